"""Argument checks run before any kernel launch.

Every failure is a ``ValueError`` that names the argument, what was given and what was
expected, so a caller never sees a kernel fault for a shape or dtype mistake.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MIN_NUM_SPEC = 1
MAX_NUM_SPEC = 7
INDEX_DTYPES = (torch.int32, torch.int64)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _fmt_dtypes(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d).replace("torch.", "") for d in dtypes]
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` in ``shape`` matches any size."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(
            f"argument '{name}': expected dtype {_fmt_dtypes(dtypes)}, got "
            f"{str(t.dtype).replace('torch.', '')}"
        )
    if shape is not None:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        if t.dim() != len(shape) or any(
            s is not None and s != g for s, g in zip(shape, t.shape, strict=True)
        ):
            raise ValueError(
                f"argument '{name}': expected shape {want}, got {list(t.shape)}"
            )
    if device is not None and t.device != device:
        raise ValueError(
            f"argument '{name}': expected a tensor on {device}, got one on {t.device}"
        )
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"argument '{name}': expected a contiguous tensor, got strides {list(t.stride())}"
        )
    return t


def check_inner_contiguous(name: str, t: torch.Tensor, inner_dims: int) -> None:
    """Require the last ``inner_dims`` dimensions to be densely packed (row-major)."""
    expected = 1
    for d in range(t.dim() - 1, t.dim() - 1 - inner_dims, -1):
        if t.shape[d] > 1 and t.stride(d) != expected:
            raise ValueError(
                f"argument '{name}': expected the last {inner_dims} dimensions to be "
                f"contiguous, got shape {list(t.shape)} with strides {list(t.stride())}"
            )
        expected *= t.shape[d]


def check_num_spec(name: str, window: int) -> int:
    """The speculative window is S+1 columns with S in 1..7; returns S."""
    num_spec = window - 1
    if not MIN_NUM_SPEC <= num_spec <= MAX_NUM_SPEC:
        raise ValueError(
            f"argument '{name}': expected a speculative window of S+1 columns with S in "
            f"{MIN_NUM_SPEC}..{MAX_NUM_SPEC}, got {window} columns (S = {num_spec})"
        )
    return num_spec


def check_index_range(name: str, idx: torch.Tensor, upper: int, allow_null: bool) -> None:
    """Indices must lie in ``[0, upper)``; negative values are the null slot if allowed."""
    if idx.numel() == 0:
        return
    lo = int(idx.min().item())
    hi = int(idx.max().item())
    if hi >= upper or (lo < 0 and not allow_null):
        bad = hi if hi >= upper else lo
        allowed = f"0..{upper - 1}" + (" or a negative null slot" if allow_null else "")
        raise ValueError(f"argument '{name}': index {bad} is out of range, expected {allowed}")


def check_query_start_loc(
    qsl: object, num_rows: int, num_tokens: int, max_len: int, device: torch.device
) -> None:
    """``query_start_loc`` is ``[N+1]``, non-decreasing, ends at T, rows at most max_len."""
    t = check_tensor("query_start_loc", qsl, dtypes=INDEX_DTYPES, shape=[num_rows + 1],
                     device=device, contiguous=True)
    if num_rows == 0:
        return
    lens = t[1:] - t[:-1]
    if int(t[0].item()) != 0 or int(t[-1].item()) > num_tokens or int(lens.min().item()) < 0:
        raise ValueError(
            f"argument 'query_start_loc': expected non-decreasing offsets from 0 up to at "
            f"most {num_tokens} tokens, got {t.tolist()}"
        )
    longest = int(lens.max().item())
    if longest > max_len:
        raise ValueError(
            f"argument 'query_start_loc': a request has {longest} tokens, expected at most "
            f"{max_len} (S+1) per speculative step"
        )


def check_token_inputs(
    q: object, k: object, v: object, raw_g: object, raw_beta: object,
    A_log: object, dt_bias: object, state: object,
) -> tuple[int, int, int, int]:
    """Shapes, dtypes and devices shared by the verify kernels; returns (T, H, K, V)."""
    st = check_tensor("state", state, dtypes=(torch.float32, torch.float64))
    if st.dim() != 4:
        raise ValueError(
            f"argument 'state': expected shape [slots, H, V, K], got {list(st.shape)}"
        )
    check_inner_contiguous("state", st, 3)
    _, H, V, K = st.shape
    dev = st.device
    qt = check_tensor("q", q, dtypes=ACTIVATION_DTYPES, device=dev)
    if qt.dim() != 3:
        raise ValueError(f"argument 'q': expected shape [T, H, K], got {list(qt.shape)}")
    T = qt.shape[0]
    adt = (qt.dtype,)
    if qt.shape[1:] != (H, K):
        raise ValueError(
            f"argument 'q': expected shape [{T}, {H}, {K}] to match state heads and key "
            f"dim, got {list(qt.shape)}"
        )
    check_tensor("k", k, dtypes=adt, shape=[T, H, K], device=dev, contiguous=True)
    check_tensor("q", q, contiguous=True)
    check_tensor("v", v, dtypes=adt, shape=[T, H, V], device=dev, contiguous=True)
    check_tensor("raw_g", raw_g, dtypes=adt, shape=[T, H, K], device=dev, contiguous=True)
    check_tensor("raw_beta", raw_beta, dtypes=adt, shape=[T, H], device=dev, contiguous=True)
    check_tensor("A_log", A_log, dtypes=(torch.float32, torch.float64), shape=[H],
                 device=dev, contiguous=True)
    check_tensor("dt_bias", dt_bias, dtypes=(torch.float32, torch.float64), shape=[H, K],
                 device=dev, contiguous=True)
    return T, H, K, V


def check_step_values(name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    """Every value of a per-request count lies in ``lo..hi`` (reads the tensor back)."""
    if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        raise ValueError(f"argument '{name}': expected values in {lo}..{hi}, got {t.tolist()}")


def check_lower_bound(lower_bound: float | None) -> float | None:
    """The bounded gate's bound is negative; None selects the softplus gate."""
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(
            f"argument 'lower_bound': expected a negative bound or None, got {lower_bound}"
        )
    return lower_bound


def as_layer_list(name: str, x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor (one layer) or a non-empty sequence of them (one per layer), as a list."""
    if isinstance(x, torch.Tensor):
        return [x]
    out = list(x)
    if not out:
        raise ValueError(f"argument '{name}': expected at least one layer, got none")
    return out


def check_record_pool(
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


def check_records(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
    corrections: torch.Tensor, kg: torch.Tensor,
) -> tuple[int, int, int, int, int, int]:
    """One layer's tensors of a recovery verify (metadata only, no device reads): the token
    inputs, the state pool and the record pool; returns (T, H, K, V, W, R)."""
    T, H, K, V = check_token_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state)
    W, R = check_record_pool("corrections", "kg", corrections, kg, state, q.dtype, H, K, V)
    return T, H, K, V, W, R


def check_rows(name: str, pool: str, rows: torch.Tensor | None, N: int, R: int,
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


def check_slot_indices(state_indices: torch.Tensor, slots: int, device: torch.device) -> int:
    """``state_indices`` is ``[N]`` with values in ``[0, slots)`` or null; returns N."""
    shape = check_tensor("state_indices", state_indices, dtypes=INDEX_DTYPES, device=device,
                         contiguous=True).shape
    if len(shape) != 1:
        raise ValueError(f"argument 'state_indices': expected shape [N], got {list(shape)}")
    check_index_range("state_indices", state_indices, slots, True)
    return int(shape[0])


def check_conv(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None, activation: str | None,
) -> None:
    """The conv input ``[T, C]``, its state pool ``[slots, C, Kc-1+S]``, weight ``[C, Kc]``,
    bias ``[C]`` and activation (``"silu"`` or None)."""
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


def check_kernel_state(state: torch.Tensor) -> None:
    """The kernels (Triton and CUDA) keep float32 states; float64 is the reference's."""
    if state.dtype != torch.float32:
        raise ValueError(
            f"argument 'state': the Triton kernels expect float32 state, got {state.dtype}; "
            "use backend='reference' for float64"
        )


def check_head_dims(K: int, V: int) -> None:
    """The kernels' tiles need power-of-two head dims of at least 16."""
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d & (d - 1):
            raise ValueError(
                f"argument 'state': the Triton kernels need a power-of-two head dim {name} "
                f">= 16, got {d}"
            )
