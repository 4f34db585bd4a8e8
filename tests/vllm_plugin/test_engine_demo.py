"""``recoverssm demo --engine vllm``: the command a user runs, end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_recoverssm.vllm_plugin.engine_demo import corruption_for

from .engine import REPO, environment


@pytest.mark.parametrize("num_spec", [1, 3, 7])
def test_corruption_rate_reaches_the_asked_acceptance(num_spec: int) -> None:
    for target in (0.0, 0.25, 0.5, 0.9, 1.0):
        q = corruption_for(target, num_spec)
        share = sum((1 - q) ** k for k in range(1, num_spec + 1)) / num_spec
        assert abs(share - target) < 1e-6 and 0.0 <= q <= 1.0


def test_demo_engine_vllm_serves_both_modes_with_the_same_tokens() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_recoverssm.cli.main", "demo", "--engine", "vllm",
         "--requests", "3", "--max-new-tokens", "8", "--num-spec", "2", "--json"],
        cwd=REPO, env=environment(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["engine"] == "vllm" and report["outputs_identical"]
    assert report["bytes_match_planner"]
    rec, full = report["modes"]["recovery"], report["modes"]["full_state"]
    assert rec["recovery"] and not full["recovery"]
    assert rec["kv"]["blocks_per_request"] == 1 and full["kv"]["blocks_per_request"] == 3
    assert rec["kv"]["num_blocks"] == full["kv"]["num_blocks"]
    assert "demo: engine recovery" in proc.stderr  # progress lines


def test_demo_engine_vllm_rejects_bad_numbers() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_recoverssm.cli.main", "demo", "--engine", "vllm",
         "--requests", "100"], cwd=REPO, env=environment(), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "argument --requests" in line and "less than or equal to 64" in line
