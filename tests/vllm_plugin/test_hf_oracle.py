"""vLLM's engine with the plugin against transformers' GLM-5.3-Flash: an oracle nobody here
wrote.

A tiny GLM-5.3-Flash is made and saved by transformers' own classes
(:mod:`vllm_recoverssm.harness.hf_glm53`: ``Glm5NextForConditionalGeneration``, float32
safetensors, a tokenizer); vLLM loads it with its default loader. transformers' greedy
``generate`` (no speculation, its PyTorch KDA on the CPU) gives the reference tokens and
log-probabilities; vLLM then decodes with speculation, recovery on and off, and every
token and log-probability must agree with transformers'.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from vllm_recoverssm.harness.hf_glm53 import (
    TinyFlash,
    greedy_in_subprocess,
    make_in_subprocess,
    words,
)
from vllm_recoverssm.vllm_plugin.run_engine import EngineRun, ImagePrompt

from .checkpoints import kv_config
from .engine import CHUNKED, oracle_file, run_engine, run_pair

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NEW_TOKENS = 32
PROMPT_LENGTHS = (7, 45, 19, 70)
"""Two prompts longer than a 32-token chunk: prompt chunks share steps with verify rows."""
LOGPROB_TOLERANCE = 1e-4
"""Nats. Both sides compute in float32 with different summation orders (transformers'
chunked KDA against the plugin's sequential one, fused against separate mHC steps); the
differences seen are about 5e-6, a twentieth of this."""
TOP = 5
FLASH_ENGINE = {"load_format": "auto", "dtype": "float32", "skip_tokenizer_init": False,
                "max_model_len": 512}
"""vLLM's default loader and the checkpoint's tokenizer and processor, in float32."""


def flash_prompts(shape: TinyFlash, seed: int = 1) -> list[list[int]]:
    """Random prompts of plain-word token ids (below the multimodal markers)."""
    rng = random.Random(seed)
    top = min(shape.image_token_ids.values())
    return [[rng.randrange(2, top) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def flash(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The checkpoint, its prompts and transformers' greedy result on them."""
    shape = TinyFlash()
    root = tmp_path_factory.mktemp("hf-flash")
    model = make_in_subprocess(root / "model", shape)
    prompt_list = flash_prompts(shape)
    reference = greedy_in_subprocess(model, prompt_list, NEW_TOKENS, root)
    return {"model": str(model), "root": root, "prompts": prompt_list, "hf": reference}


def worst_logprob_gap(hf: list[list[dict[int, float]]],
                      engine: list[list[dict[int, float]]]) -> float:
    """The largest log-probability difference over every step's tokens both list."""
    worst = 0.0
    for hf_steps, steps in zip(hf, engine, strict=True):
        assert len(hf_steps) == len(steps)
        for want, got in zip(hf_steps, steps, strict=True):
            shared = set(want) & set(got)
            assert shared, "no token among both sides' best"
            worst = max(worst, *(abs(want[t] - got[t]) for t in shared))
    return worst


def test_speculative_decoding_matches_transformers_in_both_modes(flash: dict[str, Any]) -> None:
    """Greedy tokens equal transformers' over 32 new tokens per prompt, recovery on == off
    == transformers, with 30-90% of drafts accepted; log-probabilities within tolerance."""
    hf = flash["hf"]
    oracle = oracle_file(flash["root"] / "oracle.json", flash["prompts"], hf["outputs"], 0.4)
    pair = run_pair(
        flash["root"], model=flash["model"], num_spec=3, oracle=oracle,
        prompts=flash["prompts"], max_tokens=NEW_TOKENS, logprobs=TOP,
        engine={**FLASH_ENGINE, **CHUNKED},
    )
    assert pair.on.recovery and not pair.off.recovery
    assert pair.on.outputs == hf["outputs"]
    assert pair.off.outputs == hf["outputs"]
    for report in (pair.on, pair.off):
        assert 0.3 < report.acceptance < 0.9, report.acceptance
        gap = worst_logprob_gap(hf["logprobs"], report.logprobs)
        print(f"{report.mode}: acceptance {report.acceptance:.2f}, worst log-prob gap "
              f"against transformers {gap:.3g} nats")
        assert gap < LOGPROB_TOLERANCE


TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
"""vLLM's CPU platform runs one worker process per rank."""


def tp_binding() -> dict[str, str]:
    """Each rank's OpenMP threads on a core of their own (the same one on a one-core
    machine); the engines then run one after the other."""
    cores = sorted(os.sched_getaffinity(0))
    pair = cores[:2] if len(cores) >= 2 else cores * 2
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in pair)}


def test_tensor_parallel_2_matches_transformers_and_tp1(flash: dict[str, Any]) -> None:
    """At tensor parallel 2 (one KDA head per rank) both modes give transformers' tokens,
    and each rank's state pages and record scratch hold half the heads of TP 1's."""
    hf = flash["hf"]
    oracle = oracle_file(flash["root"] / "oracle-tp.json", flash["prompts"], hf["outputs"], 0.4)
    spec = dict(model=flash["model"], num_spec=3, oracle=oracle, prompts=flash["prompts"][:2],
                max_tokens=NEW_TOKENS, logprobs=TOP)
    engine = {**FLASH_ENGINE, **CHUNKED}
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


IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
"""vLLM's GLM-5.3 image placeholder; the processor expands ``<|image|>``."""


def test_an_image_prompt_matches_transformers_and_is_never_exported(
        flash: dict[str, Any]) -> None:
    """A 56 x 56 image through the checkpoint's processor and vision tower: transformers'
    tokens in both modes; with the checkpoint connector its request is neither exported
    nor restored, while a text prompt beside it is."""
    import numpy as np
    from PIL import Image

    root = flash["root"]
    picture = root / "image.png"
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((56, 56, 3)) * 255).astype("uint8")).save(picture)
    text = f"{words(flash['prompts'][0][:5])} {IMAGE} {words(flash['prompts'][0][5:])}"
    with_image = ImagePrompt(text=text, image=str(picture))
    plain = flash["prompts"][1]
    hf = greedy_in_subprocess(Path(flash["model"]),
                              [{"text": text, "image": str(picture)}, plain], 16, root / "img")
    assert hf["prompt_ids"][0].count(TinyFlash().image_token_ids["image_token_id"]) == 4
    oracle = oracle_file(root / "oracle-img.json", hf["prompt_ids"], hf["outputs"], 0.4)
    spec = dict(model=flash["model"], num_spec=3, oracle=oracle, max_tokens=16,
                engine={**FLASH_ENGINE, **CHUNKED})
    pair = run_pair(root, prompts=[with_image, plain], **spec)
    assert pair.on.outputs == pair.off.outputs == hf["outputs"]
    assert pair.on.acceptance > 0.3
    ram = run_engine(EngineRun(mode="on", prompts=[with_image, plain],
                               waves=[[with_image, plain]], kv_transfer_config=kv_config("ram"),
                               **spec), root)
    first, second = ram.waves
    assert first.outputs == second.outputs == hf["outputs"]
    assert first.prompts[0] == hf["prompt_ids"][0]
    assert second.num_cached_tokens[0] == 0  # the image request: no bundle
    assert second.num_cached_tokens[1] == len(plain) - 1  # the text prompt: restored
    assert ram.connector is not None and ram.connector["restored"] == 1


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
    engine = {**FLASH_ENGINE, **CHUNKED}

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
