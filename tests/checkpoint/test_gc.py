"""Collecting leftovers of interrupted and lost writes: bounded, after a grace period, never a
write in flight, never a published bundle, never a name the store does not write."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.support.checkpoint_stores import (
    make_checkpoint,
    make_identity,
    make_tokens,
    manifest_file,
    open_store,
    part_files,
)
from vllm_recoverssm.checkpoint import CheckpointConfig, CheckpointStore, RequestCheckpoint
from vllm_recoverssm.checkpoint.gc import collect_garbage
from vllm_recoverssm.checkpoint.inflight import WriteMarker
from vllm_recoverssm.checkpoint.names import marker_name

pytestmark = pytest.mark.lmcache

HOUR = 3600
N = 200


def _age(paths: list[Path], seconds: float = 2 * HOUR) -> None:
    t = time.time() - seconds
    for p in paths:
        os.utime(p, (t, t), follow_symlinks=False)


def _killed_write(store: CheckpointStore, ck: RequestCheckpoint,
                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Write ``ck``'s parts and die before the manifest, leaving the parts behind."""
    with monkeypatch.context() as m:
        m.setattr(store._objects, "remove", lambda key: None)  # no clean-up: the process died

        def die(*_: object) -> str:
            raise OSError("killed")

        m.setattr(store, "_publish", die)
        assert not store.store(ck).stored


def _other_layout(ck: RequestCheckpoint) -> RequestCheckpoint:
    layers = {k: dict(v) for k, v in ck.layers.items()}
    layers["layers.0"]["extra"] = layers["layers.0"]["state"][:1].clone()
    return RequestCheckpoint(tokens=ck.tokens, layers=layers, logits=ck.logits)


def test_orphans_of_a_killed_write_are_collected_once_old_enough(
    disk_store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = disk_store.config.path
    assert root is not None
    toks = make_tokens(N)
    published = make_checkpoint(toks)
    assert disk_store.store(published).stored
    kept = part_files(root, N)
    _killed_write(disk_store, _other_layout(published), monkeypatch)  # a rewrite that died
    _killed_write(disk_store, make_checkpoint(make_tokens(90, seed=5)), monkeypatch)
    orphans = [p for p in root.iterdir() if "kind%chunk" in p.name and p not in kept]
    assert len(orphans) >= 4

    young = collect_garbage(root)
    assert young.removed == [] and young.young_parts == len(orphans)
    assert young.referenced_parts == len(kept)

    _age(orphans)
    report = collect_garbage(root)
    assert sorted(r.name for r in report.removed) == sorted(p.name for p in orphans)
    assert {r.kind for r in report.removed} == {"part"}
    assert report.removed_bytes == sum(r.nbytes for r in report.removed) > 0
    assert sorted(part_files(root, N)) == sorted(kept)
    hit = disk_store.lookup(toks)
    assert hit is not None and hit.checkpoint.same_as(published)


def test_a_write_in_flight_is_never_collected(disk_store: CheckpointStore) -> None:
    root = disk_store.config.path
    assert root is not None
    ck = make_checkpoint(make_tokens(N))
    parts_written, go_on = threading.Event(), threading.Event()
    real_publish = disk_store._publish

    def slow_publish(*args: object) -> str:
        parts_written.set()
        assert go_on.wait(60)
        return real_publish(*args)  # type: ignore[arg-type]

    disk_store._publish = slow_publish  # type: ignore[method-assign]
    results = []
    writer = threading.Thread(target=lambda: results.append(disk_store.store(ck)))
    writer.start()
    try:
        assert parts_written.wait(60)
        parts = part_files(root, N)
        _age(parts, 10 * HOUR)  # as old as any orphan: only the marker tells them apart
        report = collect_garbage(root)
        assert report.removed == [] and report.in_flight_parts == len(parts) > 0
    finally:
        go_on.set()
        writer.join(60)
    assert results and results[0].stored
    assert disk_store.lookup(ck.tokens).checkpoint.same_as(ck)  # type: ignore[union-attr]
    assert not list(root.glob("recoverssm-writing-*"))  # the marker went with the write


def test_leftover_files_and_names_the_store_does_not_write(
    disk_store: CheckpointStore, tmp_path: Path
) -> None:
    root = disk_store.config.path
    assert root is not None
    toks = make_tokens(N)
    assert disk_store.store(make_checkpoint(toks)).stored
    manifest = manifest_file(root, N)
    part = part_files(root, N)[0]
    victim = tmp_path / "victim"
    victim.write_text("keep")
    stem = part.name.removesuffix(".data")
    made = {
        "ours": root / f"{manifest.name}.0123456789abcdef.tmp",
        "legacy": root / f"{stem.replace('part%0', 'part%7')}.tmp",
        "stale marker": root / marker_name("ab" * 16),
        "probe": root / "recoverssm-probe@1@0@abc@uint8@kind%probe@ntok%1.data",
        "unknown": root / "notes.txt",
    }
    for p in made.values():
        p.write_bytes(b"x" * 10)
    fifo = root / part.name.replace("part%0", "part%9")
    os.mkfifo(fifo)
    link = root / part.name.replace("part%0", "part%8")
    os.symlink(victim, link)
    live_id = "cd" * 16
    live = WriteMarker(root, live_id)
    try:
        _age([*made.values(), fifo, link, live.path])
        report = collect_garbage(root)
    finally:
        live.release()
    removed = {r.name: r.kind for r in report.removed}
    assert removed == {
        made["ours"].name: "temporary", made["legacy"].name: "temporary",
        made["stale marker"].name: "marker", made["probe"].name: "probe",
    }
    assert (root / "notes.txt").exists() and victim.read_text() == "keep"
    assert sorted(report.left_alone) == sorted([fifo.name, link.name])
    assert fifo.exists() and link.is_symlink()
    assert disk_store.lookup(toks) is not None


def test_damaged_manifest_is_left_for_a_rewrite_and_its_parts_are_collected(
    disk_store: CheckpointStore,
) -> None:
    root = disk_store.config.path
    assert root is not None
    toks = make_tokens(N)
    assert disk_store.store(make_checkpoint(toks)).stored
    manifest = manifest_file(root, N)
    data = bytearray(manifest.read_bytes())
    data[-3] ^= 1
    manifest.write_bytes(bytes(data))
    parts = part_files(root, N)
    _age([manifest, *parts])
    report = collect_garbage(root)
    assert report.damaged_manifests == [manifest.name] and manifest.exists()
    assert sorted(r.name for r in report.removed) == sorted(p.name for p in parts)
    good = make_checkpoint(toks, seed=1)
    assert disk_store.store(good).stored
    assert disk_store.lookup(toks).checkpoint.same_as(good)  # type: ignore[union-attr]


def test_dry_run_and_scan_limit(disk_store: CheckpointStore,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    root = disk_store.config.path
    assert root is not None
    for i in range(3):
        _killed_write(disk_store, make_checkpoint(make_tokens(60 + i, seed=i)), monkeypatch)
    orphans = [p for p in root.iterdir() if "kind%chunk" in p.name]
    _age(orphans)
    dry = collect_garbage(root, dry_run=True)
    assert len(dry.removed) == len(orphans) and all(p.exists() for p in orphans)
    assert dry.summary().startswith(f"would remove {len(orphans)} part")
    limited = collect_garbage(root, max_files=2)
    assert limited.truncated and limited.scanned == 2 and len(limited.removed) <= 2
    rest = collect_garbage(root)
    assert len(limited.removed) + len(rest.removed) == len(orphans) and not rest.truncated


def test_store_start_up_collects_old_orphans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    first = open_store("disk", root, make_identity())
    try:
        _killed_write(first, make_checkpoint(make_tokens(N)), monkeypatch)
    finally:
        first.close()
    orphans = part_files(root, N)
    assert orphans
    off = open_store("disk", root, make_identity(), gc_on_start=False)
    off.close()
    assert off.startup_gc is None and all(p.exists() for p in orphans)
    _age(orphans)
    with caplog.at_level(logging.INFO, logger="vllm_recoverssm.checkpoint"):
        second = open_store("disk", root, make_identity())
    second.close()
    assert second.startup_gc is not None
    assert sorted(r.name for r in second.startup_gc.removed) == sorted(p.name for p in orphans)
    assert not any(p.exists() for p in orphans)
    assert "checkpoint clean-up" in caplog.text


def test_grace_period_has_a_floor(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="grace"):
        collect_garbage(tmp_path, grace_s=5)
    with pytest.raises(ValidationError, match="gc_grace_s"):
        CheckpointConfig(backend="disk", path=tmp_path, gc_grace_s=5)
    with pytest.raises(ValidationError, match="must exceed timeout_s"):
        CheckpointConfig(backend="disk", path=tmp_path, gc_grace_s=100, timeout_s=100)
