"""How a bundle is named between the connector's scheduler side, workers and taps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ....checkpoint import prefix_digest


@dataclass(frozen=True, order=True)
class BundleKey:
    """A bundle: the state after the first ``num_tokens`` tokens whose digest is ``digest``
    (:func:`vllm_recoverssm.checkpoint.prefix_digest`, the store's own key)."""

    num_tokens: int
    digest: str


def bundle_key(tokens: Sequence[int]) -> BundleKey:
    """The key of the bundle holding the state after ``tokens``."""
    return BundleKey(len(tokens), prefix_digest(tokens))

LOGGER = "vllm.recoverssm.checkpoints"
"""The connector's logger: a child of vLLM's, so its lines use vLLM's handlers."""
