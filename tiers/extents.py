"""Best-fit extent allocator over a byte range, with coalescing of free neighbours.

The allocator owns offsets only, never bytes, so every memory-addressable tier (host
slab, HBM slab, a shared-memory segment) can use it. Sizes are rounded up to the
alignment; what a caller gets back is exactly what is accounted.

Primitives: `allocate(n) -> offset | None`, `allocate_many(n, count) -> offsets`,
`free(offset, n)`, `fits(n, limit)` (the free extents that could hold n, best first), and
with `indexed=True`, `take(offset, n)` (that exact extent, if it is free). Free extents
are kept in a list sorted by (size, offset) for best fit, and in two dicts keyed by start
and end so that a freed extent merges with both neighbours in O(1) lookups; `indexed`
adds a sorted list of their starts, to find the free extent that holds a given offset
(a tier that prefers particular extents takes them by offset).
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    def __init__(self, capacity_bytes: int, alignment: int = 64, indexed: bool = False) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        # The tail that does not fill an aligned unit is never handed out.
        self.capacity_bytes = capacity_bytes - capacity_bytes % alignment
        self._by_size: list[tuple[int, int]] = []
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._starts: list[int] | None = [] if indexed else None
        self.used_bytes = 0
        if self.capacity_bytes:
            self._add_free(0, self.capacity_bytes)

    def aligned(self, nbytes: int) -> int:
        return (nbytes + self.alignment - 1) & ~(self.alignment - 1)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a free extent of `aligned(nbytes)` bytes, or None if none fits."""
        size = self.aligned(max(nbytes, 1))
        i = bisect.bisect_left(self._by_size, (size, -1))
        if i == len(self._by_size):
            return None
        free_size, start = self._by_size[i]
        self._remove_free(start, free_size, i)
        if free_size > size:
            self._add_free(start + size, free_size - size)
        self.used_bytes += size
        return start

    def allocate_many(self, nbytes: int, count: int) -> list[int]:
        """Offsets of up to `count` extents of `aligned(nbytes)` bytes, each placed where
        `allocate` would place it, in fewer steps: a run of free extents of exactly that
        size is taken in one slice, and a larger extent is cut into as many as it holds.
        Fewer than `count` when the free space runs out."""
        size = self.aligned(max(nbytes, 1))
        by_size, by_start, by_end = self._by_size, self._by_start, self._by_end
        out: list[int] = []
        while len(out) < count:
            i = bisect.bisect_left(by_size, (size, -1))
            if i == len(by_size):
                break
            free_size, start = by_size[i]
            if free_size == size:
                # Exact fits, lowest offsets first, as `allocate` would take them one by one.
                j = bisect.bisect_left(by_size, (size + 1, -1), i, min(len(by_size), i + count - len(out)))
                for _, s in by_size[i:j]:
                    del by_start[s]
                    del by_end[s + size]
                    out.append(s)
                if self._starts is not None:
                    for _, s in by_size[i:j]:
                        del self._starts[bisect.bisect_left(self._starts, s)]
                del by_size[i:j]
                continue
            # The smallest larger extent: cut from its start, as `allocate` does, as many
            # as it holds (its remainder stays the best fit for the next one).
            k = min(count - len(out), free_size // size)
            self._remove_free(start, free_size, i)
            out.extend(range(start, start + k * size, size))
            if free_size > k * size:
                self._add_free(start + k * size, free_size - k * size)
        self.used_bytes += size * len(out)
        return out

    def fits(self, nbytes: int, limit: int) -> list[tuple[int, int]]:
        """Up to `limit` free extents that hold `aligned(nbytes)` bytes, as (start, size),
        best fit first (the order `allocate` prefers them in)."""
        size = self.aligned(max(nbytes, 1))
        i = bisect.bisect_left(self._by_size, (size, -1))
        return [(start, free_size) for free_size, start in self._by_size[i:i + limit]]

    def take(self, offset: int, nbytes: int) -> bool:
        """Allocate exactly `[offset, offset + aligned(nbytes))` if all of it is free (an
        `indexed` allocator only); False, changing nothing, if not."""
        assert self._starts is not None, "take needs an indexed allocator"
        size = self.aligned(max(nbytes, 1))
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start = self._starts[i]
        free_size = self._by_start[start]
        end, free_end = offset + size, start + free_size
        if end > free_end:
            return False
        self._remove_free(start, free_size)
        if offset > start:
            self._add_free(start, offset - start)
        if free_end > end:
            self._add_free(end, free_end - end)
        self.used_bytes += size
        return True

    def free(self, offset: int, nbytes: int) -> None:
        size = self.aligned(max(nbytes, 1))
        if offset < 0 or offset + size > self.capacity_bytes or offset % self.alignment:
            raise ValueError(f"extent [{offset}, +{size}) is not an allocated extent")
        self.used_bytes -= size
        start, end = offset, offset + size
        before = self._by_end.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            start = before
        after_size = self._by_start.get(end)
        if after_size is not None:
            self._remove_free(end, after_size)
            end += after_size
        self._add_free(start, end - start)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self._by_size, (size, start))
        self._by_start[start] = size
        self._by_end[start + size] = start
        if self._starts is not None:
            bisect.insort(self._starts, start)

    def _remove_free(self, start: int, size: int, index: int | None = None) -> None:
        if index is None:
            index = bisect.bisect_left(self._by_size, (size, start))
        del self._by_size[index]
        del self._by_start[start]
        del self._by_end[start + size]
        if self._starts is not None:
            del self._starts[bisect.bisect_left(self._starts, start)]
