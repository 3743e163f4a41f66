"""The peer lane: unary calls from one daemon of a pool to another on the control lane's
framing over TCP (`kvstore.control_lane_wire`), TLS when the peer's lane uses it.

A grpc-python unary call costs a millisecond or more of per-call machinery on the two
sides together, which was most of a remote lookup; on the peer lane it costs a write and
a read each way. `PeerLane` is the SDK's control lane client (`kvstore.client.control_lane`:
its pool of idle connections, hello and retry policy) over TCP, one call per connection at
a time, a few connections kept open. Glossary of planes and lanes: docs/local-data-plane.md.

Primitives: `PeerLane`, `LANE_RETRY_S`, `CONNECT_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time

from kvstore.client.control_lane import MAX_ANSWER_BYTES, ControlLane, LaneBroken, LaneUnavailable
from kvstore.client.data_lane import LaneEndpoint
from kvstore.control_lane_wire import HEADER, IDEMPOTENT
from kvstore.deadlines import within
from kvstore.errors import Unavailable

logger = logging.getLogger(__name__)

# A peer whose lane could not be connected to: gRPC for this long, then the lane is asked for anew.
LANE_RETRY_S = 10.0
# How long making a peer lane connection may take.
CONNECT_TIMEOUT_S = 5.0


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


class _PeerConn(asyncio.Protocol):
    """One peer lane connection: one call at a time, its answer a future that the bytes
    as they arrive settle (no reader task, no stream). A call given up on (its deadline,
    a cancellation) closes the connection, which is then out of step."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiting: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= HEADER.size:
            length, code = HEADER.unpack_from(buf)
            if length > MAX_ANSWER_BYTES:
                self._fail(LaneBroken(f"an answer of {length} bytes, more than {MAX_ANSWER_BYTES}", True))
                return
            if len(buf) < HEADER.size + length:
                return
            payload = bytes(buf[HEADER.size : HEADER.size + length])
            del buf[: HEADER.size + length]
            fut, self.waiting = self.waiting, None
            if fut is None:
                self._fail(LaneBroken("an answer to no call", True))  # out of step: never read on
                return
            if not fut.done():
                fut.set_result((code, payload))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(LaneBroken(f"the peer lane connection broke ({exc})" if exc else "the peer closed the peer lane "
                           "connection", True))

    def _fail(self, exc: BaseException) -> None:
        self.close()
        fut, self.waiting = self.waiting, None
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        """Send one call's frame; the future of its (status, payload)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise LaneBroken("the peer lane connection is closed", False)
        fut = asyncio.get_running_loop().create_future()
        self.waiting = fut
        self.transport.write(data)
        fut.add_done_callback(self._settled)
        return fut

    def _settled(self, fut: asyncio.Future[tuple[int, bytes]]) -> None:
        if fut.cancelled():
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()


class PeerLane(ControlLane[_PeerConn]):
    """Unary calls to one peer on its peer lane (`kvstore.control_lane_wire`): the lane client's
    pool and policy (`kvstore.client.control_lane.ControlLane`) over TCP, TLS with the pool's roots
    when the peer's lane uses it. `call` answers None while the lane cannot be connected
    to (use gRPC), for `LANE_RETRY_S`; it raises `TimeoutError` at its deadline. It may
    run outside a task (a call the control lane started by hand): it awaits only
    futures, and tasks for connecting.

    A connection is made under `CONNECT_TIMEOUT_S`, not under the deadline of the call
    that needed it (a lookup's few milliseconds): a call whose deadline passes first is a
    miss, and the connection, once made, serves the next ones. One is made ahead as soon
    as the lane is known, and again when a call gave up on its connection at its
    deadline (`warm`)."""

    def __init__(self, node: str, endpoint: LaneEndpoint, token: str, tls: ssl.SSLContext | None) -> None:
        # The first hello (no boot id asked): a pool learns of a peer's restart from its
        # member record, and old and new daemons of a pool speak it alike.
        super().__init__(f"{endpoint.host}:{endpoint.port}", token, required=False, generations=False)
        self.node = node
        self.endpoint = endpoint
        self.tls = tls
        self.closed = False
        self._claimed: set[asyncio.Task[_PeerConn]] = set()  # connections a call waits for
        self._warming: asyncio.Task[_PeerConn] | None = None  # the one `warm` makes

    async def _connect(self, timeout: float) -> _PeerConn:
        ep = self.endpoint
        loop = asyncio.get_running_loop()
        connecting = asyncio.ensure_future(loop.create_connection(
            _PeerConn, ep.host, ep.port, ssl=self.tls, server_hostname=ep.host if self.tls else None))
        try:
            _, conn = await within(connecting, timeout)
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise LaneUnavailable(f"cannot connect to {self.path}: {getattr(exc, 'strerror', None) or exc}") from None
        except BaseException:
            if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
                connecting.result()[0].close()  # made as this was cancelled
            raise
        try:
            self._handshake(*await within(conn.request(self._hello), timeout))
        except BaseException as exc:
            conn.close()
            raise self._refused(exc) from None
        return conn

    async def call(self, name: str, payload: bytes, timeout: float) -> bytes | None:
        """`name`'s answer bytes; None: no lane to use now. Raises the status the peer
        answered (as `kvstore.errors`), `Unavailable` when the connection broke after the
        call was sent (and it is not safe to send again), `TimeoutError` at `timeout`."""
        if self.closed or (not self.up and time.monotonic() < self.retry_at):
            return None
        conn = self._take()
        deadline = time.monotonic() + timeout
        for attempt in (0, 1):
            if conn is None:
                try:
                    conn = await self._connection(_left(deadline))
                except LaneUnavailable as exc:
                    self._unusable(exc)
                    return None
            data = self._request(conn, name, payload)
            try:
                code, answer = await within(conn.request(data), _left(deadline))
            except LaneBroken as exc:
                conn.close()
                conn = None
                if attempt or (exc.sent and name not in IDEMPOTENT):
                    raise Unavailable(f"peer lane of node {self.node}: {exc} during {name}; it may or may not have "
                                      "taken effect") from None
                continue
            except TimeoutError:
                # Its answer may still come on this connection, where the next call would
                # read it: closed, and a replacement made now, in the background, so
                # that the next call does not wait for a connect and a hello of its own.
                conn.close()
                self.warm()
                raise
            except BaseException:
                conn.close()
                raise
            return self._answer(conn, code, answer)
        raise AssertionError("unreachable: the second failure raises")

    def warm(self) -> None:
        """Make a connection in the background, pooled once made: none while one is
        pooled or `warm` is still making one (a peer that answers no connection leaves one
        attempt under way, not one per timed-out call)."""
        if not self.closed and not self._idle and (self._warming is None or self._warming.done()):
            self._warming = self._connecting()

    def _connecting(self) -> asyncio.Task[_PeerConn]:
        task = asyncio.get_running_loop().create_task(self._connect(CONNECT_TIMEOUT_S),
                                                      name=f"kvstore-peer-lane-{self.node}")
        task.add_done_callback(self._made)
        return task

    async def _connection(self, timeout: float) -> _PeerConn:
        """A new connection within `timeout`; past it `TimeoutError`, and the connection
        still made goes to the pool."""
        task = self._connecting()
        self._claimed.add(task)
        try:
            return await within(asyncio.shield(task), timeout)
        except BaseException:
            if task.done() and not task.cancelled() and task.exception() is None:
                self._put_back(task.result())  # made just as this call gave up on it
            raise
        finally:
            self._claimed.discard(task)

    def _made(self, task: asyncio.Task[_PeerConn]) -> None:
        """A connection attempt ended: pooled (or its failure noted) unless a call that
        still waits for it takes it (`_connection`)."""
        if task.cancelled():
            return
        exc = task.exception()
        if task in self._claimed:
            return
        if isinstance(exc, LaneUnavailable):
            self._unusable(exc)
        elif exc is None:
            self.up = True
            self._put_back(task.result())

    def _unusable(self, exc: LaneUnavailable) -> None:
        logger.info("cluster: the peer lane of node %s is not available (%s); its calls go through gRPC for %.0f s",
                    self.node, exc, LANE_RETRY_S)
        self.up = False
        self.retry_at = time.monotonic() + LANE_RETRY_S

    def _put_back(self, conn: _PeerConn) -> None:
        if self.closed or conn.closed:
            conn.close()
        else:
            super()._put_back(conn)

    def close(self) -> None:
        self.closed = True
        if self._warming is not None:
            self._warming.cancel()
        super().close()
