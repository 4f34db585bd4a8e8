"""The pending-commit table behind the fused commit (state slots, scratch halves)."""

from __future__ import annotations

import pytest
import torch

from vllm_recoverssm.vllm_plugin.worker.deferred_commit import DeferredCommits


def t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_a_slot_verified_again_takes_its_pending_records_once() -> None:
    d = DeferredCommits(rows=4, device=torch.device("cpu"))
    _, _, rows = d.take(t(7, 3, -1))
    assert rows.tolist() == [0, 1, 2]  # the first step writes half 0
    d.defer(t(7, 3, -1), t(2, 4, 1), rows, num_slots=10)
    # next step: slot 3 again (row 0 now), slot 7 gone, a new slot 5
    stale = d.stale_commit(t(3, 5))
    assert stale is not None
    plan, records = stale
    assert plan.state_indices.tolist() == [7, -1, -1]  # only slot 7 leaves with records
    assert plan.commit_lens.tolist() == [2, 0, 0]
    assert records[:1].tolist() == [0]
    lens, prev_rows, rows = d.take(t(3, 5))
    assert lens.tolist() == [4, 0] and prev_rows[:1].tolist() == [1]
    assert rows.tolist() == [4, 5]  # the other half
    # nothing is left to commit or replay twice
    assert d.stale_commit(t(3)) is None
    assert d.pending_lens is not None and int(d.pending_lens.sum()) == 0
    assert d.take(t(3, 5))[0].tolist() == [0, 0]
    assert d.deferred_steps == 1


def test_a_step_without_verify_rows_commits_everything_pending() -> None:
    d = DeferredCommits(rows=2, device=torch.device("cpu"))
    _, _, rows = d.take(t(1, 2))
    d.defer(t(1, 2), t(3, 0), rows, num_slots=4)
    stale = d.stale_commit(t())
    assert stale is not None
    assert stale[0].state_indices.tolist() == [1, -1]  # slot 2 had nothing accepted
    assert stale[0].commit_lens.tolist() == [3, 0]
    d.take(t())
    assert d.stale_commit(t()) is None


def test_more_rows_than_a_scratch_half_is_refused() -> None:
    d = DeferredCommits(rows=2, device=torch.device("cpu"))
    assert d.scratch_rows == 4
    with pytest.raises(ValueError, match="3 speculative rows exceeds the scratch half of 2"):
        d.take(t(1, 2, 3))
    with pytest.raises(ValueError, match="expected rows >= 1"):
        DeferredCommits(rows=0, device=torch.device("cpu"))


def test_an_export_commits_its_requests_rows_first_and_once() -> None:
    d = DeferredCommits(rows=4, device=torch.device("cpu"))
    assert d.request_commit({"a"}) is None  # nothing deferred yet
    _, _, rows = d.take(t(4, 6, 9, -1))
    d.defer(t(4, 6, 9, -1), t(3, 2, 1, 0), rows, num_slots=12, keys=["a", "b", "c", None])
    due = d.request_commit({"b", "c", "z"})  # "b" and "c" finished; "z" was not deferred
    assert due is not None
    plan, records = due
    assert plan.state_indices.tolist() == [-1, 6, 9, -1]
    assert plan.commit_lens.tolist() == [0, 2, 1, 0] and records[1:3].tolist() == [1, 2]
    assert d.request_commit({"b"}) is None and d.export_settles == 1
    # the next step verifies "a" again: no standalone commit left, and "a" replays its 3
    assert not d.needs_settle(["a"])
    stale = d.stale_commit(t(4))
    assert stale is not None and stale[0].state_indices.tolist() == [-1, -1, -1, -1]
    assert d.take(t(4))[0].tolist() == [3]
    # rows whose requests the host does not know are all committed
    _, _, rows = d.take(t(5, 7))
    d.defer(t(5, 7), t(2, 4), rows, num_slots=12)
    due = d.request_commit({"x"})
    assert due is not None and due[0].state_indices.tolist() == [5, 7]
    assert d.pending_lens is not None and int(d.pending_lens.sum()) == 0


def test_a_restore_commits_every_deferred_row_first_and_ends_the_deferred_step() -> None:
    """A step without a forward, then a restore into the slot of a finished request that
    was never exported: its records must not reach the restored state at the next build."""
    d = DeferredCommits(rows=4, device=torch.device("cpu"))
    assert d.pending_commit() is None  # nothing deferred yet
    _, _, rows = d.take(t(4, 6, -1))
    d.defer(t(4, 6, -1), t(3, 2, 1), rows, num_slots=12, keys=["a", "b", None])
    due = d.pending_commit()
    assert due is not None and d.load_settles == 1
    plan, records = due
    assert plan.state_indices.tolist() == [4, 6, -1]
    assert plan.commit_lens.tolist() == [3, 2, 0] and records[:2].tolist() == rows[:2].tolist()
    assert d.pending_lens is not None and int(d.pending_lens.sum()) == 0
    # the next build: nothing to commit on its own, nothing for the fused verify
    assert d.pending_commit() is None and not d.needs_settle(["c"])
    assert d.stale_commit(t(6)) is None
    assert d.take(t(6))[0].tolist() == [0]


def test_the_standalone_commit_is_skipped_only_when_every_deferred_request_returns() -> None:
    d = DeferredCommits(rows=4, device=torch.device("cpu"))
    assert not d.needs_settle(["a"])  # nothing deferred yet
    _, _, rows = d.take(t(4, 6, -1))
    d.defer(t(4, 6, -1), t(1, 2, 1), rows, num_slots=8, keys=["a", "b", None])
    assert not d.needs_settle(["b", "a", "c"])  # both return (padding row: no request)
    assert d.needs_settle(["a"])                # "b" left the batch
    assert d.needs_settle(None)                 # the host does not know this step's rows
    assert (d.settles, d.settles_skipped) == (2, 1)
    d.defer(t(4, 6, -1), t(1, 2, 1), rows, num_slots=8)  # keys unknown: always settle
    assert d.needs_settle(["a", "b"])
    with pytest.raises(ValueError, match="1 request keys for 3 rows"):
        d.defer(t(4, 6, -1), t(1, 2, 1), rows, num_slots=8, keys=["a"])
