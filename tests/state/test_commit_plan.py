"""Commit plans: vectorised (CPU / CUDA) against the per-row Python reference."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from vllm_recoverssm.ops import CommitPlan
from vllm_recoverssm.state import (
    AlignRow,
    align_source_columns,
    build_align_commit_plan,
    build_commit_plan,
    plan_rows,
    query_lens_from_start_loc,
    reference_align_commit_plan,
)

I32 = torch.int32
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def t(x, device="cpu", dtype=I32):
    return torch.tensor(x, dtype=dtype, device=device)


# ---- non-align -----------------------------------------------------------------------


def test_non_align_clamps_and_keeps_slots():
    plan = build_commit_plan(t([3, -1, 5, 7]), t([2, 3, 9, -4]), t([4, 4, 3, 4]))
    assert isinstance(plan, CommitPlan)
    assert plan.state_indices.tolist() == [3, -1, 5, 7]
    assert plan.commit_lens.tolist() == [2, 0, 3, 0]
    assert plan.final_indices is not None and plan.final_indices.tolist() == [3, -1, 5, 7]
    assert plan.boundary_indices is None and plan.boundary_lens is None
    for f in (plan.state_indices, plan.commit_lens, plan.final_indices):
        assert f.dtype == I32 and f.is_contiguous()
    plan.validate(num_slots=8, max_len=4, device=torch.device("cpu"))


def test_non_align_int64_inputs_and_num_spec():
    plan = build_commit_plan(t([0, 1], dtype=torch.int64), t([4, 1], dtype=torch.int64),
                             t([4, 1], dtype=torch.int64), num_spec=3)
    assert plan.commit_lens.tolist() == [4, 1] and plan.state_indices.dtype == I32
    with pytest.raises(ValueError, match="query_lens.*S\\+1"):
        build_commit_plan(t([0]), t([1]), t([5]), num_spec=3)


@pytest.mark.parametrize(
    "args, match",
    [
        ((t([[0]]), t([1]), t([1])), "state_indices"),
        ((t([0, 1]), t([1]), t([1, 1])), "num_accepted"),
        ((t([0]), t([1]), t([1.0], dtype=torch.float32)), "query_lens"),
        ((t([0]), t([1]), t([-1])), "query_lens"),
        (([0], t([1]), t([1])), "state_indices"),
    ],
)
def test_non_align_validation(args, match):
    with pytest.raises(ValueError, match=match):
        build_commit_plan(*args)


def test_query_lens_from_start_loc():
    assert query_lens_from_start_loc(t([0, 4, 5, 5, 9])).tolist() == [4, 1, 0, 4]
    with pytest.raises(ValueError, match="query_start_loc"):
        query_lens_from_start_loc(t([[0, 1]]))


# ---- align: hand-checked cases --------------------------------------------------------

B = 8
ROW = [10, 11, 12, 13]  # block j holds the state after token (j+1)*B


@pytest.mark.parametrize(
    "nc, ql, na, want",
    [
        # fresh request, nothing committed: source column 0, no boundary unless n == B
        (0, 4, 4, AlignRow(10, 4, 10, -1, 0)),
        # mid-block: in place, no boundary
        (3, 4, 2, AlignRow(10, 2, 10, -1, 0)),
        # crosses the boundary at 8: boundary len 8-6 = 2, final in column 1
        (6, 4, 4, AlignRow(10, 4, 11, 10, 2)),
        # lands exactly on the boundary: boundary slot == final slot, len == n
        (5, 4, 3, AlignRow(10, 3, 10, 10, 3)),
        # previous step ended on the boundary: source is the completed block 0 (kept),
        # the new state goes to column 1
        (8, 4, 1, AlignRow(10, 1, 11, -1, 0)),
        (8, 4, 4, AlignRow(10, 4, 11, -1, 0)),
        # nothing accepted: final == source, no boundary even one token before it
        (7, 4, 0, AlignRow(10, 0, 10, -1, 0)),
        # accepted clamps to the row's length
        (7, 2, 5, AlignRow(10, 2, 11, 10, 1)),
        # later blocks
        (23, 4, 4, AlignRow(12, 4, 13, 12, 1)),
        (16, 3, 3, AlignRow(11, 3, 12, -1, 0)),
    ],
)
def test_align_cases(nc, ql, na, want):
    got = plan_rows(build_align_commit_plan(t([ROW]), t([nc]), t([ql]), t([na]), B))
    assert got == [want]
    assert reference_align_commit_plan([ROW], [nc], [ql], [na], B) == [want]


def test_align_first_boundary_when_block_equals_window():
    # B == S+1 == 4 and a fresh request accepts all 4: the boundary is crossed at once
    row = [[20, 21]]
    got = plan_rows(build_align_commit_plan(t(row), t([0]), t([4]), t([4]), 4, num_spec=3))
    assert got == [AlignRow(20, 4, 20, 20, 4)]


def test_align_null_rows():
    bt = t([[-1, -1], [5, 6], [7, -1]])
    plan = build_align_commit_plan(bt, t([0, 2, 1]), t([2, 2, 2]), t([2, 2, 0]), 4)
    assert plan_rows(plan) == [
        AlignRow(-1, 0, -1, -1, 0),
        AlignRow(5, 2, 5, 5, 2),
        AlignRow(7, 0, 7, -1, 0),
    ]
    plan.validate(num_slots=8, max_len=4, device=torch.device("cpu"))


def test_align_source_columns():
    assert align_source_columns(t([0, 1, 8, 9, 16]), 8).tolist() == [0, 0, 0, 1, 1]


def test_align_empty_batch():
    plan = build_align_commit_plan(torch.empty(0, 3, dtype=I32), t([]), t([]), t([]), 4)
    assert plan.num_rows == 0 and plan.boundary_lens is not None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_table=t([1, 2])), "block_table"),
        (dict(block_table=t([[1.0]], dtype=torch.float32)), "block_table"),
        (dict(num_computed=t([0, 1])), "num_computed"),
        (dict(num_computed=t([-1])), "num_computed"),
        (dict(query_lens=t([5])), "query_lens"),  # longer than the block
        (dict(query_lens=t([-2])), "query_lens"),
        (dict(num_accepted=t([[1]])), "num_accepted"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=2.0), "block_size"),
        (dict(block_size=3, num_spec=3), "block_size"),  # B < S+1
        (dict(num_computed=t([9])), "block_table.*column 3"),  # past the table
        (dict(block_table=t([[4, -1]]), num_computed=t([3])), "block_table.*null"),
    ],
)
def test_align_validation(kwargs, match):
    args = dict(block_table=t([[4, 5]]), num_computed=t([2]), query_lens=t([4]),
                num_accepted=t([4]), block_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_align_commit_plan(**args)


def test_align_without_validation_clamps_like_vllm():
    # column 2 does not exist: vLLM clamps to the last column
    plan = build_align_commit_plan(t([[4, 5]]), t([7]), t([4]), t([4]), 4, validate=False)
    assert plan_rows(plan) == [AlignRow(5, 4, 5, 5, 1)]


def test_align_mixed_devices_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with pytest.raises(ValueError, match="num_computed"):
        build_align_commit_plan(t([[1]], "cuda"), t([0]), t([1], "cuda"), t([1], "cuda"), 4)


# ---- align: random inputs, vectorised == reference, on every device ------------------


@st.composite
def align_batches(draw):
    S = draw(st.integers(1, 7))
    B = draw(st.integers(S + 1, 3 * (S + 1)))
    n = draw(st.integers(0, 12))
    width = draw(st.integers(1, 6))
    rows, ncs, qls, nas = [], [], [], []
    for _ in range(n):
        ql = draw(st.integers(0, S + 1))
        # every needed column must fit: nc + ql - 1 < width * B
        nc = draw(st.integers(0, max(width * B - max(ql, 1), 0)))
        nas.append(draw(st.integers(-1, S + 2)))
        qls.append(ql)
        ncs.append(nc)
        row = draw(st.lists(st.integers(0, 50), min_size=width, max_size=width))
        if draw(st.integers(0, 9)) == 0:
            row = [-1] * width  # a padded / null request
        rows.append(row)
    return S, B, width, rows, ncs, qls, nas


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=150, deadline=None)
@given(batch=align_batches(), index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_align_vectorised_matches_reference(device, batch, index_dtype):
    S, B, width, rows, ncs, qls, nas = batch
    bt = torch.tensor(rows, dtype=index_dtype, device=device).reshape(len(rows), width)
    plan = build_align_commit_plan(
        bt, t(ncs, device, index_dtype), t(qls, device, index_dtype),
        t(nas, device, index_dtype), B, num_spec=S,
    )
    for f in (plan.state_indices, plan.commit_lens, plan.final_indices,
              plan.boundary_indices, plan.boundary_lens):
        assert f is not None and f.dtype == I32 and f.device.type == device
    assert plan_rows(plan) == reference_align_commit_plan(rows, ncs, qls, nas, B)
    plan.validate(num_slots=51, max_len=S + 1, device=bt.device)
    # at most one boundary per step, and it lies inside the committed tokens
    for r in plan_rows(plan):
        if r.boundary_index >= 0:
            assert 1 <= r.boundary_len <= r.commit_len


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(
    slots=st.lists(st.integers(-1, 9), max_size=16),
    data=st.data(),
)
def test_non_align_random(device, slots, data):
    n = len(slots)
    na = data.draw(st.lists(st.integers(-2, 10), min_size=n, max_size=n))
    ql = data.draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
    plan = build_commit_plan(t(slots, device), t(na, device), t(ql, device))
    want = [min(max(a, 0), q) if s >= 0 else 0 for s, a, q in zip(slots, na, ql, strict=True)]
    assert plan.commit_lens.tolist() == want
    assert plan.state_indices.tolist() == [s if s >= 0 else -1 for s in slots]
    assert plan.commit_lens.device.type == device


# ---- align: semantics stated independently of the formulas ---------------------------


@settings(max_examples=200, deadline=None)
@given(batch=align_batches())
def test_align_semantics(batch):
    """Block j holds the state after token (j+1)*B: the final slot is the block of the
    last committed token, and the boundary (if any) is the one committed token that
    completes a block, with its replay length counted from the step's first token."""
    S, B, width, rows, ncs, qls, nas = batch
    plan = build_align_commit_plan(t([r for r in rows]).reshape(len(rows), width), t(ncs),
                                   t(qls), t(nas), B, num_spec=S)
    for r, row, nc, ql, na in zip(plan_rows(plan), rows, ncs, qls, nas, strict=True):
        if row[0] < 0:
            assert r == AlignRow(-1, 0, -1, -1, 0)
            continue
        n = min(max(na, 0), ql)
        assert r.commit_len == n
        last_token = nc + n  # tokens committed after the step (1-based position)
        assert r.final_index == row[max(last_token - 1, 0) // B]
        assert r.state_index == row[max(nc - 1, 0) // B]
        completing = [k for k in range(1, n + 1) if (nc + k) % B == 0]
        assert len(completing) <= 1
        if completing:
            k = completing[0]
            assert (r.boundary_index, r.boundary_len) == (row[(nc + k) // B - 1], k)
        else:
            assert (r.boundary_index, r.boundary_len) == (-1, 0)


def _align_commit_case(device):
    from vllm_recoverssm import ops
    from vllm_recoverssm.ops import reference as ref

    gen = torch.Generator().manual_seed(0)
    H, K, S, B, slots = 2, 16, 3, 4, 12
    N = 3
    state = torch.randn(slots, H, K, K, generator=gen)
    corr = torch.randn(N, H, S + 1, K, generator=gen) * 0.1
    kg = torch.randn(N, H, S + 1, 2 * K, generator=gen).to(torch.bfloat16)
    A_log = torch.randn(H, generator=gen) * 0.1
    dt_bias = torch.randn(H, K, generator=gen) * 0.1
    # row 0: nc=6 accepts 4 -> crosses 8 after 2 tokens; row 1: nc=8 accepts 1;
    # row 2: nc=1 accepts 3 -> lands on 4 exactly
    bt = t([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    plan = build_align_commit_plan(bt.to(device), t([6, 8, 1], device), t([4, 4, 4], device),
                                   t([4, 1, 3], device), B, num_spec=S)
    assert plan_rows(plan) == [AlignRow(1, 4, 2, 1, 2), AlignRow(4, 1, 5, -1, 0),
                               AlignRow(6, 3, 6, 6, 3)]
    # expected states from the single-token reference step
    want = state.clone()
    for i, r in enumerate(plan_rows(plan)):
        s = state[r.state_index].clone()
        for k in range(r.commit_len):
            s = ref.commit_step(s, corr[i, :, k], kg[i, :, k, :K], kg[i, :, k, K:], A_log,
                                dt_bias, -5.0)
            if k + 1 == r.boundary_len:
                want[r.boundary_index] = s
        want[r.final_index] = s
    got = state.clone().to(device)
    ops.commit(got, corr.to(device), kg.to(device), A_log.to(device), dt_bias.to(device),
               plan, lower_bound=-5.0)
    return got.cpu(), want


def test_align_plan_drives_commit_cpu():
    got, want = _align_commit_case("cpu")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_align_plan_drives_commit_gpu():
    got, want = _align_commit_case("cuda")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
