"""A put on the data lane (`PutTransfer`): PENDING slots reserved in a window ahead of
the blocks that landed, credit for reserved slots only, connection threads receiving
each block into its slot. See `kvstore.server.data_lane.transfer` for how the loop and the
threads meet, and `DataLaneTransfers.commit` for the publish.

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import ClassVar

import grpc

from kvstore.core.put import PutTxn
from kvstore.core.tier import Tier
from kvstore.data_lane import LaneSocket, LaneTimeout
from kvstore.deadlines import within
from kvstore.errors import DeadlineExceeded, KVStoreError, error_for_status
from kvstore.server.data_lane.transfer import DataLaneCounters, Transfer
from kvstore.v1 import kvstore_pb2

logger = logging.getLogger(__name__)

class PutTransfer(Transfer):
    """A put on the lane: PENDING slots reserved in a window ahead of the blocks that
    landed (`reserve_ahead`, on the loop, in batches: `PutTxn.extend_window`), credit
    for reserved slots only (`take_credit`), and connection threads receiving blocks
    into them (`claim`, then `landed` or `broke`); the loop commits once all landed.

    Credit, over all of a put's connections together, never exceeds the slots reserved:
    a sender takes a block only once it holds credit for it, and takes them in order, so
    the blocks it sends are always among the reserved ones; one that is not is refused
    (`claim`). The window moves on once half of it has landed, so the senders keep
    credit while the next half is reserved."""

    kind: ClassVar[str] = "put"

    def __init__(self, transfer_id: bytes, tenant: str, deadline: float, connections: int,
                 loop: asyncio.AbstractEventLoop, txn: PutTxn, header: kvstore_pb2.PutHeader, blocks: int,
                 host: Tier, counters: DataLaneCounters, idle_s: float, recv_timeout_s: float) -> None:
        super().__init__(transfer_id, tenant, deadline, connections, loop)
        self.txn = txn
        self.header = header
        # A pool's forward of several runs of one chain: the later runs (LanePutRequest.runs).
        self.runs: list[kvstore_pb2.PutRun] = []
        self.host = host
        self.block_bytes = txn.block_bytes
        self.counters = counters
        self.order = txn.needed()  # the blocks to receive, in the order their slots are reserved
        needed = bytearray(blocks)
        for i in self.order:
            needed[i] = 1
        self.needed = bytes(needed)
        self.views: list[memoryview | None] = [None] * blocks  # set as slots are reserved
        self.missing = len(self.order)
        self.claimed = bytearray(blocks)
        self.sums = [0] * blocks
        self.writers = 0
        self.committing = False
        self.ending = False  # forgotten and rolled back, or about to be
        self.window_blocks = max(1, txn.window_blocks)
        self.batch_blocks = max(1, self.window_blocks // 2)
        self.reserved = 0  # leading blocks of `order` with a slot
        self.credited = 0  # blocks of credit granted, all connections together (<= reserved)
        self.reserving = False  # the loop reserves more slots now (or was asked to)
        self.idle_s = idle_s
        self.recv_timeout_s = recv_timeout_s  # what a connection of this put waits for bytes
        self.active_at = time.monotonic()  # last sign of life from the client (or work of the daemon's)
        self.idle_timer: asyncio.TimerHandle | None = None
        # A grouped put's transfers (this one among them), sent one after another: the
        # put is idle only when all of them are.
        self.group: list[PutTransfer] = []
        # Called on the loop when the transfer fails (set by `DataLaneTransfers`).
        self.on_failed: Callable[[], None] | None = None
        self._released = False
        self._landed = asyncio.Event()  # all needed blocks landed, or the transfer failed
        self._idle = asyncio.Event()
        self._more = asyncio.Event()  # `reserving` was set, or the transfer failed or closed
        if not self.missing:
            self._landed.set()

    def _on_failed(self) -> None:
        self.wake(self._landed)
        self.wake(self._more)
        if self.on_failed is not None:
            try:
                self.loop.call_soon_threadsafe(self.on_failed)
            except RuntimeError:  # the loop is closed: the daemon is gone
                pass

    def idle_message(self) -> str:
        return (f"the data lane put sent nothing for {self.idle_s:g} s (put_idle_timeout_s); it was rolled back and "
                "nothing of it was stored: send its blocks without pauses, then commit")

    # -------------------------------------------------------------- loop side: the window

    async def reserve_ahead(self) -> None:
        """Slots for the blocks after those reserved, up to a window ahead of the blocks
        that landed (making room as a put does)."""
        with self.lock:
            landed = len(self.order) - self.missing
            count = min(landed + self.window_blocks, len(self.order)) - self.reserved
        positions = await self.txn.extend_window(count) if count > 0 else []
        nb, host = self.block_bytes, self.host
        with self.lock:
            if self.closed or self.failed is not None:
                # Rolled back meanwhile: the transaction frees them.
                self.reserving = False
                return
            views = self.views
            txn = self.txn
            for i in positions:
                slot = txn.slot(i)
                assert slot is not None
                views[i] = host.view(slot, nb)
            self.reserved += len(positions)
            self.active_at = time.monotonic()
            self.reserving = self._wants_slots()
            self.lock.notify_all()  # connections waiting for credit
        self.counters.reserved(len(positions) * nb)

    def _wants_slots(self) -> bool:
        """(under the lock) Whether half a window has landed since the last reservation."""
        total = len(self.order)
        return (self.reserved < total
                and total - self.missing + self.window_blocks - self.reserved >= self.batch_blocks)

    async def keep_reserving(self) -> None:
        """Move the window on whenever a connection asks (`landed`), until every block has
        a slot or the transfer ends. A put that finds no room fails; its slots are freed."""
        while True:
            await self.until(self._more, lambda: self.failed is not None or self.closed or self.reserving)
            with self.lock:
                if self.failed is not None or self.closed:
                    return
            try:
                await self.reserve_ahead()
            except KVStoreError as exc:
                self.fail(exc.code, f"data lane put: {exc}")
                return
            with self.lock:
                if self.reserved >= len(self.order):
                    return

    # -------------------------------------------------------------- connection threads

    def join(self, sock: LaneSocket) -> bool:
        with self.lock:
            if self.closed or self.failed is not None:
                return False
            self.joined += 1
            self.active_at = time.monotonic()
            return True

    def take_credit(self, most: int, wait: bool) -> int:
        """Credit for one connection: up to `most` blocks of the reserved slots no
        connection has credit for yet. With `wait`, waits until there are some, or until
        every block the put needs has credit (0: this connection gets no more). Raises
        `KVStoreError` if the transfer failed or passed its deadline."""
        with self.lock:
            while True:
                if self.failed is not None:
                    raise error_for_status(self.failed.code, self.failed.message)
                if self.closed:  # committed: every block had its credit
                    return 0
                free = self.reserved - self.credited
                if free > 0 and most > 0:
                    got = min(most, free)
                    self.credited += got
                    if self.credited >= len(self.order):
                        self.lock.notify_all()  # connections waiting for credit get none
                    return got
                if not wait or self.credited >= len(self.order):
                    return 0
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded("the data lane put passed its deadline waiting for room")
                self.lock.wait(left)

    def claim(self, block: int, length: int, sock: LaneSocket) -> memoryview | None:
        """The slot to receive block `block` into, or None when the transfer failed or
        closed (the caller reads the frame and drops it). A block the put does not need,
        one sent twice, of the wrong size, or one whose slot is not reserved (sent ahead
        of the window) fails the transfer."""
        with self.lock:
            if self.closed or self.failed is not None:
                return None
            problem = ""
            if not 0 <= block < len(self.views):
                problem = f"block {block} is not part of this put of {len(self.views)} blocks"
            elif not self.needed[block]:
                problem = f"block {block} was already stored; the put did not ask for it"
            elif self.claimed[block]:
                problem = f"block {block} was sent twice"
            elif length != self.block_bytes:
                problem = f"block {block} is {length} bytes; a block of this namespace is {self.block_bytes}"
            elif self.views[block] is None:
                problem = (f"block {block} was sent ahead of the put's window (its slot is not reserved yet); a "
                           "sender takes a put's blocks in order, each once it holds credit for it")
            if not problem:
                self.claimed[block] = 1
                self.writers += 1
                self.sockets.add(sock)
                self.active_at = time.monotonic()
                return self.views[block]
        self.fail(grpc.StatusCode.INVALID_ARGUMENT, f"data lane put: {problem}")
        return None

    def landed(self, block: int, got: int, want: int, sock: LaneSocket) -> None:
        bad = got != want
        more = False
        with self.lock:
            self.writers -= 1
            self.sockets.discard(sock)
            if not bad:
                self.sums[block] = got
                self.missing -= 1
                self.active_at = time.monotonic()
                if not self.reserving and self._wants_slots():
                    self.reserving = more = True
            complete = not bad and self.missing == 0
            idle = self.writers == 0 and self.closed
        if bad:
            self.counters.add("blocks_rejected")
            logger.warning("data lane put: block %d failed its checksum on arrival; the put is refused", block)
            self.fail(grpc.StatusCode.DATA_LOSS,
                      f"block {block} failed its checksum on arrival over the data lane; nothing of the put was "
                      "stored: retry it")
        else:
            self.counters.landed(self.block_bytes)
        if more:
            self.wake(self._more)
        if complete:
            self.wake(self._landed)
        if idle:
            self.wake(self._idle)

    def broke(self, block: int, error: BaseException, sock: LaneSocket) -> None:
        """Receiving block `block` failed midway (the connection broke, or its sender
        stopped: nothing arrived for `recv_timeout_s`)."""
        with self.lock:
            self.writers -= 1
            self.sockets.discard(sock)
            idle = self.writers == 0 and self.closed
        if (isinstance(error, LaneTimeout) and self.recv_timeout_s >= self.idle_s
                and time.monotonic() < self.deadline):
            self.fail(grpc.StatusCode.DEADLINE_EXCEEDED, self.idle_message())
        else:
            self.fail(grpc.StatusCode.UNAVAILABLE,
                      f"the data lane connection broke while block {block} arrived: {error}")
        if idle:
            self.wake(self._idle)

    # -------------------------------------------------------------- loop side

    async def wait_landed(self, timeout_s: float) -> None:
        """Until every needed block has landed verified; raises what failed the transfer."""
        try:
            await within(self._landed.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            raise DeadlineExceeded(
                f"{self.missing} blocks of the put had not arrived on the data lane by its deadline; nothing was "
                "stored") from None
        if self.failed is not None:
            raise error_for_status(self.failed.code, self.failed.message)

    async def close(self) -> None:
        """No thread receives into the slots once this returns (and this transfer holds
        no view of them any more)."""
        with self.lock:
            self.closed = True
            busy = self.writers
            self.lock.notify_all()  # connections waiting for credit
        self._more.set()
        if busy:
            self.shut_sockets()
            await self.until(self._idle, lambda: self.writers == 0)
        with self.lock:
            self.views = []
            ahead = 0 if self._released else self.reserved - (len(self.order) - self.missing)
            self._released = True
        if ahead:
            self.counters.reserved(-ahead * self.block_bytes)
