"""Prefix caching in align mode under vLLM's model runner V2 on the CPU.

On a GPU, vLLM 0.32 and 0.33 run hybrid models with runner V2 and turn prefix caching on
in align mode: every state block's end keeps the state there for later prompts. Here the
same engine runs V2 (:mod:`vllm_recoverssm.harness.runner_v2` says how), in two waves
whose second one hits the
prefix cache, and the greedy tokens of every engine must be those of a cold run without
prefix caching: full states, the default commit (fused, except for rows at a state
block's end) in a tight block pool, again with vLLM's asynchronous scheduling, with
blocks of 64 tokens, and the eager commit. (``test_runner_v2.py`` has the runs without
prefix caching.)
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.engine import (
    CHUNKED,
    FUSED_LINE,
    MAX_TOKENS,
    ColdRun,
    oracle_file,
    prompts,
    run_engine,
    run_v2,
    tiny_layer_page,
)
from vllm_recoverssm.harness.run_engine import EngineRun, FollowUp

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ALIGN = {**CHUNKED, "enable_prefix_caching": True}


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
