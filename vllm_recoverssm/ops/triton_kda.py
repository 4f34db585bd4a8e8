"""Triton kernels for KDA speculative verify (serial form) and commit, and their launches.

Verify has two kernels. The window kernel (:mod:`.triton_window`) computes a whole window
against the checkpoint in one tensor-core product and is used wherever it applies (a
bounded gate, SM80 or newer, or the interpreter); the serial kernel here runs the token
recurrence in registers and serves every other gate. Both read the checkpoint once and
have a ``FUSED`` form that first replays the previous step's accepted records (the
deferred commit). :func:`.backends.verify_kernel` says which one a call gets.

The serial kernel is straight-line code: the token loop is unrolled over the S+1 columns
with masked loads (no per-token branches), which lets all of a program's loads be issued
up front instead of paying one memory latency per token. Tokens past a request's length
run as no-ops (decay 1, correction 0). Each program owns a [BV, K] tile of one head's
state (K contiguous), held as two [BV, K/2] chunks, which spreads a row over half as many
lanes: the chunks' products are added in registers and one reduction with one shuffle
level less follows (measurably faster than one chunk; the numbers are in ``docs/results.md``).

Commit has three token loops (:func:`commit_loop` picks one by batch and window): a
runtime loop, where rejected tokens cost nothing and the other programs of an SM hide each
record load (large batches of long windows); the same loop loading two tokens ahead (a
batch of one, and long windows up to mid-size batches); and, for windows of up to 4
tokens, the loop unrolled with masked loads, so that every record is requested up front
and the few rejected tokens run as no-ops. Every kernel rebuilds states with the update of
:func:`.triton_math.apply_record` and normalises keys in float64, so commit, the full-state
verify and the fused verify agree bit for bit whatever their tiles and loops
(:mod:`.triton_math` says why); each kernel therefore takes its own tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cuda_commit, cuda_window, tuning
from . import triton_window as win
from .backends import commit_kernel, verify_kernel
from .plan import CommitPlan, CommitTables
from .triton_math import TL_DTYPES, gate, sumsq
from .validation import check_head_dims, check_kernel_state


@triton.jit
def _unit_chunks(x0, x1, NCH: tl.constexpr, EPS: tl.constexpr):
    """Chunks of one vector divided by its L2 norm (float64 sum of squares: the same bits
    as :func:`.triton_math.unit` on the whole vector)."""
    ss = sumsq(x0)
    if NCH == 2:
        ss += sumsq(x1)
    norm = tl.sqrt(ss.to(tl.float32) + EPS)
    return x0 / norm, x1 / norm


@triton.jit
def _apply_chunks(s0, s1, c, raw_k0, raw_k1, raw_g0, raw_g1, live, a_coef, dtb0, dtb1,
                  NCH: tl.constexpr, LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr,
                  EPS: tl.constexpr):
    """:func:`.triton_math.apply_record` on a tile held as ``NCH`` K-chunks."""
    k0, k1 = _unit_chunks(raw_k0, raw_k1, NCH, EPS)
    a0 = tl.where(live, tl.exp(gate(raw_g0, a_coef, dtb0, LOWER_BOUND, BOUNDED)), 1.0)
    s0 = tl.fma(c[:, None], k0[None, :], s0 * a0[None, :])
    if NCH == 2:
        a1 = tl.where(live, tl.exp(gate(raw_g1, a_coef, dtb1, LOWER_BOUND, BOUNDED)), 1.0)
        s1 = tl.fma(c[:, None], k1[None, :], s1 * a1[None, :])
    return s0, s1


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    alog_ptr, dtb_ptr,
    state_ptr, stride_state_slot,
    sidx_ptr, nacc_ptr, qsl_ptr,
    corr_ptr, stride_corr_row, kg_ptr, stride_kg_row, ridx_ptr,
    pcorr_ptr, stride_pcorr_row, pkg_ptr, stride_pkg_row, pridx_ptr, plen_ptr,
    out_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    NCH: tl.constexpr, NCOLS: tl.constexpr,
    LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr,
    FULL_STATE: tl.constexpr, FUSED: tl.constexpr, HAS_RIDX: tl.constexpr,
    HAS_PRIDX: tl.constexpr, EPS: tl.constexpr, SCALE: tl.constexpr,
):
    KC: tl.constexpr = K // NCH
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    start = tl.load(qsl_ptr + n).to(tl.int64)
    ntok = tl.load(qsl_ptr + n + 1).to(tl.int64) - start
    if not FUSED:
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
    if FUSED:
        # the deferred commit of the previous step's accepted records (see triton_window)
        plen = tl.load(plen_ptr + n)
        if HAS_PRIDX:
            prow = tl.load(pridx_ptr + n).to(tl.int64)
        else:
            prow = n.to(tl.int64)
        for t in tl.static_range(NCOLS):
            live = t < plen
            lmask = (kc < KC) & live
            pkg_row = pkg_ptr + prow * stride_pkg_row + (h * NCOLS + t) * (2 * K)
            rk0 = tl.load(pkg_row + kc, mask=lmask, other=0.0).to(tl.float32)
            rg0 = tl.load(pkg_row + K + kc, mask=lmask, other=0.0).to(tl.float32)
            rk1, rg1 = rk0, rg0
            if NCH == 2:
                rk1 = tl.load(pkg_row + KC + kc, mask=lmask, other=0.0).to(tl.float32)
                rg1 = tl.load(pkg_row + K + KC + kc, mask=lmask, other=0.0).to(tl.float32)
            c = tl.load(pcorr_ptr + prow * stride_pcorr_row + (h * NCOLS + t) * V + vv,
                        mask=(vv < V) & live, other=0.0)
            s0, s1 = _apply_chunks(s0, s1, c, rk0, rk1, rg0, rg1, live, a_coef, dtb0, dtb1,
                                   NCH, LOWER_BOUND, BOUNDED, EPS)
        if plen > 0:
            tl.store(state_ptr + slot * stride_state_slot + tile, s0)
            if NCH == 2:
                tl.store(state_ptr + slot * stride_state_slot + tile + KC, s1)
        if ntok <= 0:
            return
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
        a0 = tl.where(kmask, tl.exp(gate(raw_g0.to(tl.float32), a_coef, dtb0, LOWER_BOUND,
                                         BOUNDED)), 1.0)
        s0 = s0 * a0[None, :]
        kv = s0 * k0[None, :]
        if NCH == 2:
            a1 = tl.where(kmask, tl.exp(gate(raw_g1.to(tl.float32), a_coef, dtb1,
                                             LOWER_BOUND, BOUNDED)), 1.0)
            s1 = s1 * a1[None, :]
            kv += s1 * k1[None, :]
        c_t = b_t * (v_t - tl.sum(kv, axis=1))
        # an explicit fma, as in apply_record: the compiler may not contract
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
def _load_record(t, live, kg_ptr, kg_stride, corr_ptr, c_stride, rrow, h, kc, vv,
                 K: tl.constexpr, KC: tl.constexpr, NCH: tl.constexpr, NCOLS: tl.constexpr,
                 V: tl.constexpr, MASKED: tl.constexpr):
    """Token ``t``'s record (key and gate chunks, correction rows) for one commit program;
    with ``MASKED``, zeros where not ``live`` (a scalar mask keeps the loads vectorised)."""
    kg_row = kg_ptr + rrow * kg_stride + (h * NCOLS + t) * (2 * K)
    c_row = corr_ptr + rrow * c_stride + (h * NCOLS + t) * V
    if MASKED:
        rk0 = tl.load(kg_row + kc, mask=live, other=0.0).to(tl.float32)
        rg0 = tl.load(kg_row + K + kc, mask=live, other=0.0).to(tl.float32)
        c = tl.load(c_row + vv, mask=live, other=0.0)
    else:
        rk0 = tl.load(kg_row + kc).to(tl.float32)
        rg0 = tl.load(kg_row + K + kc).to(tl.float32)
        c = tl.load(c_row + vv)
    rk1, rg1 = rk0, rg0
    if NCH == 2:
        if MASKED:
            rk1 = tl.load(kg_row + KC + kc, mask=live, other=0.0).to(tl.float32)
            rg1 = tl.load(kg_row + K + KC + kc, mask=live, other=0.0).to(tl.float32)
        else:
            rk1 = tl.load(kg_row + KC + kc).to(tl.float32)
            rg1 = tl.load(kg_row + K + KC + kc).to(tl.float32)
    return rk0, rk1, rg0, rg1, c


@triton.jit
def _apply_token(s0, s1, t, live, rk0, rk1, rg0, rg1, c, a_coef, dtb0, dtb1, state_ptr,
                 s_stride, tile, bslot, blen, KC: tl.constexpr, NCH: tl.constexpr,
                 LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr,
                 HAS_BOUNDARY: tl.constexpr, EPS: tl.constexpr):
    """Token ``t``'s record applied where ``live``, then the align-mode boundary state
    stored after it."""
    s0, s1 = _apply_chunks(s0, s1, c, rk0, rk1, rg0, rg1, live, a_coef, dtb0, dtb1,
                           NCH, LOWER_BOUND, BOUNDED, EPS)
    if HAS_BOUNDARY:
        if (bslot >= 0) & (t + 1 == blen):
            tl.store(state_ptr + bslot * s_stride + tile, s0)
            if NCH == 2:
                tl.store(state_ptr + bslot * s_stride + tile + KC, s1)
    return s0, s1


@triton.jit
def _commit_token(s0, s1, t, live, MASKED: tl.constexpr, kg_ptr, kg_stride, corr_ptr,
                  c_stride, rrow, h, kc, vv, a_coef, dtb0, dtb1, state_ptr, s_stride, tile,
                  bslot, blen, K: tl.constexpr, KC: tl.constexpr, NCH: tl.constexpr,
                  NCOLS: tl.constexpr, V: tl.constexpr, LOWER_BOUND: tl.constexpr,
                  BOUNDED: tl.constexpr, HAS_BOUNDARY: tl.constexpr, EPS: tl.constexpr):
    """Token ``t`` of a commit loop whose record is loaded where it is applied (the
    unrolled and the runtime loops; the prefetching loop loads ahead instead)."""
    rk0, rk1, rg0, rg1, c = _load_record(t, live, kg_ptr, kg_stride, corr_ptr, c_stride,
                                         rrow, h, kc, vv, K, KC, NCH, NCOLS, V, MASKED)
    return _apply_token(s0, s1, t, live, rk0, rk1, rg0, rg1, c, a_coef, dtb0, dtb1,
                        state_ptr, s_stride, tile, bslot, blen, KC, NCH, LOWER_BOUND,
                        BOUNDED, HAS_BOUNDARY, EPS)


@triton.jit
def _commit_kernel(
    state_tab, state_stride_tab, corr_tab, corr_stride_tab, kg_tab, kg_stride_tab,
    alog_ptr, dtb_ptr,
    sidx_ptr, clen_ptr, fidx_ptr, bidx_ptr, blen_ptr, ridx_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    NCH: tl.constexpr, NCOLS: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BOUNDED: tl.constexpr, HAS_FINAL: tl.constexpr, HAS_BOUNDARY: tl.constexpr,
    HAS_RIDX: tl.constexpr, EPS: tl.constexpr, KG_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr, LOOP: tl.constexpr,
):
    pid_v = tl.program_id(0)
    lh = tl.program_id(1)
    n = tl.program_id(2)
    layer = lh // H
    h = lh % H
    # Every index and table load is issued before the first branch: with the L2 cold,
    # each load a branch waits on costs a DRAM latency, and at small batches these
    # chained latencies, not bytes, set the commit's time.
    src = tl.load(sidx_ptr + n).to(tl.int64)
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
    if src < 0:
        return
    if (clen == 0) & (dst == src):
        return
    if ALIGNED:
        # Addresses from tables hide their alignment from the compiler; the wrapper
        # checked it, and these hints restore vectorised loads and stores.
        state_ptr = tl.multiple_of(state_ptr, 16)
        s_stride = tl.multiple_of(s_stride, 16)
        corr_ptr = tl.multiple_of(corr_ptr, 16)
        c_stride = tl.multiple_of(c_stride, 16)
        kg_ptr = tl.multiple_of(kg_ptr, 16)
        kg_stride = tl.multiple_of(kg_stride, 16)

    KC: tl.constexpr = K // NCH
    vv = pid_v * BV + tl.arange(0, BV)
    kc = tl.arange(0, KC)
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
    if LOOP == 1:
        # Unrolled with masked loads, so that every record is requested up front instead
        # of one latency per token; a rejected token runs as a no-op (decay 1,
        # correction 0: the same bits).
        for t in tl.static_range(NCOLS):
            s0, s1 = _commit_token(s0, s1, t, t < clen, True, kg_ptr, kg_stride, corr_ptr,
                                   c_stride, rrow, h, kc, vv, a_coef, dtb0, dtb1, state_ptr,
                                   s_stride, tile, bslot, blen, K, KC, NCH, NCOLS, V,
                                   LOWER_BOUND, BOUNDED, HAS_BOUNDARY, EPS)
    elif LOOP == 2:
        # A runtime loop whose records are loaded two tokens ahead: rejected tokens cost
        # no compute, and a token's load latency overlaps the two before it.
        nk0, nk1, ng0, ng1, nc = _load_record(0, 0 < clen, kg_ptr, kg_stride, corr_ptr,
                                              c_stride, rrow, h, kc, vv, K, KC, NCH, NCOLS,
                                              V, True)
        mk0, mk1, mg0, mg1, mc = _load_record(1, 1 < clen, kg_ptr, kg_stride, corr_ptr,
                                              c_stride, rrow, h, kc, vv, K, KC, NCH, NCOLS,
                                              V, True)
        for t in range(0, clen):
            rk0, rk1, rg0, rg1, c = nk0, nk1, ng0, ng1, nc
            nk0, nk1, ng0, ng1, nc = mk0, mk1, mg0, mg1, mc
            mk0, mk1, mg0, mg1, mc = _load_record(t + 2, t + 2 < clen, kg_ptr, kg_stride,
                                                  corr_ptr, c_stride, rrow, h, kc, vv, K,
                                                  KC, NCH, NCOLS, V, True)
            s0, s1 = _apply_token(s0, s1, t, True, rk0, rk1, rg0, rg1, c, a_coef, dtb0,
                                  dtb1, state_ptr, s_stride, tile, bslot, blen, KC, NCH,
                                  LOWER_BOUND, BOUNDED, HAS_BOUNDARY, EPS)
    else:
        # A runtime loop: rejected tokens cost nothing (the records are small, so their
        # per-token load latency is hidden by the other programs on the SM).
        for t in range(0, clen):
            s0, s1 = _commit_token(s0, s1, t, True, False, kg_ptr, kg_stride, corr_ptr,
                                   c_stride, rrow, h, kc, vv, a_coef, dtb0, dtb1, state_ptr,
                                   s_stride, tile, bslot, blen, K, KC, NCH, NCOLS, V,
                                   LOWER_BOUND, BOUNDED, HAS_BOUNDARY, EPS)
    if dst >= 0:
        tl.store(state_ptr + dst * s_stride + tile, s0)
        if NCH == 2:
            tl.store(state_ptr + dst * s_stride + tile + KC, s1)


def _serial_tile(K: int, V: int) -> tuple[int, int, int]:
    """(block_v, num_warps, K chunks) of the serial verify.

    One warp on 16 rows held as two K-chunks was the fastest tile at every batch measured
    (against 8..128 rows, 1..8 warps, one or two chunks).
    """
    forced = tuning.current().serial_tile
    if forced is not None:
        return forced
    return min(16, V), 1, (2 if K >= 32 else 1)


def window_tile(rows: int, heads: int, V: int) -> tuple[int, int, int, int]:
    """(block_v, chunks, num_warps, num_stages) of the window verify for ``rows`` requests
    of ``heads`` heads; a program covers ``block_v * chunks`` rows of one head.

    Small batches take short tiles so that enough programs fill the SMs; larger ones let
    a program loop over more rows, which shares one head's probe and coupling work (the
    fastest of the tiles ``python -m vllm_recoverssm.bench.tune`` timed).
    """
    forced = tuning.current().window_tile
    if forced is not None:
        return forced
    if rows * heads <= 64:
        return min(32, V), 1, 4, 1
    bv = min(64, V)
    return bv, max(1, min(2, V // bv)), 4, 2


def commit_tile(rows: int, layer_heads: int, K: int, V: int, ncols: int
                ) -> tuple[int, int, int]:
    """(block_v, num_warps, K chunks) of the commit over ``rows`` requests, ``layer_heads``
    heads and windows of ``ncols`` tokens: one warp on 16 rows held as two K-chunks for few
    programs (and, with the unrolled loop of short windows, up to a batch of 64 at H = 32),
    on 32 rows otherwise (the fastest of 16 / 32 rows, one or two chunks, one or two warps
    that ``python -m vllm_recoverssm.bench.tune`` timed)."""
    forced = tuning.current().commit_tile
    if forced is not None:
        return forced
    programs = rows * layer_heads
    if programs <= 128 or (ncols <= 4 and programs <= 2048):
        return min(16, V), 1, (2 if K >= 32 else 1)
    return min(32, V), 1, (2 if K >= 32 else 1)


def commit_loop(rows: int, layer_heads: int, ncols: int) -> str:
    """The commit's token loop, one of :data:`.tuning.COMMIT_LOOPS`, for ``rows`` requests,
    ``layer_heads`` heads and windows of ``ncols`` tokens.

    ``"runtime"`` loads a record per token and relies on the other programs of an SM to
    hide its latency; ``"unrolled"`` requests every record up front and runs rejected
    tokens as no-ops; ``"prefetch"`` is a runtime loop that loads two tokens ahead. As
    ``python -m vllm_recoverssm.bench.tune`` timed them: with few programs the prefetch loop
    is fastest; for windows of up to 4 tokens the unrolled loop (no-ops are few); for
    longer windows the prefetch loop up to mid-size batches, and the runtime loop above,
    where the prefetch buffers cost occupancy.
    """
    forced = tuning.current().commit_loop
    if forced is not None:
        return forced
    programs = rows * layer_heads
    if programs <= 64:
        return "prefetch"
    if ncols <= 4:
        return "unrolled"
    return "prefetch" if programs < 4096 else "runtime"


def cuda_rows_per_warp(rows: int, heads: int, mode: int = win.RECOVERY,
                       ncols: int = win.TP) -> int:
    """Rows per warp of the CUDA window kernel in ``mode`` for windows of ``ncols`` tokens:
    16 (two blocks per head) or 32 (one block per head).

    Read off ``python -m vllm_recoverssm.bench.tune --variants cuda/`` (the timings are in
    ``docs/results.md``). Short blocks fill the SMs at small batches: the recovery verify of
    half-width windows (at most 4 tokens) takes 16 rows at every batch, longer windows up
    to a few hundred (request, head) pairs; the fused verify of half-width windows takes 16
    rows in a middle band of batches, the other fused and full-state verifies only at the
    smallest ones."""
    forced = tuning.current().cuda_rows
    if forced is not None:
        return forced
    if ncols <= cuda_window.HALF_WIDTH_COLS and (
            mode == win.RECOVERY or (mode == win.FUSED and 512 <= rows * heads < 2048)):
        return 16
    limit = 512 if mode == win.RECOVERY else 128
    return 16 if rows * heads <= limit else 32


Prev = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor]
"""The fused verify's previous records: (corrections, kg, record rows or None, lens)."""


def _verify_launch(
    mode: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, num_accepted: torch.Tensor | None,
    query_start_loc: torch.Tensor, corrections: torch.Tensor | None, kg: torch.Tensor | None,
    lower_bound: float | None, record_indices: torch.Tensor | None, ncols: int,
    prev: Prev | None = None,
) -> torch.Tensor:
    check_kernel_state(state)
    _, H, V, K = state.shape
    check_head_dims(K, V)
    N = query_start_loc.shape[0] - 1
    indices = (state_indices, num_accepted, query_start_loc, record_indices,
               *((prev[2], prev[3]) if prev is not None else ()))
    vectors = (k, raw_g, dt_bias, kg, *((prev[1],) if prev is not None else ()))
    kernel = verify_kernel(lower_bound, ncols, state, q, indices, vectors)
    if kernel == "cuda":
        assert lower_bound is not None  # window_supported checked it
        return cuda_window.launch(
            mode, q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices,
            num_accepted, query_start_loc, corrections, kg, record_indices, lower_bound,
            ncols, cuda_rows_per_warp(N, H, mode, ncols), prev)
    if kernel == "window":
        assert lower_bound is not None  # window_supported checked it
        return win.launch_window(
            mode, q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices,
            num_accepted, query_start_loc, corrections, kg, record_indices, lower_bound,
            ncols, window_tile(N, H, V), prev)
    # zeros: tokens past query_start_loc[-1] belong to no request and read as 0
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    bv, warps, nch = _serial_tile(K, V)
    dummy = state_indices
    pc, pk, pr, pl = prev if prev is not None else (state, q, None, dummy)
    # heads before requests, as the CUDA kernels (ops/csrc/kda_window.cuh, launch_typed)
    _verify_kernel[(V // bv, H, N)](
        q, k, v, raw_g, raw_beta,
        A_log.float().contiguous(), dt_bias.float().contiguous(),
        state, state.stride(0),
        state_indices, num_accepted if num_accepted is not None else dummy, query_start_loc,
        corrections if corrections is not None else state,
        corrections.stride(0) if corrections is not None else 0,
        kg if kg is not None else q, kg.stride(0) if kg is not None else 0,
        record_indices if record_indices is not None else dummy,
        pc, pc.stride(0) if prev is not None else 0, pk, pk.stride(0) if prev is not None else 0,
        pr if pr is not None else dummy, pl,
        out,
        H=H, K=K, V=V, BV=bv, NCH=nch, NCOLS=ncols,
        LOWER_BOUND=float(lower_bound) if lower_bound is not None else 0.0,
        BOUNDED=lower_bound is not None,
        FULL_STATE=mode == win.FULL, FUSED=mode == win.FUSED,
        HAS_RIDX=record_indices is not None, HAS_PRIDX=pr is not None,
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
        win.RECOVERY, q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, None,
        query_start_loc, corrections, kg, lower_bound, record_indices, corrections.shape[2],
    )


def verify_fused_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
    corrections: torch.Tensor, kg: torch.Tensor, lower_bound: float | None,
    record_indices: torch.Tensor | None, prev: Prev,
) -> torch.Tensor:
    """Fused verify kernel launch (arguments as :func:`api.verify_fused`)."""
    return _verify_launch(
        win.FUSED, q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, None,
        query_start_loc, corrections, kg, lower_bound, record_indices, corrections.shape[2],
        prev,
    )


def verify_full_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, num_accepted: torch.Tensor,
    query_start_loc: torch.Tensor, lower_bound: float | None,
) -> torch.Tensor:
    """Full-state verify kernel launch (arguments as :func:`api.verify_full`)."""
    return _verify_launch(
        win.FULL, q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices,
        num_accepted, query_start_loc, None, None, lower_bound, None, state_indices.shape[1],
    )


def commit_triton(
    states: list[torch.Tensor], corrections: list[torch.Tensor], kg: list[torch.Tensor],
    A_log: torch.Tensor, dt_bias: torch.Tensor, plan: CommitPlan,
    lower_bound: float | None, record_indices: torch.Tensor | None,
    tables: CommitTables | None = None,
) -> None:
    """One launch commits every layer (arguments as :func:`api.commit`): the CUDA commit
    where :func:`.backends.commit_kernel` picks it, else the Triton kernel."""
    check_kernel_state(states[0])
    if kg[0].dtype not in TL_DTYPES:
        raise ValueError(f"argument 'kg': unsupported dtype {kg[0].dtype} for the kernel")
    _, H, V, K = states[0].shape
    check_head_dims(K, V)
    L = len(states)
    N = plan.num_rows
    if N == 0:
        return
    if tables is None:
        tables = CommitTables(states, corrections, kg)
    ncols = corrections[0].shape[2]
    if commit_kernel(tables, plan, lower_bound, record_indices) == "cuda":
        assert lower_bound is not None  # cuda_commit.applies checked it
        rows = tuning.current().cuda_commit_rows or cuda_commit.rows_per_block(N, L * H)
        cuda_commit.launch(tables, A_log.float().contiguous(), dt_bias.float().contiguous(),
                           plan, lower_bound, record_indices, ncols, rows)
        return
    bv, warps, nch = commit_tile(N, L * H, K, V, ncols)
    si = plan.state_indices
    # heads before requests, as the CUDA kernels (ops/csrc/kda_window.cuh, launch_typed)
    grid = (V // bv, L * H, N)
    _commit_kernel[grid](
        tables.state_ptrs, tables.state_strides, tables.corr_ptrs, tables.corr_strides,
        tables.kg_ptrs, tables.kg_strides,
        A_log.float().contiguous(), dt_bias.float().contiguous(),
        si, plan.commit_lens,
        plan.final_indices if plan.final_indices is not None else si,
        plan.boundary_indices if plan.boundary_indices is not None else si,
        plan.boundary_lens if plan.boundary_lens is not None else si,
        record_indices if record_indices is not None else si,
        H=H, K=K, V=V, BV=bv, NCH=nch, NCOLS=ncols,
        LOWER_BOUND=float(lower_bound) if lower_bound is not None else 0.0,
        BOUNDED=lower_bound is not None,
        HAS_FINAL=plan.final_indices is not None,
        HAS_BOUNDARY=plan.boundary_indices is not None,
        HAS_RIDX=record_indices is not None,
        EPS=1e-6, KG_DTYPE=TL_DTYPES[kg[0].dtype], ALIGNED=tables.aligned,
        LOOP=tuning.COMMIT_LOOPS.index(commit_loop(N, L * H, ncols)), num_warps=warps,
    )
