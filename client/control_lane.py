"""The client side of the local control lane (framing in `kvstore.control_lane_wire`).

One lane client, `ControlLane`, holds the policy: a pool of idle connections, when to use the
lane at all, what may be sent again, and how an answer or a refusal becomes an
exception. Its two flavours only move bytes: `SyncControlLane` over blocking sockets (the
`Client`, which may be used from several threads: the pool is a list whose pop and
append are atomic, so it needs no lock), `AioControlLane` over asyncio streams on the caller's
loop. `call` sends one unary call's serialized request and returns the serialized answer,
raises the `kvstore.errors` exception the same status raises over gRPC, or returns None
when the lane cannot be used now and the caller should use gRPC instead.

When to use it: the lane is up once a connection or a call through it succeeds. After a
connection cannot be made (no socket, refused, handshake failed) calls go through gRPC
until `LANE_RETRY_S` later, or raise `FailedPrecondition` when the caller insisted on
the lane (`control_plane="lane"`). A token the daemon refuses at the handshake raises
`Unauthenticated`, as every gRPC call would.

Sending again: a pooled connection that turns out broken is replaced once; a call that
cannot have reached the daemon (nothing was sent), or that is safe to repeat
(`control_lane_wire.IDEMPOTENT`), is then sent again on a new connection. A call that broke
after it was sent and is not safe to repeat raises `Unavailable`: it may or may not
have run.

The daemon's generation: the hello asks for the daemon's boot id
(`control_lane_wire.MAGIC_GENERATION`; a daemon that predates it refuses that hello, and
the first hello is said again on a new connection). Each connection keeps what its hello
answered, and `call_told` returns it with the answer: the start of the daemon that
answered that very call (a lane-wide "last hello" could be a connection to the old
start whose hello is read after a new one's). A lane that reconnected after a restart so
tells the client it talks to another start before any call is refused
(`kvstore.client._ops`).

File descriptors: with auth on, the daemon answers `LocalSegment` with the caller's
segment as a descriptor (SCM_RIGHTS) rather than a path. `segment_over_lane` asks for it
on a blocking connection of its own (for both clients: asyncio streams cannot receive
descriptors), made and closed for that one call.

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from typing import Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError

from kvstore.client._errors import translate_status
from kvstore.control_lane_wire import (
    HEADER,
    HELLO,
    HELLO_ANSWER,
    HELLO_ANSWER_GENERATION,
    IDEMPOTENT,
    MAGIC,
    MAGIC_GENERATION,
    METHOD_IDS,
    frame,
    lane_path,
)
from kvstore.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.v1 import kvstore_pb2

# The largest answer the SDK reads (as its gRPC channels cap messages).
MAX_ANSWER_BYTES = 64 << 20
# Idle connections kept per client; more may be open while calls run concurrently.
MAX_IDLE = 4
# After the lane could not be used, calls go through gRPC; the lane is tried again this
# much later (a daemon restarted, or started without the lane, and so on).
LANE_RETRY_S = 5.0
# Descriptors the SDK takes with one answer (the daemon passes at most one).
MAX_PASSED_FDS = 4
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_PEERCRED = struct.Struct("3i")

logger = logging.getLogger(__name__)


def check_answer_length(length: int) -> None:
    """Refuse an answer header announcing more than the SDK will read (never allocated)."""
    if length > MAX_ANSWER_BYTES:
        raise ResourceExhausted(f"the daemon's answer of {length} bytes is more than the SDK reads "
                                f"({MAX_ANSWER_BYTES}); ask for fewer blocks per call")


class LaneUnavailable(Exception):
    """No lane connection could be made (no socket, refused, handshake failed)."""


class LaneBroken(Exception):
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


def _trusted_peer(sock: socket.socket) -> None:
    """Send a token only to a daemon of this uid or root (the socket could be anyone's)."""
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    me = os.getuid()
    if uid not in (me, 0) and me != 0:
        raise LaneUnavailable(f"the lane socket is served by uid {uid}, not this process's uid {me} or root")


class _Conn(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Conn)


class ControlLane(Generic[C]):
    """The lane client's pool and policy; `SyncControlLane` and `AioControlLane` add the I/O."""

    def __init__(self, path: str, token: str, required: bool, generations: bool = True) -> None:
        self.path = path
        self.required = required  # control_plane="lane": no gRPC fallback
        self.up = False
        self.retry_at = 0.0  # monotonic; while down, gRPC until then
        self.max_request = 0  # the daemon's limit, from its hello answer
        self.boot_id = 0  # the boot id the latest hello told (0: none); for one call's, see `call_told`
        first = frame(HELLO, MAGIC + token.encode("utf-8"))
        self._hello = frame(HELLO, MAGIC_GENERATION + token.encode("utf-8")) if generations else first
        # The hellos to say, in turn, where the one before was refused as unknown.
        self._hellos = (self._hello, first) if generations else (first,)
        self._idle: list[C] = []

    def _unusable(self, exc: LaneUnavailable) -> None:
        """No connection could be made: gRPC for a while (or an error, if required)."""
        if self.required:
            raise FailedPrecondition(f"cannot use the local control lane: {exc}") from None
        logger.info("local control lane unavailable (%s); unary calls go through gRPC", exc)
        self.up = False
        self.retry_at = time.monotonic() + LANE_RETRY_S

    def _handshake(self, code: int, payload: bytes) -> int:
        """Take the daemon's request-size limit from its hello answer, and return the boot
        id it tells (0: none); raise its refusal."""
        boot_id = 0
        if code != 0:
            raise status_error(code, payload)
        if len(payload) == HELLO_ANSWER_GENERATION.size:
            magic, max_request, boot_id = HELLO_ANSWER_GENERATION.unpack(payload)
            if magic != MAGIC_GENERATION:
                raise LaneUnavailable("the lane answered with another protocol")
            self.boot_id = int(boot_id)
        elif len(payload) == HELLO_ANSWER.size:
            magic, max_request = HELLO_ANSWER.unpack(payload)
            if magic != MAGIC:
                raise LaneUnavailable("the lane answered with another protocol")
        else:
            raise LaneUnavailable("the lane's hello answer is malformed")
        self.max_request = int(max_request)
        return int(boot_id)

    def _say_again(self, exc: BaseException, hello: bytes) -> bool:
        """Whether a refused `hello` is worth saying the next hello for, on a new
        connection: a daemon that predates it refuses it as a bad magic."""
        return hello is not self._hellos[-1] and isinstance(exc, InvalidArgument) and "bad magic" in str(exc)

    def _refused(self, exc: BaseException) -> BaseException:
        """What a failed handshake raises: `LaneUnavailable` (use gRPC), except for a
        refused token, which gRPC would refuse the same way, and for interruptions."""
        if isinstance(exc, (LaneBroken, OSError)):  # TimeoutError included
            return LaneUnavailable(f"the lane at {self.path} refused the connection: {exc}")
        if isinstance(exc, KVStoreError) and not isinstance(exc, Unauthenticated):
            return LaneUnavailable(f"the lane at {self.path} refused this client: {exc}")
        return exc

    def _request(self, conn: C, name: str, payload: bytes) -> bytes:
        """The request's frame; one larger than the daemon accepts is refused here, and
        `conn` goes back to the pool unused."""
        if len(payload) > self.max_request:
            self._put_back(conn)
            raise ResourceExhausted(f"the {name} request is {len(payload)} bytes, more than the daemon accepts in one "
                                    f"message ({self.max_request}, its max_message_bytes); send fewer blocks per call")
        return frame(METHOD_IDS[name], payload)

    def _check_resend(self, name: str, exc: BaseException, attempt: int, timeout: float) -> None:
        """After a call failed on a connection (now closed): return to send it again on a
        new one, or raise what the caller gets."""
        if isinstance(exc, LaneBroken):
            if attempt or (exc.sent and name not in IDEMPOTENT):
                raise Unavailable(f"kvstore daemon unavailable: {exc} during {name}; it may or may not have "
                                  "taken effect") from None
            return
        if isinstance(exc, TimeoutError):
            # An answer may still come: that connection was out of step, hence closed.
            raise DeadlineExceeded(f"{name} got no answer on the control lane within {timeout:g}s") from None
        raise exc  # cancelled or interrupted mid-call: the connection was out of step too

    def _answer(self, conn: C, code: int, answer: bytes) -> bytes:
        self._put_back(conn)
        self.up = True
        if code:
            raise status_error(code, answer)
        return answer

    def _take(self) -> C | None:
        try:
            return self._idle.pop()
        except IndexError:
            return None

    def _put_back(self, conn: C) -> None:
        if len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


# ------------------------------------------------------------------------ blocking


class _SyncConn:
    __slots__ = ("sock", "buf", "timeout", "boot_id")

    def __init__(self, path: str, timeout: float) -> None:
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
        self.boot_id = 0  # what its hello told

    def close(self) -> None:
        self.sock.close()

    def _read_exact(self, n: int, into: memoryview) -> None:
        got = 0
        while got < n:
            k = self.sock.recv_into(into[got:n])
            if not k:
                raise LaneBroken("the daemon closed the lane connection", True)
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
            raise LaneBroken(f"the lane connection is closed ({exc.strerror})", False) from None
        try:
            buf = self.buf
            view = memoryview(buf)
            k = self.sock.recv_into(view)
            if not k:
                raise LaneBroken("the daemon closed the lane connection", True)
            while k < HEADER.size:
                k2 = self.sock.recv_into(view[k:])
                if not k2:
                    raise LaneBroken("the daemon closed the lane connection", True)
                k += k2
            length, code = HEADER.unpack_from(buf)
            check_answer_length(length)
            end = HEADER.size + length
            if k >= end:
                if k > end:
                    raise LaneBroken("the daemon sent more than one answer", True)
                return code, bytes(view[HEADER.size:end])
            out = bytearray(length)
            have = k - HEADER.size
            out[:have] = view[HEADER.size:k]
            self._read_exact(length - have, memoryview(out)[have:])
            return code, bytes(out)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise LaneBroken(f"the lane connection broke ({exc.strerror})", True) from None


    def roundtrip_fds(self, data: bytes, timeout: float) -> tuple[int, bytes, list[int]]:
        """`roundtrip`, also taking the descriptors the answer carries (the caller owns
        them; closed here if the answer cannot be read)."""
        self.sock.settimeout(timeout)
        self.timeout = timeout
        try:
            self.sock.sendall(data, socket.MSG_NOSIGNAL)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise LaneBroken(f"the lane connection is closed ({exc.strerror})", False) from None
        got = b""
        fds: list[int] = []
        try:
            while len(got) < HEADER.size or len(got) < HEADER.size + HEADER.unpack_from(got)[0]:
                if len(got) >= HEADER.size:
                    check_answer_length(HEADER.unpack_from(got)[0])
                data, passed, _flags, _addr = socket.recv_fds(self.sock, 1 << 16, MAX_PASSED_FDS)
                fds += passed
                if not data:
                    raise LaneBroken("the daemon closed the lane connection", True)
                got += data
            length, code = HEADER.unpack_from(got)
            if len(got) > HEADER.size + length:
                raise LaneBroken("the daemon sent more than one answer", True)
            return code, got[HEADER.size:], fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise


def segment_over_lane(path: str, token: str,
                      timeout: float) -> tuple[kvstore_pb2.LocalSegmentResponse, int | None] | None:
    """The daemon's `LocalSegment` answer over the lane at `path`, with the descriptor it
    passed (None: the answer names a path instead). None when no lane connection can be
    made (ask over gRPC instead); the daemon's refusal raises its `KVStoreError`."""
    lane = SyncControlLane(path, token, False)
    try:
        conn = lane._connect(timeout)
    except LaneUnavailable as exc:
        logger.info("no segment over the local control lane (%s)", exc)
        return None
    try:
        code, answer, fds = conn.roundtrip_fds(frame(METHOD_IDS["LocalSegment"], b""), timeout)
    except (LaneBroken, OSError) as exc:
        logger.info("no segment over the local control lane (%s)", exc)
        return None
    finally:
        conn.close()
    for extra in fds[1:]:
        os.close(extra)
    fd = fds[0] if fds else None
    if code:
        if fd is not None:
            os.close(fd)
        raise status_error(code, answer)
    try:
        return kvstore_pb2.LocalSegmentResponse.FromString(answer), fd
    except DecodeError:
        if fd is not None:
            os.close(fd)
        raise ValueError("the daemon's LocalSegment answer does not parse") from None


class SyncControlLane(ControlLane[_SyncConn]):
    """Lane calls from blocking code."""

    def _connect(self, timeout: float) -> _SyncConn:
        for hello in self._hellos:
            try:
                conn = _SyncConn(self.path, timeout)
            except OSError as exc:
                raise LaneUnavailable(f"cannot connect to {self.path}: {exc.strerror or exc}") from None
            try:
                conn.boot_id = self._handshake(*conn.roundtrip(hello, timeout))
            except BaseException as exc:
                conn.close()
                if self._say_again(exc, hello):
                    continue
                raise self._refused(exc) from None
            return conn
        raise AssertionError("unreachable: the last hello's refusal raises")

    def in_use(self, timeout: float) -> bool:
        """Whether unary calls go over the lane; makes a connection now if one is due."""
        if not self.up and time.monotonic() >= self.retry_at:
            try:
                self._put_back(self._connect(timeout))
                self.up = True
            except LaneUnavailable as exc:
                self._unusable(exc)
        return self.up

    def call(self, name: str, payload: bytes, timeout: float) -> bytes | None:
        """The serialized answer to a serialized request of method `name`; None when the
        lane cannot be used now (the call goes to gRPC)."""
        told = self.call_told(name, payload, timeout)
        return None if told is None else told[0]

    def call_told(self, name: str, payload: bytes, timeout: float) -> tuple[bytes, int] | None:
        """`call`'s answer, with the boot id of the daemon that answered it (0: not told)."""
        if not self.up and time.monotonic() < self.retry_at:
            return None
        conn = self._take()
        try:
            for attempt in (0, 1):
                if conn is None:
                    conn = self._connect(timeout)
                data = self._request(conn, name, payload)
                try:
                    code, answer = conn.roundtrip(data, timeout)
                except BaseException as exc:
                    conn.close()
                    conn = None
                    self._check_resend(name, exc, attempt, timeout)
                    continue
                boot_id = conn.boot_id
                return self._answer(conn, code, answer), boot_id
        except LaneUnavailable as exc:
            self._unusable(exc)
            return None
        raise AssertionError("unreachable: the second failure raises")


# ------------------------------------------------------------------------ asyncio


class _AioConn:
    __slots__ = ("reader", "writer", "boot_id")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.boot_id = 0  # what its hello told

    def close(self) -> None:
        self.writer.close()

    async def roundtrip(self, data: bytes) -> tuple[int, bytes]:
        if self.writer.is_closing() or self.reader.at_eof():
            raise LaneBroken("the lane connection is closed", False)
        try:
            self.writer.write(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise LaneBroken(f"the lane connection is closed ({exc.strerror})", False) from None
        try:
            head = await self.reader.readexactly(HEADER.size)
            length, code = HEADER.unpack(head)
            check_answer_length(length)
            return code, (await self.reader.readexactly(length) if length else b"")
        except asyncio.IncompleteReadError:
            raise LaneBroken("the daemon closed the lane connection", True) from None
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise LaneBroken(f"the lane connection broke ({exc.strerror})", True) from None


class AioControlLane(ControlLane[_AioConn]):
    """Lane calls from asyncio code."""

    async def _connect(self, timeout: float) -> _AioConn:
        for hello in self._hellos:
            try:
                async with asyncio.timeout(timeout):
                    reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 16)
            except (OSError, TimeoutError) as exc:
                raise LaneUnavailable(f"cannot connect to {self.path}: {getattr(exc, 'strerror', None) or exc}") \
                    from None
            conn = _AioConn(reader, writer)
            try:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    _trusted_peer(sock)
                async with asyncio.timeout(timeout):
                    conn.boot_id = self._handshake(*await conn.roundtrip(hello))
            except BaseException as exc:
                conn.close()
                if self._say_again(exc, hello):
                    continue
                raise self._refused(exc) from None
            return conn
        raise AssertionError("unreachable: the last hello's refusal raises")

    async def in_use(self, timeout: float) -> bool:
        """Whether unary calls go over the lane; makes a connection now if one is due."""
        if not self.up and time.monotonic() >= self.retry_at:
            try:
                self._put_back(await self._connect(timeout))
                self.up = True
            except LaneUnavailable as exc:
                self._unusable(exc)
        return self.up

    async def call(self, name: str, payload: bytes, timeout: float) -> bytes | None:
        """As `SyncControlLane.call`, awaited."""
        told = await self.call_told(name, payload, timeout)
        return None if told is None else told[0]

    async def call_told(self, name: str, payload: bytes, timeout: float) -> tuple[bytes, int] | None:
        """As `SyncControlLane.call_told`, awaited."""
        if not self.up and time.monotonic() < self.retry_at:
            return None
        conn = self._take()
        try:
            for attempt in (0, 1):
                if conn is None:
                    conn = await self._connect(timeout)
                data = self._request(conn, name, payload)
                try:
                    async with asyncio.timeout(timeout):
                        code, answer = await conn.roundtrip(data)
                except BaseException as exc:
                    conn.close()
                    conn = None
                    self._check_resend(name, exc, attempt, timeout)
                    continue
                boot_id = conn.boot_id
                return self._answer(conn, code, answer), boot_id
        except LaneUnavailable as exc:
            self._unusable(exc)
            return None
        raise AssertionError("unreachable: the second failure raises")
