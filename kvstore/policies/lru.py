"""Least-recently-used order: the baseline every other policy is measured against."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvstore.policies.base import BlockKey, Clock, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the block whose last insert or hit is the oldest."""

    name = "lru"

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        # Oldest first; move_to_end on every hit keeps this O(1).
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Iterable[BlockKey]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        for key in self._order:
            if evictable(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
