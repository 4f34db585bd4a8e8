"""Triton kernels for KDA speculative verify (recovery and full-state) and commit.

A decode step is memory-bound: each (request, head) reads a 64 KiB FP32 state and does
little arithmetic per byte. What decides the speed is how many bytes are in flight, so
every kernel here is straight-line code: the token loop is unrolled over the S+1 columns
with masked loads (no per-token branches), which lets all of a program's loads be issued
up front instead of paying one memory latency per token. Tokens past a request's length
run as no-ops (decay 1, correction 0). Each program owns a [BV, K] tile of one head's
state (K contiguous), so the reductions over K stay inside a warp. The tile is held as
two [BV, K/2] chunks, which spreads a row over half as many lanes: the chunks' products
are added in registers and one reduction with one shuffle level less follows; with one
warp per 16-row tile this took the recovery verify at batch 256 from 0.442 to 0.31 ms at
S=3 and from 0.849 to 0.64 ms at S=7 (H200; ``recoverssm bench`` figures in the README).

Tried and measured slower on an H200 (H=32, K=V=128, batch 256): a factored verify that
replaces the token loop by a unit-triangular solve after one ``S0 @ [e^G k^ | e^G q^]``
product (its small fp32 matrix products dominate); four K-chunks (register pressure from
the per-token key/query/gate vectors); and both per-token reductions taken from the
undecayed state so that they are independent (no faster). Commit uses a runtime token
loop: rejected tokens then cost nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .api import CommitPlan


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
def _unit_chunks(x0, x1, NCH: tl.constexpr, EPS: tl.constexpr):
    """Chunks of one vector divided by its L2 norm; the norm is summed chunk-wise first,
    so verify and commit (same chunks, same tile) reduce it in the same order."""
    sq = x0 * x0
    if NCH == 2:
        sq += x1 * x1
    norm = tl.sqrt(tl.sum(sq, axis=0) + EPS)
    return x0 / norm, x1 / norm


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    alog_ptr, dtb_ptr,
    state_ptr, stride_state_slot,
    sidx_ptr, nacc_ptr, qsl_ptr,
    corr_ptr, stride_corr_row, kg_ptr, stride_kg_row, ridx_ptr,
    out_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    NCH: tl.constexpr, NCOLS: tl.constexpr,
    LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr,
    FULL_STATE: tl.constexpr, HAS_RIDX: tl.constexpr, EPS: tl.constexpr, SCALE: tl.constexpr,
):
    KC: tl.constexpr = K // NCH
    pid_v = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(qsl_ptr + n).to(tl.int64)
    ntok = tl.load(qsl_ptr + n + 1).to(tl.int64) - start
    if ntok <= 0:
        return
    vv = pid_v * BV + tl.arange(0, BV)
    kc = tl.arange(0, KC)
    if FULL_STATE:
        nacc = tl.load(nacc_ptr + n)
        slot = tl.load(sidx_ptr + n * NCOLS + nacc - 1).to(tl.int64)
    else:
        slot = tl.load(sidx_ptr + n).to(tl.int64)
    if slot < 0:
        for t in tl.static_range(NCOLS):
            tl.store(out_ptr + ((start + t) * H + h) * V + vv,
                     tl.zeros([BV], dtype=tl.float32).to(out_ptr.dtype.element_ty),
                     mask=(vv < V) & (t < ntok))
        return

    # The state tile is held as NCH column chunks of K/NCH (see the module docstring):
    # both chunks' products are added in registers before one cross-lane reduction.
    tile = (h * V + vv[:, None]) * K + kc[None, :]
    s0 = tl.load(state_ptr + slot * stride_state_slot + tile)
    s1 = s0
    if NCH == 2:
        s1 = tl.load(state_ptr + slot * stride_state_slot + tile + KC)
    a_coef = tl.exp(tl.load(alog_ptr + h))
    dtb0 = tl.load(dtb_ptr + h * K + kc)
    dtb1 = dtb0
    if NCH == 2:
        dtb1 = tl.load(dtb_ptr + h * K + KC + kc)
    if not FULL_STATE:
        if HAS_RIDX:
            rrow = tl.load(ridx_ptr + n).to(tl.int64)
        else:
            rrow = n.to(tl.int64)
        has_rec = rrow >= 0
    for t in tl.static_range(NCOLS):
        valid = t < ntok
        kmask = (kc < KC) & valid
        vmask = (vv < V) & valid
        row = (start + t) * H + h
        raw_k0 = tl.load(k_ptr + row * K + kc, mask=kmask, other=0.0)
        raw_q0 = tl.load(q_ptr + row * K + kc, mask=kmask, other=0.0)
        raw_g0 = tl.load(g_ptr + row * K + kc, mask=kmask, other=0.0)
        raw_k1, raw_q1, raw_g1 = raw_k0, raw_q0, raw_g0
        if NCH == 2:
            raw_k1 = tl.load(k_ptr + row * K + KC + kc, mask=kmask, other=0.0)
            raw_q1 = tl.load(q_ptr + row * K + KC + kc, mask=kmask, other=0.0)
            raw_g1 = tl.load(g_ptr + row * K + KC + kc, mask=kmask, other=0.0)
        v_t = tl.load(v_ptr + row * V + vv, mask=vmask, other=0.0).to(tl.float32)
        b_t = tl.sigmoid(tl.load(beta_ptr + row, mask=valid, other=0.0).to(tl.float32))
        k0, k1 = _unit_chunks(raw_k0.to(tl.float32), raw_k1.to(tl.float32), NCH, EPS)
        q0, q1 = _unit_chunks(raw_q0.to(tl.float32), raw_q1.to(tl.float32), NCH, EPS)
        q0 = q0 * SCALE
        q1 = q1 * SCALE
        a0 = tl.where(kmask, tl.exp(_gate(raw_g0.to(tl.float32), a_coef, dtb0, LOWER_BOUND,
                                          BOUNDED)), 1.0)
        s0 = s0 * a0[None, :]
        kv = s0 * k0[None, :]
        if NCH == 2:
            a1 = tl.where(kmask, tl.exp(_gate(raw_g1.to(tl.float32), a_coef, dtb1,
                                              LOWER_BOUND, BOUNDED)), 1.0)
            s1 = s1 * a1[None, :]
            kv += s1 * k1[None, :]
        c_t = b_t * (v_t - tl.sum(kv, axis=1))
        # an explicit fma, as in the commit kernel: the compiler may not contract
        # s * a + c * k two different ways, so commit reproduces this state bit for bit
        s0 = tl.fma(c_t[:, None], k0[None, :], s0)
        qs = s0 * q0[None, :]
        if NCH == 2:
            s1 = tl.fma(c_t[:, None], k1[None, :], s1)
            qs += s1 * q1[None, :]
        o_t = tl.sum(qs, axis=1)
        tl.store(out_ptr + row * V + vv, o_t.to(out_ptr.dtype.element_ty), mask=vmask)
        if FULL_STATE:
            dst = tl.load(sidx_ptr + n * NCOLS + t).to(tl.int64)
            ok = valid & (dst >= 0)
            smask = (vv[:, None] < V) & ok
            tl.store(state_ptr + dst * stride_state_slot + tile, s0, mask=smask)
            if NCH == 2:
                tl.store(state_ptr + dst * stride_state_slot + tile + KC, s1, mask=smask)
        else:
            rec = (h * NCOLS + t)
            tl.store(corr_ptr + rrow * stride_corr_row + rec * V + vv, c_t,
                     mask=vmask & has_rec)
            kg_row = kg_ptr + rrow * stride_kg_row + rec * (2 * K)
            kg_mask = kmask & has_rec & (pid_v == 0)
            kg_t = kg_ptr.dtype.element_ty
            tl.store(kg_row + kc, raw_k0.to(kg_t), mask=kg_mask)
            tl.store(kg_row + K + kc, raw_g0.to(kg_t), mask=kg_mask)
            if NCH == 2:
                tl.store(kg_row + KC + kc, raw_k1.to(kg_t), mask=kg_mask)
                tl.store(kg_row + K + KC + kc, raw_g1.to(kg_t), mask=kg_mask)


@triton.jit
def _commit_kernel(
    state_tab, state_stride_tab, corr_tab, corr_stride_tab, kg_tab, kg_stride_tab,
    alog_ptr, dtb_ptr,
    sidx_ptr, clen_ptr, fidx_ptr, bidx_ptr, blen_ptr, ridx_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    NCH: tl.constexpr, NCOLS: tl.constexpr,
    LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr,
    HAS_FINAL: tl.constexpr, HAS_BOUNDARY: tl.constexpr, HAS_RIDX: tl.constexpr,
    EPS: tl.constexpr, KG_DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
):
    KC: tl.constexpr = K // NCH
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
    if ALIGNED:
        # Addresses from tables hide their alignment from the compiler; the wrapper
        # checked it, and these hints restore vectorised loads and stores.
        state_ptr = tl.multiple_of(state_ptr, 16)
        s_stride = tl.multiple_of(s_stride, 16)
        corr_ptr = tl.multiple_of(corr_ptr, 16)
        c_stride = tl.multiple_of(c_stride, 16)
        kg_ptr = tl.multiple_of(kg_ptr, 16)
        kg_stride = tl.multiple_of(kg_stride, 16)

    vv = pid_v * BV + tl.arange(0, BV)
    kc = tl.arange(0, KC)
    # the same chunked tile as verify (see there): the key norm is reduced in its order
    tile = (h * V + vv[:, None]) * K + kc[None, :]
    s0 = tl.load(state_ptr + src * s_stride + tile)
    s1 = s0
    if NCH == 2:
        s1 = tl.load(state_ptr + src * s_stride + tile + KC)
    a_coef = tl.exp(tl.load(alog_ptr + layer * H + h))
    dtb0 = tl.load(dtb_ptr + (layer * H + h) * K + kc)
    dtb1 = dtb0
    if NCH == 2:
        dtb1 = tl.load(dtb_ptr + (layer * H + h) * K + KC + kc)
    # A runtime loop: rejected tokens cost nothing (the records are small, so their
    # per-token load latency is hidden by the other programs on the SM).
    for t in range(0, clen):
        kg_row = kg_ptr + rrow * kg_stride + (h * NCOLS + t) * (2 * K)
        raw_k0 = tl.load(kg_row + kc).to(tl.float32)
        raw_g0 = tl.load(kg_row + K + kc).to(tl.float32)
        raw_k1, raw_g1 = raw_k0, raw_g0
        if NCH == 2:
            raw_k1 = tl.load(kg_row + KC + kc).to(tl.float32)
            raw_g1 = tl.load(kg_row + K + KC + kc).to(tl.float32)
        c_t = tl.load(corr_ptr + rrow * c_stride + (h * NCOLS + t) * V + vv)
        k0, k1 = _unit_chunks(raw_k0, raw_k1, NCH, EPS)
        # the same rounding steps as verify: decay, then one fma
        s0 = s0 * tl.exp(_gate(raw_g0, a_coef, dtb0, LOWER_BOUND, BOUNDED))[None, :]
        s0 = tl.fma(c_t[:, None], k0[None, :], s0)
        if NCH == 2:
            s1 = s1 * tl.exp(_gate(raw_g1, a_coef, dtb1, LOWER_BOUND, BOUNDED))[None, :]
            s1 = tl.fma(c_t[:, None], k1[None, :], s1)
        if HAS_BOUNDARY:
            if (bslot >= 0) & (t + 1 == blen):
                tl.store(state_ptr + bslot * s_stride + tile, s0)
                if NCH == 2:
                    tl.store(state_ptr + bslot * s_stride + tile + KC, s1)
    if dst >= 0:
        tl.store(state_ptr + dst * s_stride + tile, s0)
        if NCH == 2:
            tl.store(state_ptr + dst * s_stride + tile + KC, s1)


TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
"""Torch dtypes the kernels read and write, with their Triton names."""


def _tile_config(K: int, V: int) -> tuple[int, int, int]:
    """(block_v, num_warps, K chunks) shared by verify and commit.

    Both kernels use the same tile so that their per-token key normalisation is reduced in
    the same order: then commit reproduces verify's state bit for bit (an H200 probe:
    bitwise equal with equal tiles, 1e-7 apart with (64, 4) against (32, 2)). One warp on
    16 rows held as two K-chunks was the fastest tile for both kernels at every batch from
    1 to 256 measured on an H200 (H=32, K=V=128, S = 3 and 7; against 8..128 rows, 1..8
    warps, one or two chunks); it does not depend on the batch, so a verify replayed
    from a padded CUDA graph and its eager commit always agree.
    """
    if TILE_OVERRIDE is not None:
        return TILE_OVERRIDE
    return min(16, V), 1, (2 if K >= 32 else 1)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 64 == 0 and t.stride(0) % 16 == 0


# (block_v, num_warps, K chunks of 1 or 2) for tuning experiments and tests, applied to
# verify and commit alike so the commit stays bitwise equal to verify; None = the measured
# heuristic above.
TILE_OVERRIDE: tuple[int, int, int] | None = None


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
    bv, warps, nch = _tile_config(K, V)
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
        H=H, K=K, V=V, BV=bv, NCH=nch, NCOLS=ncols,
        LOWER_BOUND=float(lower_bound) if lower_bound is not None else 0.0,
        BOUNDED=lower_bound is not None,
        FULL_STATE=full, HAS_RIDX=record_indices is not None,
        EPS=1e-6, SCALE=K**-0.5,
        num_warps=warps,
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
        self.aligned = all(_aligned(t) for t in (*states, *corrections, *kg))
        self._key = self._identity(states, corrections, kg)

    @staticmethod
    def _identity(*groups: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
        return tuple((t.data_ptr(), t.stride(0)) for g in groups for t in g)

    def matches(self, states: list[torch.Tensor], corrections: list[torch.Tensor],
                kg: list[torch.Tensor]) -> bool:
        """Whether the tables describe exactly these pools (same addresses and strides)."""
        return self._key == self._identity(states, corrections, kg)


def commit_triton(
    states: list[torch.Tensor], corrections: list[torch.Tensor], kg: list[torch.Tensor],
    A_log: torch.Tensor, dt_bias: torch.Tensor, plan: CommitPlan,
    lower_bound: float | None, record_indices: torch.Tensor | None,
    tables: CommitTables | None = None,
) -> None:
    """One launch commits every layer (arguments as :func:`api.commit`)."""
    _check_kernel_dtypes(states[0])
    if kg[0].dtype not in TL_DTYPES:
        raise ValueError(f"argument 'kg': unsupported dtype {kg[0].dtype} for the kernel")
    _, H, V, K = states[0].shape
    _check_head_dims(K, V)
    L = len(states)
    N = plan.num_rows
    if N == 0:
        return
    if tables is None:
        tables = CommitTables(states, corrections, kg)
    bv, warps, nch = _tile_config(K, V)
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
        H=H, K=K, V=V, BV=bv, NCH=nch, NCOLS=corrections[0].shape[2],
        LOWER_BOUND=float(lower_bound) if lower_bound is not None else 0.0,
        BOUNDED=lower_bound is not None,
        HAS_FINAL=plan.final_indices is not None,
        HAS_BOUNDARY=plan.boundary_indices is not None,
        HAS_RIDX=record_indices is not None,
        EPS=1e-6, KG_DTYPE=TL_DTYPES[kg[0].dtype], ALIGNED=tables.aligned,
        num_warps=warps,
    )
