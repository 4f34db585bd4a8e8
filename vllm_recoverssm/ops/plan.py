"""What a step's state operations act on, built once per step: plans and address tables.

A :class:`CommitPlan` says, per request row, which checkpoint a commit replays into and how
many tokens; :class:`CommitTables` holds the per-layer pool addresses the one-launch commit
reads; a :class:`VerifyPlan` holds a verify step's index tensors, checked once so that each
layer's call only checks its own tensors. This module imports no kernel: every backend
(:mod:`.triton_kda`, :mod:`.cuda_commit`, :mod:`.b12x_kda`, :mod:`.reference`) reads these
types, and none of them is imported back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .validation import (
    INDEX_DTYPES,
    as_layer_list,
    check_index_range,
    check_query_start_loc,
    check_rows,
    check_step_values,
    check_tensor,
)

__all__ = ["CommitPlan", "CommitTables", "VerifyPlan", "commit_tables", "plan_verify"]


@dataclass
class CommitPlan:
    """What commit and conv compaction do for each request row of a step.

    ``state_indices``: the checkpoint slot (negative = null row); ``commit_lens``: accepted
    tokens to replay (0..S+1); ``final_indices``: where the committed state goes (default:
    in place); ``boundary_indices`` / ``boundary_lens``: align-mode block slot that receives
    the state after ``boundary_lens`` tokens (negative slot = no boundary this step).
    """

    state_indices: torch.Tensor
    commit_lens: torch.Tensor
    final_indices: torch.Tensor | None = None
    boundary_indices: torch.Tensor | None = None
    boundary_lens: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Number of request rows in the plan."""
        return int(self.state_indices.shape[0])

    def index_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every index tensor of the plan (absent ones as None), for dtype checks."""
        return (self.state_indices, self.commit_lens, self.final_indices,
                self.boundary_indices, self.boundary_lens)

    def validate(self, num_slots: int, max_len: int, device: torch.device) -> None:
        """Check dtypes, shapes, devices and index ranges of every field."""
        n = self.num_rows
        check_tensor("plan.state_indices", self.state_indices, dtypes=INDEX_DTYPES,
                     shape=[n], device=device, contiguous=True)
        check_index_range("plan.state_indices", self.state_indices, num_slots, True)
        check_tensor("plan.commit_lens", self.commit_lens, dtypes=INDEX_DTYPES, shape=[n],
                     device=device, contiguous=True)
        check_step_values("plan.commit_lens", self.commit_lens, 0, max_len)
        for name in ("final_indices", "boundary_indices", "boundary_lens"):
            t = getattr(self, name)
            if t is None:
                continue
            check_tensor(f"plan.{name}", t, dtypes=INDEX_DTYPES, shape=[n], device=device,
                         contiguous=True)
            if name != "boundary_lens":
                check_index_range(f"plan.{name}", t, num_slots, True)
        if (self.boundary_indices is None) != (self.boundary_lens is None):
            raise ValueError(
                "argument 'plan': boundary_indices and boundary_lens must be given together"
            )
        if self.boundary_lens is not None and n:
            bl = self.boundary_lens
            has_b = self.boundary_indices >= 0  # type: ignore[operator]
            bad = has_b & ((bl < 1) | (bl > self.commit_lens))
            if bool(bad.any()):
                raise ValueError(
                    "argument 'plan.boundary_lens': a row with a boundary slot needs "
                    f"1 <= boundary_len <= commit_len, got {bl.tolist()} with commit_lens "
                    f"{self.commit_lens.tolist()}"
                )


def _address_table(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    dev = tensors[0].device
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=dev)
    strides = torch.tensor([t.stride(0) for t in tensors], dtype=torch.int64, device=dev)
    return ptrs, strides


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 64 == 0 and t.stride(0) % 16 == 0


class CommitTables:
    """Per-layer base addresses and slot strides for the one-launch commit.

    Building the tables costs a host-to-device copy; a caller that commits every step
    into the same pools (a serving engine, a CUDA graph) builds them once and reuses them.
    """

    def __init__(
        self, states: list[torch.Tensor], corrections: list[torch.Tensor],
        kg: list[torch.Tensor],
    ) -> None:
        self.states = states
        self.corrections = corrections
        self.kg = kg
        self.state_ptrs, self.state_strides = _address_table(states)
        self.corr_ptrs, self.corr_strides = _address_table(corrections)
        self.kg_ptrs, self.kg_strides = _address_table(kg)
        self.aligned = all(_aligned(t) for t in (*states, *corrections, *kg))
        self._key = self._identity(states, corrections, kg)

    @staticmethod
    def _identity(*groups: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
        return tuple((t.data_ptr(), t.stride(0)) for g in groups for t in g)

    def matches(self, states: list[torch.Tensor], corrections: list[torch.Tensor],
                kg: list[torch.Tensor]) -> bool:
        """Whether the tables describe exactly these pools (same addresses and strides)."""
        return self._key == self._identity(states, corrections, kg)


def commit_tables(
    states: torch.Tensor | Sequence[torch.Tensor],
    corrections: torch.Tensor | Sequence[torch.Tensor],
    kg: torch.Tensor | Sequence[torch.Tensor],
) -> CommitTables:
    """Per-layer address tables for :func:`.api.commit`, built once for a set of pools."""
    return CommitTables(as_layer_list("states", states),
                        as_layer_list("corrections", corrections), as_layer_list("kg", kg))


@dataclass(frozen=True)
class VerifyPlan:
    """A verify step's index tensors and the pool sizes they index, checked once per step.

    Every KDA layer of a step verifies the same requests: the same ``state_indices``,
    ``query_start_loc`` and record rows, into pools of the same sizes. Checking the values
    of those tensors reads them back to the host, so :func:`plan_verify` does it once and
    each layer's call, given the plan as ``step=``, only checks (:meth:`check`) that it was
    handed these very tensors and pools no smaller than those checked: no device reads.
    ``num_accepted`` is set for a full-state verify (``state_indices`` ``[N, S+1]``),
    ``prev_lens`` for a fused one; ``prev_shares_pool``: the fused verify reads its previous
    records from the pools it writes this step's records to.
    """

    state_indices: torch.Tensor
    query_start_loc: torch.Tensor
    num_slots: int
    num_tokens: int
    window: int
    record_indices: torch.Tensor | None = None
    record_rows: int | None = None
    num_accepted: torch.Tensor | None = None
    prev_lens: torch.Tensor | None = None
    prev_record_indices: torch.Tensor | None = None
    prev_record_rows: int | None = None
    prev_shares_pool: bool = False

    @property
    def num_rows(self) -> int:
        """Number of request rows of the step."""
        return int(self.state_indices.shape[0])

    def validate(self, device: torch.device) -> None:
        """Check every index tensor in full: dtypes, shapes, devices and values."""
        si = check_tensor("state_indices", self.state_indices, dtypes=INDEX_DTYPES,
                          device=device, contiguous=True)
        W = self.window
        if self.num_accepted is not None:
            if si.dim() != 2:
                raise ValueError(f"argument 'state_indices': expected shape [N, S+1], got "
                                 f"{list(si.shape)}")
            if si.shape[1] != W:
                raise ValueError(f"argument 'state_indices': expected shape [N, {W}], got "
                                 f"{list(si.shape)}")
        elif si.dim() != 1:
            raise ValueError(
                f"argument 'state_indices': expected shape [N] (one checkpoint slot per "
                f"request), got {list(si.shape)}"
            )
        N = si.shape[0]
        check_index_range("state_indices", si, self.num_slots, True)
        if self.num_accepted is not None:
            check_tensor("num_accepted", self.num_accepted, dtypes=INDEX_DTYPES, shape=[N],
                         device=device, contiguous=True)
            check_step_values("num_accepted", self.num_accepted, 1, W)
        check_query_start_loc(self.query_start_loc, N, self.num_tokens, W, device)
        if self.record_rows is not None:
            check_rows("record_indices", "corrections", self.record_indices, N,
                       self.record_rows, device)
        if self.prev_lens is None:
            return
        check_tensor("prev_lens", self.prev_lens, dtypes=INDEX_DTYPES, shape=[N],
                     device=device, contiguous=True)
        check_step_values("prev_lens", self.prev_lens, 0, W)
        if self.prev_record_rows is not None:
            check_rows("prev_record_indices", "prev_corrections", self.prev_record_indices, N,
                       self.prev_record_rows, device)
        if N and self.prev_shares_pool:
            self._check_no_clash()

    def _check_no_clash(self) -> None:
        """Rows read as previous records are not written as new ones (one shared pool)."""
        N = self.num_rows
        ridx, pridx = self.record_indices, self.prev_record_indices
        new = set(range(N)) if ridx is None else set(ridx.tolist())
        old = list(range(N)) if pridx is None else pridx.tolist()
        lens = self.prev_lens.tolist()  # type: ignore[union-attr]
        read = {r for r, n in zip(old, lens, strict=True) if n > 0 and r >= 0}
        clash = sorted(read & {r for r in new if r >= 0})
        if clash:
            raise ValueError(
                f"argument 'prev_record_indices': rows {clash[:8]} are read as previous "
                "records and written as new ones in the same pool; use other rows "
                "(e.g. alternate halves of the scratch by step parity)"
            )

    def check(self, step: VerifyPlan | None, device: torch.device) -> None:
        """Check this call's index tensors (``self``): in full without a ``step`` plan,
        else only that ``step`` was built from the same tensors for pools of these sizes
        (``ValueError`` naming the argument that differs)."""
        if step is None:
            self.validate(device)
            return
        for name in ("state_indices", "query_start_loc", "record_indices", "num_accepted",
                     "prev_lens", "prev_record_indices"):
            if getattr(self, name) is not getattr(step, name):
                raise ValueError(f"argument 'step': planned with another '{name}' than the "
                                 "one passed to this call")
        sizes = (("state", "slots", "num_slots", False),
                 ("q", "tokens", "num_tokens", True),
                 ("corrections", "window columns", "window", True),
                 ("corrections", "record rows", "record_rows", False),
                 ("prev_corrections", "record rows", "prev_record_rows", False))
        for arg, what, name, exact in sizes:
            got, want = getattr(self, name), getattr(step, name)
            if got is None or want is None or (got == want if exact else got >= want):
                continue
            at_least = "" if exact else "at least "
            raise ValueError(f"argument '{arg}': the step was planned for {at_least}{want} "
                             f"{what}, got {got}")
        if self.prev_shares_pool and not step.prev_shares_pool:
            raise ValueError("argument 'step': planned with separate previous record pools, "
                             "but this call reads its previous records from the pools it "
                             "writes (plan it with prev_shares_pool=True)")


def plan_verify(
    state_indices: torch.Tensor, query_start_loc: torch.Tensor, *, num_slots: int,
    num_tokens: int, window: int, device: torch.device,
    record_indices: torch.Tensor | None = None, record_rows: int | None = None,
    num_accepted: torch.Tensor | None = None, prev_lens: torch.Tensor | None = None,
    prev_record_indices: torch.Tensor | None = None, prev_record_rows: int | None = None,
    prev_shares_pool: bool = False,
) -> VerifyPlan:
    """Check a verify step's index tensors once and return them as a :class:`VerifyPlan`.

    ``num_slots``: slots of each layer's state pool; ``num_tokens``: rows of the flat token
    inputs; ``window``: S+1; ``record_rows`` / ``prev_record_rows``: rows of the record pools
    (recovery and fused verifies). ``num_accepted`` makes it a full-state step
    (``state_indices`` ``[N, S+1]``, values in 1..S+1); ``prev_lens`` a fused one (values in
    0..S+1, previous records in rows ``prev_record_indices``, default ``i``).
    """
    plan = VerifyPlan(state_indices, query_start_loc, num_slots, num_tokens, window,
                      record_indices, record_rows, num_accepted, prev_lens,
                      prev_record_indices, prev_record_rows, prev_shares_pool)
    plan.validate(device)
    return plan
