"""Adaptive Replacement Cache (Megiddo & Modha, FAST '03), counted in blocks.

ARC splits resident blocks into T1 (seen once recently) and T2 (seen at least twice),
and remembers the keys it evicted from each in ghost lists B1 and B2. A miss that hits
a ghost tells which side was too small and moves the target size `p` of T1 towards it,
so one long scan only churns T1 and leaves the frequently reused blocks in T2.

The policy does not own capacity (the store does), but ARC needs it to size `p` and the
ghost lists. It takes the capacity to be the largest resident count it has seen when
asked for a victim: the store only asks when the tier is full, so that count is the
tier's capacity in blocks (plus the block being admitted).

Primitives: the four ordered lists, `p`, and the REPLACE rule in `victim`.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from kvstore.policies.base import BlockKey, Clock, EvictionPolicy


class ARCPolicy(EvictionPolicy):
    """Scan-resistant, self-tuning recency/frequency balance."""

    name = "arc"

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        # Each list is LRU first, MRU last.
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._p = 0.0
        # Capacity learnt from the resident count at eviction time (see module doc).
        self._c = 0

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        if key in self._b1:
            # A block evicted from T1 came back: T1 was too small.
            b1, b2 = len(self._b1), len(self._b2)
            self._p = min(float(self._c), self._p + max(1.0, b2 / b1))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            # A block evicted from T2 came back: T2 was too small.
            b1, b2 = len(self._b1), len(self._b2)
            self._p = max(0.0, self._p - max(1.0, b1 / b2))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def insert_many(self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> None:
        if not self._t1:
            # An empty T1 (a rebuild at start): the new keys become T1 itself, one table
            # built instead of a plain dict copied into it (half the time at a million keys).
            fresh_t1: OrderedDict[BlockKey, None] = OrderedDict.fromkeys(keys)
            if len(fresh_t1) == len(keys) and all(d.keys().isdisjoint(fresh_t1) for d in (self._t2, self._b1, self._b2)):
                self._t1 = fresh_t1
                return
        else:
            fresh = dict.fromkeys(keys)
            if len(fresh) == len(keys) and all(d.keys().isdisjoint(fresh) for d in (self._t1, self._t2, self._b1, self._b2)):
                self._t1.update(fresh)  # all new (a put): into T1 in order, no Python step per key
                return
        super().insert_many(keys, parents)

    def touch(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def touch_many(self, keys: Iterable[BlockKey]) -> None:
        t1, t2 = self._t1, self._t2
        keys = keys if isinstance(keys, list) else list(keys)
        # Fast paths without a Python step per key (a lookup touches up to thousands):
        # every key already in T2 (a chain hit again), or every key in T1 (hit once before).
        try:
            deque(map(t2.move_to_end, keys), 0)
            return
        except KeyError:
            pass  # some key is not in T2: below (moving a key again keeps the order exact)
        if t2.keys().isdisjoint(keys) and len(unique := set(keys)) == len(keys) and unique <= t1.keys():
            deque(map(t1.__delitem__, keys), 0)
            t2.update(dict.fromkeys(keys))
            return
        for key in keys:
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        # ARC's bounds: |T1| + |B1| <= c and the whole directory <= 2c.
        c = max(self._c, len(self._t1) + len(self._t2))
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        resident = len(self._t1) + len(self._t2)
        if resident > self._c:
            self._c = resident
        # REPLACE: take from T1 while it is over its target size, else from T2.
        first, second = (self._t1, self._t2) if len(self._t1) > self._p else (self._t2, self._t1)
        for side in (first, second):
            for key in side:
                if evictable(key):
                    return key
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
