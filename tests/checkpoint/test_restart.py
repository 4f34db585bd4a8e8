"""Bundles written by one process are restored by a fresh one; a crash mid-write leaves none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import checkpoint_restart_worker
from tests.support.checkpoint_stores import CRASH_PROMPT, make_identity, open_store

pytestmark = pytest.mark.lmcache

WORKER = Path(checkpoint_restart_worker.__file__)


def run_worker(action: str, root: Path) -> subprocess.CompletedProcess[str]:
    """Run the worker in a new interpreter (nothing shared with this process)."""
    env = dict(os.environ, PYTHONHASHSEED="random")
    return subprocess.run(
        [sys.executable, str(WORKER), action, str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )


def test_store_in_one_process_restore_in_a_fresh_one(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    stored = run_worker("store", root)
    assert stored.returncode == 0 and "stored" in stored.stdout, stored.stderr
    restored = run_worker("check", root)
    assert restored.returncode == 0 and "restored" in restored.stdout, restored.stderr


def test_a_process_dying_midway_through_a_write_leaves_nothing_visible(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    died = run_worker("crash", root)
    assert died.returncode == 17, died.stderr
    leftovers = [p.name for p in root.iterdir()]
    assert any("kind%chunk@ntok%400@" in n for n in leftovers)  # parts were written ...
    assert not any("kind%manifest" in n for n in leftovers)  # ... but never published
    store = open_store("disk", root, make_identity())
    try:
        assert store.lookup(CRASH_PROMPT) is None and store.stats.rejected == 0
    finally:
        store.close()
