"""What the runtime's helpers read of a runtime: a narrow protocol, not the runtime itself.

Request-boundary capture and restore (:mod:`.boundary`) and the checkpoint store's side
(:mod:`.checkpointing`) act on one running runtime, but need only its model, pools, sizes,
counters and two of its slot operations. They take a :class:`RuntimeView`, which
:class:`~vllm_recoverssm.reference.runtime.SpecRuntime` satisfies, so that
:mod:`.runtime` imports them and none of them imports it back.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .model import HybridModel
from .pools import ModelPools
from .request import Request
from .stats import RuntimeStats


class RuntimeView(Protocol):
    """The parts of a running runtime the boundary and checkpoint helpers use."""

    @property
    def model(self) -> HybridModel:
        """The model whose layers the pools serve."""

    @property
    def pools(self) -> ModelPools:
        """Every layer's state, conv and KV pools."""

    @property
    def mode(self) -> str:
        """``"recovery"`` or ``"full_state"``."""

    @property
    def num_spec(self) -> int:
        """Draft tokens per speculative step (S)."""

    @property
    def block_size(self) -> int:
        """Tokens per KV page."""

    @property
    def device(self) -> torch.device:
        """Where the pools live."""

    @property
    def stats(self) -> RuntimeStats:
        """The runtime's counters, which restores and exports add to."""

    def running_state_slot(self, req: Request) -> int:
        """The slot holding ``req``'s committed state at zero speculative offset."""

    def compact_full_state(self, req: Request) -> None:
        """Full state: move ``req``'s latest state to column 0 (no-op in recovery)."""
