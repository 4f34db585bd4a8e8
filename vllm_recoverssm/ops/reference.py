"""The oracle: the KDA recurrence and its speculative-decoding state operations in PyTorch.

Every kernel (Triton, CUDA, b12x's adapter) has its twin here and is tested against it;
the public operations (:mod:`.api`) also run it for ``backend="reference"`` and for
tensors off CUDA. It runs on any device and in float32 or float64, one token at a time, in
the arithmetic order of ``../DESIGN.md`` section 2.
Layouts (shared with the Triton kernels):

* tokens are flat and variable-length: ``q, k, raw_g: [T, H, K]``, ``v: [T, H, V]``,
  ``raw_beta: [T, H]``, request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``;
* the recurrent state pool is ``[slots, H, V, K]`` (K contiguous);
* a state index below zero is the null slot: the row reads and writes nothing and its
  outputs are zero;
* recovery records live in ``corrections: [R, H, W, V]`` (FP32) and ``kg: [R, H, W, 2K]``
  (raw k then raw g, activation dtype), addressed by ``record_indices`` (default: the
  request's row in the batch, i.e. a scratch area), ``W = S + 1``.
"""

from __future__ import annotations

import math

import torch

L2NORM_EPS = 1e-6


def kda_gate(
    raw_g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
) -> torch.Tensor:
    """Log-decay ``g`` from the raw gate.

    ``raw_g`` is ``[..., H, K]``, ``A_log`` is ``[H]`` and ``dt_bias`` is ``[H, K]``.
    Bounded gate: ``lower_bound * sigmoid(exp(A_log) * x)``; unbounded:
    ``-exp(A_log) * softplus(x)`` with ``x = raw_g + dt_bias``.
    """
    x = raw_g + dt_bias
    a = torch.exp(A_log)[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * torch.nn.functional.softplus(x)


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x * x) + eps)`` along the last dimension."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KDA token for a batch of heads.

    ``state`` is ``[..., H, V, K]``; ``q, k, raw_g`` ``[..., H, K]``; ``v`` ``[..., H, V]``;
    ``raw_beta`` ``[..., H]``. Everything is computed in ``state.dtype``. Returns
    ``(output [..., H, V], new_state, correction [..., H, V])``; ``state`` is not modified.
    """
    dt = state.dtype
    K = q.shape[-1]
    qh = l2_normalize(q.to(dt)) * (K**-0.5)
    kh = l2_normalize(k.to(dt))
    decay = torch.exp(kda_gate(raw_g.to(dt), A_log.to(dt), dt_bias.to(dt), lower_bound))
    beta = torch.sigmoid(raw_beta.to(dt))
    s = state * decay[..., None, :]
    c = beta[..., None] * (v.to(dt) - (s * kh[..., None, :]).sum(-1))
    s = s + c[..., :, None] * kh[..., None, :]
    o = (s * qh[..., None, :]).sum(-1)
    return o, s, c


def commit_step(
    state: torch.Tensor,
    correction: torch.Tensor,
    raw_k: torch.Tensor,
    raw_g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
) -> torch.Tensor:
    """Apply one recorded update ``S = S * diag(a) + outer(c, k^)`` (forward replay)."""
    dt = state.dtype
    kh = l2_normalize(raw_k.to(dt))
    decay = torch.exp(kda_gate(raw_g.to(dt), A_log.to(dt), dt_bias.to(dt), lower_bound))
    return state * decay[..., None, :] + correction.to(dt)[..., :, None] * kh[..., None, :]


def _rows(query_start_loc: torch.Tensor) -> list[tuple[int, int]]:
    qsl = query_start_loc.tolist()
    return [(int(qsl[i]), int(qsl[i + 1])) for i in range(len(qsl) - 1)]


def _out_dtype(state: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    return state.dtype if out_dtype is None else out_dtype


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    lower_bound: float | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Sequential prefill of each request from the state in its slot.

    The final state of request ``i`` is written back to ``state[state_indices[i]]``.
    Returns the outputs ``[T, H, V]``.
    """
    out = torch.zeros(v.shape, dtype=_out_dtype(state, out_dtype), device=v.device)
    for i, (start, end) in enumerate(_rows(query_start_loc)):
        slot = int(state_indices[i])
        if slot < 0 or end <= start:
            continue
        s = state[slot]
        for t in range(start, end):
            o, s, _ = kda_step(
                s, q[t], k[t], v[t], raw_g[t], raw_beta[t], A_log, dt_bias, lower_bound
            )
            out[t] = o.to(out.dtype)
        state[slot] = s
    return out


def verify_full(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    query_start_loc: torch.Tensor,
    lower_bound: float | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Full-state speculative verify (the baseline).

    ``state_indices`` is ``[N, S+1]``: request ``i`` starts from the state in column
    ``num_accepted[i] - 1`` (the last accepted token of the previous step) and writes the
    state after its token ``t`` into column ``t``. Returns the outputs ``[T, H, V]``.
    """
    out = torch.zeros(v.shape, dtype=_out_dtype(state, out_dtype), device=v.device)
    for i, (start, end) in enumerate(_rows(query_start_loc)):
        if end <= start:
            continue
        src = int(state_indices[i, int(num_accepted[i]) - 1])
        if src < 0:
            continue
        s = state[src].clone()
        for j, t in enumerate(range(start, end)):
            o, s, _ = kda_step(
                s, q[t], k[t], v[t], raw_g[t], raw_beta[t], A_log, dt_bias, lower_bound
            )
            out[t] = o.to(out.dtype)
            dst = int(state_indices[i, j])
            if dst >= 0:
                state[dst] = s
    return out


def verify_recovery(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    corrections: torch.Tensor,
    kg: torch.Tensor,
    lower_bound: float | None,
    record_indices: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Recovery verify: outputs plus per-token records; the checkpoint is never written.

    For request ``i`` and its ``t``-th token this stores the correction into
    ``corrections[r, :, t]`` and raw k / raw g into ``kg[r, :, t, :K]`` / ``kg[r, :, t, K:]``
    with ``r = record_indices[i]`` (default ``i``). Returns the outputs ``[T, H, V]``.
    """
    K = q.shape[-1]
    out = torch.zeros(v.shape, dtype=_out_dtype(state, out_dtype), device=v.device)
    for i, (start, end) in enumerate(_rows(query_start_loc)):
        slot = int(state_indices[i])
        if slot < 0 or end <= start:
            continue
        r = i if record_indices is None else int(record_indices[i])
        s = state[slot]
        for j, t in enumerate(range(start, end)):
            o, s, c = kda_step(
                s, q[t], k[t], v[t], raw_g[t], raw_beta[t], A_log, dt_bias, lower_bound
            )
            out[t] = o.to(out.dtype)
            corrections[r, :, j] = c.to(corrections.dtype)
            kg[r, :, j, :K] = k[t].to(kg.dtype)
            kg[r, :, j, K:] = raw_g[t].to(kg.dtype)
    return out


def verify_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    corrections: torch.Tensor,
    kg: torch.Tensor,
    prev_corrections: torch.Tensor,
    prev_kg: torch.Tensor,
    prev_lens: torch.Tensor,
    lower_bound: float | None,
    record_indices: torch.Tensor | None = None,
    prev_record_indices: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Deferred commit, then recovery verify: the fused step, written as its two parts.

    Request ``i`` first commits the ``prev_lens[i]`` records of the previous step (rows
    ``prev_record_indices[i]`` of ``prev_corrections`` / ``prev_kg``, default ``i``) into its
    checkpoint in place, then verifies this step's tokens from the committed state as
    :func:`verify_recovery` does. Returns the outputs ``[T, H, V]``.
    """
    commit(state, prev_corrections, prev_kg, A_log, dt_bias, state_indices, prev_lens,
           lower_bound, record_indices=prev_record_indices)
    return verify_recovery(q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices,
                           query_start_loc, corrections, kg, lower_bound,
                           record_indices=record_indices, out_dtype=out_dtype)


def commit(
    state: torch.Tensor,
    corrections: torch.Tensor,
    kg: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    commit_lens: torch.Tensor,
    lower_bound: float | None,
    record_indices: torch.Tensor | None = None,
    final_indices: torch.Tensor | None = None,
    boundary_indices: torch.Tensor | None = None,
    boundary_lens: torch.Tensor | None = None,
) -> None:
    """Forward replay of the first ``commit_lens[i]`` records of each request.

    Reads the checkpoint from ``state_indices[i]`` and writes the committed state to
    ``final_indices[i]`` (default: the same slot). In align mode, a request whose
    ``boundary_indices[i] >= 0`` also gets the state after ``boundary_lens[i]`` tokens
    written into that slot. ``commit_lens[i] == 0`` leaves the state unchanged (copied to
    the final slot when it differs).
    """
    K = kg.shape[-1] // 2
    for i in range(state_indices.shape[0]):
        src = int(state_indices[i])
        if src < 0:
            continue
        r = i if record_indices is None else int(record_indices[i])
        dst = src if final_indices is None else int(final_indices[i])
        bslot = -1 if boundary_indices is None else int(boundary_indices[i])
        blen = 0 if boundary_lens is None else int(boundary_lens[i])
        s = state[src].clone()
        for t in range(int(commit_lens[i])):
            s = commit_step(
                s, corrections[r, :, t], kg[r, :, t, :K], kg[r, :, t, K:],
                A_log, dt_bias, lower_bound,
            )
            if bslot >= 0 and t + 1 == blen:
                state[bslot] = s
        if dst >= 0:
            state[dst] = s


def capture_boundary(
    state: torch.Tensor,
    conv_state: torch.Tensor | None,
    state_indices: torch.Tensor,
    boundary_indices: torch.Tensor,
    boundary_lens: torch.Tensor,
) -> None:
    """Full-state align-mode capture: copy the state after token ``boundary_lens[i]``.

    The recurrent state comes from column ``boundary_lens[i] - 1`` of ``state_indices``
    (``[N, S+1]``); the conv history from offset ``boundary_lens[i] - 1`` of the window in
    the request's first column slot, written at offset 0 of the boundary slot.
    Rows with ``boundary_indices[i] < 0`` or ``boundary_lens[i] <= 0`` are skipped.
    """
    for i in range(state_indices.shape[0]):
        b = int(boundary_lens[i])
        dst = int(boundary_indices[i])
        if dst < 0 or b <= 0:
            continue
        src = int(state_indices[i, b - 1])
        if src >= 0:
            state[dst] = state[src]
        if conv_state is not None:
            conv_src = int(state_indices[i, 0])
            if conv_src < 0:
                continue
            # The window is Kc-1+S wide and state_indices has S+1 columns.
            hist_len = conv_state.shape[-1] - (state_indices.shape[1] - 1)
            off = b - 1
            conv_state[dst, :, :hist_len] = conv_state[conv_src, :, off : off + hist_len].clone()


# ---------------------------------------------------------------------------------------
# Short causal convolution (depthwise, width Kc) with a Kc-1+S wide window per slot.
# ---------------------------------------------------------------------------------------


def _conv_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "silu":
        return torch.nn.functional.silu(y)
    raise ValueError(f"argument 'activation': expected 'silu' or None, got {activation!r}")


def conv_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv over whole sequences, continuing from each slot's history.

    ``x`` is ``[T, C]``, ``conv_state`` ``[slots, C, Kc-1+S]`` (history of the last Kc-1
    inputs at offset 0, oldest first), ``weight`` ``[C, Kc]``. Afterwards offset 0 holds the
    last Kc-1 inputs of the sequence. Computed in float32 (float64 for float64 inputs).
    """
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    Kc = weight.shape[1]
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    for i, (start, end) in enumerate(_rows(query_start_loc)):
        slot = int(state_indices[i])
        if slot < 0 or end <= start:
            continue
        hist = conv_state[slot, :, : Kc - 1].to(cdt)
        seq = torch.cat([hist, x[start:end].to(cdt).t()], dim=1)  # [C, Kc-1+L]
        windows = seq.unfold(1, Kc, 1)  # [C, L, Kc]
        y = (windows * weight.to(cdt)[:, None, :]).sum(-1)
        if bias is not None:
            y = y + bias.to(cdt)[:, None]
        out[start:end] = _conv_activation(y, activation).t().to(x.dtype)
        conv_state[slot, :, : Kc - 1] = seq[:, -(Kc - 1) :].to(conv_state.dtype)
    return out


def conv_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv_offsets: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Speculative conv update over up to S+1 tokens per request.

    The history is read at ``conv_offsets[i]`` (default 0; full-state mode without
    compaction passes ``num_accepted - 1``). With ``hist`` the Kc-1 history columns and
    ``x_0..x_{T-1}`` the new inputs, the window becomes ``[hist[1:], x_0, ..., x_{T-1}]`` from
    offset 0, so the history after ``n`` accepted tokens sits at offset ``n - 1``.
    """
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    Kc = weight.shape[1]
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    for i, (start, end) in enumerate(_rows(query_start_loc)):
        slot = int(state_indices[i])
        if slot < 0 or end <= start:
            continue
        off = 0 if conv_offsets is None else int(conv_offsets[i])
        hist = conv_state[slot, :, off : off + Kc - 1].to(cdt)
        seq = torch.cat([hist, x[start:end].to(cdt).t()], dim=1)
        windows = seq.unfold(1, Kc, 1)
        y = (windows * weight.to(cdt)[:, None, :]).sum(-1)
        if bias is not None:
            y = y + bias.to(cdt)[:, None]
        out[start:end] = _conv_activation(y, activation).t().to(x.dtype)
        tail = seq[:, 1:]
        conv_state[slot, :, : tail.shape[1]] = tail.to(conv_state.dtype)
    return out


def conv_compact(
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    commit_lens: torch.Tensor,
    kernel_width: int,
    final_indices: torch.Tensor | None = None,
    boundary_indices: torch.Tensor | None = None,
    boundary_lens: torch.Tensor | None = None,
) -> None:
    """Move the accepted conv history to offset 0 (zero speculative offset).

    For ``n = commit_lens[i] >= 1`` the history ending at accepted token ``n`` sits at
    offset ``n - 1`` of the window written by :func:`conv_update`; it is copied to offset 0
    of ``final_indices[i]`` (default: the same slot). ``n == 0`` means no update ran for the
    row: the history stays at offset 0 (copied when the final slot differs). In align mode
    the history after ``boundary_lens[i]`` tokens is also written to ``boundary_indices[i]``.
    """
    h = kernel_width - 1
    for i in range(state_indices.shape[0]):
        src = int(state_indices[i])
        if src < 0:
            continue
        window = conv_state[src].clone()
        n = int(commit_lens[i])
        if boundary_indices is not None and boundary_lens is not None:
            bslot, b = int(boundary_indices[i]), int(boundary_lens[i])
            if bslot >= 0 and b >= 1:
                conv_state[bslot, :, :h] = window[:, b - 1 : b - 1 + h]
        dst = src if final_indices is None else int(final_indices[i])
        if dst < 0:
            continue
        off = max(n - 1, 0)
        conv_state[dst, :, :h] = window[:, off : off + h]


def default_scale(head_dim: int) -> float:
    """The query scale ``K**-0.5`` applied after normalisation."""
    return 1.0 / math.sqrt(head_dim)
