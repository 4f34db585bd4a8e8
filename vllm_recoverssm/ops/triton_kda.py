"""Triton kernels for KDA speculative verify (recovery and full-state) and commit.

Verify does not step the T <= 8 tokens serially. With ``G_t`` the cumulative log-decay,
``k^, q^`` the normalised keys and queries and ``S0`` the checkpoint, the corrections
``c_t = b_t (v_t - S_{t-1} diag(a_t) k^_t)`` satisfy

    c_t = b_t (v_t - S0 (e^{G_t} k^_t) - sum_{j<t} c_j M_jt),
    M_jt = sum_k k^_j[k] k^_t[k] e^{G_t[k] - G_j[k]}                      (no S0 in it)
    o_t = S0 (e^{G_t} q^_t) + sum_{j<=t} c_j N_jt,  N_jt likewise with q^_t.

So one pass over the state tile computes ``S0 @ [e^G k^ | e^G q^]`` (a [BV, K] x [K, 16]
product), and the token recurrence shrinks to a unit-triangular 8x8 system per head,
solved as ``(I + N)^-1 = (I - N)(I + N^2)(I + N^4)`` (N is nilpotent). This removes the
per-token reduction chain that makes a serial verify latency-bound. Commit replays the
accepted records in forward order, ``S = S diag(a_t) + c_t k^_t^T``, as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .api import CommitPlan

# Tokens per request per step (S+1 <= 8) and the packed width [k-columns | q-columns].
MAX_TOKENS = 8
PACKED = 16


@triton.jit
def _gate(raw_g, a_coef, dt_bias, LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr):
    x = raw_g + dt_bias
    if BOUNDED:
        g = LOWER_BOUND * tl.sigmoid(a_coef * x)
    else:
        # softplus with the usual linear tail for large inputs (no overflow in exp)
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -a_coef * sp
    return g


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    alog_ptr, dtb_ptr,
    state_ptr, stride_state_slot,
    sidx_ptr, nacc_ptr, qsl_ptr,
    corr_ptr, stride_corr_row, kg_ptr, stride_kg_row, ridx_ptr,
    out_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    NCOLS: tl.constexpr,
    LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr,
    FULL_STATE: tl.constexpr, HAS_RIDX: tl.constexpr, EPS: tl.constexpr, SCALE: tl.constexpr,
):
    pid_v = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(qsl_ptr + n).to(tl.int64)
    ntok = tl.load(qsl_ptr + n + 1).to(tl.int64) - start
    if ntok <= 0:
        return

    vv = pid_v * BV + tl.arange(0, BV)  # V rows of this program
    kk = tl.arange(0, K)
    cols = tl.arange(0, 16)  # packed columns: 0..7 keys of tokens 0..7, 8..15 queries
    tok = cols % 8
    is_q = cols >= 8
    tok_ok = tok < ntok

    if FULL_STATE:
        nacc = tl.load(nacc_ptr + n)
        slot = tl.load(sidx_ptr + n * NCOLS + nacc - 1).to(tl.int64)
    else:
        slot = tl.load(sidx_ptr + n).to(tl.int64)

    # Output tile [BV, 16]: column 8 + t holds token t's output rows.
    o_ptrs = out_ptr + ((start + tok)[None, :] * H + h) * V + vv[:, None]
    o_mask = is_q[None, :] & tok_ok[None, :]
    if slot < 0:
        zero = tl.zeros([BV, 16], dtype=tl.float32)
        tl.store(o_ptrs, zero.to(out_ptr.dtype.element_ty), mask=o_mask)
        return

    # ---- token-side quantities, shared by all V rows ------------------------------------
    row_off = ((start + tok) * H + h) * K
    x_ptrs = tl.where(is_q[:, None], q_ptr, k_ptr) + row_off[:, None] + kk[None, :]
    x = tl.load(x_ptrs, mask=tok_ok[:, None], other=0.0).to(tl.float32)  # [16, K]
    xn = x / tl.sqrt(tl.sum(x * x, axis=1) + EPS)[:, None]
    xn = tl.where(is_q[:, None], xn * SCALE, xn)
    raw_g = tl.load(g_ptr + row_off[:, None] + kk[None, :], mask=tok_ok[:, None], other=0.0)
    a_coef = tl.exp(tl.load(alog_ptr + h))
    dtb = tl.load(dtb_ptr + h * K + kk)
    g = _gate(raw_g.to(tl.float32), a_coef, dtb[None, :], LOWER_BOUND, BOUNDED)
    g = tl.where(tok_ok[:, None] & (cols < 8)[:, None], g, 0.0)  # one copy per token
    # cumulative log-decay per packed row: G[r] = sum_{j <= tok(r)} g[j]
    cum = ((cols[None, :] <= tok[:, None]) & (cols[None, :] < 8)).to(tl.float32)
    G = tl.dot(cum, g, input_precision="ieee")  # [16, K]
    wd = xn * tl.exp(G)  # rows: e^{G_t} k^_t | e^{G_t} q^_t

    # pairwise token coefficients A[j, c] = sum_k k^_j e^{G_c - G_j} x^_c  (j < 8)
    key_row = cols < 8
    if BOUNDED:
        # |G| <= 8 * |lower_bound|, so e^{-G} cannot overflow
        kinv = tl.where(key_row[:, None] & tok_ok[:, None], xn * tl.exp(-G), 0.0)
        A = tl.dot(kinv, tl.trans(wd), input_precision="ieee")  # [16, 16]
    else:
        kj = tl.where(key_row[:, None], xn, 0.0)
        # pairs with c before j are masked out below; clamp so they stay finite
        ratio = tl.exp(tl.minimum(G[None, :, :] - G[:, None, :], 0.0))  # [j, c, K]
        A = tl.sum(kj[:, None, :] * ratio * xn[None, :, :], axis=2)

    beta_raw = tl.load(beta_ptr + (start + tok) * H + h, mask=tok_ok & (cols < 8), other=0.0)
    beta = tl.where(tok_ok & (cols < 8), tl.sigmoid(beta_raw.to(tl.float32)), 0.0)
    jj = cols[:, None]
    cc = cols[None, :]
    # N = strict-upper key block scaled by beta of the later token; Linv = (I + N)^-1
    nmat = tl.where((jj < cc) & (cc < 8), A, 0.0) * beta[None, :]
    eye = (jj == cc).to(tl.float32)
    n2 = tl.dot(nmat, nmat, input_precision="ieee")
    n4 = tl.dot(n2, n2, input_precision="ieee")
    linv = tl.dot(tl.dot(eye - nmat, eye + n2, input_precision="ieee"), eye + n4,
                  input_precision="ieee")
    # output mixing: columns 8 + t take c_j for j <= t
    mq = tl.where((cc >= 8) & (jj <= cc - 8) & (jj < 8), A, 0.0)

    # ---- state side --------------------------------------------------------------------
    s_ptrs = state_ptr + slot * stride_state_slot + (h * V + vv[:, None]) * K + kk[None, :]
    s0 = tl.load(s_ptrs)
    p = tl.dot(s0, tl.trans(wd), input_precision="ieee")  # [BV, 16]
    v_ptrs = v_ptr + ((start + tok)[None, :] * H + h) * V + vv[:, None]
    vt = tl.load(v_ptrs, mask=(cols < 8)[None, :] & tok_ok[None, :], other=0.0).to(tl.float32)
    resid = tl.where((cols < 8)[None, :] & tok_ok[None, :], vt - p, 0.0)
    corr = tl.dot(resid * beta[None, :], linv, input_precision="ieee")  # [BV, 16]
    out = p + tl.dot(corr, mq, input_precision="ieee")
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)

    if FULL_STATE:
        # Forward replay, writing the state after every token into its column.
        s = s0
        for t in tl.static_range(8):
            if t < ntok:
                c_t = tl.sum(tl.where(cc == t, corr, 0.0), axis=1)
                k_t = tl.sum(tl.where(jj == t, xn, 0.0), axis=0)
                a_t = tl.exp(tl.sum(tl.where(jj == t, g, 0.0), axis=0))
                s = s * a_t[None, :] + c_t[:, None] * k_t[None, :]
                dst = tl.load(sidx_ptr + n * NCOLS + t).to(tl.int64)
                if dst >= 0:
                    d_ptrs = (state_ptr + dst * stride_state_slot
                              + (h * V + vv[:, None]) * K + kk[None, :])
                    tl.store(d_ptrs, s)
    else:
        if HAS_RIDX:
            rrow = tl.load(ridx_ptr + n).to(tl.int64)
        else:
            rrow = n.to(tl.int64)
        if rrow >= 0:
            c_ptrs = (corr_ptr + rrow * stride_corr_row
                      + ((h * NCOLS + tok[None, :]) * V) + vv[:, None])
            tl.store(c_ptrs, corr, mask=(cols < 8)[None, :] & tok_ok[None, :])
            if pid_v == 0:
                kg_row = kg_ptr + rrow * stride_kg_row + (h * NCOLS + tok) * (2 * K)
                m = (cols < 8) & tok_ok
                raw_k = tl.load(k_ptr + row_off[:, None] + kk[None, :], mask=m[:, None])
                tl.store(kg_row[:, None] + kk[None, :], raw_k.to(kg_ptr.dtype.element_ty),
                         mask=m[:, None])
                tl.store(kg_row[:, None] + K + kk[None, :], raw_g.to(kg_ptr.dtype.element_ty),
                         mask=m[:, None])


@triton.jit
def _commit_kernel(
    state_tab, state_stride_tab, corr_tab, corr_stride_tab, kg_tab, kg_stride_tab,
    alog_ptr, dtb_ptr,
    sidx_ptr, clen_ptr, fidx_ptr, bidx_ptr, blen_ptr, ridx_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    NCOLS: tl.constexpr,
    LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr,
    HAS_FINAL: tl.constexpr, HAS_BOUNDARY: tl.constexpr, HAS_RIDX: tl.constexpr,
    EPS: tl.constexpr, KG_DTYPE: tl.constexpr,
):
    pid_v = tl.program_id(0)
    n = tl.program_id(1)
    lh = tl.program_id(2)
    layer = lh // H
    h = lh % H
    src = tl.load(sidx_ptr + n).to(tl.int64)
    if src < 0:
        return
    clen = tl.load(clen_ptr + n)
    if HAS_FINAL:
        dst = tl.load(fidx_ptr + n).to(tl.int64)
    else:
        dst = src
    if HAS_BOUNDARY:
        bslot = tl.load(bidx_ptr + n).to(tl.int64)
        blen = tl.load(blen_ptr + n)
    else:
        bslot = -1
        blen = 0
    if (clen == 0) & (dst == src):
        return
    if HAS_RIDX:
        rrow = tl.load(ridx_ptr + n).to(tl.int64)
    else:
        rrow = n.to(tl.int64)

    state_ptr = tl.load(state_tab + layer).to(tl.pointer_type(tl.float32))
    s_stride = tl.load(state_stride_tab + layer)
    corr_ptr = tl.load(corr_tab + layer).to(tl.pointer_type(tl.float32))
    c_stride = tl.load(corr_stride_tab + layer)
    kg_ptr = tl.load(kg_tab + layer).to(tl.pointer_type(KG_DTYPE))
    kg_stride = tl.load(kg_stride_tab + layer)

    vv = pid_v * BV + tl.arange(0, BV)
    kk = tl.arange(0, K)
    tile = (h * V + vv[:, None]) * K + kk[None, :]
    s = tl.load(state_ptr + src * s_stride + tile)
    a_coef = tl.exp(tl.load(alog_ptr + layer * H + h))
    dtb = tl.load(dtb_ptr + (layer * H + h) * K + kk)
    for t in range(0, clen):
        kg_row = kg_ptr + rrow * kg_stride + (h * NCOLS + t) * (2 * K)
        raw_k = tl.load(kg_row + kk).to(tl.float32)
        raw_g = tl.load(kg_row + K + kk).to(tl.float32)
        c_t = tl.load(corr_ptr + rrow * c_stride + (h * NCOLS + t) * V + vv)
        k_t = raw_k / tl.sqrt(tl.sum(raw_k * raw_k, axis=0) + EPS)
        a_t = tl.exp(_gate(raw_g, a_coef, dtb, LOWER_BOUND, BOUNDED))
        s = s * a_t[None, :] + c_t[:, None] * k_t[None, :]
        if HAS_BOUNDARY:
            if (bslot >= 0) & (t + 1 == blen):
                tl.store(state_ptr + bslot * s_stride + tile, s)
    if dst >= 0:
        tl.store(state_ptr + dst * s_stride + tile, s)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _block_v(num_programs_without_v: int, V: int) -> int:
    # Small batches split V finer so that enough programs fill the GPU.
    bv = 32 if num_programs_without_v >= 2048 else 16
    return min(bv, V)


def _check_kernel_dtypes(state: torch.Tensor) -> None:
    if state.dtype != torch.float32:
        raise ValueError(
            f"argument 'state': the Triton kernels expect float32 state, got {state.dtype}; "
            "use backend='reference' for float64"
        )


def _check_head_dims(K: int, V: int) -> None:
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d & (d - 1):
            raise ValueError(
                f"argument 'state': the Triton kernels need a power-of-two head dim {name} "
                f">= 16, got {d}"
            )


def _verify_launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, num_accepted: torch.Tensor | None,
    query_start_loc: torch.Tensor, corrections: torch.Tensor | None, kg: torch.Tensor | None,
    lower_bound: float | None, record_indices: torch.Tensor | None, ncols: int,
) -> torch.Tensor:
    _check_kernel_dtypes(state)
    _, H, V, K = state.shape
    _check_head_dims(K, V)
    N = query_start_loc.shape[0] - 1
    # zeros: tokens past query_start_loc[-1] belong to no request and read as 0
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    bv = _block_v(N * H, V)
    full = corrections is None
    dummy = state_indices
    grid = (V // bv, N, H)
    _verify_kernel[grid](
        q, k, v, raw_g, raw_beta,
        A_log.float().contiguous(), dt_bias.float().contiguous(),
        state, state.stride(0),
        state_indices, num_accepted if num_accepted is not None else dummy, query_start_loc,
        corrections if corrections is not None else state,
        corrections.stride(0) if corrections is not None else 0,
        kg if kg is not None else q, kg.stride(0) if kg is not None else 0,
        record_indices if record_indices is not None else dummy,
        out,
        H=H, K=K, V=V, BV=bv, NCOLS=ncols,
        LOWER_BOUND=float(lower_bound) if lower_bound is not None else 0.0,
        BOUNDED=lower_bound is not None,
        FULL_STATE=full, HAS_RIDX=record_indices is not None,
        EPS=1e-6, SCALE=K**-0.5,
        num_warps=4,
    )
    return out


def verify_recovery_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
    corrections: torch.Tensor, kg: torch.Tensor, lower_bound: float | None,
    record_indices: torch.Tensor | None,
) -> torch.Tensor:
    """Recovery verify kernel launch (arguments as :func:`api.verify_recovery`)."""
    return _verify_launch(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, None,
        query_start_loc, corrections, kg, lower_bound, record_indices, corrections.shape[2],
    )


def verify_full_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, num_accepted: torch.Tensor,
    query_start_loc: torch.Tensor, lower_bound: float | None,
) -> torch.Tensor:
    """Full-state verify kernel launch (arguments as :func:`api.verify_full`)."""
    return _verify_launch(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, num_accepted,
        query_start_loc, None, None, lower_bound, None, state_indices.shape[1],
    )


def _address_table(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    dev = tensors[0].device
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=dev)
    strides = torch.tensor([t.stride(0) for t in tensors], dtype=torch.int64, device=dev)
    return ptrs, strides


class CommitTables:
    """Per-layer base addresses and slot strides for the one-launch commit.

    Building the tables costs a host-to-device copy; a caller that commits every step
    into the same pools (a serving engine, a CUDA graph) builds them once and reuses them.
    """

    def __init__(
        self, states: list[torch.Tensor], corrections: list[torch.Tensor],
        kg: list[torch.Tensor],
    ) -> None:
        self.states = states
        self.corrections = corrections
        self.kg = kg
        self.state_ptrs, self.state_strides = _address_table(states)
        self.corr_ptrs, self.corr_strides = _address_table(corrections)
        self.kg_ptrs, self.kg_strides = _address_table(kg)


def commit_triton(
    states: list[torch.Tensor], corrections: list[torch.Tensor], kg: list[torch.Tensor],
    A_log: torch.Tensor, dt_bias: torch.Tensor, plan: CommitPlan,
    lower_bound: float | None, record_indices: torch.Tensor | None,
    tables: CommitTables | None = None,
) -> None:
    """One launch commits every layer (arguments as :func:`api.commit`)."""
    _check_kernel_dtypes(states[0])
    if kg[0].dtype not in _TL_DTYPES:
        raise ValueError(f"argument 'kg': unsupported dtype {kg[0].dtype} for the kernel")
    _, H, V, K = states[0].shape
    _check_head_dims(K, V)
    L = len(states)
    N = plan.num_rows
    if N == 0:
        return
    if tables is None:
        tables = CommitTables(states, corrections, kg)
    bv = _block_v(N * H * L, V)
    si = plan.state_indices
    grid = (V // bv, N, L * H)
    _commit_kernel[grid](
        tables.state_ptrs, tables.state_strides, tables.corr_ptrs, tables.corr_strides,
        tables.kg_ptrs, tables.kg_strides,
        A_log.float().contiguous(), dt_bias.float().contiguous(),
        si, plan.commit_lens,
        plan.final_indices if plan.final_indices is not None else si,
        plan.boundary_indices if plan.boundary_indices is not None else si,
        plan.boundary_lens if plan.boundary_lens is not None else si,
        record_indices if record_indices is not None else si,
        H=H, K=K, V=V, BV=bv, NCOLS=corrections[0].shape[2],
        LOWER_BOUND=float(lower_bound) if lower_bound is not None else 0.0,
        BOUNDED=lower_bound is not None,
        HAS_FINAL=plan.final_indices is not None,
        HAS_BOUNDARY=plan.boundary_indices is not None,
        HAS_RIDX=record_indices is not None,
        EPS=1e-6, KG_DTYPE=_TL_DTYPES[kg[0].dtype],
        num_warps=4,
    )
