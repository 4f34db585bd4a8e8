"""Reference-counted KV pages: a request owns its pages, the prefix cache may share them."""

from __future__ import annotations

from .pools import NULL_PAGE


class PageAllocator:
    """Hands out KV page ids ``1..num_pages-1`` (page 0 is the null page) with refcounts.

    A page returns to the free list when its last holder drops it, so a page kept by the
    prefix cache survives the request that wrote it.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"argument 'num_pages': expected >= 2, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() gives the lowest id
        self._refs: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Pages no one holds."""
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the null page)."""
        return self.num_pages - 1

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh pages with one reference each; ``ValueError`` if too few are free."""
        if count > len(self._free):
            raise ValueError(
                f"argument 'count': asked for {count} KV pages, {len(self._free)} are free"
            )
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add one reference to each page."""
        for p in pages:
            if p not in self._refs:
                raise ValueError(f"argument 'pages': page {p} is not allocated")
            self._refs[p] += 1

    def drop(self, pages: list[int]) -> None:
        """Remove one reference from each page; free pages nobody holds any more."""
        for p in pages:
            left = self._refs[p] - 1
            if left:
                self._refs[p] = left
            else:
                del self._refs[p]
                self._free.append(p)
        self._free.sort(reverse=True)

    def refcount(self, page: int) -> int:
        """References held on ``page`` (0 when free)."""
        return self._refs.get(page, 0)
