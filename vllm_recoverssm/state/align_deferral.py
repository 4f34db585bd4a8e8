"""Which rows of an align-mode commit may wait for the request's next verify.

Under prefix caching (cache mode ``align``) vLLM keeps a state block every ``B`` tokens
and, between steps, moves a request's running state from block to block (runner V2's
pre-copy before the forward; its postprocess after sampling). A row's commit can be
fused into its next verify only if nothing between the two steps reads or moves its
state. That holds exactly when none of these happens, with ``nc`` the tokens committed
before the step, ``q`` its scheduled tokens, ``n`` the accepted ones (the commit length)
and ``W = S+1`` the most tokens a decode row is scheduled:

* the accepted tokens reach a block's end (``nc + n >= (nc // B + 1) * B``): the block that
  ends there becomes a cacheable prefix block, which another request may read in the
  very next step, so its state must be written now;
* the last accepted token lies in an earlier block than the last scheduled one, which is
  where verify read the checkpoint: the committed state goes to another block than the
  one that holds the checkpoint;
* the next step's window may end in a later block
  (``(nc + n - 1 + W) // B != (nc + n - 1) // B``): vLLM would copy the running state into
  that block before the forward, and the copy would carry no pending records.

Every other row keeps its state in the block its verify read, and the next step's verify
reads the same block, so it can replay the pending records there. Such a row leaves all
three conditions only within ``S+1`` tokens of a block's end; with blocks of hundreds of
tokens almost every row of almost every step waits.

All three conditions need a block boundary in ``(nc, nc + q + S]``. The host knows an
upper bound of ``nc + q`` (vLLM's ``seq_lens_cpu_upper_bound``: exact without asynchronous
scheduling, otherwise it assumes every draft of the step in flight was accepted, so it may
overshoot by up to ``S``), so
:func:`align_step_may_commit` tells without a device read whether any row of a step can
need the commit right after sampling, and the launch is skipped when none can.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.plan import CommitPlan

NULL = -1


@dataclass(frozen=True)
class AlignSplit:
    """An align-mode commit plan split into the rows committed now and those deferred."""

    now: CommitPlan
    """The plan with every deferred row made null (commit right after sampling)."""
    deferred_slots: torch.Tensor
    """Per row: the slot whose checkpoint waits for the next verify (-1: none)."""
    deferred_lens: torch.Tensor
    """Per row: the records it waits with (0 where ``deferred_slots`` is -1)."""


def align_deferrable(plan: CommitPlan, read_slots: torch.Tensor, num_computed: torch.Tensor,
                     window: int, block_size: int) -> torch.Tensor:
    """Per row of the align plan ``plan``: whether its commit may wait for the next verify
    (module docstring). ``read_slots`` are the slots verify read the checkpoint from,
    ``num_computed`` the tokens committed before the step, ``window`` = S+1, the most
    tokens the next step schedules for the row. Rows with nothing to commit are False."""
    if window < 1 or block_size < window:
        raise ValueError(
            f"align deferral: expected 1 <= window <= block_size, got window={window}, "
            f"block_size={block_size}"
        )
    if plan.final_indices is None or plan.boundary_indices is None:
        raise ValueError("align deferral: the plan has no final or boundary slots; "
                         "build it with build_align_commit_plan")
    n = plan.commit_lens.to(torch.int64)
    last = (num_computed.to(torch.int64) + n - 1).clamp(min=0)
    stays = (last + window) // block_size == last // block_size
    return ((plan.state_indices >= 0) & (n > 0) & (plan.final_indices == read_slots)
            & (plan.boundary_indices < 0) & stays)


def split_align_plan(plan: CommitPlan, keep: torch.Tensor) -> AlignSplit:
    """Split ``plan`` by ``keep`` (:func:`align_deferrable`): deferred rows wait in their
    source slot, which their next verify reads; the rest commit now."""
    now = keep.logical_not()
    assert plan.final_indices is not None and plan.boundary_indices is not None
    assert plan.boundary_lens is not None

    def null_where_kept(x: torch.Tensor, null: int) -> torch.Tensor:
        return torch.where(now, x, null).to(torch.int32).contiguous()

    return AlignSplit(
        now=CommitPlan(
            state_indices=null_where_kept(plan.state_indices, NULL),
            commit_lens=null_where_kept(plan.commit_lens, 0),
            final_indices=null_where_kept(plan.final_indices, NULL),
            boundary_indices=null_where_kept(plan.boundary_indices, NULL),
            boundary_lens=null_where_kept(plan.boundary_lens, 0),
        ),
        deferred_slots=torch.where(keep, plan.state_indices, NULL).to(torch.int32)
        .contiguous(),
        deferred_lens=torch.where(keep, plan.commit_lens, 0).to(torch.int32).contiguous(),
    )


def align_step_may_commit(seq_lens_upper: torch.Tensor | None, query_lens: torch.Tensor,
                          window: int, block_size: int, *, overshoot: int = 0) -> bool:
    """Whether any row of a step may need its commit right after sampling, from host
    values only: ``seq_lens_upper`` (upper bounds of ``nc + q``, None: not known, so True)
    and ``query_lens`` (``q``), both CPU tensors of the step's speculative rows.

    ``overshoot``: how far a bound may exceed the true ``nc + q`` (0 when vLLM schedules
    synchronously; under asynchronous scheduling it assumes the drafts of the step in
    flight were accepted, so up to ``S``)."""
    if overshoot < 0:
        raise ValueError(f"align_step_may_commit: expected overshoot >= 0, got {overshoot}")
    if seq_lens_upper is None:
        return True
    if seq_lens_upper.device.type != "cpu" or query_lens.device.type != "cpu":
        raise ValueError("align_step_may_commit: expected host (CPU) tensors")
    if seq_lens_upper.numel() == 0:
        return False
    ub = seq_lens_upper.to(torch.int64)
    lo = (ub - query_lens.to(torch.int64) - overshoot).clamp(min=0)
    hi = ub + window - 1
    return bool((hi // block_size > lo // block_size).any())
