"""The window verify: a whole speculative window against the checkpoint in one MMA.

Per request and head, with ``A_t = exp(G_t)`` the cumulative decay (``G_t`` the sum of the
log-decays of tokens ``0..t``), the state before token ``t``'s correction is
``S_0 diag(A_t) + sum_{j<t} c_j (k^_j * A_t / A_j)^T``. So

    c_t = b_t (v_t - S_0 (A_t k^_t) - sum_{j<t} beta_tj c_j),   beta_tj  = sum_K k^_t k^_j A_t/A_j
    o_t = S_0 (A_t q^_t) + sum_{j<=t} gamma_tj c_j,             gamma_tj = sum_K q^_t k^_j A_t/A_j

Everything that touches the state is one product ``S_0 [A_t k^_t | A_t q^_t]`` of a
``[BV, K]`` tile with 16 probe columns, on the tensor cores in fp32-accurate tf32x3
(3 tf32 products: about 2^-21 relative per product, well inside the 1e-6 state bound).
The couplings are one ``16 x 16`` product per head, independent of the state; the
correction recurrence is unit lower-triangular, ``M c = b (v - p)`` with
``M = I + diag(b) L``, and since ``L`` is nilpotent (at most 8 tokens)
``M^-1 = (I - N)(I + N^2)(I + N^4)`` with ``N = diag(b) L``. No token depends on another
through a reduction over K, so the kernel reads its tile, issues a few small products
and writes: it is bound by memory, not by per-token cross-lane sums (the serial kernel in
:mod:`.triton_kda`).

``A_t / A_j`` is formed as ``exp(G_t) * exp(-G_j)``; that is safe while the window's
log-decay stays within ``WINDOW_MAX_LOG_DECAY`` (the bounded gate: ``|lower_bound| * (S+1)``,
40 for GLM-5.3). Other gates use the serial kernel.

Modes (one kernel, so the three share the arithmetic of the window):

* ``RECOVERY``: writes the outputs and each token's record (correction, raw k, raw g).
* ``FULL``: the full-state baseline; starts from column ``num_accepted - 1`` and writes the
  state after every token, rebuilt from the corrections with the commit's update
  (:func:`.triton_math.apply_record`), so a commit of ``n`` records reproduces column
  ``n - 1`` bit for bit.
* ``FUSED``: first replays the previous step's accepted records into each row chunk in
  registers and writes the committed rows back (the deferred commit), then runs the
  window on them as ``RECOVERY``: the state is read once and written once per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_math import apply_record, gate

RECOVERY, FULL, FUSED = 0, 1, 2
TP = 8  # token slots of the probe block: S + 1 <= 8
# the same numbers as kernel constants (a jitted function reads only constexpr globals)
_FULL = tl.constexpr(FULL)
_FUSED = tl.constexpr(FUSED)
_TP = tl.constexpr(TP)
WINDOW_MAX_LOG_DECAY = 64.0
"""Largest window log-decay ``|sum g|`` for which ``exp(G)`` and ``exp(-G)`` stay finite and
normal in fp32 (products within the MMA's range)."""


@triton.jit
def _replay(s, vv, kk, pcorr_ptr, stride_pcorr_row, pkg_ptr, stride_pkg_row, prow, plen, h,
            a_coef, dtb, K: tl.constexpr, V: tl.constexpr, NCOLS: tl.constexpr,
            LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr, EPS: tl.constexpr):
    """The deferred commit of ``plen`` previous records into rows ``vv`` of the tile: every
    column unrolled with masked loads, so all of them are requested with the tile."""
    for t in tl.static_range(NCOLS):
        live = t < plen
        rec = h * NCOLS + t
        pkg_row = pkg_ptr + prow * stride_pkg_row + rec * (2 * K)
        rk = tl.load(pkg_row + kk, mask=(kk < K) & live, other=0.0).to(tl.float32)
        rg = tl.load(pkg_row + K + kk, mask=(kk < K) & live, other=0.0).to(tl.float32)
        c = tl.load(pcorr_ptr + prow * stride_pcorr_row + rec * V + vv,
                    mask=(vv < V) & live, other=0.0)
        s = apply_record(s, c, rk, rg, live, a_coef, dtb, LOWER_BOUND, BOUNDED, EPS)
    return s


@triton.jit
def _window_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    alog_ptr, dtb_ptr,
    state_ptr, stride_state_slot,
    sidx_ptr, nacc_ptr, qsl_ptr,
    corr_ptr, stride_corr_row, kg_ptr, stride_kg_row, ridx_ptr,
    pcorr_ptr, stride_pcorr_row, pkg_ptr, stride_pkg_row, pridx_ptr, plen_ptr,
    out_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    NCHUNK: tl.constexpr, NUM_STAGES: tl.constexpr,
    NCOLS: tl.constexpr, LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr,
    MODE: tl.constexpr, HAS_RIDX: tl.constexpr, HAS_PRIDX: tl.constexpr,
    EPS: tl.constexpr, SCALE: tl.constexpr,
):
    # Probe index c (a row of the probe block, a column of P): token c // 2, its key for
    # even c and its query for odd c. Everything per head is built on [NP, K] blocks, each
    # element owned by one thread, so no token loop repeats work on every thread.
    NP: tl.constexpr = 2 * _TP
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    start = tl.load(qsl_ptr + n).to(tl.int64)
    ntok = tl.load(qsl_ptr + n + 1).to(tl.int64) - start
    if MODE != _FUSED:
        if ntok <= 0:
            return
    kk = tl.arange(0, K)
    pc = tl.arange(0, NP)
    ptok = pc // 2
    is_key = (pc % 2) == 0
    live_p = ptok < ntok
    v0 = pid_v * (BV * NCHUNK)
    if MODE == _FULL:
        nacc = tl.load(nacc_ptr + n)
        slot = tl.load(sidx_ptr + n * NCOLS + nacc - 1).to(tl.int64)
    else:
        slot = tl.load(sidx_ptr + n).to(tl.int64)
    if slot < 0:
        for ch in tl.static_range(NCHUNK):
            vz = v0 + ch * BV + tl.arange(0, BV)
            optr = out_ptr + ((start + ptok[None, :]) * H + h) * V + vz[:, None]
            tl.store(optr, tl.zeros([BV, NP], dtype=tl.float32).to(out_ptr.dtype.element_ty),
                     mask=(~is_key & live_p)[None, :] & (vz[:, None] < V))
        return
    a_coef = tl.exp(tl.load(alog_ptr + h))
    dtb = tl.load(dtb_ptr + h * K + kk)
    state_base = state_ptr + slot * stride_state_slot + h * V * K

    if MODE == _FUSED:
        plen = tl.load(plen_ptr + n)
        if HAS_PRIDX:
            prow = tl.load(pridx_ptr + n).to(tl.int64)
        else:
            prow = n.to(tl.int64)
        if ntok <= 0:
            # nothing to verify: only the deferred commit
            for ch in tl.static_range(NCHUNK):
                vv = v0 + ch * BV + tl.arange(0, BV)
                tile = vv[:, None] * K + kk[None, :]
                s = _replay(tl.load(state_base + tile), vv, kk, pcorr_ptr, stride_pcorr_row,
                            pkg_ptr, stride_pkg_row, prow, plen, h, a_coef, dtb, K, V, NCOLS,
                            LOWER_BOUND, BOUNDED, EPS)
                if plen > 0:
                    tl.store(state_base + tile, s)
            return

    if MODE != _FULL:
        if HAS_RIDX:
            rrow = tl.load(ridx_ptr + n).to(tl.int64)
        else:
            rrow = n.to(tl.int64)
        has_rec = rrow >= 0

    # ---- per head: probes, couplings and the solve matrix. Per-token vectors are held
    # transposed, [K, TP] (token t in column t), each element owned by one thread;
    # interleaving two of them gives the [K, NP] probe block (column c = token c // 2,
    # its key for even c, its query for odd c) that the products take.
    tt = tl.arange(0, _TP)
    live_t = tt < ntok
    trow = (start + tt) * H + h  # [TP]
    xptr = trow[None, :] * K + kk[:, None]
    lmask = live_t[None, :] & (kk[:, None] < K)
    raw_k = tl.load(k_ptr + xptr, mask=lmask, other=0.0)
    raw_gt = tl.load(g_ptr + xptr, mask=lmask, other=0.0)
    if MODE != _FULL:
        # the records' raw k and raw g, straight from the loaded blocks
        kg_ptrs = kg_ptr + rrow * stride_kg_row + (h * NCOLS + tt[None, :]) * (2 * K) + kk[:, None]
        kg_mask = lmask & has_rec & (pid_v == 0)
        kg_t = kg_ptr.dtype.element_ty
        tl.store(kg_ptrs, raw_k.to(kg_t), mask=kg_mask)
        tl.store(kg_ptrs + K, raw_gt.to(kg_t), mask=kg_mask)
    kf = raw_k.to(tl.float32)
    qf = tl.load(q_ptr + xptr, mask=lmask, other=0.0).to(tl.float32)
    k64 = kf.to(tl.float64)
    q64 = qf.to(tl.float64)
    inv_k = 1.0 / tl.sqrt(tl.sum(k64 * k64, axis=0).to(tl.float32) + EPS)
    inv_q = SCALE / tl.sqrt(tl.sum(q64 * q64, axis=0).to(tl.float32) + EPS)
    g = tl.where(lmask, gate(raw_gt.to(tl.float32), a_coef, dtb[:, None], LOWER_BOUND,
                             BOUNDED), 0.0)
    G = tl.cumsum(g, axis=1)  # cumulative log-decay of tokens 0..t
    probes = tl.interleave(tl.exp(G) * (kf * inv_k[None, :]),
                           tl.exp(G) * (qf * inv_q[None, :]))  # [K, NP]: A_t k^_t | A_t q^_t
    inv_keys = tl.interleave(tl.exp(-G) * (kf * inv_k[None, :]),
                             tl.zeros([K, _TP], dtype=tl.float32))  # k^_t / A_t | 0
    coup = tl.dot(tl.trans(probes), inv_keys, input_precision="tf32x3")  # [NP, NP]

    rr = pc[:, None]
    cc = pc[None, :]
    rtok = rr // 2
    ctok = cc // 2
    key_r = (rr % 2) == 0
    key_c = (cc % 2) == 0
    prow_tok = (start + ptok) * H + h  # [NP] token row of each probe
    beta_p = tl.load(beta_ptr + prow_tok, mask=is_key & live_p, other=0.0).to(tl.float32)
    b_p = tl.where(is_key & live_p, tl.sigmoid(beta_p), 0.0)  # b_t on key probes, else 0
    nil = tl.where(key_r & key_c & (ctok < rtok), b_p[:, None] * coup, 0.0)
    eye = tl.where(rr == cc, 1.0, 0.0)
    n2 = tl.dot(nil, nil, input_precision="ieee")
    n4 = tl.dot(n2, n2, input_precision="ieee")
    m_inv = tl.dot(tl.dot(eye - nil, eye + n2, input_precision="ieee"), eye + n4,
                   input_precision="ieee")
    gam = tl.where(~key_r & key_c & (ctok <= rtok), coup, 0.0)
    q_mat = tl.dot(gam, m_inv, input_precision="ieee")
    # Y = R @ solve: even columns give the corrections c = M^-1 r, odd ones o - p
    solve = tl.where(key_c, tl.trans(m_inv), tl.trans(q_mat))

    # ---- per row chunk: one product with the checkpoint, one with the solve matrix
    for ch in tl.range(0, NCHUNK, num_stages=NUM_STAGES):
        vv = v0 + ch * BV + tl.arange(0, BV)
        tile = vv[:, None] * K + kk[None, :]
        s = tl.load(state_base + tile)
        if MODE == _FUSED:
            # the deferred commit of this chunk, then the window from the committed rows
            s = _replay(s, vv, kk, pcorr_ptr, stride_pcorr_row, pkg_ptr, stride_pkg_row, prow,
                        plen, h, a_coef, dtb, K, V, NCOLS, LOWER_BOUND, BOUNDED, EPS)
            if plen > 0:
                tl.store(state_base + tile, s)
        p = tl.dot(s, probes, input_precision="tf32x3")  # [BV, NP]
        v_t = tl.load(v_ptr + prow_tok[None, :] * V + vv[:, None],
                      mask=(is_key & live_p)[None, :] & (vv[:, None] < V),
                      other=0.0).to(tl.float32)
        rhs = tl.where((is_key & live_p)[None, :], b_p[None, :] * (v_t - p), 0.0)
        y = tl.dot(rhs, solve, input_precision="ieee")
        optr = out_ptr + prow_tok[None, :] * V + vv[:, None]
        tl.store(optr, (p + y).to(out_ptr.dtype.element_ty),
                 mask=(~is_key & live_p)[None, :] & (vv[:, None] < V))
        if MODE == _FULL:
            for t in tl.static_range(NCOLS):
                live = t < ntok
                row_t = (start + t) * H + h
                rk = tl.load(k_ptr + row_t * K + kk, mask=(kk < K) & live, other=0.0)
                rgt = tl.load(g_ptr + row_t * K + kk, mask=(kk < K) & live, other=0.0)
                c_t = tl.sum(tl.where(pc[None, :] == 2 * t, y, 0.0), axis=1)  # exact
                s = apply_record(s, c_t, rk.to(tl.float32), rgt.to(tl.float32), live, a_coef,
                                 dtb, LOWER_BOUND, BOUNDED, EPS)
                dst = tl.load(sidx_ptr + n * NCOLS + t).to(tl.int64)
                tl.store(state_ptr + dst * stride_state_slot + h * V * K + tile, s,
                         mask=(vv[:, None] < V) & live & (dst >= 0))
        else:
            cptr = corr_ptr + rrow * stride_corr_row + (h * NCOLS + ptok[None, :]) * V + vv[:, None]
            tl.store(cptr, y, mask=(is_key & live_p)[None, :] & (vv[:, None] < V) & has_rec)


def window_supported(lower_bound: float | None, ncols: int, device: torch.device) -> bool:
    """Whether the window kernel applies: a bounded gate whose window log-decay stays in
    range, at most ``TP`` tokens, and tf32 tensor cores (SM80+) or the interpreter."""
    if lower_bound is None or abs(lower_bound) * ncols > WINDOW_MAX_LOG_DECAY or ncols > TP:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return True


def launch_window(
    mode: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, num_accepted: torch.Tensor | None,
    query_start_loc: torch.Tensor, corrections: torch.Tensor | None, kg: torch.Tensor | None,
    record_indices: torch.Tensor | None, lower_bound: float, ncols: int,
    tile: tuple[int, int, int, int],
    prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Launch the window kernel; ``prev`` = (corrections, kg, record rows, lens) in FUSED."""
    _, H, V, K = state.shape
    N = query_start_loc.shape[0] - 1
    # zeros: tokens past query_start_loc[-1] belong to no request and read as 0
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    # every mode takes the same tile: the product's tiling decides its rounding, so a
    # step's full-state, recovery and fused verify then agree bit for bit
    bv, nchunk, warps, stages = tile
    dummy = state_indices
    pc, pk, pr, pl = prev if prev is not None else (state, q, None, dummy)
    # heads before requests, as the CUDA kernels (ops/csrc/kda_window.cuh, launch_typed)
    _window_kernel[(V // (bv * nchunk), H, N)](
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
        H=H, K=K, V=V, BV=bv, NCHUNK=nchunk, NUM_STAGES=stages, NCOLS=ncols,
        LOWER_BOUND=float(lower_bound), BOUNDED=True,
        MODE=mode, HAS_RIDX=record_indices is not None, HAS_PRIDX=pr is not None,
        EPS=1e-6, SCALE=K**-0.5,
        num_warps=warps,
    )
    return out
