"""Recovery KDA attention backend: vLLM's GDN metadata, narrowed to one state column.

vLLM's generic GDN builder hands every speculative row ``S+1`` state slots (one per draft
token) and the previous step's accepted count. Under recovery there is one checkpoint per
request, always committed with zero speculative offset, so
:class:`RecoverKDAMetadataBuilder` narrows the speculative state indices to that single
column and passes neutral accepted counts (ones). Verify writes speculative row ``i``'s
update records into row ``i`` of each layer's record scratch.

Commit runs after sampling, in the same step, under both of vLLM's model runners:
runner V2 calls :meth:`RecoverKDAMetadata.commit_recoverssm_state` itself (vLLM's
``RecoverSSMMetadata`` interface, from its model-state postprocess); under runner V1 the
builder leaves the step's metadata with its group's
:class:`~..worker.commit_context.RecoveryCommitContext` and the
plugin's post-sampling hook (:mod:`..worker.commit`) commits it. Either way it is one
commit and one conv compaction for all KDA layers of the KV-cache group, before the next
step (and before any request-boundary export) reads the state.

With the commit fused (``additional_config["recoverssm_commit"]`` ``auto``, the default, or
``fused``; no KV connector but the plugin's own) the commit after sampling only records
what is pending (:mod:`..worker.deferred_commit`); runner V2's model state commits the
rows of requests that left the batch before vLLM's preprocess, and the builder of the
next step settles the rest before the forward: rows verified again replay their records
inside the fused verify, every other row is committed on its own. The checkpoint
connector commits a finished request's rows before it exports them, at the start of that
step (:meth:`~..worker.commit_context.RecoveryCommitContext.settle_requests`).

Prefix caching (vLLM's mamba cache mode ``align``, its default for hybrid models; runner
V2) keeps a state block every ``B`` tokens. There the builder takes vLLM's aligned state
indices (the block of the step's last scheduled token, which vLLM's runner pre-copies the
checkpoint into), and commit follows
:func:`~vllm_recoverssm.state.build_align_commit_plan`: the committed state goes to the
block of the last accepted token and, when the accepted tokens cross a block boundary,
the state at the boundary goes to the block that ends there, so it becomes a cacheable
prefix block. The commit reads the checkpoint and the conv window from the slot verify
used. vLLM's runner then moves its running-state column
(``RecoverSSMPostprocessMetadata``). Under the fused commit only the rows that reach a
block's end or leave the block verify read commit there; the others wait for their next
verify in that block (:mod:`vllm_recoverssm.state.align_deferral`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ... import ops
from ...state.align_deferral import align_deferrable, align_step_may_commit, split_align_plan
from ...state.commit_plan import build_align_commit_plan
from .. import compat
from ..config import fused_commit_enabled
from ..worker.commit import register_commit_context
from ..worker.commit_context import RecoveryCommitContext
from ..worker.deferred_commit import DeferredCommits
from ..worker.state_layout import to_ops_slots

GDNAttentionBackend: Any = compat.GDNAttentionBackend
GDNAttentionMetadata: Any = compat.GDNAttentionMetadata
GDNAttentionMetadataBuilder: Any = compat.GDNAttentionMetadataBuilder
RecoverSSMMetadata: Any = compat.RecoverSSMMetadata
RecoverSSMPostprocessMetadata: Any = compat.RecoverSSMPostprocessMetadata

RECOVERY_STATE_COLUMNS = 1
"""State columns a speculative row gets under recovery (generic GDN: S+1)."""


@dataclass(frozen=True)
class AlignCommitInfo:
    """What an align-mode (prefix caching) commit needs beyond the state slots."""

    block_table: torch.Tensor
    """The KV-cache group's block table, one row per batch row (vLLM block ids)."""
    num_computed_tokens: torch.Tensor
    """Tokens whose state was committed before this step, per batch row."""
    block_size: int
    """Tokens per state block (vLLM's ``mamba_block_size``)."""
    window: int = 1
    """S+1: the most tokens a decode row is scheduled in one step."""
    query_lens_cpu: torch.Tensor | None = None
    """Tokens of each batch row this step, on the host."""
    seq_lens_upper_cpu: torch.Tensor | None = None
    """Upper bounds of each batch row's ``num_computed + query_len``, on the host (vLLM's
    ``seq_lens_cpu_upper_bound``; None: not known)."""
    overshoot: int = 0
    """How far those bounds may exceed the true values (asynchronous scheduling: S)."""


@dataclass
class RecoverKDAMetadata(GDNAttentionMetadata, RecoverSSMMetadata):
    """GDN metadata with one state column per speculative row, plus what commit needs."""

    commit_context: RecoveryCommitContext | None = None
    spec_request_rows: torch.Tensor | None = None
    """Batch row of each speculative row (to read its sampled-token count)."""
    spec_request_rows_cpu: list[int] | None = None
    """The same rows on the host."""
    align: AlignCommitInfo | None = None
    """Set in mamba cache mode ``align`` (prefix caching)."""
    committed: bool = False
    """Set by the first commit: a step's records are replayed once."""
    prev_lens: torch.Tensor | None = None
    """Fused commit: records each speculative row replays before its verify (else None)."""
    prev_record_rows: torch.Tensor | None = None
    """Fused commit: the scratch row holding them."""
    step_record_rows: torch.Tensor | None = None
    """Fused commit: the scratch row this step's records go to (default: the row index)."""

    def spec_slots(self) -> torch.Tensor:
        """The checkpoint slot of each speculative row (null rows are -1)."""
        assert self.spec_state_indices_tensor is not None
        return to_ops_slots(self.spec_state_indices_tensor[: self.num_spec_decodes, 0])

    def record_rows(self) -> torch.Tensor:
        """The record-scratch row of each speculative row: its position in the step (under
        the fused commit, in the scratch half of this step)."""
        if self.step_record_rows is not None:
            return self.step_record_rows
        assert self.spec_state_indices_tensor is not None
        return torch.arange(self.num_spec_decodes, dtype=torch.int32,
                            device=self.spec_state_indices_tensor.device)

    def commit_recoverssm_state(
        self, num_accepted_tokens: torch.Tensor
    ) -> RecoverSSMPostprocessMetadata | None:
        """Commit the accepted tokens (``num_accepted_tokens`` = sampled count per batch row).

        Returns vLLM's align-mode postprocess description in mamba cache mode ``align``
        (vLLM then moves each row's running-state column), else None.
        """
        if self.commit_context is None or self.num_spec_decodes == 0 or self.committed:
            return None
        self.committed = True
        assert self.spec_request_rows is not None and self.spec_query_start_loc is not None
        n = self.num_spec_decodes
        rows = self.spec_request_rows[:n]
        qsl = self.spec_query_start_loc[: n + 1]
        query_lens = (qsl[1:] - qsl[:-1]).to(torch.int32)
        sampled = num_accepted_tokens.to(torch.int32)[rows]
        slots = self.spec_slots().contiguous()
        records = self.record_rows()
        deferred = self.commit_context.deferred
        if self.align is None:
            commit_lens = torch.minimum(sampled.clamp(min=0), query_lens).contiguous()
            if deferred is not None:
                self._defer(slots, commit_lens, records)
                return None
            plan = ops.CommitPlan(state_indices=slots, commit_lens=commit_lens)
            self.commit_context.commit(plan, records)
            return None
        plan = self.align_plan(rows, query_lens, sampled, slots)
        if deferred is None:
            self.commit_context.commit(plan, records)
        else:
            self._defer_align(plan, rows, slots, records)
        return RecoverSSMPostprocessMetadata(
            num_spec_decodes=n,
            request_indices=rows.to(torch.int32),
            block_table=self.align.block_table,
            num_computed_tokens=self.align.num_computed_tokens,
            block_size=self.align.block_size,
        )

    def _defer(self, slots: torch.Tensor, commit_lens: torch.Tensor,
               records: torch.Tensor) -> None:
        """Leave ``commit_lens[i]`` records pending on slot ``slots[i]`` (fused commit)."""
        context = self.commit_context
        assert context is not None and context.deferred is not None
        layers = context.layers()
        num_slots = int(layers[0].kv_cache[1].shape[0]) if layers else 0
        keys = context.request_keys(self.spec_request_rows_cpu, current=False)
        context.deferred.defer(slots, commit_lens, records, num_slots, keys)

    def _defer_align(self, plan: ops.CommitPlan, rows: torch.Tensor, slots: torch.Tensor,
                     records: torch.Tensor) -> None:
        """Fused commit in align mode: rows that reach a block's end or leave their block
        commit now, the others wait for their next verify
        (:mod:`vllm_recoverssm.state.align_deferral`)."""
        info, context = self.align, self.commit_context
        assert info is not None and context is not None and context.deferred is not None
        keep = align_deferrable(plan, slots, info.num_computed_tokens[rows].to(torch.int32),
                                info.window, info.block_size)
        split = split_align_plan(plan, keep)
        host_rows = self.spec_request_rows_cpu
        upper = query = None
        if host_rows is not None and info.query_lens_cpu is not None:
            query = info.query_lens_cpu[host_rows]
            if info.seq_lens_upper_cpu is not None:
                upper = info.seq_lens_upper_cpu[host_rows]
        if query is None or align_step_may_commit(upper, query, info.window, info.block_size,
                                                  overshoot=info.overshoot):
            context.commit(split.now, records)
            context.deferred.boundary_commits += 1
        self._defer(split.deferred_slots, split.deferred_lens, records)

    def align_plan(self, rows: torch.Tensor, query_lens: torch.Tensor,
                   sampled: torch.Tensor, slots: torch.Tensor) -> ops.CommitPlan:
        """The align-mode commit plan of the speculative rows, reading from ``slots``."""
        assert self.align is not None
        check = not slots.is_cuda
        plan = build_align_commit_plan(
            to_ops_slots(self.align.block_table[rows]),
            self.align.num_computed_tokens[rows].to(torch.int32), query_lens, sampled,
            self.align.block_size, validate=check,
        )
        # vLLM pre-copies the checkpoint into the block verify reads (the block of the
        # last scheduled token); verify's conv window is there too.
        live = plan.state_indices >= 0
        plan.state_indices = torch.where(live, slots, -1).to(torch.int32).contiguous()
        return plan


class RecoverKDAMetadataBuilder(GDNAttentionMetadataBuilder):
    """vLLM's GDN builder, narrowed for recovery (see the module docstring)."""

    state_columns = RECOVERY_STATE_COLUMNS
    mamba_aligned_state_indices: torch.Tensor | None = None
    """Filled by vLLM's runner V2 in align mode (its ``hasattr`` opt-in); when unset the
    parent gathers the same indices from the block table."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        fused = fused_commit_enabled(vllm_config)
        self.commit_context = RecoveryCommitContext(
            layer_names, compat.layer_table(vllm_config),
            deferred=DeferredCommits(int(vllm_config.scheduler_config.max_num_seqs), device)
            if fused else None,
        )
        register_commit_context(self.commit_context)
        spec = vllm_config.speculative_config
        self.window = 1 + (int(spec.num_speculative_tokens) if spec is not None else 0)
        """S+1: the most tokens a decode row is scheduled in one step."""
        # asynchronous scheduling fills vLLM's host bounds as if every draft of the step in
        # flight was accepted
        asynchronous = vllm_config.scheduler_config.async_scheduling
        self.overshoot = 0 if asynchronous is False else self.window - 1
        # Neutral accepted counts: the checkpoint never carries a speculative offset.
        self._ones = torch.ones(self.decode_cudagraph_max_bs, dtype=torch.int32,
                                device=device)

    def build(  # type: ignore[override]
        self,
        common_prefix_len: int,
        common_attn_metadata: Any,
        num_accepted_tokens: torch.Tensor | None = None,
        num_decode_draft_tokens_cpu: torch.Tensor | None = None,
        fast_build: bool = False,
    ) -> RecoverKDAMetadata:
        """Build vLLM's GDN metadata, then narrow it to one state column per row."""
        meta = super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens,
                             num_decode_draft_tokens_cpu, fast_build)
        narrowed = self.narrow(meta, common_attn_metadata)
        if self.commit_context.deferred is not None:
            self.settle_deferred(narrowed)
        self.commit_context.set_step(narrowed if narrowed.num_spec_decodes else None)
        return narrowed

    def settle_deferred(self, meta: RecoverKDAMetadata) -> None:
        """Fused commit: settle the previous step's pending records before this step runs
        (module docstring) and give ``meta`` its fused-verify inputs."""
        deferred = self.commit_context.deferred
        assert deferred is not None
        n = meta.num_spec_decodes
        slots = (meta.spec_slots().contiguous() if n else
                 torch.empty(0, dtype=torch.int32, device=self._ones.device))
        keys = self.commit_context.request_keys(meta.spec_request_rows_cpu if n else [],
                                                current=True)
        self.commit_context.settle(slots, keys)
        prev_lens, prev_rows, rows = deferred.take(slots)
        if n:
            meta.prev_lens, meta.prev_record_rows, meta.step_record_rows = (
                prev_lens, prev_rows, rows)

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> RecoverKDAMetadata:
        """Capture metadata: built like a step's, but never committed (no sampling)."""
        meta = super().build_for_cudagraph_capture(common_attn_metadata)
        self.commit_context.set_step(None)
        return meta  # type: ignore[no-any-return]

    def narrow(self, meta: GDNAttentionMetadata,
               common: Any | None = None) -> RecoverKDAMetadata:
        """The recovery view of ``meta``: one state column, ones as accepted counts, and
        (mamba cache mode ``align``) the block table and counts of ``common`` for commit."""
        values = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
        rows = None
        rows_cpu: list[int] | None = None
        spec = meta.spec_state_indices_tensor
        if spec is not None:
            values["spec_state_indices_tensor"] = spec[:, :RECOVERY_STATE_COLUMNS]
            values["num_accepted_tokens"] = self._ones[: spec.shape[0]]
            masks = meta.spec_sequence_masks_cpu
            device = spec.device
            if masks is None or meta.num_prefills + meta.num_decodes == 0:
                # Pure speculative step: rows are the first num_spec_decodes.
                rows_cpu = list(range(spec.shape[0]))
                rows = torch.arange(spec.shape[0], dtype=torch.long, device=device)
            else:
                at = masks.nonzero().flatten()
                rows_cpu = at.tolist()  # a host tensor: no device sync
                rows = at.to(device)
        align = None
        if spec is not None and getattr(self.kv_cache_spec, "mamba_cache_mode", "none") == "align":
            if common is None:
                raise ValueError("align mode: narrow() needs the common attention metadata")
            qsl_cpu = common.query_start_loc_cpu[: common.num_reqs + 1]
            upper = getattr(common, "seq_lens_cpu_upper_bound", None)
            align = AlignCommitInfo(
                block_table=common.block_table_tensor[: common.num_reqs],
                num_computed_tokens=common.compute_num_computed_tokens(),
                block_size=int(self.kv_cache_spec.block_size),
                window=self.window,
                query_lens_cpu=(qsl_cpu[1:] - qsl_cpu[:-1]).to(torch.int64),
                seq_lens_upper_cpu=None if upper is None else upper[: common.num_reqs],
                overshoot=self.overshoot,
            )
        return RecoverKDAMetadata(**values, commit_context=self.commit_context,
                                  spec_request_rows=rows, spec_request_rows_cpu=rows_cpu,
                                  align=align)


class RecoverKDAAttentionBackend(GDNAttentionBackend):
    """GDN backend whose builder is the recovery builder."""

    @staticmethod
    def get_name() -> str:
        """Backend name shown in vLLM's logs."""
        return "RECOVERSSM_GLM5NEXT_KDA"

    @staticmethod
    def get_builder_cls() -> type[RecoverKDAMetadataBuilder]:  # type: ignore[override]
        """The recovery metadata builder."""
        return RecoverKDAMetadataBuilder
