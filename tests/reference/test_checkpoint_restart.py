"""A runtime restores, from disk, bundles that another process's runtime exported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import reference_restart_worker as worker

pytestmark = pytest.mark.lmcache

WORKER = Path(worker.__file__)


def run_worker(*args: str) -> dict[str, dict]:
    """Run the worker in a new interpreter (nothing shared with this process)."""
    env = dict(os.environ, PYTHONHASHSEED="random")
    done = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True,
                          env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_restart_restores_prompt_and_response_bundles_in_both_modes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    first = run_worker("store", str(root))
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({m: r["outputs"] for m, r in first.items()}))
    second = run_worker("restore", str(root), str(answers))
    prompts = worker.wave1()
    for mode in worker.MODES:
        assert first[mode]["exported"] == 2 * len(prompts)
        assert first[mode]["external_hits"] == 0
        wave2 = worker.wave2({mode: first[mode]["outputs"]}, mode)
        with worker.runtime(mode, None) as cold_rt:
            cold = worker.serve(cold_rt, wave2)
        got = second[mode]
        assert got["outputs"] == cold["outputs"], mode
        ans = first[mode]["outputs"]
        assert got["restored"] == [len(p) + len(a) - 1 for p, a in zip(prompts, ans, strict=True)
                                   ] + [len(p) for p in prompts]
        assert got["external_hits"] == len(wave2) and got["rejected"] == 0
        # only the tails: the last answer token and the new text of each follow-up turn
        assert got["prefill_tokens"] == len(prompts) * (1 + len(worker.NEW_TEXT))
