"""vLLM's real engine on the CPU with the commit fused into the next verify.

The plugin's default commit (``recoverssm_commit`` ``auto``), like ``fused``, defers each
step's commit into the request's next verify wherever nothing blocks it. The greedy tokens
must be those of full speculative states, through steps that mix prompt chunks with verify
rows, requests that end, and requests that vLLM preempts (whose pending records are
committed on their own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from tests.support.engine import CHUNKED, MAX_TOKENS, ColdRun, oracle_file, prompts, run_engine
from vllm_recoverssm.harness.run_engine import EngineReport, EngineRun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def run_fused(cold_run: ColdRun, num_spec: int, corrupt: float, name: str,
              preempt_after_steps: int | None = None,
              commit: Literal["fused"] | None = "fused") -> EngineReport:
    p = prompts()
    oracle = oracle_file(cold_run.workdir / f"oracle-fused-{name}.json", p,
                         cold_run.continuations, corrupt)
    spec = EngineRun(model=cold_run.model, mode="on", commit=commit, num_spec=num_spec,
                     oracle=oracle, prompts=p, max_tokens=MAX_TOKENS, engine=CHUNKED,
                     preempt_after_steps=preempt_after_steps)
    return run_engine(spec, cold_run.workdir)


def assert_fused(report: EngineReport, num_spec: int) -> None:
    assert report.recovery
    assert any("fused into the next verify" in line for line in report.commit_lines), \
        report.commit_lines
    # every step with verify rows deferred its commit; steps where every deferred request
    # was verified again skipped the standalone commit, the others (requests that ended,
    # or were preempted) ran it
    assert report.deferred_commit_steps > 0
    assert report.settles_skipped > 0 and report.settles > 0
    assert report.settles + report.settles_skipped <= report.deferred_commit_steps
    # two scratch halves: 2 * max_num_seqs rows of S+1 FP32 corrections and bf16 k|g
    rows = 2 * CHUNKED["max_num_seqs"]
    assert report.kv.scratch_bytes == 3 * rows * 4 * (num_spec + 1) * 128 * (4 + 2 * 2)


@pytest.mark.parametrize("num_spec, corrupt, preempt, commit",
                         [(3, 0.3, None, None), (7, 0.0, 6, "fused")],
                         ids=["S3-half-default", "S7-all-preempted-fused"])
def test_fused_commit_matches_full_state_token_for_token(
    cold_run: ColdRun, num_spec: int, corrupt: float, preempt: int | None,
    commit: Literal["fused"] | None,
) -> None:
    """S = 3 at ~50% acceptance with the default commit, and S = 7 at ~100% with
    ``fused`` and every running request preempted once after 6 steps: the pending records
    of a request that leaves the batch are committed on their own, and its recompute
    starts clean."""
    report = run_fused(cold_run, num_spec, corrupt, f"{num_spec}-{corrupt}", preempt, commit)
    assert report.outputs == cold_run.continuations
    assert report.accepted_tokens > 0
    if preempt is not None:
        assert report.preemptions > 0
    assert_fused(report, num_spec)


def test_an_unknown_commit_mode_fails_at_startup(cold_run: ColdRun, tmp_path: Path) -> None:
    spec = EngineRun(model=cold_run.model, mode="on", num_spec=3, prompts=prompts()[:1],
                     max_tokens=4, engine={**CHUNKED, "additional_config": {
                         "recoverssm": "on", "recoverssm_commit": "lazy"}})
    with pytest.raises(RuntimeError) as info:
        run_engine(spec, tmp_path)
    assert ("additional_config['recoverssm_commit']: expected one of auto, eager, fused, "
            "got 'lazy'") in str(info.value)
