"""The migrator: the store's background work, one periodic driver and one writer.

- The driver (Redis `performEvictions` style): each tick, every memory tier over its
  high watermark demotes its policy's victims to the next tier down in one bounded batch
  (`migrate_once`: OK / RUNNING / FAIL), until it is at or under its low watermark. A
  RUNNING batch runs the next one without waiting a tick; a put's publish wakes it. The
  last tier only evicts on demand: dropping ahead of need would lose hits for nothing.
- The write-through writer: with `write_policy="through"` (the default) every published
  block is queued, head of its chain first, and written to the inclusive tier (SSD) in
  queue order, a few blocks in flight: a crash loses at most the queue, and can cut a
  chain short but never leave its later blocks without its start. `flush` waits for the
  queue to drain. With `write_policy="back"` a block reaches SSD only when demoted.
- Room ahead of need (`make_room_soon`): a writer that reserves slots ahead of its next
  put gets them freed in the background while it copies, not inside its next call.

Every task has an owner (this object): `stop` cancels and awaits them.

Primitives: `start`, `stop`, `published`, `wake`, `migrate_once`, `make_room_soon`, `flush`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence

from kvstore.core.copies import CopyBook
from kvstore.core.index import BlockEntry, BlockIndex
from kvstore.core.moves import EVICT_BATCH, TierMoves
from kvstore.core.store_tier import StoreTier
from kvstore.core.table import I64
from kvstore.core.types import MigrationConfig, MigrationStatus, StoreCounters, WritePolicy
from kvstore.deadlines import within
from kvstore.errors import ResourceExhausted

logger = logging.getLogger(__name__)

# How many blocks the SSD writer has in flight at once (its I/O pool does the work).
SSD_WRITE_CONCURRENCY = 8


class Migrator:
    """Background movement for a store's tiers (top first)."""

    def __init__(self, index: BlockIndex, copies: CopyBook, moves: TierMoves, counters: StoreCounters,
                 tiers: Sequence[StoreTier], config: MigrationConfig, expire_leases: Callable[[], object]) -> None:
        self._index = index
        self._copies = copies
        self._moves = moves
        self._counters = counters
        self._tiers = list(tiers)
        self._by_name = {t.name: t for t in self._tiers}
        self._config = config
        self._expire_leases = expire_leases
        self._inclusive = moves.inclusive
        self._through = self._inclusive is not None and config.write_policy is WritePolicy.THROUGH
        self._queue: deque[BlockEntry] = deque()
        self._inflight = 0
        self._write_wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._migrate_wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Background evictions making room ahead of expected puts, by tier name.
        self._making_room: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    @property
    def pending_writes(self) -> int:
        """Blocks queued for the write-through writer or being written."""
        return len(self._queue) + self._inflight

    def start(self) -> None:
        if self._inclusive is not None:
            self._tasks.append(asyncio.create_task(self._writer(), name="kvstore-ssd-writer"))
        if len(self._tiers) > 1:
            self._tasks.append(asyncio.create_task(self._driver(), name="kvstore-migrator"))

    async def stop(self) -> None:
        """Cancel every background task and wait for them to end."""
        tasks = self._tasks + list(self._making_room.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks.clear()

    def cancel(self) -> None:
        """Cancel every background task (no loop to wait on: the store is closing)."""
        self._closed = True
        for task in self._tasks + list(self._making_room.values()):
            task.cancel()

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued SSD write has landed; False if `timeout_s` passed first."""
        if self._inclusive is None:
            return True
        try:
            await within(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def wake(self) -> None:
        """Something changed the tiers' use (a put landed): the driver looks now."""
        self._migrate_wakeup.set()

    def published(self, rows: I64) -> None:
        """A put's rows (in chain order) became READY: queue them for write-through, if
        that is the policy, and wake the driver."""
        if self._through and len(rows):
            # Head first: the writer follows queue order (see the module docstring).
            self._queue.extend(self._index.queue_ssd_writes(rows))
            self._idle.clear()
            self._write_wakeup.set()
        self._migrate_wakeup.set()

    # -- the write-through writer

    async def _writer(self) -> None:
        """Drain the write-through queue in put order, a few blocks in flight at a time."""
        while True:
            if not self._queue and self._inflight == 0:
                self._idle.set()
                self._write_wakeup.clear()
                await self._write_wakeup.wait()
                continue
            batch: list[BlockEntry] = []
            while self._queue and len(batch) < SSD_WRITE_CONCURRENCY:
                batch.append(self._queue.popleft())
            self._inflight += len(batch)
            try:
                await asyncio.gather(*(self._write_through(e) for e in batch))
            finally:
                self._inflight -= len(batch)

    async def _write_through(self, entry: BlockEntry) -> None:
        assert self._inclusive is not None
        if not entry.ssd_queued:
            return
        src = self._copies.top_tier(entry)
        if entry.removed or self._inclusive.name in entry.locations or src is None:
            # Out of the queue with nothing to write: its row may be recycled once removed.
            entry.ssd_queued = False
            return
        self._copies.hold(entry)
        try:
            data = await self._moves.read_verified(entry, src)
            if data is None:
                return
            await self._moves.ensure_inclusive_copy(entry, data)
        except asyncio.CancelledError:
            raise
        except OSError as exc:  # disk full or failing: expected, and one line per block is enough
            self._counters.ssd_write_failures += 1
            logger.warning("ssd write of block %s failed (%s); it stays in memory only", entry.key.hex(), exc)
        except Exception:  # task boundary: the block stays in memory, unwritten
            self._counters.ssd_write_failures += 1
            logger.exception("ssd write of block %s failed", entry.key.hex())
        finally:
            entry.ssd_queued = False
            self._copies.release(entry)

    # -- the periodic driver

    async def _driver(self) -> None:
        """One bounded batch per over-watermark tier per tick."""
        while True:
            try:
                await within(self._migrate_wakeup.wait(), self._config.tick_s)
            except TimeoutError:
                pass
            self._migrate_wakeup.clear()
            try:
                # Pins decide what is evictable: leases past their deadline end first.
                self._expire_leases()
                # The last tier only evicts on demand (see the module docstring).
                for st in self._moves.memory_tiers:
                    if self._moves.below(st) is not None and await self.migrate_once(st) is MigrationStatus.RUNNING:
                        self._migrate_wakeup.set()  # more to do: no need to wait a tick
            except asyncio.CancelledError:
                raise
            except Exception:  # task boundary: keep migrating next tick
                logger.exception("migration batch failed")

    async def migrate_once(self, st: StoreTier) -> MigrationStatus:
        """Demote at most `batch_blocks` victims of `st` if it is over its high watermark."""
        cap = st.tier.capacity_bytes
        if not st.draining:
            if st.tier.used_bytes <= st.high_watermark * cap:
                return MigrationStatus.OK
            st.draining = True
        target = st.low_watermark * cap
        moved = 0
        while st.tier.used_bytes > target and moved < self._config.batch_blocks:
            row, replica = self._moves.victim_row(st)
            if row is None:
                return MigrationStatus.FAIL
            await self._moves.evict_victim(st, row, replica)
            moved += 1
        if st.tier.used_bytes > target:
            return MigrationStatus.RUNNING
        st.draining = False
        return MigrationStatus.OK

    # -- room ahead of need

    def make_room_soon(self, tier: str, nbytes: int, block_bytes: int) -> None:
        """Evict from memory tier `tier`, in the background and in its policy's order,
        until `nbytes` of it are free: room for a put that is expected next (a writer's
        next reserve-ahead), made while the writer copies instead of inside its call.
        A put that comes first still makes room for itself, as always; a tier with
        nothing evictable is left as it is."""
        st = self._by_name.get(tier)
        if (st is None or self._closed or tier in self._making_room
                or st.tier.capacity_bytes - st.tier.used_bytes >= nbytes):
            return
        task = asyncio.get_running_loop().create_task(self._make_room(st, nbytes, block_bytes),
                                                      name=f"kvstore-room-{tier}")
        self._making_room[tier] = task
        task.add_done_callback(lambda _: self._making_room.pop(tier, None))

    async def _make_room(self, st: StoreTier, nbytes: int, block_bytes: int) -> None:
        await asyncio.sleep(0)  # after the answer that asked for it has gone out
        try:
            while (short := nbytes - (st.tier.capacity_bytes - st.tier.used_bytes)) > 0:
                # A few blocks at a time: calls in between go first.
                await self._moves.evict_some(st, block_bytes, min(EVICT_BATCH, -(-short // block_bytes)))
                await asyncio.sleep(0)
        except ResourceExhausted:
            pass  # nothing evictable now: the next put makes its own room, or says why not
        except Exception:  # task boundary: a failed eviction is the next put's to meet
            logger.exception("making room in tier %s failed", st.name)
