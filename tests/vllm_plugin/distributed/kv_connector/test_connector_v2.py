"""``RecoverSSMCheckpointConnector`` under vLLM's GPU defaults for the runner and the
scheduler: model runner V2, with and without asynchronous scheduling, on vLLM's CPU engine
(:mod:`vllm_recoverssm.harness.runner_v2` says how V2 runs there).

The scenario is :mod:`tests.support.checkpoints`' (exact prompts, a changed tail, a
follow-up turn), in one engine with the RAM store, drafting the cold continuation with 30%
of the drafts wrong. Every restored output must be the cold run's token for token (the cold
run: runner V1, no connector), with the same cached-token counts as under runner V1.

With prefix caching (align mode, vLLM's default for hybrid models), vLLM's own prefix
cache serves the block-aligned prefixes it holds and the connector restores past them, into
the block vLLM reads the running state from; the cached count is the sum of both.

Asynchronous scheduling plans a step before the previous step's tokens are known, so vLLM
may run one more step of a request that has already ended, over its state. In these runs
it does (the follow-up's turn ends by ``max_tokens`` inside a verify window): the worker
reads each request's state in the step that reaches its end, and the follow-up restores
that one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.checkpoints import (
    ENGINE,
    MAX_TOKENS,
    WAVE1_RESTORED,
    S,
    kv_config,
    prompts,
    waves,
)
from tests.support.engine import oracle_file, run_engine, run_v2, side_by_side
from vllm_recoverssm.harness.run_engine import EngineReport, EngineRun
from vllm_recoverssm.harness.tiny_model import write_tiny_glm53

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUNS = {"v2-recovery": ("on", False, False), "v2-async-recovery": ("on", True, False),
        "v2-async-full-state": ("off", True, False),
        "v2-align-async-recovery": ("on", True, True), "v2-align-full-state": ("off", False, True)}
"""name: (mode, asynchronous scheduling, prefix caching in align mode)."""


def _spec(model: str, mode: str, oracle: str | None, **more: Any) -> EngineRun:
    first, later = waves(prompts())
    return EngineRun(model=model, mode=mode, num_spec=S, oracle=oracle, prompts=first,  # type: ignore[arg-type]
                     waves=later, max_tokens=MAX_TOKENS, engine=ENGINE, **more)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, EngineReport]:
    """The cold run (runner V1, no connector), then the three V2 engines, two at a time."""
    workdir = tmp_path_factory.mktemp("connector-v2")
    model = str(write_tiny_glm53(tmp_path_factory.mktemp("tiny-glm53")))
    cold = run_engine(_spec(model, "off", None), workdir)
    asked = [p for w in cold.waves for p in w.prompts]
    answers = [o for w in cold.waves for o in w.outputs]
    oracle = oracle_file(workdir / "oracle.json", asked, answers, 0.3)

    def job(name: str) -> Any:
        mode, asynchronous, align = RUNS[name]
        engine = {**ENGINE, "enable_prefix_caching": True} if align else ENGINE

        def run(env: dict[str, str]) -> EngineReport:
            spec = _spec(model, mode, oracle, kv_transfer_config=kv_config("ram"))
            return run_v2(spec.model_copy(update={"engine": engine}), Path(workdir),
                          asynchronous=asynchronous, align=align, env=env)
        return run

    names = list(RUNS)
    done = side_by_side([job(n) for n in names])
    return {"cold": cold, **dict(zip(names, done, strict=True))}


@pytest.mark.parametrize("name", list(RUNS))
def test_restores_under_runner_v2_give_the_cold_tokens(
    name: str, runs: dict[str, EngineReport],
) -> None:
    run, cold = runs[name], runs["cold"]
    mode, asynchronous, align = RUNS[name]
    assert run.recovery is (mode == "on") and run.async_scheduling is asynchronous
    assert 0.2 < run.acceptance < 0.9, run.acceptance
    first, second = run.waves
    assert first.outputs == cold.waves[0].outputs and first.num_cached_tokens == [0, 0, 0]
    assert second.prompts == cold.waves[1].prompts
    assert second.outputs == cold.waves[1].outputs
    stats = run.connector
    assert stats is not None and stats["load_failures"] == 0 and stats["export_failures"] == 0
    assert stats["exported"]["prompt"] >= 5 and stats["exported"]["interval"] >= 4
    # the exact prompts it restored: the engine's first-token logits are the bundle's
    assert stats["logits_checked"] == stats["logits_argmax_equal"] >= 1
    assert stats["logits_max_abs_diff"] < 1e-3
    if align:
        # vLLM's own prefix cache serves block-aligned prefixes of wave 0; the connector
        # restores past them: its hits and vLLM's add up to each request's cached count
        # A exact: vLLM's 64; A's new tail: vLLM's 32 + the connector's 16 (its interval
        # bundle at 48); B's follow-up: B's prompt bundle (39), since B ended inside a
        # verify window and align mode keeps vLLM's counts (no cut state to export); C: 11
        assert second.num_cached_tokens == [64, 48, 39, 11]
        assert second.local_hits == 64 + 32 and second.external_hits == 16 + 39 + 11
        assert stats["restored"] == 3 and stats["restored_tokens"] == 16 + 39 + 11
        assert stats["stale_exports"] > 0
        return
    # exact prompts (len-1), the tail before the change, the follow-up's response bundle
    assert second.num_cached_tokens == WAVE1_RESTORED
    assert stats["logits_checked"] == 2  # A and C
    assert second.external_hits == sum(WAVE1_RESTORED) and second.local_hits == 0
    assert stats["restored"] == 4 and stats["restored_tokens"] == sum(WAVE1_RESTORED)
    assert stats["exported"]["response"] >= 3 and stats["stale_exports"] == 0
    # asynchronous scheduling ran steps of requests that had ended; without it none
    assert (stats["steps_past_end"] > 0) is asynchronous, stats["steps_past_end"]
