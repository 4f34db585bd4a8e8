"""vLLM's engine with the plugin at tensor parallel 2 against transformers' GLM-5.3-Flash,
and the request-boundary checkpoints of both ranks.

vLLM's CPU platform runs one worker process per rank; each rank holds one of the tiny
checkpoint's two KDA heads (:mod:`.hf_flash`).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.checkpoints import kv_config
from tests.support.engine import oracle_file, run_engine
from tests.support.hf_flash import LOGPROB_TOLERANCE, NEW_TOKENS, make_flash
from vllm_recoverssm.harness.hf_compare import (
    FLASH_ENGINE,
    TOP_LOGPROBS,
    TP2,
    tp_binding,
    worst_logprob_gap,
)
from vllm_recoverssm.harness.hf_glm53 import TinyFlash
from vllm_recoverssm.harness.run_engine import EngineRun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def flash(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_flash(tmp_path_factory.mktemp("hf-flash-tp"))


def test_tensor_parallel_2_matches_transformers_and_tp1(flash: dict[str, Any]) -> None:
    """At tensor parallel 2 (one KDA head per rank) both modes give transformers' tokens,
    and each rank's state pages and record scratch hold half the heads of TP 1's."""
    hf = flash["hf"]
    oracle = oracle_file(flash["root"] / "oracle-tp.json", flash["prompts"], hf["outputs"], 0.4)
    spec = dict(model=flash["model"], num_spec=3, oracle=oracle, prompts=flash["prompts"][:2],
                max_tokens=NEW_TOKENS, logprobs=TOP_LOGPROBS)
    engine = dict(FLASH_ENGINE)
    tp1 = run_engine(EngineRun(mode="on", engine=engine, **spec), flash["root"])
    reports = {mode: run_engine(EngineRun(mode=mode, engine={**engine, **TP2}, **spec),
                                flash["root"], env=tp_binding()) for mode in ("on", "off")}
    on, off = reports["on"], reports["off"]
    assert on.recovery and not off.recovery
    assert on.outputs == off.outputs == tp1.outputs == hf["outputs"][:2]
    for report in (on, off):
        assert worst_logprob_gap(hf["logprobs"][:2], report.logprobs) < LOGPROB_TOLERANCE
    # The state page of a block holds each layer's FP32 state of the rank's own heads.
    state_per_head = 128 * 128 * 4
    layers = TinyFlash().num_layers
    assert tp1.kv.bytes_per_block - on.kv.bytes_per_block == layers * state_per_head + (
        layers * 3 * 128 * (3 + 3) * 4)  # and a conv history of half the channels
    assert len(on.kv.scratch_bytes_per_rank) == 2
    assert on.kv.scratch_bytes_per_rank == [tp1.kv.scratch_bytes // 2] * 2
    assert off.kv.scratch_bytes_per_rank == [0, 0]


def test_tensor_parallel_2_checkpoints_restore_per_rank_and_nowhere_else(
        flash: dict[str, Any]) -> None:
    """Request-boundary checkpoints on disk at tensor parallel 2: every rank stores its
    part; a fresh TP 2 engine restores them; a TP 1 engine and a bundle with a rank's part
    missing warn and compute cold. Every run gives transformers' tokens."""
    hf = flash["hf"]
    root = flash["root"]
    store = root / "tp-store"
    prompt_list = flash["prompts"][:2]
    oracle = oracle_file(root / "oracle-tpc.json", prompt_list, hf["outputs"][:2], 0.4)
    engine = dict(FLASH_ENGINE)

    def run(tp: int, tag: str) -> Any:
        spec = EngineRun(mode="on", num_spec=3, oracle=oracle, model=flash["model"],
                         prompts=prompt_list, max_tokens=NEW_TOKENS,
                         engine={**engine, **(TP2 if tp == 2 else {})},
                         kv_transfer_config=kv_config("disk", store))
        report = run_engine(spec, root / tag, env=tp_binding() if tp == 2 else None)
        assert report.outputs == hf["outputs"][:2], tag
        return report

    cold = run(2, "export")
    assert [r is not None and r["exported"]["prompt"] >= 2 for r in cold.connector_per_rank] \
        == [True, True]
    exact = [len(p) - 1 for p in prompt_list]
    warm = run(2, "restore")
    assert warm.num_cached_tokens == exact
    assert [r["restored"] for r in warm.connector_per_rank if r] == [2, 2]

    tp1 = run(1, "tp1")
    assert tp1.num_cached_tokens == [0, 0]
    assert any("tensor parallel 2 (here 1)" in w for w in tp1.warnings), tp1.warnings

    # Rank 1's part of the short prompt's bundle goes missing: a failed load, cold compute.
    short = len(prompt_list[0]) - 1
    parts = [f for f in store.iterdir() if f"@ntok%{short}@" in f.name and "@1@" in f.name]
    assert parts, sorted(f.name for f in store.iterdir())[:5]
    for part in parts:
        part.unlink()
    damaged = run(2, "missing")
    assert damaged.num_cached_tokens == [0, exact[1]]
    assert any(f"checkpoint of a {short}-token prefix failed to load" in w
               for w in damaged.warnings), damaged.warnings
