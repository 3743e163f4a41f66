"""The store: engine verbs over the block index, the tiers and their policies.

A facade: `Store` builds its collaborators, one noun each, and answers the verbs with
them. Each module states the ordering decisions it keeps:

- kvstore.core.namespaces: `NamespaceRegistry`, layouts by id, the per-call limits;
- kvstore.core.copies: `CopyBook`, where each block's copies are, readers, accounting,
  events, replicas;
- kvstore.core.moves: `TierMoves`, verified moves, making room, demotion, promotion, and
  the operator's loops over them (prefetch, eviction, verification);
- kvstore.core.migration: `Migrator`, the periodic driver and the write-through writer;
- kvstore.core.put: `PutPath`, two-phase puts (publish after the data lands);
- kvstore.core.fetch: `FetchPath`, verified fetch streams (what is verified is what is
  sent), and the leased prefix a co-located reader reads itself;
- kvstore.core.groups: `GroupBook`, layouts with several KV groups, whose parts are
  stored, hit, published and dropped as one block;
- kvstore.core.index / table / leases / tenancy: the block table and what hangs off it;
- kvstore.core.types: the values, and `StoreCounters` (`counters`), whose lookup
  bookkeeping the servers and a pool's node call too.

Control plane on one event loop, no locks: every method either runs to completion
without awaiting (metadata) or holds the blocks it touches (pins for leases, `readers`
for reads and copies in flight) across its awaits, so eviction, migration and deletion
cannot pull bytes out from under it.

Tiers are ordered top (fastest) to bottom. The addressable tiers (HBM, host, memory)
hold a block exclusively among themselves; an inclusive tier (SSD), if any, is last
(kvstore.core.store_tier.check_tiers).

Every verb on named blocks starts with one prelude (`_enter`): the namespace must be
known (and its id well formed), the hashes within the per-call limit and 16 bytes each,
and leases past their deadline are expired. These checks are the core's own: they guard
its invariants whatever a server checked before.

Lease expiry has one owner, the store, and one rule: a lease ends at the first moment
after its deadline that anything reads pins, namely the prelude of every verb (and
`stats`, `evict_bytes`, `tenant_leases`), and each tick of the migrator, whose batches
depend on what is pinned. Nothing outside needs to sweep; `expire_leases` stays public
for a host that wants an idle store's pins released on its own schedule.

Verbs: `lookup`, `lease_prefix`, `begin_put`, `open_fetch`, `prefetch`, `delete`,
`pin`/`unpin`, `hint`/`end_session`, `verify`, `purge`, `evict_bytes`, `stats`; for a
cluster, `present` (a probe without a lookup's side effects) and `mark_replicas`;
`start`/`aclose` own the background tasks.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from kvstore.answers import PinResult, PrefetchResult
from kvstore.core.copies import CopyBook
from kvstore.core.fetch import FetchPath, FetchStream
from kvstore.core.groups import GroupBook, GroupedFetchStream, GroupedPutTxn
from kvstore.core.index import BlockEntry, BlockIndex, make_key
from kvstore.core.leases import Lease, LeaseTable
from kvstore.core.migration import Migrator
from kvstore.core.moves import TierMoves
from kvstore.core.namespaces import NamespaceRegistry, check_hint
from kvstore.core.put import PutPath, PutTxn
from kvstore.core.store_tier import PolicyDeferral, StoreTier, check_tiers
from kvstore.core.tenancy import TenantLedger
from kvstore.core.tier import BounceCopier, Copier, Slot, Tier
from kvstore.core.types import (
    BlockGroup,
    BlockInfo,
    BlockRef,
    MigrationConfig,
    MigrationStatus,
    NamespaceInfo,
    PrefixLookup,
    PutOutcome,
    RemovalResult,
    StoreCounters,
    StoreLimits,
    StoreObserver,
    StoreStatus,
    TierCounters,
    TierStatus,
    WritePolicy,
)
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.hashing import HASH_BYTES
from kvstore.layout import KVLayout

# The facade and the values its verbs take and return.
__all__ = [
    "BlockGroup", "BlockInfo", "BlockRef", "FetchStream", "PrefixLookup", "MigrationConfig", "MigrationStatus",
    "NamespaceInfo", "PinResult", "PolicyDeferral", "PrefetchResult", "PutOutcome", "PutTxn", "RemovalResult",
    "Store", "StoreCounters", "StoreLimits", "StoreObserver", "StoreStatus", "StoreTier", "TierCounters",
    "TierStatus", "WritePolicy", "check_hint",
]

logger = logging.getLogger(__name__)


def _bounce(src: Tier, dst: Tier) -> Copier:
    return BounceCopier()


class Store:
    """The verbs, over collaborators built here and exposed as attributes for inspection
    and as seams (`index`, `registry`, `copies`, `moves`, `migrator`, `puts`,
    `fetches`, `groups`, `counters`): servers call the verbs."""

    def __init__(
        self,
        tiers: Sequence[StoreTier],
        *,
        limits: StoreLimits | None = None,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
        migration: MigrationConfig | None = None,
        make_copier: Callable[[Tier, Tier], Copier] | None = None,
    ) -> None:
        """`make_copier` picks the copier for each pair of memory tiers (the data plane's
        choice, e.g. `kvstore.tiers.make_copier`); by default every pair bounces bytes
        through `read` and `write` (`BounceCopier`)."""
        check_tiers(tiers)
        self.tiers = list(tiers)
        self.memory_tiers = [t for t in self.tiers if t.tier.addressable]
        self.migration = migration or MigrationConfig()
        if self.migration.put_tier != "auto" and self.migration.put_tier not in {t.name for t in self.memory_tiers}:
            raise ValueError(f"put tier {self.migration.put_tier!r} is not one of this store's memory tiers")
        # Who applies the tiers' deferred policy calls (`PolicyDeferral`): one for the store.
        self.deferral = PolicyDeferral()
        for t in self.tiers:
            t.deferral = self.deferral
        self._limits = limits or StoreLimits()
        self._clock = clock
        self.counters = StoreCounters(tiers=tuple(st.counters for st in self.tiers))
        self.index = BlockIndex()
        table = self.index.table
        # Tier ids in the table follow the tier order, so the top copy is the lowest id.
        for st in self.tiers:
            table.tier_id(st.name)
            st.policy.bind(table)
        self._tier_id_names = tuple(table.tier_names)
        self._by_name = {t.name: t for t in self.tiers}
        # Payload bytes per tenant and tier, and quotas (set by the daemon from its token file).
        self.tenancy = TenantLedger()
        self.registry = NamespaceRegistry(self.index, self.tenancy, self._limits)
        self.copies = CopyBook(self.index, self.tiers, self.registry, self.tenancy, self.counters)
        self._leases = LeaseTable(self.copies.readers_gone)
        copiers = {
            (a.name, b.name): (make_copier or _bounce)(a.tier, b.tier)
            for a in self.memory_tiers
            for b in self.memory_tiers
            if a is not b
        }
        self.moves = TierMoves(self.index, self.copies, self.registry, self.tenancy, self.counters, self.tiers,
                               self.migration, copiers, executor)
        self.migrator = Migrator(self.index, self.copies, self.moves, self.counters, self.tiers, self.migration,
                                 self.expire_leases)
        self.puts = PutPath(self.index, self.registry, self.copies, self.moves, self.migrator, self.tenancy,
                            self.counters, self.tiers, executor)
        self.fetches = FetchPath(self.index, self.copies, self.moves, self.counters, self.tiers, self.migration,
                                 executor, self.unpin, self._acquire_lease)
        self.groups = GroupBook(self.index, self.puts, self.fetches, self.counters, self.tiers,
                                self._lease_for, self.unpin, self._listen)
        self.registry.on_adopted = self.groups.adopted
        # Bound once: the lookup path calls these on every request.
        self._namespace = self.registry.namespace
        self._check_hashes = self.registry.check_hashes
        self._packed_chain = self.registry.packed_chain
        self._expire = self._leases.expire
        self._prefix_rows = self.index.prefix_rows
        self._top_ids = self.index.top_ids
        self._closed = False

    def _enter(self, namespace_id: bytes, hashes: Sequence[bytes] | None = None) -> NamespaceInfo:
        """The prelude of every verb on named blocks (see the module docstring): the
        namespace's record, the hashes checked, expired leases released."""
        info = self._namespace(namespace_id)
        if hashes is not None:
            self._check_hashes(hashes)
        self._expire(self._clock())
        return info

    @property
    def limits(self) -> StoreLimits:
        return self._limits

    @limits.setter
    def limits(self, value: StoreLimits) -> None:
        """Replaced whole at runtime (SetConfig, SIGHUP): every later call sees the new limits."""
        self._limits = value
        self.registry.limits = value

    @property
    def observer(self) -> StoreObserver | None:
        """Told of blocks stored, moved and removed (the daemon's event bus); None by default."""
        return self.groups.inner

    @observer.setter
    def observer(self, observer: StoreObserver | None) -> None:
        # Once grouped namespaces exist, the group book hears removals first (a block's
        # parts leave together) and forwards every event.
        self.groups.inner = observer
        self.copies.observer = self.groups if self.groups.active else observer

    def _listen(self, book: StoreObserver | None) -> None:
        self.copies.observer = book

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Index the blocks the tiers recovered, then start the background work."""
        # A rebuild allocates an object or two per block, all long-lived: the cyclic
        # collector would rescan the growing index again and again. Paused while it runs;
        # afterwards the rebuilt index is frozen out of the collector's reach, since it
        # holds no cycles to collect.
        collecting = gc.isenabled()
        gc.disable()
        recovered = 0
        try:
            for st in self.tiers:
                report = await st.tier.recover()
                if report is not None:
                    recovered += self.copies.recovered(st, report)
        finally:
            if collecting:
                gc.enable()
        if recovered:
            gc.freeze()
        self.migrator.start()

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued SSD write has landed; False if `timeout_s` passed first."""
        return await self.migrator.flush(timeout_s)

    async def aclose(self, flush_timeout_s: float | None = 30.0) -> None:
        """Graceful stop: flush pending SSD writes, stop background tasks, close tiers."""
        if self._closed:
            return
        if self.migrator.running and not await self.flush(flush_timeout_s):
            logger.warning("shutdown: %d SSD writes still pending after %.1fs; they are lost",
                           self.pending_ssd_writes, flush_timeout_s or 0.0)
        await self.migrator.stop()
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.migrator.cancel()
        for st in self.tiers:
            st.tier.close()

    @property
    def indexed_blocks(self) -> int:
        """READY blocks in the index (each counted once, whatever tiers hold it)."""
        return len(self.index)

    @property
    def pending_ssd_writes(self) -> int:
        return self.migrator.pending_writes

    # ----------------------------------------------------------------- namespaces

    def register(self, layout: KVLayout, tenant: str = "default", salt: bytes = b"") -> bytes:
        """Record a layout for `tenant`; returns its namespace id (salted by `salt`). Idempotent."""
        if layout.groups:
            self.groups.activate()
        return self.registry.register(layout, tenant, salt)

    def prepare_namespace(self, layout: KVLayout, tenant: str = "default", salt: bytes = b"") -> NamespaceInfo:
        """The record a put of `layout` works with (`begin_put` takes it): the registered
        one, or a new one filed only when the put publishes. ResourceExhausted when it is
        new and `max_namespaces` are held."""
        return self.registry.prepare(layout, tenant, salt)

    def has_namespace(self, namespace_id: bytes) -> bool:
        return self.registry.has(namespace_id)

    def has_recovered(self, namespace_id: bytes, layout: KVLayout | None = None) -> bool:
        """Whether the index holds blocks of this unregistered namespace, recovered from
        SSD: a read of its layout registers it to adopt them (`register`). Give the
        `layout` for a grouped one (its parts are filed under its groups' ids)."""
        return self.registry.awaits_adoption(namespace_id, layout)

    def namespace(self, namespace_id: bytes) -> NamespaceInfo:
        return self.registry.namespace(namespace_id)

    def namespaces(self) -> list[NamespaceInfo]:
        return self.registry.all()

    def hashes_for_tokens(self, namespace_id: bytes, packed_tokens: bytes, max_blocks: int | None = None) -> list[bytes]:
        """Block hashes of tokens packed as little-endian u32 (at most `max_blocks` blocks)."""
        return self.registry.hashes_for_tokens(namespace_id, packed_tokens, max_blocks)

    def chain_for_tokens(self, namespace_id: bytes, packed_tokens: bytes, max_blocks: int | None = None) -> bytes:
        """`hashes_for_tokens` as one packed chain (N x 16 bytes), the form a lookup probes."""
        return self.registry.chain_for_tokens(namespace_id, packed_tokens, max_blocks)

    def check_hashes(self, hashes: Sequence[bytes]) -> None:
        """The per-call limit and the hash size, checked as every verb checks them."""
        self.registry.check_hashes(hashes)

    # ----------------------------------------------------------------- lookup

    def lookup(self, namespace_id: bytes, hashes: Sequence[bytes] | bytes, lease_ms: int = 0,
               count: bool = True) -> PrefixLookup:
        """The longest READY prefix of a chain, given as hashes or packed (N x 16 bytes:
        what the wire carries, probed without cutting it into N objects). `count=False`:
        the lookup's blocks are counted by the caller (`counters.count_lookup`), once it
        knows what it answered (a pool's node adds what other nodes hold); the tiers'
        counts are the store's own either way (a pool's node moves the blocks it holds past
        the prefix from misses to hits: `counters.count_past_prefix`)."""
        info = self._enter(namespace_id)
        packed = self._packed_chain(hashes)
        if info.groups:
            return self.groups.lookup(info, packed, lease_ms, count)
        n_asked = len(packed) // HASH_BYTES
        # One vectorized probe of the block table, no Python step (nor object) per block.
        rows = self._prefix_rows(namespace_id, packed)
        n_hit = len(rows)
        lease_id = ""
        if n_hit and lease_ms > 0:
            lease_id = self._acquire_lease(rows, lease_ms, tenant=info.tenant).lease_id
        if count:
            self.counters.count_lookup(info, n_asked, n_hit)
        # Where each block is served from: its top copy (tier ids follow the tier order).
        tops = self._top_ids(rows)
        tier_ids = tops.tobytes()
        tail_first = rows[::-1]
        tops_tail_first = tops[::-1]
        served = self.counters.count_tiers(tier_ids, n_asked)
        for tid, st in enumerate(self.tiers, start=1):
            held = served[tid - 1]
            if held:
                # Tail first, so the head of a chain is the most recently used: a recency
                # policy then evicts chain tails before the heads later blocks depend on.
                st.defer_touch(tail_first if held == n_hit else tail_first[tops_tail_first == tid])
        return PrefixLookup(
            namespace_id=namespace_id,
            num_blocks=n_hit,
            block_size_tokens=info.layout.block_size_tokens,
            tier_ids=tier_ids,
            tier_names=self._tier_id_names,
            hashes_packed=packed[: n_hit * HASH_BYTES],
            lease_id=lease_id,
        )

    # The byte `present` answers for a block that is not held.
    ABSENT = 255

    @property
    def tier_id_names(self) -> tuple[str, ...]:
        """Tier id -> tier name, for `PrefixLookup.tier_ids` and `present`."""
        return self._tier_id_names

    def present(self, namespace_id: bytes, packed: bytes) -> bytes:
        """Which of the named blocks (N x 16-byte hashes, not necessarily a chain's prefix)
        are held: one byte per block, its top tier id, or `ABSENT`. A probe without a
        lookup's side effects (no counters, touches or leases): a cluster asks it of the
        units past a lookup's local prefix, in one vectorized step."""
        self._enter(namespace_id)
        if len(packed) % HASH_BYTES:
            raise InvalidArgument(f"a packed chain is a multiple of {HASH_BYTES} bytes, got {len(packed)}")
        rows = self.index.find_packed(namespace_id, packed)
        out = np.full(len(rows), self.ABSENT, np.uint8)
        found = rows >= 0
        if found.any():
            out[found] = self._top_ids(rows[found])
        return out.tobytes()

    def mark_replicas(self, namespace_id: bytes, hashes: Sequence[bytes]) -> int:
        """Hold the named blocks as replicas: copies of blocks another daemon of a pool
        owns. Each becomes one of the first victims of the memory tier it is in
        (`StoreTier.replicas`), is dropped rather than demoted, and is not written through
        to SSD. Returns how many were present (in a memory tier).

        One vectorized probe of the block table, then `mark_replica_rows`: a put on a
        node of a pool marks the blocks of every unit it forwards (hundreds), before the
        engine's commit is answered."""
        self._enter(namespace_id, hashes)
        if not hashes:
            return 0
        rows = self.index.find_packed(namespace_id, b"".join(hashes))
        return self.mark_replica_rows(rows[rows >= 0])

    def mark_replica_rows(self, rows: Sequence[int] | np.ndarray[Any, Any]) -> int:
        """`mark_replicas` of blocks a put just published (`PutTxn.stored_rows`), by their
        rows: a block with one copy (a put's) is marked in the tier of that copy without
        a lookup per block (`CopyBook.mark_replicas`). Returns how many were marked."""
        return self.copies.mark_replicas(rows)

    def block(self, namespace_id: bytes, block_hash: bytes) -> BlockInfo | None:
        """A snapshot of one READY block's metadata; None if it is not in the store."""
        entry = self.index.get(make_key(namespace_id, block_hash))
        if entry is None:
            return None
        return self.copies.block_info(entry)

    def top_tier(self, entry: BlockEntry) -> StoreTier | None:
        """The highest tier holding a copy of `entry` (where reads are served from)."""
        return self.copies.top_tier(entry)

    # ----------------------------------------------------------------- put

    def begin_put(
        self, namespace: bytes | NamespaceInfo, hashes: Sequence[bytes], parent_hash: bytes | None = None,
        tier: str | None = None, window_bytes: int | None = None, runs: Sequence[tuple[int, bytes | None]] = (),
    ) -> PutTxn:
        """Start a two-phase put of `hashes` (in chain order). Use as `async with`.

        `namespace`: a registered namespace's id, or a record from `prepare_namespace`
        (filed when the put publishes, so a refused put registers nothing).
        `tier` names the memory tier the new blocks land in (default: `put_tier`).
        `window_bytes`: reserve slots as the chunks arrive, at most this many bytes ahead
        of them, instead of all at once (`PutPath.begin`).
        `runs`: `hashes` are runs of one chain laid end to end, these (position, parent
        hash) starting the runs after the first (`PutPath.begin`).
        A grouped namespace's blocks travel as parts: put them with `begin_stream_put`.
        """
        info = self._put_namespace(namespace, hashes)
        if info.groups:
            raise FailedPrecondition("a layout with KV groups is put as gRPC bytes (Put), not through shared "
                                     "memory or the device plane")
        return self.puts.begin(info, hashes, parent_hash, tier, window_bytes, runs)

    def begin_stream_put(
        self, namespace: bytes | NamespaceInfo, hashes: Sequence[bytes], parent_hash: bytes | None = None,
        tier: str | None = None, window_bytes: int | None = None, spans: Sequence[tuple[int, int, int]] = (),
    ) -> PutTxn | GroupedPutTxn:
        """`begin_put` of a put whose bytes arrive as a stream of wire blocks (the Put
        RPC): a block each, or for a grouped namespace its parts, group-major
        (`GroupedPutTxn`, published all together; `spans`: the parts named, not the hit
        rules', `GroupBook.begin_put`)."""
        info = self._put_namespace(namespace, hashes)
        if info.groups:
            return self.groups.begin_put(info, hashes, parent_hash, tier, window_bytes, spans)
        if spans:
            raise InvalidArgument("group_spans is for a layout with KV groups; this one has none")
        return self.puts.begin(info, hashes, parent_hash, tier, window_bytes)

    def _put_namespace(self, namespace: bytes | NamespaceInfo, hashes: Sequence[bytes]) -> NamespaceInfo:
        if isinstance(namespace, NamespaceInfo):
            self._check_hashes(hashes)
            self._expire(self._clock())
            return namespace
        return self._enter(namespace, hashes)

    async def reserve_slots(self, tier: str, nbytes: int, count: int, space: int = 0) -> list[Slot]:
        """`count` empty slots of `nbytes` in memory tier `tier` (in `space`), bound to no
        block yet: a co-located client fills them ahead of the put that names them
        (`PutTxn.adopt`). The caller frees what it does not adopt (`free_slots`)."""
        return await self.puts.reserve_slots(tier, nbytes, count, space)

    def free_slots(self, slots: Sequence[Slot]) -> None:
        """Return reserved, never-published slots to their tiers."""
        self.puts.free_slots(slots)

    def make_room_soon(self, tier: str, nbytes: int, block_bytes: int) -> None:
        """Evict from memory tier `tier` in the background until `nbytes` of it are free:
        room for a put that is expected next (`Migrator.make_room_soon`)."""
        self.migrator.make_room_soon(tier, nbytes, block_bytes)

    async def migrate_once(self, st: StoreTier) -> MigrationStatus:
        """Demote at most `batch_blocks` victims of `st` if it is over its high watermark."""
        return await self.migrator.migrate_once(st)

    # ----------------------------------------------------------------- fetch, prefetch

    def open_fetch(self, namespace_id: bytes, hashes: Sequence[bytes],
                   lease_id: str = "", group: str = "") -> FetchStream | GroupedFetchStream:
        """Plan a fetch of the longest present prefix of `hashes`; use as `async with`
        (`FetchPath.open`). `lease_id`, if given, is released when the stream closes.
        A grouped namespace's fetch streams the parts of its longest hit (`GroupBook`),
        or with `group` that group's parts of the leading run that holds one."""
        info = self._enter(namespace_id, hashes)
        if group:
            if not info.groups:
                raise InvalidArgument("FetchRequest.group is for a layout with KV groups; this one has none")
            return self.groups.open_group_fetch(info, group, hashes, lease_id)
        if info.groups:
            return self.groups.open_fetch(info, hashes, lease_id)
        return self.fetches.open(info, hashes, lease_id)

    async def prefetch(self, namespace_id: bytes, hashes: Sequence[bytes], tier: str = "") -> PrefetchResult:
        """Raise the named blocks that are present into `tier` (default: the top tier)."""
        info = self._enter(namespace_id, hashes)
        target = self._by_name[self.prefetch_target(tier)]
        self.counters.prefetches += 1
        if not info.groups:
            return await self.moves.prefetch(namespace_id, hashes, target)
        results = [await self.moves.prefetch(part_id, hashes, target) for part_id in self.groups.part_ids(info)]
        return PrefetchResult(target.name, *(sum(getattr(r, k) for r in results)
                                             for k in ("requested", "raised", "already", "missing", "skipped")))

    def prefetch_target(self, tier: str = "") -> str:
        """The memory tier a prefetch into `tier` raises blocks into (default: the top one)."""
        target = self._by_name.get(tier) if tier else self.memory_tiers[0]
        if target is None or not target.tier.addressable:
            names = ", ".join(t.name for t in self.memory_tiers)
            raise InvalidArgument(f"prefetch target tier {tier!r} is not a memory tier of this daemon; use one of {names}")
        return target.name

    # ----------------------------------------------------------------- delete, pins, hints

    def delete(self, namespace_id: bytes, hashes: Sequence[bytes]) -> int:
        """Remove the named blocks, leased or not (an explicit delete wins over a lease)."""
        info = self._enter(namespace_id, hashes)
        if info.groups:
            deleted = self.groups.delete(info, hashes)
        else:
            deleted = 0
            for h in hashes:
                entry = self.index.get(make_key(namespace_id, h))
                if entry is not None:
                    self.copies.drop(entry)
                    deleted += 1
        self.counters.deletes += deleted
        return deleted

    def pin(self, namespace_id: bytes, hashes: Sequence[bytes], ttl_ms: int = 0) -> PinResult:
        """Pin every named block that is present (not only a prefix) for `ttl_ms`."""
        info = self._enter(namespace_id, hashes)
        ttl = ttl_ms or self._limits.default_pin_ms
        part_ids = self.groups.part_ids(info)
        entries = [e for i in part_ids for h in hashes if (e := self.index.get(make_key(i, h))) is not None]
        if not entries:
            return PinResult("", 0, 0)
        lease = self._acquire_lease(np.array([e.row for e in entries], np.int64), ttl, tenant=info.tenant)
        pinned = len(entries) if len(part_ids) == 1 else len({e.key[HASH_BYTES:] for e in entries})
        return PinResult(lease.lease_id, pinned, min(ttl, self._limits.max_lease_ms))

    def lease_prefix(
        self, namespace_id: bytes, hashes: Sequence[bytes] | bytes, ttl_ms: int, tier: str
    ) -> tuple[PrefixLookup, list[int], list[int]]:
        """The fetch of a co-located reader: the READY prefix of `hashes` (given one by one
        or packed, as `lookup` takes them), plus a bytes-holding lease on its leading run
        of blocks in `tier`, with their offsets in that tier and their checksums.

        The returned slots stay valid (never freed or reused) until the lease is released
        or expires, even if the blocks are deleted meanwhile. Counted as a fetch of the
        leased blocks, like `open_fetch`; blocks past the run are fetched separately.
        Like `lookup`, one probe of the chain and array steps over its rows: no object
        or Python step per block beyond the lease's hold on each. A grouped namespace's
        parts are leased all or none (`GroupBook.lease_prefix`).
        """
        info = self._enter(namespace_id)
        if info.groups:
            return self.groups.lease_prefix(info, self._packed_chain(hashes), ttl_ms, tier)
        return self.fetches.lease_prefix(info, self._packed_chain(hashes), ttl_ms, tier)

    async def verify(self, namespace_id: bytes, hashes: Sequence[bytes]) -> tuple[int, int]:
        """Re-check the named blocks against their checksums; drop and count the bad ones.

        Returns (verified, dropped). A client that saw a mismatch asks for this: the
        daemon does not take the client's word, it looks for itself. A grouped
        namespace's blocks count per part.
        """
        info = self._enter(namespace_id, hashes)
        return await self.moves.verify([e for i in self.groups.part_ids(info) for h in hashes
                                        if (e := self.index.get(make_key(i, h))) is not None])

    def hint(self, namespace_id: bytes, hashes: Sequence[bytes], session_id: str, expect_reuse_within_s: float,
             *, carried_by: str = "") -> int:
        """Tell each tier's policy that `session_id` will reuse the named blocks soon.

        Only blocks present are hinted; returns how many. Policies without hint support
        ignore it, so a hint never changes correctness, only what is evicted first.
        `carried_by` ("lookup" or "put") counts the request the hint came with.
        """
        check_hint(session_id, expect_reuse_within_s)
        self.count_hint(carried_by)
        info = self._enter(namespace_id, hashes)
        by_tier: dict[str, list[bytes]] = {}
        present = 0
        for h in hashes:
            held = False
            for part_id in self.groups.part_ids(info):
                entry = self.index.get(make_key(part_id, h))
                if entry is not None:
                    held = True
                    for name in entry.locations:  # every copy is protected where it lives
                        by_tier.setdefault(name, []).append(entry.key)
            present += held
        for name, keys in by_tier.items():
            self._by_name[name].policy.hint(keys, session_id, expect_reuse_within_s)
        return present

    def count_hint(self, carried_by: str) -> None:
        """Count a lookup or a put that carried a session hint (`StoreCounters.hinted_*`)."""
        if carried_by == "lookup":
            self.counters.hinted_lookups += 1
        elif carried_by == "put":
            self.counters.hinted_puts += 1

    def end_session(self, session_id: str) -> None:
        """Release the protection every tier holds for `session_id`."""
        check_hint(session_id, 1.0)
        self.counters.sessions_ended += 1
        for st in self.tiers:
            st.policy.end_session(session_id)

    def open_lease(self, namespace_id: bytes, ttl_ms: int) -> str:
        """A lease on no block yet, counted against the namespace's tenant: a pool's lookup
        whose answer lies on other nodes takes it, and the blocks copied here for it are
        added as they land (`lease_more`)."""
        info = self._enter(namespace_id)
        return self._acquire_lease(np.empty(0, np.int64), ttl_ms, tenant=info.tenant).lease_id

    def lease_more(self, lease_id: str, rows: np.ndarray[Any, Any]) -> bool:
        """Pin `rows` (blocks just published) under a lease still held, until it ends;
        False when it has ended already (the fetch it was for came and went)."""
        return self._leases.extend(lease_id, rows)

    def lease_held(self, lease_id: str, namespace_id: bytes, packed: bytes) -> bool:
        """`lease_more` for those of the named blocks (N x 16-byte hashes) held here now."""
        rows = self.index.find_packed(namespace_id, packed)
        return self._leases.extend(lease_id, rows[rows >= 0])

    def unpin(self, lease_id: str) -> bool:
        return self._leases.release(lease_id) is not None

    def _lease_for(self, rows: np.ndarray[Any, Any], ttl_ms: int, tenant: str) -> str:
        return self._acquire_lease(rows, ttl_ms, tenant=tenant).lease_id

    def _acquire_lease(
        self, rows: np.ndarray[Any, Any], ttl_ms: int, holds_bytes: bool = False, tenant: str = "default"
    ) -> Lease:
        return self._leases.grant(self.index.table, rows, ttl_ms, self._clock(), self._limits, holds_bytes, tenant)

    def tenant_leases(self, tenant: str) -> int:
        """How many leases `tenant` has active (expired ones are dropped first)."""
        self.expire_leases()
        return self._leases.held(tenant)

    def expire_leases(self) -> int:
        """Release the leases past their deadline now; how many (see the module docstring)."""
        return self._expire(self._clock())

    def expire_namespaces(self) -> int:
        """Forget the namespaces that have held no block for `limits.namespace_grace_s`
        (none when it is None); how many. A host calls it on its own schedule (the
        daemon's sweep, every second); it looks at the namespaces at most every few
        seconds (`NamespaceRegistry.expire`)."""
        return self.registry.expire(self._clock())

    # ----------------------------------------------------------------- operator verbs

    def purge(self, namespace_id: bytes | None = None) -> RemovalResult:
        """Remove every block (of one namespace, if given), leased or not, like `delete`.
        The operator's `kvstore flush`."""
        ids: set[bytes] = set()
        if namespace_id is not None:
            ids.update(self.groups.part_ids(self._enter(namespace_id)))
        else:
            self.expire_leases()
        doomed = [e for e in self.index if namespace_id is None or e.key[:HASH_BYTES] in ids]
        for entry in doomed:
            self.copies.drop(entry)
        self.counters.deletes += len(doomed)
        if doomed:
            logger.info("purged %d blocks%s", len(doomed), f" of namespace {namespace_id.hex()}" if namespace_id else "")
        return RemovalResult(len(doomed), sum(e.nbytes for e in doomed))

    async def evict_bytes(self, tier: str, nbytes: int) -> RemovalResult:
        """Make room in `tier`, in its policy's order, until `nbytes` are freed or nothing
        evictable is left: memory tiers demote their victims (the last tier drops them),
        the SSD tier reclaims whole regions. Pinned and in-use blocks stay."""
        st = self._by_name.get(tier)
        if st is None:
            raise InvalidArgument(f"no tier named {tier!r} in this daemon; tiers: {', '.join(self._by_name)}")
        if nbytes < 0:
            raise InvalidArgument(f"bytes to evict must be >= 0, got {nbytes}")
        self.expire_leases()
        result = await self.moves.evict_bytes(st, nbytes)
        logger.info("operator eviction from %s: %d blocks, %d bytes", tier, result.blocks, result.removed_bytes)
        return result

    def namespace_blocks(self, namespace_id: bytes) -> list[BlockRef]:
        """Every READY block of a namespace, parents before children, chains consecutive
        (depth-first from each root), so the list replays as chained puts. A grouped
        namespace lists each block once, whichever of its parts it holds."""
        return self.index.chains(set(self.groups.part_ids(self._enter(namespace_id))))

    def part_masks(self, namespace_id: bytes, hashes: Sequence[bytes]) -> list[int]:
        """A grouped namespace's blocks: per block, the groups that hold a part (bit g)."""
        return self.groups.part_masks(self._enter(namespace_id), hashes)

    def block_groups(self) -> list[BlockGroup]:
        """Every READY block, grouped by namespace and the tier it is served from (a
        point-in-time snapshot)."""
        return self.copies.block_groups()

    # ----------------------------------------------------------------- stats

    def stats(self) -> StoreStatus:
        self.expire_leases()
        inclusive = self.moves.inclusive
        return StoreStatus(
            tiers=[st.status(self.pending_ssd_writes if st is inclusive else 0) for st in self.tiers],
            counters=self.counters.snapshot(),
            namespaces=len(self.registry),
            leases_active=len(self._leases),
        )

    # ----------------------------------------------------------------- chains (for a cluster)

    def ancestor(self, namespace_id: bytes, block_hash: bytes, steps: int) -> bytes | None:
        """The hash `steps` parents above a block (0: itself) through the blocks held here,
        None past them: a probe without side effects, as `present` (`BlockIndex.ancestor`)."""
        return self.index.ancestor(namespace_id, block_hash, steps)

    def chain_position(self, namespace_id: bytes, block_hash: bytes, max_position: int) -> int | None:
        """A block's position in its chain (0: the first) from the parents held here, None
        where one is missing or past `max_position` (`BlockIndex.chain_position`)."""
        return self.index.chain_position(namespace_id, block_hash, max_position)
