"""The fetch path: verified bytes of a chain's longest present prefix, block by block.

What leaves the daemon is exactly what was checked: each block is copied out of its top
tier right before it is sent, by the caller's framer (which makes the messages the block
travels in), and the checksum is taken over the payload inside those messages. The
framer is handed in (`FetchStream.frames`): the core knows what a framed block offers
(`FramedBlock`), not the wire codec that makes one.

Blocks are held (as readers) from `open` until the stream closes, so eviction,
migration and deletion cannot free their bytes mid-read.

A copy that fails verification is dropped (and counted), and the block's next copy down
(an SSD copy under a bad host copy) is read and verified in its place: the stream ends
early only when no copy of a block verifies, or the block was deleted meanwhile, and
then says so (`FetchStream.sent`, `ended_early`, `verification_failed`), so the server
can tell the client how many blocks it got and why.

A co-located reader fetches through shared memory instead (`FetchPath.lease_prefix`):
it gets a lease that holds the bytes of the prefix's leading run in one tier (their
slots are not freed or reused until the lease ends), their offsets and their checksums,
and verifies what it reads itself.

Primitives: `FetchPath.open`, `FetchPath.lease_prefix`, `FetchStream.frames`,
`touch_served`, `frame_and_checksum`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from kvstore.checksum import checksum, checksum_pieced
from kvstore.core.copies import CopyBook
from kvstore.core.index import BlockEntry, BlockIndex, hold_readers, make_key, release_readers
from kvstore.core.leases import Lease
from kvstore.core.moves import TierMoves
from kvstore.core.store_tier import StoreTier
from kvstore.core.table import I64
from kvstore.core.tier import Slot
from kvstore.core.types import MigrationConfig, NamespaceInfo, PrefixLookup, StoreCounters
from kvstore.errors import DataLoss
from kvstore.hashing import HASH_BYTES

logger = logging.getLogger(__name__)

# A fetch copies and verifies each block right before sending it: on the event loop up
# to FETCH_INLINE_BYTES per block (a thread hand-off per block costs more than the copy
# and hash it would move), on a hashing thread above that (the loop stays responsive).
# Blocks without a view (SSD) are read up to FETCH_AHEAD_BYTES ahead, concurrently.
FETCH_INLINE_BYTES = 4 * 1024 * 1024
FETCH_AHEAD_BYTES = 8 * 1024 * 1024
# Up to this many blocks, a fetch holds and lets go of each on its own (numpy's per-call
# cost is more than a few scalar steps).
HOLD_ONE_BY_ONE = 8


class FramedBlock(Protocol):
    """A block made into messages by a framer (e.g. `kvstore.wire.Framed`): `messages` to
    send, `payload` views that, in order, cover exactly the block's bytes inside them, and
    `checksum`, the payload's, where the framer took it while copying (else None)."""

    @property
    def messages(self) -> list[bytes]: ...

    @property
    def payload(self) -> list[memoryview]: ...

    @property
    def checksum(self) -> int | None: ...


F = TypeVar("F", bound=FramedBlock)


class _OneCopy(NamedTuple):
    """A block as one plain copy: what iterating a stream yields."""

    messages: list[bytes]
    payload: list[memoryview]
    checksum: int | None


class ViewedBlock(NamedTuple):
    """A block where it is (a view of its tier's memory, or the bytes read) and the
    checksum of those bytes, which matched the stored one: what `view_batches` yields."""

    data: memoryview
    checksum: int


class _Viewed(NamedTuple):
    """`frames`' form of a `ViewedBlock` (no message, no copy)."""

    messages: list[bytes]
    payload: list[memoryview]
    checksum: int


def _viewed(index: int, data: memoryview) -> _Viewed:
    return _Viewed([], [data], checksum(data))


class _HostPlan(NamedTuple):
    """A stream whose blocks' top copies are all in one tier with host views: its rows
    (and their generations), offsets in that tier, stored checksums and sizes."""

    st: StoreTier
    rows: I64
    gens: I64
    offsets: list[int]
    checksums: list[int]
    nbytes: list[int]


def _one_copy(index: int, data: memoryview) -> _OneCopy:
    copy = bytes(data)
    return _OneCopy([copy], [memoryview(copy)], None)


class FetchPath:
    """Where fetches leave a store: what a `FetchStream` works with, by name."""

    def __init__(self, index: BlockIndex, copies: CopyBook, moves: TierMoves, counters: StoreCounters,
                 tiers: Sequence[StoreTier], config: MigrationConfig, executor: Executor | None,
                 unpin: Callable[[str], object], lease: Callable[[I64, int, bool, str], Lease]) -> None:
        """`lease(rows, ttl_ms, holds_bytes, tenant)` grants a lease under the store's
        limits, `unpin` ends one."""
        self.index = index
        self.copies = copies
        self.moves = moves
        self.counters = counters
        self.tiers = list(tiers)  # top first
        self._by_name = {t.name: t for t in self.tiers}
        self._tier_ids = {t.name: index.table.tier_id(t.name) for t in self.tiers}
        self._tier_names = tuple(index.table.tier_names)
        self.executor = executor
        self.unpin = unpin
        self.lease = lease
        # A block served from the inclusive tier (SSD) may leave a copy in the top memory tier.
        self.promote_on_hit = config.promote_on_hit and moves.inclusive is not None

    def open(self, info: NamespaceInfo, hashes: Sequence[bytes], lease_id: str = "") -> FetchStream:
        """Plan a fetch of the longest present prefix of `hashes` (checked against the
        per-call limits already); use as `async with`. `lease_id`, if given, is released
        when the stream closes: the lease's job (bridging lookup and fetch) is done."""
        ns = info.namespace_id
        entries, rows = self.index.ready_prefix([make_key(ns, h) for h in hashes])
        self.counters.fetches += 1
        return FetchStream(self, entries, info.layout.bytes_per_block, lease_id, rows)

    def lease_rows(self, rows: I64, ttl_ms: int, tier: str, tenant: str) -> tuple[str, list[int], list[int]] | None:
        """A bytes-holding lease on every row of `rows` when each of them sits in `tier`,
        with their offsets there and their checksums; None (nothing leased) when any
        does not. Counted as bytes sent to a co-located reader. What a grouped prefix's
        parts take on the shared-memory plane: all of them, or none (`GroupBook.lease_prefix`)."""
        index, c = self.index, self.counters
        tid = self._tier_ids[tier]
        if not len(rows) or bool((index.top_ids(rows) != tid).any()):
            return None
        lease_id = self.lease(rows, ttl_ms, True, tenant).lease_id
        nbytes = int(index.nbytes_of(rows).sum())
        c.bytes_out += nbytes
        c.local_bytes_out += nbytes
        self._by_name[tier].defer_touch(rows[::-1])
        return lease_id, index.offsets_in(rows, tid), index.checksums_of(rows)

    def lease_prefix(self, info: NamespaceInfo, packed: bytes, ttl_ms: int,
                     tier: str) -> tuple[PrefixLookup, list[int], list[int]]:
        """The READY prefix of a packed chain in `info`'s namespace, and a bytes-holding
        lease on its leading run of blocks in `tier`, with their offsets in that tier and
        their checksums (`Store.lease_prefix`). One probe of the chain and array steps
        over its rows; counted as a fetch of the leased blocks."""
        index, c = self.index, self.counters
        rows = index.prefix_rows(info.namespace_id, packed)
        tops = index.top_ids(rows)
        st = self._by_name[tier]
        tid = self._tier_ids[tier]
        elsewhere = np.flatnonzero(tops != tid)
        run = rows[: int(elsewhere[0])] if len(elsewhere) else rows
        lease_id = ""
        offsets: list[int] = []
        checksums: list[int] = []
        if len(run):
            lease_id = self.lease(run, ttl_ms, True, info.tenant).lease_id
            offsets = index.offsets_in(run, tid)
            checksums = index.checksums_of(run)
            nbytes = int(index.nbytes_of(run).sum())
            c.bytes_out += nbytes
            c.local_bytes_out += nbytes
            st.defer_touch(run[::-1])
        c.fetches += 1
        c.blocks_fetched += len(run)
        result = PrefixLookup(
            namespace_id=info.namespace_id,
            num_blocks=len(rows),
            block_size_tokens=info.layout.block_size_tokens,
            tier_ids=tops.tobytes(),
            tier_names=self._tier_names,
            hashes_packed=packed[: len(rows) * HASH_BYTES],
            lease_id=lease_id,
        )
        return result, offsets, checksums


class FetchStream:
    """Verified bytes of planned blocks, in order, as an async iterator.

    Each block is copied out of its highest tier right before it is sent, and the copy is
    verified against the checksum taken at put time: what leaves the daemon is exactly
    what was checked. Blocks go out one at a time, each as soon as its own copy verified,
    so sending never waits for a batch and the copy of the next block overlaps the
    transport flushing the previous one. A copy that fails is dropped from that tier and
    counted, and the block's next copy (in the tier below) is tried; when none verifies,
    the stream ends there: nothing after it is sent, nor even framed (only SSD reads
    already started ahead may have run). The stream may therefore yield fewer than
    `num_blocks` blocks: `sent` says how many it did, `ended_early` why (empty when it
    sent them all, or was closed by its consumer), `verification_failed` whether a block
    failed verification with no intact copy (else it was deleted meanwhile). Blocks on
    SSD are read ahead of the consumer (up to FETCH_AHEAD_BYTES), and a block served from
    SSD may be promoted into the top memory tier on the way out.
    """

    def __init__(self, path: FetchPath, entries: list[BlockEntry], block_bytes: int, lease_id: str,
                 rows: I64 | None = None) -> None:
        self._path = path
        self._entries = entries
        self._lease_id = lease_id
        self.num_blocks = len(entries)
        self.prefix_blocks = self.num_blocks  # the blocks of the prefix (a grouped fetch's differ)
        self.block_bytes = block_bytes
        self.sent = 0
        self.ended_early = ""
        self.verification_failed = False
        self._closed = False
        # SSD reads started ahead of the consumer, by stream position; and copies of large
        # blocks running on the hashing threads (they read tier memory these entries hold:
        # `close` waits for them before letting go of the blocks).
        self._reads: dict[int, asyncio.Task[tuple[StoreTier, bytes | None]]] = {}
        self._jobs: set[Future[Any]] = set()
        # Rows `view_batches` served in array steps, for the policies (`touch_rows`).
        self._touched: list[tuple[StoreTier, I64, I64]] = []
        # Each block is held (a reader) until `close`: in one array step where the index
        # found the entries in one (`rows`, theirs in its table), else one by one.
        self._held_rows = rows if rows is not None and len(rows) > HOLD_ONE_BY_ONE else None
        if self._held_rows is not None:
            hold_readers(path.index.table, self._held_rows)
        else:
            for entry in entries:
                path.copies.hold(entry)

    @property
    def checksums(self) -> list[int]:
        """The checksum taken at put time of each planned block, in order (a receiver
        that keeps the blocks verifies them against these)."""
        return [entry.checksum for entry in self._entries]

    async def __aenter__(self) -> FetchStream:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._reads.values():
            task.cancel()
        self._reads.clear()
        if self._jobs:
            # A copy still running reads a slot that only our hold keeps from reuse: drop
            # the copies not started, wait for the running one (one block).
            wait_futures([job for job in self._jobs if not job.cancel()])
            self._jobs.clear()
        touched, self._touched = self._touched, []
        if touched:
            touch_rows(self._path.index, touched)
        held, self._held_rows = self._held_rows, None
        if held is not None:
            release_readers(self._path.index.table, held, self._path.copies.readers_gone)
        else:
            for entry in self._entries:
                self._path.copies.release(entry)
        if self._lease_id:
            self._path.unpin(self._lease_id)

    def _view(self, entry: BlockEntry) -> tuple[StoreTier | None, memoryview | None]:
        """The tier the block is served from (its top tier), with a view of its bytes when
        that tier is host memory (`frame` copies the view, and the copy is what gets
        verified); no view when the bytes must be read (`_get`); no tier when the block
        is gone."""
        slots = entry.slots()  # one read of the block's locations (`CopyBook.top_tier` takes several)
        if not slots or entry.removed:
            return None, None
        for st in self._path.tiers:  # top first
            for slot in slots:
                if slot.tier == st.name:
                    return st, st.tier.view(slot, entry.nbytes)
        return None, None

    async def _get(self, entry: BlockEntry, st: StoreTier) -> tuple[StoreTier, bytes | None]:
        """A copy of the block read from a tier without views (SSD); None if it failed."""
        try:
            return st, await st.tier.get_block(entry.locations[st.name], entry.nbytes)
        except DataLoss as exc:
            logger.warning("block %s in tier %s: %s", entry.key.hex(), st.name, exc)
            self._path.copies.drop_bad_copy(entry, st)
            return st, None

    async def _copy_of(self, entry: BlockEntry) -> tuple[StoreTier | None, bytes | memoryview | None]:
        """The block's top copy: a view of it, or its bytes read (None if they could not
        be, the copy then dropped); no tier when no copy is left."""
        st, view = self._view(entry)
        if st is not None and view is None:
            return await self._get(entry, st)
        return st, view

    def _start_read(self, position: int) -> None:
        """Start reading the block at `position` if it has no view (SSD, HBM)."""
        entry = self._entries[position]
        st, view = self._view(entry)
        if st is not None and view is None:
            self._reads[position] = asyncio.ensure_future(self._get(entry, st))

    async def _copy_off_loop(self, frame: Callable[[int, memoryview], F], position: int,
                             data: memoryview) -> tuple[F, int]:
        executor = self._path.executor
        assert executor is not None
        job = executor.submit(frame_and_checksum, frame, position, data)
        self._jobs.add(job)
        try:
            return await asyncio.wrap_future(job)
        finally:
            if job.done():
                self._jobs.discard(job)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Each block as one verified copy."""
        async for framed in self.frames(_one_copy):
            yield framed.messages[0]

    async def frames(self, frame: Callable[[int, memoryview], F], start: int = 0,
                     stop: int | None = None) -> AsyncGenerator[F, None]:
        """Each block as the messages `frame` makes of it (e.g. wire messages), verified.

        `frame` copies the block's bytes into its messages; the checksum is then taken over
        the payload inside those messages, so what is verified is exactly what is sent,
        with a single copy out of the tier. A block up to FETCH_INLINE_BYTES is copied and
        hashed on the loop, right before it is yielded (a thread hand-off per block costs
        more than it saves: the copy holds the GIL); a larger one on a hashing thread, so
        the loop stays responsive (`frame` must then be safe to call off the loop).
        `start`, `stop`: the planned blocks from `start` up to `stop` only (`view_batches`
        hands single blocks to this path).
        """
        path = self._path
        entries = self._entries
        promote = path.promote_on_hit
        off_loop = path.executor is not None
        # Blocks without views are read ahead, concurrently: reads have been started for
        # the blocks before `ahead_end`, which hold `ahead_bytes` from the current one on.
        read_ahead = any(not st.tier.has_host_view for st in path.tiers)
        end = len(entries) if stop is None else min(stop, len(entries))
        ahead_end, ahead_bytes = start, 0
        served: list[tuple[StoreTier, BlockEntry]] = []  # for the policies, touched once at the end
        try:
            for i in range(start, end):
                entry = entries[i]
                if self._closed:
                    return
                while read_ahead and ahead_end < end and (ahead_end <= i or ahead_bytes < FETCH_AHEAD_BYTES):
                    self._start_read(ahead_end)
                    ahead_bytes += entries[ahead_end].nbytes
                    ahead_end += 1
                ahead_bytes -= entry.nbytes
                st: StoreTier | None
                data: bytes | memoryview | None
                read = self._reads.pop(i, None)
                st, data = await read if read is not None else await self._copy_of(entry)
                failed = False
                framed: F | None = None
                # Each copy that fails is dropped (counted) and the next one down is tried:
                # a block has at most one copy per tier, so this ends.
                for _ in range(len(path.tiers)):
                    if st is None or entry.removed:
                        break  # no copy left, or deleted while we read it
                    if data is None:  # its copy could not be read (dropped and counted)
                        failed = True
                        st, data = await self._copy_of(entry)
                        continue
                    view = memoryview(data)
                    if off_loop and len(view) > FETCH_INLINE_BYTES:
                        framed, got = await self._copy_off_loop(frame, i, view)
                    else:
                        framed, got = frame_and_checksum(frame, i, view)
                    if entry.removed:
                        framed = None
                        break
                    if got == entry.checksum:
                        break
                    path.copies.drop_bad_copy(entry, st)
                    failed, framed = True, None
                    st, data = await self._copy_of(entry)
                if framed is None or st is None or data is None:
                    self._end_early(i, failed)
                    return
                served.append((st, entry))
                path.counters.blocks_fetched += 1
                path.counters.bytes_out += len(view)
                if promote and st.tier.inclusive:
                    await path.moves.promote_on_hit(entry, bytes(data))  # SSD reads are bytes already: no copy
                self.sent += 1
                yield framed
        finally:
            for task in self._reads.values():
                task.cancel()
            self._reads.clear()
            touch_served(served)

    async def view_batches(self, most: int) -> AsyncGenerator[list[ViewedBlock], None]:
        """The planned blocks as `frames` gives them to a framer that sends a block from
        where it is (no copy, as the data lane does), up to `most` to a batch: each block's
        bytes and their checksum, equal to the one taken at put time.

        When every block's top copy is in one tier with host views and is small enough to
        hash on the loop (the common case: a pull of a chain from another node's host
        memory), a batch is found, viewed and checked with array steps over the blocks'
        rows, not the layers of Python steps `frames` takes per block (a pull of hundreds
        of small blocks spent milliseconds there). A block that fails its checksum or was
        removed meanwhile is handed to `frames` alone, which drops the bad copy and tries
        the next one down, or ends the stream. Otherwise the whole stream goes through
        `frames`, one block to a batch."""
        plan = self._host_plan()
        n = self.num_blocks
        if plan is None:
            each = self.frames(_viewed)
            try:
                async for framed in each:
                    yield [ViewedBlock(framed.payload[0], framed.checksum)]
            finally:
                await each.aclose()
            return
        i = 0
        while i < n and not self._closed:
            batch = self._viewed_run(plan, i, min(n, i + max(1, most)))
            if not batch:
                one = self.frames(_viewed, i, i + 1)
                try:
                    batch = [ViewedBlock(framed.payload[0], framed.checksum) async for framed in one]
                finally:
                    await one.aclose()
                if not batch:
                    return  # ended early (`ended_early` says why), or closed
            i += len(batch)
            yield batch

    def _host_plan(self) -> _HostPlan | None:
        """What `view_batches` needs to take blocks in array steps, or None where some
        block's top copy is not in the one tier with host views the others are in."""
        entries = self._entries
        if not entries or self.block_bytes > FETCH_INLINE_BYTES:
            return None
        index = self._path.index
        rows, gens = index.rows_of(entries)
        tops = index.top_ids(rows)
        tid = int(tops[0])
        if tid == 0 or (len(tops) > 1 and tops.min() != tops.max()):
            return None
        name = index.table.tier_names[tid]
        st = next((t for t in self._path.tiers if t.name == name), None)
        nbytes = index.nbytes_of(rows)
        if st is None or not st.tier.has_host_view or int(nbytes.max()) > FETCH_INLINE_BYTES:
            return None
        return _HostPlan(st, rows, gens, index.offsets_in(rows, tid), index.checksums_of(rows), nbytes.tolist())

    def _viewed_run(self, plan: _HostPlan, start: int, stop: int) -> list[ViewedBlock]:
        """The blocks from `start` (before `stop`) that are still held and whose view
        hashes to their checksum, up to the first that is not: counted as sent, and their
        rows kept for the policies' touch when the stream closes."""
        index = self._path.index
        rows, gens = plan.rows[start:stop], plan.gens[start:stop]
        held = index.held(rows, gens)
        k = len(held) if held.all() else int(np.argmin(held))
        st, tier, name = plan.st, plan.st.tier, plan.st.name
        offsets, sums, sizes = plan.offsets, plan.checksums, plan.nbytes
        out: list[ViewedBlock] = []
        for j in range(start, start + k):
            view = tier.view(Slot(name, offsets[j], sizes[j]), sizes[j])
            if view is None:
                break
            got = checksum(view)
            if got != sums[j]:
                break  # `frames` drops this copy and tries the next
            out.append(ViewedBlock(view, got))
        if out:
            # Removed while hashed: no longer sent (as `frames` checks after its copy).
            after = index.held(rows[: len(out)], gens[: len(out)])
            if not after.all():
                del out[int(np.argmin(after)):]
        if out:
            self.sent += len(out)
            counters = self._path.counters
            counters.blocks_fetched += len(out)
            counters.bytes_out += sum(sizes[start : start + len(out)])
            self._touched.append((st, rows[: len(out)], gens[: len(out)]))
        return out

    def _end_early(self, position: int, failed: bool) -> None:
        self.verification_failed = failed
        if failed:
            self.ended_early = (f"block {position} failed verification and no other copy of it verified; it was "
                                "dropped (and counted), so a new lookup no longer counts it")
        else:
            self.ended_early = f"block {position} was deleted while the fetch ran"



def touch_served(served: list[tuple[StoreTier, BlockEntry]]) -> None:
    """Tell each tier's policy of the hits of a fetch, in the order they were served: one
    vectorized call per tier instead of one per block. Blocks removed meanwhile are left
    out (their rows may already hold other blocks)."""
    by_tier: dict[str, tuple[StoreTier, list[int]]] = {}
    for st, entry in served:
        if not entry.removed:
            by_tier.setdefault(st.name, (st, []))[1].append(entry.row)
    for st, rows in by_tier.values():
        st.policy.touch_rows(np.asarray(rows, dtype=np.int64))


def touch_rows(index: BlockIndex, served: list[tuple[StoreTier, I64, I64]]) -> None:
    """`touch_served` of the rows `FetchStream.view_batches` served (tier, rows and the
    generations they were read at), one call per tier, leaving out those removed since."""
    by_tier: dict[str, tuple[StoreTier, list[I64]]] = {}
    for st, rows, gens in served:
        by_tier.setdefault(st.name, (st, []))[1].append(rows[index.held(rows, gens)])
    for st, parts in by_tier.values():
        st.policy.touch_rows(np.concatenate(parts))


def frame_and_checksum(frame: Callable[[int, memoryview], F], position: int, data: memoryview) -> tuple[F, int]:
    """The block at stream `position` made into messages, and the checksum of the
    payload inside them (what is verified is what is sent)."""
    framed = frame(position, data)
    if framed.checksum is not None:
        return framed, framed.checksum
    return framed, checksum_pieced([framed.payload])[0]


