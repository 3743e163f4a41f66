"""A data lane transfer, of either kind: what fetches and puts on the lane share
(`Transfer`: an id, an owner, a deadline, a lock, the loop; `TransferFailed`), the lane's
settings and counters (`DataLaneSettings`, `DataLaneCounters`).

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

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import grpc

from kvstore.data_lane import LaneSocket


@dataclass(frozen=True, slots=True)
class DataLaneSettings:
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
    # Frames may be encoded by a lossless codec the client asks for (`lane_codecs`).
    codecs: bool = True
    # This start of the daemon (kvstore.server.generation), told to each connection in its WELCOME.
    boot_id: int = 0


class DataLaneCounters:
    """The lane's counters (scraped as `kvstore_datalane_*`). Threads add to them; a lock
    keeps the sums exact (a `+=` is not atomic across threads)."""

    FIELDS = ("bytes_in", "bytes_out", "blocks_in", "blocks_out", "blocks_rejected", "transfers_fetch",
              "transfers_put", "transfers_failed", "connections", "connections_total", "connections_refused",
              "connections_dropped",
              "committed_bytes_in", "served_bytes_out", "put_reserved_bytes", "put_reserved_peak_bytes",
              "encoded_raw_bytes_out", "encoded_wire_bytes_out", "encoded_raw_bytes_in", "encoded_wire_bytes_in")

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

    def encoded(self, direction: str, raw_bytes: int, wire_bytes: int) -> None:
        """Blocks of `raw_bytes` went `direction` ("in", "out") in `wire_bytes` (encoded
        frames; blocks a codec did not shrink went raw and count as such)."""
        with self._lock:
            self.values[f"encoded_raw_bytes_{direction}"] += raw_bytes
            self.values[f"encoded_wire_bytes_{direction}"] += wire_bytes

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
        # The lossless codecs its frames may use (a `kvstore.codecs.codec_mask`; 0: raw
        # only), and the element size of its blocks, for the byte-plane shuffle.
        self.codecs = 0
        self.itemsize = 1

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
