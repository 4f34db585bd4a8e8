"""Align-mode deferral: which commits may wait for the next verify under prefix caching.

The walk below models what vLLM's runner V2 does to a request's state blocks between
steps (the pre-copy into the block of the step's last scheduled token, the running column
moved after sampling) with a state that counts the tokens folded into it. Over random
decode trajectories, the rows :func:`align_deferrable` lets wait must find their pending
records in the block the next verify reads, and every block that ends at or before the
committed tokens must hold the state at its end right after the step (another request
may read it from the prefix cache in the next step).
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_recoverssm.state import build_align_commit_plan
from vllm_recoverssm.state.align_deferral import (
    align_deferrable,
    align_step_may_commit,
    split_align_plan,
)

I32 = torch.int32


def t(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=I32)


def walk(seed: int, block_size: int, window: int, steps: int) -> tuple[int, int]:
    """One request's decode steps; returns (rows deferred, rows committed at once)."""
    rng = random.Random(seed)
    B = block_size
    slots = [100 + j for j in range(64)]  # block-table column j -> slot id
    nc = rng.randrange(1, 3 * B)  # tokens after the prompt
    tokens = {slots[j]: (j + 1) * B for j in range(nc // B)}  # complete blocks
    running = (nc - 1) // B
    tokens[slots[running]] = nc
    pending: dict[int, int] = {}
    deferred = eager = 0
    for _ in range(steps):
        q = rng.randrange(1, window + 1)
        read_col = (nc + q - 1) // B
        if read_col != running:  # vLLM's pre-copy; it carries no pending records
            tokens[slots[read_col]] = tokens[slots[running]]
        read = slots[read_col]
        stray = {s: n for s, n in pending.items() if s != read}
        assert not stray, f"pending records on {stray}, verify reads slot {read}"
        tokens[read] += pending.pop(read, 0)  # the fused verify replays them first
        assert tokens[read] == nc
        n = rng.randrange(1, q + 1)
        plan = build_align_commit_plan(t([slots]), t([nc]), t([q]), t([n]), B,
                                       num_spec=window - 1)
        plan.state_indices = t([read])
        keep = align_deferrable(plan, t([read]), t([nc]), window, B)
        split = split_align_plan(plan, keep)
        if bool(keep[0]):
            deferred += 1
            assert split.now.state_indices.tolist() == [-1]
            pending[int(split.deferred_slots[0])] = int(split.deferred_lens[0])
        else:
            eager += 1
            assert split.deferred_slots.tolist() == [-1]
            assert align_step_may_commit(t([nc + q]), t([q]), window, B)
            now = split.now
            assert now.boundary_indices is not None and now.boundary_lens is not None
            assert now.final_indices is not None
            if int(now.boundary_indices[0]) >= 0:
                tokens[int(now.boundary_indices[0])] = nc + int(now.boundary_lens[0])
            tokens[int(now.final_indices[0])] = nc + n
        nc += n
        running = (nc - 1) // B  # vLLM's postprocess moves the running column
        for j in range(nc // B):
            assert tokens[slots[j]] == (j + 1) * B, f"block {j} is not its prefix's state"
    return deferred, eager


@pytest.mark.parametrize("block_size, window", [(4, 4), (8, 4), (16, 8), (64, 4), (9, 2)])
def test_deferred_rows_find_their_records_and_blocks_hold_their_prefixes(
    block_size: int, window: int,
) -> None:
    totals = [walk(seed, block_size, window, steps=40) for seed in range(60)]
    deferred = sum(d for d, _ in totals)
    eager = sum(e for _, e in totals)
    assert eager > 0
    # a block of exactly S+1 tokens leaves no row's next window inside it
    assert (deferred > 0) is (block_size > window)
    if block_size >= 8 * window:
        assert deferred > 3 * eager  # with long blocks most rows wait


def test_host_check_is_false_only_far_from_block_ends() -> None:
    B, W = 64, 4
    # nc + q = 20, q = 3: tokens 17..23 (+ the next window) stay inside block 0
    assert not align_step_may_commit(t([20]), t([3]), W, B)
    # the next window may reach token 64
    assert align_step_may_commit(t([61]), t([4]), W, B)
    # nc + q = 66 exactly: nc = 65 is past block 0's end, and the next window stays
    assert not align_step_may_commit(t([66]), t([1]), W, B)
    # a bound that may overshoot by a step's drafts: nc could be 62, before the end
    assert align_step_may_commit(t([66]), t([1]), W, B, overshoot=W - 1)
    with pytest.raises(ValueError, match="overshoot"):
        align_step_may_commit(t([66]), t([1]), W, B, overshoot=-1)
    assert align_step_may_commit(None, t([1]), W, B)
    assert not align_step_may_commit(t([]), t([]), W, B)
    with pytest.raises(ValueError, match="host"):
        align_step_may_commit(t([20]).to("meta"), t([3]), W, B)


def test_rows_that_commit_nothing_or_are_null_never_wait() -> None:
    B, W = 64, 4
    slots = [[10, 11], [20, 21], [30, 31]]
    nc, q, n = t([5, 5, 5]), t([3, 3, 3]), t([0, 2, 2])
    plan = build_align_commit_plan(t(slots[0:1] + slots[1:2] + [[-1, -1]]), nc, q, n, B)
    read = t([10, 20, -1])
    plan.state_indices = torch.where(plan.state_indices >= 0, read, -1).to(I32)
    assert align_deferrable(plan, read, nc, W, B).tolist() == [False, True, False]


def test_bad_arguments_are_named() -> None:
    plan = build_align_commit_plan(t([[1, 2]]), t([5]), t([2]), t([1]), 8)
    with pytest.raises(ValueError, match="window"):
        align_deferrable(plan, t([1]), t([5]), 9, 8)
    plan.final_indices = None
    with pytest.raises(ValueError, match="build_align_commit_plan"):
        align_deferrable(plan, t([1]), t([5]), 4, 8)
