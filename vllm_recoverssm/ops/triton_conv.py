"""Triton kernels for the speculative short-convolution update and its compaction.

Window semantics are those of :func:`reference.conv_update` / :func:`reference.conv_compact`.
Each program owns a block of channels of one request, so the in-place window rewrite
only needs a barrier between its own loads and stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan import CommitPlan
from .triton_math import TL_DTYPES


@triton.jit
def _conv_update_kernel(
    x_ptr, cs_ptr, stride_cs_slot, w_ptr, b_ptr, y_ptr,
    sidx_ptr, qsl_ptr, off_ptr,
    C, W: tl.constexpr, KC: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
    BJ: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_OFFSETS: tl.constexpr, SILU: tl.constexpr,
):
    pid_c = tl.program_id(0)
    n = tl.program_id(1)
    start = tl.load(qsl_ptr + n).to(tl.int64)
    ntok = tl.load(qsl_ptr + n + 1).to(tl.int64) - start
    if ntok <= 0:
        return
    slot = tl.load(sidx_ptr + n).to(tl.int64)
    ch = pid_c * BC + tl.arange(0, BC)
    cmask = ch < C
    tt = tl.arange(0, BT)
    tmask = tt < ntok
    y_ptrs = y_ptr + (start + tt)[None, :] * C + ch[:, None]
    ymask = cmask[:, None] & tmask[None, :]
    if slot < 0:
        tl.store(y_ptrs, tl.zeros([BC, BT], dtype=tl.float32).to(y_ptr.dtype.element_ty),
                 mask=ymask)
        return
    if HAS_OFFSETS:
        off = tl.load(off_ptr + n)
    else:
        off = 0
    win = cs_ptr + slot * stride_cs_slot + ch[:, None] * W

    # concat = [history (KC-1 columns from `off`), x_0 .. x_{ntok-1}]; position p in BT+KC
    acc = tl.zeros([BC, BT], dtype=tl.float32)
    for i in tl.static_range(KC):
        pos = tt + i
        in_hist = pos < KC - 1
        hv = tl.load(win + off + pos[None, :], mask=cmask[:, None] & in_hist[None, :], other=0.0)
        xv = tl.load(x_ptr + (start + pos - (KC - 1))[None, :] * C + ch[:, None],
                     mask=cmask[:, None] & (~in_hist & (pos - (KC - 1) < ntok))[None, :],
                     other=0.0)
        val = tl.where(in_hist[None, :], hv.to(tl.float32), xv.to(tl.float32))
        wi = tl.load(w_ptr + ch * KC + i, mask=cmask, other=0.0).to(tl.float32)
        acc += wi[:, None] * val
    if HAS_BIAS:
        acc += tl.load(b_ptr + ch, mask=cmask, other=0.0).to(tl.float32)[:, None]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)

    # New window column j = concat[j + 1] for j < KC - 2 + ntok.
    jj = tl.arange(0, BJ)
    src = jj + 1
    from_hist = src < KC - 1
    keep = jj < KC - 2 + ntok
    hv = tl.load(win + off + src[None, :], mask=cmask[:, None] & (from_hist & keep)[None, :],
                 other=0.0)
    xv = tl.load(x_ptr + (start + src - (KC - 1))[None, :] * C + ch[:, None],
                 mask=cmask[:, None] & (~from_hist & keep)[None, :], other=0.0)
    new = tl.where(from_hist[None, :], hv, xv.to(hv.dtype))
    tl.debug_barrier()  # every thread has read the old window before any writes
    tl.store(win + jj[None, :], new, mask=cmask[:, None] & keep[None, :])


@triton.jit
def _conv_compact_kernel(
    cs_tab, cs_stride_tab, C_tab,
    sidx_ptr, clen_ptr, fidx_ptr, bidx_ptr, blen_ptr,
    W: tl.constexpr, HIST: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr,
    HAS_FINAL: tl.constexpr, HAS_BOUNDARY: tl.constexpr, CS_DTYPE: tl.constexpr,
):
    pid_c = tl.program_id(0)
    n = tl.program_id(1)
    layer = tl.program_id(2)
    src = tl.load(sidx_ptr + n).to(tl.int64)
    if src < 0:
        return
    C = tl.load(C_tab + layer)
    ch = pid_c * BC + tl.arange(0, BC)
    cmask = ch < C
    if pid_c * BC >= C:
        return
    clen = tl.load(clen_ptr + n)
    if HAS_FINAL:
        dst = tl.load(fidx_ptr + n).to(tl.int64)
    else:
        dst = src
    base = tl.load(cs_tab + layer).to(tl.pointer_type(CS_DTYPE))
    stride = tl.load(cs_stride_tab + layer)
    hh = tl.arange(0, BH)
    hmask = cmask[:, None] & (hh < HIST)[None, :]
    win = base + src * stride + ch[:, None] * W
    off = tl.maximum(clen - 1, 0)
    final_hist = tl.load(win + off + hh[None, :], mask=hmask)
    if HAS_BOUNDARY:
        bslot = tl.load(bidx_ptr + n).to(tl.int64)
        blen = tl.load(blen_ptr + n)
        has_b = (bslot >= 0) & (blen >= 1)
        b_hist = tl.load(win + tl.maximum(blen - 1, 0) + hh[None, :], mask=hmask & has_b)
        tl.debug_barrier()
        if has_b:
            tl.store(base + bslot * stride + ch[:, None] * W + hh[None, :], b_hist, mask=hmask)
    tl.debug_barrier()
    if dst >= 0:
        tl.store(base + dst * stride + ch[:, None] * W + hh[None, :], final_hist, mask=hmask)




def _check_dtype(conv_state: torch.Tensor) -> None:
    if conv_state.dtype not in TL_DTYPES:
        raise ValueError(
            f"argument 'conv_state': the Triton kernels support bfloat16, float16 or float32, "
            f"got {conv_state.dtype}; use backend='reference'"
        )


def conv_update_triton(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
    conv_offsets: torch.Tensor | None, activation: str | None,
) -> torch.Tensor:
    """Conv update kernel launch (arguments as :func:`api.conv_update`)."""
    _check_dtype(conv_state)
    N = query_start_loc.shape[0] - 1
    C = conv_state.shape[1]
    W = conv_state.shape[2]
    Kc = weight.shape[1]
    y = torch.zeros_like(x)
    if N == 0:
        return y
    bt = triton.next_power_of_2(W - (Kc - 1) + 1)  # at most S+1 tokens
    bc = min(128, triton.next_power_of_2(C))
    _conv_update_kernel[(triton.cdiv(C, bc), N)](
        x, conv_state, conv_state.stride(0), weight, bias if bias is not None else weight, y,
        state_indices, query_start_loc,
        conv_offsets if conv_offsets is not None else state_indices,
        C, W=W, KC=Kc, BC=bc, BT=bt, BJ=triton.next_power_of_2(W),
        HAS_BIAS=bias is not None, HAS_OFFSETS=conv_offsets is not None,
        SILU=activation == "silu",
        num_warps=4,
    )
    return y


def conv_compact_triton(
    conv_states: list[torch.Tensor], plan: CommitPlan, kernel_width: int
) -> None:
    """One launch compacts every layer's conv window (arguments as :func:`api.conv_compact`)."""
    _check_dtype(conv_states[0])
    N = plan.num_rows
    if N == 0:
        return
    dev = conv_states[0].device
    ptrs = torch.tensor([c.data_ptr() for c in conv_states], dtype=torch.int64, device=dev)
    strides = torch.tensor([c.stride(0) for c in conv_states], dtype=torch.int64, device=dev)
    chans = torch.tensor([c.shape[1] for c in conv_states], dtype=torch.int32, device=dev)
    C = max(c.shape[1] for c in conv_states)
    W = conv_states[0].shape[2]
    hist = kernel_width - 1
    bc = min(256, triton.next_power_of_2(C))
    si = plan.state_indices
    _conv_compact_kernel[(triton.cdiv(C, bc), N, len(conv_states))](
        ptrs, strides, chans,
        si, plan.commit_lens,
        plan.final_indices if plan.final_indices is not None else si,
        plan.boundary_indices if plan.boundary_indices is not None else si,
        plan.boundary_lens if plan.boundary_lens is not None else si,
        W=W, HIST=hist, BH=triton.next_power_of_2(hist), BC=bc,
        HAS_FINAL=plan.final_indices is not None,
        HAS_BOUNDARY=plan.boundary_indices is not None,
        CS_DTYPE=TL_DTYPES[conv_states[0].dtype],
        num_warps=4,
    )
