"""Bélády's offline optimum (MIN) as an eviction policy, for trace replay only.

With the whole future known, evicting the block whose next use is farthest away (blocks
never used again first) maximises hits. A replay tells the policy each block's next use
through the `next_use` callable, read at every insert and touch. Ties go to the block
recorded first: a replay records a request's blocks tail first, so of a chain that is
next needed by the same request the tail goes before the head.
Under prefix semantics the next use of a child is never earlier than its parent's (a
request holding the child holds the parent), so this order also never strands a child.

Not registered in `POLICIES`: it needs the future, which only a replay has.

Primitives: a max-heap of (next use, record order) with lazy deletion.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from kvstore.core.policies.base import BlockKey, Clock, EvictionPolicy

NEVER = float("inf")


class BeladyPolicy(EvictionPolicy):
    """Evicts the block used farthest in the future, per `next_use(key)`."""

    name = "opt"

    def __init__(
        self,
        next_use: Callable[[BlockKey], float],
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(clock)
        self._next_use = next_use
        # key -> (next use, record seq) as last recorded; the heap holds next use negated.
        self._rank: dict[BlockKey, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, BlockKey]] = []
        self._seq = 0

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        self._record(key)

    def touch(self, key: BlockKey) -> None:
        if key in self._rank:
            self._record(key)

    def _record(self, key: BlockKey) -> None:
        self._seq += 1
        use = self._next_use(key)
        self._rank[key] = (use, self._seq)
        heapq.heappush(self._heap, (-use, self._seq, key))

    def remove(self, key: BlockKey) -> None:
        self._rank.pop(key, None)

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        heap = self._heap
        skipped: list[tuple[float, int, BlockKey]] = []
        found: BlockKey | None = None
        while heap:
            neg_use, seq, key = heap[0]
            if self._rank.get(key) != (-neg_use, seq):
                heapq.heappop(heap)  # stale: touched since, or removed
                continue
            if evictable(key):
                found = key
                break
            skipped.append(heapq.heappop(heap))
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def __len__(self) -> int:
        return len(self._rank)

    def __contains__(self, key: object) -> bool:
        return key in self._rank
