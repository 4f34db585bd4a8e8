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

from pathlib import Path
from typing import Any

import pytest

from tests.support.checkpoints import kv_config
from tests.support.engine import oracle_file, run_engine, run_pair
from tests.support.hf_flash import LOGPROB_TOLERANCE, make_flash
from vllm_recoverssm.harness.hf_compare import (
    FLASH_ENGINE,
    compare,
)
from vllm_recoverssm.harness.hf_glm53 import (
    TinyFlash,
    greedy_in_subprocess,
    words,
)
from vllm_recoverssm.harness.run_engine import EngineRun, ImagePrompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

@pytest.fixture(scope="module")
def flash(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_flash(tmp_path_factory.mktemp("hf-flash"))


def test_speculative_decoding_matches_transformers_in_both_modes(flash: dict[str, Any]) -> None:
    """Greedy tokens equal transformers' over 32 new tokens per prompt, recovery on == off
    == transformers, with 30-90% of drafts accepted; log-probabilities within tolerance."""
    hf, results = compare(Path(flash["model"]), flash["root"] / "compare")
    assert hf["outputs"] == flash["hf"]["outputs"]
    assert [r.recovery for r in results] == [True, False]
    for r in results:
        assert r.same_tokens, r.mode
        assert 0.3 < r.acceptance < 0.9, r.acceptance
        print(f"{r.mode}: acceptance {r.acceptance:.2f}, worst log-prob gap against "
              f"transformers {r.worst_gap:.3g} nats")
        assert r.worst_gap < LOGPROB_TOLERANCE


def test_the_oracle_command_prints_the_agreement(flash: dict[str, Any],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_recoverssm.cli.main import main

    assert main(["oracle", "--model-dir", flash["model"], "--new-tokens", "4", "--num-spec",
                 "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "every token and log-probability agrees with transformers: yes" in out
    assert out.count(" yes ") == 2  # both modes: tokens = transformers'


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
                engine=dict(FLASH_ENGINE))
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
