"""State taps: the KDA state at chosen token positions inside a prefill chunk.

vLLM always computes at least one token of a prompt, so an exact-prompt checkpoint must
hold the state after ``len(prompt) - 1`` tokens, and interval checkpoints sit every
``checkpoint_interval`` tokens: both usually fall inside a prefill chunk, where the state
exists only while the layer computes it. The connector's worker installs this step's taps
before the forward (:func:`install`); the plugin's KDA layer asks for the taps of its rows
(:func:`row_taps`) and hands each tapped state over (:func:`deliver`); after the forward the
worker collects them (:func:`collect`).

A row is found by its KV-cache group and the state slot (block id) it computes into, which
the scheduler knows from the request's blocks; ``offset`` counts the row's tokens before
the tap (0 = the state the row starts from). Taps copy state and change no arithmetic, so
a tapped prefill computes exactly what an untapped one does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .keys import BundleKey


@dataclass(frozen=True)
class RowTaps:
    """The taps of one row: ``offsets[i]`` tokens into the row, delivered as ``keys[i]``."""

    offsets: tuple[int, ...]
    keys: tuple[BundleKey, ...]
    row_len: int
    """The row's token count the scheduler planned; a row of another length is left
    untapped (and its captures fail) rather than tapped at the wrong position."""


TappedState = dict[str, dict[str, torch.Tensor]]
"""Per layer name: ``{"conv": [C, Kc-1], "state": [h, V, K]}``."""

_layer_groups: dict[str, int] = {}
_active: dict[tuple[int, int], RowTaps] = {}
_delivered: dict[BundleKey, TappedState] = {}


def set_layer_groups(layer_groups: Mapping[str, int]) -> None:
    """Which KV-cache group each KDA layer (by its prefix) belongs to."""
    _layer_groups.clear()
    _layer_groups.update(layer_groups)


def install(taps: Mapping[tuple[int, int], RowTaps]) -> None:
    """This step's taps, keyed by ``(group index, slot)``; replaces the previous step's."""
    _active.clear()
    _active.update(taps)
    _delivered.clear()


def active() -> bool:
    """Whether any tap is installed (the layer's fast path checks this first)."""
    return bool(_active)


def row_taps(layer_prefix: str, slots: list[int]) -> dict[int, RowTaps]:
    """The taps of this layer's rows: row index -> its taps (rows without taps absent)."""
    if not _active:
        return {}
    group = _layer_groups.get(layer_prefix)
    if group is None:
        return {}
    out: dict[int, RowTaps] = {}
    for row, slot in enumerate(slots):
        taps = _active.get((group, slot))
        if taps is not None:
            out[row] = taps
    return out


def deliver(key: BundleKey, layer_prefix: str, conv: torch.Tensor, state: torch.Tensor) -> None:
    """Hand over one layer's conv history ``[C, Kc-1]`` and state at ``key``'s position."""
    _delivered.setdefault(key, {})[layer_prefix] = {"conv": conv, "state": state}


def collect() -> dict[BundleKey, TappedState]:
    """Everything delivered since :func:`install`, and remove the taps."""
    out = dict(_delivered)
    _delivered.clear()
    _active.clear()
    return out
