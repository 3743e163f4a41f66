"""Adaptive Replacement Cache (Megiddo & Modha, FAST '03), counted in blocks.

ARC splits resident blocks into T1 (seen once recently) and T2 (seen at least twice),
and remembers the keys it evicted from each in ghost lists B1 and B2. A miss that hits
a ghost tells which side was too small and moves the target size `p` of T1 towards it,
so one long scan only churns T1 and leaves the frequently reused blocks in T2.

The policy does not own capacity (the store does), but ARC needs it to size `p` and the
ghost lists. It takes the capacity to be the largest resident count it has seen when
asked for a victim: the store only asks when the tier is full, so that count is the
tier's capacity in blocks (plus the block being admitted).

Storage: the lists are `RowLists` over rows (of the store's block table when bound to
it, else of a private key map), the ghosts `GhostList`s of 64-bit key fingerprints:
no Python object per block. The order is exactly the OrderedDict order this policy
kept before (tests/core/test_policy_rows.py replays random traces against that reference).

Primitives: the four ordered lists, `p`, and the REPLACE rule in `victim`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvstore.core.policies.base import BlockKey, Clock, Rows
from kvstore.core.policies.rows import GhostList, RowKeyedPolicy, RowLists, key_fingerprint

T1, T2 = 1, 2


class ARCPolicy(RowKeyedPolicy):
    """Scan-resistant, self-tuning recency/frequency balance."""

    name = "arc"

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        # Each list is LRU first, MRU last.
        self._lists = RowLists(2)
        self._b1 = GhostList()
        self._b2 = GhostList()
        self._p = 0.0
        # Capacity learnt from the resident count at eviction time (see module doc).
        self._c = 0

    # -- keys <-> rows (see RowKeyedPolicy)

    def _fp(self, row: int) -> int:
        return key_fingerprint(self._keys.key(row)) if self._keys is not None else self._bound().fingerprint(row)

    def _forget(self, row: int) -> None:
        if self._keys is not None:
            self._keys.drop(row)

    # -- the policy on keys

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        row = self._insert_key(key)
        self._insert_row(row)

    def touch(self, key: BlockKey) -> None:
        row = self._row(key)
        if row >= 0:
            self._touch_row(row)

    def __len__(self) -> int:
        return self._lists.size[T1] + self._lists.size[T2]

    # -- the policy on rows

    def _insert_row(self, row: int) -> None:
        lists = self._lists
        lists.ensure(row + 1)
        if lists.lst[row]:
            self._touch_row(row)
            return
        fp = self._fp(row) if len(self._b1) or len(self._b2) else 0
        if len(self._b1) and fp in self._b1:
            # A block evicted from T1 came back: T1 was too small.
            b1, b2 = len(self._b1), len(self._b2)
            self._p = min(float(self._c), self._p + max(1.0, b2 / b1))
            self._b1.delete(fp)
            lists.append(T2, row)
        elif len(self._b2) and fp in self._b2:
            # A block evicted from T2 came back: T2 was too small.
            b1, b2 = len(self._b1), len(self._b2)
            self._p = max(0.0, self._p - max(1.0, b1 / b2))
            self._b2.delete(fp)
            lists.append(T2, row)
        else:
            lists.append(T1, row)

    def insert_rows(self, rows: Rows) -> None:
        lists = self._lists
        if not len(rows):
            return
        lists.ensure(self._bound().high if self._keys is None else int(rows.max()) + 1)
        fresh = not np.any(lists.lst[rows]) and lists.distinct_untracked(rows)
        if fresh and (len(self._b1) or len(self._b2)):
            fps = self._bound().fingerprints(rows)
            fresh = not (self._b1.contains_many(fps).any() or self._b2.contains_many(fps).any())
        if fresh:
            lists.append_many(T1, rows)  # all new (a put): into T1 in order, one step
            return
        for row in rows.tolist():
            self._insert_row(row)

    def _touch_row(self, row: int) -> None:
        lists = self._lists
        if row < len(lists.lst) and lists.lst[row]:
            lists.append(T2, row)

    def touch_rows(self, rows: Rows) -> None:
        lists = self._lists
        if not len(rows):
            return
        lists.ensure(self._bound().high if self._keys is None else int(rows.max()) + 1)
        # Each row ends where its last touch puts it (`append_many` keeps last occurrences).
        lists.touch_many(T2, rows)

    def remove_row(self, row: int) -> None:
        lists = self._lists
        which = lists.list_of(row)
        if not which:
            return
        fp = self._fp(row)
        lists.discard(row)
        (self._b1 if which == T1 else self._b2).push(fp)
        self._forget(row)
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        # ARC's bounds: |T1| + |B1| <= c and the whole directory <= 2c.
        size = self._lists.size
        t1, t2 = size[T1], size[T2]
        c = max(self._c, t1 + t2)
        b1, b2 = self._b1, self._b2
        n1, n2 = len(b1), len(b2)
        while n1 and t1 + n1 > c:
            b1.pop_oldest()
            n1 -= 1
        while n2 and t1 + t2 + n1 + n2 > 2 * c:
            b2.pop_oldest()
            n2 -= 1

    def victim_row(self, evictable: Callable[[int], bool]) -> int | None:
        lists = self._lists
        t1 = lists.size[T1]
        resident = t1 + lists.size[T2]
        if resident > self._c:
            self._c = resident
        # REPLACE: take from T1 while it is over its target size, else from T2.
        first, second = (T1, T2) if t1 > self._p else (T2, T1)
        for side in (first, second):
            row = lists.first(side, evictable)
            if row is not None:
                return row
        return None

    # -- for tests and diagnostics: the lists as keys, oldest first

    def state(self) -> tuple[list[BlockKey], list[BlockKey], list[int], list[int]]:
        return ([self._key(r) for r in self._lists.rows(T1)], [self._key(r) for r in self._lists.rows(T2)],
                list(self._b1), list(self._b2))
