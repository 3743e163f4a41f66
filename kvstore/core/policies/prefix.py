"""Prefix-aware ordering: never evict a block while a descendant of it stays.

A lookup returns the longest cached prefix, so a block whose ancestor is gone can never
be hit again: keeping it wastes a slot. This wrapper keeps, for every tracked block, how
many of its tracked children exist, and lets the base policy choose only among leaves
(blocks with no tracked child). It never evicts an ancestor while a descendant stays.

Primitives: `parent` and child counts per key; the base policy's order among leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from kvstore.core.policies.base import BlockKey, EvictionPolicy


class PrefixAwarePolicy(EvictionPolicy):
    """Leaves first, in the order of `base`. Named ``prefix-`` and its base's name."""

    # What this wrapper puts before its base's name.
    word: ClassVar[str] = "prefix"

    def __init__(self, base: EvictionPolicy) -> None:
        super().__init__(base.clock)
        self.name = f"{self.word}-{base.name}"
        self._base = base
        self._parent: dict[BlockKey, BlockKey | None] = {}
        # Children counted whether or not the parent is tracked yet: blocks of one
        # request arrive tail first, so a child can precede its parent.
        self._children: dict[BlockKey, int] = {}

    @property
    def base(self) -> EvictionPolicy:
        """The policy this one wraps."""
        return self._base

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        if key not in self._parent:
            self._parent[key] = parent
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1
        self._base.insert(key, parent)

    def touch(self, key: BlockKey) -> None:
        self._base.touch(key)

    def remove(self, key: BlockKey) -> None:
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        if parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
        self._base.remove(key)

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        children = self._children
        key = self._base.victim(lambda k: k not in children and evictable(k))
        if key is None:
            # Every evictable block has a pinned descendant: evicting an inner block
            # beats refusing to make room.
            key = self._base.victim(evictable)
        return key

    def parent_of(self, key: BlockKey) -> BlockKey | None:
        return self._parent.get(key)

    def __len__(self) -> int:
        return len(self._base)

    def __contains__(self, key: object) -> bool:
        return key in self._base

