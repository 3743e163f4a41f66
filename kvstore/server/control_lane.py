"""The daemon's side of the local control lane (framing in `kvstore.control_lane_wire`).

A Unix stream socket next to each gRPC Unix socket, served on the daemon's event loop by
a protocol that runs each call as soon as its frame is whole (see `_Connection`). It
exists because a grpc-python unary call costs several hundred microseconds of per-call
machinery on each side, which is most of a co-located engine's `Lookup` and of the local
data plane's per-batch control calls.

Each call goes through the per-call pipeline a gRPC call goes through
(`kvstore.server.pipeline`: metrics, drain gate, request id, auth admission, error
mapping), bound to the same per-method objects, then the gRPC servicer's own method with
the parsed request and `context=None` (the servicers' rule: no unary method reads its
context). Errors travel as (status code, message), exactly what the gRPC path would
answer. Request ids are this server's random prefix and the call's number.

Two seams reach past the servicer, on purpose:
- The core's `PolicyDeferral`: a lookup's policy touch is deferred by the store and
  applied here once the answer is written, rather than before it or in a loop turn of its
  own (`_Connection.dispatch`).
- asyncio's task protocol: a call is started by hand (`coro.send`) in the callback that
  received its frame, so a call that never suspends costs no task and no loop turn; one
  that suspends is handed to a task that finishes it (`kvstore.eager.resume`), which
  speaks the protocol a task's step speaks to the futures a coroutine yields.

Who may connect: the socket is created 0600 before it listens (in the socket
directory, which is 0700), and each connection's peer credentials (SO_PEERCRED) must
name the daemon's uid or root, the same set of processes that may map the shared
segment. The client's first frame carries its bearer token; the tenant is
authenticated then and again, against the current token table, on every call (so a
token revoked by a reload stops working on open connections too).

How many, and for how long (`kvstore.server.connections`): the server accepts on its
own (asyncio's accept loop answers a descriptor shortage by logging and retrying at
once, many times over); it holds at most `max_connections`, dropping the oldest one
that has not said hello to make room for a new one, and refuses the rest; a connection
that sends no hello within `hello_timeout_s`, or nothing for `idle_s`, is closed; when
accept() runs out of descriptors, accepting pauses for `ACCEPT_PAUSE_S`.

File descriptors: a Unix socket can carry them, gRPC cannot. A `LocalSegment` call
here runs with `PASSED_FDS` set to a list; the handler may put descriptors in it
(a tenant's own shared-memory segment, with auth on), and they go to the client with
the answer's first byte (SCM_RIGHTS). Over gRPC the list is None.

The peer lane (`ControlLaneServer.start_tcp`): the same server on a TCP socket, TLS when the
daemon has a certificate, for the calls the daemons of a pool make on each other. Its
connections skip the uid check (the network has none): the hello's token is what admits
them, accepted as a cluster credential (`Authenticator.identify_lane`), and every call
names the node and tenant it is made for (`kvstore.control_lane_wire.split_envelope`), checked
as gRPC checks those metadata entries (so only a pool's calls are admitted).

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import secrets
import socket
import ssl
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError

from kvstore.control_lane_wire import (
    HEADER,
    HELLO,
    HELLO_ANSWER,
    HELLO_ANSWER_GENERATION,
    MAGIC,
    MAGIC_GENERATION,
    MAX_HELLO_BYTES,
    METHOD_IDS,
    REQUEST_TYPES,
    method_path,
    split_envelope,
)

# The core's after-reply policy calls (see the module docstring): the one import of it.
from kvstore.core.store_tier import PolicyDeferral
from kvstore.eager import resume
from kvstore.errors import InvalidArgument, KVStoreError, PermissionDenied, ResourceExhausted
from kvstore.server.auth import MAX_TOKEN_CHARS
from kvstore.server.pipeline import CallSteps, Pipeline

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0
IDLE_S = 300.0
MAX_CONNECTIONS = 1024
LISTEN_BACKLOG = 128
# Connections taken per wake-up of the listening socket, so a flood cannot hold the loop.
ACCEPTS_PER_WAKEUP = 64
# accept() failures that a pause, not a retry, can cure.
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_PAUSE_S = 1.0
# Room offered at least to each read of a connection's socket; a buffer grown past
# RECEIVE_KEEP for a large frame is dropped once emptied.
RECEIVE_CHUNK = 1 << 16
RECEIVE_KEEP = 1 << 20
# Answers larger than this wait for the socket to drain before the next call is read.
WRITE_HIGH_WATER = 1 << 20
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# The calls whose handlers may pass file descriptors with their answer.
PASSES_FDS = frozenset({"LocalSegment"})
# Where such a handler puts them (see the module docstring); None outside the lane.
PASSED_FDS: ContextVar[list[int] | None] = ContextVar("kvstore_lane_passed_fds", default=None)

_NO_ENVELOPE = "a peer lane request must start with the node and tenant it is made for"

Handler = Callable[[Any, Any], Awaitable[Any]]
# A call's answer: status, payload, and for a call that passes them, the descriptors.
Answer = tuple[int, bytes] | tuple[int, bytes, list[int]]


class _Ending(NamedTuple):
    """A call's metrics, recorded once its answer is written (`CallSteps.record`): its
    steps and status, when it started and when its answer was made."""

    steps: CallSteps
    code: grpc.StatusCode
    start: float
    end: float

    def record(self) -> None:
        self.steps.record(self.code, self.start, self.end)


class _Method:
    __slots__ = ("name", "request_type", "handler", "steps", "passes_fds")

    def __init__(self, name: str, handler: Handler, steps: CallSteps) -> None:
        self.name = name
        self.request_type = REQUEST_TYPES[name]
        self.handler = handler
        self.steps = steps
        self.passes_fds = name in PASSES_FDS


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid


class ControlLaneServer:
    """Serves the KVStore servicer's unary methods on one Unix socket (`start`), or the
    pool's node-to-node calls on one TCP socket (`start_tcp`)."""

    def __init__(self, servicer: Any, pipeline: Pipeline, max_frame_bytes: int,
                 max_connections: int = MAX_CONNECTIONS, deferral: PolicyDeferral | None = None,
                 hello_timeout_s: float = HELLO_TIMEOUT_S, idle_s: float = IDLE_S, boot_id: int = 0) -> None:
        self.auth = pipeline.auth
        # This start of the daemon, told to a client whose hello asks for it (MAGIC_GENERATION).
        self.boot_id = boot_id
        # The store's deferred policy calls (a lookup's touch), applied here once each
        # answer is written, rather than in a turn of the event loop of their own.
        self.deferral = deferral if deferral is not None else PolicyDeferral()
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.hello_timeout_s = hello_timeout_s
        self.idle_s = idle_s
        self.uid = os.getuid()
        self.path = ""  # the Unix socket's path
        self.tcp = False  # a peer lane (see the module docstring)
        self.address = ""  # where it listens: the path, or host:port
        self.tls: ssl.SSLContext | None = None
        self.calls = 0
        # Request ids for the logs, as gRPC calls get them: unique within this daemon's run
        # (a random prefix per server, then the call's number), without a syscall per call.
        self._id_prefix = f"{secrets.token_hex(3)}-"
        self._methods = {mid: _Method(name, getattr(servicer, name), pipeline.bind(method_path(name)))
                         for name, mid in METHOD_IDS.items()}
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connections: set[_Connection] = set()
        # Connections that have not said hello yet, oldest first: the first to go when
        # a new one needs room.
        self._unhelloed: dict[_Connection, None] = {}
        # Accepted sockets whose transport is being made.
        self._opening: set[asyncio.Task[Any]] = set()
        self._resume: asyncio.TimerHandle | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, path: str) -> None:
        """Listen on `path` (a stale socket there must already be cleared). The socket is
        bound and made 0600 before it listens, so nobody can connect in between."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            try:
                os.chmod(path, 0o600)
                sock.listen(LISTEN_BACKLOG)
                sock.setblocking(False)
                loop = self._loop = asyncio.get_running_loop()
                loop.add_reader(sock.fileno(), self._accept)
            except BaseException:
                os.unlink(path)
                raise
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.path = self.address = path
        self._sweeper = loop.call_later(self.idle_s, self._sweep)

    async def start_tcp(self, host: str, port: int, tls: ssl.SSLContext | None) -> str:
        """Listen for the pool's node-to-node calls on `host`:`port` (0: a port of the
        system's choosing), TLS with `tls`; the address bound, host:port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
            loop = self._loop = asyncio.get_running_loop()
            loop.add_reader(sock.fileno(), self._accept)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.tcp = True
        self.tls = tls
        bound_port = sock.getsockname()[1]
        self.address = f"[{host}]:{bound_port}" if family == socket.AF_INET6 else f"{host}:{bound_port}"
        self._sweeper = loop.call_later(self.idle_s, self._sweep)
        return self.address

    async def close(self) -> None:
        """Stop listening, end every connection and remove the socket file."""
        for handle in (self._resume, self._sweeper):
            if handle is not None:
                handle.cancel()
        self._resume = self._sweeper = None
        if self._sock is not None:
            assert self._loop is not None
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for opening in self._opening:
            opening.cancel()
        pending = [c.task for c in self._connections if c.task is not None] + list(self._opening)
        for conn in list(self._connections):
            conn.abort()
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        # An aborted transport closes its socket in a callback of the next loop turn: let
        # it run (the loop may be closed right after this returns).
        await asyncio.sleep(0)
        self._connections.clear()
        self._unhelloed.clear()
        if self.path and not self.tcp:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = ""

    # --- accepting

    def _accept(self) -> None:
        """The listening socket is readable: take what is waiting, a bounded number."""
        assert self._sock is not None
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                sock, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                # Retrying at once would fail the same way, as fast as the loop turns:
                # pause instead, while connections end and give descriptors back.
                hint = (" (raise the open-file limit, or lower max_connections)"
                        if exc.errno in _OUT_OF_RESOURCES else "")
                logger.error("control lane %s cannot accept connections (%s); accepting again in %gs%s", self.address,
                             exc.strerror or exc, ACCEPT_PAUSE_S, hint)
                self._pause_accepting()
                return
            self._admit(sock)

    def _pause_accepting(self) -> None:
        assert self._sock is not None and self._loop is not None
        self._loop.remove_reader(self._sock.fileno())
        self._resume = self._loop.call_later(ACCEPT_PAUSE_S, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._resume = None
        if self._sock is not None and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _admit(self, sock: socket.socket) -> None:
        """Serve an accepted connection, or answer its refusal and hang up."""
        try:
            if self.tcp:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                refusal = self.admit_peer(self.uid)  # the token admits it (module docstring)
            else:
                refusal = self.admit_peer(peer_uid(sock))
        except OSError as exc:
            sock.close()
            logger.debug("lane connection lost before it was served: %s", exc)
            return
        if refusal is not None:
            _refuse_socket(sock, refusal)
            return
        sock.setblocking(False)
        assert self._loop is not None
        handshake_s = self.hello_timeout_s if self.tls is not None else None
        task = self._loop.create_task(self._loop.connect_accepted_socket(
            lambda: _Connection(self), sock, ssl=self.tls, ssl_handshake_timeout=handshake_s))
        self._opening.add(task)
        task.add_done_callback(functools.partial(self._opened, sock))

    def _opened(self, sock: socket.socket, task: asyncio.Task[Any]) -> None:
        self._opening.discard(task)
        if task.cancelled() or task.exception() is not None:
            sock.close()  # no transport took it (the daemon is stopping, or the handshake failed)
            if not task.cancelled():
                logger.debug("lane connection lost before it was served: %s", task.exception())

    def admit_peer(self, uid: int) -> KVStoreError | None:
        """The refusal of a new connection from a process of `uid`, or None. At the cap,
        the oldest connection that has not said hello yet makes room, if there is one."""
        if uid not in (self.uid, 0):
            logger.warning("lane connection from uid %d refused (only uid %d and root may connect)", uid, self.uid)
            return PermissionDenied(
                f"the control lane admits only the daemon's uid ({self.uid}) and root; this process runs as uid {uid}")
        if len(self._connections) + len(self._opening) >= self.max_connections:
            if not self._unhelloed:
                return ResourceExhausted(
                    f"the control lane has {self.max_connections} connections open, the most it serves; use gRPC")
            oldest = next(iter(self._unhelloed))
            del self._unhelloed[oldest]
            oldest.abort()
        return None

    def _sweep(self) -> None:
        """Close the connections that received nothing since the last sweep, one
        `idle_s` ago, unless a call of theirs is running or being answered."""
        for conn in list(self._connections):
            if conn.active or conn.task is not None or conn.write_paused:
                conn.active = False
            else:
                conn.close()
        assert self._loop is not None
        self._sweeper = self._loop.call_later(self.idle_s, self._sweep)

    def hello(self, payload: bytes) -> tuple[KVStoreError | None, str | None]:
        """A hello frame's payload: (the refusal to answer, or None; the client's token,
        None if it sent none)."""
        if payload[: len(MAGIC)] not in (MAGIC, MAGIC_GENERATION):
            return InvalidArgument("not a kvstore control lane hello (bad magic)"), None
        try:
            text = payload[len(MAGIC):].decode("utf-8")
        except UnicodeDecodeError:
            text = "\0"  # not a token anyone holds: refused below like a wrong one
        # As for gRPC metadata: no token is None, a malformed one "" (refused when auth is on).
        token: str | None = None if not text else ("" if len(text) > MAX_TOKEN_CHARS else text)
        try:
            if self.tcp:
                self.auth.identify_lane(method_path("Lookup"), token, False)
            else:
                self.auth.identify(method_path("Lookup"), token, True)
        except KVStoreError as exc:
            logger.debug("lane hello refused: %s: %s", exc.code.name, exc)
            return exc, None
        return None, token

    async def _call(self, mid: int, payload: bytes, token: str | None) -> tuple[Answer, _Ending | None]:
        """One call, through the per-call pipeline (see the module docstring): its answer,
        and its metrics, which the connection records once the answer is written (the
        call has left its tenant's in-flight count by then; its duration is measured up
        to its answer either way)."""
        method = self._methods.get(mid)
        if method is None:
            return (grpc.StatusCode.UNIMPLEMENTED.value[0],
                    f"method id {mid} is not served on the control lane".encode()), None
        self.calls += 1
        steps = method.steps
        start = time.perf_counter()
        identity = None
        code = grpc.StatusCode.OK
        out = b""
        fds: list[int] | None = None
        if method.passes_fds:
            PASSED_FDS.set(fds := [])
        try:
            if self.tcp:
                envelope = split_envelope(payload)
                identity = self._enter_peer(method, envelope, token)
                if envelope is None:
                    raise InvalidArgument(_NO_ENVELOPE)
                payload = envelope[2]
            else:
                identity = steps.enter(token, True, f"{self._id_prefix}{self.calls:x}")
            try:
                request = method.request_type.FromString(payload)
            except DecodeError:
                raise InvalidArgument(f"the {method.name} request does not parse") from None
            response = await method.handler(request, None)
            out = response.SerializeToString()
            if len(out) > self.max_frame_bytes:
                raise ResourceExhausted(
                    f"the {method.name} answer is {len(out)} bytes, more than max_message_bytes "
                    f"({self.max_frame_bytes}); ask for fewer blocks per call")
        except Exception as exc:  # task boundary: map, log, answer
            code, message = steps.failed(exc)
            out = message.encode()
        except BaseException:  # cancelled (the daemon is stopping), or closed unanswered
            code = grpc.StatusCode.CANCELLED
            steps.record(code, start, time.perf_counter())
            raise
        finally:
            steps.release(identity)
            if fds is not None:
                PASSED_FDS.set(None)
        ending = _Ending(steps, code, start, time.perf_counter())
        if fds and code is grpc.StatusCode.OK:
            return (code.value[0], out, fds), ending
        return (code.value[0], out), ending


    def _enter_peer(self, method: _Method, envelope: tuple[str, str, bytes] | None, token: str | None) -> Any:
        """The pipeline's entry of a peer lane call, its envelope checked as the same
        call's metadata would be over gRPC: the identity, or what `enter` refused (a
        request without a whole envelope, once its token passed, does not parse)."""
        try:
            return method.steps.enter(token, False, f"{self._id_prefix}{self.calls:x}",
                                      None if envelope is None else envelope[:2])
        except PermissionDenied:
            if envelope is None:
                raise InvalidArgument(_NO_ENVELOPE) from None
            raise


def _refuse_socket(sock: socket.socket, exc: KVStoreError) -> None:
    """Answer `exc` on a socket no transport owns yet (one small frame: it fits in the
    socket's buffer, or is dropped), then close it."""
    message = str(exc).encode()
    try:
        sock.setblocking(False)
        sock.send(HEADER.pack(len(message), exc.code.value[0]) + message)
    except OSError:
        pass
    sock.close()


class _Connection(asyncio.BufferedProtocol):
    """One lane connection: frames are cut out of the received bytes as they arrive and
    each call is started at once, in the loop's callback for those bytes. A call that
    completes without suspending (a Lookup, most control calls) is answered right there,
    with no task and no further trip through the event loop; one that suspends is run on
    as a task, and the frames after it wait for it, so answers keep their order.

    The socket is read into the connection's own buffer (`get_buffer`), which is reused
    from call to call: a plain protocol would be handed a new bytes object per read, made
    from a fresh allocation of the transport's largest read size, which costs a small
    call more than everything else it does on the way in."""

    def __init__(self, server: ControlLaneServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray(RECEIVE_CHUNK)
        self.start = 0  # the first byte not taken yet
        self.end = 0  # the end of the bytes received
        self.admitted = False
        self.token: str | None = None
        self.task: asyncio.Task[Any] | None = None
        self.closing = False
        self.write_paused = False
        self.read_paused = False
        self.active = True  # bytes arrived since the last idle sweep
        self._hello_timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        server = self.server
        server._connections.add(self)
        server._unhelloed[self] = None
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self._hello_timer = asyncio.get_running_loop().call_later(server.hello_timeout_s, self.abort)

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the next read lands: the free tail of the buffer, at least RECEIVE_CHUNK
        bytes. To make room the unread bytes move to the front, or into a buffer twice
        as large, so it grows with the bytes that arrive, never with what a header
        announces; never resized in place, as the view handed out may outlive this call."""
        buf, start, end = self.buf, self.start, self.end
        if start == end:
            start = end = self.start = self.end = 0
            if len(buf) > RECEIVE_KEEP:  # an empty buffer grown for a large frame
                buf = self.buf = bytearray(RECEIVE_CHUNK)
        if len(buf) - end < RECEIVE_CHUNK:
            unread = end - start
            if unread + RECEIVE_CHUNK <= len(buf):
                buf[:unread] = buf[start:end]  # same size: moves the bytes, never resizes
            else:
                grown = bytearray(max(2 * len(buf), unread + RECEIVE_CHUNK))
                grown[:unread] = buf[start:end]
                buf = self.buf = grown
            self.start, self.end = 0, unread
            end = unread
        return memoryview(buf)[end:]

    def buffer_updated(self, nbytes: int) -> None:
        self.end += nbytes
        self.active = True
        self.take_frames()

    def eof_received(self) -> bool | None:
        if self.end > self.start:
            logger.debug("lane connection closed inside a frame")
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server._connections.discard(self)
        self.server._unhelloed.pop(self, None)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self.task is not None:
            self.task.cancel()  # the daemon is stopping, or the client went away

    def pause_writing(self) -> None:
        self.write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.take_frames()

    # --- frames

    def take_frames(self) -> None:
        """Answer every whole frame received, in order, until a call suspends."""
        buf = self.buf
        size = HEADER.size
        server = self.server
        while not self.closing and self.task is None and not self.write_paused and self.end - self.start >= size:
            start = self.start
            length, kind = HEADER.unpack_from(buf, start)
            if not self.admitted:
                if kind != HELLO or not len(MAGIC) <= length <= MAX_HELLO_BYTES:
                    self.refuse(InvalidArgument(
                        "a control lane connection must start with a hello frame (kvstore.control_lane_wire)"))
                    return
            elif length > server.max_frame_bytes:
                # Never read (or keep) what the peer says it will send past the limit.
                self.refuse(ResourceExhausted(
                    f"a control lane request of {length} bytes is larger than max_message_bytes "
                    f"({server.max_frame_bytes}); send fewer blocks per call"))
                return
            if self.end - start < size + length:
                break
            payload = bytes(memoryview(buf)[start + size:start + size + length])
            self.start = start + size + length
            if self.admitted:
                self.dispatch(kind, payload)
                continue
            refusal, self.token = server.hello(payload)
            if refusal is not None:
                self.refuse(refusal)
                return
            self.admitted = True
            server._unhelloed.pop(self, None)
            if self._hello_timer is not None:
                self._hello_timer.cancel()
                self._hello_timer = None
            if payload[: len(MAGIC_GENERATION)] == MAGIC_GENERATION:
                self.write(0, HELLO_ANSWER_GENERATION.pack(MAGIC_GENERATION, server.max_frame_bytes, server.boot_id))
            else:
                self.write(0, HELLO_ANSWER.pack(MAGIC, server.max_frame_bytes))
        if self.task is not None or self.write_paused:
            # Waiting: keep at most one more whole frame buffered.
            if self.end - self.start > server.max_frame_bytes + 2 * size:
                self._pause_reading()
        elif self.read_paused:
            self.read_paused = False
            if self.transport is not None:
                self.transport.resume_reading()

    def dispatch(self, mid: int, payload: bytes) -> None:
        """Start one call; answer it now if it completes without suspending. What the
        call deferred to the store's policies is applied after that (`PolicyDeferral`)."""
        coro = self.server._call(mid, payload, self.token)
        deferral = self.server.deferral
        deferral.hold()
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            self._answer(*stop.value)
            return
        finally:
            deferral.release()
        self.task = asyncio.get_running_loop().create_task(self._finish(coro, yielded))
        self.task.add_done_callback(self._failed)

    async def _finish(self, coro: Coroutine[Any, Any, tuple[Answer, _Ending | None]], yielded: Any) -> None:
        """Run a call that suspended on to its answer, and write it in the same step (not
        in a done callback, a loop turn later: what the call scheduled to follow its
        answer, such as a lookup's pulls, runs after the answer is on its way); then the
        frames that waited for it."""
        answer, ending = await resume(coro, yielded)
        self.task = None
        self._answer(answer, ending)
        self.take_frames()

    def _answer(self, answer: Answer, ending: _Ending | None) -> None:
        """Write a call's answer, then record its metrics."""
        self.write(*answer)
        if ending is not None:
            ending.record()

    def _failed(self, task: asyncio.Task[Any]) -> None:
        if self.task is task:
            self.task = None
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # `_call` answers every error itself: this is a bug
            logger.error("lane call failed", exc_info=exc)
            self.abort()

    def write(self, code: int, out: bytes, fds: list[int] | None = None) -> None:
        if self.transport is not None and not self.closing:
            if fds:
                self._write_with_fds(HEADER.pack(len(out), code) + out, fds)
                return
            self.transport.write(HEADER.pack(len(out), code) + out)

    def _write_with_fds(self, data: bytes, fds: list[int]) -> None:
        """Send `data` with `fds` attached to its first byte. The transport cannot carry
        them, so the first bytes go straight to the socket, which is only right while
        nothing of an earlier answer waits in the transport's buffer."""
        assert self.transport is not None
        sock = self.transport.get_extra_info("socket")
        sent = 0
        if sock is not None and not self.transport.get_write_buffer_size():
            try:
                with socket.socket(fileno=os.dup(sock.fileno())) as raw:  # the same connection
                    sent = socket.send_fds(raw, [data], fds, socket.MSG_NOSIGNAL)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                logger.debug("lane answer with descriptors not sent: %s", exc)
                self.abort()
                return
        if not sent:
            message = b"the answer could not be sent with its file descriptor; ask again on an idle connection"
            self.transport.write(HEADER.pack(len(message), grpc.StatusCode.UNAVAILABLE.value[0]) + message)
            return
        if sent < len(data):
            self.transport.write(data[sent:])

    def refuse(self, exc: KVStoreError) -> None:
        """Answer `exc` and hang up (after the answer is sent)."""
        self.write(exc.code.value[0], str(exc).encode())
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Hang up once what was written has been sent."""
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()
