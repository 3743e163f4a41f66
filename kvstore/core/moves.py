"""Tier moves: which tier a block's bytes go to, and how room is made for them.

Everything here that moves bytes holds the block it moves (a reader, `CopyBook.hold`)
across its awaits, so eviction, migration and deletion cannot free them mid-move.

Ordering decisions that matter:
- Never serve a wrong block. Every read that crosses a tier is verified against the
  checksum taken at put time (`read_verified`, and a copy is checked where it is host
  visible: before it crosses, else after); a mismatch, or a record that does not decode,
  drops that copy, counts it, and ends the move.
- Never lose a block while it moves. A copy adds the destination location only after
  the bytes landed and verified, and removes the source location after that.
- Making room and demoting call each other: a slot is allocated by demoting victims to
  the tier below (`allocate` -> `evict_some` -> `evict_one` -> `demote`), and a demotion
  into a full memory tier allocates there in turn (`demote` -> `copy_into` ->
  `allocate`); the last tier drops its victims, a tier that reclaims whole regions (the
  SSD log) drops the victim's whole region. A demotion that finds no room below drops the
  block, as the last tier would: a put that needs the room never fails for it.
- Tenancy: a put over its tenant's quota first demotes that tenant's own victims
  (`quota_room`); promotions, demotions and SSD writes never take a tenant over. In a
  tier with spaces, every block is allocated, demoted into and promoted into its
  tenant's space (`space_of`), and room kept free for a space's own reuse is taken only
  when nothing is left to evict (`allocate`).
- Blocks already on the inclusive tier (SSD) are demoted by dropping the memory copy; a
  hit there may leave a copy in the top memory tier on its way out (`promote_on_hit`).

`evict_some` and `evict_one` are the seams through which all room is made (benchmarks
time them). Victims come from `victim_row`: a tier's replicas (copies of blocks another
daemon of a pool owns, `StoreTier.replicas`) go first, and are dropped, not demoted.

Primitives: `read_verified`, `allocate`/`allocate_put`, `evict_some`/`evict_one`,
`demote`, `ensure_inclusive_copy`, `copy_into`, `raise_into`, `promote_on_hit`,
`quota_room`, `landing_tiers`, `space_of`/`space_of_tenant`; and the operator-facing loops over them,
`prefetch`, `evict_bytes` and `verify`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Executor

from kvstore.answers import PrefetchResult
from kvstore.checksum import checksum_batch
from kvstore.core.copies import CopyBook
from kvstore.core.index import BlockEntry, BlockIndex, make_key
from kvstore.core.namespaces import NamespaceRegistry
from kvstore.core.store_tier import StoreTier
from kvstore.core.tenancy import TenantLedger
from kvstore.core.tier import BlockMeta, Copier, Slot
from kvstore.core.types import MigrationConfig, NamespaceInfo, RemovalResult, StoreCounters
from kvstore.errors import DataLoss, FailedPrecondition, ResourceExhausted
from kvstore.hashing import HASH_BYTES

logger = logging.getLogger(__name__)

# Victims evicted together when room is made for several blocks (`TierMoves.evict_some`).
EVICT_BATCH = 32


class TierMoves:
    """Room and movement for a store's tiers (top first; `memory_tiers` are the
    addressable ones, `inclusive` the SSD tier if any)."""

    def __init__(self, index: BlockIndex, copies: CopyBook, registry: NamespaceRegistry, tenancy: TenantLedger,
                 counters: StoreCounters, tiers: Sequence[StoreTier], config: MigrationConfig,
                 copiers: dict[tuple[str, str], Copier], executor: Executor | None) -> None:
        self._index = index
        self._copies = copies
        self._registry = registry
        self._tenancy = tenancy
        self._counters = counters
        self._tiers = list(tiers)
        self.memory_tiers = [t for t in self._tiers if t.tier.addressable]
        self.inclusive: StoreTier | None = next((t for t in self._tiers if t.tier.inclusive), None)
        # Whether any tier keeps spaces apart: else no block's space is ever looked up.
        self._spaced = any(t.tier.spaces for t in self.memory_tiers)
        self._by_name = {t.name: t for t in self._tiers}
        self._rank = {t.name: i for i, t in enumerate(self._tiers)}
        self._tier_ids = {t.name: index.table.tier_id(t.name) for t in self._tiers}
        self._config = config
        self._copiers = copiers
        self._executor = executor
        self._evictable_row = index.evictable_row  # the victim predicate, bound once
        # Blocks being written to the inclusive tier right now, so a demotion and the
        # write-through writer never write the same block twice.
        self._writing: dict[bytes, asyncio.Future[None]] = {}

    def below(self, st: StoreTier) -> StoreTier | None:
        i = self._rank[st.name] + 1
        return self._tiers[i] if i < len(self._tiers) else None

    def space_of(self, namespace_id: bytes) -> int:
        """The space blocks of `namespace_id` are allocated in (0 where no tier has spaces)."""
        return self._registry.space(namespace_id) if self._spaced else 0

    def space_of_tenant(self, tenant: str) -> int:
        """The space a tenant's new blocks are allocated in (0 where no tier has spaces):
        a put's namespace may be filed only when it publishes."""
        return self._registry.space_of_tenant(tenant) if self._spaced else 0

    def landing_tiers(self) -> list[StoreTier]:
        if self._config.put_tier == "auto":
            return self.memory_tiers
        return [self._by_name[self._config.put_tier]]

    async def read_verified(self, entry: BlockEntry, st: StoreTier) -> bytes | None:
        """The bytes of `entry`'s copy in `st`, verified; None (copy dropped, counted) if bad.

        The caller holds the entry.
        """
        slot = entry.locations[st.name]
        try:
            data = await st.tier.get_block(slot, entry.nbytes)
        except DataLoss as exc:
            logger.warning("block %s in tier %s: %s", entry.key.hex(), st.name, exc)
            self._copies.drop_bad_copy(entry, st)
            return None
        got = (await checksum_batch([data], self._executor))[0]
        if got != entry.checksum:
            self._copies.drop_bad_copy(entry, st)
            return None
        return data

    async def _verify_view(self, entry: BlockEntry, st: StoreTier, slot: Slot) -> bool | None:
        """Checksum of a host-visible copy against the entry's; None when not host-visible."""
        view = st.tier.view(slot, entry.nbytes)
        if view is None:
            return None
        return (await checksum_batch([view], self._executor))[0] == entry.checksum

    async def allocate(self, st: StoreTier, nbytes: int, want: int = 1, space: int = 0) -> Slot:
        """An empty slot in addressable tier `st` (in `space`), demoting victims until one
        fits; `want`: how many slots the caller is about to take, so that room for them is
        made at once. With nothing left to evict, room a tier with spaces keeps for other
        spaces' reuse is taken before giving up."""
        while True:
            slot = st.tier.allocate(nbytes, space)
            if slot is not None:
                return slot
            try:
                await self.evict_some(st, nbytes, want)
            except ResourceExhausted:
                slot = st.tier.allocate(nbytes, space, reclaim=True) if st.tier.spaces else None
                if slot is None:
                    raise
                return slot

    async def allocate_put(self, nbytes: int, landing: list[StoreTier], want: int = 1, space: int = 0) -> Slot:
        """A PENDING slot for a new block (of `space`): the highest landing tier with room,
        else make room in the first one (for `want` blocks: the caller's next ones take the
        rest)."""
        for st in landing:
            slot = st.tier.allocate(nbytes, space)
            if slot is not None:
                return slot
        # Make room in the first tier that can: the top one may be full of PENDING slots
        # of concurrent puts, which nothing can evict.
        for st in landing[:-1]:
            try:
                return await self.allocate(st, nbytes, want, space)
            except ResourceExhausted:
                continue
        return await self.allocate(landing[-1], nbytes, want, space)

    async def _place(self, st: StoreTier, entry: BlockEntry, data: bytes | memoryview) -> Slot:
        """Store `data` as `entry` in `st`, demoting (or dropping) victims until it fits."""
        meta = BlockMeta(entry.key, entry.parent, entry.checksum, entry.itemsize)
        while True:
            slot = await st.tier.put_block(meta, data)
            if slot is not None:
                return slot
            await self.evict_one(st, entry.nbytes)

    async def evict_some(self, st: StoreTier, nbytes: int, count: int) -> None:
        """Make progress towards room for `count` blocks in `st`: where `st` is the last tier,
        drop up to `count` victims in one batch (`CopyBook.drop_last_copies`); otherwise, or
        for a victim that is not simply the only copy of an indexed block, one `evict_one`
        step."""
        # Slots of an addressable tier give their room back one by one, so a batch of
        # victims dropped at once makes room for as many blocks.
        if count > 1 and st.tier.addressable and self.below(st) is None:
            rows = self._take_victims(st, min(count, EVICT_BATCH))
            if rows:
                self._copies.drop_last_copies(st, rows)
                st.counters.evictions += len(rows)
                self._counters.evictions += len(rows)
                return
        await self.evict_one(st, nbytes)

    def _take_victims(self, st: StoreTier, count: int) -> list[int]:
        """Up to `count` rows of the policy's victims in order, each taken out of the policy,
        stopping before the first that `CopyBook.drop_last_copies` cannot drop."""
        tid = self._tier_ids[st.name]
        only_copy_in = self._index.only_copy_in
        rows: list[int] = []
        policy = st.policy
        for _ in range(count):
            row, _replica = self.victim_row(st)
            if row is None or not only_copy_in(row, tid):
                break
            policy.remove_row(row)
            st.replicas.discard(row)
            rows.append(row)
        return rows

    def victim_row(self, st: StoreTier) -> tuple[int | None, bool]:
        """The next block to leave `st`: its oldest evictable replica (a copy of another
        daemon's block), else its policy's victim; and whether it is a replica."""
        if len(st.replicas):
            row = st.replicas.victim_row(self._index.table, st.name, self._evictable_row)
            if row is not None:
                return row, True
        return st.policy.victim_row(self._evictable_row), False

    async def evict_victim(self, st: StoreTier, row: int, replica: bool) -> None:
        """Move a victim out of `st`: demoted to the tier below, except a replica, which is
        dropped (its owner holds the block; a copy is not worth SSD writes)."""
        entry = self._index.entry(row)
        if replica:
            st.replicas.discard(row)
            self.evict_location(entry, st)
            return
        await self.demote(entry, st)

    async def evict_one(self, st: StoreTier, nbytes: int) -> None:
        """Make progress towards room in `st`: demote one victim, or (in the last tier) drop
        it with whatever shares its room."""
        row, replica = self.victim_row(st)
        if row is None:
            raise ResourceExhausted(
                f"tier {st.name} is full ({st.tier.used_bytes} of {st.tier.capacity_bytes} bytes) and every "
                "block in it is pinned or being moved; retry later, release leases, or add capacity"
            )
        entry = self._index.entry(row)
        if self.below(st) is not None or replica:
            await self.evict_victim(st, row, replica)
            return
        # Region-level reclaim: a tier that frees whole regions (the SSD log) gets a
        # region back only when all its records are dead, so the victim's whole region
        # goes at once (what of it is evictable).
        keys = st.tier.region_keys(entry.locations[st.name], entry.key)
        if len(keys) == 1:  # the victim's room alone: every memory tier
            self.evict_location(entry, st)
            return
        for k in keys:
            e = self._index.get(k)
            if e is not None and e.evictable and e.slot_in(st.name) is not None:
                self.evict_location(e, st)

    def evict_location(self, entry: BlockEntry, st: StoreTier) -> None:
        st.counters.evictions += 1
        self._counters.evictions += 1
        self._copies.remove_location(entry, st)

    async def demote(self, entry: BlockEntry, st: StoreTier) -> bool:
        """Move `entry` out of `st` to the next tier down; the last tier drops it.

        True when `st` no longer holds the block.
        """
        lower = self.below(st)
        if lower is None:
            self.evict_location(entry, st)
            return True
        if entry.slot_in(lower.name) is not None:  # already below (the inclusive SSD copy)
            st.counters.demotions += 1
            self._copies.remove_location(entry, st)
            return True
        self._copies.hold(entry)
        try:
            try:
                if not lower.tier.addressable:  # a whole-block write (the SSD)
                    data = await self.read_verified(entry, st)
                    if data is None:
                        return True
                    landed = await self.ensure_inclusive_copy(entry, data)
                else:
                    slot = await self.copy_into(entry, st, lower)
                    if slot is None:
                        return True
                    landed = self._copies.add_location(entry, lower, slot)
            except ResourceExhausted:
                landed = False
            except OSError as exc:
                # The SSD refused the write (disk full, I/O error): as if there were no room
                # below. The put that needs this slot must not fail for it.
                self._counters.ssd_write_failures += 1
                logger.warning("ssd write of block %s failed (%s); not demoted", entry.key.hex(), exc)
                landed = False
            if not landed and lower.name not in entry.locations:
                # Nothing below can take it: dropping is what the last tier would do.
                logger.debug("no room below %s for %s; dropped", st.name, entry.key.hex())
                if st.name in entry.locations and not entry.removed:
                    self.evict_location(entry, st)
                return True
            if st.name in entry.locations:
                st.counters.demotions += 1
                self._copies.remove_location(entry, st)
            return True
        finally:
            self._copies.release(entry)

    async def ensure_inclusive_copy(self, entry: BlockEntry, data: bytes) -> bool:
        """Write `entry` to the inclusive tier (SSD) unless it is there or already being
        written (then wait for that write). True when the block has an SSD copy afterwards.
        The caller holds it."""
        assert self.inclusive is not None
        if self.inclusive.name in entry.locations:
            return True
        if self._copies.quota_exceeded(entry, self.inclusive):
            return False  # over the tenant's SSD quota: the block stays (or ends) in memory only
        pending = self._writing.get(entry.key)
        if pending is not None:
            await asyncio.shield(pending)
            return self.inclusive.name in entry.locations
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writing[entry.key] = done
        self._copies.quota_incoming(entry, self.inclusive, entry.nbytes)
        try:
            slot = await self._place(self.inclusive, entry, data)
            return self._copies.add_location(entry, self.inclusive, slot)
        finally:
            self._copies.quota_incoming(entry, self.inclusive, -entry.nbytes)
            del self._writing[entry.key]
            done.set_result(None)

    async def copy_into(self, entry: BlockEntry, src: StoreTier, dst: StoreTier) -> Slot | None:
        """A verified copy of `entry` from `src` in a new slot of addressable tier `dst`
        (making room there). None when the source copy failed verification (it is dropped
        and counted). The caller holds the entry and publishes the slot."""
        over = self._copies.quota_exceeded(entry, dst)
        if over:
            raise ResourceExhausted(over)
        # Counted as incoming until this returns: the caller adds the location without
        # awaiting in between.
        self._copies.quota_incoming(entry, dst, entry.nbytes)
        try:
            return await self._copy_into_counted(entry, src, dst)
        finally:
            self._copies.quota_incoming(entry, dst, -entry.nbytes)

    async def _copy_into_counted(self, entry: BlockEntry, src: StoreTier, dst: StoreTier) -> Slot | None:
        if not src.tier.addressable:  # no copier from it: a whole-block read (the SSD)
            data = await self.read_verified(entry, src)
            if data is None:
                return None
            slot = await self.allocate(dst, entry.nbytes, space=self.space_of(entry.key[:HASH_BYTES]))
            try:
                await dst.tier.write(slot, 0, data)
            except BaseException:
                dst.tier.free(slot)
                raise
            return slot
        # Verify the source where it is host-visible, before it crosses; else the
        # destination after it crossed (a device copy is checked once it is on the host).
        if await self._verify_view(entry, src, entry.locations[src.name]) is False:
            self._copies.drop_bad_copy(entry, src)
            return None
        slot = await self.allocate(dst, entry.nbytes, space=self.space_of(entry.key[:HASH_BYTES]))
        try:
            if src.name not in entry.locations:  # taken away (deleted) while room was made
                raise FailedPrecondition(f"block {entry.key.hex()} left tier {src.name} during a copy")
            await self._copiers[src.name, dst.name].copy(src.tier, entry.locations[src.name], dst.tier, slot,
                                                         entry.nbytes)
            if await self._verify_view(entry, dst, slot) is False:
                dst.tier.free(slot)
                self._copies.drop_bad_copy(entry, src)
                return None
        except BaseException:
            dst.tier.free(slot)
            raise
        return slot

    async def raise_into(self, entry: BlockEntry, target: StoreTier) -> bool:
        """Copy `entry` up into `target` (moving it out of a lower memory tier). Caller holds it."""
        src = self._copies.top_tier(entry)
        if src is None:
            return False
        try:
            slot = await self.copy_into(entry, src, target)
        except FailedPrecondition:
            return False
        if slot is None:
            return False
        if not self._copies.add_location(entry, target, slot):
            return False
        target.counters.promotions += 1
        if not src.tier.inclusive and src.name in entry.locations:
            self._copies.remove_location(entry, src)  # memory tiers are exclusive: a move
        return True

    async def promote_on_hit(self, entry: BlockEntry, data: bytes) -> None:
        """After a verified read from SSD: keep a memory copy if the top tier has headroom."""
        top = self.memory_tiers[0]
        if entry.removed or top.name in entry.locations or self._copies.quota_exceeded(entry, top):
            return
        if top.tier.used_bytes + top.tier.accounted_size(entry.nbytes) > top.high_watermark * top.tier.capacity_bytes:
            return
        slot = top.tier.allocate(entry.nbytes, self.space_of(entry.key[:HASH_BYTES]))
        if slot is None:
            return
        try:
            await top.tier.write(slot, 0, data)
        except BaseException:
            top.tier.free(slot)
            raise
        if self._copies.add_location(entry, top, slot):
            top.counters.promotions += 1

    async def quota_room(self, info: NamespaceInfo, st: StoreTier, need: int) -> None:
        """Make `need` more bytes of `info.tenant`'s quota in `st` free by evicting the
        tenant's own evictable blocks there (cache semantics); ResourceExhausted if its
        blocks there are pinned, leased or in flight."""
        ledger = self._tenancy
        quota = ledger.quota(info.tenant, st.name)
        if quota is None:
            return
        if need > quota:
            raise ResourceExhausted(
                f"tenant {info.tenant!r}: this put needs {need} bytes in tier {st.name}, more than the tenant's "
                f"whole {st.name} quota of {quota} bytes; put fewer blocks per call or raise the quota"
            )
        owned = self._registry.owned_by(info.tenant)

        def own(key: bytes) -> bool:
            if key[:HASH_BYTES] not in owned:
                return False
            entry = self._index.get(key)
            return entry is not None and entry.evictable

        while over := ledger.exceeded(info.tenant, st.name, need):
            key = st.policy.victim(own)
            if key is None:
                raise ResourceExhausted(
                    f"{over}, and its blocks there are pinned or in use; release leases, delete blocks, "
                    "or raise the quota in the token file"
                )
            entry = self._index.get(key)
            assert entry is not None
            await self.demote(entry, st)

    async def prefetch(self, namespace_id: bytes, hashes: Sequence[bytes], target: StoreTier) -> PrefetchResult:
        """Raise the named blocks that are present into memory tier `target`."""
        raised = already = missing = skipped = 0
        for h in hashes:
            entry = self._index.get(make_key(namespace_id, h))
            src = self._copies.top_tier(entry) if entry is not None else None
            if entry is None or src is None:
                missing += 1
                continue
            if self._rank[src.name] <= self._rank[target.name]:
                already += 1
                target.policy.touch(entry.key)
                continue
            self._copies.hold(entry)
            try:
                if await self.raise_into(entry, target):
                    raised += 1
                elif target.name in entry.locations:
                    already += 1
                else:
                    missing += 1
            except ResourceExhausted:
                # A prefetch is advice: with no room to make, the block stays where it
                # is (still served from there) and the rest are not worth trying.
                skipped = len(hashes) - raised - already - missing
                break
            finally:
                self._copies.release(entry)
        return PrefetchResult(target.name, len(hashes), raised, already, missing, skipped)

    async def evict_bytes(self, st: StoreTier, nbytes: int) -> RemovalResult:
        """Make room in `st`, in its policy's order, until `nbytes` are freed or nothing
        evictable is left (the operator's eviction)."""
        freed = 0
        c = st.counters
        moved_before = c.evictions + c.demotions
        while freed < nbytes:
            used = st.tier.used_bytes
            progress = c.evictions + c.demotions
            try:
                await self.evict_one(st, 0)
            except ResourceExhausted:
                break  # everything left is pinned or in use
            freed += max(0, used - st.tier.used_bytes)
            if st.tier.used_bytes == used and c.evictions + c.demotions == progress:
                break  # no progress (the victim was busy): stop rather than spin
        blocks = c.evictions + c.demotions - moved_before
        return RemovalResult(blocks, freed)

    async def verify(self, entries: Sequence[BlockEntry]) -> tuple[int, int]:
        """Read every copy of each of `entries` and check it (`read_verified`: a bad copy
        is dropped and counted); the entries are held meanwhile. Returns (verified,
        dropped): blocks whose every copy checked out, blocks with a bad one."""
        verified = dropped = 0
        for entry in entries:
            self._copies.hold(entry)
        try:
            # Every copy, not only the one served first: a bad SSD copy would be served
            # once the memory copy is gone.
            for entry in entries:
                bad = False
                for st in [t for t in self._tiers if t.name in entry.locations]:
                    if entry.removed:
                        break
                    if await self.read_verified(entry, st) is None:
                        bad = True
                if bad:
                    dropped += 1
                elif not entry.removed:
                    verified += 1
        finally:
            for entry in entries:
                self._copies.release(entry)
        return verified, dropped
