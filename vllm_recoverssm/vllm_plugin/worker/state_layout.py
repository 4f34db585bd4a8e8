"""vLLM's state pages as the project's ops address them: slot indices and conv views."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ... import ops
from .. import compat

NULL_BLOCK_ID: int = compat.NULL_BLOCK_ID


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
