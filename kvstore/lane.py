"""The daemon's side of the local control lane (framing in `kvstore.laneproto`).

A Unix stream socket next to each gRPC Unix socket, served by asyncio streams on the
daemon's event loop. It exists because a grpc-python unary call costs several hundred
microseconds of per-call machinery on each side, which is most of a co-located
engine's `Lookup` and of the local data plane's per-batch control calls.

Each call goes through the same steps a gRPC call does, in the same order, and through
the same objects: the metrics histogram and in-flight gauge (same method labels), the
drain gate (refused with UNAVAILABLE while shutting down, LocalCommit excepted, and
waited for), a request id for the logs, the auth admission step
(`AuthInterceptor.admit`: token -> tenant, role and `local_plane` checks, the per-tenant
cap on calls in flight), then the gRPC servicer's own method with the parsed request.
Errors travel as (status code, message), exactly what the gRPC path would answer.

Who may connect: the socket is created 0600 before it listens (in the socket
directory, which is 0700), and each connection's peer credentials (SO_PEERCRED) must
name the daemon's uid or root, the same set of processes that may map the shared
segment. The client's first frame carries its bearer token; the tenant is
authenticated then and again, against the current token table, on every call (so a
token revoked by a reload stops working on open connections too).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvstore.auth import MAX_TOKEN_CHARS, AuthInterceptor
from kvstore.errors import InvalidArgument, KVStoreError, PermissionDenied, ResourceExhausted
from kvstore.interceptors import request_id
from kvstore.laneproto import (
    HEADER,
    HELLO,
    HELLO_ANSWER,
    MAGIC,
    MAX_HELLO_BYTES,
    METHOD_IDS,
    REQUEST_TYPES,
    frame,
    method_path,
)
from kvstore.lifecycle import REFUSAL, DrainGate
from kvstore.metrics import Metrics

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 1024
# Answers larger than this wait for the socket to drain before the next call is read.
WRITE_HIGH_WATER = 1 << 20
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

Handler = Callable[[Any, Any], Awaitable[Any]]


class _Method:
    __slots__ = ("name", "path", "request_type", "handler", "in_flight", "observed")

    def __init__(self, name: str, handler: Handler, metrics: Metrics) -> None:
        self.name = name
        self.path = method_path(name)
        self.request_type = REQUEST_TYPES[name]
        self.handler = handler
        self.in_flight = metrics.rpcs_in_flight.labels(name)
        self.observed: dict[grpc.StatusCode, Any] = {}  # histogram children by status


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid


class LaneServer:
    """Serves the KVStore servicer's unary methods on one Unix socket."""

    def __init__(self, servicer: Any, auth: AuthInterceptor, gate: DrainGate, metrics: Metrics,
                 max_frame_bytes: int, max_connections: int = MAX_CONNECTIONS) -> None:
        self.auth = auth
        self.gate = gate
        self.metrics = metrics
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.uid = os.getuid()
        self.path = ""
        self.calls = 0
        self._methods = {mid: _Method(name, getattr(servicer, name), metrics) for name, mid in METHOD_IDS.items()}
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, path: str) -> None:
        """Listen on `path` (a stale socket there must already be cleared). The socket is
        bound and made 0600 before it listens, so nobody can connect in between."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            try:
                os.chmod(path, 0o600)
                self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=1 << 16)
            except BaseException:
                os.unlink(path)
                raise
        except BaseException:
            sock.close()
            raise
        self.path = path

    async def close(self) -> None:
        """Stop listening, end every connection and remove the socket file."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = ""

    # ------------------------------------------------------------------ connections

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            admitted, token = await self._hello(reader, writer)
            if admitted:
                await self._calls(reader, writer, token)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the client went away (or never said hello): nothing to answer
        except asyncio.CancelledError:
            pass  # the daemon is stopping
        except Exception:  # task boundary: one bad connection must not stop the lane
            logger.exception("lane connection failed")
        finally:
            self._connections.discard(task)
            writer.close()

    async def _refuse(self, writer: asyncio.StreamWriter, exc: KVStoreError) -> tuple[bool, None]:
        writer.write(frame(exc.code.value[0], str(exc).encode()))
        await writer.drain()
        return False, None

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[bool, str | None]:
        """(whether the connection was admitted, the client's token: None if it sent none)."""
        sock = writer.get_extra_info("socket")
        uid = peer_uid(sock) if sock is not None else -1
        if uid not in (self.uid, 0):
            logger.warning("lane connection from uid %d refused (only uid %d and root may connect)", uid, self.uid)
            return await self._refuse(writer, PermissionDenied(
                f"the control lane admits only the daemon's uid ({self.uid}) and root; this process runs as uid {uid}"))
        if len(self._connections) > self.max_connections:
            return await self._refuse(writer, ResourceExhausted(
                f"the control lane has {self.max_connections} connections open, the most it serves; use gRPC"))
        length, kind = HEADER.unpack(await asyncio.wait_for(reader.readexactly(HEADER.size), HELLO_TIMEOUT_S))
        if kind != HELLO or not len(MAGIC) <= length <= MAX_HELLO_BYTES:
            return await self._refuse(writer, InvalidArgument(
                "a control lane connection must start with a hello frame (kvstore.laneproto)"))
        payload = await asyncio.wait_for(reader.readexactly(length), HELLO_TIMEOUT_S)
        if payload[: len(MAGIC)] != MAGIC:
            return await self._refuse(writer, InvalidArgument("not a kvstore control lane hello (bad magic)"))
        try:
            text = payload[len(MAGIC):].decode("utf-8")
        except UnicodeDecodeError:
            text = "\0"  # not a token anyone holds: refused below like a wrong one
        # As for gRPC metadata: no token is None, a malformed one "" (refused when auth is on).
        token: str | None = None if not text else ("" if len(text) > MAX_TOKEN_CHARS else text)
        try:
            self.auth.identify(method_path("Lookup"), token, True)
        except KVStoreError as exc:
            logger.debug("lane hello refused: %s: %s", exc.code.name, exc)
            return await self._refuse(writer, exc)
        writer.write(frame(0, HELLO_ANSWER.pack(MAGIC, self.max_frame_bytes)))
        return True, token

    async def _calls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str | None) -> None:
        header_size = HEADER.size
        unpack = HEADER.unpack
        while True:
            try:
                head = await reader.readexactly(header_size)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    logger.debug("lane connection closed inside a frame header")
                return
            length, mid = unpack(head)
            if length > self.max_frame_bytes:
                # Never read (or allocate) what the peer says it will send past the limit.
                await self._refuse(writer, ResourceExhausted(
                    f"a control lane request of {length} bytes is larger than max_message_bytes "
                    f"({self.max_frame_bytes}); send fewer blocks per call"))
                return
            payload = await reader.readexactly(length) if length else b""
            code, out = await self._call(mid, payload, token)
            writer.write(HEADER.pack(len(out), code) + out)
            if writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                await writer.drain()

    async def _call(self, mid: int, payload: bytes, token: str | None) -> tuple[int, bytes]:
        """One call, through the same steps as a gRPC call (see the module docstring)."""
        method = self._methods.get(mid)
        if method is None:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], f"method id {mid} is not served on the control lane".encode()
        self.calls += 1
        start = time.perf_counter()
        method.in_flight.inc()
        code = grpc.StatusCode.OK
        out = b""
        try:
            if self.gate.refuses(method.path):
                code, out = grpc.StatusCode.UNAVAILABLE, REFUSAL.encode()
                return code.value[0], out
            self.gate.enter()
            try:
                request_id.set(secrets.token_hex(6))
                try:
                    identity = self.auth.admit(method.path, token, True)
                except KVStoreError as exc:
                    logger.debug("%s refused on the control lane: %s: %s", method.path, exc.code.name, exc)
                    raise
                try:
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
                finally:
                    self.auth.leave(identity)
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED  # the daemon is stopping
                raise
            except KVStoreError as exc:
                logger.debug("%s failed: %s: %s", method.path, exc.code.name, exc)
                code, out = exc.code, str(exc).encode()
            except Exception:  # task boundary: map, log, answer
                logger.exception("%s failed unexpectedly", method.path)
                code = grpc.StatusCode.INTERNAL
                out = f"internal error in {method.path}; see the daemon's log".encode()
            finally:
                self.gate.leave()
            return code.value[0], out
        finally:
            method.in_flight.dec()
            child = method.observed.get(code)
            if child is None:
                child = method.observed[code] = self.metrics.rpc_seconds.labels(method.name, code.name)
            child.observe(time.perf_counter() - start)
