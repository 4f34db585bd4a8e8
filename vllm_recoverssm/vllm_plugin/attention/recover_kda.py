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
builder leaves the step's metadata with its group's :class:`RecoveryCommitContext` and the
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
step (:meth:`RecoveryCommitContext.settle_requests`).

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
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ... import ops
from ...ops.b12x_kda import B12xKdaRecovery
from ...state.align_deferral import align_deferrable, align_step_may_commit, split_align_plan
from ...state.commit_plan import build_align_commit_plan
from .. import compat
from ..config import fused_commit_enabled
from ..kernels import b12x_recovery_for
from ..worker.commit import register_commit_context
from ..worker.deferred_commit import DeferredCommits

GDNAttentionBackend: Any = compat.GDNAttentionBackend
GDNAttentionMetadata: Any = compat.GDNAttentionMetadata
GDNAttentionMetadataBuilder: Any = compat.GDNAttentionMetadataBuilder
RecoverSSMMetadata: Any = compat.RecoverSSMMetadata
RecoverSSMPostprocessMetadata: Any = compat.RecoverSSMPostprocessMetadata
NULL_BLOCK_ID: int = compat.NULL_BLOCK_ID

RECOVERY_STATE_COLUMNS = 1
"""State columns a speculative row gets under recovery (generic GDN: S+1)."""


def to_ops_slots(block_ids: torch.Tensor) -> torch.Tensor:
    """vLLM block ids -> our slot indices: vLLM's null block (0) becomes -1 (null row)."""
    return torch.where(block_ids == NULL_BLOCK_ID, -1, block_ids).to(torch.int32)


@contextmanager
def dim_first_conv(conv_state: torch.Tensor, slots: torch.Tensor) -> Iterator[
    tuple[torch.Tensor, torch.Tensor]
]:
    """A ``[slots, dim, width]`` conv view with the width contiguous, as our ops need.

    ``conv_state`` is the layer's view already oriented ``(dim, width)``. With vLLM's
    default "SD" layout that view is strided; then the rows ``slots`` are gathered into a
    dense copy, addressed by their row number, and written back on exit. Yields
    ``(view, indices into view)``.
    """
    if conv_state.stride(-1) == 1:
        yield conv_state, slots
        return
    live = slots >= 0
    # Null rows gather vLLM's null block (0); our ops skip them, so writing them back
    # rewrites block 0 with its own bytes. This keeps the path free of host syncs.
    src = torch.where(live, slots, 0).long()
    dense = conv_state.index_select(0, src).contiguous()
    local = torch.where(live, torch.arange(slots.numel(), device=slots.device,
                                           dtype=torch.int32), -1).to(torch.int32)
    yield dense, local
    conv_state.index_copy_(0, src, dense)


@contextmanager
def dim_first_conv_plan(conv_state: torch.Tensor, plan: ops.CommitPlan) -> Iterator[
    tuple[torch.Tensor, ops.CommitPlan]
]:
    """:func:`dim_first_conv` for a commit plan: a contiguous view and the plan on it.

    With a strided ("SD") conv layout the source, final and boundary rows are gathered into
    one dense tensor and the plan is rewritten to address it; on exit only the final and
    boundary rows are written back (the source row is read, never written, so writing it
    back could race with a final row of the same slot).
    """
    if conv_state.stride(-1) == 1:
        yield conv_state, plan
        return
    n = plan.num_rows
    dev = plan.state_indices.device
    groups = [plan.state_indices]
    for field in (plan.final_indices, plan.boundary_indices):
        if field is not None:
            groups.append(field)
    slots = torch.cat(groups)
    live = slots >= 0
    src = torch.where(live, slots, 0).long()
    dense = conv_state.index_select(0, src).contiguous()
    rows = torch.where(live, torch.arange(slots.numel(), device=dev, dtype=torch.int32), -1)
    parts = list(rows.to(torch.int32).split(n))
    final_local = parts[1].contiguous() if plan.final_indices is not None else None
    boundary_local = parts[-1].contiguous() if plan.boundary_indices is not None else None
    yield dense, ops.CommitPlan(
        state_indices=parts[0].contiguous(), commit_lens=plan.commit_lens,
        final_indices=final_local, boundary_indices=boundary_local,
        boundary_lens=plan.boundary_lens,
    )
    # Null rows gathered vLLM's null block 0 and are never written by the ops, so writing
    # them back rewrites block 0 with its own bytes; this keeps the path free of host syncs.
    # Without final indices the source rows are updated in place and written back.
    start = 0 if plan.final_indices is None else n
    conv_state.index_copy_(0, src[start:], dense[start:])


class RecoveryCommitContext:
    """The KDA layers of one KV-cache group and what commit needs from them."""

    def __init__(self, layer_names: list[str], static_forward_context: dict[str, Any],
                 ops_backend: str = "auto", b12x: B12xKdaRecovery | None = None,
                 deferred: DeferredCommits | None = None) -> None:
        self.deferred = deferred
        """Pending counts when commits are fused into the next verify (else None)."""
        self.layer_names = list(layer_names)
        self.forward_context = static_forward_context
        """vLLM's layer table (``static_forward_context``) the layer names index."""
        self.ops_backend = ops_backend
        self.b12x = b12x
        """b12x's verify and commit for this group (SM12x), or None for our kernels."""
        self.validate: bool | None = None
        """Argument checks that read device values; default: only off CUDA (they sync)."""
        self._params: tuple[torch.Tensor, torch.Tensor] | None = None
        self.step: RecoverKDAMetadata | None = None
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
        if self.b12x is not None:
            self.b12x.commit(*pools, a_log, dt_bias, plan,
                             lower_bound=layers[0].kda_lower_bound,
                             record_indices=record_rows, validate=check)
        else:
            ops.commit(*pools, a_log, dt_bias, plan, lower_bound=layers[0].kda_lower_bound,
                       record_indices=record_rows, backend=self.ops_backend,
                       validate=check)
        for m in layers:
            view = m.conv_state_dim_first_view(m.kv_cache[0])
            with dim_first_conv_plan(view, plan) as (conv, lp):
                ops.conv_compact(conv, lp, kernel_width=m.conv_size,
                                 backend=self.ops_backend, validate=check)

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
            ids = compat.runner_request_ids(runner) if runner is not None else None
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

    def set_step(self, metadata: RecoverKDAMetadata | None) -> None:
        """Remember this step's metadata for the post-sampling commit (runner V1)."""
        self.step = metadata

    def commit_step(self, num_sampled: torch.Tensor) -> None:
        """Commit the remembered step (``num_sampled`` per batch row), once."""
        step, self.step = self.step, None
        if step is not None:
            step.commit_recoverssm_state(num_sampled)


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
            layer_names, vllm_config.compilation_config.static_forward_context,
            b12x=b12x_recovery_for(vllm_config, device),
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
