"""``RequestCheckpoint``: a request's complete state at a request boundary, runtime-agnostic.

The runtime fills it at the end of a prompt or a response and reads it back on a hit. It holds
the token prefix, named tensors per layer (for a linear layer its recurrent state and its conv
history at zero speculative offset; for an attention layer the KV of the prefix) and the
last-token logits, so an exact prompt hit needs no compute at all. The checkpoint layer never
interprets the tensors: shapes and names are the runtime's contract, pinned by the layout
identity.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from .identity import ScalarValue, check_tokens
from .tensors import as_bytes, dtype_name

Boundary = Literal["prompt", "response"]
BOUNDARIES: tuple[str, ...] = ("prompt", "response")
MAX_NDIM = 8
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def check_name(name: object, what: str) -> str:
    """Return ``name`` if it is a valid layer or tensor name (``[A-Za-z0-9_.:-]``, 1-128)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"{what} {name!r}: expected 1-128 characters from letters, digits and '_.:-'"
        )
    return name


def _check_meta(meta: Mapping[str, ScalarValue]) -> dict[str, ScalarValue]:
    out: dict[str, ScalarValue] = {}
    for k, v in meta.items():
        check_name(k, "meta key")
        if not isinstance(v, bool | int | float | str):
            raise ValueError(
                f"meta[{k!r}]: expected int, float, str or bool, got {type(v).__name__}"
            )
        out[k] = v
    return out


@dataclass(frozen=True)
class RequestCheckpoint:
    """The state of one request after ``tokens``, captured at a request boundary.

    ``layers`` maps a layer name to its named tensors; ``logits`` are the logits of the last
    token of ``tokens``. ``has_images`` marks a request that carried images: such a checkpoint
    is never exported. ``meta`` carries small runtime facts (for example ``num_accepted``).
    """

    tokens: tuple[int, ...]
    layers: Mapping[str, Mapping[str, torch.Tensor]]
    logits: torch.Tensor
    boundary: Boundary = "prompt"
    has_images: bool = False
    meta: Mapping[str, ScalarValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        toks = check_tokens(self.tokens, "tokens")
        if not toks:
            raise ValueError("tokens: a checkpoint needs at least one token")
        object.__setattr__(self, "tokens", toks)
        if self.boundary not in BOUNDARIES:
            raise ValueError(f"boundary {self.boundary!r}: expected one of {BOUNDARIES}")
        if not isinstance(self.has_images, bool):
            raise ValueError(f"has_images: expected a bool, got {type(self.has_images).__name__}")
        if not isinstance(self.layers, Mapping):
            raise ValueError(f"layers: expected a mapping, got {type(self.layers).__name__}")
        layers: dict[str, dict[str, torch.Tensor]] = {}
        for lname, tensors in self.layers.items():
            check_name(lname, "layer name")
            if not isinstance(tensors, Mapping) or not tensors:
                raise ValueError(f"layer {lname!r}: expected a non-empty mapping of tensors")
            layers[lname] = {}
            for tname, t in tensors.items():
                check_name(tname, f"layer {lname!r}: tensor name")
                layers[lname][tname] = _check_tensor(t, f"layer {lname!r} tensor {tname!r}")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "logits", _check_tensor(self.logits, "logits"))
        object.__setattr__(self, "meta", _check_meta(self.meta))

    @property
    def num_tokens(self) -> int:
        """Length of the token prefix this checkpoint holds the state after."""
        return len(self.tokens)

    def named_tensors(self) -> Iterator[tuple[str | None, str, torch.Tensor]]:
        """Every tensor as ``(layer name or None, tensor name, tensor)``; logits last."""
        for lname, tensors in self.layers.items():
            for tname, t in tensors.items():
                yield lname, tname, t
        yield None, "logits", self.logits

    @property
    def nbytes(self) -> int:
        """Total bytes of all tensors."""
        return sum(t.numel() * t.element_size() for _, _, t in self.named_tensors())

    def same_as(self, other: RequestCheckpoint) -> bool:
        """True when both hold the same tokens, flags, meta and bit-identical tensors."""
        if (self.tokens, self.boundary, self.has_images, dict(self.meta)) != (
            other.tokens,
            other.boundary,
            other.has_images,
            dict(other.meta),
        ):
            return False
        mine = list(self.named_tensors())
        theirs = list(other.named_tensors())
        if [(a, b) for a, b, _ in mine] != [(a, b) for a, b, _ in theirs]:
            return False
        return all(
            x.dtype == y.dtype and x.shape == y.shape and torch.equal(as_bytes(x), as_bytes(y))
            for (_, _, x), (_, _, y) in zip(mine, theirs, strict=True)
        )


def _check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    try:
        dtype_name(t.dtype)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if t.dim() > MAX_NDIM:
        raise ValueError(f"{what}: {t.dim()} dimensions, at most {MAX_NDIM} are allowed")
    return t
