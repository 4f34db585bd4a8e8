"""The tiny transformers GLM-5.3-Flash checkpoint: what it holds and how it is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_recoverssm.harness.hf_glm53 import (
    MARKER_TOKENS,
    VLLM_TEXT_FIELDS,
    TinyFlash,
    greedy_in_subprocess,
    make_in_subprocess,
    words,
)

pytest.importorskip("transformers.models.glm5_next")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_in_subprocess(tmp_path_factory.mktemp("flash") / "model")


def test_the_checkpoint_is_what_transformers_saves_plus_vllms_fields(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Glm5NextForConditionalGeneration"]
    text = config["text_config"]
    for name, value in VLLM_TEXT_FIELDS.items():
        assert text[name] == value
    assert (text["linear_head_dim"], text["linear_conv_kernel_dim"],
            text["linear_lower_bound"], text["hc_mult"]) == (128, 4, -5.0, 4)
    assert set(text["layer_types"]) == {"linear_attention"}
    assert {p.name for p in checkpoint.iterdir()} >= {
        "model.safetensors", "tokenizer.json", "processor_config.json"}


def test_weights_are_float32_with_no_constant_norms_or_gates(checkpoint: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        for name in names:
            assert f.get_slice(name).get_dtype() == "F32", name
        for suffix in ("input_layernorm.weight", "self_attn.A_log", "hc_attn_base",
                       "hc_ffn_scale", "self_attn.o_norm.weight"):
            values = f.get_tensor(next(n for n in names if n.endswith(suffix)))
            assert values.numel() > 1 and float(values.std()) > 0.05, suffix


def test_the_tokenizer_and_processor_load_with_transformers(checkpoint: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(checkpoint))
    ids = [5, 17, 300, 2]
    assert processor.tokenizer(words(ids))["input_ids"] == ids
    shape = TinyFlash()
    for field, text in MARKER_TOKENS.items():
        assert processor.tokenizer.convert_tokens_to_ids(text) == shape.image_token_ids[field]


def test_greedy_gives_every_step_its_logprobs(checkpoint: Path, tmp_path: Path) -> None:
    out = greedy_in_subprocess(checkpoint, [[5, 9, 40], [7]], 4, tmp_path)
    assert [len(o) for o in out["outputs"]] == [4, 4]
    for tokens, steps in zip(out["outputs"], out["logprobs"], strict=True):
        for token, step in zip(tokens, steps, strict=True):
            assert max(step, key=step.get) == token  # greedy picks the best
    assert len(out["first_logits"][0]) == TinyFlash().vocab_size


@pytest.mark.parametrize("field, value, message", [
    ("num_layers", 0, "num_layers: expected an integer in 1..4096, got 0"),
    ("head_dim", True, "head_dim: expected an integer in 1..4096, got True"),
    ("vocab_size", 32, "vocab_size: expected at least 64, got 32"),
])
def test_a_bad_shape_is_named(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyFlash(**{field: value})  # type: ignore[arg-type]
