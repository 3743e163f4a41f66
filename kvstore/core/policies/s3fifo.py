"""S3-FIFO (Yang et al., SOSP '23), counted in blocks.

Three FIFO queues: a small probationary queue S (10% of capacity) that new blocks enter,
a main queue M, and a ghost queue G of keys recently dropped from S. A block hit at
least once while in S moves to M when it reaches S's head; others leave, and their key
goes to G so that a quick return is admitted straight into M. M is a CLOCK with a 2-bit
frequency. One-hit blocks (most of a scan) thus leave after a short stay in S.

As with ARC, capacity is learnt from the resident count when the store asks for a
victim. `victim` advances the queues (promotions, frequency decay): that is how this
policy orders, and it is idempotent in what it returns until the caller removes it.

Primitives: the queues S, M, G and the per-block frequency.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from kvstore.core.policies.base import BlockKey, Clock, EvictionPolicy

_MAX_FREQ = 3
_SMALL_FRACTION = 0.1


class S3FIFOPolicy(EvictionPolicy):
    """Quick demotion of one-hit blocks; frequency-aware CLOCK for the rest."""

    name = "s3fifo"

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        # Oldest first. Values are access frequencies (0..3).
        self._small: OrderedDict[BlockKey, int] = OrderedDict()
        self._main: OrderedDict[BlockKey, int] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._c = 0

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        if key in self._small or key in self._main:
            self.touch(key)
        elif key in self._ghost:
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def touch(self, key: BlockKey) -> None:
        if key in self._small:
            self._small[key] = min(self._small[key] + 1, _MAX_FREQ)
        elif key in self._main:
            self._main[key] = min(self._main[key] + 1, _MAX_FREQ)

    def remove(self, key: BlockKey) -> None:
        if key in self._small:
            del self._small[key]
            self._ghost[key] = None
            limit = max(self._c, len(self))
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)
        else:
            self._main.pop(key, None)

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        resident = len(self)
        if resident > self._c:
            self._c = resident
        if len(self._small) >= _SMALL_FRACTION * self._c or not self._main:
            key = self._victim_small(evictable)
            if key is not None:
                return key
        key = self._victim_main(evictable)
        if key is not None:
            return key
        return self._victim_small(evictable)

    def _victim_small(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        # Bounded: a pass looks at each block of S at most once; hit blocks leave S for
        # M, and a pinned block goes to the back of S rather than stalling the queue.
        for _ in range(len(self._small)):
            key, freq = next(iter(self._small.items()))
            if freq > 0:
                del self._small[key]
                self._main[key] = 0
            elif evictable(key):
                return key
            else:
                self._small.move_to_end(key)
        return None

    def _victim_main(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        # A full sweep decays every frequency by one, so at most _MAX_FREQ + 1 sweeps.
        for _ in range((_MAX_FREQ + 1) * len(self._main) + 1):
            if not self._main:
                return None
            key, freq = next(iter(self._main.items()))
            if freq > 0 or not evictable(key):
                self._main.move_to_end(key)
                self._main[key] = max(freq - 1, 0)
                continue
            return key
        return None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main
