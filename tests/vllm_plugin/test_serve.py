"""``vllm serve`` with the plugin, over HTTP on loopback, on the tiny GLM-5.3:

* ``--use-replayssm`` against ``--no-use-replayssm`` (vLLM's CPU defaults: runner V1, no
  prefix caching), the same greedy tokens from /v1/completions;
* the defaults a CUDA GPU gives (runner V2, asynchronous scheduling, prefix caching in
  align mode; recovery chosen automatically, with the fused commit), every answer the
  cold run's, the second time partly from vLLM's prefix cache (:mod:`.serve_v2`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.engine import FUSED_LINE, MAX_TOKENS, ColdRun, oracle_file, prompts
from tests.support.serve import metric_label, metric_value, vllm_serve
from vllm_recoverssm.harness.oracle_drafter import CLASS_PATH, CONFIG_KEY
from vllm_recoverssm.harness.random_loader import LOAD_FORMAT
from vllm_recoverssm.harness.run_engine import decision_lines
from vllm_recoverssm.harness.runner_v2 import ASYNC_LINE, oracle_speculative_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

S = 3


def serve_args(oracle: str, recovery_flag: str) -> list[str]:
    """The command line a user would type for the tiny model, oracle drafts included."""
    spec = {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": S}
    return [
        "--load-format", LOAD_FORMAT, "--skip-tokenizer-init", "--dtype", "bfloat16",
        "--enforce-eager", "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
        "--kv-cache-memory-bytes", str(64 << 20), "--no-enable-prefix-caching",
        "--max-num-seqs", "4", "--enable-chunked-prefill", "--max-num-batched-tokens", "32",
        "--speculative-config", json.dumps(spec),
        "--additional-config", json.dumps({CONFIG_KEY: {"path": oracle}}), recovery_flag,
    ]


def test_vllm_serve_recovery_and_full_state_answer_the_same_tokens(
    tmp_path: Path, cold_run: ColdRun,
) -> None:
    model = cold_run.model
    p = prompts()
    # the model's continuations, from the offline engine with the same settings
    cold = cold_run.continuations
    oracle = oracle_file(tmp_path / "half.json", p, cold, 0.3)
    results: dict[str, list[list[int]]] = {}
    metrics: dict[str, str] = {}
    logs: dict[str, str] = {}
    for flag in ("--use-replayssm", "--no-use-replayssm"):
        with vllm_serve(model, serve_args(oracle, flag), tmp_path / f"serve{flag}.log") as srv:
            results[flag] = srv.complete_all(p, MAX_TOKENS)
            metrics[flag] = srv.metrics()
        logs[flag] = (tmp_path / f"serve{flag}.log").read_text(errors="replace")

    on, off = results["--use-replayssm"], results["--no-use-replayssm"]
    assert on == off == cold
    for flag, text in metrics.items():
        drafted = metric_value(text, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafted > 0 and 0.2 < accepted / drafted < 0.9, (flag, accepted, drafted)
    # the same KV-cache bytes give the same number of state blocks in both modes
    blocks = {f: int(metric_label(t, "vllm:cache_config_info", "num_gpu_blocks"))
              for f, t in metrics.items()}
    assert blocks["--use-replayssm"] == blocks["--no-use-replayssm"] > 0
    # each server logged its decision once, with its reason
    on_lines = decision_lines(logs["--use-replayssm"])
    off_lines = decision_lines(logs["--no-use-replayssm"])
    assert len(on_lines) == len(off_lines) == 1
    assert "recovery: on [mode on]" in on_lines[0]
    assert "recovery: off" in off_lines[0] and "--no-use-replayssm" in off_lines[0]


def test_vllm_serve_with_the_gpu_defaults_answers_the_cold_tokens(
    tmp_path: Path, cold_run: ColdRun,
) -> None:
    """No recovery flag, prefix caching on, runner V2 and asynchronous scheduling: what
    ``vllm serve`` of GLM-5.3 with MTP drafting runs on a CUDA GPU. Every prompt is asked
    twice; the second time vLLM reads state blocks from its prefix cache."""
    p = prompts()
    oracle = oracle_file(tmp_path / "v2.json", p, cold_run.continuations, 0.3)
    spec = oracle_speculative_config(S, asynchronous=True)
    args = [
        "--load-format", LOAD_FORMAT, "--skip-tokenizer-init", "--dtype", "bfloat16",
        "--enforce-eager", "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
        "--kv-cache-memory-bytes", str(64 << 20), "--enable-prefix-caching",
        # vLLM's CPU platform resets an unset block size to 128 when the engine-core
        # process re-validates the config, while the state blocks stay at 16 tokens; its
        # scheduler then ends prompt chunks past state-block ends and the prefix cache
        # serves blocks whose state was never written, in either mode
        "--block-size", "16",
        "--max-num-seqs", "4", "--enable-chunked-prefill", "--max-num-batched-tokens", "32",
        "--speculative-config", json.dumps(spec),
        "--additional-config", json.dumps({CONFIG_KEY: {"path": oracle}}),
    ]
    log = tmp_path / "serve-v2.log"
    # PYTHONOPTIMIZE: vLLM's align-mode state-index step asserts a CUDA input (runner_v2)
    with vllm_serve(cold_run.model, args, log, env_overrides={"PYTHONOPTIMIZE": "1"},
                    module="tests.support.serve_v2") as srv:
        first = srv.complete_all(p, MAX_TOKENS)
        again = srv.complete_all(p, MAX_TOKENS)
        text = srv.metrics()
    assert first == cold_run.continuations
    assert again == cold_run.continuations
    # every block-aligned prompt prefix (16, 32, 48 and 80 tokens) hit the second time
    assert metric_value(text, "vllm:prefix_cache_hits_total") == 176
    drafted = metric_value(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0.2 < accepted / drafted < 0.9, (accepted, drafted)
    logged = log.read_text(errors="replace")
    assert ASYNC_LINE in logged
    decided = decision_lines(logged)
    assert len(decided) == 1 and "recovery: on" in decided[0], decided
    assert FUSED_LINE in logged
