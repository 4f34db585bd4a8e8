"""vLLM's real engine under model runner V2 on the CPU: the runner a CUDA GPU picks.

On a GPU, vLLM 0.32 and 0.33 run hybrid models with runner V2, whose model state commits
recovery after sampling (``worker/model_state.py``), and turn prefix caching on in align
mode. The other engine tests run vLLM's CPU default, runner V1. Here the same engine runs
V2 (:mod:`.runner_v2` says how: Triton's interpreter, and the oracle drafting in place of
V2's n-gram speculator), and the greedy tokens must be those of a cold full-state run:

* without prefix caching: the default commit (fused into the next verify) at S = 3
  (~50% acceptance), ``fused`` at S = 7 (every draft right) with every running request
  preempted once, and ``eager`` at S = 3; and vLLM's DFlash drafter, V2's own;
* with prefix caching in align mode, through a second wave whose prompts hit the prefix
  cache: the default commit (fused, except for rows at a state block's end) and
  ``eager``;
* with vLLM's asynchronous scheduling, its GPU default with MTP drafting: the default
  commit at S = 7 with preemption, and with prefix caching in align mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest

from vllm_recoverssm.vllm_plugin.run_engine import (
    EngineReport,
    EngineRun,
    FollowUp,
)
from vllm_recoverssm.vllm_plugin.tiny_model import write_tiny_dflash

from .engine import (
    CHUNKED,
    MAX_TOKENS,
    ColdRun,
    oracle_file,
    prompts,
    run_engine,
    tiny_layer_page,
)
from .runner_v2 import ASYNC_SCHEDULING, ENVIRONMENT, MODULE

pytestmark = pytest.mark.vllm

FUSED_LINE = "commit: fused into the next verify"
ALIGN = {**CHUNKED, "enable_prefix_caching": True}


def run_v2(spec: EngineRun, workdir: Path, *, align: bool = False,
           asynchronous: bool = False) -> EngineReport:
    """One engine under runner V2, in a fresh process.

    ``align``: with ``PYTHONOPTIMIZE``, because vLLM's align-mode state-index step asserts
    that its input lives on a CUDA device before it launches its Triton kernel
    (``MambaStateContext.compute_aligned_state_indices``); the kernel itself runs in the
    interpreter on CPU tensors like every other. ``asynchronous``: with vLLM's
    asynchronous scheduling, as on a GPU (:mod:`.runner_v2`).
    """
    env = dict(ENVIRONMENT)
    if align:
        env["PYTHONOPTIMIZE"] = "1"
    if asynchronous:
        env[ASYNC_SCHEDULING] = "1"
    report = run_engine(spec, workdir, env, module=MODULE)
    assert report.async_scheduling is asynchronous
    return report


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


def _waves() -> tuple[list[list[int]], list[list[list[int] | FollowUp]]]:
    """Wave 0: three prompts (two longer than 32-token chunks). Wave 1: the first again,
    its first 70 tokens with a new tail, and the second's follow-up turn."""
    first = prompts(seed=11, lengths=(80, 45, 9))
    later: list[list[int] | FollowUp] = [first[0], first[0][:70] + [11, 12, 13],
                                         FollowUp(after=(0, 1), extra=[3, 4, 5, 6, 7])]
    return first, [later]


TIGHT = {**ALIGN, "max_model_len": 128, "kv_cache_memory_bytes": 12 * 3 * tiny_layer_page(3)}
"""Prefix caching with 12 state blocks: vLLM hands the blocks that the first wave's last
requests leave to the second wave's first requests in the very next step, and copies
cached states into them, so pending records of a finished request must be committed
before that copy (without it, this run's tokens differ)."""


def test_prefix_caching_in_align_mode_under_runner_v2_matches_a_cold_run(
    cold_run: ColdRun,
) -> None:
    """Recovery and full states, each with vLLM's prefix caching (align mode), against a
    cold run without it: every token of both waves, with the second wave's prompts
    served partly from cached state blocks. The default (fused) commit runs in a tight
    block pool (``TIGHT``), once more there with asynchronous scheduling (the host then
    knows each row's length only up to the drafts in flight, and must launch the commit
    after sampling wherever those could reach a block's end), and with blocks of 64
    tokens; the eager one as asked for."""
    first, later = _waves()
    common: dict[str, Any] = dict(model=cold_run.model, num_spec=3, prompts=first,
                                  waves=later, max_tokens=MAX_TOKENS)
    cold = run_engine(EngineRun(mode="off", engine=CHUNKED, **common), cold_run.workdir)
    asked = [q for w in cold.waves for q in w.prompts]
    answers = [o for w in cold.waves for o in w.outputs]
    oracle = oracle_file(cold_run.workdir / "oracle-v2-align.json", asked, answers, 0.3)
    runs = {name: run_v2(EngineRun(mode=mode, oracle=oracle, engine=engine, commit=commit,
                                   **common), cold_run.workdir, align=True,
                         asynchronous=name == "on-async")
            for name, mode, commit, engine in (
                ("off", "off", None, ALIGN), ("on", "on", None, TIGHT),
                ("on-async", "on", None, TIGHT),
                ("on-64", "on", None, {**ALIGN, "mamba_block_size": 64}),
                ("on-eager", "on", "eager", ALIGN))}
    for mode, run in runs.items():
        assert run.accepted_tokens > 0, mode
        assert [w.prompts for w in run.waves] == [w.prompts for w in cold.waves], mode
        assert [w.outputs for w in run.waves] == [w.outputs for w in cold.waves], mode
        # the second wave read state blocks from vLLM's own prefix cache
        assert run.waves[1].local_hits > 0, (mode, run.waves[1].num_cached_tokens)
    assert runs["on"].waves[1].num_cached_tokens == runs["off"].waves[1].num_cached_tokens
    assert not runs["off"].recovery
    for name in ("on", "on-async", "on-64"):
        run = runs[name]
        assert run.recovery and any(FUSED_LINE in line for line in run.commit_lines), name
        assert run.deferred_commit_steps > 0 and run.boundary_commits > 0, (name, run)
    # with blocks of 64 tokens (16 by default here) most steps have no row near a block's
    # end and launch no commit after sampling
    assert runs["on-64"].boundary_commits < runs["on-64"].deferred_commit_steps / 2
    assert runs["on-eager"].recovery and runs["on-eager"].deferred_commit_steps == 0
