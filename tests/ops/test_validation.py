"""Bad arguments are refused before any launch, with the argument named."""

from __future__ import annotations

import pytest
import torch

from tests.support.kda_batches import make_batch, make_state
from vllm_recoverssm import ops

H, K, V, N, W = 2, 8, 8, 3, 4


def _args(**over):
    b = make_batch([W, 2, 1], H, K, V)
    a = dict(
        q=b.q, k=b.k, v=b.v, raw_g=b.raw_g, raw_beta=b.raw_beta, A_log=b.A_log,
        dt_bias=b.dt_bias, state=make_state(6, H, V, K),
        state_indices=torch.tensor([0, 3, 5], dtype=torch.int32),
        query_start_loc=b.query_start_loc,
        corrections=torch.zeros(N, H, W, V), kg=torch.zeros(N, H, W, 2 * K),
    )
    a.update(over)
    return a


def _verify(**over):
    a = _args(**over)
    return ops.verify_recovery(
        a["q"], a["k"], a["v"], a["raw_g"], a["raw_beta"], a["A_log"], a["dt_bias"],
        a["state"], a["state_indices"], a["query_start_loc"], a["corrections"], a["kg"],
        lower_bound=-5.0, record_indices=a.get("record_indices"),
    )


def test_valid_arguments_pass():
    _verify()


@pytest.mark.parametrize("over, pattern", [
    (dict(state=make_state(6, H, V, K).half()), r"'state': expected dtype .*float32.*got float16"),
    (dict(q=torch.zeros(7, H, K, dtype=torch.float64)),
     r"'k': expected dtype float64, got float32"),
    (dict(v=torch.zeros(7, H, V + 1)), r"'v': expected shape \[7, 2, 8\], got \[7, 2, 9\]"),
    (dict(q=torch.zeros(7, H, K + 8), k=torch.zeros(7, H, K + 8)),
     r"'q': expected shape \[7, 2, 8\] to match state heads and key dim"),
    (dict(state=make_state(6, H, V, K).transpose(2, 3)), r"'state': expected the last 3 dim"),
    (dict(corrections=torch.zeros(N, H, 9, V), kg=torch.zeros(N, H, 9, 2 * K)),
     r"'corrections': .*S in 1..7, got 9 columns \(S = 8\)"),
    (dict(corrections=torch.zeros(N, H, 1, V), kg=torch.zeros(N, H, 1, 2 * K)),
     r"S in 1..7, got 1 columns \(S = 0\)"),
    (dict(state_indices=torch.tensor([0, 6, 1], dtype=torch.int32)),
     r"'state_indices': index 6 is out of range, expected 0..5"),
    (dict(state_indices=torch.tensor([0, 1, 2], dtype=torch.float32)),
     r"'state_indices': expected dtype one of int32, int64, got float32"),
    (dict(A_log=torch.zeros(H + 1)), r"'A_log': expected shape \[2\], got \[3\]"),
    (dict(query_start_loc=torch.tensor([0, 5, 6, 7], dtype=torch.int32)),
     r"'query_start_loc': a request has 5 tokens, expected at most 4"),
    (dict(query_start_loc=torch.tensor([0, 3, 2, 7], dtype=torch.int32)),
     r"'query_start_loc': expected non-decreasing"),
    (dict(corrections=torch.zeros(2, H, W, V), kg=torch.zeros(2, H, W, 2 * K)),
     r"'corrections': expected at least 3 record rows"),
    (dict(record_indices=torch.tensor([0, 1, 3], dtype=torch.int32)),
     r"'record_indices': index 3 is out of range"),
    (dict(q=torch.zeros(7, H, K, device="meta"), k=torch.zeros(7, H, K, device="meta")),
     r"'q': expected a tensor on cpu, got one on meta"),
])
def test_bad_verify_argument_is_named(over, pattern):
    with pytest.raises(ValueError, match=pattern):
        _verify(**over)


def test_bad_commit_plan_is_named():
    st = make_state(6, H, V, K)
    corr, kg = torch.zeros(N, H, W, V), torch.zeros(N, H, W, 2 * K)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32)
    A, dtb = torch.zeros(H), torch.zeros(H, K)
    with pytest.raises(ValueError, match=r"'plan.commit_lens': expected values in 0..4"):
        ops.commit(st, corr, kg, A, dtb,
                   ops.CommitPlan(idx, torch.tensor([1, 5, 0], dtype=torch.int32)),
                   lower_bound=-5.0)
    with pytest.raises(ValueError, match=r"'plan.final_indices': index 9 is out of range"):
        ops.commit(st, corr, kg, A, dtb,
                   ops.CommitPlan(idx, torch.ones(3, dtype=torch.int32),
                                  final_indices=torch.tensor([0, 9, 1], dtype=torch.int32)),
                   lower_bound=-5.0)
    with pytest.raises(ValueError, match=r"1 <= boundary_len <= commit_len"):
        ops.commit(st, corr, kg, A, dtb,
                   ops.CommitPlan(idx, torch.ones(3, dtype=torch.int32),
                                  boundary_indices=torch.tensor([4, -1, -1], dtype=torch.int32),
                                  boundary_lens=torch.tensor([2, 0, 0], dtype=torch.int32)),
                   lower_bound=-5.0)
    with pytest.raises(ValueError, match=r"'corrections'/'kg': expected 2 layers"):
        ops.commit([st, st], [corr], [kg], A, dtb,
                   ops.CommitPlan(idx, torch.ones(3, dtype=torch.int32)), lower_bound=-5.0)
    with pytest.raises(ValueError, match=r"'lower_bound': expected a negative bound"):
        ops.commit(st, corr, kg, A, dtb,
                   ops.CommitPlan(idx, torch.ones(3, dtype=torch.int32)), lower_bound=5.0)


def test_bad_full_state_and_conv_arguments_are_named():
    b = make_batch([W, 2, 1], H, K, V)
    st = make_state(12, H, V, K)
    cols = torch.arange(12, dtype=torch.int32).view(N, W)
    with pytest.raises(ValueError, match=r"'num_accepted': expected values in 1..4"):
        ops.verify_full(*b.tokens(), st, cols, torch.tensor([0, 1, 1], dtype=torch.int32),
                        b.query_start_loc, lower_bound=-5.0)
    with pytest.raises(ValueError, match=r"'state_indices': expected shape \[N, S\+1\]"):
        ops.verify_full(*b.tokens(), st, cols[:, 0].contiguous(), torch.ones(3, dtype=torch.int32),
                        b.query_start_loc, lower_bound=-5.0)
    conv = torch.zeros(4, 6, 6)
    x = torch.zeros(7, 6)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"'weight': expected shape \[6, \*\]"):
        ops.conv_update(x, conv, torch.zeros(5, 4), None, idx, b.query_start_loc)
    with pytest.raises(ValueError, match=r"'conv_offsets': expected values in 0..3"):
        ops.conv_update(x, conv, torch.zeros(6, 4), None, idx, b.query_start_loc,
                        conv_offsets=torch.tensor([0, 4, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"'activation': expected 'silu' or None"):
        ops.conv_update(x, conv, torch.zeros(6, 4), None, idx, b.query_start_loc,
                        activation="gelu")
    with pytest.raises(ValueError, match=r"'backend': expected one of"):
        ops.conv_update(x, conv, torch.zeros(6, 4), None, idx, b.query_start_loc,
                        backend="cuda")


def test_rejected_call_leaves_buffers_untouched():
    a = _args()
    corr = torch.full((N, H, W, V), 3.0)
    state = a["state"].clone()
    with pytest.raises(ValueError):
        _verify(corrections=corr, state=state,
                state_indices=torch.tensor([0, 1, 99], dtype=torch.int32))
    assert (corr == 3.0).all()
    assert torch.equal(state, a["state"])


def _fused(**over):
    a = _args(corrections=torch.zeros(2 * N, H, W, V), kg=torch.zeros(2 * N, H, W, 2 * K))
    a.update(prev_lens=torch.tensor([2, 0, 1], dtype=torch.int32),
             record_indices=torch.tensor([3, 4, 5], dtype=torch.int32),
             prev_record_indices=torch.tensor([0, 1, 2], dtype=torch.int32))
    a.update(over)
    return ops.verify_fused(
        a["q"], a["k"], a["v"], a["raw_g"], a["raw_beta"], a["A_log"], a["dt_bias"],
        a["state"], a["state_indices"], a["query_start_loc"], a["corrections"], a["kg"],
        a["prev_lens"], lower_bound=-5.0, record_indices=a["record_indices"],
        prev_record_indices=a["prev_record_indices"], prev_corrections=a.get("pc"),
        prev_kg=a.get("pk"),
    )


def test_valid_fused_arguments_pass():
    _fused()
    # rows that are not read (nothing pending) may be written
    _fused(prev_record_indices=torch.tensor([0, 3, 2], dtype=torch.int32))


@pytest.mark.parametrize("over, pattern", [
    (dict(prev_lens=torch.tensor([2, 5, 1], dtype=torch.int32)),
     r"'prev_lens': expected values in 0..4, got \[2, 5, 1\]"),
    (dict(prev_lens=torch.tensor([2, 0], dtype=torch.int32)),
     r"'prev_lens': expected shape \[3\], got \[2\]"),
    (dict(prev_lens=torch.tensor([2.0, 0.0, 1.0])), r"'prev_lens': expected dtype"),
    (dict(prev_record_indices=torch.tensor([0, 1, 6], dtype=torch.int32)),
     r"'prev_record_indices': index 6 is out of range, expected 0..5"),
    (dict(prev_record_indices=torch.tensor([0, 1, 5], dtype=torch.int32)),
     r"'prev_record_indices': rows \[5\] are read as previous records and written"),
    (dict(prev_record_indices=None, record_indices=None),
     r"'prev_record_indices': rows \[0, 2\] are read"),
    (dict(pc=torch.zeros(N, H, W + 1, V), pk=torch.zeros(N, H, W + 1, 2 * K)),
     r"'prev_corrections': expected a window of 4 columns"),
    (dict(pc=torch.zeros(N, H, W, V), pk=torch.zeros(N, H, W, K)),
     r"'prev_kg': expected shape \[3, 2, 4, 16\], got \[3, 2, 4, 8\]"),
    (dict(pc=torch.zeros(N, H, W, V).double(), pk=torch.zeros(N, H, W, 2 * K)),
     r"'prev_corrections': expected dtype float32, got float64"),
])
def test_bad_fused_argument_is_named(over, pattern):
    with pytest.raises(ValueError, match=pattern):
        _fused(**over)


def test_fused_with_separate_previous_pools_may_reuse_rows():
    """Separate pools for the previous records: the same row numbers do not clash."""
    _fused(pc=torch.zeros(N, H, W, V), pk=torch.zeros(N, H, W, 2 * K),
           record_indices=torch.tensor([0, 1, 2], dtype=torch.int32))


def _plan(a: dict, **over) -> ops.VerifyPlan:
    kw = dict(num_slots=a["state"].shape[0], num_tokens=a["q"].shape[0], window=W,
              device=a["state"].device, record_rows=a["corrections"].shape[0])
    kw.update(over)
    return ops.plan_verify(a["state_indices"], a["query_start_loc"], **kw)


def _verify_with(a: dict, step: ops.VerifyPlan):
    return ops.verify_recovery(
        a["q"], a["k"], a["v"], a["raw_g"], a["raw_beta"], a["A_log"], a["dt_bias"],
        a["state"], a["state_indices"], a["query_start_loc"], a["corrections"], a["kg"],
        lower_bound=-5.0, step=step,
    )


def test_a_planned_step_checks_its_indices_once(monkeypatch: pytest.MonkeyPatch):
    """With a verify plan, each layer's call checks its own tensors only: the step's index
    tensors were checked (with device reads) when the plan was built, never again."""
    from vllm_recoverssm.ops import plan as plan_module

    want = _verify()
    a = _args()
    step = _plan(a)

    def no_reads(*args, **kwargs):
        raise AssertionError("a planned call read an index tensor back")

    for name in ("check_index_range", "check_query_start_loc", "check_step_values",
                 "check_rows"):
        monkeypatch.setattr(plan_module, name, no_reads)
    for _ in range(2):  # two layers of one step
        assert torch.equal(_verify_with(a, step), want)


def test_a_planned_step_still_names_bad_arguments():
    a = _args()
    step = _plan(a)
    # the step-wide checks run when the plan is built, with the usual messages
    with pytest.raises(ValueError, match=r"'state_indices': index 6 is out of range"):
        ops.plan_verify(
            torch.tensor([0, 6, 1], dtype=torch.int32), a["query_start_loc"], num_slots=6,
            num_tokens=a["q"].shape[0], window=W, device=a["state"].device)
    with pytest.raises(ValueError, match=r"'query_start_loc': a request has 5 tokens"):
        ops.plan_verify(a["state_indices"], torch.tensor([0, 5, 6, 7], dtype=torch.int32),
                        num_slots=6, num_tokens=7, window=W, device=a["state"].device)
    # a layer's own tensors are still checked in full
    with pytest.raises(ValueError, match=r"'v': expected shape \[7, 2, 8\]"):
        _verify_with(_args(v=torch.zeros(7, H, V + 1)), step)
    # a call that does not match its plan is refused, naming what differs
    other = _args(state_indices=torch.tensor([0, 3, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"'step': planned with another 'state_indices'"):
        _verify_with(other, step)
    small = dict(a, state=make_state(4, H, V, K))
    with pytest.raises(ValueError, match=r"'state': the step was planned for at least 6 slots"):
        _verify_with(small, step)
    few = dict(a, corrections=torch.zeros(2, H, W, V), kg=torch.zeros(2, H, W, 2 * K))
    with pytest.raises(ValueError, match=r"'corrections': the step was planned for at least "
                                         r"3 record rows, got 2"):
        _verify_with(few, step)


def test_a_fused_plan_checks_shared_record_rows():
    a = _args(corrections=torch.zeros(2 * N, H, W, V), kg=torch.zeros(2 * N, H, W, 2 * K))
    lens = torch.tensor([2, 0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"'prev_record_indices': rows \[5\] are read"):
        ops.plan_verify(a["state_indices"], a["query_start_loc"], num_slots=6, num_tokens=7,
                        window=W, device=a["state"].device,
                        record_indices=torch.tensor([3, 4, 5], dtype=torch.int32),
                        record_rows=2 * N, prev_lens=lens,
                        prev_record_indices=torch.tensor([0, 1, 5], dtype=torch.int32),
                        prev_record_rows=2 * N, prev_shares_pool=True)
    ridx = torch.tensor([3, 4, 5], dtype=torch.int32)
    pridx = torch.tensor([0, 1, 2], dtype=torch.int32)
    separate = ops.plan_verify(a["state_indices"], a["query_start_loc"], num_slots=6,
                               num_tokens=7, window=W, device=a["state"].device,
                               record_indices=ridx, record_rows=2 * N, prev_lens=lens,
                               prev_record_indices=pridx, prev_record_rows=2 * N)
    with pytest.raises(ValueError, match=r"'step': planned with separate previous record"):
        ops.verify_fused(
            a["q"], a["k"], a["v"], a["raw_g"], a["raw_beta"], a["A_log"], a["dt_bias"],
            a["state"], a["state_indices"], a["query_start_loc"], a["corrections"], a["kg"],
            lens, lower_bound=-5.0, record_indices=ridx, prev_record_indices=pridx,
            step=separate)
