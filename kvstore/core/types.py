"""The store's values: limits and configuration, counters, namespace records, the
results of its verbs, and the observer it tells of block events.

Plain data, no behaviour beyond derived properties and the counters' own bookkeeping
(`StoreCounters.count_lookup` and its kin: the store's lookups call them, and so do the
servers and a pool's node, on `Store.counters`): every collaborator of the store
(kvstore.core.store and the modules it is built from) and the server that renders these
values import them from here, without importing the store.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvstore.core.tier import Slot
from kvstore.hashing import split_hashes
from kvstore.layout import KVLayout


class WritePolicy(enum.Enum):
    THROUGH = "through"  # every published block is also written to SSD, in the background
    BACK = "back"  # a block reaches SSD only when it is demoted


class MigrationStatus(enum.Enum):
    OK = "ok"  # the tier is under its low watermark (or was never over the high one)
    RUNNING = "running"  # a batch moved blocks; more remain above the low watermark
    FAIL = "fail"  # over the watermark but nothing is evictable (all pinned or moving)



@dataclass(frozen=True, slots=True)
class StoreLimits:
    max_blocks_per_call: int = 4096
    max_namespaces: int = 4096
    max_leases: int = 65536
    # Most leases one tenant may hold at once (None: only `max_leases` applies).
    max_leases_per_tenant: int | None = None
    max_lease_ms: int = 600_000
    default_pin_ms: int = 30_000
    # A namespace that held no block this long is forgotten (None: never).
    namespace_grace_s: float | None = None


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    """How blocks move between tiers."""

    write_policy: WritePolicy = WritePolicy.THROUGH
    # Where puts land: "auto" = the highest addressable tier with room, else a tier name.
    put_tier: str = "auto"
    promote_on_hit: bool = True
    batch_blocks: int = 64
    tick_s: float = 0.05


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    promotions: int = 0  # blocks copied into this tier from a lower one
    demotions: int = 0  # blocks moved from this tier to a lower one
    drops: int = 0  # blocks that left the store from this tier (their last copy)

    def snapshot(self) -> TierCounters:
        return replace(self)


@dataclass(slots=True)
class StoreCounters:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    puts: int = 0
    put_failures: int = 0
    blocks_stored: int = 0
    blocks_existing: int = 0
    bytes_in: int = 0
    fetches: int = 0
    blocks_fetched: int = 0
    bytes_out: int = 0
    deletes: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    prefetches: int = 0
    ssd_write_failures: int = 0
    # The parts of bytes_in / bytes_out that moved through the shared-memory plane
    # (the rest went as gRPC bytes); metrics label throughput by plane with them.
    local_bytes_in: int = 0
    local_bytes_out: int = 0
    # Layouts with KV groups (kvstore.core.groups): parts stored, the bytes the hit rules
    # did not need to store (a put's parts outside every window, states before its end),
    # and parts dropped because a sibling part of their block left the store.
    group_parts_stored: int = 0
    group_bytes_skipped: int = 0
    group_parts_dropped: int = 0
    # Session hints (docs/policies.md): lookups and puts that carried one, and sessions
    # ended; what engines' per-request hints reach the store as.
    hinted_lookups: int = 0
    hinted_puts: int = 0
    sessions_ended: int = 0
    # The store's tiers' counters, top first (tier id i + 1 is tiers[i]): where a lookup's
    # hits and misses per tier go. Not part of a snapshot.
    tiers: tuple[TierCounters, ...] = field(default=(), repr=False, compare=False)

    def count_lookup(self, info: NamespaceInfo | None, asked: int, hit: int) -> None:
        """A lookup in `info`'s namespace: `hit` of its `asked` blocks found. Nothing for
        None: a lookup counted by its caller once it knew what it answered (a pool's
        node, `Store.lookup(count=False)`), whose namespace has been forgotten since."""
        if info is None:
            return
        self.lookups += 1
        info.lookup_blocks += asked
        info.hit_blocks += hit
        self.lookup_blocks += asked
        self.hit_blocks += hit
        self.miss_blocks += asked - hit

    def count_tiers(self, tier_ids: bytes, asked: int) -> list[int]:
        """A lookup's blocks in each tier (`tier_ids`: the top tier id of each block it
        answered, one byte each): a tier's hits are the blocks served from it, its misses
        the rest of the `asked`. How many each tier served, top first."""
        served = []
        for tid, tc in enumerate(self.tiers, start=1):
            held = tier_ids.count(tid)
            tc.hits += held
            tc.misses += asked - held
            served.append(held)
        return served

    def count_past_prefix(self, tier_ids: bytes) -> None:
        """Blocks a pool's node answered past its local prefix (one byte per block: a top
        tier id as `Store.present` gives it, `Store.ABSENT` for a block found elsewhere):
        each one held here moves from its tier's misses, where `Store.lookup` counted it
        once the prefix ended, to that tier's hits, as a block of the prefix would be
        counted."""
        for tid, tc in enumerate(self.tiers, start=1):
            held = tier_ids.count(tid)
            if held:
                tc.hits += held
                tc.misses -= held

    def count_unknown_lookup(self, asked: int) -> None:
        """A lookup of a layout the store holds nothing of (the server answers it without
        registering one): counted as a lookup whose every block missed, in every tier."""
        self.lookups += 1
        self.lookup_blocks += asked
        self.miss_blocks += asked
        for tc in self.tiers:
            tc.misses += asked

    def snapshot(self) -> StoreCounters:
        """The counts now, without the tiers' counters (what `StoreStatus` carries)."""
        return replace(self, tiers=())


@dataclass(slots=True, eq=False)
class NamespaceInfo:
    namespace_id: bytes
    layout: KVLayout
    # The owner, and the public id that starts its hash chains (the namespace id itself
    # for the default tenant; see kvstore.hashing.tenant_namespace_id).
    tenant: str = "default"
    chain_seed: bytes = b""
    blocks: int = 0
    bytes: int = 0
    # Which engines get value from the cache: per-namespace block hit ratio for operators.
    lookup_blocks: int = 0
    hit_blocks: int = 0
    # A layout with KV groups: one record per group (each a namespace of its own, filed
    # under kvstore.hashing.group_namespace_id), each naming the layout's record back.
    groups: tuple[NamespaceInfo, ...] = ()
    group_of: NamespaceInfo | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    namespace_id: bytes
    num_blocks: int
    block_size_tokens: int
    tier_ids: bytes  # each hit's top tier, one byte per block: an index into `tier_names`
    tier_names: tuple[str, ...]  # tier id -> name
    hashes_packed: bytes  # the hits' hashes, 16 bytes each, in chain order
    lease_id: str

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size_tokens

    @property
    def tiers(self) -> list[str]:
        """Each hit's tier by name (where it is served from: its top copy)."""
        ids, names = self.tier_ids, self.tier_names
        if ids and ids.count(ids[:1]) == len(ids):  # one tier: the common case
            return [names[ids[0]]] * len(ids)
        return [names[i] for i in ids]

    @property
    def block_hashes(self) -> list[bytes]:
        return split_hashes(self.hashes_packed)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """A snapshot of one READY block's metadata, for operators and diagnostics."""

    tier: str
    slot: Slot
    nbytes: int
    checksum: int
    pins: int
    tiers: list[str] = field(default_factory=list)  # every tier holding a copy, top first


@dataclass(frozen=True, slots=True)
class PutOutcome:
    namespace_id: bytes
    stored: int
    existing: int
    block_hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class TierStatus:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    policy: str
    counters: TierCounters
    facts: dict[str, str]
    pending_writes: int = 0


@dataclass(frozen=True, slots=True)
class RemovalResult:
    blocks: int
    removed_bytes: int


@dataclass(frozen=True, slots=True)
class BlockRef:
    block_hash: bytes
    parent_hash: bytes  # b"" for the first block of a chain


@dataclass(frozen=True, slots=True)
class BlockGroup:
    """Blocks of one namespace in one tier (what a resyncing event consumer reloads)."""

    namespace_id: bytes
    tier: str
    block_hashes: tuple[bytes, ...]


class StoreObserver(Protocol):
    """Told synchronously, on the loop, when blocks appear, leave or change tier; must not block.

    `blocks_stored` when blocks become READY, `blocks_removed` when a block leaves the
    daemon (its last copy), `blocks_moved` when migration moves a block between tiers.
    """

    def blocks_stored(self, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str) -> None: ...

    def blocks_removed(self, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str) -> None: ...

    def blocks_moved(self, namespace_id: bytes, block_hashes: Sequence[bytes], from_tier: str, to_tier: str) -> None: ...


@dataclass(frozen=True, slots=True)
class StoreStatus:
    tiers: list[TierStatus]
    counters: StoreCounters
    namespaces: int
    leases_active: int
