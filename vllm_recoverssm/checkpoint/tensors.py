"""Tensor <-> raw byte helpers with an explicit dtype allow-list (no pickle anywhere)."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Dtypes a bundle may hold, by the name written in the manifest."""

DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Manifest name of ``dtype``; ``ValueError`` for a dtype a bundle cannot hold."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot be stored in a checkpoint (allowed: {', '.join(DTYPES)})"
        ) from None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as a flat, contiguous CPU uint8 tensor (a view when possible)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        # bool has no uint8 view in every torch build; one byte per element either way.
        return flat.to(torch.uint8)
    return flat.view(torch.uint8)


def from_bytes(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of ``dtype``/``shape`` holding a copy of the uint8 bytes ``raw``."""
    owned = raw.clone()  # own storage at offset 0: safe to view as a wider dtype
    if dtype == torch.bool:
        return owned.to(torch.bool).reshape(shape)
    return owned.view(dtype).reshape(shape)
