"""Property tests of the PyTorch reference against an independent element-wise oracle."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from tests.support.kda_batches import make_batch, make_state
from vllm_recoverssm import ops
from vllm_recoverssm.ops import reference as ref

F64 = torch.float64
SETTINGS = settings(max_examples=25, deadline=None)


def naive_step(S, q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound):
    """DESIGN.md section 2 written out element by element in float64 Python floats."""
    H, V, K = len(S), len(S[0]), len(S[0][0])
    out = []
    for h in range(H):
        kn = math.sqrt(sum(x * x for x in k[h]) + 1e-6)
        qn = math.sqrt(sum(x * x for x in q[h]) + 1e-6)
        kh = [x / kn for x in k[h]]
        qh = [x / qn * K**-0.5 for x in q[h]]
        a = []
        for j in range(K):
            x = raw_g[h][j] + dt_bias[h][j]
            if lower_bound is None:
                sp = math.log1p(math.exp(x)) if x < 20 else x
                g = -math.exp(A_log[h]) * sp
            else:
                g = lower_bound / (1.0 + math.exp(-math.exp(A_log[h]) * x))
            a.append(math.exp(g))
        b = 1.0 / (1.0 + math.exp(-raw_beta[h]))
        for i in range(V):
            S[h][i] = [S[h][i][j] * a[j] for j in range(K)]
        c = [b * (v[h][i] - sum(S[h][i][j] * kh[j] for j in range(K))) for i in range(V)]
        for i in range(V):
            S[h][i] = [S[h][i][j] + c[i] * kh[j] for j in range(K)]
        out.append([sum(S[h][i][j] * qh[j] for j in range(K)) for i in range(V)])
    return out


lens_strategy = st.lists(st.integers(1, 4), min_size=1, max_size=3)


@SETTINGS
@given(lens=lens_strategy, seed=st.integers(0, 10_000), bounded=st.booleans())
def test_verify_outputs_equal_naive_stepping(lens, seed, bounded):
    H, K, V = 2, 4, 3
    lb = -5.0 if bounded else None
    b = make_batch(lens, H, K, V, seed=seed).to(F64)
    state = make_state(len(lens), H, V, K, seed=seed + 1).double()
    N, W = len(lens), 4
    corr = torch.zeros(N, H, W, V, dtype=F64)
    kg = torch.zeros(N, H, W, 2 * K, dtype=F64)
    idx = torch.arange(N, dtype=torch.int32)
    out = ops.verify_recovery(*b.tokens()[:5], b.A_log.double(), b.dt_bias.double(), state,
                              idx, b.query_start_loc, corr, kg, lower_bound=lb)
    for i, (s0, s1) in enumerate(zip(b.query_start_loc[:-1], b.query_start_loc[1:], strict=True)):
        S = state[i].tolist()
        for t in range(int(s0), int(s1)):
            o = naive_step(S, b.q[t].tolist(), b.k[t].tolist(), b.v[t].tolist(),
                           b.raw_g[t].tolist(), b.raw_beta[t].tolist(), b.A_log.tolist(),
                           b.dt_bias.tolist(), lb)
            assert torch.allclose(out[t], torch.tensor(o, dtype=F64), atol=1e-12)


@SETTINGS
@given(lens=lens_strategy, seed=st.integers(0, 10_000), bounded=st.booleans(),
       data=st.data())
def test_commit_n_equals_stepping_n_times(lens, seed, bounded, data):
    H, K, V = 2, 8, 4
    lb = -5.0 if bounded else None
    b = make_batch(lens, H, K, V, seed=seed).to(F64)
    N, W = len(lens), 8
    state = make_state(N, H, V, K, seed=seed + 1).double()
    corr = torch.zeros(N, H, W, V, dtype=F64)
    kg = torch.zeros(N, H, W, 2 * K, dtype=F64)
    idx = torch.arange(N, dtype=torch.int32)
    ops.verify_recovery(*b.tokens()[:5], b.A_log.double(), b.dt_bias.double(), state, idx,
                        b.query_start_loc, corr, kg, lower_bound=lb)
    n_acc = [data.draw(st.integers(0, n)) for n in lens]
    committed = state.clone()
    ops.commit(committed, corr, kg, b.A_log.double(), b.dt_bias.double(),
               ops.CommitPlan(idx, torch.tensor(n_acc, dtype=torch.int32)), lower_bound=lb)
    for i, n in enumerate(n_acc):
        s = state[i]
        start = int(b.query_start_loc[i])
        for t in range(start, start + n):
            _, s, _ = ref.kda_step(s, b.q[t], b.k[t], b.v[t], b.raw_g[t], b.raw_beta[t],
                                   b.A_log.double(), b.dt_bias.double(), lb)
        assert torch.allclose(committed[i], s, atol=1e-12)


@SETTINGS
@given(n=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_forward_commit_equals_closed_form(n, seed):
    """Records are exact: the reverse-accumulated closed form gives the same state."""
    H, K, V = 1, 6, 5
    b = make_batch([n], H, K, V, seed=seed).to(F64)
    state = make_state(1, H, V, K, seed=seed).double()
    corr = torch.zeros(1, H, 8, V, dtype=F64)
    kg = torch.zeros(1, H, 8, 2 * K, dtype=F64)
    idx = torch.zeros(1, dtype=torch.int32)
    ops.verify_recovery(*b.tokens()[:5], b.A_log.double(), b.dt_bias.double(), state, idx,
                        b.query_start_loc, corr, kg, lower_bound=-5.0)
    committed = state.clone()
    ops.commit(committed, corr, kg, b.A_log.double(), b.dt_bias.double(),
               ops.CommitPlan(idx, torch.tensor([n], dtype=torch.int32)), lower_bound=-5.0)
    decay_after = torch.ones(H, K, dtype=F64)
    acc = torch.zeros(H, V, K, dtype=F64)
    for t in reversed(range(n)):
        kh = ref.l2_normalize(kg[0, :, t, :K])
        a = torch.exp(ref.kda_gate(kg[0, :, t, K:], b.A_log.double(), b.dt_bias.double(), -5.0))
        acc += corr[0, :, t, :, None] * (kh * decay_after)[:, None, :]
        decay_after = decay_after * a
    closed = state[0] * decay_after[:, None, :] + acc
    assert torch.allclose(committed[0], closed, atol=1e-12)


@SETTINGS
@given(lens=lens_strategy, seed=st.integers(0, 10_000), bounded=st.booleans())
def test_float32_reference_close_to_float64(lens, seed, bounded):
    H, K, V = 2, 16, 8
    lb = -5.0 if bounded else None
    b = make_batch(lens, H, K, V, seed=seed)
    N = len(lens)
    s32 = make_state(N, H, V, K, seed=seed + 1)
    s64 = s32.double()
    idx = torch.arange(N, dtype=torch.int32)
    qsl = b.query_start_loc
    o32 = ref.prefill(*b.tokens(), s32, idx, qsl, lb)
    b64 = b.to(F64)
    o64 = ref.prefill(*b64.tokens()[:5], b.A_log.double(), b.dt_bias.double(), s64, idx, qsl, lb)
    assert (o32.double() - o64).abs().max() <= 1e-5
    assert (s32.double() - s64).abs().max() <= 1e-5


@SETTINGS
@given(lens=lens_strategy, seed=st.integers(0, 10_000), data=st.data())
def test_full_state_column_n_equals_recovery_commit_n(lens, seed, data):
    H, K, V, W = 2, 8, 4, 4
    b = make_batch(lens, H, K, V, seed=seed).to(F64)
    N = len(lens)
    base = make_state(N, H, V, K, seed=seed).double()
    n_prev = [data.draw(st.integers(1, W)) for _ in lens]
    pool = torch.zeros(N * W, H, V, K, dtype=F64)
    cols = torch.arange(N * W, dtype=torch.int32).view(N, W)
    for i in range(N):
        pool[cols[i, n_prev[i] - 1]] = base[i]
    ops.verify_full(*b.tokens()[:5], b.A_log.double(), b.dt_bias.double(), pool, cols,
                    torch.tensor(n_prev, dtype=torch.int32), b.query_start_loc, lower_bound=-5.0)
    corr = torch.zeros(N, H, W, V, dtype=F64)
    kg = torch.zeros(N, H, W, 2 * K, dtype=F64)
    idx = torch.arange(N, dtype=torch.int32)
    ops.verify_recovery(*b.tokens()[:5], b.A_log.double(), b.dt_bias.double(), base, idx,
                        b.query_start_loc, corr, kg, lower_bound=-5.0)
    n_acc = [data.draw(st.integers(1, n)) for n in lens]
    ops.commit(base, corr, kg, b.A_log.double(), b.dt_bias.double(),
               ops.CommitPlan(idx, torch.tensor(n_acc, dtype=torch.int32)), lower_bound=-5.0)
    for i, n in enumerate(n_acc):
        assert torch.allclose(pool[cols[i, n - 1]], base[i], atol=1e-12)


@SETTINGS
@given(prefix=st.integers(0, 5), spec=st.integers(1, 4), seed=st.integers(0, 10_000),
       data=st.data())
def test_conv_update_and_compaction_match_whole_sequence(prefix, spec, seed, data):
    """Prefill + spec update + compaction == one causal conv over the accepted sequence."""
    C, Kc, S = 5, 4, 3
    spec = min(spec, S + 1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(prefix + spec, C, generator=gen, dtype=F64)
    w = torch.randn(C, Kc, generator=gen, dtype=F64)
    bias = torch.randn(C, generator=gen, dtype=F64)
    cs = torch.zeros(1, C, Kc - 1 + S, dtype=F64)
    idx = torch.zeros(1, dtype=torch.int32)
    ref.conv_prefill(x[:prefix], cs, w, bias, idx, torch.tensor([0, prefix]))
    y = ops.conv_update(x[prefix:], cs, w, bias, idx, torch.tensor([0, spec], dtype=torch.int32))
    whole = torch.zeros(1, C, Kc - 1 + S, dtype=F64)
    y_all = ref.conv_prefill(x, whole, w, bias, idx, torch.tensor([0, prefix + spec]))
    assert torch.allclose(y, y_all[prefix:], atol=1e-12)
    n = data.draw(st.integers(1, spec))
    ops.conv_compact(cs, ops.CommitPlan(idx, torch.tensor([n], dtype=torch.int32)),
                     kernel_width=Kc)
    accepted = torch.zeros(1, C, Kc - 1 + S, dtype=F64)
    ref.conv_prefill(x[: prefix + n], accepted, w, bias, idx, torch.tensor([0, prefix + n]))
    assert torch.equal(cs[..., : Kc - 1], accepted[..., : Kc - 1])


def test_full_state_conv_offset_path_equals_compaction():
    """Reading the history at offset n-1 (full-state) equals compacting first (recovery)."""
    C, Kc, S = 4, 4, 3
    gen = torch.Generator().manual_seed(3)
    x1, x2 = torch.randn(4, C, generator=gen), torch.randn(4, C, generator=gen)
    w = torch.randn(C, Kc, generator=gen)
    cs = torch.randn(1, C, Kc - 1 + S, generator=gen)
    idx = torch.zeros(1, dtype=torch.int32)
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    for n in range(1, 5):
        a, b = cs.clone(), cs.clone()
        ops.conv_update(x1, a, w, None, idx, qsl)
        ops.conv_update(x1, b, w, None, idx, qsl)
        ops.conv_compact(b, ops.CommitPlan(idx, torch.tensor([n], dtype=torch.int32)),
                         kernel_width=Kc)
        ya = ops.conv_update(x2, a, w, None, idx, qsl,
                             conv_offsets=torch.tensor([n - 1], dtype=torch.int32))
        yb = ops.conv_update(x2, b, w, None, idx, qsl)
        assert torch.equal(ya, yb)


def test_capture_boundary_copies_column_and_conv_history():
    H, K, V = 1, 4, 4
    pool = make_state(10, H, V, K)
    cols = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    conv = torch.arange(10 * 2 * 6, dtype=torch.float32).view(10, 2, 6)
    ref.capture_boundary(pool, conv, cols, torch.tensor([9]), torch.tensor([3]))
    assert torch.equal(pool[9], pool[2])
    assert torch.equal(conv[9, :, :3], conv[0, :, 2:5])


def test_null_slot_reads_and_writes_nothing():
    H, K, V = 2, 4, 4
    b = make_batch([2, 3], H, K, V).to(F64)
    state = make_state(2, H, V, K).double()
    before = state.clone()
    corr = torch.full((2, H, 4, V), 7.0, dtype=F64)
    kg = torch.full((2, H, 4, 2 * K), 7.0, dtype=F64)
    idx = torch.tensor([-1, 1], dtype=torch.int32)
    out = ops.verify_recovery(*b.tokens()[:5], b.A_log.double(), b.dt_bias.double(), state, idx,
                              b.query_start_loc, corr, kg, lower_bound=-5.0)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert (corr[0] == 7.0).all() and (kg[0] == 7.0).all()
    ops.commit(state, corr, kg, b.A_log.double(), b.dt_bias.double(),
               ops.CommitPlan(idx, torch.tensor([2, 0], dtype=torch.int32)), lower_bound=-5.0)
    assert torch.equal(state, before)
