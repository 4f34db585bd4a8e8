"""vLLM's real engine under model runner V2 on the CPU: the runner a CUDA GPU picks.

On a GPU, vLLM 0.32 and 0.33 run hybrid models with runner V2, whose model state commits
recovery after sampling (``worker/model_state.py``), and turn prefix caching on in align
mode. The other engine tests run vLLM's CPU default, runner V1. Here the same engine runs
V2 (:mod:`vllm_recoverssm.harness.runner_v2` says how: Triton's interpreter, and the
oracle drafting in place of
V2's n-gram speculator), and the greedy tokens must be those of a cold full-state run:

* without prefix caching: the default commit (fused into the next verify) at S = 3
  (~50% acceptance), ``fused`` at S = 7 (every draft right) with every running request
  preempted once, and ``eager`` at S = 3; and vLLM's DFlash drafter, V2's own;
* with vLLM's asynchronous scheduling, its GPU default with MTP drafting: the default
  commit at S = 7 with preemption.

Prefix caching in align mode under runner V2 has a module of its own,
``test_runner_v2_align.py``: its engines take as long as these, and pytest-xdist hands
whole modules to its workers.
"""

from __future__ import annotations

from typing import Literal

import pytest

from tests.support.engine import (
    CHUNKED,
    FUSED_LINE,
    MAX_TOKENS,
    ColdRun,
    oracle_file,
    prompts,
    run_v2,
)
from vllm_recoverssm.harness.run_engine import EngineRun
from vllm_recoverssm.harness.tiny_model import write_tiny_dflash

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("num_spec, corrupt, preempt, commit, asynchronous", [
    (3, 0.3, None, None, False), (7, 0.0, 6, "fused", False), (3, 0.3, None, "eager", False),
    (7, 0.3, 6, None, True),
], ids=["S3-half-default", "S7-all-preempted-fused", "S3-half-eager",
        "S7-part-preempted-default-async"])
def test_recovery_under_runner_v2_matches_full_states_token_for_token(
    cold_run: ColdRun, num_spec: int, corrupt: float, preempt: int | None,
    commit: Literal["fused", "eager"] | None, asynchronous: bool,
) -> None:
    p = prompts()
    oracle = oracle_file(cold_run.workdir / f"oracle-v2-{num_spec}-{corrupt}.json", p,
                         cold_run.continuations, corrupt)
    report = run_v2(EngineRun(model=cold_run.model, mode="on", commit=commit,
                              num_spec=num_spec, oracle=oracle, prompts=p,
                              max_tokens=MAX_TOKENS, engine=CHUNKED,
                              preempt_after_steps=preempt), cold_run.workdir,
                    asynchronous=asynchronous)
    assert report.recovery
    assert report.accepted_tokens > 0
    if corrupt == 0.0:
        assert report.acceptance > 0.9, report.acceptance
    if preempt is not None:
        assert report.preemptions > 0
    assert report.outputs == cold_run.continuations
    if commit == "eager":
        # the plugin logs no commit line for a commit asked for by name
        assert report.commit_lines == [] and report.deferred_commit_steps == 0
        return
    assert any(FUSED_LINE in line for line in report.commit_lines), report.commit_lines
    # V2's model state names each step's requests, so a step that verifies every pending
    # request again skips the standalone commit; requests that end or are preempted don't
    assert report.deferred_commit_steps > 0
    assert report.settles_skipped > 0 and report.settles > 0


def test_vllms_dflash_drafter_under_runner_v2(cold_run: ColdRun) -> None:
    """V2's own DFlash speculator (a tiny draft reading the target's hidden states; random
    weights, so its drafts are rarely right) with the default commit."""
    draft = write_tiny_dflash(cold_run.workdir / "tiny-dflash-v2")
    report = run_v2(EngineRun(model=cold_run.model, mode="on", drafter="dflash",
                              draft_model=str(draft), num_spec=3, prompts=prompts(),
                              max_tokens=MAX_TOKENS, engine=CHUNKED), cold_run.workdir)
    assert report.recovery and report.draft_tokens > 0
    assert any(FUSED_LINE in line for line in report.commit_lines), report.commit_lines
    assert report.outputs == cold_run.continuations
