"""What a checkpoint bundle is keyed by: the layout identity and the token prefix.

A bundle's bytes only mean something for the exact layout that wrote them (model weights,
dtypes, page layout, tensor-parallel rank, number of speculative tokens, recovery or full-state
mode). The identity is hashed into every storage key and repeated in the manifest, so a bundle
is never restored into a different layout. Token prefixes are hashed with SHA-256 over
little-endian uint32 token ids: stable across processes and restarts (unlike Python's ``hash``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config.state_mode import STATE_MODES
from .tensors import DTYPES

MODES = tuple(m.value for m in STATE_MODES)
"""Spellings of the state modes an identity may hold."""
_PREFIX_DOMAIN = b"vllm-recoverssm/prefix/v1\0"
MAX_TOKEN_ID = 2**32 - 1

ScalarValue = int | float | str | bool


class LayoutIdentity(BaseModel):
    """Everything that decides how a bundle's bytes are read back.

    ``dtypes`` names the dtype of each kind of tensor (for example ``{"state": "float32",
    "conv": "bfloat16", "kv": "bfloat16", "logits": "float32"}``); ``extra`` holds further
    layout facts such as page size or layer count.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=256)
    revision: str = Field(min_length=1, max_length=256)
    dtypes: dict[str, str]
    layout: str = Field(min_length=1, max_length=128)
    layout_version: int = Field(ge=1)
    tp_rank: int = Field(ge=0)
    tp_size: int = Field(ge=1)
    num_speculative_tokens: int = Field(ge=0, le=64)
    mode: Literal["recovery", "full_state"]
    extra: dict[str, ScalarValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> LayoutIdentity:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        for kind, name in self.dtypes.items():
            if name not in DTYPES:
                raise ValueError(
                    f"dtypes[{kind!r}] = {name!r} is not one of {', '.join(sorted(DTYPES))}"
                )
        return self

    def canonical_json(self) -> str:
        """The identity as canonical JSON (sorted keys, no spaces): what the digest covers."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """SHA-256 (hex) of the canonical JSON; part of every storage key."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


def check_tokens(tokens: Sequence[int], what: str = "tokens") -> tuple[int, ...]:
    """Return ``tokens`` as a tuple of ints after checking each is a uint32 token id."""
    out = tuple(tokens)
    for i, t in enumerate(out):
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise ValueError(f"{what}[{i}]: expected an int token id, got {type(t).__name__}")
        if not 0 <= int(t) <= MAX_TOKEN_ID:
            raise ValueError(f"{what}[{i}]: token id {int(t)} is outside 0..{MAX_TOKEN_ID}")
    return tuple(int(t) for t in out)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def prefix_digest(tokens: Sequence[int]) -> str:
    """SHA-256 (hex) of a token prefix; the same in every process."""
    toks = check_tokens(tokens)
    return hashlib.sha256(_PREFIX_DOMAIN + _token_bytes(toks)).hexdigest()


def prefix_digests(tokens: Sequence[int]) -> list[str]:
    """Digests of every prefix ``tokens[:n]`` for n = 1..len(tokens), in one pass.

    Element ``n - 1`` equals ``prefix_digest(tokens[:n])``.
    """
    toks = check_tokens(tokens)
    data = _token_bytes(toks)
    h = hashlib.sha256(_PREFIX_DOMAIN)
    out = []
    for i in range(len(toks)):
        h.update(data[4 * i : 4 * i + 4])
        out.append(h.copy().hexdigest())
    return out
