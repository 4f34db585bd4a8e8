"""Public state operations: one function per operation, Triton or reference behind it.

``backend="auto"`` runs the Triton kernels on CUDA tensors and the PyTorch reference on
anything else; ``"triton"`` forces the kernels (on CPU tensors this needs
``TRITON_INTERPRET=1``) and ``"reference"`` forces the reference. All arguments are
validated first (``validate=False`` skips the checks that read device values, e.g. during
CUDA-graph capture, once the caller has validated the same buffers).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import reference as ref
from .validation import (
    ACTIVATION_DTYPES,
    INDEX_DTYPES,
    check_index_range,
    check_inner_contiguous,
    check_num_spec,
    check_query_start_loc,
    check_tensor,
    check_token_inputs,
)

BACKENDS = ("auto", "triton", "reference")

CONV_PREFILL_MAX_WIDTH = 4
"""Widest conv the Triton prefill kernel holds in registers (GLM-5.3, Kimi and Qwen3-Next
use 4)."""

if TYPE_CHECKING:
    from .triton_kda import CommitTables


def commit_tables(
    states: torch.Tensor | Sequence[torch.Tensor],
    corrections: torch.Tensor | Sequence[torch.Tensor],
    kg: torch.Tensor | Sequence[torch.Tensor],
) -> CommitTables:
    """Per-layer address tables for :func:`commit`, built once for a set of pools."""
    from .triton_kda import CommitTables

    return CommitTables(_as_layer_list("states", states),
                        _as_layer_list("corrections", corrections), _as_layer_list("kg", kg))


@dataclass
class CommitPlan:
    """What commit and conv compaction do for each request row of a step.

    ``state_indices``: the checkpoint slot (negative = null row); ``commit_lens``: accepted
    tokens to replay (0..S+1); ``final_indices``: where the committed state goes (default:
    in place); ``boundary_indices`` / ``boundary_lens``: align-mode block slot that receives
    the state after ``boundary_lens`` tokens (negative slot = no boundary this step).
    """

    state_indices: torch.Tensor
    commit_lens: torch.Tensor
    final_indices: torch.Tensor | None = None
    boundary_indices: torch.Tensor | None = None
    boundary_lens: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Number of request rows in the plan."""
        return int(self.state_indices.shape[0])

    def validate(self, num_slots: int, max_len: int, device: torch.device) -> None:
        """Check dtypes, shapes, devices and index ranges of every field."""
        n = self.num_rows
        check_tensor("plan.state_indices", self.state_indices, dtypes=INDEX_DTYPES,
                     shape=[n], device=device, contiguous=True)
        check_index_range("plan.state_indices", self.state_indices, num_slots, True)
        check_tensor("plan.commit_lens", self.commit_lens, dtypes=INDEX_DTYPES, shape=[n],
                     device=device, contiguous=True)
        if n and (int(self.commit_lens.min()) < 0 or int(self.commit_lens.max()) > max_len):
            raise ValueError(
                f"argument 'plan.commit_lens': expected values in 0..{max_len}, got "
                f"{self.commit_lens.tolist()}"
            )
        for name in ("final_indices", "boundary_indices", "boundary_lens"):
            t = getattr(self, name)
            if t is None:
                continue
            check_tensor(f"plan.{name}", t, dtypes=INDEX_DTYPES, shape=[n], device=device,
                         contiguous=True)
            if name != "boundary_lens":
                check_index_range(f"plan.{name}", t, num_slots, True)
        if (self.boundary_indices is None) != (self.boundary_lens is None):
            raise ValueError(
                "argument 'plan': boundary_indices and boundary_lens must be given together"
            )
        if self.boundary_lens is not None and n:
            bl = self.boundary_lens
            has_b = self.boundary_indices >= 0  # type: ignore[operator]
            bad = has_b & ((bl < 1) | (bl > self.commit_lens))
            if bool(bad.any()):
                raise ValueError(
                    "argument 'plan.boundary_lens': a row with a boundary slot needs "
                    f"1 <= boundary_len <= commit_len, got {bl.tolist()} with commit_lens "
                    f"{self.commit_lens.tolist()}"
                )


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"argument 'backend': expected one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"argument 'backend': 'triton' on {device.type} tensors needs "
                "TRITON_INTERPRET=1 (or CUDA tensors)"
            )
        return True
    return device.type == "cuda"


def _lower_bound(lower_bound: float | None) -> float | None:
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(
            f"argument 'lower_bound': expected a negative bound or None, got {lower_bound}"
        )
    return lower_bound


def _check_records(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
    corrections: torch.Tensor, kg: torch.Tensor, record_indices: torch.Tensor | None,
) -> tuple[int, int, int]:
    """The recovery verify's checks; returns (requests N, window W, record rows R)."""
    T, H, K, V = check_token_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state)
    dev = state.device
    n = check_tensor("state_indices", state_indices, dtypes=INDEX_DTYPES, device=dev,
                     contiguous=True)
    if n.dim() != 1:
        raise ValueError(
            f"argument 'state_indices': expected shape [N] (one checkpoint slot per "
            f"request), got {list(n.shape)}"
        )
    N = n.shape[0]
    W, R = _check_record_pool("corrections", "kg", corrections, kg, state, q.dtype, H, K, V)
    check_index_range("state_indices", n, state.shape[0], True)
    check_query_start_loc(query_start_loc, N, T, W, dev)
    _check_rows("record_indices", "corrections", record_indices, N, R, dev)
    return N, W, R


def _check_record_pool(
    corr_name: str, kg_name: str, corrections: torch.Tensor, kg: torch.Tensor,
    state: torch.Tensor, act_dtype: torch.dtype, H: int, K: int, V: int, window: int = 0,
) -> tuple[int, int]:
    """Shapes of a record pool ``[R, H, W, V]`` + ``[R, H, W, 2K]``; returns (W, R)."""
    dev = state.device
    check_tensor(corr_name, corrections, dtypes=(state.dtype,), device=dev)
    if corrections.dim() != 4 or corrections.shape[1] != H or corrections.shape[3] != V:
        raise ValueError(
            f"argument '{corr_name}': expected shape [R, {H}, S+1, {V}], got "
            f"{list(corrections.shape)}"
        )
    W = corrections.shape[2]
    check_num_spec(corr_name, W)
    if window and W != window:
        raise ValueError(
            f"argument '{corr_name}': expected a window of {window} columns like the new "
            f"records, got {W}"
        )
    check_inner_contiguous(corr_name, corrections, 3)
    R = corrections.shape[0]
    check_tensor(kg_name, kg, dtypes=(act_dtype,), shape=[R, H, W, 2 * K], device=dev)
    check_inner_contiguous(kg_name, kg, 3)
    return W, R


def _check_rows(name: str, pool: str, rows: torch.Tensor | None, N: int, R: int,
                dev: torch.device) -> None:
    """``rows`` is ``[N]`` in ``0..R-1`` (negative: none), or None (row ``i``: R >= N)."""
    if rows is None:
        if R < N:
            raise ValueError(
                f"argument '{pool}': expected at least {N} record rows (one per "
                f"request), got {R}"
            )
        return
    check_tensor(name, rows, dtypes=INDEX_DTYPES, shape=[N], device=dev, contiguous=True)
    check_index_range(name, rows, R, True)


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
) -> torch.Tensor:
    """Recovery verify of up to S+1 tokens per request; returns outputs in ``q.dtype``.

    Reads each request's checkpoint ``state[state_indices[i]]`` and never writes it;
    writes FP32 corrections ``corrections[r, h, t, :]`` and raw k / raw g
    ``kg[r, h, t, :]`` for ``r = record_indices[i]`` (default ``i``: a scratch area).
    """
    if validate:
        _check_records(q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices,
                       query_start_loc, corrections, kg, record_indices)
    lb = _lower_bound(lower_bound)
    if _use_triton(backend, state.device):
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
    """
    pc = corrections if prev_corrections is None else prev_corrections
    pk = kg if prev_kg is None else prev_kg
    if validate:
        N, W, R = _check_records(q, k, v, raw_g, raw_beta, A_log, dt_bias, state,
                                 state_indices, query_start_loc, corrections, kg,
                                 record_indices)
        _, H, V, K = state.shape
        _, R_prev = _check_record_pool("prev_corrections", "prev_kg", pc, pk, state, q.dtype,
                                       H, K, V, window=W)
        dev = state.device
        check_tensor("prev_lens", prev_lens, dtypes=INDEX_DTYPES, shape=[N], device=dev,
                     contiguous=True)
        if N and (int(prev_lens.min()) < 0 or int(prev_lens.max()) > W):
            raise ValueError(
                f"argument 'prev_lens': expected values in 0..{W}, got {prev_lens.tolist()}"
            )
        _check_rows("prev_record_indices", "prev_corrections", prev_record_indices, N,
                    R_prev, dev)
        if N and (_overlaps(pc, corrections) or _overlaps(pk, kg)):
            new = set(range(N)) if record_indices is None else set(record_indices.tolist())
            old = list(range(N)) if prev_record_indices is None else \
                prev_record_indices.tolist()
            read = {r for r, n in zip(old, prev_lens.tolist(), strict=True) if n > 0 and r >= 0}
            clash = sorted(read & {r for r in new if r >= 0})
            if clash:
                raise ValueError(
                    f"argument 'prev_record_indices': rows {clash[:8]} are read as previous "
                    "records and written as new ones in the same pool; use other rows "
                    "(e.g. alternate halves of the scratch by step parity)"
                )
    lb = _lower_bound(lower_bound)
    if _use_triton(backend, state.device):
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
) -> torch.Tensor:
    """Full-state speculative verify (the baseline): one state written per token.

    ``state_indices`` is ``[N, S+1]``; request ``i`` starts from column
    ``num_accepted[i] - 1`` and writes the state after its token ``t`` to column ``t``.
    """
    if validate:
        T, H, K, V = check_token_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state)
        dev = state.device
        si = check_tensor("state_indices", state_indices, dtypes=INDEX_DTYPES, device=dev,
                          contiguous=True)
        if si.dim() != 2:
            raise ValueError(
                f"argument 'state_indices': expected shape [N, S+1], got {list(si.shape)}"
            )
        N, W = si.shape
        check_num_spec("state_indices", W)
        check_index_range("state_indices", si, state.shape[0], True)
        na = check_tensor("num_accepted", num_accepted, dtypes=INDEX_DTYPES, shape=[N],
                          device=dev, contiguous=True)
        if N and (int(na.min()) < 1 or int(na.max()) > W):
            raise ValueError(
                f"argument 'num_accepted': expected values in 1..{W}, got {na.tolist()}"
            )
        check_query_start_loc(query_start_loc, N, T, W, dev)
    lb = _lower_bound(lower_bound)
    if _use_triton(backend, state.device):
        from .triton_kda import verify_full_triton

        return verify_full_triton(
            q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, num_accepted,
            query_start_loc, lb,
        )
    return ref.verify_full(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, num_accepted,
        query_start_loc, lb, out_dtype=q.dtype,
    )


def _as_layer_list(name: str, x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    out = list(x)
    if not out:
        raise ValueError(f"argument '{name}': expected at least one layer, got none")
    return out


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
    st = _as_layer_list("states", states)
    co = _as_layer_list("corrections", corrections)
    kgs = _as_layer_list("kg", kg)
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
        if record_indices is None:
            if R < plan.num_rows:
                raise ValueError(
                    f"argument 'corrections': expected at least {plan.num_rows} record rows, "
                    f"got {R}"
                )
        else:
            check_tensor("record_indices", record_indices, dtypes=INDEX_DTYPES,
                         shape=[plan.num_rows], device=dev, contiguous=True)
            check_index_range("record_indices", record_indices, R, True)
    lb = _lower_bound(lower_bound)
    if _use_triton(backend, st[0].device):
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


def _check_slot_indices(state_indices: torch.Tensor, slots: int, device: torch.device) -> int:
    """``state_indices`` is ``[N]`` with values in ``[0, slots)`` or null; returns N."""
    shape = check_tensor("state_indices", state_indices, dtypes=INDEX_DTYPES, device=device,
                         contiguous=True).shape
    if len(shape) != 1:
        raise ValueError(f"argument 'state_indices': expected shape [N], got {list(shape)}")
    check_index_range("state_indices", state_indices, slots, True)
    return int(shape[0])


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
        N = _check_slot_indices(state_indices, state.shape[0], state.device)
        check_query_start_loc(query_start_loc, N, T, max(T, 1), state.device)
    lb = _lower_bound(lower_bound)
    dtype = state.dtype if out_dtype is None else out_dtype
    triton_ok = state.dtype == torch.float32 or backend == "triton"
    if triton_ok and _use_triton(backend, state.device):
        from .triton_kda import _check_head_dims, _check_kernel_dtypes
        from .triton_prefill import prefill_triton

        _check_kernel_dtypes(state)
        _check_head_dims(state.shape[3], state.shape[2])
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
        _check_conv(x, conv_state, weight, bias, activation)
        N = _check_slot_indices(state_indices, conv_state.shape[0], x.device)
        check_query_start_loc(query_start_loc, N, x.shape[0], max(x.shape[0], 1), x.device)
    fits = weight.shape[1] <= CONV_PREFILL_MAX_WIDTH and x.dtype != torch.float64
    if (fits or backend == "triton") and _use_triton(backend, x.device):
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
        _check_conv(x, conv_state, weight, bias, activation)
        dev = x.device
        N = _check_slot_indices(state_indices, conv_state.shape[0], dev)
        Kc = weight.shape[1]
        max_len = conv_state.shape[2] - (Kc - 1) + 1
        check_num_spec("conv_state", max_len)
        check_query_start_loc(query_start_loc, N, x.shape[0], max_len, dev)
        if conv_offsets is not None:
            check_tensor("conv_offsets", conv_offsets, dtypes=INDEX_DTYPES, shape=[N],
                         device=dev, contiguous=True)
            if N and (int(conv_offsets.min()) < 0 or int(conv_offsets.max()) > max_len - 1):
                raise ValueError(
                    f"argument 'conv_offsets': expected values in 0..{max_len - 1}, got "
                    f"{conv_offsets.tolist()}"
                )
    if _use_triton(backend, x.device):
        from .triton_conv import conv_update_triton

        return conv_update_triton(x, conv_state, weight, bias, state_indices, query_start_loc,
                                  conv_offsets, activation)
    return ref.conv_update(x, conv_state, weight, bias, state_indices, query_start_loc,
                           conv_offsets=conv_offsets, activation=activation)


def _check_conv(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None, activation: str | None,
) -> None:
    cs = check_tensor("conv_state", conv_state, dtypes=ACTIVATION_DTYPES)
    if cs.dim() != 3:
        raise ValueError(
            f"argument 'conv_state': expected shape [slots, C, Kc-1+S], got {list(cs.shape)}"
        )
    check_inner_contiguous("conv_state", cs, 2)
    C = cs.shape[1]
    dev = cs.device
    check_tensor("x", x, dtypes=(cs.dtype,), shape=[None, C], device=dev, contiguous=True)
    w = check_tensor("weight", weight, dtypes=ACTIVATION_DTYPES, shape=[C, None], device=dev,
                     contiguous=True)
    if not 2 <= w.shape[1] <= cs.shape[2]:
        raise ValueError(
            f"argument 'weight': expected a kernel width in 2..{cs.shape[2]}, got {w.shape[1]}"
        )
    if bias is not None:
        check_tensor("bias", bias, dtypes=ACTIVATION_DTYPES, shape=[C], device=dev,
                     contiguous=True)
    if activation not in ("silu", None):
        raise ValueError(f"argument 'activation': expected 'silu' or None, got {activation!r}")


def conv_compact(
    conv_states: torch.Tensor | Sequence[torch.Tensor],
    plan: CommitPlan,
    *,
    kernel_width: int,
    backend: str = "auto",
    validate: bool = True,
) -> None:
    """Move each request's accepted conv history to offset 0, for every layer at once."""
    cs = _as_layer_list("conv_states", conv_states)
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
    if _use_triton(backend, cs[0].device):
        from .triton_conv import conv_compact_triton

        conv_compact_triton(cs, plan, kernel_width)
        return
    for c in cs:
        ref.conv_compact(c, plan.state_indices, plan.commit_lens, kernel_width,
                         final_indices=plan.final_indices,
                         boundary_indices=plan.boundary_indices,
                         boundary_lens=plan.boundary_lens)
