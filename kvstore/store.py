"""The store: index, namespaces, leases, tiers and policies behind engine verbs.

Control plane on one event loop, no locks: every method either runs to completion
without awaiting (metadata) or holds the blocks it touches (pins for leases, `readers`
for reads in flight) across its awaits, so eviction and deletion cannot pull bytes out
from under it.

Verbs: `lookup`, `put` (a two-phase `PutTxn`), `fetch`, `delete`, `pin`/`unpin`, `stats`.

Ordering decisions that matter:
- Publish after the data lands. A put allocates PENDING slots, receives every byte,
  checksums them, and only then adds all its blocks to the index in one synchronous
  step. A failed or cancelled put frees its slots; nothing was ever visible.
- Read-your-writes. `PutTxn.commit` returns only after the index holds the blocks, so a
  lookup from any client that starts after the put returned sees them.
- Never serve a wrong block. Fetch copies a block out of its tier, then verifies the copy
  against the checksum taken at put time; a mismatch drops the block, counts it, and ends
  the fetch there (prefix semantics: nothing after a missing block is useful).
- Re-putting a READY block is a no-op that accounts nothing twice.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from kvstore.checksum import checksum_batch
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvstore.hashing import HASH_BYTES, block_hashes_packed
from kvstore.index import BlockEntry, BlockIndex, BlockState, make_key
from kvstore.layout import KVLayout
from kvstore.leases import Lease, LeaseTable
from kvstore.policies import EvictionPolicy
from kvstore.tiers.base import Slot, Tier

logger = logging.getLogger(__name__)

# Fetch reads and verifies blocks in batches of about this many bytes: large enough to
# amortize the thread hand-off of checksumming, small enough to bound memory per call.
FETCH_BATCH_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoreLimits:
    max_blocks_per_call: int = 4096
    max_namespaces: int = 4096
    max_leases: int = 65536
    max_lease_ms: int = 600_000
    default_pin_ms: int = 30_000


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    checksum_failures: int = 0


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


@dataclass(slots=True, eq=False)
class StoreTier:
    """A tier as the control plane sees it: bytes (`tier`), order (`policy`), counters."""

    tier: Tier
    policy: EvictionPolicy
    counters: TierCounters = field(default_factory=TierCounters)

    @property
    def name(self) -> str:
        return self.tier.name


@dataclass(slots=True, eq=False)
class NamespaceInfo:
    namespace_id: bytes
    layout: KVLayout
    blocks: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class LookupResult:
    namespace_id: bytes
    num_blocks: int
    block_size_tokens: int
    tiers: list[str]
    block_hashes: list[bytes]
    lease_id: str

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size_tokens


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """A snapshot of one READY block's metadata, for operators and diagnostics."""

    tier: str
    slot: Slot
    nbytes: int
    checksum: int
    pins: int


@dataclass(frozen=True, slots=True)
class PutResult:
    namespace_id: bytes
    stored: int
    existing: int
    block_hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class PinResult:
    lease_id: str
    pinned: int
    expires_in_ms: int


@dataclass(frozen=True, slots=True)
class TierStatus:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    policy: str
    counters: TierCounters
    facts: dict[str, str]


@dataclass(frozen=True, slots=True)
class StoreStatus:
    tiers: list[TierStatus]
    counters: StoreCounters
    namespaces: int
    leases_active: int


class Store:
    def __init__(
        self,
        tiers: Sequence[StoreTier],
        *,
        limits: StoreLimits | None = None,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = list(tiers)
        self.limits = limits or StoreLimits()
        self.counters = StoreCounters()
        self._executor = executor
        self._clock = clock
        self._index = BlockIndex()
        self._leases = LeaseTable(self._end_read)
        self._namespaces: dict[bytes, NamespaceInfo] = {}
        self._tier_by_name = {t.name: t for t in self.tiers}

    # ----------------------------------------------------------------- namespaces

    def register(self, layout: KVLayout) -> bytes:
        """Record a layout; returns its namespace id. Idempotent."""
        ns_id = layout.namespace_id
        if ns_id not in self._namespaces:
            if len(self._namespaces) >= self.limits.max_namespaces:
                raise ResourceExhausted(
                    f"the daemon already holds {self.limits.max_namespaces} namespaces; "
                    "flush unused ones or raise max_namespaces"
                )
            self._namespaces[ns_id] = NamespaceInfo(ns_id, layout)
            logger.info("namespace %s registered: model=%s dtype=%s block=%d tokens / %d bytes",
                        ns_id.hex(), layout.model, layout.dtype, layout.block_size_tokens, layout.bytes_per_block)
        return ns_id

    def namespace(self, namespace_id: bytes) -> NamespaceInfo:
        if len(namespace_id) != HASH_BYTES:
            raise InvalidArgument(f"namespace id must be {HASH_BYTES} bytes, got {len(namespace_id)}")
        info = self._namespaces.get(namespace_id)
        if info is None:
            raise NotFound(
                f"namespace {namespace_id.hex()} is not known to this daemon; "
                "send the full layout instead of its id (the daemon forgets namespaces on restart)"
            )
        return info

    def namespaces(self) -> list[NamespaceInfo]:
        return list(self._namespaces.values())

    def hashes_for_tokens(self, namespace_id: bytes, packed_tokens: bytes, max_blocks: int | None = None) -> list[bytes]:
        """Block hashes of tokens packed as little-endian u32 (at most `max_blocks` blocks)."""
        info = self.namespace(namespace_id)
        step = info.layout.block_size_tokens * 4
        n_blocks = len(packed_tokens) // step
        if max_blocks is not None:
            n_blocks = min(n_blocks, max_blocks)
        self._check_count(n_blocks, "blocks of tokens")
        return block_hashes_packed(namespace_id, memoryview(packed_tokens)[: n_blocks * step],
                                   info.layout.block_size_tokens)

    def check_hashes(self, hashes: Sequence[bytes]) -> None:
        self._check_count(len(hashes), "block hashes")
        if hashes and set(map(len, hashes)) != {HASH_BYTES}:  # one C-level pass in the common case
            i, h = next((i, h) for i, h in enumerate(hashes) if len(h) != HASH_BYTES)
            raise InvalidArgument(f"block hash {i} is {len(h)} bytes; every block hash is {HASH_BYTES} bytes")

    def _check_count(self, n: int, what: str) -> None:
        if n > self.limits.max_blocks_per_call:
            raise InvalidArgument(
                f"{n} {what} in one call; the limit is {self.limits.max_blocks_per_call}: split the request"
            )

    # ----------------------------------------------------------------- lookup

    def lookup(self, namespace_id: bytes, hashes: Sequence[bytes], lease_ms: int = 0) -> LookupResult:
        info = self.namespace(namespace_id)
        self.check_hashes(hashes)
        self.expire_leases()
        keys = [make_key(namespace_id, h) for h in hashes]
        hit = self._index.longest_ready_prefix(keys)
        lease_id = ""
        if hit and lease_ms > 0:
            lease_id = self._acquire_lease(hit, lease_ms).lease_id
        c = self.counters
        c.lookups += 1
        c.lookup_blocks += len(keys)
        c.hit_blocks += len(hit)
        c.miss_blocks += len(keys) - len(hit)
        tier_names = [entry.slot.tier for entry in hit]
        per_tier = Counter(tier_names)
        for st in self.tiers:
            # A tier's hits are looked-up blocks it holds; its misses, those it does not.
            held = per_tier.get(st.name, 0)
            st.counters.hits += held
            st.counters.misses += len(keys) - held
            if held:
                # Tail first, so the head of a chain is the most recently used: a recency
                # policy then evicts chain tails before the heads later blocks depend on.
                tail_first = reversed(hit) if held == len(hit) else (e for e in reversed(hit) if e.slot.tier == st.name)
                st.policy.touch_many(e.key for e in tail_first)
        return LookupResult(
            namespace_id=namespace_id,
            num_blocks=len(hit),
            block_size_tokens=info.layout.block_size_tokens,
            tiers=tier_names,
            block_hashes=list(hashes[: len(hit)]),
            lease_id=lease_id,
        )

    def block(self, namespace_id: bytes, block_hash: bytes) -> BlockInfo | None:
        entry = self._index.get(make_key(namespace_id, block_hash))
        if entry is None:
            return None
        return BlockInfo(entry.slot.tier, entry.slot, entry.nbytes, entry.checksum, entry.pins)

    # ----------------------------------------------------------------- put

    def begin_put(
        self, namespace_id: bytes, hashes: Sequence[bytes], parent_hash: bytes | None = None, tier: str | None = None
    ) -> PutTxn:
        """Start a two-phase put of `hashes` (in chain order). Use as `async with`.

        `tier` names the tier the new blocks land in (default: the first).
        """
        info = self.namespace(namespace_id)
        self.check_hashes(hashes)
        if parent_hash is not None and len(parent_hash) != HASH_BYTES:
            raise InvalidArgument(f"parent hash must be {HASH_BYTES} bytes, got {len(parent_hash)}")
        if not hashes:
            raise InvalidArgument("a put must carry at least one block")
        self.expire_leases()
        if tier is not None and tier not in self._tier_by_name:
            raise FailedPrecondition(f"this daemon has no {tier} tier")
        target = self._tier_by_name[tier] if tier is not None else self.tiers[0]
        return PutTxn(self, info, list(hashes), parent_hash, target)

    def _allocate(self, st: StoreTier, nbytes: int) -> Slot:
        """A slot in `st`, evicting victims in policy order until one fits."""
        while True:
            slot = st.tier.allocate(nbytes)
            if slot is not None:
                return slot
            victim = st.policy.victim(self._is_evictable)
            if victim is None:
                raise ResourceExhausted(
                    f"tier {st.name} is full ({st.tier.used_bytes} of {st.tier.capacity_bytes} bytes) and every "
                    "block in it is pinned or being written; retry later, release leases, or add capacity"
                )
            self._evict(st, victim)

    def _is_evictable(self, key: bytes) -> bool:
        entry = self._index.get(key)
        return entry is not None and entry.evictable

    def _evict(self, st: StoreTier, key: bytes) -> None:
        entry = self._index.get(key)
        assert entry is not None and entry.evictable
        self._drop(entry)
        st.counters.evictions += 1
        self.counters.evictions += 1
        logger.debug("evicted %s from %s", key.hex(), st.name)

    def _drop(self, entry: BlockEntry) -> None:
        """Remove a block from the index and its policy; free its bytes when no reader holds them."""
        self._index.remove(entry.key)
        st = self._tier_by_name[entry.slot.tier]
        st.policy.remove(entry.key)
        info = self._namespaces.get(entry.key[:HASH_BYTES])
        if info is not None:
            info.blocks -= 1
            info.bytes -= entry.nbytes
        if entry.readers == 0:
            st.tier.free(entry.slot)

    def _publish(self, entries: list[BlockEntry]) -> None:
        # Tail first, for the same reason as in `lookup`.
        for entry in reversed(entries):
            entry.state = BlockState.READY
            self._index.add(entry)
            self._tier_by_name[entry.slot.tier].policy.insert(entry.key, entry.parent)
            info = self._namespaces[entry.key[:HASH_BYTES]]
            info.blocks += 1
            info.bytes += entry.nbytes

    # ----------------------------------------------------------------- fetch

    def open_fetch(self, namespace_id: bytes, hashes: Sequence[bytes], lease_id: str = "") -> FetchStream:
        """Plan a fetch of the longest present prefix of `hashes`; use as `async with`.

        The planned blocks are held (as readers) until the stream closes, so eviction and
        deletion cannot free their bytes mid-read. `lease_id`, if given, is released when
        the stream closes: the lease's job (bridging lookup and fetch) is done.
        """
        info = self.namespace(namespace_id)
        self.check_hashes(hashes)
        self.expire_leases()
        entries = self._index.longest_ready_prefix([make_key(namespace_id, h) for h in hashes])
        self.counters.fetches += 1
        return FetchStream(self, entries, info.layout.bytes_per_block, lease_id)

    def _end_read(self, entry: BlockEntry) -> None:
        entry.readers -= 1
        if entry.removed and entry.readers == 0:
            self._tier_by_name[entry.slot.tier].tier.free(entry.slot)

    def _checksum_failed(self, entry: BlockEntry) -> None:
        st = self._tier_by_name[entry.slot.tier]
        st.counters.checksum_failures += 1
        self.counters.checksum_failures += 1
        logger.warning("block %s in tier %s failed its checksum; dropped", entry.key.hex(), st.name)
        if not entry.removed:
            self._drop(entry)

    # ----------------------------------------------------------------- delete, pins

    def delete(self, namespace_id: bytes, hashes: Sequence[bytes]) -> int:
        """Remove the named blocks, leased or not (an explicit delete wins over a lease)."""
        self.namespace(namespace_id)
        self.check_hashes(hashes)
        deleted = 0
        for h in hashes:
            entry = self._index.get(make_key(namespace_id, h))
            if entry is not None:
                self._drop(entry)
                deleted += 1
        self.counters.deletes += deleted
        return deleted

    def pin(self, namespace_id: bytes, hashes: Sequence[bytes], ttl_ms: int = 0) -> PinResult:
        """Pin every named block that is present (not only a prefix) for `ttl_ms`."""
        self.namespace(namespace_id)
        self.check_hashes(hashes)
        self.expire_leases()
        ttl = ttl_ms or self.limits.default_pin_ms
        entries = [e for h in hashes if (e := self._index.get(make_key(namespace_id, h))) is not None]
        if not entries:
            return PinResult("", 0, 0)
        lease = self._acquire_lease(entries, ttl)
        return PinResult(lease.lease_id, len(entries), min(ttl, self.limits.max_lease_ms))

    def lease_prefix(
        self, namespace_id: bytes, hashes: Sequence[bytes], ttl_ms: int, tier: str
    ) -> tuple[LookupResult, list[BlockInfo]]:
        """The fetch of a co-located reader: the READY prefix of `hashes`, plus a
        bytes-holding lease on its leading run of blocks in `tier`.

        The returned slots stay valid (never freed or reused) until the lease is released
        or expires, even if the blocks are deleted meanwhile. Counted as a fetch of the
        leased blocks, like `open_fetch`; blocks past the run are fetched separately.
        """
        info = self.namespace(namespace_id)
        self.check_hashes(hashes)
        self.expire_leases()
        entries = self._index.longest_ready_prefix([make_key(namespace_id, h) for h in hashes])
        local: list[BlockEntry] = []
        for entry in entries:
            if entry.slot.tier != tier:
                break
            local.append(entry)
        lease_id = ""
        if local:
            lease_id = self._acquire_lease(local, ttl_ms, holds_bytes=True).lease_id
        self.counters.fetches += 1
        self.counters.blocks_fetched += len(local)
        self.counters.bytes_out += sum(e.nbytes for e in local)
        for entry in reversed(local):
            self._tier_by_name[entry.slot.tier].policy.touch(entry.key)
        result = LookupResult(
            namespace_id=namespace_id,
            num_blocks=len(entries),
            block_size_tokens=info.layout.block_size_tokens,
            tiers=[e.slot.tier for e in entries],
            block_hashes=list(hashes[: len(entries)]),
            lease_id=lease_id,
        )
        return result, [BlockInfo(e.slot.tier, e.slot, e.nbytes, e.checksum, e.pins) for e in local]

    async def verify(self, namespace_id: bytes, hashes: Sequence[bytes]) -> tuple[int, int]:
        """Re-check the named blocks against their checksums; drop and count the bad ones.

        Returns (verified, dropped). A client that saw a mismatch asks for this: the
        daemon does not take the client's word, it looks for itself.
        """
        self.namespace(namespace_id)
        self.check_hashes(hashes)
        entries = [e for h in hashes if (e := self._index.get(make_key(namespace_id, h))) is not None]
        for entry in entries:
            entry.readers += 1
        try:
            datas = [await self._tier_by_name[e.slot.tier].tier.read(e.slot, e.nbytes) for e in entries]
            sums = await checksum_batch(datas, self._executor)
        finally:
            for entry in entries:
                self._end_read(entry)
        verified = dropped = 0
        for entry, got in zip(entries, sums):
            if got == entry.checksum:
                verified += 1
            elif not entry.removed:
                self._checksum_failed(entry)
                dropped += 1
        return verified, dropped

    def unpin(self, lease_id: str) -> bool:
        return self._leases.release(lease_id) is not None

    def _acquire_lease(self, entries: list[BlockEntry], ttl_ms: int, holds_bytes: bool = False) -> Lease:
        if ttl_ms < 0:
            raise InvalidArgument(f"lease time must be >= 0 ms, got {ttl_ms}")
        if len(self._leases) >= self.limits.max_leases:
            raise ResourceExhausted(
                f"{self.limits.max_leases} leases are active; release leases (Unpin) or wait for them to expire"
            )
        ttl_ms = min(ttl_ms, self.limits.max_lease_ms)
        return self._leases.acquire(entries, self._clock() + ttl_ms / 1000.0, holds_bytes)

    def expire_leases(self) -> int:
        return self._leases.expire(self._clock())

    # ----------------------------------------------------------------- stats

    def stats(self) -> StoreStatus:
        self.expire_leases()
        return StoreStatus(
            tiers=[
                TierStatus(
                    name=st.name,
                    capacity_bytes=st.tier.capacity_bytes,
                    used_bytes=st.tier.used_bytes,
                    blocks=st.tier.blocks,
                    policy=st.policy.name,
                    counters=TierCounters(**{k: getattr(st.counters, k) for k in TierCounters.__slots__}),
                    facts=st.tier.describe(),
                )
                for st in self.tiers
            ],
            counters=StoreCounters(**{k: getattr(self.counters, k) for k in StoreCounters.__slots__}),
            namespaces=len(self._namespaces),
            leases_active=len(self._leases),
        )

    def close(self) -> None:
        for st in self.tiers:
            st.tier.close()


class FetchStream:
    """Verified bytes of planned blocks, in order, as an async iterator.

    Blocks are copied out of their tier in batches, then the copies are verified against
    the checksums taken at put time: what leaves the daemon is exactly what was checked.
    A block that fails is dropped and counted, and the stream ends there. The stream may
    therefore yield fewer than `num_blocks` blocks.
    """

    def __init__(self, store: Store, entries: list[BlockEntry], block_bytes: int, lease_id: str) -> None:
        self._store = store
        self._entries = entries
        self._lease_id = lease_id
        self.num_blocks = len(entries)
        self.block_bytes = block_bytes
        self._closed = False
        for entry in entries:
            entry.readers += 1

    async def __aenter__(self) -> FetchStream:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for entry in self._entries:
            self._store._end_read(entry)
        if self._lease_id:
            self._store._leases.release(self._lease_id)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        store = self._store
        tiers = store._tier_by_name
        entries = self._entries
        i = 0
        while i < len(entries) and not self._closed:
            batch: list[BlockEntry] = []
            batch_bytes = 0
            while i < len(entries) and (not batch or batch_bytes + entries[i].nbytes <= FETCH_BATCH_BYTES):
                batch.append(entries[i])
                batch_bytes += entries[i].nbytes
                i += 1
            datas = [await tiers[e.slot.tier].tier.read(e.slot, e.nbytes) for e in batch]
            sums = await checksum_batch(datas, store._executor)
            for entry, data, got in zip(batch, datas, sums):
                if entry.removed:
                    return  # deleted while we read it: it no longer exists
                if got != entry.checksum:
                    store._checksum_failed(entry)
                    return
                tiers[entry.slot.tier].policy.touch(entry.key)
                store.counters.blocks_fetched += 1
                store.counters.bytes_out += len(data)
                yield data


class PutTxn:
    """One put in flight: PENDING slots that become READY all together on `commit`.

    Blocks must arrive in order (chunks of block i, then of block i+1). A block already
    READY when the put began is accepted and discarded without being stored again.
    """

    def __init__(
        self, store: Store, info: NamespaceInfo, hashes: list[bytes], parent_hash: bytes | None, tier: StoreTier
    ) -> None:
        self._store = store
        self._info = info
        self._hashes = hashes
        self.block_bytes = info.layout.bytes_per_block
        ns = info.namespace_id
        self._keys = [make_key(ns, h) for h in hashes]
        first_parent = make_key(ns, parent_hash) if parent_hash else None
        self._parents: list[bytes | None] = [first_parent, *self._keys[:-1]]
        self._entries: list[BlockEntry | None] = [None] * len(hashes)
        # Blocks already READY when the put began, held so that making room for the new
        # blocks cannot evict them (the put would otherwise report them present when not).
        self._held: list[BlockEntry] = []
        self._received = [0] * len(hashes)
        self._current = 0
        self._done = False
        self._tier = tier

    async def __aenter__(self) -> PutTxn:
        self.reserve()
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._done:
            self.abort()

    def reserve(self) -> None:
        """Allocate PENDING slots for the blocks not already present (evicting as needed)."""
        st = self._tier
        index = self._store._index
        new = []
        for i, key in enumerate(self._keys):
            present = index.get(key)
            if present is None:
                new.append(i)
            else:
                present.readers += 1
                self._held.append(present)
        need = len(new) * st.tier.accounted_size(self.block_bytes)
        if need > st.tier.capacity_bytes:
            raise ResourceExhausted(
                f"this put needs {need} bytes but tier {st.name} holds {st.tier.capacity_bytes}; "
                "put fewer blocks per call or raise the tier's capacity"
            )
        try:
            for i in new:
                slot = self._store._allocate(st, self.block_bytes)
                self._entries[i] = BlockEntry(self._keys[i], self._parents[i], slot, self.block_bytes, 0)
        except BaseException:
            self.abort()
            raise

    async def write(self, block: int, data: bytes | memoryview) -> None:
        """Append `data` to block `block`'s payload."""
        if self._done:
            raise FailedPrecondition("this put has already finished")
        if not 0 <= block < len(self._keys):
            raise InvalidArgument(f"chunk for block {block}, but the put carries {len(self._keys)} blocks")
        if block < self._current:
            raise InvalidArgument(f"chunk for block {block} after block {self._current} began; send blocks in order")
        while self._current < block:
            self._check_complete(self._current)
            self._current += 1
        offset = self._received[block]
        if offset + len(data) > self.block_bytes:
            raise InvalidArgument(
                f"block {block} got {offset + len(data)} bytes, but a block of this namespace is "
                f"{self.block_bytes} bytes (layout {self._info.layout.model}, "
                f"{self._info.layout.block_size_tokens} tokens); check the layout you sent"
            )
        entry = self._entries[block]
        if entry is not None:
            await self._store._tier_by_name[entry.slot.tier].tier.write(entry.slot, offset, data)
        self._received[block] = offset + len(data)

    def slots(self) -> list[Slot | None]:
        """Where each block's bytes must land; None for blocks already present."""
        return [e.slot if e is not None else None for e in self._entries]

    def mark_written(self) -> None:
        """Every byte was written into the slots by someone else (a co-located client)."""
        self._received = [self.block_bytes] * len(self._keys)
        self._current = len(self._keys) - 1

    def _check_complete(self, block: int) -> None:
        got = self._received[block]
        if got != self.block_bytes:
            raise InvalidArgument(
                f"block {block} got {got} bytes, but a block of this namespace is {self.block_bytes} bytes; "
                "check the layout you sent"
            )

    async def commit(self, checksums: Sequence[int] | None = None) -> PutResult:
        """Verify every block is complete, checksum, and publish. Read-your-writes holds on return.

        `checksums` (one per block of the put, in order) are taken as given instead of
        hashing the slots: a co-located client hashes its source while copying it in. A
        wrong one cannot cause a wrong block to be served: every read verifies.
        """
        store = self._store
        for i in range(len(self._keys)):
            self._check_complete(i)
        pending = [e for e in self._entries if e is not None]
        tiers = store._tier_by_name
        if checksums is not None:
            if len(checksums) != len(self._keys):
                raise InvalidArgument(f"{len(checksums)} checksums for a put of {len(self._keys)} blocks")
            sums = [checksums[i] for i, e in enumerate(self._entries) if e is not None]
        else:
            views = [tiers[e.slot.tier].tier.view(e.slot, e.nbytes) for e in pending]
            if any(v is None for v in views):
                datas: list[bytes | memoryview] = [await tiers[e.slot.tier].tier.read(e.slot, e.nbytes) for e in pending]
            else:
                datas = [v for v in views if v is not None]
            sums = await checksum_batch(datas, store._executor)
        if self._done:  # aborted while checksumming (cancelled call)
            raise FailedPrecondition("this put was aborted")
        stored = existing = 0
        publish: list[BlockEntry] = []
        for entry, csum in zip(pending, sums):
            entry.checksum = csum
        for i, maybe in enumerate(self._entries):
            if maybe is None or maybe.key in store._index:
                # Present before the put began, or published by a concurrent put since.
                existing += 1
                if maybe is not None:
                    tiers[maybe.slot.tier].tier.free(maybe.slot)
                    self._entries[i] = None
            else:
                publish.append(maybe)
                stored += 1
        store._publish(publish)
        self._done = True
        self._release_held()
        c = store.counters
        c.puts += 1
        c.blocks_stored += stored
        c.blocks_existing += existing
        c.bytes_in += stored * self.block_bytes
        return PutResult(self._info.namespace_id, stored, existing, list(self._hashes))

    def abort(self) -> None:
        """Free every PENDING slot. Nothing of this put was ever visible."""
        if self._done:
            return
        self._done = True
        self._release_held()
        self._store.counters.put_failures += 1
        for i, entry in enumerate(self._entries):
            if entry is not None:
                self._store._tier_by_name[entry.slot.tier].tier.free(entry.slot)
                self._entries[i] = None

    def _release_held(self) -> None:
        for entry in self._held:
            self._store._end_read(entry)
        self._held.clear()
