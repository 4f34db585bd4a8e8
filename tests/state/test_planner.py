"""Memory planner: figures against independent formulas and the worked numbers."""

from __future__ import annotations

import math

import pydantic
import pytest

from vllm_recoverssm.config.models import GLM_5_3, KIMI_LINEAR, QWEN3_NEXT_80B_A3B, ModelSpec
from vllm_recoverssm.state import PlanConfig, format_plan, plan

MIB = 1 << 20
GIB = 1 << 30


def glm_attention(tokens, layers=12, kv_bytes=2):
    """GLM-5.3 per-GPU attention bytes: MLA latent 512 + indexer 132 B per 16 tokens."""
    return layers * (tokens * 512 * kv_bytes + math.ceil(tokens / 16) * 132)


def test_glm_tp2_s3_none_matches_the_worked_numbers():
    p = plan(PlanConfig(model=GLM_5_3, tp=2, num_spec=3))
    assert (p.conv_bytes, p.state_bytes, p.record_bytes) == (147_456, 2_097_152, 131_072)
    full, inpage, scratch = (p.layout(n) for n in
                             ("full", "recovery_in_page", "recovery_scratch"))
    assert (full.page_bytes, inpage.page_bytes, scratch.page_bytes) == \
        (2_244_608, 2_375_680, 2_244_608)
    assert round(full.state_bytes_per_request / MIB, 1) == 291.1
    assert round(inpage.state_bytes_per_request / MIB, 1) == 77.0
    assert inpage.saving_bytes == full.state_bytes_per_request - 34 * 2_375_680
    assert inpage.saving_mib == pytest.approx(inpage.saving_bytes / MIB)
    assert inpage.saving_pct == pytest.approx(100 * inpage.saving_bytes
                                              / full.state_bytes_per_request)
    assert round(inpage.page_growth_pct, 1) == 5.8 and scratch.page_growth_pct == 0
    # the scratch area: 256 rows x 34 layers x 131,072 B
    assert scratch.scratch_bytes == 256 * 34 * 131_072
    assert scratch.reserve_bytes_per_request == 34 * 2_244_608
    assert scratch.total_bytes_at_max_num_seqs == 256 * 34 * (2_244_608 + 131_072)
    assert full.requests_fit is None and full.longest_context is None


def test_the_fused_commit_doubles_the_scratch_rows():
    eager = plan(PlanConfig(model=GLM_5_3, tp=2, num_spec=3)).layout("recovery_scratch")
    p = plan(PlanConfig(model=GLM_5_3, tp=2, num_spec=3, fused_commit=True))
    fused = p.layout("recovery_scratch")
    assert fused.scratch_bytes == 2 * 256 * 34 * 131_072 == 2 * eager.scratch_bytes
    assert fused.state_bytes_per_request == 34 * (2_244_608 + 2 * 131_072)
    assert fused.reserve_bytes_per_request == eager.reserve_bytes_per_request
    # records in pages have no scratch to double
    assert p.layout("recovery_in_page").scratch_bytes == 0
    assert "(+ its 2 scratch rows (fused commit)); scratch = 512 rows" in format_plan(p)


@pytest.mark.parametrize("model", [GLM_5_3, KIMI_LINEAR, QWEN3_NEXT_80B_A3B],
                         ids=lambda m: m.name)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("cache_mode", ["none", "align"])
def test_every_model_tp_and_cache_mode(model, tp, cache_mode):
    S = 3
    cfg = PlanConfig(model=model, tp=tp, num_spec=S, cache_mode=cache_mode,
                     block_size=64 if cache_mode == "align" else None,
                     state_dtype="float32", gpu_memory_gib=80, max_model_len=65536,
                     max_num_seqs=32)
    p = plan(cfg)
    full, inpage, scratch = (p.layout(n) for n in
                             ("full", "recovery_in_page", "recovery_scratch"))
    L = model.num_linear_layers
    assert full.blocks_per_request == (1 + S if cache_mode == "none" else 2 + S)
    assert inpage.blocks_per_request == (1 if cache_mode == "none" else 2)
    assert inpage.page_bytes == full.page_bytes + p.record_bytes
    assert full.state_bytes_per_request == L * full.blocks_per_request * full.page_bytes
    assert scratch.state_bytes_per_request == \
        L * (scratch.blocks_per_request * full.page_bytes + p.record_bytes)
    assert 0 < inpage.saving_pct < 100 and 0 < scratch.saving_pct < 100
    # fits: recomputed from the per-request cost and the budget
    attn_layers = model.num_attention_layers + model.num_mtp_layers
    for lp in (full, inpage, scratch):
        per_req = lp.reserve_bytes_per_request + p.attention_fixed_bytes_per_request
        per_req += round(p.attention_bytes_per_token * 65536)
        assert lp.requests_fit == (80 * GIB - lp.scratch_bytes) // per_req
        assert lp.longest_context is not None and lp.longest_context > 0
    assert p.num_draft_attention_layers == model.num_mtp_layers
    assert attn_layers == p.num_attention_layers + p.num_draft_attention_layers
    text = format_plan(p)
    for lp in (full, inpage, scratch):
        assert lp.title in text and f"{lp.page_bytes:,}" in text


def test_glm_budget_figures_independently():
    budget = 24
    p = plan(PlanConfig(model=GLM_5_3, tp=2, num_spec=3, gpu_memory_gib=budget,
                        max_model_len=131072, max_num_seqs=16))
    ring = 12 * 32 * 2 * 128 * 2
    assert p.attention_fixed_bytes_per_request == ring
    for name, reserve, scratch in (("full", 34 * 4 * 2_244_608, 0),
                                   ("recovery_in_page", 34 * 2_375_680, 0),
                                   ("recovery_scratch", 34 * 2_244_608,
                                    16 * 34 * 131_072)):
        lp = p.layout(name)
        per_req = reserve + ring + glm_attention(131072)
        assert lp.requests_fit == (budget * GIB - scratch) // per_req
        avail = budget * GIB - scratch - reserve - ring
        n = lp.longest_context
        assert n is not None
        assert glm_attention(n) <= avail < glm_attention(n + 1)


def test_more_recovery_requests_fit_at_short_context():
    p = plan(PlanConfig(model=GLM_5_3, tp=2, num_spec=7, gpu_memory_gib=40,
                        max_model_len=8192, max_num_seqs=64))
    assert p.layout("recovery_in_page").requests_fit > 2 * p.layout("full").requests_fit


def test_align_with_prefill_checkpoint_and_s7():
    p = plan(PlanConfig(model=GLM_5_3, tp=2, num_spec=7, cache_mode="align",
                        block_size=64))
    assert round(p.layout("full").state_bytes_per_request / MIB, 1) == 683.7
    assert round(p.layout("recovery_in_page").state_bytes_per_request / MIB, 1) == 168.9
    assert round(p.layout("recovery_in_page").page_growth_pct, 1) == 11.2
    p = plan(PlanConfig(model=GLM_5_3, tp=1, num_spec=3, cache_mode="align",
                        block_size=16, prefill_checkpoint_blocks=1))
    assert round(p.layout("full").state_bytes_per_request / MIB, 1) == 873.4
    assert round(p.layout("recovery_in_page").state_bytes_per_request / MIB, 1) == 462.2
    assert any("cached prefix block" in n for n in p.notes)


def test_dtypes():
    # GDN's "auto" state is the activation dtype, as in vLLM; recovery needs float32
    p = plan(PlanConfig(model=QWEN3_NEXT_80B_A3B, tp=2, num_spec=3))
    assert p.state_dtype == "bfloat16" and any("needs float32" in n for n in p.notes)
    p = plan(PlanConfig(model=QWEN3_NEXT_80B_A3B, tp=2, num_spec=3, state_dtype="float32"))
    assert p.state_dtype == "float32" and p.state_bytes == 16 * 128 * 128 * 4
    p8 = plan(PlanConfig(model=GLM_5_3, tp=2, num_spec=3, kv_cache_dtype="fp8"))
    assert p8.attention_bytes_per_token == pytest.approx(12 * (512 + 132 / 16))
    p32 = plan(PlanConfig(model=GLM_5_3, tp=2, num_spec=3, activation_dtype="float32"))
    assert p32.conv_bytes == 2 * 147_456


def test_no_speculation_and_no_attention():
    p = plan(PlanConfig(model=GLM_5_3, tp=2, num_spec=0))
    assert p.num_draft_attention_layers == 0
    assert p.layout("full").blocks_per_request == 1
    linear_only = ModelSpec(
        name="tiny", architecture="Glm5NextForCausalLM", kind="kda", num_layers=2,
        num_linear_layers=2, num_attention_layers=0, linear_num_heads=2, linear_head_dim=16,
        linear_num_k_heads=2, linear_k_head_dim=16, conv_kernel=4, max_model_len=128)
    p = plan(PlanConfig(model=linear_only, tp=1, num_spec=1, gpu_memory_gib=1))
    assert p.layout("full").longest_context is None
    assert "unbounded" in format_plan(p)
    # a budget too small for even one request
    p = plan(PlanConfig(model=GLM_5_3, tp=1, num_spec=3, gpu_memory_gib=0.01))
    assert p.layout("full").requests_fit == 0 and p.layout("full").longest_context == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cache_mode="align"), "needs a block_size"),
        (dict(cache_mode="align", block_size=3), "smaller than S\\+1"),
        (dict(prefill_checkpoint_blocks=1), "only to cache_mode 'align'"),
        (dict(tp=0), "tp"),
        (dict(num_spec=-1), "num_spec"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(gpu_memory_gib=0), "gpu_memory_gib"),
        (dict(state_dtype="int8"), "state_dtype"),
        (dict(cache_mode="all"), "cache_mode"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        PlanConfig(model=GLM_5_3, **{"num_spec": 3, **kwargs})


def test_tp_must_divide_heads():
    with pytest.raises(ValueError, match="does not divide"):
        plan(PlanConfig(model=GLM_5_3, tp=3))


def test_json_round_trip():
    p = plan(PlanConfig(model=KIMI_LINEAR, tp=4, num_spec=7, gpu_memory_gib=10))
    again = type(p).model_validate_json(p.model_dump_json())
    assert again == p
