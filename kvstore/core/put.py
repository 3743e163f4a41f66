"""The put path: two-phase puts (`PutTxn`), slots reserved ahead of them, and publish.

Ordering decisions that matter:
- Publish after the data lands. A put allocates PENDING slots (rows of the block table
  that no lookup sees), receives every byte, and only then adds all its blocks to the
  index in one synchronous step (`PutPath.publish`). A failed or cancelled put frees its
  slots; nothing was ever visible.
- A checksum comes only from bytes the writer owned, never from a re-read of the slot:
  `write` hashes each chunk from the message it arrived in, in the same pass that copies
  it into the slot; a co-located client's put brings the checksums it took from its own
  source (`commit(checksums)`). A slot is memory other processes may map (the shared
  segment), so anything written into it by anyone else, before or after the commit,
  makes that block fail verification when it is next read: a miss, never wrong bytes.
- Read-your-writes. `PutTxn.commit` returns only after the index holds the blocks.
- A put registers its namespace when it publishes, not before: it may begin with a
  record the registry has not filed (`NamespaceRegistry.prepare`), which `commit` files
  in the publishing step (`ensure`), so a refused or failed put leaves no namespace.
- Publish only what is still wanted. The caller may hand `commit` a check (a call still
  alive: not cancelled, deadline not passed); it runs after the commit's last await, in
  the same synchronous step as the publish, so nothing can change between the two.
- A block already READY when the put began is held (so making room for the new blocks
  cannot evict it) and reported as existing, not stored again; one published by a
  concurrent put meanwhile is found by one probe at commit and given up.
- A put that finds no room demotes in line (`TierMoves.allocate_put`); one over its
  tenant's quota first demotes that tenant's own victims, and holds its bytes against
  the quota from then until it commits or aborts.
- Room for bytes that have arrived, not for promises. A streamed put (begun with a
  window) allocates nothing at its header: each block's slot is reserved when its first
  chunk arrives, together with the next blocks' up to `window_bytes`, so a header naming
  the whole tier followed by silence evicts nothing and blocks no one. Publishing stays
  all or nothing: a put that finds no room mid-stream fails (RESOURCE_EXHAUSTED) and
  frees every slot it took. The check that the whole put could ever fit (its tiers'
  capacity, its tenant's quota) is still made up front.
- One-trip puts from a co-located client: `reserve_slots` hands out empty slots ahead of
  the put that names them; the client fills them and `PutTxn.adopt` takes them, with
  the checksums the client took while copying.

Primitives: `PutPath.begin`, `reserve_slots`, `free_slots`, `publish`; `PutTxn.reserve`
/ `adopt`, `write` (or `extend_window` and `mark_written`, for bytes that land in the
slots by other means: the data lane), `commit`, `abort`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np
import xxhash

from kvstore.checksum import checksum
from kvstore.core.copies import CopyBook
from kvstore.core.index import BlockEntry, BlockIndex, RunParents
from kvstore.core.migration import Migrator
from kvstore.core.moves import TierMoves
from kvstore.core.namespaces import NamespaceRegistry
from kvstore.core.store_tier import StoreTier
from kvstore.core.table import I64
from kvstore.core.tenancy import TenantLedger
from kvstore.core.tier import Slot
from kvstore.core.types import NamespaceInfo, PutOutcome, StoreCounters
from kvstore.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.hashing import HASH_BYTES
from kvstore.native import XXH3, native


class PutPath:
    """Where puts enter a store: what a `PutTxn` works with, by name (the attributes are
    the transaction's collaborators, read-only for it)."""

    def __init__(self, index: BlockIndex, registry: NamespaceRegistry, copies: CopyBook, moves: TierMoves,
                 migrator: Migrator, tenancy: TenantLedger, counters: StoreCounters, tiers: Sequence[StoreTier],
                 executor: Executor | None) -> None:
        self.index = index
        self.registry = registry
        self.copies = copies
        self.moves = moves
        self.tenancy = tenancy
        self.counters = counters
        self.tiers = {t.name: t for t in tiers}
        self.executor = executor
        self._migrator = migrator

    def begin(self, info: NamespaceInfo, hashes: Sequence[bytes], parent_hash: bytes | None = None,
              tier: str | None = None, window_bytes: int | None = None,
              runs: Sequence[tuple[int, bytes | None]] = ()) -> PutTxn:
        """A two-phase put of `hashes` (in chain order, checked against the per-call limits
        already) into `info`'s namespace. `tier` names the memory tier the new blocks land
        in (default: the store's `put_tier`). `window_bytes`: reserve slots as the blocks'
        chunks arrive, at most this many bytes of them ahead (at least one block), instead
        of all at `reserve` (a streamed put whose bytes may never come). `runs`: `hashes`
        are several runs of one chain laid end to end (the parts of it another node holds)
        and these (position in `hashes`, parent hash) start the runs after the first one,
        published with it in one step."""
        if window_bytes is not None and window_bytes <= 0:
            raise InvalidArgument(f"a put's reservation window must be positive, got {window_bytes} bytes")
        if parent_hash is not None and len(parent_hash) != HASH_BYTES:
            raise InvalidArgument(f"parent hash must be {HASH_BYTES} bytes, got {len(parent_hash)}")
        last = 0
        for start, parent in runs:
            if not last < start < len(hashes):
                raise InvalidArgument(f"a run of a put starts at {start}: after {last}, before {len(hashes)} expected")
            if parent is not None and len(parent) != HASH_BYTES:
                raise InvalidArgument(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
            last = start
        if not hashes:
            raise InvalidArgument("a put must carry at least one block")
        if len(set(hashes)) != len(hashes):
            # Two PENDING entries for one key would both be published: refuse up front.
            seen: dict[bytes, int] = {}
            for i, h in enumerate(hashes):
                if h in seen:
                    raise InvalidArgument(f"block hash {i} names the same block as block hash {seen[h]}; "
                                          "a put names each block only once")
                seen[h] = i
        target = self.tiers.get(tier) if tier is not None else None
        if tier is not None and (target is None or not target.tier.addressable):
            raise FailedPrecondition(f"this daemon has no {tier} memory tier")
        return PutTxn(self, info, list(hashes), parent_hash, target, window_bytes,
                      RunParents.of(runs) if runs else None)

    async def reserve_slots(self, tier: str, nbytes: int, count: int, space: int = 0) -> list[Slot]:
        """`count` empty slots of `nbytes` in memory tier `tier` (in `space`, for a tier
        with spaces), bound to no block yet (making room as a put would): a co-located
        client fills them ahead of the put that names them (`PutTxn.adopt`). The caller
        frees what it does not adopt."""
        st = self.tiers.get(tier)
        if st is None or not st.tier.addressable:
            raise FailedPrecondition(f"this daemon has no {tier} memory tier")
        slots = st.tier.allocate_many(nbytes, count, space)  # what fits now, in one step
        try:
            while len(slots) < count:
                slots.append(await self.moves.allocate_put(nbytes, [st], count - len(slots), space))
                slots += st.tier.allocate_many(nbytes, count - len(slots), space)  # the rest of the room made
        except BaseException:
            self.free_slots(slots)
            raise
        return slots

    def free_slots(self, slots: Sequence[Slot]) -> None:
        """Return reserved, never-published slots to their tiers."""
        for slot in slots:
            self.tiers[slot.tier].tier.free(slot)

    def publish(self, info: NamespaceInfo, rows: I64) -> None:
        """Make a put's PENDING rows READY (in chain order), in one synchronous step."""
        if len(rows):
            # One put's blocks: one namespace, one copy each, published in whole-array steps.
            self.index.publish(rows[::-1])
            self.copies.published(info, rows)
        self._migrator.published(rows)


class PutTxn:
    """One put in flight: PENDING slots that become READY all together on `commit`.

    Blocks must arrive in order (chunks of block i, then of block i+1). A block already
    READY when the put began is accepted and discarded without being stored again.
    Its blocks are rows of the block table (an array), each with its slot: no object
    per block beyond the slot the tier handed out.
    """

    def __init__(
        self, puts: PutPath, info: NamespaceInfo, hashes: list[bytes], parent_hash: bytes | None,
        tier: StoreTier | None, window_bytes: int | None = None, runs: RunParents | None = None
    ) -> None:
        self._puts = puts
        self._info = info
        # Whose quota the put's bytes count against until it ends (the record may be
        # replaced by the registered one at commit: `ensure`).
        self._tenant = info.tenant
        self._hashes = hashes
        self.block_bytes = info.layout.bytes_per_block
        self._itemsize = info.layout.stored_itemsize
        n = self._n = len(hashes)
        q = np.frombuffer(b"".join(hashes), "<u8")
        self._q0, self._q1 = q[0::2], q[1::2]
        self._parent_hash = parent_hash or None
        self._runs = runs
        # Each block's PENDING row and slot; -1 and None for a block present before the put.
        self._rows = np.full(n, -1, np.int64)
        self._slots: list[Slot | None] = [None] * n
        # Blocks already READY when the put began, held so that making room for the new
        # blocks cannot evict them (the put would otherwise report them present when not).
        self._held: list[BlockEntry] = []
        self._received = [0] * len(hashes)
        # Each block's checksum, taken from the bytes `write` was given; for a block that
        # arrives in several chunks, the running hash of the chunks so far.
        self._sums = [0] * n
        self._running: xxhash.xxh3_64 | None = None
        self._current = 0
        self._done = False
        self._tier = tier
        # Bytes this put holds against its tenant's quota, by tier, until it ends.
        self._quota_held: dict[str, int] = {}
        # Slots are reserved as chunks arrive, at most this many bytes ahead (None: all at once).
        self._window_bytes = window_bytes
        self._window_blocks = 0
        self._landing: list[StoreTier] = []
        self._new: list[int] = []  # with a window: positions of the blocks to store
        self._next_new = 0  # ... and how many of them have slots
        self._needed: list[int] = []  # positions of the blocks to store, once reserved
        self._sealed: tuple[np.ndarray, np.ndarray, Sequence[int], bool] | None = None
        self._stored_at = np.zeros(0, np.int64)

    async def __aenter__(self) -> PutTxn:
        await self.reserve()
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._done:
            self.abort()

    async def reserve(self) -> None:
        """Hold the blocks already present and check the put can fit; then allocate PENDING
        slots for the others (making room as needed): all of them now, or, for a put begun
        with a window (`window_bytes`), as their chunks arrive (`write`)."""
        puts = self._puts
        new = self._hold_present()
        landing = [self._tier] if self._tier is not None else puts.moves.landing_tiers()
        room = sum(st.tier.capacity_bytes for st in landing)
        need = len(new) * landing[0].tier.accounted_size(self.block_bytes)
        if need > room:
            raise ResourceExhausted(
                f"this put needs {need} bytes but the tiers puts land in ({', '.join(t.name for t in landing)}) "
                f"hold {room}; put fewer blocks per call or raise their capacity"
            )
        self._landing = landing
        self._needed = new
        try:
            if self._window_bytes is None:
                await self._take_slots(new)
                return
            # Nothing is allocated, nor evicted, for bytes that have not arrived: a header
            # alone costs the daemon nothing but the check that the put could ever fit.
            self._check_quota_fits(len(new) * self.block_bytes)
            self._new = new
            per_block = landing[0].tier.accounted_size(self.block_bytes)
            self._window_blocks = max(1, self._window_bytes // per_block)
        except BaseException:
            self.abort()
            raise

    def _check_quota_fits(self, nbytes: int) -> None:
        """Refuse a put larger than its tenant's whole quota in a tier it may land in."""
        tenancy = self._puts.tenancy
        tenant = self._tenant
        for st in self._landing:
            quota = tenancy.quota(tenant, st.name)
            if quota is not None and nbytes > quota:
                raise ResourceExhausted(
                    f"tenant {tenant!r}: this put needs {nbytes} bytes in tier {st.name}, more than the tenant's "
                    f"whole {st.name} quota of {quota} bytes; put fewer blocks per call or raise the quota"
                )

    async def _reserve_window(self) -> None:
        """Slots for the next new blocks, the one whose first chunk just arrived first, and
        at most `window_bytes` of them (at least that one)."""
        await self.extend_window(self._window_blocks)

    @property
    def window_blocks(self) -> int:
        """How many blocks' slots the window holds (a put begun with `window_bytes`)."""
        return self._window_blocks

    def needed(self) -> list[int]:
        """Positions of the blocks this put stores (those not present when it began), in
        order; known once `reserve` returned."""
        return list(self._needed)

    def slot(self, block: int) -> Slot | None:
        """Where block `block`'s bytes land; None until its slot is reserved, and for a
        block present before the put."""
        return self._slots[block]

    async def extend_window(self, count: int) -> list[int]:
        """For a put whose bytes land in its slots by other means (`mark_written`): slots
        for its next `count` new blocks in order, at most the window's worth, making room
        as `write` does. The caller keeps what is reserved ahead of the bytes that landed
        within the window. The positions given slots (empty once all have them)."""
        if self._done:
            raise FailedPrecondition("this put has already finished")
        start = self._next_new
        positions = self._new[start : start + min(count, self._window_blocks)]
        self._next_new = start + len(positions)
        await self._take_slots(positions)
        return positions

    async def _take_slots(self, positions: list[int]) -> None:
        """PENDING slots and rows for the blocks at `positions` (all new), making room as a
        put does; their bytes count against the tenant's quota until the put ends."""
        if not positions:
            return
        puts = self._puts
        landing = self._landing
        nbytes = self.block_bytes
        quotas = puts.tenancy.quotas.get(self._tenant)
        if quotas:
            # The put must fit the tenant's quota in every tier it may land in; its
            # bytes count there from when room is made until it commits or aborts.
            more = len(positions) * nbytes
            limited = [st.name for st in landing if st.name in quotas]
            for st in landing:
                if st.name in quotas:
                    await puts.moves.quota_room(self._info, st, more)
            if self._done:  # aborted while making room
                raise FailedPrecondition("this put was aborted")
            for name in limited:
                puts.tenancy.hold(self._tenant, name, more)
                self._quota_held[name] = self._quota_held.get(name, 0) + more
        # What fits in the first landing tier now, in one step; then, per block, the
        # next tier with room, or room made (no await and no coroutine where a tier has room).
        space = puts.moves.space_of_tenant(self._tenant)
        slots: list[Slot] = landing[0].tier.allocate_many(nbytes, len(positions), space)
        try:
            for k in range(len(slots), len(positions)):
                slot = next((s for st in landing if (s := st.tier.allocate(nbytes, space)) is not None), None)
                if slot is None:
                    slot = await puts.moves.allocate_put(nbytes, landing, len(positions) - k, space)
                    if self._done:  # aborted while making room
                        puts.tiers[slot.tier].tier.free(slot)
                        raise FailedPrecondition("this put was aborted")
                slots.append(slot)
        except BaseException:
            puts.free_slots(slots)
            raise
        self._make_entries(positions, slots)

    def _hold_present(self) -> list[int]:
        """Hold the blocks of this put that are READY already; the others' positions."""
        puts = self._puts
        present = puts.index.find_chain(self._info.namespace_id, self._q0, self._q1)
        for row in present[present >= 0].tolist():
            entry = puts.index.entry(row)
            puts.copies.hold(entry)
            self._held.append(entry)
        return np.flatnonzero(present < 0).tolist()

    def _make_entries(self, new: list[int], slots: Sequence[Slot]) -> None:
        """PENDING rows for blocks `new` (positions in the put), block i in slots[i], in
        whole-column steps."""
        if not new:
            return
        at = np.array(new, np.int64)
        rows = self._puts.index.add_pending(self._info.namespace_id, self._q0, self._q1, at, self._parent_hash,
                                              self.block_bytes, self._itemsize, slots, self._runs)
        self._rows[at] = rows
        if len(new) == self._n:
            self._slots = list(slots)
        else:
            for i, slot in zip(new, slots):
                self._slots[i] = slot

    async def adopt(self, filled: Sequence[Slot]) -> list[Slot]:
        """Instead of `reserve`: take slots from `PutPath.reserve_slots` that a co-located
        client already filled, block i in `filled[i]`. Returns the slots of blocks already
        present (their bytes are not needed), which stay the caller's. The tenant's quota
        applies as in `reserve`; if this raises, no slot was taken."""
        if len(filled) != self._n:
            raise InvalidArgument(f"{len(filled)} filled slots for a put of {self._n} blocks")
        puts = self._puts
        new = self._hold_present()
        quotas = puts.tenancy.quotas.get(self._tenant)
        if quotas and new:
            landing = [self._tier] if self._tier is not None else puts.moves.landing_tiers()
            nbytes = len(new) * self.block_bytes
            for st in landing:
                if st.name in quotas:
                    await puts.moves.quota_room(self._info, st, nbytes)
                    puts.tenancy.hold(self._tenant, st.name, nbytes)
                    self._quota_held[st.name] = nbytes
        self._make_entries(new, [filled[i] for i in new])
        new_set = set(new)
        return [slot for i, slot in enumerate(filled) if i not in new_set]

    async def write(self, block: int, data: bytes | memoryview) -> None:
        """Append `data` to block `block`'s payload. Every mistake in the order of chunks
        is refused with what it is (`_advance`, `_overflow`)."""
        if self._done:
            raise FailedPrecondition("this put has already finished")
        if block != self._current:
            self._advance(block)
        offset = self._received[block]
        if offset + len(data) > self.block_bytes:
            raise self._overflow(block, offset + len(data))
        if self._next_new < len(self._new) and self._new[self._next_new] == block:
            await self._reserve_window()  # the first chunk of a block without a slot yet
        slot = self._slots[block]
        end = offset + len(data)
        if slot is not None:
            tier = self._puts.tiers[slot.tier].tier
            if offset == 0 and end == self.block_bytes:  # the whole block in one chunk: one pass
                view = tier.view(slot, end) if XXH3 else None
                if view is not None:
                    # Streamed into the slot, hashed from the message piece just copied.
                    self._sums[block] = native.copy_hash(np.frombuffer(view, np.uint8),
                                                         np.frombuffer(data, np.uint8), True)
                else:
                    self._sums[block] = checksum(data)
                    await tier.write(slot, 0, data)
            else:
                if offset == 0:
                    self._running = xxhash.xxh3_64()
                assert self._running is not None
                self._running.update(data)
                await tier.write(slot, offset, data)
                if end == self.block_bytes:
                    self._sums[block] = self._running.intdigest()
                    self._running = None
        self._received[block] = end

    def _advance(self, block: int) -> None:
        """Move on to block `block` (a chunk for it arrived): it must be one of the put's,
        the next one, and the block before it whole."""
        n, current, size = self._n, self._current, self.block_bytes
        if not 0 <= block < n:
            raise InvalidArgument(
                f"a chunk for block {block}, but the header names {n} blocks (0 to {n - 1}); "
                "a chunk's block counts the put's blocks from 0"
            )
        if block < current:
            raise InvalidArgument(
                f"a chunk for block {block} arrived after block {current} began: chunks out of order; "
                f"send all of block {block}'s chunks before block {block + 1}'s"
            )
        got = self._received[current]
        if got == 0:
            raise InvalidArgument(
                f"block {current} is missing: a chunk for block {block} arrived before any of block {current}'s; "
                "send every block the header names, in order"
            )
        if got != size:
            raise InvalidArgument(
                f"block {current} got {got} of its {size} bytes before a chunk for block {block} arrived: "
                f"all of a block's chunks come before the next block's (chunks out of order, or block {current} "
                "cut short)"
            )
        if block > current + 1:
            raise InvalidArgument(
                f"block {current + 1} is missing: a chunk for block {block} arrived right after block {current}; "
                "send every block the header names, in order"
            )
        self._current = block

    def _overflow(self, block: int, total: int) -> InvalidArgument:
        size, layout = self.block_bytes, self._info.layout
        what = f"(layout {layout.model}, {layout.block_size_tokens} tokens per block)"
        if self._received[block] == size:
            return InvalidArgument(
                f"block {block} already has all its {size} bytes: a chunk was sent twice, or the client's blocks "
                f"are larger than this namespace's {what}; send each chunk once"
            )
        return InvalidArgument(
            f"block {block} got {total} bytes, but a block of this namespace holds {size} {what}; "
            "check the layout you sent"
        )

    def slots(self) -> list[Slot | None]:
        """Where each block's bytes must land; None for blocks already present."""
        return list(self._slots)

    def shorten(self, n: int) -> None:
        """Before the commit: keep the first `n` blocks only (those after them did not
        arrive: their slots are freed, and they are not part of the put)."""
        if self._done or self._sealed is not None or self._window_bytes is not None:
            raise FailedPrecondition("only a reserved put, before its commit, can be shortened")
        if not 0 < n <= self._n:
            raise InvalidArgument(f"a put of {self._n} blocks cannot keep {n}")
        for i in np.flatnonzero(self._rows[n:] >= 0).tolist():
            self._drop_pending(n + i)
        # Blocks held as present past `n` stay held until the put ends.
        self._n = n
        self._hashes = self._hashes[:n]
        self._q0, self._q1 = self._q0[:n], self._q1[:n]
        self._rows = self._rows[:n]
        self._slots = self._slots[:n]
        self._received = self._received[:n]
        self._sums = self._sums[:n]
        self._needed = [i for i in self._needed if i < n]
        self._current = min(self._current, n - 1)

    def mark_written(self) -> None:
        """Every byte was written into the slots by someone else (a co-located client)."""
        self._received = [self.block_bytes] * self._n
        self._current = self._n - 1

    def _check_all_arrived(self) -> None:
        """Every block got all its bytes; else say where the stream of chunks stopped."""
        size = self.block_bytes
        i = next(i for i, got in enumerate(self._received) if got != size)
        got = self._received[i]
        if got == 0:
            raise InvalidArgument(
                f"the stream ended after {i} of the {self._n} blocks the header names; send every block, "
                "then close the stream"
            )
        raise InvalidArgument(
            f"the stream ended inside block {i} ({got} of its {size} bytes); send every block whole, "
            "then close the stream"
        )

    async def commit(self, checksums: Sequence[int] | None = None,
                     check: Callable[[], None] | None = None) -> PutOutcome:
        """Verify every block is complete and publish. Read-your-writes holds on return.

        Each block's checksum is the one `write` took from the bytes it was given; or, for
        bytes a co-located client copied in itself (`mark_written`), `checksums` (one per
        block of the put, in order), which the client took from its source while copying.
        A wrong one cannot cause a wrong block to be served: every read verifies.

        `check`, if given, raises when the put is no longer wanted (its call was cancelled
        or ran past its deadline); it is called right before the publish, with no await
        in between, and the put is rolled back if it raises.
        """
        self.seal(checksums)
        return self.publish_sealed(check)

    def seal(self, checksums: Sequence[int] | None = None) -> None:
        """`commit`'s first half: every block complete, its checksum the one `write` took
        (or the client's, given). A put of several transactions (a grouped layout's parts:
        kvstore.core.groups) seals them all, then publishes them all in one step."""
        new_at, rows = self._complete()
        n = self._n
        given = self._sums if checksums is None else checksums
        if len(given) != n:
            raise InvalidArgument(f"{len(given)} checksums for a put of {n} blocks")
        sums = given if len(new_at) == n else [given[i] for i in new_at.tolist()]
        if self._done:
            raise FailedPrecondition("this put was aborted")
        self._sealed = (new_at, rows, sums, checksums is not None)

    def _complete(self) -> tuple[np.ndarray, np.ndarray]:
        """Every block got all its bytes (else say where the stream stopped); the
        positions and PENDING rows of the blocks this put stores."""
        if self._received.count(self.block_bytes) != self._n:
            self._check_all_arrived()
        new_at = np.flatnonzero(self._rows >= 0)
        return new_at, self._rows[new_at]

    def publish_sealed(self, check: Callable[[], None] | None = None) -> PutOutcome:
        """`commit`'s second half, synchronous: `check`, then publish what `seal` sealed."""
        assert self._sealed is not None, "seal() comes first"
        if self._done:  # aborted since it was sealed
            raise FailedPrecondition("this put was aborted")
        new_at, rows, sums, client_sums = self._sealed
        puts = self._puts
        n = self._n
        index = puts.index
        try:
            if check is not None:
                check()
            # Filed now, in the step that publishes: a put that fails registers nothing.
            self._info = puts.registry.ensure(self._info)
        except BaseException:
            self.abort()
            raise
        index.set_checksums(rows, sums)
        # Published by a concurrent put since this one began: one probe for all.
        raced = index.published_already(self._info.namespace_id, rows)
        if raced.any():
            for k in np.flatnonzero(raced).tolist():
                self._drop_pending(int(new_at[k]))
            rows = rows[~raced]
            new_at = new_at[~raced]
        self._stored_at = new_at
        stored = len(rows)
        existing = n - stored
        puts.publish(self._info, rows)
        self._done = True
        self._release_held()
        c = puts.counters
        c.puts += 1
        c.blocks_stored += stored
        c.blocks_existing += existing
        c.bytes_in += stored * self.block_bytes
        if client_sums:  # the client wrote the bytes into the segment itself
            c.local_bytes_in += stored * self.block_bytes
        return PutOutcome(self._info.namespace_id, stored, existing, list(self._hashes))

    def stored_rows(self) -> tuple[list[int], I64]:
        """After the publish: the positions (in the put) of the blocks it stored, and their rows."""
        return self._stored_at.tolist(), self._rows[self._stored_at]

    def stored_positions(self) -> list[int]:
        """After the publish: the positions (in the put) of the blocks it stored."""
        return self._stored_at.tolist()

    def abort(self) -> None:
        """Free every PENDING slot. Nothing of this put was ever visible."""
        if self._done:
            return
        self._done = True
        self._release_held()
        self._puts.counters.put_failures += 1
        for i in np.flatnonzero(self._rows >= 0).tolist():
            self._drop_pending(i)

    def _drop_pending(self, i: int) -> None:
        """Free block i's PENDING slot and row (the put will not publish it)."""
        slot, row = self._slots[i], int(self._rows[i])
        assert slot is not None and row >= 0
        self._puts.tiers[slot.tier].tier.free(slot)
        self._puts.index.discard_pending(row)
        self._slots[i] = None
        self._rows[i] = -1

    def _release_held(self) -> None:
        for tier, nbytes in self._quota_held.items():
            self._puts.tenancy.release(self._tenant, tier, nbytes)
        self._quota_held.clear()
        for entry in self._held:
            self._puts.copies.release(entry)
        self._held.clear()
