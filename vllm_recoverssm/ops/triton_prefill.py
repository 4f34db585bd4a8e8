"""Triton kernels for prompt rows: the sequential KDA recurrence and the short conv.

Semantics are those of :func:`reference.prefill` and :func:`reference.conv_prefill`. A
prompt row has any length, so both kernels loop over its tokens at run time with the
carried state in registers: the KDA state as a ``[BV, K]`` tile per program (one head,
``BV`` value rows), the conv history as ``Kc - 1`` columns of one channel block. The
per-token arithmetic is that of the serial verify (:mod:`.triton_kda`): the same gate,
float64 key norm, decay-then-fma order, so splitting a row into segments (state taps)
gives the same bits as one call over it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_math import TL_DTYPES, gate, unit


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr,
    state_ptr, stride_state_slot, sidx_ptr, qsl_ptr, out_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr, EPS: tl.constexpr,
    SCALE: tl.constexpr,
):
    pid_v = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(qsl_ptr + n).to(tl.int64)
    end = tl.load(qsl_ptr + n + 1).to(tl.int64)
    slot = tl.load(sidx_ptr + n).to(tl.int64)
    if (slot < 0) | (end <= start):
        return  # the caller's output is zero-filled: null rows read and write nothing
    vv = pid_v * BV + tl.arange(0, BV)
    kk = tl.arange(0, K)
    tile = (h * V + vv[:, None]) * K + kk[None, :]
    s = tl.load(state_ptr + slot * stride_state_slot + tile)
    a_coef = tl.exp(tl.load(alog_ptr + h))
    dtb = tl.load(dtb_ptr + h * K + kk)
    for t in range(start, end):
        row = t * H + h
        kh = unit(tl.load(k_ptr + row * K + kk).to(tl.float32), EPS)
        qh = unit(tl.load(q_ptr + row * K + kk).to(tl.float32), EPS) * SCALE
        a = tl.exp(gate(tl.load(g_ptr + row * K + kk).to(tl.float32), a_coef, dtb,
                        LOWER_BOUND, BOUNDED))
        v_t = tl.load(v_ptr + row * V + vv).to(tl.float32)
        b_t = tl.sigmoid(tl.load(beta_ptr + row).to(tl.float32))
        s = s * a[None, :]
        c_t = b_t * (v_t - tl.sum(s * kh[None, :], axis=1))
        s = tl.fma(c_t[:, None], kh[None, :], s)
        o_t = tl.sum(s * qh[None, :], axis=1)
        tl.store(out_ptr + row * V + vv, o_t.to(out_ptr.dtype.element_ty))
    tl.store(state_ptr + slot * stride_state_slot + tile, s)


def prefill_block_v(rows: int, heads: int, V: int) -> int:
    """Value rows per program: 16 for a batch with few programs (more of them then share
    the GPU), 32 otherwise (a [32, K] fp32 tile is 32 registers a thread at K = 128 with
    4 warps). Not tuned: prompt rows are off the decode path this project measures."""
    return min(V, 16 if rows * heads <= 64 else 32)


def prefill_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
    state_indices: torch.Tensor, query_start_loc: torch.Tensor, lower_bound: float | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """One launch over every prompt row (arguments as :func:`api.prefill`)."""
    _, H, V, K = state.shape
    N = query_start_loc.shape[0] - 1
    out = torch.zeros(v.shape, dtype=out_dtype, device=v.device)
    if N == 0 or q.shape[0] == 0:
        return out
    bv = prefill_block_v(N, H, V)
    _prefill_kernel[(V // bv, N, H)](
        q, k, v, raw_g, raw_beta, A_log.float().contiguous(), dt_bias.float().contiguous(),
        state, state.stride(0), state_indices, query_start_loc, out,
        H=H, K=K, V=V, BV=bv,
        LOWER_BOUND=float(lower_bound) if lower_bound is not None else 0.0,
        BOUNDED=lower_bound is not None, EPS=1e-6, SCALE=K**-0.5, num_warps=4,
    )
    return out


@triton.jit
def _conv_prefill_kernel(
    x_ptr, cs_ptr, stride_cs_slot, stride_cs_ch, w_ptr, b_ptr, y_ptr,
    sidx_ptr, qsl_ptr, C, KC: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    pid_c = tl.program_id(0)
    n = tl.program_id(1)
    start = tl.load(qsl_ptr + n).to(tl.int64)
    end = tl.load(qsl_ptr + n + 1).to(tl.int64)
    slot = tl.load(sidx_ptr + n).to(tl.int64)
    if (slot < 0) | (end <= start):
        return
    ch = pid_c * BC + tl.arange(0, BC)
    cmask = ch < C
    hist_ptr = cs_ptr + slot * stride_cs_slot + ch * stride_cs_ch
    # The history columns h0 (oldest) .. h2 of a width-4 conv (KC <= 4, checked by the
    # caller, api.CONV_PREFILL_MAX_WIDTH); unused ones stay zero and are never weighted.
    h0 = tl.zeros([BC], dtype=tl.float32)
    h1 = tl.zeros([BC], dtype=tl.float32)
    h2 = tl.zeros([BC], dtype=tl.float32)
    if KC >= 2:
        h0 = tl.load(hist_ptr, mask=cmask, other=0.0).to(tl.float32)
    if KC >= 3:
        h1 = tl.load(hist_ptr + 1, mask=cmask, other=0.0).to(tl.float32)
    if KC >= 4:
        h2 = tl.load(hist_ptr + 2, mask=cmask, other=0.0).to(tl.float32)
    w0 = tl.load(w_ptr + ch * KC, mask=cmask, other=0.0).to(tl.float32)
    w1 = w0
    w2 = w0
    w3 = w0
    if KC >= 2:
        w1 = tl.load(w_ptr + ch * KC + 1, mask=cmask, other=0.0).to(tl.float32)
    if KC >= 3:
        w2 = tl.load(w_ptr + ch * KC + 2, mask=cmask, other=0.0).to(tl.float32)
    if KC >= 4:
        w3 = tl.load(w_ptr + ch * KC + 3, mask=cmask, other=0.0).to(tl.float32)
    bias = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    for t in range(start, end):
        x_t = tl.load(x_ptr + t * C + ch, mask=cmask, other=0.0).to(tl.float32)
        # the window oldest-first, weighted in the reference's column order
        if KC == 1:
            y = w0 * x_t
        elif KC == 2:
            y = w0 * h0 + w1 * x_t
        elif KC == 3:
            y = w0 * h0 + w1 * h1 + w2 * x_t
        else:
            y = w0 * h0 + w1 * h1 + w2 * h2 + w3 * x_t
        y = y + bias
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + t * C + ch, y.to(y_ptr.dtype.element_ty), mask=cmask)
        if KC == 2:
            h0 = x_t
        elif KC == 3:
            h0 = h1
            h1 = x_t
        elif KC == 4:
            h0 = h1
            h1 = h2
            h2 = x_t
    cs_t = cs_ptr.dtype.element_ty
    if KC >= 2:
        tl.store(hist_ptr, h0.to(cs_t), mask=cmask)
    if KC >= 3:
        tl.store(hist_ptr + 1, h1.to(cs_t), mask=cmask)
    if KC >= 4:
        tl.store(hist_ptr + 2, h2.to(cs_t), mask=cmask)


def conv_prefill_triton(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    state_indices: torch.Tensor, query_start_loc: torch.Tensor, activation: str | None,
) -> torch.Tensor:
    """One launch over every prompt row (arguments as :func:`api.conv_prefill`)."""
    C, Kc = weight.shape
    N = query_start_loc.shape[0] - 1
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if N == 0 or x.shape[0] == 0:
        return out
    if x.dtype not in TL_DTYPES or conv_state.dtype not in TL_DTYPES:
        raise ValueError(
            f"argument 'x'/'conv_state': unsupported dtypes {x.dtype}/{conv_state.dtype} "
            "for the kernel"
        )
    bc = 256
    _conv_prefill_kernel[(triton.cdiv(C, bc), N)](
        x, conv_state, conv_state.stride(0), conv_state.stride(1), weight.contiguous(),
        bias if bias is not None else weight, out, state_indices, query_start_loc, C,
        KC=Kc, BC=bc, HAS_BIAS=bias is not None, SILU=activation == "silu", num_warps=4,
    )
    return out
