"""The model: GLM-5.3 layer pattern, seeded weights, varied greedy output; the drafters."""

from __future__ import annotations

import pytest
import torch

from tests.support.reference_runs import make_prompts
from vllm_recoverssm.reference import (
    CPU_MODEL,
    GLM_TP2_MODEL,
    GPU_MODEL,
    TEST_MODEL,
    HybridModel,
    ModelConfig,
    OracleDrafter,
    Request,
    build_model,
    corruption_for_acceptance,
    expected_acceptance,
    greedy_continuations,
)
from vllm_recoverssm.reference.layers import KDAMixer, PagedAttention


def test_layer_pattern_is_glm53() -> None:
    assert CPU_MODEL.attention_layers == [3, 7]
    assert CPU_MODEL.kda_layers == [0, 1, 2, 4, 5, 6]
    assert GPU_MODEL.kda_head_dim == 128
    # GLM-5.3's 64 KDA heads split over two GPUs: a 2 MiB FP32 state per request and layer
    glm = GLM_TP2_MODEL
    assert (glm.num_kda_heads, glm.kda_head_dim, glm.dtype) == (32, 128, "bfloat16")
    assert glm.num_kda_heads * glm.kda_head_dim ** 2 * 4 == 2 << 20
    assert len(glm.kda_layers) == 12 and glm.attention_layers == [3, 7, 11, 15]
    model = build_model(TEST_MODEL)
    kinds = [type(layer.mixer) for layer in model.layers]  # type: ignore[union-attr]
    assert kinds == [KDAMixer, KDAMixer, KDAMixer, PagedAttention]
    mixer = model.kda_mixers()[0]
    assert mixer.lower_bound == -5.0
    assert mixer.A_log.dtype == torch.float32 and mixer.dt_bias.shape == (2, 16)


def test_weights_come_from_the_seed() -> None:
    a, b = build_model(TEST_MODEL), build_model(TEST_MODEL)
    c = build_model(ModelConfig(**{**TEST_MODEL.to_dict(), "seed": 1}))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed.weight, c.embed.weight)


@pytest.mark.parametrize("config", [TEST_MODEL, CPU_MODEL], ids=["test", "cpu"])
def test_greedy_output_is_varied(config: ModelConfig) -> None:
    model = build_model(config)
    prompts = make_prompts(2, config.vocab_size, seed=4, lengths=[6, 13])
    outs = greedy_continuations(model, prompts, 24, max_model_len=48)
    for out in outs:
        assert len(set(out)) >= 12, out  # not one repeated token, not a short loop
    assert outs[0] != outs[1]


def test_model_config_is_validated() -> None:
    with pytest.raises(ValueError, match="'hidden_size'"):
        ModelConfig(hidden_size=0)
    with pytest.raises(ValueError, match="'dtype'"):
        ModelConfig(dtype="int8")
    with pytest.raises(ValueError, match="'lower_bound'"):
        ModelConfig(lower_bound=1.0)
    with pytest.raises(ValueError, match="no KDA layer"):
        ModelConfig(num_layers=1, full_attn_interval=1)


def test_corruption_rate_hits_the_target_acceptance() -> None:
    for S in (1, 3, 7):
        for target in (0.0, 0.25, 0.5, 0.9, 1.0):
            p = corruption_for_acceptance(target, S)
            assert abs(expected_acceptance(p, S) - target) < 1e-9
    assert corruption_for_acceptance(0.5, 1) == pytest.approx(0.5)


def test_oracle_drafts_are_deterministic_and_corrupted_at_the_rate(
    tiny_model: HybridModel,
) -> None:
    prompt = [1, 2, 3]
    ref = list(range(10, 60))
    req = Request(rid=0, prompt=prompt, max_new_tokens=40)
    req.tokens += ref[:5]
    exact = OracleDrafter({tuple(prompt): ref}, 0.0, 256).propose(tiny_model, [req], 7)
    assert exact == [ref[5:12]]
    noisy = OracleDrafter({tuple(prompt): ref}, 1.0, 256)
    drafts = noisy.propose(tiny_model, [req], 7)[0]
    assert all(d != r for d, r in zip(drafts, ref[5:12], strict=True))
    assert drafts == noisy.propose(tiny_model, [req], 7)[0]
    with pytest.raises(ValueError, match="no reference"):
        noisy.propose(tiny_model, [Request(rid=1, prompt=[9], max_new_tokens=1)], 3)
