"""``recoverssm checkpoints gc DIR``: reports what it removed, keeps what is published."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.support.checkpoint_stores import (
    make_checkpoint,
    make_identity,
    make_tokens,
    open_store,
    part_files,
)
from vllm_recoverssm.cli.main import main

pytestmark = pytest.mark.lmcache


@pytest.fixture
def directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[Path]]:
    """A directory with one published bundle and the aged parts of a write that died."""
    root = tmp_path / "ckpt"
    store = open_store("disk", root, make_identity())
    try:
        assert store.store(make_checkpoint(make_tokens(50))).stored
        with monkeypatch.context() as m:
            m.setattr(store._objects, "remove", lambda key: None)

            def die(*_: object) -> str:
                raise OSError("killed")

            m.setattr(store, "_publish", die)
            assert not store.store(make_checkpoint(make_tokens(120, seed=2))).stored
    finally:
        store.close()
    orphans = part_files(root, 120)
    old = time.time() - 7200
    for p in orphans:
        os.utime(p, (old, old))
    return root, orphans


def test_gc_lists_what_it_removes(directory: tuple[Path, list[Path]],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    root, orphans = directory
    assert main(["checkpoints", "gc", str(root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert all(p.exists() for p in orphans)
    assert out.count("would remove part ") == len(orphans)
    assert main(["checkpoints", "gc", str(root)]) == 0
    out = capsys.readouterr().out
    for p in orphans:
        assert f"removed part {p.name}" in out and not p.exists()
    assert f"removed {len(orphans)} part" in out.splitlines()[-1]
    assert part_files(root, 50)  # the published bundle is kept
    store = open_store("disk", root, make_identity(), gc_on_start=False)
    try:
        assert store.lookup(make_tokens(50)) is not None
    finally:
        store.close()


def test_gc_json_and_grace(directory: tuple[Path, list[Path]],
                           capsys: pytest.CaptureFixture[str]) -> None:
    root, orphans = directory
    assert main(["checkpoints", "gc", str(root), "--grace", "86400", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["removed"] == [] and report["young_parts"] == len(orphans)
    assert main(["checkpoints", "gc", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(r["name"] for r in report["removed"]) == sorted(p.name for p in orphans)
    assert report["removed_bytes"] > 0 and report["referenced_parts"] == len(part_files(root, 50))


def test_gc_of_a_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["checkpoints", "gc", str(f)]) == 2
    err = capsys.readouterr().err
    assert "argument DIR" in err and "not a directory" in err and err.count("\n") == 1
