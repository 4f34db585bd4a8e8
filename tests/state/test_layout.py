"""Pool layouts: page bytes and reserves against DESIGN.md section 3's formulas.

The expected numbers are derived here from the formulas alone (not from the code under
test): per linear layer with h = H/TP local heads, D the head dim, c the local conv
channels, b the activation bytes,

    conv  = c * (Kc - 1 + S) * b
    state = h * D * D * 4
    recs  = h * (S + 1) * D * (4 + 2*b)

and a request reserves (1+S) pages (align: 2+S+P) with full states, 1 (align: 2+P)
under recovery. For KDA c = 3*H*D/TP; for GDN c = (2*Hk*K + Hv*V)/TP and the records are
hv * (S+1) * (V*4 + 2*K*b).
"""

from __future__ import annotations

import pytest

from vllm_recoverssm.config.models import GLM_5_3, KIMI_LINEAR, QWEN3_NEXT_80B_A3B
from vllm_recoverssm.state import (
    LAYOUT_NAMES,
    blocks_per_request,
    build_layout,
    build_layouts,
    linear_layer_dims,
    state_bytes_per_request,
    state_pool_bytes,
)

MODELS = [GLM_5_3, KIMI_LINEAR, QWEN3_NEXT_80B_A3B]
TPS = [1, 2, 4, 8]
MIB = 1 << 20


def expected(model, tp, S, b=2, state_b=4):
    """(conv, state, recs) bytes of one layer, from the formulas above."""
    if model.kind == "kda":
        H, D = model.linear_num_heads, model.linear_head_dim
        h, c = H // tp, 3 * H * D // tp
        return c * (model.conv_kernel - 1 + S) * b, h * D * D * state_b, \
            h * (S + 1) * D * (4 + 2 * b)
    hv = model.linear_num_heads // tp
    V, K = model.linear_head_dim, model.linear_k_head_dim
    c = (2 * model.linear_num_k_heads * K + model.linear_num_heads * V) // tp
    return c * (model.conv_kernel - 1 + S) * b, hv * V * K * state_b, \
        hv * (S + 1) * (V * 4 + 2 * K * b)


def expected_blocks(recovery, cache_mode, S, P):
    if cache_mode == "none":
        return 1 if recovery else 1 + S
    return 2 + P if recovery else 2 + S + P


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("S", [1, 3, 7])
@pytest.mark.parametrize("cache_mode, P", [("none", 0), ("align", 0), ("align", 1)])
def test_every_layout_against_the_formulas(model, tp, S, cache_mode, P):
    conv, state, recs = expected(model, tp, S)
    lays = build_layouts(model, tp=tp, num_spec=S, cache_mode=cache_mode,
                         prefill_checkpoint_blocks=P)
    assert set(lays) == set(LAYOUT_NAMES)
    full, inpage, scratch = lays["full"], lays["recovery_in_page"], lays["recovery_scratch"]
    assert full.page_bytes == conv + state
    assert inpage.page_bytes == conv + state + recs
    assert scratch.page_bytes == conv + state
    assert full.scratch_row_bytes == inpage.scratch_row_bytes == 0
    assert scratch.scratch_row_bytes == recs
    assert scratch.scratch_bytes(64) == 64 * recs
    assert full.blocks_per_request == expected_blocks(False, cache_mode, S, P)
    assert inpage.blocks_per_request == scratch.blocks_per_request == \
        expected_blocks(True, cache_mode, S, P)
    L = model.num_linear_layers
    kw = dict(tp=tp, num_spec=S, cache_mode=cache_mode, prefill_checkpoint_blocks=P)
    assert state_bytes_per_request(model, mode="full", **kw) == \
        L * expected_blocks(False, cache_mode, S, P) * (conv + state)
    assert state_bytes_per_request(model, mode="recovery", **kw) == \
        L * expected_blocks(True, cache_mode, S, P) * (conv + state + recs)
    assert state_bytes_per_request(model, mode="recovery", records="scratch", **kw) == \
        L * (expected_blocks(True, cache_mode, S, P) * (conv + state) + recs)
    # records are ignored for full states
    assert state_bytes_per_request(model, mode="full", records="scratch", **kw) == \
        state_bytes_per_request(model, mode="full", **kw)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_tensor_shapes_follow_vllm(model):
    tp, S = 2, 3
    lay = build_layout(model, "recovery_in_page", tp=tp, num_spec=S)
    d = linear_layer_dims(model, tp)
    shapes = {t.name: (t.shape, t.itemsize) for t in lay.page_tensors}
    assert shapes == {
        "conv": ((model.conv_kernel - 1 + S, d.conv_channels), 2),
        "state": ((d.heads, model.linear_head_dim, model.linear_k_head_dim), 4),
        "corrections": ((d.heads, S + 1, model.linear_head_dim), 4),
        "kg": ((d.heads, S + 1, 2 * model.linear_k_head_dim), 2),
    }


# Worked numbers from notes/vllm-internals.md section B (GLM-5.3, 34 KDA layers).
@pytest.mark.parametrize(
    "tp, S, page_full, page_rec",
    [(2, 3, 2_244_608, 2_375_680), (2, 7, 2_342_912, 2_605_056)],
)
def test_glm_worked_pages(tp, S, page_full, page_rec):
    lays = build_layouts(GLM_5_3, tp=tp, num_spec=S)
    assert lays["full"].page_bytes == page_full
    assert lays["recovery_in_page"].page_bytes == page_rec


@pytest.mark.parametrize(
    "tp, S, cache_mode, P, full_mib, rec_mib",
    [
        (2, 3, "none", 0, 291.1, 77.0),
        (2, 3, "align", 0, 363.9, 154.1),
        (2, 3, "align", 1, 436.7, 231.1),
        (2, 7, "align", 0, 683.7, 168.9),
        (1, 3, "align", 1, 873.4, 462.2),
    ],
)
def test_glm_worked_reserves(tp, S, cache_mode, P, full_mib, rec_mib):
    kw = dict(tp=tp, num_spec=S, cache_mode=cache_mode, prefill_checkpoint_blocks=P)
    full = state_bytes_per_request(GLM_5_3, mode="full", **kw)
    rec = state_bytes_per_request(GLM_5_3, mode="recovery", **kw)
    assert round(full / MIB, 1) == full_mib
    assert round(rec / MIB, 1) == rec_mib


def test_glm_align_per_layer_difference_matches_the_fork_test():
    # test_glm_recoverssm_reserves_one_recurrent_state_per_draft_window: 9*Pn - 2*Pr
    kw = dict(tp=2, num_spec=7, cache_mode="align", num_linear_layers=1)
    diff = (state_bytes_per_request(GLM_5_3, mode="full", **kw)
            - state_bytes_per_request(GLM_5_3, mode="recovery", **kw))
    assert diff == 15_876_096


def test_record_growth_percentages():
    # "every cached page grows by +5.8% at S=3 and +11.2% at S=7"
    for S, pct in ((3, 5.8), (7, 11.2)):
        lays = build_layouts(GLM_5_3, tp=2, num_spec=S)
        grow = lays["recovery_in_page"].page_bytes / lays["full"].page_bytes - 1
        assert round(100 * grow, 1) == pct


def test_pool_bytes():
    kw = dict(tp=2, num_spec=3)
    L = GLM_5_3.num_linear_layers
    conv, state, recs = expected(GLM_5_3, 2, 3)
    assert state_pool_bytes(GLM_5_3, num_requests=5, max_num_seqs=8, mode="full", **kw) == \
        5 * L * 4 * (conv + state)
    assert state_pool_bytes(GLM_5_3, num_requests=5, max_num_seqs=8, mode="recovery",
                            **kw) == 5 * L * (conv + state + recs)
    # the scratch area has max_num_seqs rows whatever the number of requests
    assert state_pool_bytes(GLM_5_3, num_requests=0, max_num_seqs=8, mode="recovery",
                            records="scratch", **kw) == 8 * L * recs
    assert state_pool_bytes(GLM_5_3, num_requests=5, max_num_seqs=8, mode="recovery",
                            records="scratch", **kw) == L * (5 * (conv + state) + 8 * recs)
    # at num_requests == max_num_seqs both recovery layouts cost the same
    a = state_pool_bytes(GLM_5_3, num_requests=8, max_num_seqs=8, mode="recovery", **kw)
    b = state_pool_bytes(GLM_5_3, num_requests=8, max_num_seqs=8, mode="recovery",
                         records="scratch", **kw)
    assert a == b


def test_other_dtypes():
    conv, state, recs = expected(GLM_5_3, 4, 2, b=4, state_b=4)
    lay = build_layout(GLM_5_3, "recovery_in_page", tp=4, num_spec=2, activation_bytes=4)
    assert lay.page_bytes == conv + state + recs
    lay = build_layout(GLM_5_3, "full", tp=4, num_spec=2, state_bytes=2)
    assert lay.page_bytes == expected(GLM_5_3, 4, 2)[0] + expected(GLM_5_3, 4, 2, state_b=2)[1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp=3), "tp.*does not divide"),
        (dict(tp=0), "tp"),
        (dict(num_spec=-1), "num_spec"),
        (dict(cache_mode="all"), "cache_mode"),
        (dict(prefill_checkpoint_blocks=-1), "prefill_checkpoint_blocks"),
        (dict(activation_bytes=0), "activation_bytes"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = dict(tp=2, num_spec=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_layout(GLM_5_3, "full", **args)


def test_bad_modes():
    with pytest.raises(ValueError, match="mode"):
        state_bytes_per_request(GLM_5_3, tp=1, num_spec=3, mode="half")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="records"):
        state_bytes_per_request(GLM_5_3, tp=1, num_spec=3, mode="recovery",
                                records="disk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name"):
        build_layout(GLM_5_3, "mixed", tp=1, num_spec=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_num_seqs"):
        build_layout(GLM_5_3, "recovery_scratch", tp=1, num_spec=3).scratch_bytes(0)


def test_blocks_per_request_table():
    assert [blocks_per_request(False, "none", s) for s in (0, 1, 7)] == [1, 2, 8]
    assert [blocks_per_request(True, "none", s) for s in (0, 1, 7)] == [1, 1, 1]
    assert blocks_per_request(False, "align", 3, 1) == 6
    assert blocks_per_request(True, "align", 3, 1) == 3
