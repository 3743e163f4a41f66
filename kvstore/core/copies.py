"""The copy book: which tiers hold a copy of each block, who is reading it, and what
every copy counts for (tenant usage, namespace totals, the observer's events).

Control plane only: these methods run to completion without awaiting, so a copy appears
or disappears in one step as far as every other call can tell.

Ordering decisions that matter:
- A landed copy is recorded (`add_location`) only after its bytes verified; a block's
  last copy takes the block out of the index with it (`remove_location`, `drop`).
- Never free bytes under a reader. A copy taken away while readers hold the block is
  retired, and freed when the last reader lets go (`release` -> `readers_gone`); a
  deleted block keeps its slots the same way.
- Tenancy: a READY copy counts against its namespace's tenant in the tier that holds
  it; copies of namespaces not registered yet (recovered from SSD) count from the moment
  a request registers them. A removed entry counts for nothing (its copies stopped
  counting when it was dropped, though readers may still hold them).
- Events: only READY blocks are reported (what a router may have heard of): stored when
  published, moved when the tier a block is served from changes, removed with the last
  copy.
- Replicas (copies of blocks another daemon of a pool owns) are marked in the memory
  tier of their top copy, and their queued SSD write cleared: they are that tier's first
  victims, and are never written through (`mark_replicas`).

Primitives: `top_tier`/`top_name`, `block_info`/`block_groups`, `hold`/`release`,
`add_location`/`remove_location`, `recovered`, `drop`, `drop_last_copies`,
`drop_bad_copy`, `published`, `mark_replicas`, `quota_exceeded`/`quota_incoming`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvstore.core.index import BlockEntry, BlockIndex, BlockState
from kvstore.core.namespaces import NamespaceRegistry
from kvstore.core.store_tier import StoreTier
from kvstore.core.table import I64
from kvstore.core.tenancy import TenantLedger
from kvstore.core.tier import RecoveredBlocks, Slot
from kvstore.core.types import BlockGroup, BlockInfo, NamespaceInfo, StoreCounters, StoreObserver
from kvstore.hashing import HASH_BYTES

logger = logging.getLogger(__name__)


class CopyBook:
    """Copies of the index's blocks in a store's tiers (`tiers` top first)."""

    def __init__(self, index: BlockIndex, tiers: Sequence[StoreTier], registry: NamespaceRegistry,
                 tenancy: TenantLedger, counters: StoreCounters) -> None:
        self._index = index
        self._tiers = list(tiers)
        self._by_name = {t.name: t for t in self._tiers}
        self._rank = {t.name: i for i, t in enumerate(self._tiers)}
        self._tier_ids = {t.name: index.table.tier_id(t.name) for t in self._tiers}
        self._by_id = {self._tier_ids[t.name]: t for t in self._tiers}
        self._registry = registry
        self._tenancy = tenancy
        self._counters = counters
        # Set by the daemon (the event bus); None in embedded and unit-test stores.
        self.observer: StoreObserver | None = None

    # -- where a block is served from

    def top_tier(self, entry: BlockEntry) -> StoreTier | None:
        """The highest tier holding a copy of `entry` (where reads are served from)."""
        for st in self._tiers:
            if entry.slot_in(st.name) is not None:
                return st
        return None

    def top_name(self, entry: BlockEntry) -> str:
        name = entry.only_tier()
        if name is not None:  # one copy: the common case, on the lookup hot path
            return name
        st = self.top_tier(entry)
        assert st is not None, "an indexed block has a location"
        return st.name

    def block_info(self, entry: BlockEntry) -> BlockInfo:
        top = self.top_name(entry)
        return BlockInfo(top, entry.locations[top], entry.nbytes, entry.checksum, entry.pins,
                         sorted(entry.locations, key=self._rank.__getitem__))

    def block_groups(self) -> list[BlockGroup]:
        """Every READY block, grouped by namespace and the tier it is served from (a
        point-in-time snapshot)."""
        groups: dict[tuple[bytes, str], list[bytes]] = {}
        for entry in self._index:
            groups.setdefault((entry.key[:HASH_BYTES], self.top_name(entry)), []).append(entry.key[HASH_BYTES:])
        return [BlockGroup(ns, tier, tuple(hashes)) for (ns, tier), hashes in groups.items()]

    # -- readers

    def hold(self, entry: BlockEntry) -> None:
        entry.readers += 1

    def release(self, entry: BlockEntry) -> None:
        entry.readers -= 1
        if entry.readers == 0:
            self.readers_gone(entry)

    def readers_gone(self, entry: BlockEntry) -> None:
        """The last reader of `entry` let go: free what was kept only for readers (a
        retired copy; every copy of a deleted block)."""
        if entry.retired is not None:
            for slot in entry.retired:
                self._by_name[slot.tier].tier.free(slot)
            entry.retired = None
        if entry.removed:
            for slot in entry.slots():
                self._by_name[slot.tier].tier.free(slot)
            entry.clear_slots()

    # -- copies appearing and leaving

    def add_location(self, entry: BlockEntry, st: StoreTier, slot: Slot) -> bool:
        """Record a landed, verified copy; False (and the slot freed) if it is not needed."""
        if entry.removed or entry.slot_in(st.name) is not None:
            st.tier.free(slot)
            return False
        was_top = self.top_name(entry) if entry.slots() else ""
        entry.add_slot(slot)
        self._account(entry, st.name, entry.nbytes)
        st.policy.insert(entry.key, entry.parent)
        if was_top and self._rank[st.name] < self._rank[was_top]:
            self._moved(entry, was_top, st.name)  # promoted: now served from higher up
        return True

    def remove_location(self, entry: BlockEntry, st: StoreTier) -> None:
        """Take one copy away; the entry leaves the index with its last copy."""
        if self._drop_last_copy(entry, st):
            return
        was_top = self.top_name(entry)
        slot = entry.pop_slot(st.name)
        self._account(entry, st.name, -entry.nbytes)
        st.policy.remove_row(entry.row)
        if entry.readers:
            entry.retire(slot)
        else:
            st.tier.free(slot)
        if not entry.slots() and not entry.removed:
            self._index.remove_entry(entry)
            st.counters.drops += 1
            self._forget(entry)
            self._removed(entry, st.name)
        elif entry.slots() and was_top == st.name:
            self._moved(entry, st.name, self.top_name(entry))  # demoted (or its top copy dropped)

    def _drop_last_copy(self, entry: BlockEntry, st: StoreTier) -> bool:
        """`remove_location` of an indexed block's only copy, in `st`, with no reader (an
        eviction from the last tier, the common case at scale), in the batch form
        (`drop_last_copies`). False, having done nothing, in any other case."""
        if not self._index.sole_copy(entry, self._tier_ids[st.name]):
            return False
        st.policy.remove_row(entry.row)
        self.drop_last_copies(st, [entry.row])
        return True

    def drop_last_copies(self, st: StoreTier, taken: list[int]) -> None:
        """Drop rows whose only copy is in `st`, each indexed, with no reader, and already
        out of `st`'s policy, with the table, the accounting and the events updated once
        for all of them."""
        observer = self.observer
        rows = np.array(taken, np.int64)
        for gone in self._index.remove_sole_copies(rows, st.tier.free, observer is not None):
            info = self._registry.get(gone.namespace_id)
            if info is not None:
                self._tenancy.add(info.tenant, st.name, -gone.nbytes)
                info.blocks -= gone.blocks
                info.bytes -= gone.nbytes
            if observer is not None:
                observer.blocks_removed(gone.namespace_id, gone.hashes, st.name)
        st.counters.drops += len(rows)

    def recovered(self, st: StoreTier, report: RecoveredBlocks) -> int:
        """Index the copies `st` recovered at start (READY blocks, one copy each), queue
        them for its policy and count its checksum failures; their namespaces await a
        request that sends their layout (`NamespaceRegistry.recovered`). How many."""
        rows = self._index.add_recovered(st.name, report.records)
        st.policy.insert_rows(rows)
        if len(rows):
            self._registry.recovered(self._index.namespaces_of(rows))
        st.counters.checksum_failures += report.checksum_failures
        self._counters.checksum_failures += report.checksum_failures
        return len(rows)

    def drop(self, entry: BlockEntry) -> None:
        """Remove a block from the index and every tier; bytes go when no reader holds them."""
        if entry.locations:
            self._removed(entry, self.top_name(entry))
        for name in entry.locations:
            self._account(entry, name, -entry.nbytes)  # before the index marks it removed
        for name in entry.locations:
            self._by_name[name].policy.remove_row(entry.row)
        self._index.remove_entry(entry)
        self._forget(entry)
        if entry.readers == 0:
            for slot in entry.slots():
                self._by_name[slot.tier].tier.free(slot)
            entry.clear_slots()

    def drop_bad_copy(self, entry: BlockEntry, st: StoreTier) -> None:
        """`entry`'s copy in `st` failed verification (or did not decode): count it and
        drop that copy; the others stay, each verified when read."""
        st.counters.checksum_failures += 1
        self._counters.checksum_failures += 1
        logger.warning("block %s in tier %s failed verification; that copy is dropped", entry.key.hex(), st.name)
        if st.name in entry.locations and not entry.removed:
            self.remove_location(entry, st)

    def published(self, info: NamespaceInfo, rows: I64) -> None:
        """A put's rows (in chain order, one copy each) just became READY: count them for
        the namespace and its tenant, queue them for their tiers' policies (after the
        answer), and tell the observer."""
        tail_first = rows[::-1]
        nbytes = self._index.nbytes_of(tail_first)
        info.blocks += len(rows)
        info.bytes += int(nbytes.sum())
        tops = self._index.top_ids(rows)
        tops_tail_first = tops[::-1]
        for tid, st in enumerate(self._tiers, start=1):
            has = tops_tail_first == tid
            if not has.any():
                continue
            self._tenancy.add(info.tenant, st.name, int(nbytes[has].sum()))
            # Tail first, so the head of a chain is the most recently used: a recency
            # policy then evicts chain tails before the heads later blocks depend on.
            st.defer_insert(tail_first[has])
        if self.observer is not None:
            hashes = self._index.table.hashes(rows)
            tids = np.unique(tops).tolist()
            for tid in tids:
                # One tier (the common case): every hash, without a pass to pick them.
                chosen = hashes if len(tids) == 1 else [hashes[i] for i in np.flatnonzero(tops == tid).tolist()]
                self.observer.blocks_stored(info.namespace_id, chosen, self._index.table.tier_names[tid])

    def mark_replicas(self, rows: Sequence[int] | I64) -> int:
        """Mark indexed rows as replicas in the memory tier of their top copy (see the
        module docstring); a block with one copy (a put's) is marked with the others of
        its tier in one step, without a handle per block. How many were marked."""
        at = np.asarray(rows, np.int64)
        if not len(at):
            return 0
        sole = self._index.sole_tier_ids(at)
        marked = 0
        for tid in np.unique(sole[sole != 0]).tolist():
            st = self._by_id.get(tid)
            if st is None or not st.tier.addressable:
                continue
            mine = at[sole == tid]
            self._index.unqueue_ssd_writes(mine)  # the write-through writer skips them
            st.replicas.add_rows(mine.tolist(), self._index.generations(mine))
            marked += len(mine)
        for row in at[sole == 0].tolist():
            entry = self._index.entry(row)
            top = self.top_tier(entry)
            if top is not None and top.tier.addressable:
                top.replicas.add(entry)
                entry.ssd_queued = False
                marked += 1
        return marked

    def _forget(self, entry: BlockEntry) -> None:
        info = self._registry.get(entry.key[:HASH_BYTES])
        if info is not None:
            info.blocks -= 1
            info.bytes -= entry.nbytes

    # -- events for the observer

    def _moved(self, entry: BlockEntry, from_tier: str, to_tier: str) -> None:
        if self.observer is not None and entry.state is BlockState.READY:
            self.observer.blocks_moved(entry.key[:HASH_BYTES], [entry.key[HASH_BYTES:]], from_tier, to_tier)

    def _removed(self, entry: BlockEntry, tier: str) -> None:
        if self.observer is not None and entry.state is BlockState.READY:
            self.observer.blocks_removed(entry.key[:HASH_BYTES], [entry.key[HASH_BYTES:]], tier)

    # -- tenancy: usage and quotas

    def _account(self, entry: BlockEntry, tier: str, nbytes: int) -> None:
        if entry.removed or entry.state is not BlockState.READY:
            return
        info = self._registry.get(entry.key[:HASH_BYTES])
        if info is not None:
            self._tenancy.add(info.tenant, tier, nbytes)

    def quota_exceeded(self, entry: BlockEntry, st: StoreTier) -> str:
        """Why one more copy of `entry` in `st` would take its tenant over quota; empty if not."""
        info = self._registry.get(entry.key[:HASH_BYTES]) if self._tenancy.quotas else None
        return self._tenancy.exceeded(info.tenant, st.name, entry.nbytes) if info is not None else ""

    def quota_incoming(self, entry: BlockEntry, st: StoreTier, nbytes: int) -> None:
        """Count (or, with a negative `nbytes`, stop counting) a copy on its way into `st`."""
        info = self._registry.get(entry.key[:HASH_BYTES])
        if info is not None:
            if nbytes > 0:
                self._tenancy.hold(info.tenant, st.name, nbytes)
            else:
                self._tenancy.release(info.tenant, st.name, -nbytes)
