"""Model state for vLLM's GPU model runner (V2): commit first, then capture.

vLLM's runner calls ``model_state.postprocess_state`` from ``postprocess_sampled``, right
after sampling and before the drafter proposes or the KV connector saves. vLLM's
``MambaHybridModelState`` commits there only for its own RecoverSSM flag (Kimi); this
subclass gives GLM-5.3 recovery the same commit (vLLM's ``RecoverSSMState`` calls our
metadata's ``commit_recoverssm_state``: commit, then conv compaction), and *then* runs the
request-boundary capture hooks, so a capture always sees the committed state with zero
speculative offset (``bias`` 0). In full-state mode the captures get vLLM's lazy offset
(``bias = num_sampled - 1``) instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import compat
from ..config import recovery_enabled
from ..patch.cache_config import mark_kda_recoverssm
from .commit import see_step, settle_absent, settle_pending

MambaHybridModelState: Any = compat.MambaHybridModelState


@dataclass(frozen=True)
class BoundaryCaptureStep:
    """What a request-boundary capture hook gets after a step's state is final."""

    idx_mapping: torch.Tensor
    """Batch row -> request state index (-1 = masked row)."""
    num_sampled: torch.Tensor
    """Tokens sampled per batch row (accepted drafts + 1)."""
    num_computed_tokens: torch.Tensor | None
    recovery: bool
    """True: state is committed at column 0 with zero speculative offset."""
    bias: torch.Tensor
    """Per batch row: the column/conv offset of the accepted state (0 under recovery)."""


BoundaryCapture = Callable[[BoundaryCaptureStep], None]

_captures: list[BoundaryCapture] = []


def register_boundary_capture(hook: BoundaryCapture) -> None:
    """Run ``hook`` after every step's commit (request-boundary checkpoint exporters)."""
    if hook not in _captures:
        _captures.append(hook)


def unregister_boundary_capture(hook: BoundaryCapture) -> None:
    """Stop running ``hook``."""
    if hook in _captures:
        _captures.remove(hook)


class RecoverMambaHybridModelState(MambaHybridModelState):  # type: ignore[misc]
    """``MambaHybridModelState`` that commits GLM-5.3 recovery state, then captures."""

    def __init__(self, vllm_config: Any, model: Any, encoder_cache: Any,
                 device: torch.device) -> None:
        self.use_recovery = recovery_enabled(vllm_config)
        if self.use_recovery:
            mark_kda_recoverssm(vllm_config)
        super().__init__(vllm_config, model, encoder_cache, device)
        if self.use_recovery and getattr(self, "recoverssm", None) is None:
            self.recoverssm = compat.RecoverSSMState()

    def preprocess_state(self, input_batch: Any, *args: Any, **kwargs: Any) -> None:
        """Commit the pending records of requests that left the batch, then vLLM's
        preprocess (in align mode it copies states into the blocks this step runs in, and
        a block a finished request left may be one of them)."""
        if self.use_recovery:
            settle_absent(compat.layer_table(self.vllm_config),
                          compat.batch_request_ids(input_batch))
        super().preprocess_state(input_batch, *args, **kwargs)

    def prepare_attn(self, input_batch: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """vLLM's attention metadata, after naming the batch's requests to the recovery
        groups (the fused commit keys its pending records by request)."""
        if self.use_recovery:
            see_step(compat.layer_table(self.vllm_config),
                     compat.batch_request_ids(input_batch))
        return super().prepare_attn(input_batch, *args, **kwargs)  # type: ignore[no-any-return]

    def postprocess_state(self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor | int,
                          num_computed_tokens: torch.Tensor | None = None) -> None:
        """vLLM's postprocess (which commits and compacts), then the capture hooks."""
        super().postprocess_state(idx_mapping, num_sampled, num_computed_tokens)
        self.run_boundary_captures(idx_mapping, num_sampled, num_computed_tokens)

    def run_boundary_captures(self, idx_mapping: torch.Tensor,
                              num_sampled: torch.Tensor | int,
                              num_computed_tokens: torch.Tensor | None) -> None:
        """Call every registered capture hook with the step's final-state description."""
        if not _captures or isinstance(num_sampled, int):
            return
        if self.use_recovery:
            # under the fused commit the step's records wait for the next verify; a
            # capture reads the state now, so they are committed first
            settle_pending(compat.layer_table(self.vllm_config))
            bias = torch.zeros_like(num_sampled)
        else:
            bias = (num_sampled - 1).clamp(min=0)
        step = BoundaryCaptureStep(idx_mapping, num_sampled, num_computed_tokens,
                                   self.use_recovery, bias)
        for hook in list(_captures):
            hook(step)
