"""A checkpoint directory someone else can write: planted links, FIFOs, directories, huge files.

The store never writes through a link, never opens anything but a regular file, never
allocates what a file's header claims before checking it against the file, and a lookup never
waits on (or leaves a thread waiting on) a FIFO.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.checkpoint_stores import make_checkpoint, make_tokens, object_path, part_files
from vllm_recoverssm.checkpoint import CheckpointStore, prefix_digest
from vllm_recoverssm.checkpoint import files as files_module

pytestmark = pytest.mark.lmcache

SHORT, LONG = 12, 300
PRECIOUS = b"the server must never overwrite this file\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the checkpoint directory that a planted link points at."""
    path = tmp_path / "victim"
    path.write_bytes(PRECIOUS)
    return path


def _manifest_path(store: CheckpointStore, tokens: tuple[int, ...]) -> Path:
    return object_path(store, store._manifest_key(len(tokens), prefix_digest(tokens)))


def test_symlink_planted_at_the_temporary_name_is_not_written_through(
    disk_store: CheckpointStore, victim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = make_checkpoint(make_tokens(40))
    final = _manifest_path(disk_store, ck.tokens)
    root = final.parent
    # LMCache's own fs connector would write the manifest to this predictable name
    legacy = final.with_suffix(".tmp")
    os.symlink(victim, legacy)
    # and if an attacker could guess our name: make the first name drawn a planted link
    real = files_module.temp_name
    planted: list[Path] = []

    def temp_name(final_name: str) -> str:
        name = real(final_name)
        if final_name == final.name and not planted:
            planted.append(root / name)
            os.symlink(victim, root / name)
        return name

    monkeypatch.setattr(files_module, "temp_name", temp_name)
    assert disk_store.store(ck).stored
    assert victim.read_bytes() == PRECIOUS
    assert planted and planted[0].is_symlink() and legacy.is_symlink()  # left as they were
    assert final.is_file() and not final.is_symlink()
    hit = disk_store.lookup(ck.tokens)
    assert hit is not None and hit.checkpoint.same_as(ck)


def test_symlink_at_a_final_name_is_neither_read_nor_followed(
    disk_store: CheckpointStore, victim: Path, caplog: pytest.LogCaptureFixture
) -> None:
    toks = make_tokens(LONG)
    assert disk_store.store(make_checkpoint(toks[:SHORT])).stored
    final = _manifest_path(disk_store, toks)
    os.symlink(victim, final)  # a "manifest" that is a link to a file the server can read
    with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
        hit = disk_store.lookup(toks)
    assert hit is not None and hit.num_tokens == SHORT
    assert "not a regular file" in caplog.text
    ck = make_checkpoint(toks)
    assert disk_store.store(ck).stored  # the rename replaces the link itself
    assert victim.read_bytes() == PRECIOUS and not final.is_symlink()
    assert disk_store.lookup(toks).checkpoint.same_as(ck)  # type: ignore[union-attr]


def test_fifo_in_the_directory_is_never_opened(
    disk_store: CheckpointStore, caplog: pytest.LogCaptureFixture
) -> None:
    toks = make_tokens(LONG)
    short = make_checkpoint(toks[:SHORT])
    assert disk_store.store(short).stored
    assert disk_store.store(make_checkpoint(toks)).stored
    assert disk_store.config.path is not None
    part = part_files(disk_store.config.path, LONG)[1]
    part.unlink()
    os.mkfifo(part)  # a part that would block any reader that opens it
    os.mkfifo(_manifest_path(disk_store, toks[:200]))  # and a manifest
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
        hit = disk_store.lookup(toks)
    assert time.monotonic() - t0 < 10  # LMCache's own reader waits its 30 s timeout per FIFO
    assert hit is not None and hit.num_tokens == SHORT and hit.checkpoint.same_as(short)
    assert "part 1 of" in caplog.text and "not a regular file" in caplog.text


def test_directory_and_huge_sparse_file_under_object_names(
    disk_store: CheckpointStore, caplog: pytest.LogCaptureFixture
) -> None:
    toks = make_tokens(LONG)
    short = make_checkpoint(toks[:SHORT])
    assert disk_store.store(short).stored
    assert disk_store.store(make_checkpoint(toks)).stored
    assert disk_store.config.path is not None
    with open(part_files(disk_store.config.path, LONG)[0], "r+b") as f:
        f.truncate(2**40)  # sparse: a 1 TiB "part" whose header still says a few KiB
    blocked = make_checkpoint(toks[:100])
    _manifest_path(disk_store, blocked.tokens).mkdir()
    with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
        hit = disk_store.lookup(toks)
        result = disk_store.store(blocked)  # cannot rename onto a directory: not stored
    assert hit is not None and hit.num_tokens == SHORT
    assert not result.stored and result.reason.startswith("write failed")
    assert disk_store.lookup(blocked.tokens).num_tokens == SHORT  # type: ignore[union-attr]


EXIT_CHILD = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from tests.support.checkpoint_stores import (
    make_checkpoint, make_identity, make_tokens, part_files)
from vllm_recoverssm.checkpoint import CheckpointConfig, CheckpointStore
root = Path({root!r})
store = CheckpointStore(CheckpointConfig(backend="disk", path=root, ram_bytes=2**24,
                                         chunk_bytes=4096, timeout_s=5), make_identity())
toks = make_tokens(300)
assert store.store(make_checkpoint(toks)).stored
for part in part_files(root, 300):
    part.unlink()
    os.mkfifo(part)
t0 = time.monotonic()
print("hit" if store.lookup(toks) else "miss", round(time.monotonic() - t0, 1), flush=True)
"""


def test_a_lookup_that_meets_fifos_never_blocks_process_exit(tmp_path: Path) -> None:
    code = EXIT_CHILD.format(tests=str(Path(__file__).resolve().parents[2]),
                             root=str(tmp_path / "ckpt"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    verdict, seconds = out.stdout.split()
    assert verdict == "miss" and float(seconds) < 5


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/null"])
def test_a_manifest_replaced_by_a_link_to_a_device_warns_and_counts_rejected(
    disk_store: CheckpointStore, target: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Like every other bad manifest: a warning naming why, one more rejected bundle."""
    toks = make_tokens(SHORT)
    assert disk_store.store(make_checkpoint(toks)).stored
    manifest = _manifest_path(disk_store, toks)
    manifest.unlink()
    os.symlink(target, manifest)
    with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
        assert disk_store.lookup(toks) is None
    assert disk_store.stats.rejected == 1
    assert "manifest is not a regular file" in caplog.text
