"""Data lane transfers: the puts and fetches whose bytes move on the lane
(`kvstore.server.datalane`), opened by control calls (`DataLane`, `LaneFetch`,
`LanePut`, `LaneCommit`) that the servicer delegates here.

Primitives: `LaneTransfers` (`offer`, `open_fetch`, `open_put`, `commit`, and for the
lane's connection threads `fetch_transfer` / `put_transfer`), `FetchTransfer`,
`PutTransfer`, `LaneCounters`, `LaneSettings`.

Two kinds of threads meet here. The event loop owns the store: it opens a transfer,
runs a fetch's `FetchStream` (each block copied out of nothing: the store verifies the
tier's bytes in place, and the lane sends them from there) and commits or aborts a put's
`PutTxn`. Each lane connection has a thread of its own doing blocking socket I/O, so
bytes move in parallel and without the loop: a fetch's connection threads take verified
blocks from the transfer's hand-off queue and send them; a put's receive each block
straight into its PENDING slot, hashing it as it lands. The shared state of a transfer
is guarded by its own lock; the loop is woken with `call_soon_threadsafe`.

A put holds little ahead of its bytes, as a Put stream does: its slots are reserved by
`PutTxn`'s window (`extend_window`), at most `put_window_bytes` (max_put_reserve_bytes)
ahead of the blocks that landed, the first window when it opens and the next half as
each half lands; the credit its connections get is taken out of reserved slots only.
A put whose client sends nothing for `put_idle_timeout_s` is rolled back.

Ordering decisions that matter:
- Memory is never let go while a thread uses it. A fetch's blocks stay held (readers)
  until every thread that took one has finished sending it; a put's slots are freed
  (abort) or published (commit) only when no thread is receiving into them. Closing a
  transfer first refuses new work, then shuts the sockets of threads still at it (they
  fail at once), then waits for them.
- A put is all or nothing: a block that fails its checksum on arrival, a connection that
  breaks mid-block, a block sent twice or ahead of the window, a put that finds no room
  mid-way or whose client stalls fails the whole transfer; it is rolled back at once
  (its slots freed once no thread receives into them), its commit answers the error,
  and nothing was ever visible (`PutTxn`).
- A fetch ends at the first block the store could not verify (as the Fetch stream does);
  the lane's END frame carries how many blocks the result has.
- Every transfer has a deadline (the client's, capped): past it the transfer is closed
  and its blocks or slots released, whoever still holds a connection to it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, cast

import grpc

from kvstore.core.fetch import FetchStream
from kvstore.core.put import PutTxn
from kvstore.core.store import Store
from kvstore.core.tier import Tier
from kvstore.datalane import VERSION, LaneSocket, LaneTimeout, checksum_of
from kvstore.errors import DeadlineExceeded, FailedPrecondition, KVStoreError, ResourceExhausted, error_for_status
from kvstore.server.auth import current_identity
from kvstore.server.cluster import forward_put
from kvstore.server.requests import RequestResolver, UnregisteredLayout, hash_fields, packed_reply
from kvstore.tiers import HOST
from kvstore.v1 import kvstore_pb2

if TYPE_CHECKING:
    from kvstore.cluster.pool import ClusterNode

logger = logging.getLogger(__name__)

# A transfer that names no deadline (timeout_ms 0), and the longest one may name.
DEFAULT_TRANSFER_S = 30.0
MAX_TRANSFER_S = 600.0
# After a fetch's last block is taken, how long it waits for connections the client said
# would join and have not (one that failed on the client's side never will).
LATE_JOIN_GRACE_S = 1.0
# Verified blocks a fetch keeps ready ahead of its senders, per connection: at least two
# blocks, else up to this many bytes (views of tier memory cost nothing; blocks read from
# SSD are copies, and are read ahead by at most FETCH_AHEAD_BYTES anyway). The loop is
# woken to verify more once half of them are taken: one wake-up per several blocks.
READY_BYTES_PER_CONNECTION = 16 << 20
# A grouped block is parts that only some prefix ends have: it moves as Put and Fetch do.
GROUPED_NOT_ON_LANE = "a layout with KV groups moves as gRPC bytes (Put and Fetch), not on the data lane"


@dataclass(frozen=True, slots=True)
class LaneSettings:
    """What the lane promises and enforces (config keys `data_lane_*`)."""

    window_bytes: int = 32 << 20
    max_connections_per_transfer: int = 4
    io_timeout_s: float = 30.0
    max_transfers: int = 1024
    max_block_bytes: int = 256 << 20
    # A put's window and idle deadline: those of a Put stream (max_put_reserve_bytes,
    # put_idle_timeout_s).
    put_window_bytes: int = 64 << 20
    put_idle_timeout_s: float = 30.0


class LaneCounters:
    """The lane's counters (scraped as `kvstore_datalane_*`). Threads add to them; a lock
    keeps the sums exact (a `+=` is not atomic across threads)."""

    FIELDS = ("bytes_in", "bytes_out", "blocks_in", "blocks_out", "blocks_rejected", "transfers_fetch",
              "transfers_put", "transfers_failed", "connections", "connections_total", "connections_refused",
              "committed_bytes_in", "served_bytes_out", "put_reserved_bytes", "put_reserved_peak_bytes")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(self.FIELDS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n

    def get(self, name: str) -> int:
        return self.values[name]

    def reserved(self, nbytes: int) -> None:
        """Slots of lane puts reserved (or, negative, let go) ahead of their bytes."""
        with self._lock:
            values = self.values
            now = values["put_reserved_bytes"] = values["put_reserved_bytes"] + nbytes
            if now > values["put_reserved_peak_bytes"]:
                values["put_reserved_peak_bytes"] = now

    def landed(self, nbytes: int) -> None:
        """A lane put's block landed verified in its reserved slot."""
        with self._lock:
            values = self.values
            values["blocks_in"] += 1
            values["bytes_in"] += nbytes
            values["put_reserved_bytes"] -= nbytes


class TransferFailed(NamedTuple):
    code: grpc.StatusCode
    message: str


class Transfer:
    """What both kinds share: an id, an owner, a deadline, a lock, the loop."""

    kind: ClassVar[str] = ""

    def __init__(self, transfer_id: bytes, tenant: str, deadline: float, connections: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.id = transfer_id
        self.tenant = tenant
        # The node whose node-to-node call opened it (else ""): a cluster credential's lane
        # connection may join it whatever tenant it is for.
        self.peer = ""
        self.deadline = deadline  # time.monotonic()
        self.connections = connections
        self.loop = loop
        self.lock = threading.Condition()
        self.failed: TransferFailed | None = None
        self.closed = False
        self.joined = 0
        # Sockets of the connections working on this transfer now (shut on close).
        self.sockets: set[LaneSocket] = set()

    def wake(self, event: asyncio.Event) -> None:
        """Set a loop-side event from any thread."""
        try:
            self.loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop is closed: the daemon is gone
            pass

    async def until(self, event: asyncio.Event, done: Callable[[], bool]) -> None:
        """On the loop: wait until `done()` (read under the lock) holds. A thread that
        changes what `done` reads wakes `event` after it let go of the lock, so a wake
        is never lost; one left over from before only makes the loop look again."""
        while True:
            with self.lock:
                if done():
                    return
                event.clear()
            await event.wait()

    def fail(self, code: grpc.StatusCode, message: str) -> bool:
        """Mark the transfer failed (the first reason wins); True if it was not yet."""
        with self.lock:
            if self.failed is not None:
                return False
            self.failed = TransferFailed(code, message)
            self.lock.notify_all()
        self._on_failed()
        return True

    def _on_failed(self) -> None:
        pass

    def shut_sockets(self) -> None:
        with self.lock:
            socks = list(self.sockets)
        for sock in socks:
            sock.shutdown()


class ReadyBlock(NamedTuple):
    position: int
    data: memoryview
    checksum: int


class _LaneFramed(NamedTuple):
    """A block as the lane sends it: its bytes where they are (no message, no copy); the
    checksum is taken over them, so what is verified is what is sent."""

    messages: list[bytes]
    payload: list[memoryview]
    checksum: int | None


def _lane_frame(index: int, data: memoryview) -> _LaneFramed:
    return _LaneFramed([], [data], checksum_of(data))


class FetchTransfer(Transfer):
    """A fetch on the lane: the loop verifies blocks into a bounded hand-off queue
    (`pump`); each joined connection's thread takes blocks from it (`take`) as its credit
    allows, sends them, and leaves after END."""

    kind: ClassVar[str] = "fetch"

    def __init__(self, transfer_id: bytes, tenant: str, deadline: float, connections: int,
                 loop: asyncio.AbstractEventLoop, stream: FetchStream, counters: LaneCounters) -> None:
        super().__init__(transfer_id, tenant, deadline, connections, loop)
        self.stream = stream
        self.block_bytes = stream.block_bytes
        self.counters = counters
        self.ready: deque[ReadyBlock] = deque()
        self.max_ready = connections * max(2, READY_BYTES_PER_CONNECTION // max(1, stream.block_bytes))
        self._producer_waits = False
        self.end: int | None = None  # blocks in the result, once the stream is done
        self.sending = 0  # blocks taken by a thread whose send has not finished
        self.left = 0
        self._space = asyncio.Event()
        self._idle = asyncio.Event()  # every connection left, or none is sending after a failure

    # -------------------------------------------------------------- loop side

    async def pump(self) -> None:
        """Verify the planned blocks into the queue, then wait until every connection has
        left (or the transfer failed); the stream is closed once no thread sends from it."""
        # Closed explicitly: a generator left to the collector would keep views of tier
        # memory (which must be gone before the tier's segment is unmapped).
        frames = cast(AsyncGenerator[_LaneFramed, None], self.stream.frames(_lane_frame))  # an async generator
        try:
            served = 0
            async for framed in frames:
                assert framed.checksum is not None
                with self.lock:
                    self._producer_waits = len(self.ready) >= self.max_ready
                if self._producer_waits:
                    await self.until(self._space, lambda: self.failed is not None or
                                     len(self.ready) <= self.max_ready // 2)
                with self.lock:
                    if self.failed is not None:
                        return
                    self.ready.append(ReadyBlock(served, framed.payload[0], framed.checksum))
                    self.lock.notify()
                del framed
                served += 1
                self.counters.add("served_bytes_out", self.block_bytes)
            with self.lock:
                self.end = served
                self.lock.notify_all()
            try:
                await asyncio.wait_for(self.until(self._idle, lambda: self.failed is not None or
                                                  (self.left >= self.connections and self.sending == 0)),
                                       LATE_JOIN_GRACE_S)
            except TimeoutError:
                # A connection the client meant to join never did (it failed on the way):
                # the blocks are released once those that joined took them all and left.
                await self.until(self._idle, lambda: self.failed is not None or (
                    not self.ready and self.joined > 0 and self.left >= self.joined and self.sending == 0))
        finally:
            await frames.aclose()
            await self._release()

    async def _release(self) -> None:
        """Close the stream once no thread sends from its blocks: threads still sending
        (after a failure or the deadline) have their sockets shut, and fail at once."""
        with self.lock:
            self.closed = True
            self.ready.clear()
            busy = self.sending
            self.lock.notify_all()
        if busy:
            self.shut_sockets()
            await self.until(self._idle, lambda: self.sending == 0)
        self.stream.close()

    def _on_failed(self) -> None:
        with self.lock:
            self.ready.clear()
        self.wake(self._space)
        self.wake(self._idle)

    # -------------------------------------------------------------- connection threads

    def join(self, sock: LaneSocket) -> bool:
        with self.lock:
            if self.closed or self.failed is not None or self.joined >= self.connections:
                return False
            self.joined += 1
            self.sockets.add(sock)
            return True

    def take(self, deadline: float) -> ReadyBlock | int:
        """The next verified block, or the END count; raises `KVStoreError` if the
        transfer failed or its deadline passed. The caller must call `sent` after a block."""
        with self.lock:
            while True:
                if self.failed is not None:
                    raise error_for_status(self.failed.code, self.failed.message)
                if self.ready:
                    block = self.ready.popleft()
                    self.sending += 1
                    wake = self._producer_waits and len(self.ready) <= self.max_ready // 2
                    if wake:
                        self._producer_waits = False
                    break
                if self.end is not None:
                    return self.end
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded("the fetch transfer passed its deadline")
                self.lock.wait(left)
        if wake:
            self.wake(self._space)
        return block

    def finished(self) -> int | None:
        """The END count once every block has been taken (None while some may come)."""
        with self.lock:
            return self.end if self.end is not None and not self.ready else None

    def sent(self) -> None:
        with self.lock:
            self.sending -= 1
            idle = self.sending == 0 and (self.closed or self.failed is not None)
        self.counters.add("blocks_out")
        self.counters.add("bytes_out", self.block_bytes)
        if idle:
            self.wake(self._idle)

    def abandon(self, reason: str) -> None:
        """A taken block was not sent (the connection broke): the fetch cannot complete."""
        with self.lock:
            self.sending -= 1
        self.fail(grpc.StatusCode.UNAVAILABLE, f"a data lane connection broke mid-fetch: {reason}")
        self.wake(self._idle)

    def leave(self, sock: LaneSocket) -> None:
        with self.lock:
            self.sockets.discard(sock)
            self.left += 1
        self.wake(self._idle)


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
                 host: Tier, counters: LaneCounters, idle_s: float, recv_timeout_s: float) -> None:
        super().__init__(transfer_id, tenant, deadline, connections, loop)
        self.txn = txn
        self.header = header
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
        # Called on the loop when the transfer fails (set by `LaneTransfers`).
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
            await asyncio.wait_for(self._landed.wait(), max(timeout_s, 0.0))
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


class LaneTransfers:
    """The open transfers of one daemon, and the control calls that open and end them."""

    def __init__(self, store: Store, resolver: RequestResolver, settings: LaneSettings,
                 endpoints: Callable[[], list[kvstore_pb2.DataLaneEndpoint]]) -> None:
        self.store = store
        self.resolver = resolver
        self.settings = settings
        self.counters = LaneCounters()
        self._endpoints = endpoints
        # The pool this daemon is one of (kvstore.server.cluster); None on a single daemon.
        self.cluster: ClusterNode | None = None
        self._open: dict[bytes, Transfer] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timers: dict[bytes, asyncio.TimerHandle] = {}
        self._closing = False
        # Why recent puts failed, for their LaneCommit and senders that come late (they
        # are rolled back at once). Connection threads read it: under its own lock.
        self._failed_puts: OrderedDict[bytes, tuple[str, str, TransferFailed]] = OrderedDict()
        self._failed_lock = threading.Lock()
        host = next((st.tier for st in store.tiers if st.name == HOST), None)
        self._host = host

    def __len__(self) -> int:
        return len(self._open)

    # -------------------------------------------------------------- control calls

    def offer(self) -> kvstore_pb2.DataLaneResponse:
        endpoints = self._endpoints()
        return kvstore_pb2.DataLaneResponse(
            endpoints=endpoints, max_connections=self.settings.max_connections_per_transfer if endpoints else 0,
            version=VERSION, max_block_bytes=self.settings.max_block_bytes)

    def _deadline(self, timeout_ms: int) -> tuple[float, float]:
        """(monotonic deadline, loop deadline) of a transfer asking for `timeout_ms`."""
        seconds = min(timeout_ms / 1000.0 if timeout_ms else DEFAULT_TRANSFER_S, MAX_TRANSFER_S)
        return time.monotonic() + seconds, asyncio.get_running_loop().time() + seconds

    def _connections(self, asked: int) -> int:
        return max(1, min(asked or 1, self.settings.max_connections_per_transfer))

    def _admit(self) -> None:
        if self._closing:
            raise FailedPrecondition("the data lane is closing; use Put and Fetch")
        if len(self._open) >= self.settings.max_transfers:
            raise ResourceExhausted(f"{len(self._open)} data lane transfers are open, the most this daemon allows; "
                                    "retry, or use Put and Fetch")

    def _register(self, transfer: Transfer, loop_deadline: float) -> None:
        self._open[transfer.id] = transfer
        loop = asyncio.get_running_loop()
        self._timers[transfer.id] = loop.call_at(loop_deadline, self._expire, transfer.id)

    def _forget(self, transfer: Transfer) -> None:
        if self._open.get(transfer.id) is transfer:
            del self._open[transfer.id]
        timer = self._timers.pop(transfer.id, None)
        if timer is not None:
            timer.cancel()
        if isinstance(transfer, PutTransfer) and transfer.idle_timer is not None:
            transfer.idle_timer.cancel()
            transfer.idle_timer = None

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def open_fetch(self, request: kvstore_pb2.LaneFetchRequest) -> kvstore_pb2.LaneFetchResponse:
        self._admit()
        resolver = self.resolver
        fetch = request.fetch
        try:
            ns_id = resolver.namespace(fetch.namespace)
        except UnregisteredLayout as unknown:  # a layout nothing was put in: a miss, as for Fetch
            resolver.check_keys(fetch.keys, unknown.layout)
            lease_id = resolver.tags.untag(fetch.lease_id)
            if lease_id:  # released when a fetch ends, whatever it found
                self.store.unpin(lease_id)
            return kvstore_pb2.LaneFetchResponse(block_bytes=unknown.layout.bytes_per_block,
                                                 namespace_id=unknown.namespace_id)
        if self.store.namespace(ns_id).layout.groups:
            raise FailedPrecondition(GROUPED_NOT_ON_LANE)
        hashes = resolver.hashes(ns_id, fetch.keys)
        cluster = self.cluster
        if cluster is not None:  # as for a gRPC Fetch
            peer = current_identity().peer
            if peer:
                cluster.peer_fetched(ns_id, hashes)
            else:
                await cluster.settle_fetch(ns_id, hashes)  # blocks a lookup is copying here
        stream = self.store.open_fetch(ns_id, hashes, resolver.tags.untag(fetch.lease_id))
        assert isinstance(stream, FetchStream)  # grouped layouts were refused above
        resp = kvstore_pb2.LaneFetchResponse(num_blocks=stream.num_blocks, block_bytes=stream.block_bytes,
                                             namespace_id=ns_id)
        if not stream.num_blocks:
            stream.close()
            return resp
        deadline, loop_deadline = self._deadline(request.timeout_ms)
        transfer = FetchTransfer(secrets.token_bytes(16), current_identity().tenant, deadline,
                                 self._connections(request.connections), asyncio.get_running_loop(), stream,
                                 self.counters)
        transfer.peer = current_identity().peer
        self._register(transfer, loop_deadline)
        self.counters.add("transfers_fetch")
        self._spawn(self._run_fetch(transfer), "kvstore-lane-fetch")
        resp.transfer_id = transfer.id
        resp.expires_in_ms = int((deadline - time.monotonic()) * 1000)
        return resp

    async def _run_fetch(self, transfer: FetchTransfer) -> None:
        try:
            await transfer.pump()
        except Exception:  # task boundary: the transfer fails, its blocks are released
            logger.exception("data lane fetch failed")
            transfer.fail(grpc.StatusCode.INTERNAL, "the daemon failed this fetch; see its log")
        finally:
            if transfer.failed is not None:
                self.counters.add("transfers_failed")
            self._forget(transfer)

    async def open_put(self, request: kvstore_pb2.LanePutRequest) -> kvstore_pb2.LanePutResponse:
        self._admit()
        if self._host is None:
            raise FailedPrecondition("this daemon has no host tier for data lane puts; use Put")
        resolver, store, settings = self.resolver, self.store, self.settings
        header = request.header
        info = resolver.put_namespace(header.namespace)  # filed when the put publishes
        if info.layout.groups:
            raise FailedPrecondition(GROUPED_NOT_ON_LANE)
        hashes, parent = resolver.put_keys(info, header)
        resolver.put_session(header)  # checked now; applied at commit
        # Slots are reserved a window at a time as the blocks land, as for a Put stream.
        txn = store.begin_put(info, hashes, parent, tier=HOST, window_bytes=settings.put_window_bytes)
        await txn.reserve()
        try:
            deadline, loop_deadline = self._deadline(request.timeout_ms)
            transfer = PutTransfer(secrets.token_bytes(16), current_identity().tenant, deadline,
                                   self._connections(request.connections), asyncio.get_running_loop(), txn, header,
                                   len(hashes), self._host, self.counters, settings.put_idle_timeout_s,
                                   min(settings.io_timeout_s, settings.put_idle_timeout_s))
            # The first window now: the connections get credit as soon as they join.
            await transfer.reserve_ahead()
        except BaseException:
            txn.abort()
            raise
        transfer.peer = current_identity().peer
        self._register(transfer, loop_deadline)
        transfer.on_failed = lambda: self._put_failed(transfer)
        self._arm_idle(transfer, settings.put_idle_timeout_s)
        if transfer.reserved < len(transfer.order):
            self._spawn(self._run_reserver(transfer), "kvstore-lane-reserve")
        self.counters.add("transfers_put")
        return kvstore_pb2.LanePutResponse(transfer_id=transfer.id, needed=transfer.needed,
                                           block_bytes=transfer.block_bytes, namespace_id=info.namespace_id,
                                           expires_in_ms=int((deadline - time.monotonic()) * 1000))

    async def _run_reserver(self, transfer: PutTransfer) -> None:
        try:
            await transfer.keep_reserving()
        except Exception:  # task boundary: the put fails, its slots are freed
            logger.exception("data lane put failed while reserving slots")
            transfer.fail(grpc.StatusCode.INTERNAL, "the daemon failed this put; see its log")

    def _arm_idle(self, transfer: PutTransfer, delay_s: float) -> None:
        transfer.idle_timer = asyncio.get_running_loop().call_later(delay_s, self._check_idle, transfer)

    def _check_idle(self, transfer: PutTransfer) -> None:
        """Roll back a put whose client sent nothing for `put_idle_timeout_s`. A block on
        its way is bounded by its connection's receive timeout instead, and the daemon's
        own work (making room) is not the client's silence."""
        transfer.idle_timer = None
        if transfer.ending or self._open.get(transfer.id) is not transfer:
            return
        idle_s = self.settings.put_idle_timeout_s
        now = time.monotonic()
        with transfer.lock:
            if transfer.committing and transfer.missing == 0:
                return  # every byte is in; the commit publishes
            if transfer.writers or transfer.reserving:
                transfer.active_at = now
            quiet_s = now - transfer.active_at
        if quiet_s < idle_s:
            self._arm_idle(transfer, idle_s - quiet_s)
            return
        logger.info("data lane put sent nothing for %g s; rolled back", idle_s)
        transfer.fail(grpc.StatusCode.DEADLINE_EXCEEDED, transfer.idle_message())

    def _put_failed(self, transfer: PutTransfer) -> None:
        """(on the loop) A put failed: roll it back now, and keep why for its LaneCommit.
        A commit under way rolls back itself."""
        failed = transfer.failed
        if transfer.ending or transfer.committing or failed is None:
            return
        with self._failed_lock:
            self._failed_puts[transfer.id] = (transfer.tenant, transfer.peer, failed)
            while len(self._failed_puts) > max(16, self.settings.max_transfers):
                self._failed_puts.popitem(last=False)
        self.counters.add("transfers_failed")
        self._end(transfer)

    def _end(self, transfer: PutTransfer) -> None:
        """Forget a put and roll it back (once no thread receives into its slots)."""
        if transfer.ending:
            return
        transfer.ending = True
        self._forget(transfer)
        self._spawn(self._roll_back(transfer), "kvstore-lane-abort")

    async def commit(self, request: kvstore_pb2.LaneCommitRequest) -> kvstore_pb2.PutResponse:
        transfer = self._open.get(request.transfer_id)
        tenant = current_identity().tenant
        if (not isinstance(transfer, PutTransfer) or transfer.tenant != tenant or transfer.committing
                or transfer.ending):
            why = self.put_failure(request.transfer_id, tenant)
            if why is not None:
                with self._failed_lock:
                    self._failed_puts.pop(request.transfer_id, None)
                if request.abort:
                    return kvstore_pb2.PutResponse()
                raise error_for_status(why.code, why.message)
            raise FailedPrecondition("this data lane put is not open: it was committed, aborted, or rolled back "
                                     "after its deadline; put the blocks again")
        txn = transfer.txn
        if request.abort:
            self._end(transfer)
            transfer.fail(grpc.StatusCode.ABORTED, "the client aborted the put")
            return kvstore_pb2.PutResponse()
        # Blocks may still be landing: the transfer stays findable by the lane's threads
        # until the commit is done; its deadline now bounds the wait below instead.
        transfer.committing = True
        timer = self._timers.pop(transfer.id, None)
        if timer is not None:
            timer.cancel()
        try:
            try:
                await transfer.wait_landed(transfer.deadline - time.monotonic())
                await transfer.close()
            finally:
                self._forget(transfer)
            txn.mark_written()
            result = await txn.commit(transfer.sums)
        except BaseException as exc:
            if isinstance(exc, KVStoreError):
                self.counters.add("transfers_failed")
            transfer.fail(grpc.StatusCode.ABORTED, "the put failed")
            # Not awaited here: a cancelled commit must still roll back, once no thread
            # receives into the slots.
            self._end(transfer)
            raise
        self.counters.add("committed_bytes_in", result.stored * transfer.block_bytes)
        header = transfer.header
        session = self.resolver.put_session(header)
        if session:
            self.store.hint(result.namespace_id, result.block_hashes, session, header.hint.expect_reuse_within_s)
        resp = kvstore_pb2.PutResponse(stored=result.stored, existing=result.existing,
                                       namespace_id=result.namespace_id,
                                       **hash_fields(result.block_hashes, packed_reply(header.keys)))
        if self.cluster is not None:  # as for a gRPC Put: forwarded to its units' owners
            hashes, parent = self.resolver.put_keys(self.store.namespace(result.namespace_id), header)
            await forward_put(self.cluster, result.namespace_id, hashes, parent, header, resp,
                              current_identity().peer)
        return resp

    async def _roll_back(self, transfer: PutTransfer) -> None:
        try:
            await transfer.close()
        finally:
            transfer.txn.abort()

    def _expire(self, transfer_id: bytes) -> None:
        transfer = self._open.get(transfer_id)
        self._timers.pop(transfer_id, None)
        if transfer is None:
            return
        logger.info("data lane %s transfer expired before it finished", transfer.kind)
        if isinstance(transfer, PutTransfer):
            self._end(transfer)
            self.counters.add("transfers_failed")
        transfer.fail(grpc.StatusCode.DEADLINE_EXCEEDED, f"the data lane {transfer.kind} passed its deadline")
        # A fetch's pump sees the failure, releases its blocks and forgets it.

    # -------------------------------------------------------------- connection threads

    def fetch_transfer(self, transfer_id: bytes, tenant: str, peer: bool = False) -> FetchTransfer | None:
        """The open fetch `transfer_id` of `tenant` (another tenant's is not found); with
        `peer` (a cluster credential's connection), also one a node-to-node call opened."""
        transfer = self._open.get(transfer_id)
        if isinstance(transfer, FetchTransfer) and (transfer.tenant == tenant or (peer and transfer.peer)):
            return transfer
        return None

    def put_failure(self, transfer_id: bytes, tenant: str, peer: bool = False) -> TransferFailed | None:
        """Why `tenant`'s put `transfer_id` failed, if it did so lately (and was let go);
        with `peer`, also one a node-to-node call opened."""
        with self._failed_lock:
            failed = self._failed_puts.get(transfer_id)
        return failed[2] if failed is not None and (failed[0] == tenant or (peer and failed[1])) else None

    def put_transfer(self, transfer_id: bytes, tenant: str, peer: bool = False) -> PutTransfer | None:
        transfer = self._open.get(transfer_id)
        if isinstance(transfer, PutTransfer) and (transfer.tenant == tenant or (peer and transfer.peer)):
            return transfer
        return None

    # -------------------------------------------------------------- shutdown

    def interrupt(self) -> None:
        """Fail every open transfer (the daemon is stopping): connection threads waiting
        on one (for credit, for blocks to send) wake and leave."""
        self._closing = True
        for transfer in list(self._open.values()):
            if isinstance(transfer, PutTransfer):
                self._end(transfer)
            transfer.fail(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")

    async def close(self) -> None:
        """Fail every open transfer and wait until their blocks and slots are released.
        Call after the lane's connections are shut (no thread is left to wait for)."""
        self.interrupt()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._open.clear()


