"""Public state operations: one function per operation, kernels or reference behind it.

``backend`` picks the implementation (:func:`.backends.use_kernels`: ``"auto"`` runs the
kernels on CUDA tensors and the PyTorch reference, the oracle, on anything else). All
arguments are validated first (``validate=False`` skips the checks, e.g. during CUDA-graph
capture, once the caller has validated the same buffers). The checks of a step's index
tensors read them back to the host; a caller running one step over many layers builds a
:class:`.plan.VerifyPlan` once (:func:`.plan.plan_verify`) and passes it as ``step=``, so
each layer's call checks only its own tensors, without device reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import reference as ref
from .backends import BACKENDS, use_kernels
from .plan import CommitPlan, CommitTables, VerifyPlan, commit_tables, plan_verify
from .validation import (
    ACTIVATION_DTYPES,
    INDEX_DTYPES,
    as_layer_list,
    check_conv,
    check_head_dims,
    check_inner_contiguous,
    check_kernel_state,
    check_lower_bound,
    check_num_spec,
    check_query_start_loc,
    check_record_pool,
    check_records,
    check_rows,
    check_slot_indices,
    check_step_values,
    check_tensor,
    check_token_inputs,
)

__all__ = ["BACKENDS", "CONV_PREFILL_MAX_WIDTH", "CommitPlan", "CommitTables", "VerifyPlan",
           "commit", "commit_tables", "conv_compact", "conv_prefill", "conv_update",
           "plan_verify", "prefill", "verify_full", "verify_fused", "verify_recovery"]

CONV_PREFILL_MAX_WIDTH = 4
"""Widest conv the Triton prefill kernel holds in registers (GLM-5.3, Kimi and Qwen3-Next
use 4)."""


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
    *,
    lower_bound: float | None,
    record_indices: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
    step: VerifyPlan | None = None,
) -> torch.Tensor:
    """Recovery verify of up to S+1 tokens per request; returns outputs in ``q.dtype``.

    Reads each request's checkpoint ``state[state_indices[i]]`` and never writes it;
    writes FP32 corrections ``corrections[r, h, t, :]`` and raw k / raw g
    ``kg[r, h, t, :]`` for ``r = record_indices[i]`` (default ``i``: a scratch area).
    ``step``: the step's index tensors, checked once (see the module docstring).
    """
    if validate:
        T, _, _, _, W, R = check_records(q, k, v, raw_g, raw_beta, A_log, dt_bias, state,
                                         corrections, kg)
        layer = VerifyPlan(state_indices, query_start_loc, state.shape[0], T, W,
                           record_indices=record_indices, record_rows=R)
        layer.check(step, state.device)
    lb = check_lower_bound(lower_bound)
    if use_kernels(backend, state.device):
        from .triton_kda import verify_recovery_triton

        return verify_recovery_triton(
            q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices,
            query_start_loc, corrections, kg, lb, record_indices,
        )
    return ref.verify_recovery(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, query_start_loc,
        corrections, kg, lb, record_indices=record_indices, out_dtype=q.dtype,
    )


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return bool(sa.data_ptr() == sb.data_ptr())


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
    prev_lens: torch.Tensor,
    *,
    lower_bound: float | None,
    record_indices: torch.Tensor | None = None,
    prev_record_indices: torch.Tensor | None = None,
    prev_corrections: torch.Tensor | None = None,
    prev_kg: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
    step: VerifyPlan | None = None,
) -> torch.Tensor:
    """Commit fused into the next verify: one launch, the state read once and written once.

    Request ``i`` first replays the ``prev_lens[i]`` accepted records of its previous step
    (rows ``prev_record_indices[i]``, default ``i``, of ``prev_corrections`` / ``prev_kg``,
    default the same pools as this step's records) into its checkpoint
    ``state[state_indices[i]]`` and writes the committed state back in place, then runs
    :func:`verify_recovery` on this step's tokens from that state, writing its records
    to rows ``record_indices[i]``. ``prev_lens[i] == 0`` (nothing pending) makes it a plain
    recovery verify. Rows that are read as previous records must not be written as new
    ones (double-buffer the scratch, e.g. by step parity). Returns outputs in ``q.dtype``.
    The committed state equals :func:`commit` of the same records bit for bit (Triton).
    ``step``: the step's index tensors, checked once (see the module docstring).
    """
    pc = corrections if prev_corrections is None else prev_corrections
    pk = kg if prev_kg is None else prev_kg
    if validate:
        T, H, K, V, W, R = check_records(q, k, v, raw_g, raw_beta, A_log, dt_bias, state,
                                         corrections, kg)
        _, R_prev = check_record_pool("prev_corrections", "prev_kg", pc, pk, state, q.dtype,
                                      H, K, V, window=W)
        layer = VerifyPlan(state_indices, query_start_loc, state.shape[0], T, W,
                           record_indices=record_indices, record_rows=R, prev_lens=prev_lens,
                           prev_record_indices=prev_record_indices, prev_record_rows=R_prev,
                           prev_shares_pool=_overlaps(pc, corrections) or _overlaps(pk, kg))
        layer.check(step, state.device)
    lb = check_lower_bound(lower_bound)
    if use_kernels(backend, state.device):
        from .triton_kda import verify_fused_triton

        return verify_fused_triton(
            q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices,
            query_start_loc, corrections, kg, lb, record_indices,
            (pc, pk, prev_record_indices, prev_lens),
        )
    return ref.verify_fused(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, query_start_loc,
        corrections, kg, pc, pk, prev_lens, lb, record_indices=record_indices,
        prev_record_indices=prev_record_indices, out_dtype=q.dtype,
    )


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
    *,
    lower_bound: float | None,
    backend: str = "auto",
    validate: bool = True,
    step: VerifyPlan | None = None,
) -> torch.Tensor:
    """Full-state speculative verify (the baseline): one state written per token.

    ``state_indices`` is ``[N, S+1]``; request ``i`` starts from column
    ``num_accepted[i] - 1`` and writes the state after its token ``t`` to column ``t``.
    ``step``: the step's index tensors, checked once (see the module docstring).
    """
    if validate:
        T, _, _, _ = check_token_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state)
        si = check_tensor("state_indices", state_indices, dtypes=INDEX_DTYPES,
                          device=state.device)
        W = si.shape[1] if si.dim() == 2 else 0
        if W:
            check_num_spec("state_indices", W)
        layer = VerifyPlan(state_indices, query_start_loc, state.shape[0], T, W,
                           num_accepted=num_accepted)
        layer.check(step, state.device)
    lb = check_lower_bound(lower_bound)
    if use_kernels(backend, state.device):
        from .triton_kda import verify_full_triton

        return verify_full_triton(
            q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, num_accepted,
            query_start_loc, lb,
        )
    return ref.verify_full(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, num_accepted,
        query_start_loc, lb, out_dtype=q.dtype,
    )


def commit(
    states: torch.Tensor | Sequence[torch.Tensor],
    corrections: torch.Tensor | Sequence[torch.Tensor],
    kg: torch.Tensor | Sequence[torch.Tensor],
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    plan: CommitPlan,
    *,
    lower_bound: float | None,
    record_indices: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
    tables: CommitTables | None = None,
) -> None:
    """Commit the accepted tokens of every request into its checkpoint, in place.

    ``states``, ``corrections`` and ``kg`` are one tensor (one layer) or one per layer;
    ``A_log`` is ``[H]`` or ``[L, H]`` and ``dt_bias`` ``[H, K]`` or ``[L, H, K]``. All layers
    of a step are committed by one kernel launch. The launch reads per-layer addresses from
    device tables; pass ``tables`` (:func:`commit_tables`) built once for the same pools to
    avoid rebuilding them, which is required inside CUDA-graph capture.
    """
    st = as_layer_list("states", states)
    co = as_layer_list("corrections", corrections)
    kgs = as_layer_list("kg", kg)
    L = len(st)
    if A_log.dim() == 1:
        A_log = A_log[None]
    if dt_bias.dim() == 2:
        dt_bias = dt_bias[None]
    if validate:
        if len(co) != L or len(kgs) != L:
            raise ValueError(
                f"argument 'corrections'/'kg': expected {L} layers like 'states', got "
                f"{len(co)} and {len(kgs)}"
            )
        s0 = check_tensor("states[0]", st[0], dtypes=(torch.float32, torch.float64))
        if s0.dim() != 4:
            raise ValueError(
                f"argument 'states[0]': expected shape [slots, H, V, K], got {list(s0.shape)}"
            )
        slots, H, V, K = s0.shape
        dev = s0.device
        R, W = co[0].shape[0], co[0].shape[2] if co[0].dim() == 4 else -1
        for i in range(L):
            check_tensor(f"states[{i}]", st[i], dtypes=(s0.dtype,), shape=[slots, H, V, K],
                         device=dev)
            check_inner_contiguous(f"states[{i}]", st[i], 3)
            check_tensor(f"corrections[{i}]", co[i], dtypes=(s0.dtype,), shape=[R, H, W, V],
                         device=dev)
            check_inner_contiguous(f"corrections[{i}]", co[i], 3)
            check_tensor(f"kg[{i}]", kgs[i], dtypes=ACTIVATION_DTYPES,
                         shape=[R, H, W, 2 * K], device=dev)
            check_inner_contiguous(f"kg[{i}]", kgs[i], 3)
        check_num_spec("corrections", W)
        check_tensor("A_log", A_log, dtypes=(torch.float32, torch.float64), shape=[L, H],
                     device=dev)
        check_tensor("dt_bias", dt_bias, dtypes=(torch.float32, torch.float64),
                     shape=[L, H, K], device=dev)
        plan.validate(slots, W, dev)
        check_rows("record_indices", "corrections", record_indices, plan.num_rows, R, dev)
    lb = check_lower_bound(lower_bound)
    if use_kernels(backend, st[0].device):
        from .triton_kda import commit_triton

        if tables is not None and not tables.matches(st, co, kgs):
            raise ValueError(
                "argument 'tables': built for other pools than 'states'/'corrections'/'kg'"
            )
        commit_triton(st, co, kgs, A_log.contiguous(), dt_bias.contiguous(), plan, lb,
                      record_indices, tables=tables)
        return
    for i in range(L):
        ref.commit(
            st[i], co[i], kgs[i], A_log[i], dt_bias[i], plan.state_indices, plan.commit_lens,
            lb, record_indices=record_indices, final_indices=plan.final_indices,
            boundary_indices=plan.boundary_indices, boundary_lens=plan.boundary_lens,
        )


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
    *,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Sequential KDA over whole prompt rows, continuing from (and writing back) each slot.

    Row ``i`` (tokens ``query_start_loc[i]:query_start_loc[i+1]``, any length) starts from
    ``state[state_indices[i]]`` and leaves its final state there; a null slot reads and
    writes nothing and gets zero outputs. Returns ``[T, H, V]`` in ``out_dtype`` (default:
    the state's dtype). The Triton kernel serves FP32 states; FP64 runs the reference.
    """
    if validate:
        T, H, K, V = check_token_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state)
        N = check_slot_indices(state_indices, state.shape[0], state.device)
        check_query_start_loc(query_start_loc, N, T, max(T, 1), state.device)
    lb = check_lower_bound(lower_bound)
    dtype = state.dtype if out_dtype is None else out_dtype
    if use_kernels(backend, state.device, kernels_serve=state.dtype == torch.float32):
        from .triton_prefill import prefill_triton

        check_kernel_state(state)
        check_head_dims(state.shape[3], state.shape[2])
        return prefill_triton(q, k, v, raw_g, raw_beta, A_log, dt_bias, state,
                              state_indices, query_start_loc, lb, dtype)
    return ref.prefill(q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices,
                       query_start_loc, lb, out_dtype=dtype)


def conv_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    activation: str | None = "silu",
    *,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Causal depthwise conv over whole prompt rows; see :func:`reference.conv_prefill`.

    Offset 0 of each slot's window holds the history before the row and, afterwards, the
    last ``Kc - 1`` inputs. The Triton kernel holds convs up to width 4 in registers;
    wider ones, and float64 inputs, run the reference.
    """
    if validate:
        check_conv(x, conv_state, weight, bias, activation)
        N = check_slot_indices(state_indices, conv_state.shape[0], x.device)
        check_query_start_loc(query_start_loc, N, x.shape[0], max(x.shape[0], 1), x.device)
    fits = weight.shape[1] <= CONV_PREFILL_MAX_WIDTH and x.dtype != torch.float64
    if use_kernels(backend, x.device, kernels_serve=fits):
        from .triton_prefill import conv_prefill_triton

        if not fits:
            raise ValueError(
                f"argument 'weight': the Triton conv prefill takes widths up to "
                f"{CONV_PREFILL_MAX_WIDTH} and no float64, got width {weight.shape[1]} and "
                f"{x.dtype}; use backend='reference'"
            )
        return conv_prefill_triton(x, conv_state, weight, bias, state_indices,
                                   query_start_loc, activation)
    return ref.conv_prefill(x, conv_state, weight, bias, state_indices, query_start_loc,
                            activation=activation)


def conv_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    conv_offsets: torch.Tensor | None = None,
    activation: str | None = "silu",
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Speculative causal-conv update; see :func:`reference.conv_update` for the window."""
    if validate:
        check_conv(x, conv_state, weight, bias, activation)
        dev = x.device
        N = check_slot_indices(state_indices, conv_state.shape[0], dev)
        Kc = weight.shape[1]
        max_len = conv_state.shape[2] - (Kc - 1) + 1
        check_num_spec("conv_state", max_len)
        check_query_start_loc(query_start_loc, N, x.shape[0], max_len, dev)
        if conv_offsets is not None:
            check_tensor("conv_offsets", conv_offsets, dtypes=INDEX_DTYPES, shape=[N],
                         device=dev, contiguous=True)
            check_step_values("conv_offsets", conv_offsets, 0, max_len - 1)
    if use_kernels(backend, x.device):
        from .triton_conv import conv_update_triton

        return conv_update_triton(x, conv_state, weight, bias, state_indices, query_start_loc,
                                  conv_offsets, activation)
    return ref.conv_update(x, conv_state, weight, bias, state_indices, query_start_loc,
                           conv_offsets=conv_offsets, activation=activation)


def conv_compact(
    conv_states: torch.Tensor | Sequence[torch.Tensor],
    plan: CommitPlan,
    *,
    kernel_width: int,
    backend: str = "auto",
    validate: bool = True,
) -> None:
    """Move each request's accepted conv history to offset 0, for every layer at once."""
    cs = as_layer_list("conv_states", conv_states)
    if validate:
        c0 = check_tensor("conv_states[0]", cs[0], dtypes=ACTIVATION_DTYPES)
        if c0.dim() != 3:
            raise ValueError(
                f"argument 'conv_states[0]': expected shape [slots, C, Kc-1+S], got "
                f"{list(c0.shape)}"
            )
        for i, c in enumerate(cs):
            check_tensor(f"conv_states[{i}]", c, dtypes=(c0.dtype,), shape=[c0.shape[0], None,
                         c0.shape[2]], device=c0.device)
            check_inner_contiguous(f"conv_states[{i}]", c, 2)
        if not 2 <= kernel_width <= c0.shape[2]:
            raise ValueError(
                f"argument 'kernel_width': expected 2..{c0.shape[2]}, got {kernel_width}"
            )
        W = c0.shape[2] - (kernel_width - 1) + 1
        check_num_spec("conv_states", W)
        plan.validate(c0.shape[0], W, c0.device)
    if use_kernels(backend, cs[0].device):
        from .triton_conv import conv_compact_triton

        conv_compact_triton(cs, plan, kernel_width)
        return
    for c in cs:
        ref.conv_compact(c, plan.state_indices, plan.commit_lens, kernel_width,
                         final_indices=plan.final_indices,
                         boundary_indices=plan.boundary_indices,
                         boundary_lens=plan.boundary_lens)
