"""What commit needs from the KDA layers of one KV-cache group, and the commit itself.

One :class:`RecoveryCommitContext` per KV-cache group of KDA layers: it replays each
row's accepted update records into the state (our kernels, or b12x's on SM12x), compacts
the conv history the same way, and holds what the fused commit left pending until a
step settles it. The attention metadata of each step points at its group's context.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from ... import ops
from .. import compat
from .deferred_commit import DeferredCommits
from .state_layout import dim_first_conv_plan


class CommitsItsState(Protocol):
    """A step's metadata that commits its accepted state (vLLM's ``RecoverSSMMetadata``)."""

    def commit_recoverssm_state(self, num_accepted_tokens: torch.Tensor) -> None:
        """Commit ``num_accepted_tokens`` per batch row."""


class RecoveryCommitContext:
    """The KDA layers of one KV-cache group and what commit needs from them."""

    def __init__(self, layer_names: list[str], static_forward_context: dict[str, Any],
                 ops_backend: str = "auto",
                 deferred: DeferredCommits | None = None) -> None:
        self.deferred = deferred
        """Pending counts when commits are fused into the next verify (else None)."""
        self.layer_names = list(layer_names)
        self.forward_context = static_forward_context
        """vLLM's layer table (``static_forward_context``) the layer names index."""
        self.ops_backend = ops_backend
        self.validate: bool | None = None
        """Argument checks that read device values; default: only off CUDA (they sync)."""
        self._params: tuple[torch.Tensor, torch.Tensor] | None = None
        self.step: CommitsItsState | None = None
        """The step built last and not yet committed (used under runner V1)."""
        self._runner: weakref.ref[Any] | None = None
        self._request_ids: list[str | None] | None = None
        self._step_ids: list[str | None] | None = None

    def layers(self) -> list[Any]:
        """The layer modules, in group order."""
        return [self.forward_context[name] for name in self.layer_names]

    def _gate_params(self, layers: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        # Parameters are fixed once weights are loaded; stack them once for the
        # single multi-layer commit launch.
        if self._params is None:
            h, d = layers[0].local_num_heads, layers[0].head_dim
            a_log = torch.stack([m.A_log.detach().reshape(h) for m in layers])
            dt_bias = torch.stack([m.dt_bias.detach().reshape(h, d) for m in layers])
            self._params = (a_log.float().contiguous(), dt_bias.float().contiguous())
        return self._params

    def commit(self, plan: ops.CommitPlan, record_rows: torch.Tensor) -> None:
        """Replay each row's accepted records (scratch row ``record_rows[i]``, where verify
        wrote them) as ``plan`` says, then compact the conv history the same way."""
        layers = self.layers()
        if not layers or plan.num_rows == 0:
            return
        a_log, dt_bias = self._gate_params(layers)
        on_gpu = plan.state_indices.is_cuda
        check = (not on_gpu) if self.validate is None else self.validate
        records = [m.recovery_records() for m in layers]
        pools = ([m.kv_cache[1] for m in layers], [r[0] for r in records],
                 [r[1] for r in records])
        ops.commit(*pools, a_log, dt_bias, plan, lower_bound=layers[0].kda_lower_bound,
                   record_indices=record_rows, backend=self.ops_backend, validate=check)
        # One plan and one page layout for the whole group: the plan's checks read its
        # tensors back to the host, so they run with the first layer only.
        for index, m in enumerate(layers):
            view = m.conv_state_dim_first_view(m.kv_cache[0])
            with dim_first_conv_plan(view, plan) as (conv, lp):
                ops.conv_compact(conv, lp, kernel_width=m.conv_size,
                                 backend=self.ops_backend, validate=check and index == 0)

    def see_batch(self, runner: Any, request_ids: list[str | None]) -> None:
        """The runner that sampled and its batch's request ids, row by row (runner V1)."""
        self._runner = weakref.ref(runner)
        self._request_ids = request_ids

    def see_step(self, request_ids: list[str | None]) -> None:
        """The request ids, row by row, of the step about to be built (runner V2, whose
        model state names them before the builders run). Its commit, after sampling,
        belongs to the same step."""
        self._step_ids = self._request_ids = request_ids

    def request_keys(self, rows: list[int] | None, current: bool) -> list[str | None] | None:
        """The request id of each batch row in ``rows``: of the step just sampled, or
        (``current``) of the step being built (named by runner V2's model state, or read
        from runner V1's batch). None where the host does not know them."""
        if rows is None:
            return None
        ids: list[str | None] | None
        if current and self._step_ids is not None:
            ids = self._step_ids
        elif current:
            runner = self._runner() if self._runner is not None else None
            ids = compat.batch_request_ids(runner.input_batch) if runner is not None else None
        else:
            ids = self._request_ids
        if ids is None:
            return None
        # Rows past the batch are CUDA-graph padding: null slots, never pending.
        return [ids[r] if r < len(ids) else None for r in rows]

    def settle(self, slots: torch.Tensor, keys: list[str | None] | None = None) -> None:
        """Commit, on their own, the deferred rows that this step (speculative slots
        ``slots``, of requests ``keys`` where known) does not verify again (fused commit
        only)."""
        if self.deferred is None or not self.deferred.needs_settle(keys):
            return
        stale = self.deferred.stale_commit(slots)
        if stale is not None:
            self.commit(*stale)

    def settle_absent(self, keys: set[str]) -> None:
        """Commit, on their own and now, the deferred rows of requests that are not among
        ``keys`` (the requests of the step about to run; fused commit only): vLLM may hand
        a finished request's state block to another request, whose state it then copies
        in before the forward."""
        if self.deferred is None:
            return
        due = self.deferred.absent_commit(keys)
        if due is not None:
            self.commit(*due)

    def settle_requests(self, keys: set[str]) -> None:
        """Commit, on their own and now, the deferred rows of requests ``keys`` (fused
        commit only): an export reads their states before the next step's build."""
        if self.deferred is None:
            return
        due = self.deferred.request_commit(keys)
        if due is not None:
            self.commit(*due)

    def settle_pending(self) -> None:
        """Commit, on their own and now, every deferred row (fused commit only): a
        restore is about to write whole states into slots."""
        if self.deferred is None:
            return
        due = self.deferred.pending_commit()
        if due is not None:
            self.commit(*due)

    def set_step(self, metadata: CommitsItsState | None) -> None:
        """Remember this step's metadata for the post-sampling commit (runner V1)."""
        self.step = metadata

    def commit_step(self, num_sampled: torch.Tensor) -> None:
        """Commit the remembered step (``num_sampled`` per batch row), once."""
        step, self.step = self.step, None
        if step is not None:
            step.commit_recoverssm_state(num_sampled)
