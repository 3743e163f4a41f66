"""A tier as the control plane sees it (`StoreTier`: bytes, order, watermarks, counters,
status), which tiers make one store (`check_tiers`), who applies the policy calls a verb
leaves for after its answer (`PolicyDeferral`), and the blocks the tier holds as
replicas of another daemon's (`ReplicaSet`).

A lookup's hits and a put's new blocks reach a tier's policy after the reply has gone
out: that is the one reverse edge between a server and the store, and it is named here
so a server can take it over (the control lane applies the calls right after writing
its answer instead of leaving them to a loop callback).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.core.index import BlockEntry
from kvstore.core.policies import EvictionPolicy
from kvstore.core.table import BlockTable
from kvstore.core.tier import Tier
from kvstore.core.types import TierCounters, TierStatus

# Policy calls that may wait for the loop (see `StoreTier.defer_touch`).
DEFERRED_MAX = 64


def check_tiers(tiers: Sequence[StoreTier]) -> None:
    """Refuse tiers that cannot make one store (ValueError). A store takes them top first,
    with distinct names, each either addressable (memory: a block's copy there is its only
    one among them) or inclusive (SSD: a copy kept next to a memory one); at most one
    inclusive tier, and that one last; and at least one addressable tier for puts to land in."""
    if not tiers:
        raise ValueError("a store needs at least one tier")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ValueError(f"tier names must be distinct, got {names}")
    for t in tiers:
        if t.tier.addressable == t.tier.inclusive:
            raise ValueError(
                f"tier {t.name} is {'both' if t.tier.addressable else 'neither'} addressable "
                f"{'and' if t.tier.addressable else 'nor'} inclusive; a store takes addressable tiers "
                "that hold blocks exclusively (memory) and at most one inclusive tier that is not (SSD)"
            )
    inclusive = [t for t in tiers if t.tier.inclusive]
    if len(inclusive) > 1 or (inclusive and inclusive[0] is not tiers[-1]):
        raise ValueError("at most one inclusive (SSD) tier, and it must be the last")
    if not any(t.tier.addressable for t in tiers):
        raise ValueError("a store needs at least one addressable tier for puts to land in")


class PolicyDeferral:
    """Who applies the tiers' deferred policy calls. By default a loop callback after the
    running one (`call_soon`). A server that answers a call and can apply them itself
    right after (the control lane) `hold`s it around the call and `release`s it once the
    answer is written: the calls are then applied in that same callback, which saves the
    event loop a turn per call. Every tier of a store shares its store's."""

    __slots__ = ("held", "_pending")

    def __init__(self) -> None:
        self.held = False
        self._pending: list[StoreTier] = []

    def hold(self) -> None:
        self.held = True

    def take(self, tier: StoreTier) -> bool:
        """Whether the holder applies `tier`'s deferred calls (else the tier schedules them)."""
        if self.held:
            self._pending.append(tier)
        return self.held

    def release(self) -> None:
        """Apply what was deferred while held, in the order the tiers deferred it."""
        self.held = False
        if self._pending:
            pending, self._pending = self._pending, []
            for tier in pending:
                tier.apply_deferred()


class ReplicaSet:
    """Blocks a tier holds as copies of blocks another daemon of a pool owns (a cluster's
    replicas): the first victims when room is needed, oldest first, before anything the
    tier's policy orders, so copies never crowd out the blocks this daemon owns (what the
    cluster benchmark measured, docs/cluster.md). They stay while nothing needs their room,
    and while they are pinned or read (a fetch serving them).

    Rows are kept with their generation; a row that was recycled, or whose block left this
    tier, is forgotten when a scan meets it (no hook on every removal is needed)."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: dict[int, int] = {}  # row -> generation, in marking order

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, entry: BlockEntry) -> None:
        self._rows.pop(entry.row, None)
        self._rows[entry.row] = int(entry.table.vgen[entry.row])

    def add_rows(self, rows: Sequence[int], gens: Sequence[int]) -> None:
        """`add` of each of `rows` (with its generation), in order."""
        held = self._rows
        for row, gen in zip(rows, gens):
            held.pop(row, None)
            held[row] = gen

    def discard(self, row: int) -> None:
        self._rows.pop(row, None)

    def holds(self, table: BlockTable, row: int, tier: str) -> bool:
        gen = self._rows.get(row)
        return gen is not None and int(table.vgen[row]) == gen and BlockEntry.of(table, row).slot_in(tier) is not None

    def victim_row(self, table: BlockTable, tier: str, evictable: Callable[[int], bool]) -> int | None:
        """The oldest replica in `tier` that could leave now; stale rows are dropped on the way."""
        stale: list[int] = []
        found = None
        for row, gen in self._rows.items():
            if int(table.vgen[row]) != gen or BlockEntry.of(table, row).slot_in(tier) is None:
                stale.append(row)
            elif evictable(row):
                found = row
                break
        for row in stale:
            del self._rows[row]
        return found


class StoreTier:
    """A tier as the control plane sees it: bytes (`tier`), order (`policy`), counters.

    Watermarks are fractions of capacity: over `high_watermark` the migrator demotes
    until the tier is at or under `low_watermark`.

    A lookup's hits and a put's new blocks reach the policy after the answer has gone out
    (`defer_touch`, `defer_insert`): the call is queued and applied by a loop callback,
    or at the latest by the next use of `policy`, which applies whatever is queued
    first. So the policy sees exactly the same calls in the same order as if each had
    been made on the spot; only the reply no longer waits for them.
    """

    __slots__ = ("tier", "_policy", "high_watermark", "low_watermark", "counters", "draining",
                 "_deferred", "_flush_scheduled", "deferral", "replicas")

    def __init__(self, tier: Tier, policy: EvictionPolicy, high_watermark: float = 0.95,
                 low_watermark: float = 0.85) -> None:
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(
                f"tier {tier.name}: watermarks must satisfy 0 < low <= high <= 1, "
                f"got low={low_watermark} high={high_watermark}"
            )
        self.tier = tier
        self._policy = policy
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.counters = TierCounters()
        self.draining = False
        self._deferred: list[tuple[bool, np.ndarray[Any, Any]]] = []  # (insert, rows), in call order
        self._flush_scheduled = False
        self.deferral = PolicyDeferral()  # its store's, once in one
        self.replicas = ReplicaSet()

    def __repr__(self) -> str:
        return f"StoreTier({self.tier.name}, {self._policy.name})"

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def policy(self) -> EvictionPolicy:
        """The tier's policy, with every deferred touch and insert applied."""
        if self._deferred:
            self.apply_deferred()
        return self._policy

    def status(self, pending_writes: int = 0) -> TierStatus:
        """A snapshot of the tier: its bytes, blocks, policy, counters and facts, and the
        writes queued for it (`pending_writes`, the store's SSD writes for its SSD tier)."""
        tier = self.tier
        return TierStatus(name=self.name, capacity_bytes=tier.capacity_bytes, used_bytes=tier.used_bytes,
                          blocks=tier.blocks, policy=self.policy.name, counters=self.counters.snapshot(),
                          facts=tier.describe(), pending_writes=pending_writes)

    def defer_touch(self, rows: np.ndarray[Any, Any]) -> None:
        """`policy.touch_rows(rows)`, applied soon after the running callback (at once
        when no event loop runs), and in any case before the policy is used again."""
        self._defer(False, rows)

    def defer_insert(self, rows: np.ndarray[Any, Any]) -> None:
        """`policy.insert_rows(rows)`, deferred as `defer_touch` is."""
        self._defer(True, rows)

    def _defer(self, insert: bool, rows: np.ndarray[Any, Any]) -> None:
        self._deferred.append((insert, rows))
        if len(self._deferred) >= DEFERRED_MAX:
            self.apply_deferred()  # many calls answered in one callback: catch up now
            return
        if self._flush_scheduled:
            return
        if self.deferral.take(self):
            self._flush_scheduled = True
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.apply_deferred()
            return
        self._flush_scheduled = True
        loop.call_soon(self.apply_deferred)

    def apply_deferred(self) -> None:
        self._flush_scheduled = False
        touches, self._deferred = self._deferred, []
        for insert, rows in touches:
            if insert:
                self._policy.insert_rows(rows)
            else:
                self._policy.touch_rows(rows)

