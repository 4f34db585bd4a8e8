"""``vllm serve`` with the plugin, over HTTP on loopback: ``--use-replayssm`` against
``--no-use-replayssm`` on the tiny GLM-5.3, the same greedy tokens from /v1/completions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_recoverssm.vllm_plugin.model_loader import LOAD_FORMAT
from vllm_recoverssm.vllm_plugin.run_engine import decision_lines
from vllm_recoverssm.vllm_plugin.spec_decode.oracle import CLASS_PATH, CONFIG_KEY

from .engine import MAX_TOKENS, ColdRun, oracle_file, prompts
from .serve import metric_label, metric_value, vllm_serve

pytestmark = pytest.mark.vllm

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
