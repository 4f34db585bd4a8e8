"""vLLM's real engine on the CPU: recovery and full states give the same greedy tokens.

Every test runs vLLM's ``LLM`` (in a process of its own) on the tiny all-KDA GLM-5.3 with
seeded random weights, forcing recovery on (``additional_config={"recoverssm": "on"}``)
and off, and compares the outputs token for token. The drafts come from the oracle
drafter (:mod:`vllm_recoverssm.harness.oracle_drafter`), which drafts the model's
own continuation with a chosen share of wrong tokens, so each test sets its acceptance.
Batches mix prompt chunks (32-token chunked prefill) and verify rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engine import (
    CHUNKED,
    MAX_TOKENS,
    ColdRun,
    Pair,
    oracle_file,
    prompts,
    run_engine,
    run_pair,
    tiny_layer_page,
)
from vllm_recoverssm.harness.run_engine import EngineRun
from vllm_recoverssm.harness.tiny_model import write_tiny_dflash

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model(cold_run: ColdRun) -> str:
    return cold_run.model


@pytest.fixture(scope="module")
def workdir(cold_run: ColdRun) -> Path:
    return cold_run.workdir


@pytest.fixture(scope="module")
def continuations(cold_run: ColdRun) -> list[list[int]]:
    """The model's greedy continuations: full states, every draft wrong (no oracle)."""
    assert cold_run.report.accepted_tokens == 0 and cold_run.report.draft_tokens > 0
    return cold_run.continuations


def assert_same_tokens(pair: Pair, same_schedule: bool = True) -> None:
    assert pair.on.recovery and not pair.off.recovery
    assert pair.on.outputs == pair.off.outputs
    assert all(len(o) == MAX_TOKENS for o in pair.on.outputs)
    if same_schedule:  # the same drafts were verified in both modes
        assert (pair.on.draft_tokens, pair.on.accepted_tokens) == (
            pair.off.draft_tokens, pair.off.accepted_tokens)


def check_decisions(pair: Pair) -> None:
    for report in (pair.on, pair.off):
        # the decision is logged once, with its reason
        assert len(report.decision) == 1, report.decision
    assert "recovery: on [mode on]" in pair.on.decision[0]
    assert "one checkpoint per request and layer" in pair.on.decision[0]
    assert "recovery: off" in pair.off.decision[0]


def test_no_draft_accepted_recovery_matches_full_state(cold_run: ColdRun) -> None:
    """~0% acceptance: every window falls back to its first token (drafts all wrong)."""
    pair = Pair(on=run_engine(EngineRun(mode="on", **cold_run.spec), cold_run.workdir),
                off=cold_run.report)
    assert_same_tokens(pair)
    assert pair.on.accepted_tokens == 0
    check_decisions(pair)


@pytest.mark.parametrize("num_spec, corrupt, low, high", [
    (1, 0.0, 0.9, 1.0),    # ~100% acceptance, the smallest window
    (3, 0.3, 0.25, 0.75),  # ~50%: windows cut at every position
    # ~100% with the widest window (8 tokens)
    (7, 0.0, 0.9, 1.0),
], ids=["S1-all", "S3-half", "S7-all"])
def test_recovery_matches_full_state_token_for_token(
    model: str, workdir: Path, continuations: list[list[int]], num_spec: int,
    corrupt: float, low: float, high: float,
) -> None:
    p = prompts()
    oracle = oracle_file(workdir / f"oracle-{num_spec}-{corrupt}.json", p, continuations,
                         corrupt)
    pair = run_pair(workdir, model=model, num_spec=num_spec, oracle=oracle, prompts=p,
                    max_tokens=MAX_TOKENS, engine=CHUNKED)
    assert_same_tokens(pair)
    assert pair.on.outputs == continuations
    assert low <= pair.on.acceptance <= high, pair.on.acceptance
    check_decisions(pair)


def test_dflash_drafts_recovery_matches_full_state(cold_run: ColdRun) -> None:
    """vLLM's own DFlash drafter (a tiny Qwen3 DFlash draft reading the target's hidden
    states; random weights, so its drafts are rarely right) in both modes."""
    draft = write_tiny_dflash(cold_run.workdir / "tiny-dflash")
    spec = {**cold_run.spec, "drafter": "dflash", "draft_model": str(draft)}
    pair = run_pair(cold_run.workdir, **spec)
    assert_same_tokens(pair)
    assert pair.on.draft_tokens > 0
    check_decisions(pair)


def test_preemption_under_a_tiny_cache_budget_and_the_state_blocks_vllm_allocates(
    model: str, workdir: Path, continuations: list[list[int]],
) -> None:
    """Room for two full-state requests; every running request preempted once."""
    num_spec = 3
    blocks = 2 * (num_spec + 1) + 1  # vLLM keeps block 0 as its null block
    layer_page = tiny_layer_page(num_spec)
    budget = blocks * 3 * layer_page  # three KDA layers
    p = prompts()
    oracle = oracle_file(workdir / "oracle-preempt.json", p, continuations, 0.0)
    pair = run_pair(workdir, model=model, num_spec=num_spec, oracle=oracle, prompts=p,
                    max_tokens=MAX_TOKENS, preempt_after_steps=6,
                    engine={**CHUNKED, "kv_cache_memory_bytes": budget})
    # full states fit two requests at a time, recovery all four rows: other schedules
    assert_same_tokens(pair, same_schedule=False)
    assert pair.on.preemptions > 0 and pair.off.preemptions > 0
    on, off = pair.on.kv, pair.off.kv
    # the same bytes give the same blocks; a request holds 1 of them instead of S+1
    assert on.num_blocks == off.num_blocks == blocks
    assert on.bytes_per_block == off.bytes_per_block == 3 * layer_page
    assert (on.blocks_per_request, off.blocks_per_request) == (1, num_spec + 1)
    assert off.state_bytes_per_request == (num_spec + 1) * on.state_bytes_per_request
    assert on.max_concurrency == (num_spec + 1) * off.max_concurrency == blocks
    # the record scratch: per layer, two halves (the default commit is fused here) of
    # max_num_seqs rows of S+1 FP32 corrections and bf16 k|g
    assert pair.on.deferred_commit_steps > 0
    rows = 2 * CHUNKED["max_num_seqs"]
    assert on.scratch_bytes == 3 * rows * 4 * (num_spec + 1) * 128 * (4 + 2 * 2)
    assert off.scratch_bytes == 0


def test_forced_recovery_with_prefix_caching_under_runner_v1_fails_at_startup(
    model: str, workdir: Path,
) -> None:
    """vLLM's CPU engine runs model runner V1, which cannot move align-mode state blocks
    after a commit: forcing recovery with prefix caching is refused, naming why."""
    spec = EngineRun(model=model, mode="on", num_spec=3, prompts=prompts()[:1],
                     max_tokens=4, engine={**CHUNKED, "enable_prefix_caching": True})
    with pytest.raises(RuntimeError) as info:
        run_engine(spec, workdir)
    text = str(info.value)
    assert "IneligibleError" in text and "model_runner" in text
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in text
