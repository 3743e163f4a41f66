"""Least-recently-used order: the baseline every other policy is measured against.

One `RowLists` list over rows (see kvstore.core.policies.rows): no Python object per block,
and the same order an OrderedDict with `move_to_end` on every hit keeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore.core.policies.base import BlockKey, Clock, Rows
from kvstore.core.policies.rows import RowKeyedPolicy, RowLists

_ORDER = 1


class LRUPolicy(RowKeyedPolicy):
    """Evicts the block whose last insert or hit is the oldest."""

    name = "lru"

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        self._lists = RowLists(1)

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        row = self._insert_key(key)
        self._lists.ensure(row + 1)
        self._lists.append(_ORDER, row)

    def touch(self, key: BlockKey) -> None:
        row = self._row(key)
        if row >= 0 and self._lists.list_of(row):
            self._lists.append(_ORDER, row)

    def __len__(self) -> int:
        return self._lists.size[_ORDER]

    # -- rows

    def insert_rows(self, rows: Rows) -> None:
        if len(rows):
            self._lists.ensure(int(rows.max()) + 1)
            self._lists.append_many(_ORDER, rows)

    def touch_rows(self, rows: Rows) -> None:
        if len(rows):
            self._lists.ensure(int(rows.max()) + 1)
            self._lists.touch_many(_ORDER, rows)

    def remove_row(self, row: int) -> None:
        if self._lists.list_of(row):
            self._lists.discard(row)
            if self._keys is not None:
                self._keys.drop(row)

    def victim_row(self, evictable: Callable[[int], bool]) -> int | None:
        return self._lists.first(_ORDER, evictable)

    def order(self) -> list[BlockKey]:
        """Tracked keys, oldest first (tests and diagnostics)."""
        return [self._key(r) for r in self._lists.rows(_ORDER)]
