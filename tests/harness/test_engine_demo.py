"""``recoverssm demo --engine vllm``: the command a user runs, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engine import REPO, environment
from vllm_recoverssm.harness.engine_demo import corruption_for


@pytest.mark.parametrize("num_spec", [1, 3, 7])
def test_corruption_rate_reaches_the_asked_acceptance(num_spec: int) -> None:
    for target in (0.0, 0.25, 0.5, 0.9, 1.0):
        q = corruption_for(target, num_spec)
        share = sum((1 - q) ** k for k in range(1, num_spec + 1)) / num_spec
        assert abs(share - target) < 1e-6 and 0.0 <= q <= 1.0


@pytest.mark.slow
def test_demo_engine_vllm_serves_both_modes_and_restores_wave_two_from_disk(
    tmp_path: Path,
) -> None:
    """The main table (both modes, allocation) and the disk checkpoint table: wave 2 runs
    in fresh engine processes that restore every follow-up turn from the store."""
    store = tmp_path / "store"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_recoverssm.cli.main", "demo", "--engine", "vllm",
         "--requests", "3", "--max-new-tokens", "8", "--num-spec", "2", "--json",
         "--checkpoint", "disk", "--checkpoint-dir", str(store)],
        cwd=REPO, env=environment(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["engine"] == "vllm" and report["outputs_identical"]
    assert report["bytes_match_planner"]
    rec, full = report["modes"]["recovery"], report["modes"]["full_state"]
    assert rec["recovery"] and not full["recovery"]
    # recovery commits inside the next verify (the demo's default), full states do not
    assert report["commit"].startswith("fused into the next verify"), report["commit"]
    assert rec["deferred_commit_steps"] > 0 and full["deferred_commit_steps"] == 0
    assert report["scratch_rows"] == 2 * report["options"]["max_num_seqs"]
    assert rec["kv"]["blocks_per_request"] == 1 and full["kv"]["blocks_per_request"] == 3
    assert rec["kv"]["num_blocks"] == full["kv"]["num_blocks"]
    assert "demo: engine recovery" in proc.stderr  # progress lines
    lengths = report["prompt_lengths"]
    for mode in ("recovery", "full_state"):
        wave2 = report["checkpoints"][mode]
        assert wave2["outputs_identical"] and wave2["exports_flushed"], wave2
        # each follow-up restores its first turn's response bundle: prompt + answer - 1
        assert wave2["restored_per_request"] == [n + 8 - 1 for n in lengths]
        assert wave2["computed_restored"] == wave2["prompt_tokens"] - sum(
            wave2["restored_per_request"]) < wave2["computed_cold"]
    # the recovery engines with the connector fuse the commit too, and commit each finished
    # request's last records before exporting it
    rec2, full2 = report["checkpoints"]["recovery"], report["checkpoints"]["full_state"]
    assert rec2["fused_steps"] > 0 and rec2["export_settles"] > 0
    assert full2["fused_steps"] == full2["export_settles"] == 0
    assert any(store.rglob("*")), "the disk store stays where --checkpoint-dir named"


def test_demo_checkpoint_dir_needs_the_disk_backend(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_recoverssm.cli.main", "demo", "--engine", "vllm",
         "--checkpoint", "ram", "--checkpoint-dir", str(tmp_path)], cwd=REPO,
        env=environment(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "--checkpoint-dir" in line and "only --checkpoint disk" in line


def test_demo_engine_vllm_rejects_bad_numbers() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_recoverssm.cli.main", "demo", "--engine", "vllm",
         "--requests", "100"], cwd=REPO, env=environment(), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "argument --requests" in line and "less than or equal to 64" in line
