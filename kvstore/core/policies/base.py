"""Eviction policy interface: a policy only orders victims.

The store owns capacity accounting and the eviction loop (cachetools style). A policy
is told about every block that becomes READY in its tier (`insert`), every hit
(`touch`) and every removal for any reason (`remove`), and answers one question:
which block should go next (`victim`). Pinned or leased blocks are skipped by the
caller's `evictable` predicate, never by the policy, so the policy needs no view of
leases.

Keys are opaque `bytes` (namespace id + block hash, 32 bytes). `parent` is the key of
the previous block in the same prefix chain, or None for the first block; prefix-aware
policies use it, others ignore it. Time comes from the injected clock so that a trace
replay can drive policies with the trace's timestamps.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvstore.core.table import BlockTable

Clock = Callable[[], float]
BlockKey = bytes
Rows = npt.NDArray[np.int64]


class EvictionPolicy(ABC):
    """Orders the READY blocks of one tier for eviction."""

    # The configured name: a class attribute of a base order, set per instance by a
    # wrapper from its base's ("hint-" + "arc").
    name: str

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._table: BlockTable | None = None

    # -- rows of a block table (the store's fast paths)
    #
    # In the daemon a policy is bound to the store's block table and told about blocks by
    # row number. These defaults translate rows to keys; the array-backed policies (ARC,
    # LRU) work on rows directly and keep no key of their own.

    def bind(self, table: BlockTable) -> None:
        """From now on, keys are keys of `table`'s indexed rows (call before any insert)."""
        self._table = table

    def _bound(self) -> BlockTable:
        assert self._table is not None, "row calls need a policy bound to a block table"
        return self._table

    def insert_rows(self, rows: Rows) -> None:
        """`insert` the blocks of `rows` in order, with their parents."""
        t = self._bound()
        self.insert_many(t.keys(rows), t.parent_keys(rows))

    def touch_rows(self, rows: Rows) -> None:
        """`touch` the blocks of `rows` in order."""
        self.touch_many(self._bound().keys(rows))

    def remove_row(self, row: int) -> None:
        self.remove(self._bound().key(row))

    def victim_row(self, evictable: Callable[[int], bool]) -> int | None:
        """`victim`, as a row; `evictable` takes a row."""
        t = self._bound()
        key = self.victim(lambda k: evictable(t.find_key(k)))
        return None if key is None else t.find_key(key)

    @abstractmethod
    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        """A block became READY in this tier. Inserting a present key acts as `touch`."""

    def insert_many(self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> None:
        """`insert` each key with its parent, in order. Override to go faster."""
        for key, parent in zip(keys, parents):
            self.insert(key, parent)

    @abstractmethod
    def touch(self, key: BlockKey) -> None:
        """A block was hit (lookup or fetch). Unknown keys are ignored."""

    def touch_many(self, keys: Iterable[BlockKey]) -> None:
        """`touch` each key in order (a lookup's hits, tail first). Override to go faster."""
        for key in keys:
            self.touch(key)

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """A block left this tier (evicted, deleted, moved). Unknown keys are ignored."""

    @abstractmethod
    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        """The best block to evict among those for which `evictable` is true.

        Does not remove it: the caller evicts it and then calls `remove`. Returns None
        when no tracked block is evictable.
        """

    def parent_of(self, key: BlockKey) -> BlockKey | None:
        """The parent this policy keeps for `key`; None where it does not keep parents
        (a policy that ignores them needs none back on a later `insert`)."""
        return None

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def hint(
        self,
        keys: Iterable[BlockKey],
        session_id: str,
        expect_reuse_within_s: float,
    ) -> None:
        """The client expects `keys` to be reused within the given time. Optional."""

    def end_session(self, session_id: str) -> None:
        """The session will not come back; release any protection it holds. Optional."""
