"""A fetch on the data lane (`FetchTransfer`): the loop verifies blocks into a bounded
hand-off queue, each joined connection's thread takes them as its credit allows and
sends them from where they are (`ReadyBlock`). See `kvstore.server.data_lane.transfer` for how the
loop and the threads meet.

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import ClassVar, NamedTuple

import grpc

from kvstore.core.fetch import FetchStream
from kvstore.data_lane import LaneSocket
from kvstore.deadlines import within
from kvstore.errors import DeadlineExceeded, error_for_status
from kvstore.server.data_lane.transfer import DataLaneCounters, Transfer

# After a fetch's last block is taken, how long it waits for connections the client said
# would join and have not (one that failed on the client's side never will).
LATE_JOIN_GRACE_S = 1.0
# Verified blocks a fetch keeps ready ahead of its senders, per connection: at least two
# blocks, else up to this many bytes (views of tier memory cost nothing; blocks read from
# SSD are copies, and are read ahead by at most FETCH_AHEAD_BYTES anyway). The loop is
# woken to verify more once half of them are taken: one wake-up per several blocks.
READY_BYTES_PER_CONNECTION = 16 << 20
# Blocks the pump verifies into the queue before it lets the event loop run other calls:
# blocks in host memory never make it wait, and a pull of hundreds of small ones would
# otherwise hold the loop for milliseconds (the daemon's own lookups waiting behind it).
PUMP_BATCH_BLOCKS = 64
# And bytes it hashes in one step (larger blocks come fewer to a step).
PUMP_BATCH_BYTES = 4 << 20

class ReadyBlock(NamedTuple):
    position: int
    data: memoryview
    checksum: int


class FetchTransfer(Transfer):
    """A fetch on the lane: the loop verifies blocks into a bounded hand-off queue
    (`pump`); each joined connection's thread takes blocks from it (`take`) as its credit
    allows, sends them, and leaves after END."""

    kind: ClassVar[str] = "fetch"

    def __init__(self, transfer_id: bytes, tenant: str, deadline: float, connections: int,
                 loop: asyncio.AbstractEventLoop, stream: FetchStream, counters: DataLaneCounters) -> None:
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
        batches = self.stream.view_batches(self._batch_blocks())
        try:
            served = counted = 0
            try:
                async for batch in batches:
                    with self.lock:
                        if self.failed is not None:
                            return
                        ready = self.ready
                        ready.extend(ReadyBlock(served + k, b.data, b.checksum) for k, b in enumerate(batch))
                        self.lock.notify(len(batch))
                        self._producer_waits = len(ready) >= self.max_ready
                    served += len(batch)
                    del batch
                    if self._producer_waits:
                        await self.until(self._space, lambda: self.failed is not None or
                                         len(self.ready) <= self.max_ready // 2)
                    if served - counted >= PUMP_BATCH_BLOCKS:
                        self.counters.add("served_bytes_out", (served - counted) * self.block_bytes)
                        counted = served
                        await asyncio.sleep(0)  # the loop's other calls, between batches
            finally:  # every block queued is counted, however the loop ends
                self.counters.add("served_bytes_out", (served - counted) * self.block_bytes)
            with self.lock:
                self.end = served
                self.lock.notify_all()
            try:
                await within(self.until(self._idle, lambda: self.failed is not None or
                                                  (self.left >= self.connections and self.sending == 0)),
                                       LATE_JOIN_GRACE_S)
            except TimeoutError:
                # A connection the client meant to join never did (it failed on the way):
                # the blocks are released once those that joined took them all and left.
                await self.until(self._idle, lambda: self.failed is not None or (
                    not self.ready and self.joined > 0 and self.left >= self.joined and self.sending == 0))
        finally:
            await batches.aclose()
            await self._release()

    def _batch_blocks(self) -> int:
        """Blocks the pump takes in one step: PUMP_BATCH_BLOCKS, fewer where they would
        be more than PUMP_BATCH_BYTES to hash, and never more than the queue holds."""
        return max(1, min(PUMP_BATCH_BLOCKS, PUMP_BATCH_BYTES // max(1, self.block_bytes), self.max_ready))

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

    def take(self, deadline: float, most: int = 1) -> list[ReadyBlock] | int:
        """The next verified blocks (at least one, up to `most` of those ready), or the END
        count; raises `KVStoreError` if the transfer failed or its deadline passed. The
        caller must call `sent` once they went (`abandon` if they could not)."""
        with self.lock:
            while True:
                if self.failed is not None:
                    raise error_for_status(self.failed.code, self.failed.message)
                if self.ready:
                    ready = self.ready
                    block = [ready.popleft() for _ in range(min(most, len(ready)))]
                    self.sending += len(block)
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

    def sent(self, blocks: int = 1) -> None:
        with self.lock:
            self.sending -= blocks
            idle = self.sending == 0 and (self.closed or self.failed is not None)
        self.counters.add("blocks_out", blocks)
        self.counters.add("bytes_out", blocks * self.block_bytes)
        if idle:
            self.wake(self._idle)

    def abandon(self, reason: str, blocks: int = 1) -> None:
        """Taken blocks were not sent (the connection broke): the fetch cannot complete."""
        with self.lock:
            self.sending -= blocks
        self.fail(grpc.StatusCode.UNAVAILABLE, f"a data lane connection broke mid-fetch: {reason}")
        self.wake(self._idle)

    def leave(self, sock: LaneSocket) -> None:
        with self.lock:
            self.sockets.discard(sock)
            self.left += 1
        self.wake(self._idle)
