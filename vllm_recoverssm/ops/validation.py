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
