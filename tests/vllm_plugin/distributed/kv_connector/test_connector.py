"""``RecoverSSMCheckpointConnector`` on vLLM's real CPU engine, recovery and full states.

Every restored output is compared token for token with a cold run of the same waves in an
engine without any connector. The scenario is in :mod:`.checkpoints`: exact prompts, a
changed prompt tail, a follow-up turn.

* ``LLM(kv_transfer_config=...)`` with the RAM backend: wave 1 restores from wave 0 inside
  one engine; these engines draft the cold continuation at about 50% acceptance, so
  full-state exports meet vLLM's lazy layout (accepted column and conv offset) and
  recovery exports a page that committed several tokens; recovery also with the commit
  fused into the next verify, where a finished request's last records are committed
  just before its export;
* ``vllm serve --kv-transfer-config ...`` with the disk backend: a first server answers
  wave 0 over HTTP and is stopped; a fresh server restores wave 1 from disk, one bundle
  damaged on disk in between;
* the deliberately wrong order (capture before the commit) restores wrong tokens.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from tests.support.checkpoints import (
    ENGINE,
    FOLLOW_UP_EXTRA,
    MAX_TOKENS,
    WAVE1_RESTORED,
    S,
    ask,
    damage_bundle,
    kv_config,
    prompts,
    wait_for_index,
    waves,
)
from tests.support.engine import environment, oracle_file, side_by_side
from tests.support.serve import metric_value, vllm_serve
from vllm_recoverssm.harness.random_loader import LOAD_FORMAT
from vllm_recoverssm.harness.run_engine import (
    EngineReport,
    EngineRun,
    FollowUp,
    run_in_subprocess,
)
from vllm_recoverssm.harness.tiny_model import write_tiny_glm53

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODES = ["on", "off"]
TESTING_ENV = "VLLM_RECOVERSSM_TESTING"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_glm53(tmp_path_factory.mktemp("tiny-glm53")))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("connector-runs")


def _run(spec: EngineRun, workdir: Path, env: dict[str, str]) -> EngineReport:
    return run_in_subprocess(spec, workdir, env={**environment(), **env})


def _spec(model: str, mode: str, oracle: str | None, **more: Any) -> EngineRun:
    first, later = waves(prompts())
    return EngineRun(model=model, mode=mode, num_spec=S, oracle=oracle, prompts=first,  # type: ignore[arg-type]
                     waves=later, max_tokens=MAX_TOKENS, engine=ENGINE, **more)


def _oracle(workdir: Path, cold: EngineReport, corrupt: float) -> str:
    asked = [p for w in cold.waves for p in w.prompts]
    answers = [o for w in cold.waves for o in w.outputs]
    return oracle_file(workdir / f"oracle-{corrupt}.json", asked, answers, corrupt)


@pytest.fixture(scope="module")
def engines(model: str, workdir: Path) -> dict[str, Any]:
    """Every engine of this module, in two lanes (one core each where there are two):

    * the cold run (both waves, no connector, every draft wrong), then the recovery RAM
      engines (the eager commit, then the default: fused), then the recovery disk restart;
    * the full-state disk restart, then the full-state RAM engine and the deliberately
      wrong-order engine (they draft the cold continuations, so they wait for it).

    The RAM engines draft the cold continuation with 30% of the drafts wrong (~50% accepted:
    full-state exports meet the lazy column and conv offset, recovery commits several
    tokens); the wrong-order engine with every draft right, so its last step commits
    several tokens and the state before that commit is far from the right one.
    """
    got: Future[tuple[EngineReport, str, str]] = Future()
    ram = kv_config("ram")

    def lane_cold_and_recovery(env: dict[str, str]) -> dict[str, Any]:
        try:
            cold = _run(_spec(model, "off", None), workdir, env)
            got.set_result((cold, _oracle(workdir, cold, 0.3), _oracle(workdir, cold, 0.0)))
        except BaseException as exc:
            got.set_exception(exc)
            raise
        on = _run(_spec(model, "on", got.result()[1], kv_transfer_config=ram,
                        commit="eager"), workdir, env)
        fused = _run(_spec(model, "on", got.result()[1], kv_transfer_config=ram), workdir, env)
        return {"cold": cold, "on": on, "fused": fused,
                "disk_on": _disk_restart(model, workdir, "on", env)}

    def lane_full_state(env: dict[str, str]) -> dict[str, Any]:
        disk_off = _disk_restart(model, workdir, "off", env)
        cold, half, right = got.result()
        off = _run(_spec(model, "off", half, kv_transfer_config=ram), workdir, env)
        first, _ = waves(prompts())
        wrong = EngineRun(
            model=model, mode="on", num_spec=S, oracle=right, prompts=first,
            waves=[[FollowUp(after=(0, 1), extra=FOLLOW_UP_EXTRA)]], max_tokens=MAX_TOKENS,
            engine=ENGINE, commit="eager",
            kv_transfer_config=kv_config("ram", _test_capture_stage="pre_commit"))
        return {"off": off, "disk_off": disk_off,
                "wrong": _run(wrong, workdir, {**env, TESTING_ENV: "1"})}

    first_lane, second_lane = side_by_side([lane_cold_and_recovery, lane_full_state])
    out = {**first_lane, **second_lane}
    cold = out["cold"]
    assert all(len(o) == MAX_TOKENS for w in cold.waves for o in w.outputs)
    assert cold.waves[1].num_cached_tokens == [0, 0, 0, 0]
    return out


@pytest.fixture(scope="module")
def cold(engines: dict[str, Any]) -> EngineReport:
    """Both waves in an engine without any connector."""
    return engines["cold"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def ram_runs(engines: dict[str, Any]) -> dict[str, EngineReport]:
    """Both modes with the RAM store, two waves in one engine each; and the wrong one."""
    return {k: engines[k] for k in ("on", "off", "wrong")}


@pytest.mark.parametrize("mode", MODES, ids=["recovery", "full-state"])
def test_ram_restore_within_one_engine_gives_the_cold_tokens(
    mode: str, ram_runs: dict[str, EngineReport], cold: EngineReport,
) -> None:
    run = ram_runs[mode]
    assert run.recovery is (mode == "on")
    assert 0.2 < run.acceptance < 0.9, run.acceptance  # accepted drafts: bias > 0 in full state
    first, second = run.waves
    assert first.outputs == cold.waves[0].outputs and first.num_cached_tokens == [0, 0, 0]
    assert second.prompts == cold.waves[1].prompts
    assert second.outputs == cold.waves[1].outputs
    # exact prompts (len-1), the tail before the change, the follow-up's response bundle
    assert second.num_cached_tokens == WAVE1_RESTORED
    assert second.external_hits == sum(WAVE1_RESTORED) and second.local_hits == 0
    assert second.cached_by_source == {"host": sum(WAVE1_RESTORED)}
    stats = run.connector
    assert stats is not None
    assert stats["restored"] == 4 and stats["load_failures"] == 0
    assert stats["restored_tokens"] == sum(WAVE1_RESTORED)
    # the two exact prompts: the engine's first-token logits are the bundle's
    assert stats["logits_checked"] == 2 == stats["logits_argmax_equal"]
    assert stats["logits_max_abs_diff"] < 1e-3
    assert stats["export_failures"] == 0
    assert stats["exported"]["prompt"] >= 5 and stats["exported"]["interval"] >= 4


def test_the_fused_commit_exports_committed_states(
    engines: dict[str, Any], cold: EngineReport,
) -> None:
    """Recovery with the RAM store and the default commit, fused into the next verify:
    each finished request's last records are committed before its response bundle is
    read, so the follow-up turn restores it and continues with the cold tokens."""
    run, eager = engines["fused"], engines["on"]
    assert run.recovery and 0.2 < run.acceptance < 0.9, run.acceptance
    assert any("fused into the next verify" in line for line in run.commit_lines), \
        run.commit_lines
    first, second = run.waves
    assert first.outputs == cold.waves[0].outputs
    assert second.num_cached_tokens == WAVE1_RESTORED
    assert second.outputs == cold.waves[1].outputs
    assert run.deferred_commit_steps > 0 and run.export_settles > 0
    stats, eager_stats = run.connector, eager.connector
    assert stats is not None and eager_stats is not None
    assert stats["restored"] == 4 and stats["load_failures"] == 0
    assert stats["export_failures"] == 0
    assert stats["exported"]["response"] == eager_stats["exported"]["response"] > 0


def test_capturing_before_the_commit_restores_wrong_tokens(
    ram_runs: dict[str, EngineReport], cold: EngineReport,
) -> None:
    """The wrong order (test-only setting): response bundles hold the state before the
    last step's commit, keyed by the tokens after it; the follow-up restores it and
    continues from a state one step behind."""
    wrong = ram_runs["wrong"]
    assert wrong.recovery and wrong.acceptance > 0.3  # wave 0 accepts every draft
    assert wrong.waves[0].outputs == cold.waves[0].outputs  # nothing restored yet
    follow_up = wrong.waves[1]
    assert follow_up.prompts[0] == cold.waves[1].prompts[2]
    assert follow_up.num_cached_tokens == [WAVE1_RESTORED[2]]  # the response bundle
    assert follow_up.outputs[0] != cold.waves[1].outputs[2]


def serve_args(flag: str, store: Path) -> list[str]:
    """``vllm serve`` as a user runs it for the tiny model with the disk store (n-gram
    drafts: the restart does not wait for the cold run's continuations)."""
    spec = {"method": "ngram", "num_speculative_tokens": S, "prompt_lookup_min": 1,
            "prompt_lookup_max": 4}
    return [
        "--load-format", LOAD_FORMAT, "--skip-tokenizer-init", "--dtype", "bfloat16",
        "--enforce-eager", "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
        "--kv-cache-memory-bytes", str(64 << 20), "--no-enable-prefix-caching",
        "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--enable-chunked-prefill",
        "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
        "--speculative-config", json.dumps(spec),
        "--kv-transfer-config", json.dumps(kv_config("disk", store)),
        "--enable-prompt-tokens-details", flag,
    ]


def _disk_restart(model: str, workdir: Path, mode: str, env: dict[str, str]) -> dict[str, Any]:
    """A first server answers wave 0 and stops; one bundle is damaged on disk; a fresh
    server answers wave 1."""
    flag = "--use-replayssm" if mode == "on" else "--no-use-replayssm"
    store = workdir / f"store-{mode}"
    first, later = waves(prompts())
    args = serve_args(flag, store)
    with vllm_serve(model, args, workdir / f"serve-{mode}-1.log", env) as srv:
        wave0 = [ask(srv.url, model, p, MAX_TOKENS) for p in first]
        # response bundles are exported in the step after each request ends
        wait_for_index(store, [len(p) + MAX_TOKENS - 1 for p in first])
    damaged = damage_bundle(store, WAVE1_RESTORED[3])  # C's prompt bundle
    follow = first[1] + wave0[1][0] + FOLLOW_UP_EXTRA
    wave1 = [first[0], later[0][1], follow, first[2]]
    with vllm_serve(model, args, workdir / f"serve-{mode}-2.log", env) as srv:
        answers = [ask(srv.url, model, p, MAX_TOKENS) for p in wave1]
        metrics = srv.metrics()
    log = (workdir / f"serve-{mode}-2.log").read_text(errors="replace")
    return dict(wave0=wave0, wave1=wave1, answers=answers, metrics=metrics, log=log,
                damaged=damaged)


@pytest.fixture(scope="module")
def disk_runs(engines: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Both modes: the disk store across two ``vllm serve`` processes."""
    return {"on": engines["disk_on"], "off": engines["disk_off"]}


@pytest.mark.parametrize("mode", MODES, ids=["recovery", "full-state"])
def test_disk_restore_in_a_fresh_vllm_serve_and_a_damaged_bundle_computes_cold(
    mode: str, disk_runs: dict[str, dict[str, Any]], cold: EngineReport,
) -> None:
    run = disk_runs[mode]
    assert [tokens for tokens, _ in run["wave0"]] == cold.waves[0].outputs
    assert [cached for _, cached in run["wave0"]] == [0, 0, 0]
    assert run["wave1"] == cold.waves[1].prompts
    assert [tokens for tokens, _ in run["answers"]] == cold.waves[1].outputs
    # C's prompt bundle was damaged on disk: a miss with a warning, computed cold
    assert run["damaged"]
    expected = WAVE1_RESTORED[:3] + [0]
    assert [cached for _, cached in run["answers"]] == expected
    # vLLM's counters count a connector hit when it is offered, the failed one included;
    # the per-request counts above are what was restored
    text = run["metrics"]
    offered = sum(expected) + WAVE1_RESTORED[3]
    disk = [line for line in text.splitlines()
            if line.startswith("vllm:prompt_tokens_cached_by_source_total{")
            and 'source="disk"' in line]
    assert disk and float(disk[0].rsplit(" ", 1)[1]) == offered
    assert metric_value(text, "vllm:external_prefix_cache_hits_total") == offered
    assert "checkpoint of a 11-token prefix not restored" in run["log"]
    assert "first-token logits match the stored ones" in run["log"]
