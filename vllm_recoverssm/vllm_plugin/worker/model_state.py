"""Model state for vLLM's GPU model runner (V2): commit first, then capture.

vLLM's runner calls ``model_state.postprocess_state`` from ``postprocess_sampled``, right
after sampling and before the drafter proposes or the KV connector saves. vLLM's
``MambaHybridModelState`` commits there only for its own RecoverSSM flag (Kimi); this
subclass gives GLM-5.3 recovery the same commit (vLLM's ``RecoverSSMState`` calls our
metadata's ``commit_recoverssm_state``: commit, then conv compaction), and *then* runs the
request-boundary capture hooks, so a capture always sees the committed state with zero
speculative offset (``bias`` 0). In full-state mode the captures get vLLM's lazy offset
(``bias = num_sampled - 1``) instead.

A request whose verify window reaches past its end (``max_tokens``, ``max_model_len``)
keeps fewer tokens than it sampled. A registered end provider (:func:`register_state_ends`,
the checkpoint connector) names each row's last token position its state may hold; the
commit then counts only the kept tokens, so a finished request's page holds the state of
its final tokens. With asynchronous scheduling vLLM may run one more step of a request that
has already ended (it was planned before the end was known): that step counts no token,
and its state is reported overwritten (-1), so the connector exports the state it read at
the end. In align mode the counts stay vLLM's (its block-aligned state copies read them
too); the connector then checks each state's length before it exports.
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
    req_ids: list[str | None]
    """The request of each batch row (None: a padding row)."""
    layers: dict[str, Any]
    """The layer table of the runner that ran the step (tells runners apart)."""
    state_len: torch.Tensor
    """Per batch row: tokens its state holds after the step; -1 where the step wrote past
    the request's end over the state (a step beyond the end)."""
    state_column: torch.Tensor
    """Per batch row: the block column (of the request's KDA block table) that holds its
    state: 0, or in align mode vLLM's running-state column."""


BoundaryCapture = Callable[[BoundaryCaptureStep], None]

_captures: list[BoundaryCapture] = []

StateEnds = Callable[[dict[str, Any], list[str | None]], list[int] | None]
"""``ends(layers, req_ids) -> per row, the most tokens its state may hold`` (a huge
number for rows without an end), or None when no row of the step has one."""
_ends: list[StateEnds] = []
NO_END = 2**31 - 1


def register_state_ends(ends: StateEnds) -> None:
    """Count at most ``ends``' tokens per row in the commit (module docstring)."""
    if ends not in _ends:
        _ends.append(ends)


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
        self._step_req_ids: list[str | None] | None = None
        """The requests of the step's batch rows (named at ``prepare_attn``)."""
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
        self._step_req_ids = compat.batch_request_ids(input_batch)
        if self.use_recovery:
            see_step(compat.layer_table(self.vllm_config), self._step_req_ids)
        return super().prepare_attn(input_batch, *args, **kwargs)  # type: ignore[no-any-return]

    def postprocess_state(self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor | int,
                          num_computed_tokens: torch.Tensor | None = None) -> None:
        """vLLM's postprocess (which commits and compacts), then the capture hooks; rows
        past their request's end count only the kept tokens (module docstring)."""
        cut = self._kept_counts(idx_mapping, num_sampled, num_computed_tokens)
        committed = num_sampled if cut is None or self._align_mode else cut[0]
        super().postprocess_state(idx_mapping, committed, num_computed_tokens)
        self.run_boundary_captures(idx_mapping, num_sampled, num_computed_tokens, cut)

    @staticmethod
    def _computed(idx_mapping: torch.Tensor, num_computed_tokens: torch.Tensor) -> torch.Tensor:
        """Per batch row, the tokens vLLM counts as computed after the step."""
        return num_computed_tokens[idx_mapping.clamp(min=0).long()].to(torch.int64)

    def _kept_counts(self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor | int,
                     num_computed_tokens: torch.Tensor | None,
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per row, the sampled tokens its state keeps and the most tokens it may hold, or
        None when no row has an end."""
        req_ids = self._step_req_ids
        if (not _ends or isinstance(num_sampled, int) or num_computed_tokens is None
                or not idx_mapping.shape[0] or req_ids is None):
            return None
        layers = compat.layer_table(self.vllm_config)
        limit: torch.Tensor | None = None
        for ends in list(_ends):
            got = ends(layers, req_ids[: idx_mapping.shape[0]])
            if got is None:
                continue
            t = torch.tensor(got, dtype=torch.int64).to(num_sampled.device, non_blocking=True)
            limit = t if limit is None else torch.minimum(limit, t)
        if limit is None:
            return None
        # the state holds every computed token; past the end those were sampled but cut
        over = (self._computed(idx_mapping, num_computed_tokens) - limit).clamp(min=0)
        kept = (num_sampled.to(torch.int64) - over).clamp(min=0).to(num_sampled.dtype)
        return kept, limit

    def run_boundary_captures(self, idx_mapping: torch.Tensor,
                              num_sampled: torch.Tensor | int,
                              num_computed_tokens: torch.Tensor | None,
                              cut: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Call every registered capture hook with the step's final-state description
        (``cut``: the kept counts and ends of :meth:`_kept_counts`)."""
        if not _captures or isinstance(num_sampled, int):
            return
        counts = num_sampled if cut is None else cut[0]
        if self.use_recovery:
            # under the fused commit the step's records wait for the next verify; a
            # capture reads the state now, so they are committed first
            settle_pending(compat.layer_table(self.vllm_config))
            bias = torch.zeros_like(counts)
        else:
            bias = (counts - 1).clamp(min=0)
        rows = idx_mapping.clamp(min=0).long()
        if self._align_mode:
            # where vLLM's next pre-copy reads the running state: its column and the
            # accepted-token bias (recovery's postprocess resets the bias to none)
            column = self._mamba_state_idx_gpu[rows].to(torch.int64)
            bias = (self.num_accepted_tokens_gpu[rows] - 1).clamp(min=0).to(counts.dtype)
        else:
            column = torch.zeros_like(rows)
        state_len = self._state_len(idx_mapping, num_sampled, num_computed_tokens, cut)
        req_ids = list(self._step_req_ids or [])[: idx_mapping.shape[0]]
        req_ids += [None] * (idx_mapping.shape[0] - len(req_ids))
        step = BoundaryCaptureStep(idx_mapping, counts, num_computed_tokens,
                                   self.use_recovery, bias, req_ids,
                                   compat.layer_table(self.vllm_config), state_len, column)
        for hook in list(_captures):
            hook(step)

    def _state_len(self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                   num_computed_tokens: torch.Tensor | None,
                   cut: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Tokens each row's state holds after the step (-1: overwritten past the end)."""
        rows = idx_mapping.shape[0]
        if num_computed_tokens is None:
            return torch.full((rows,), -1, dtype=torch.int64, device=num_sampled.device)
        after = self._computed(idx_mapping, num_computed_tokens)
        if cut is None:
            return after
        kept, limit = cut
        # align mode: the commit counted vLLM's tokens, so the state holds them all;
        # otherwise the commits counted the kept tokens only (recovery), or the accepted
        # column is the last kept token's (full states)
        held = after if self._align_mode else torch.minimum(after, limit)
        # a step that kept none ran past the end, over a state that is no longer the
        # end's (full states: its columns; recovery: a verify whose commit counts nothing
        # leaves the conv history misplaced)
        overwritten = (kept == 0) & (num_sampled > 0)
        return torch.where(overwritten, torch.full_like(held, -1), held)
