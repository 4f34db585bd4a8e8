"""Disk stores publish manifests one at a time under a lock on the checkpoint directory."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.support.checkpoint_stores import make_checkpoint, make_identity, make_tokens, open_store
from vllm_recoverssm.checkpoint.inflight import publish_lock

pytestmark = pytest.mark.lmcache


def test_a_held_publish_lock_keeps_another_out_until_released(tmp_path: Path) -> None:
    with publish_lock(tmp_path, 5.0) as first:
        assert first
        t0 = time.monotonic()
        with publish_lock(tmp_path, 0.2) as second:  # another open file description
            assert not second
        assert time.monotonic() - t0 >= 0.2
    with publish_lock(tmp_path, 0.2) as third:
        assert third
    assert list(tmp_path.iterdir()) == []  # the lock leaves no file behind


def test_publish_lock_on_a_missing_directory_is_not_held(tmp_path: Path) -> None:
    with publish_lock(tmp_path / "gone", 0.1) as held:
        assert not held


def test_a_disk_store_publishes_only_under_the_directory_lock(tmp_path: Path) -> None:
    """While another writer holds the lock, a store writes its parts but does not publish;
    once the lock is free it publishes and confirms its bundle."""
    root = tmp_path / "ckpt"
    store = open_store("disk", root, make_identity())
    reader = open_store("disk", root, make_identity(), gc_on_start=False)  # its own lock
    ck = make_checkpoint(make_tokens(40, seed=3))
    result: list[object] = []
    try:
        with publish_lock(root, 5.0) as held:
            assert held
            writer = threading.Thread(target=lambda: result.append(store.store(ck)))
            writer.start()
            writer.join(timeout=1.0)
            assert writer.is_alive(), "the store published while another writer held the lock"
            assert reader.lookup(ck.tokens) is None
        writer.join(timeout=30)
        assert not writer.is_alive()
        assert len(result) == 1 and result[0].stored  # type: ignore[attr-defined]
        hit = reader.lookup(ck.tokens)
        assert hit is not None and hit.exact and hit.checkpoint.same_as(ck)
    finally:
        store.close()
        reader.close()
