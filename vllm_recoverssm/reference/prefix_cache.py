"""Prefix cache for align mode: the complete state after every ``B`` tokens of a prefix.

An entry for a prefix of ``m * B`` tokens holds one state-pool slot (every KDA layer's
recurrent state and conv history at zero speculative offset after token ``m * B``) and a
reference on the KV pages of those tokens. A request whose prompt starts with the prefix
copies the slot into its own and shares the pages, then continues from token ``m * B``.
Entries are evicted least recently used first when the cache is full or a request needs
their slot or pages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from vllm_recoverssm.state import SlotAllocator

from .kv_pages import PageAllocator


@dataclass(frozen=True)
class CacheEntry:
    """One cached block: the slot (held under ``owner``) and the prefix's KV pages."""

    owner: Hashable
    slot: int
    pages: tuple[int, ...]
    num_tokens: int


@dataclass
class PrefixCacheStats:
    """Lookups, hits (requests that resumed from a block), tokens skipped, blocks stored."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """Token-prefix -> :class:`CacheEntry`, at most ``capacity`` entries, LRU eviction."""

    def __init__(
        self, block_size: int, capacity: int, slots: SlotAllocator, pages: PageAllocator
    ) -> None:
        if block_size < 1:
            raise ValueError(f"argument 'block_size': expected >= 1, got {block_size}")
        if capacity < 0:
            raise ValueError(f"argument 'capacity': expected >= 0, got {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        self._slots = slots
        self._pages = pages
        self._entries: OrderedDict[tuple[int, ...], CacheEntry] = OrderedDict()
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, tokens: Sequence[int], max_tokens: int) -> CacheEntry | None:
        """Deepest cached block whose prefix ``tokens[:m*B]`` has ``m*B <= max_tokens``.

        A found entry becomes the most recently used. Statistics are kept by
        :meth:`record_lookup`, once per admitted request.
        """
        m = min(max_tokens, len(tokens)) // self.block_size
        while m >= 1:
            key = tuple(tokens[: m * self.block_size])
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry
            m -= 1
        return None

    def record_lookup(self, entry: CacheEntry | None) -> None:
        """Count one admitted request's lookup and, if it resumed from ``entry``, the hit."""
        self.stats.lookups += 1
        if entry is not None:
            self.stats.hits += 1
            self.stats.hit_tokens += entry.num_tokens

    def contains(self, tokens: Sequence[int]) -> bool:
        """Whether exactly this prefix is cached."""
        return tuple(tokens) in self._entries

    def insert(
        self, tokens: Sequence[int], owner: Hashable, slot: int, pages: Sequence[int]
    ) -> bool:
        """Keep the block of prefix ``tokens`` (length a multiple of ``B``).

        On success the cache takes over ``owner``'s slot and adds a reference to ``pages``.
        Returns False (nothing taken) when the prefix is already cached or the capacity
        is 0; the caller then keeps or releases the slot itself.
        """
        key = tuple(tokens)
        if len(key) % self.block_size or not key:
            raise ValueError(
                f"argument 'tokens': expected a prefix of a multiple of {self.block_size} "
                f"tokens, got {len(key)}"
            )
        if self.capacity == 0 or key in self._entries:
            return False
        while len(self._entries) >= self.capacity:
            self.evict_one()
        self._pages.share(list(pages))
        self._entries[key] = CacheEntry(owner, slot, tuple(pages), len(key))
        self.stats.stored_blocks += 1
        return True

    def evict_one(self) -> bool:
        """Drop the least recently used entry; False if the cache is empty."""
        if not self._entries:
            return False
        _, entry = self._entries.popitem(last=False)
        self._slots.release(entry.owner)
        self._pages.drop(list(entry.pages))
        self.stats.evicted_blocks += 1
        return True

    def clear(self) -> None:
        """Evict every entry."""
        while self.evict_one():
            pass
