"""Two processes storing the same prefixes into one directory (two replicas on a shared disk).

Every store that reports success (or that another writer's bundle already covers) must be
readable afterwards, byte for byte; the writer that loses a race cleans up after itself, so
no orphan is left for the collector.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import checkpoint_race_worker
from tests.support.checkpoint_stores import RACE_PROMPTS, make_checkpoint, make_identity, open_store
from vllm_recoverssm.checkpoint.gc import collect_garbage

pytestmark = pytest.mark.lmcache

WORKER = Path(checkpoint_race_worker.__file__)
WRITERS = 3


@pytest.mark.slow
def test_two_processes_racing_on_the_same_prefixes_lose_no_acknowledged_write(
    tmp_path: Path,
) -> None:
    root, go = tmp_path / "ckpt", tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(root), str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(WRITERS)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
        go.write_text("go")  # both are past start-up: they now race on every prefix
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    store = open_store("disk", root, make_identity(), gc_on_start=False)
    try:
        for i, prompt in enumerate(RACE_PROMPTS):
            acknowledged = [res[i] for res in results if res[i][1] or res[i][2] == "exists"]
            assert acknowledged, f"prompt {i}: neither writer stored it"
            hit = store.lookup(prompt)
            assert hit is not None and hit.exact, f"prompt {i}: acknowledged but not readable"
            assert hit.checkpoint.same_as(make_checkpoint(prompt))
    finally:
        store.close()
    reasons = {r[2] for res in results for r in res}
    assert reasons <= {"stored", "exists"}, reasons  # nobody failed on another's temp file
    # Writers publish one at a time under the directory's lock, so every loser sees the
    # winner's bundle and removes its own parts: nothing is left for the collector, and
    # every bundle stays readable after a collection.
    later = time.time() + 2 * 3600
    report = collect_garbage(root, dry_run=True, now=later)
    assert not report.removed, report.summary()
    collect_garbage(root, now=later)
    store = open_store("disk", root, make_identity(), gc_on_start=False)
    try:
        assert all(store.lookup(p) is not None for p in RACE_PROMPTS)
        assert store.stats.rejected == 0
    finally:
        store.close()
    leftovers = [p.name for p in root.iterdir() if not p.name.endswith(".data")]
    assert leftovers == [], leftovers
