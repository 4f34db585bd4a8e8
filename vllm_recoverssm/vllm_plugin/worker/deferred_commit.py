"""Commits deferred into the next verify (``recoverssm_commit`` ``auto`` or ``fused``).

After sampling, a speculative row's accepted records are not replayed; the row's state
slot remembers how many are pending and in which scratch row they sit. The next step's
verify of that slot replays them first (:func:`vllm_recoverssm.ops.verify_fused`), so the
state is read once and written once per step, in one launch.

Only the step right after a deferral can hold pending records. Under runner V2 its model
state first commits the rows of requests that left the batch (:meth:`absent_commit`),
before vLLM's ``preprocess_state``: in align mode that call copies states into the blocks
the step runs in, and a block a finished request left may be one of them. The step's
metadata build then settles the rest before its forward runs:

* slots that the new step verifies again take their pending counts into the fused verify
  (and the counts are cleared at once, so no later step can replay them twice);
* every other slot of the deferred step -- a request that finished, was preempted, is not
  scheduled, or runs as a prompt or plain decode row -- is committed on its own (with its
  conv history compacted), so whatever reads the slot next sees a committed state.

The request-boundary connector reads and writes states outside that order. It exports a
finished request's state at the start of the next step, and first commits that request's
rows on their own (:meth:`DeferredCommits.request_commit`), which also takes them off the
build's list. It restores a state into a request's slot after a step's forward, and a step
may run no forward (and no build) at all, so the slot may be one that a finished, never
exported request left with records pending; the next build would replay them onto the
restored state. Before a restore it commits every deferred row
(:meth:`DeferredCommits.pending_commit`).

The counts live on the device and are never read by the host, so nothing here syncs. When
the host knows which requests the deferred rows and the new step's speculative rows belong
to (runner V1's batch, or the requests runner V2's model state names before each build), a
step that verifies every deferred request again skips the
standalone commit and its launches (:meth:`DeferredCommits.needs_settle`). The
record scratch has two halves of ``max_num_seqs`` rows: a step writes its records into one
half while the fused verify reads the previous step's from the other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import ops

INDEX = torch.int32


class DeferredCommits:
    """Pending commit counts per state slot, and the scratch half each step writes."""

    def __init__(self, rows: int, device: torch.device) -> None:
        if rows < 1:
            raise ValueError(f"deferred commits: expected rows >= 1, got {rows}")
        self.rows = rows
        """Rows of one scratch half (vLLM's ``max_num_seqs``)."""
        self.device = device
        self.half = 0
        """The scratch half the next step writes its records to."""
        self.pending_lens: torch.Tensor | None = None
        """Per state slot: records waiting to be replayed (allocated at the first deferral)."""
        self.pending_rows: torch.Tensor | None = None
        """Per state slot: the scratch row holding them."""
        self._deferred_slots = torch.full((rows,), -1, dtype=INDEX, device=device)
        self._num_deferred = 0
        """Rows of the deferred step (a host count: 0 = nothing can be pending)."""
        # Persistent per-step inputs of the fused verify, so a captured CUDA graph reads
        # the values each build writes.
        self.prev_lens = torch.zeros(rows, dtype=INDEX, device=device)
        self.prev_rows = torch.zeros(rows, dtype=INDEX, device=device)
        self.step_rows = torch.arange(rows, dtype=INDEX, device=device)
        self._deferred_keys: list[str | None] | None = None
        """The request of each deferred row (None: not known to the host)."""
        self.deferred_steps = 0
        """Steps whose commit was deferred (host count, for reports)."""
        self.settles = 0
        """Steps that ran the standalone commit of rows not verified again (host count)."""
        self.settles_skipped = 0
        """Steps that skipped it: every deferred request was verified again (host count)."""
        self.export_settles = 0
        """Standalone commits of finished requests before their export (host count)."""
        self.load_settles = 0
        """Standalone commits of every deferred row before a restore (host count)."""
        self.boundary_commits = 0
        """Align mode: steps that launched the commit after sampling, since a row could
        have reached a state block's end (host count)."""

    @property
    def scratch_rows(self) -> int:
        """Rows the layers' record scratch needs: two halves."""
        return 2 * self.rows

    def _check_rows(self, n: int) -> None:
        if n > self.rows:
            raise ValueError(
                f"deferred commits: a step of {n} speculative rows exceeds the scratch half "
                f"of {self.rows} rows (max_num_seqs)"
            )

    def needs_settle(self, keys: list[str | None] | None) -> bool:
        """Whether a step whose speculative rows belong to requests ``keys`` (None: not
        known) must commit deferred rows on their own: only when some deferred request is
        not among them. Counts the answer."""
        if self._num_deferred == 0:
            return False
        old = self._deferred_keys
        if old is None or keys is None or not {k for k in old if k is not None} <= set(keys):
            self.settles += 1
            return True
        self.settles_skipped += 1
        return False

    def stale_commit(self, slots: torch.Tensor) -> tuple[ops.CommitPlan, torch.Tensor] | None:
        """The standalone commit of the deferred rows that ``slots`` (this step's
        speculative slots, -1 = null) do not verify again, as ``(plan, record_rows)``;
        None when nothing can be pending. Clears those rows' pending counts."""
        n = self._num_deferred
        if n == 0 or self.pending_lens is None or self.pending_rows is None:
            return None
        old = self._deferred_slots[:n]
        live = old >= 0
        if slots.numel():
            live &= ~torch.isin(old, slots[slots >= 0])
        return self._commit_rows(live)

    def _commit_rows(self, live: torch.Tensor) -> tuple[ops.CommitPlan, torch.Tensor]:
        """The standalone commit of the deferred rows where ``live``; clears their counts."""
        assert self.pending_lens is not None and self.pending_rows is not None
        old = self._deferred_slots[:self._num_deferred]
        at = old.clamp(min=0).long()
        lens = torch.where(live, self.pending_lens[at], 0)
        # Rows with nothing to replay become null rows: the commit skips them whole.
        plan = ops.CommitPlan(
            state_indices=torch.where(live & (lens > 0), old, -1).to(INDEX).contiguous(),
            commit_lens=lens.to(INDEX).contiguous(),
        )
        records = self.pending_rows[at].contiguous()
        self.pending_lens.index_put_((at,), torch.where(live, 0, self.pending_lens[at]))
        return plan, records

    def absent_commit(self, keys: set[str]) -> tuple[ops.CommitPlan, torch.Tensor] | None:
        """The standalone commit of the deferred rows whose requests are not among
        ``keys`` (the requests of the step about to run), as ``(plan, record_rows)``; of
        every deferred row where the host does not know the rows' requests. None when no
        such row can be pending. Clears those rows' pending counts and drops their
        requests from the deferred step, so the build's settle neither commits them again
        nor waits for them. Counts a settle when it commits anything."""
        due = self._commit_requests(lambda k: k is not None and k not in keys)
        if due is not None:
            self.settles += 1
        return due

    def request_commit(self, keys: set[str]) -> tuple[ops.CommitPlan, torch.Tensor] | None:
        """The standalone commit of the deferred rows of requests ``keys`` (an export is
        about to read their states), as ``(plan, record_rows)``; of every deferred row
        where the host does not know the rows' requests. None when no such row can be
        pending. Clears those rows' pending counts and drops their requests from the
        deferred step, so the next step's settle neither commits them again nor waits
        for them to be verified."""
        if not keys:
            return None
        due = self._commit_requests(lambda k: k is not None and k in keys)
        if due is not None:
            self.export_settles += 1
        return due

    def _commit_requests(self, pick: Callable[[str | None], bool]
                         ) -> tuple[ops.CommitPlan, torch.Tensor] | None:
        """The standalone commit of the deferred rows whose request ``pick`` selects
        (every row where the host does not know the requests); drops them from the
        deferred step. None when no such row can be pending."""
        n = self._num_deferred
        if n == 0 or self.pending_lens is None or self.pending_rows is None:
            return None
        old_keys = self._deferred_keys
        picked = [True] * n if old_keys is None else [pick(k) for k in old_keys]
        if not any(picked):
            return None
        live = (self._deferred_slots[:n] >= 0) & torch.tensor(picked, dtype=torch.bool,
                                                               device=self.device)
        due = self._commit_rows(live)
        if old_keys is not None:
            self._deferred_keys = [None if p else k
                                   for k, p in zip(old_keys, picked, strict=True)]
        return due

    def pending_commit(self) -> tuple[ops.CommitPlan, torch.Tensor] | None:
        """The standalone commit of every deferred row, as ``(plan, record_rows)``: a
        connector is about to write whole states into slots, one of which a finished
        request may have left with records pending. None when nothing can be pending.
        Clears the counts and ends the deferred step, so the next build neither commits
        the rows again nor hands them to its fused verify."""
        n = self._num_deferred
        if n == 0 or self.pending_lens is None or self.pending_rows is None:
            return None
        due = self._commit_rows(self._deferred_slots[:n] >= 0)
        self._num_deferred = 0
        self._deferred_keys = None
        self.load_settles += 1
        return due

    def take(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's fused-verify inputs for speculative slots ``slots``:
        ``(prev_lens, prev_rows, step_rows)``. Clears the counts it hands out and ends the
        deferred step (call after :meth:`stale_commit`)."""
        n = int(slots.numel())
        self._check_rows(n)
        self.prev_lens.zero_()
        if self.pending_lens is not None and self.pending_rows is not None and n:
            live = slots >= 0
            at = slots.clamp(min=0).long()
            self.prev_lens[:n] = torch.where(live, self.pending_lens[at], 0)
            self.prev_rows[:n] = self.pending_rows[at]
            self.pending_lens.index_put_((at,), torch.where(live, 0, self.pending_lens[at]))
        self.step_rows.copy_(torch.arange(self.rows, dtype=INDEX, device=self.device)
                             + self.half * self.rows)
        self._num_deferred = 0
        return self.prev_lens[:n], self.prev_rows[:n], self.step_rows[:n]

    def capture_inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The persistent inputs for a CUDA-graph capture of ``n`` rows (nothing pending)."""
        self._check_rows(n)
        return self.prev_lens[:n], self.prev_rows[:n], self.step_rows[:n]

    def defer(self, slots: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor,
              num_slots: int, keys: list[str | None] | None = None) -> None:
        """Remember that slot ``slots[i]`` has ``lens[i]`` records pending in scratch row
        ``rows[i]`` (instead of committing them); the next step writes the other half.
        ``num_slots`` sizes the per-slot tables on first use; ``keys[i]`` names the request
        of row ``i`` where the host knows it."""
        n = int(slots.numel())
        self._check_rows(n)
        if keys is not None and len(keys) != n:
            raise ValueError(f"deferred commits: {len(keys)} request keys for {n} rows")
        if self.pending_lens is None or self.pending_rows is None:
            self.pending_lens = torch.zeros(num_slots, dtype=INDEX, device=self.device)
            self.pending_rows = torch.zeros(num_slots, dtype=INDEX, device=self.device)
        live = slots >= 0
        at = slots.clamp(min=0).long()
        self.pending_lens.index_put_((at,), torch.where(live, lens.to(INDEX),
                                                        self.pending_lens[at]))
        self.pending_rows.index_put_((at,), torch.where(live, rows.to(INDEX),
                                                        self.pending_rows[at]))
        self._deferred_slots[:n] = slots
        self._num_deferred = n
        self._deferred_keys = None if keys is None else list(keys)
        self.half ^= 1
        self.deferred_steps += 1
