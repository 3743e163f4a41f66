"""The client side of the local control lane (framing in `kvstore.laneproto`).

`SyncLane` (plain blocking sockets, a small pool guarded by a lock, so the blocking
`Client` may be used from several threads) and `AioLane` (asyncio streams) send one
unary call's serialized request and return the serialized answer, or raise the
`kvstore.errors` exception the same status raises over gRPC.

A token the daemon refuses at the handshake raises `Unauthenticated`, as every gRPC
call would. Failure handling: a pooled connection that turns out broken is replaced once; a call
that cannot have reached the daemon (nothing was sent), or that is safe to repeat
(`IDEMPOTENT`), is then sent again on a new connection. When no connection can be made,
`LaneUnavailable` tells the client to use gRPC instead. A call that broke after it was
sent and is not safe to repeat raises `Unavailable`: it may or may not have run.
"""

from __future__ import annotations

import asyncio
import os
import logging
import socket
import struct
import threading
import time

import grpc

from kvstore.client._errors import translate_status
from kvstore.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    KVStoreError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.laneproto import HEADER, HELLO, HELLO_ANSWER, IDEMPOTENT, MAGIC, METHOD_IDS, frame, lane_path

# The largest answer the SDK reads (as its gRPC channels cap messages).
MAX_ANSWER_BYTES = 64 << 20
# Idle connections kept per client; more may be open while calls run concurrently.
MAX_IDLE = 4
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_PEERCRED = struct.Struct("3i")
# After the lane could not be used, calls go through gRPC; the lane is tried again this
# much later (a daemon restarted, or started without the lane, and so on).
LANE_RETRY_S = 5.0

logger = logging.getLogger(__name__)


def check_answer_length(length: int) -> None:
    """Refuse an answer header announcing more than the SDK will read (never allocated)."""
    if length > MAX_ANSWER_BYTES:
        raise ResourceExhausted(f"the daemon's answer of {length} bytes is more than the SDK reads "
                                f"({MAX_ANSWER_BYTES}); ask for fewer blocks per call")


class LaneUnavailable(Exception):
    """No lane connection could be made (no socket, refused, handshake failed)."""


class _Broken(Exception):
    """The connection failed mid-call; `sent` says whether the request may have left."""

    def __init__(self, reason: str, sent: bool) -> None:
        super().__init__(reason)
        self.sent = sent


def lane_socket(target: str) -> str | None:
    """The lane's socket path for a `unix:` gRPC target; None for TCP targets."""
    if not target.startswith("unix:"):
        return None
    path = target[len("unix:"):]
    if path.startswith("//"):
        path = path[2:]
    return lane_path(os.path.abspath(path)) if path else None


def status_error(code_value: int, message: bytes) -> KVStoreError:
    """The exception for an error answer: the same class and text as over gRPC."""
    code = _CODES.get(code_value, grpc.StatusCode.UNKNOWN)
    return translate_status(code, message.decode("utf-8", "replace"))


def _hello(token: str) -> bytes:
    return frame(HELLO, MAGIC + token.encode("utf-8"))


def _hello_answer(code: int, payload: bytes) -> int:
    """The daemon's request-size limit from its hello answer; raises its refusal."""
    if code != 0:
        raise status_error(code, payload)
    if len(payload) != HELLO_ANSWER.size:
        raise LaneUnavailable("the lane's hello answer is malformed")
    magic, max_request = HELLO_ANSWER.unpack(payload)
    if magic != MAGIC:
        raise LaneUnavailable("the lane answered with another protocol")
    return int(max_request)


def _check_request(name: str, payload: bytes, max_request: int) -> int:
    mid = METHOD_IDS[name]
    if len(payload) > max_request:
        raise ResourceExhausted(f"the {name} request is {len(payload)} bytes, more than the daemon accepts in one "
                                f"message ({max_request}, its max_message_bytes); send fewer blocks per call")
    return mid


def _trusted_peer(sock: socket.socket) -> None:
    """Send a token only to a daemon of this uid or root (the socket could be anyone's)."""
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    me = os.getuid()
    if uid not in (me, 0) and me != 0:
        raise LaneUnavailable(f"the lane socket is served by uid {uid}, not this process's uid {me} or root")


class LaneState:
    """Whether a client's unary calls go over the local control lane: up once a call
    through it succeeds; after a failure, gRPC until LANE_RETRY_S later, or an error when
    the caller insisted on the lane (`control_plane="lane"`)."""

    __slots__ = ("required", "up", "retry_at")

    def __init__(self, required: bool) -> None:
        self.required = required
        self.up = False
        self.retry_at = 0.0

    def due(self) -> bool:
        """Whether this call should try the lane."""
        return self.up or time.monotonic() >= self.retry_at

    def failed(self, exc: Exception) -> None:
        if self.required:
            raise FailedPrecondition(f"cannot use the local control lane: {exc}") from None
        logger.info("local control lane unavailable (%s); unary calls go through gRPC", exc)
        self.up = False
        self.retry_at = time.monotonic() + LANE_RETRY_S


# ------------------------------------------------------------------------ blocking


class _SyncConn:
    __slots__ = ("sock", "buf", "timeout")

    def __init__(self, path: str, token: str, timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            _trusted_peer(sock)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.timeout = timeout
        self.buf = bytearray(1 << 16)

    def close(self) -> None:
        self.sock.close()

    def _read_exact(self, n: int, into: memoryview) -> None:
        got = 0
        while got < n:
            k = self.sock.recv_into(into[got:n])
            if not k:
                raise _Broken("the daemon closed the lane connection", True)
            got += k

    def roundtrip(self, data: bytes, timeout: float) -> tuple[int, bytes]:
        if timeout != self.timeout:
            self.sock.settimeout(timeout)
            self.timeout = timeout
        try:
            # MSG_NOSIGNAL: a closed peer is an error here, never a SIGPIPE (the CLI runs
            # with SIGPIPE's default action, which would end the process).
            self.sock.sendall(data, socket.MSG_NOSIGNAL)
        except (BrokenPipeError, ConnectionResetError) as exc:
            # On a Unix socket a failed send delivered nothing.
            raise _Broken(f"the lane connection is closed ({exc.strerror})", False) from None
        try:
            buf = self.buf
            view = memoryview(buf)
            k = self.sock.recv_into(view)
            if not k:
                raise _Broken("the daemon closed the lane connection", True)
            while k < HEADER.size:
                k2 = self.sock.recv_into(view[k:])
                if not k2:
                    raise _Broken("the daemon closed the lane connection", True)
                k += k2
            length, code = HEADER.unpack_from(buf)
            check_answer_length(length)
            end = HEADER.size + length
            if k >= end:
                if k > end:
                    raise _Broken("the daemon sent more than one answer", True)
                return code, bytes(view[HEADER.size:end])
            out = bytearray(length)
            have = k - HEADER.size
            out[:have] = view[HEADER.size:k]
            self._read_exact(length - have, memoryview(out)[have:])
            return code, bytes(out)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _Broken(f"the lane connection broke ({exc.strerror})", True) from None


class SyncLane:
    """Lane calls from blocking code: a lock-guarded pool of connections."""

    def __init__(self, path: str, token: str) -> None:
        self.path = path
        self.token = token
        self.max_request = 0
        self._idle: list[_SyncConn] = []
        self._lock = threading.Lock()

    def _connect(self, timeout: float) -> _SyncConn:
        try:
            conn = _SyncConn(self.path, self.token, timeout)
        except OSError as exc:
            raise LaneUnavailable(f"cannot connect to {self.path}: {exc.strerror or exc}") from None
        try:
            code, payload = conn.roundtrip(_hello(self.token), timeout)
            self.max_request = _hello_answer(code, payload)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, (_Broken, OSError)):
                raise LaneUnavailable(f"the lane at {self.path} refused the connection: {exc}") from None
            if isinstance(exc, KVStoreError) and not isinstance(exc, Unauthenticated):
                raise LaneUnavailable(f"the lane at {self.path} refused this client: {exc}") from None
            raise  # a refused token: gRPC would refuse it the same way
        return conn

    def open(self, timeout: float) -> None:
        """Make one connection now (the handshake); raises `LaneUnavailable`."""
        conn = self._connect(timeout)
        self._put_back(conn)

    def _take(self) -> _SyncConn | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _put_back(self, conn: _SyncConn) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def call(self, name: str, payload: bytes, timeout: float) -> bytes:
        """The serialized answer to a serialized request of method `name`."""
        conn = self._take()
        if conn is None:
            conn = self._connect(timeout)
        mid = _check_request(name, payload, self.max_request)
        data = frame(mid, payload)
        for attempt in (0, 1):
            try:
                code, answer = conn.roundtrip(data, timeout)
            except _Broken as exc:
                conn.close()
                if attempt or (exc.sent and name not in IDEMPOTENT):
                    raise Unavailable(f"kvstore daemon unavailable: {exc} during {name}; it may or may not have "
                                      "taken effect") from None
                conn = self._connect(timeout)  # once; LaneUnavailable if the daemon is gone
                continue
            except TimeoutError:
                conn.close()  # an answer may still come: the connection is out of step
                raise DeadlineExceeded(f"{name} got no answer on the control lane within {timeout:g}s") from None
            except BaseException:
                conn.close()
                raise
            self._put_back(conn)
            if code:
                raise status_error(code, answer)
            return answer
        raise AssertionError("unreachable")


# ------------------------------------------------------------------------ asyncio


class _AioConn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()

    async def roundtrip(self, data: bytes) -> tuple[int, bytes]:
        if self.writer.is_closing() or self.reader.at_eof():
            raise _Broken("the lane connection is closed", False)
        try:
            self.writer.write(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _Broken(f"the lane connection is closed ({exc.strerror})", False) from None
        try:
            head = await self.reader.readexactly(HEADER.size)
            length, code = HEADER.unpack(head)
            check_answer_length(length)
            return code, (await self.reader.readexactly(length) if length else b"")
        except asyncio.IncompleteReadError:
            raise _Broken("the daemon closed the lane connection", True) from None
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _Broken(f"the lane connection broke ({exc.strerror})", True) from None


class AioLane:
    """Lane calls from asyncio code: a pool of stream connections on the caller's loop."""

    def __init__(self, path: str, token: str) -> None:
        self.path = path
        self.token = token
        self.max_request = 0
        self._idle: list[_AioConn] = []

    async def _connect(self, timeout: float) -> _AioConn:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 16)
        except (OSError, TimeoutError) as exc:
            raise LaneUnavailable(f"cannot connect to {self.path}: {getattr(exc, 'strerror', None) or exc}") from None
        conn = _AioConn(reader, writer)
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                _trusted_peer(sock)
            async with asyncio.timeout(timeout):
                code, payload = await conn.roundtrip(_hello(self.token))
            self.max_request = _hello_answer(code, payload)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, (_Broken, OSError, TimeoutError)) or (
                    isinstance(exc, KVStoreError) and not isinstance(exc, Unauthenticated)):
                raise LaneUnavailable(f"the lane at {self.path} refused the connection: {exc}") from None
            raise  # a refused token: gRPC would refuse it the same way
        return conn

    async def open(self, timeout: float) -> None:
        self._put_back(await self._connect(timeout))

    def _put_back(self, conn: _AioConn) -> None:
        if len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def call(self, name: str, payload: bytes, timeout: float) -> bytes:
        conn = self._idle.pop() if self._idle else await self._connect(timeout)
        mid = _check_request(name, payload, self.max_request)
        data = frame(mid, payload)
        for attempt in (0, 1):
            try:
                async with asyncio.timeout(timeout):
                    code, answer = await conn.roundtrip(data)
            except _Broken as exc:
                conn.close()
                if attempt or (exc.sent and name not in IDEMPOTENT):
                    raise Unavailable(f"kvstore daemon unavailable: {exc} during {name}; it may or may not have "
                                      "taken effect") from None
                conn = await self._connect(timeout)
                continue
            except TimeoutError:
                conn.close()
                raise DeadlineExceeded(f"{name} got no answer on the control lane within {timeout:g}s") from None
            except BaseException:
                conn.close()  # cancelled mid-call: the connection is out of step
                raise
            self._put_back(conn)
            if code:
                raise status_error(code, answer)
            return answer
        raise AssertionError("unreachable")
