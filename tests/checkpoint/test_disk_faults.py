"""Damaged bundles on disk are detected and treated as a miss with a warning, never restored.

Each test stores a short bundle and a longer one that extends it, damages the longer one's
files the way a crash, a bad disk or a stray copy would, and checks that the lookup falls back
to the short bundle (the longest *valid* prefix) and logs why.
"""

from __future__ import annotations

import logging
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.checkpoint_stores import (
    HEADER,
    flip_bit,
    make_checkpoint,
    make_identity,
    make_tokens,
    manifest_file,
    open_store,
    part_files,
)
from vllm_recoverssm.checkpoint import CheckpointStore, RequestCheckpoint

pytestmark = pytest.mark.lmcache

SHORT, LONG = 12, 300


@pytest.fixture
def stored(disk_store: CheckpointStore) -> tuple[CheckpointStore, RequestCheckpoint, Path]:
    """A disk store holding a SHORT-token bundle and a LONG-token bundle extending it."""
    toks = make_tokens(LONG)
    short = make_checkpoint(toks[:SHORT])
    assert disk_store.store(short).stored
    assert disk_store.store(make_checkpoint(toks)).stored
    assert disk_store.config.path is not None
    assert len(part_files(disk_store.config.path, LONG)) >= 4
    return disk_store, short, disk_store.config.path


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


DAMAGE: dict[str, tuple[Callable[[Path], object], str]] = {
    "truncated part": (
        lambda root: _truncate(part_files(root, LONG)[1], HEADER + 100),
        "part 1 of .* missing or unreadable",
    ),
    "truncated manifest": (
        lambda root: _truncate(manifest_file(root, LONG), HEADER + 60),
        "manifest is listed but cannot be read",
    ),
    "bit flip in a part": (
        lambda root: flip_bit(part_files(root, LONG)[2], HEADER + 1000),
        "part 2: checksum mismatch",
    ),
    "bit flip in the last part": (
        lambda root: flip_bit(part_files(root, LONG)[-1], -1),
        "checksum mismatch",
    ),
    "bit flip in the manifest": (
        lambda root: flip_bit(manifest_file(root, LONG), HEADER + 120),
        "manifest checksum mismatch",
    ),
    "missing part": (
        lambda root: part_files(root, LONG)[0].unlink(),
        "part 0 of .* missing or unreadable",
    ),
    "part header claims 1 GiB": (
        # a damaged LMCache header must not make the reader wait for memory forever
        lambda root: _set_header_dim(part_files(root, LONG)[0], 2**30),
        "part 0 of .* missing or unreadable",
    ),
    "part from another bundle": (
        lambda root: shutil.copyfile(part_files(root, SHORT)[0], part_files(root, LONG)[0]),
        "part 0: .*bytes",
    ),
}


def _set_header_dim(path: Path, value: int) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into("<i", data, HEADER - 4, value)  # last shape dimension
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_bundle_is_a_miss_with_a_warning(
    stored: tuple[CheckpointStore, RequestCheckpoint, Path],
    damage: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, short, root = stored
    damage_fn, message = DAMAGE[damage]
    damage_fn(root)
    with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
        hit = store.lookup(make_tokens(LONG))
    assert hit is not None and hit.num_tokens == SHORT and hit.checkpoint.same_as(short)
    assert store.stats.rejected == 1
    assert re.search(message, caplog.text), caplog.text
    assert f"{LONG}-token prefix ignored" in caplog.text


def test_a_fresh_store_of_the_damaged_prefix_repairs_it(
    stored: tuple[CheckpointStore, RequestCheckpoint, Path],
) -> None:
    store, _, root = stored
    flip_bit(part_files(root, LONG)[1], HEADER + 5)
    assert store.lookup(make_tokens(LONG)).num_tokens == SHORT  # type: ignore[union-attr]
    good = make_checkpoint(make_tokens(LONG))
    assert store.store(good).stored  # the rejected bundle is replaced, not kept
    assert store.lookup(make_tokens(LONG)).checkpoint.same_as(good)  # type: ignore[union-attr]
    # the damaged bundle's parts went with it: every part file left is the new bundle's
    bundles = {re.search(r"bundle%([0-9a-f]+)", p.name).group(1) for p in part_files(root, LONG)}  # type: ignore[union-attr]
    assert len(bundles) == 1


def test_bundle_of_another_layout_under_this_layouts_name_is_refused(
    stored: tuple[CheckpointStore, RequestCheckpoint, Path], caplog: pytest.LogCaptureFixture
) -> None:
    store, short, root = stored
    other = make_identity(mode="full_state")
    # a stray copy: the recovery-mode bundle's files renamed to the full-state names
    mine, theirs = store.identity.digest()[:32], other.digest()[:32]
    for path in [manifest_file(root, LONG), *part_files(root, LONG)]:
        shutil.copyfile(path, root / path.name.replace(mine, theirs))
    reader = open_store("disk", root, other)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
            assert reader.lookup(make_tokens(LONG)) is None
        assert "another layout" in caplog.text and reader.stats.rejected == 1
    finally:
        reader.close()
    assert store.lookup(make_tokens(LONG)).num_tokens == LONG  # type: ignore[union-attr]


def test_manifest_moved_to_another_prefix_is_refused(
    stored: tuple[CheckpointStore, RequestCheckpoint, Path], caplog: pytest.LogCaptureFixture
) -> None:
    store, _, root = stored
    src = manifest_file(root, LONG)
    # same 300 tokens but the last one changed: its key names a different prefix
    toks = make_tokens(LONG)
    other = toks[:-1] + ((toks[-1] + 1) % 50_000,)
    store.store(make_checkpoint(other))
    shutil.copyfile(src, _manifest_for(root, other, exclude=src))
    with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
        hit = store.lookup(other)
    assert hit is not None and hit.num_tokens == SHORT
    assert "another token prefix" in caplog.text


def _manifest_for(root: Path, toks: tuple[int, ...], exclude: Path) -> Path:
    (path,) = [
        p
        for p in root.glob("*.data")
        if f"kind%manifest@ntok%{len(toks)}." in p.name and p != exclude
    ]
    return path
