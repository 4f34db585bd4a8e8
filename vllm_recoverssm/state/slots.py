"""Slot allocation for a recurrent-state pool.

A pool has ``num_slots`` pages (slot ids ``0 .. num_slots-1``). Requests ("owners": any
hashable key, e.g. a request id) acquire slots and release all of them together when they
finish. Allocation is all-or-nothing and deterministic: the lowest free ids are handed out
first, so the same sequence of calls always yields the same slots.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable


class PoolExhaustedError(RuntimeError):
    """Raised when a request asks for more slots than the pool has free."""

    def __init__(self, owner: Hashable, requested: int, free: int, num_slots: int) -> None:
        self.owner = owner
        self.requested = requested
        self.free = free
        self.num_slots = num_slots
        super().__init__(
            f"state pool exhausted: owner {owner!r} asked for {requested} slot(s) but only "
            f"{free} of {num_slots} are free; finish or preempt a request, or give the pool "
            "more slots"
        )


class SlotAllocator:
    """Hands out state-pool slot ids to owners; all-or-nothing, lowest free ids first."""

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int):
            raise TypeError(
                f"argument 'num_slots': expected an int, got {type(num_slots).__name__}"
            )
        if num_slots < 1:
            raise ValueError(f"argument 'num_slots': expected >= 1, got {num_slots}")
        self._num_slots = num_slots
        self._free: list[int] = list(range(num_slots))  # a min-heap (sorted = valid heap)
        self._owned: dict[Hashable, list[int]] = {}

    @property
    def num_slots(self) -> int:
        """Total number of slots in the pool."""
        return self._num_slots

    @property
    def num_free(self) -> int:
        """Slots not held by any owner."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots held by some owner."""
        return self._num_slots - len(self._free)

    @property
    def owners(self) -> list[Hashable]:
        """Owners currently holding slots, in the order they first acquired."""
        return list(self._owned)

    def __contains__(self, owner: object) -> bool:
        return owner in self._owned

    def can_acquire(self, count: int) -> bool:
        """Whether ``count`` slots could be acquired right now."""
        return 0 <= count <= len(self._free)

    def acquire(self, owner: Hashable, count: int = 1) -> list[int]:
        """Give ``owner`` ``count`` more slots (lowest free ids, ascending) and return them.

        All-or-nothing: if fewer than ``count`` slots are free, nothing changes and
        :class:`PoolExhaustedError` is raised. An owner may acquire again; its new slots
        are added to those it already holds.
        """
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"argument 'count': expected an int, got {type(count).__name__}")
        if count < 1:
            raise ValueError(f"argument 'count': expected >= 1, got {count}")
        if count > len(self._free):
            raise PoolExhaustedError(owner, count, len(self._free), self._num_slots)
        got = [heapq.heappop(self._free) for _ in range(count)]
        self._owned.setdefault(owner, []).extend(got)
        return got

    def release(self, owner: Hashable) -> list[int]:
        """Free every slot of ``owner`` and return them (ascending)."""
        try:
            slots = self._owned.pop(owner)
        except KeyError:
            raise KeyError(f"owner {owner!r} holds no slots in this pool") from None
        for s in slots:
            heapq.heappush(self._free, s)
        return sorted(slots)

    def owned(self, owner: Hashable) -> list[int]:
        """Slots held by ``owner`` in acquisition order (empty if it holds none)."""
        return list(self._owned.get(owner, ()))

    def reset(self) -> None:
        """Release every slot of every owner."""
        self._free = list(range(self._num_slots))
        self._owned.clear()

    def __repr__(self) -> str:
        return (
            f"SlotAllocator(num_slots={self._num_slots}, used={self.num_used}, "
            f"owners={len(self._owned)})"
        )
