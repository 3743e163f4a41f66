"""The daemon's side of the data lane (framing in `kvstore.data_lane`): listeners of its
own, one thread per connection, moving the bytes of the transfers that
`kvstore.server.data_lane.transfers` opened on control calls.

Primitives: `DataLaneServer` (`start(addresses)`, `endpoints()`, `close()`),
`lane_addresses(config, grpc_addresses)`, `check_lane_exposure(...)`, `server_tls(config)`,
`DataLaneCollector` (the `kvstore_datalane_*` metrics).

Why threads and not the event loop: a block is one `sendmsg` from the host segment's
memory, or a few `recv_into` straight into a PENDING slot, each holding no GIL while the
kernel copies; one thread per connection lets several connections copy at once while
the loop keeps serving calls. The loop keeps everything the store owns (see
`kvstore.server.data_lane.transfers`); a connection thread touches only its socket and the shared
state of the transfer it works on.

Who may connect: the same rules as gRPC. The listeners are refused at start-up when they
would expose the daemon beyond this host without a token file, and without TLS unless
`insecure_remote` (`check_lane_exposure`); TCP lanes use TLS (Python's `ssl`, the
daemon's gRPC certificate and client CA) whenever the gRPC listeners do. A Unix lane is
created 0600 in the daemon's 0700 socket directory. The first frame of a connection is a
hello with the bearer token, checked by the daemon's `Authenticator` (on the loop) as a
call of `DataLane` would be; a connection may then only join transfers its tenant
opened, so tenant isolation holds on the lane as on gRPC, and never one that a
node-to-node call opened. A connection of a node's credential (role peer) may join only
transfers that calls from that node opened (`Joiner`): those calls were authorized for
the tenant they act for, and the transfer's id (16 random bytes, answered only to that
call) is the claim to it. The hello of a node's credential is taken only from a member of
the pool's current view.

Strangers cannot take the slots of authenticated connections: a connection holds one of
the lane's `max_connections` slots only once its hello checked out. Before that it is
pending, and pending connections have a budget of their own (`PENDING_PER_SOURCE` per
source address, `PENDING_SHARE` of the cap in all): past it the oldest pending
connection (of that source, else of all) is dropped to make room, and every pending
connection is dropped `HELLO_TIMEOUT_S` after it was accepted, TLS handshake included. A
flood of connections that never say hello thus delays nobody's hello by more than the
time it takes to send one; a client refused at its hello because every slot is taken by
authenticated connections is told RESOURCE_EXHAUSTED, and the SDK then moves the bytes
through gRPC (`kvstore.client.data_lane`).

Bounded by construction: at most `max_connections` authenticated connections, and the
pending ones above; a frame, once begun, must make progress within the I/O timeout;
an idle connection is closed after IDLE_TIMEOUT_S; a sender that exceeds its credit is
disconnected; a DATA payload is at most the daemon's `max_block_bytes`. A put's credit
covers only the slots its window has reserved (`PutTransfer.take_credit`): a connection
that used its credit up waits, on its thread, for the window to move on.

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.codecs import Codec
from kvstore.control_lane_wire import method_path
from kvstore.data_lane import (
    CREDIT,
    DATA,
    END,
    ERROR,
    FETCH,
    HELLO,
    MAX_ERROR_BYTES,
    MAX_HELLO_BYTES,
    PUSH,
    TRAILER,
    VERSION,
    WELCOME,
    Frame,
    LaneClosed,
    LaneSocket,
    LaneTimeout,
    ProtocolError,
    boot_id_field,
    parse_hello,
    send_batch,
)
from kvstore.errors import ConfigError, KVStoreError
from kvstore.server.auth import ACTS_FOR_TENANTS, Authenticator, Identity
from kvstore.server.config import Config
from kvstore.server.data_lane.fetch import FetchTransfer
from kvstore.server.data_lane.put import PutTransfer
from kvstore.server.data_lane.transfer import DataLaneCounters
from kvstore.server.data_lane.transfers import ANY_NODE, DataLaneTransfers, Joiner
from kvstore.server.listen import ListenAddress, is_loopback, parse_listen, prepare_unix_path
from kvstore.v1 import kvstore_pb2

logger = logging.getLogger(__name__)

# From accept to a checked hello (the TLS handshake included): a connection that has not
# said hello by then is dropped.
HELLO_TIMEOUT_S = 3.0
IDLE_TIMEOUT_S = 600.0
# Connections not yet past their hello (see `DataLaneServer._take`): at most this many from
# one source address, and at most `PENDING_SHARE` of the lane's connection cap in all
# (at least `MIN_PENDING`); past either, the oldest such connection makes room.
PENDING_PER_SOURCE = 64
PENDING_SHARE = 0.5
MIN_PENDING = 16
# While a fetch waits for credit, how often it looks whether its transfer failed.
CREDIT_POLL_S = 0.05
# Connections taken per wake-up of a listener, and the pause after a failed accept (out of
# descriptors: retrying at once would fail the same way, as fast as the loop turns).
ACCEPTS_PER_WAKEUP = 32
ACCEPT_PAUSE_S = 0.1
# Put transfers one connection remembers credit for (a client runs one at a time).
MAX_PUTS_PER_CONNECTION = 16
AUTH_PATH = method_path("DataLane")
OFF, AUTO = "off", "auto"
UNIX_SUFFIX = ".data"


def lane_addresses(config: Config, grpc_addresses: Sequence[ListenAddress],
                   key: str = "data_lane_listen") -> list[ListenAddress]:
    """Where the lane of setting `key` (data_lane_listen, peer_lane_listen) listens: `off`;
    `auto`, next to each TCP gRPC listener, on the same host with a port of the system's
    choosing; or the addresses listed."""
    spec = [a.strip() for a in getattr(config, key) if a.strip()]
    if spec == [OFF]:
        return []
    if spec == [AUTO]:
        return [ListenAddress("tcp", host=a.host, port=0) for a in grpc_addresses if a.kind == "tcp"]
    if OFF in spec or AUTO in spec:
        raise ConfigError(f"{key} {','.join(spec)!r}: 'off' and 'auto' stand alone; or list addresses")
    return [parse_listen(a) for a in spec]


def check_lane_exposure(config: Config, addresses: Sequence[ListenAddress], key: str = "data_lane_listen") -> None:
    """The rules of the gRPC listeners (`kvstore.server.listen.check_exposure`)."""
    for addr in addresses:
        if addr.kind != "tcp" or is_loopback(addr.host):
            continue
        if not config.auth_token_file:
            raise ConfigError(
                f"{key} {addr.grpc_target} is not loopback, and serving other hosts needs "
                f"authentication: set --auth-token-file (see SECURITY.md), or a loopback {key}"
            )
        if not config.tls_cert and not config.insecure_remote:
            raise ConfigError(
                f"{key} {addr.grpc_target} is not loopback and TLS is off, so tokens and blocks would "
                "cross the network in clear text: set --tls-cert and --tls-key, or --insecure-remote on a trusted "
                "network"
            )


def server_tls(config: Config) -> ssl.SSLContext | None:
    """The TCP lanes' TLS context: the gRPC listeners' certificate (and client CA)."""
    if not config.tls_cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
        if config.tls_client_ca:
            ctx.load_verify_locations(config.tls_client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate for the data lane: {exc}") from None
    return ctx


class DataLaneServer:
    """The lane's listeners and connection threads for one daemon."""

    def __init__(self, transfers: DataLaneTransfers, auth: Authenticator, tls: ssl.SSLContext | None,
                 max_connections: int, advertise: Sequence[str] = ()) -> None:
        self.transfers = transfers
        self.settings = transfers.settings
        self.counters = transfers.counters
        self.auth = auth
        self.tls = tls
        self.max_connections = max_connections
        self.advertise = list(advertise)
        self.bound: list[ListenAddress] = []
        self.closing = False
        self._listeners: list[socket.socket] = []
        self._unix_paths: list[str] = []
        self._paused: dict[int, asyncio.TimerHandle] = {}  # listener fd -> when it accepts again
        self._lock = threading.Lock()
        self._sockets: set[LaneSocket] = set()
        self._raw: set[socket.socket] = set()
        # Accepted connections whose hello has not checked out yet (oldest first), each
        # with its source address, and how many each source has; then the admitted count.
        self._pending: dict[socket.socket, str] = {}
        self._pending_by_source: dict[str, int] = {}
        self._admitted = 0
        self.max_pending = max(MIN_PENDING, int(max_connections * PENDING_SHARE))
        self._threads: set[threading.Thread] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -------------------------------------------------------------- listeners

    async def start(self, addresses: Sequence[ListenAddress]) -> None:
        self._loop = asyncio.get_running_loop()
        for addr in addresses:
            sock = self._listen(addr)
            self._listeners.append(sock)
            if addr.kind == "unix":
                self.bound.append(addr)
            else:
                host, port = sock.getsockname()[:2]
                self.bound.append(ListenAddress("tcp", host=addr.host, port=port))
            self._loop.add_reader(sock.fileno(), self._accept, sock, addr.kind == "unix")

    def _listen(self, addr: ListenAddress) -> socket.socket:
        if addr.kind == "unix":
            prepare_unix_path(addr.path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(addr.path)
                os.chmod(addr.path, 0o600)  # before it listens: nobody connects in between
            except OSError as exc:
                sock.close()
                raise ConfigError(f"cannot listen on data lane {addr.grpc_target}: {exc.strerror}") from None
            self._unix_paths.append(addr.path)
        else:
            try:
                infos = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise ConfigError(f"data lane address {addr.grpc_target}: {exc}") from None
            family, _, _, _, sockaddr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(sockaddr)
            except OSError as exc:
                sock.close()
                raise ConfigError(f"cannot listen on data lane {addr.grpc_target}: {exc.strerror}; is it in use? "
                                  "choose another --data-lane-listen") from None
        sock.listen(128)
        sock.setblocking(False)
        return sock

    def endpoints(self) -> list[kvstore_pb2.DataLaneEndpoint]:
        """What the DataLane call offers: the advertised addresses, else the bound ones."""
        if self.closing:
            return []
        tls = self.tls is not None
        if self.advertise:
            return [kvstore_pb2.DataLaneEndpoint(address=a, tls=tls and not a.startswith("unix:"))
                    for a in self.advertise]
        return [kvstore_pb2.DataLaneEndpoint(address=a.grpc_target, tls=tls and a.kind == "tcp") for a in self.bound]

    def _accept(self, listener: socket.socket, on_unix: bool) -> None:
        """A listener is readable: take what is waiting, a bounded number. (A callback,
        not a task awaiting `sock_accept`: a task cancelled once a connection was
        accepted for it drops that socket unclosed.)"""
        for _ in range(ACCEPTS_PER_WAKEUP):
            if self.closing:
                return
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:  # out of descriptors: pause rather than spin
                logger.warning("data lane accept failed: %s; accepting again in %gs", exc, ACCEPT_PAUSE_S)
                loop = self._loop
                assert loop is not None
                fd = listener.fileno()
                loop.remove_reader(fd)
                self._paused[fd] = loop.call_later(ACCEPT_PAUSE_S, self._resume, listener, on_unix)
                return
            self._take(sock, on_unix)

    def _resume(self, listener: socket.socket, on_unix: bool) -> None:
        self._paused.pop(listener.fileno(), None)
        if not self.closing and self._loop is not None:
            self._loop.add_reader(listener.fileno(), self._accept, listener, on_unix)

    def _take(self, sock: socket.socket, on_unix: bool) -> None:
        """Serve an accepted connection on a thread of its own, as a pending one: it
        takes a slot only once its hello checked out (`_admit`). At the pending budget
        the oldest pending connection of its source (else of all) is dropped for it."""
        source = _source(sock, on_unix)
        with self._lock:
            victim = None
            if self._pending_by_source.get(source, 0) >= PENDING_PER_SOURCE:
                victim = next(s for s, src in self._pending.items() if src == source)
            elif len(self._pending) >= self.max_pending:
                victim = next(iter(self._pending))
            if victim is not None:
                self._unpend(victim)
            self._pending[sock] = source
            self._pending_by_source[source] = self._pending_by_source.get(source, 0) + 1
            self._raw.add(sock)
        if victim is not None:
            self.counters.add("connections_dropped")
            _shut(victim)  # its thread's next read fails, and it ends
        thread = threading.Thread(target=self._serve, args=(sock, on_unix, source), name="kvstore-datalane",
                                  daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _unpend(self, sock: socket.socket) -> bool:
        """Forget a pending connection (under the lock); whether it was pending."""
        source = self._pending.pop(sock, None)
        if source is None:
            return False
        left = self._pending_by_source[source] - 1
        if left:
            self._pending_by_source[source] = left
        else:
            del self._pending_by_source[source]
        return True

    def _admit(self, sock: socket.socket) -> bool:
        """A pending connection said a valid hello: it takes a slot if one is free, and
        False if not (or if it was dropped meanwhile)."""
        with self._lock:
            if not self._unpend(sock) or self._admitted >= self.max_connections:
                return False
            self._admitted += 1
            return True

    # -------------------------------------------------------------- connections

    def _serve(self, sock: socket.socket, on_unix: bool, source: str) -> None:
        lane: LaneSocket | None = None
        admitted = False
        self.counters.add("connections")
        self.counters.add("connections_total")
        deadline = time.monotonic() + HELLO_TIMEOUT_S  # the handshake and the hello, together
        try:
            sock.setblocking(True)
            conn: socket.socket = sock
            if self.tls is not None and not on_unix:
                sock.settimeout(HELLO_TIMEOUT_S)
                conn = self.tls.wrap_socket(sock, server_side=True)
            lane = LaneSocket(conn, max(0.001, deadline - time.monotonic()))
            with self._lock:
                if self.closing:
                    return
                self._sockets.add(lane)
            identity = self._hello(lane, on_unix, source, deadline)
            if identity is None:
                return
            admitted = self._admit(sock)
            if not admitted:
                self.counters.add("connections_refused")
                self._try_error(lane, bytes(16), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the data lane has {self.max_connections} connections, the most it allows; use "
                                "Put and Fetch, or retry")
                return
            lane.send_frame(WELCOME, transfer=boot_id_field(self.settings.boot_id), block=VERSION,
                            value=self.settings.max_block_bytes)
            lane.set_timeout(self.settings.io_timeout_s)
            _Connection(self, lane, identity).run()
        except (LaneClosed, LaneTimeout, ssl.SSLError, OSError) as exc:
            logger.debug("data lane connection ended: %s", exc)
        except ProtocolError as exc:
            logger.info("data lane connection closed: %s", exc)
            if lane is not None:
                self._try_error(lane, bytes(16), exc.code, str(exc))
        except Exception:  # task boundary: one connection's bug must not stop the lane
            logger.exception("data lane connection failed")
        finally:
            self.counters.add("connections", -1)
            with self._lock:
                if lane is not None:
                    self._sockets.discard(lane)
                self._raw.discard(sock)
                self._unpend(sock)
                if admitted:
                    self._admitted -= 1
                self._threads.discard(threading.current_thread())
            if lane is not None:
                lane.close()
            sock.close()

    def _hello(self, lane: LaneSocket, on_unix: bool, source: str, deadline: float) -> Identity | None:
        """The identity a connection's hello proves, or None (refused: told why)."""
        frame = lane.read_frame(deadline)
        if frame.kind != HELLO:
            raise ProtocolError("the first frame on the data lane must be a hello")
        token = parse_hello(lane.read_payload(frame.length, MAX_HELLO_BYTES, deadline))
        try:
            return self._identify(token, on_unix, source)
        except KVStoreError as exc:
            self._try_error(lane, bytes(16), exc.code, str(exc))
            return None

    def _identify(self, token: str, on_unix: bool, source: str) -> Identity:
        """The caller's identity, from the daemon's current token table (on the loop)."""
        loop = self._loop
        assert loop is not None

        async def identify() -> Identity:
            return self.auth.identify_lane(AUTH_PATH, token or None, on_unix, source)

        return asyncio.run_coroutine_threadsafe(identify(), loop).result(HELLO_TIMEOUT_S)

    @staticmethod
    def _try_error(lane: LaneSocket, transfer: bytes, code: grpc.StatusCode, message: str) -> None:
        try:
            lane.send_error(transfer, code, message)
        except KVStoreError:
            pass

    async def close(self) -> None:
        """Stop listening, end every connection (their threads fail at once and exit),
        then release every transfer still open."""
        self.closing = True
        for handle in self._paused.values():
            handle.cancel()
        self._paused.clear()
        for sock in self._listeners:
            if self._loop is not None:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self._listeners.clear()
        for path in self._unix_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._unix_paths.clear()
        with self._lock:
            lanes = list(self._sockets)
            raw = list(self._raw)
            threads = list(self._threads)
        for lane in lanes:
            lane.shutdown()
        for sock in raw:  # connections still in their TLS handshake or hello
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.transfers.interrupt()  # threads waiting on a transfer, not on a socket
        # A thread may be handing a result to the loop: join them off the loop.
        await asyncio.to_thread(_join_all, threads, self.settings.io_timeout_s)
        await self.transfers.close()


def _join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


class _Connection:
    """One authenticated connection: frames in order, one transfer at a time."""

    def __init__(self, server: DataLaneServer, lane: LaneSocket, identity: Identity) -> None:
        self.server = server
        self.lane = lane
        self.tenant = identity.tenant
        # Which transfers this connection may carry (`Joiner`): a client's, its tenant's;
        # a node's credential, those that calls from that node opened.
        if server.auth.table is None:
            self.joiner = Joiner(identity.tenant, client=True, node=ANY_NODE)
        elif identity.role in ACTS_FOR_TENANTS:
            self.joiner = Joiner(identity.tenant, client=False, node=identity.node or ANY_NODE)
        else:
            self.joiner = Joiner(identity.tenant, client=True)
        self.transfers = server.transfers
        self.settings = server.settings
        # This connection's credit for each put transfer it joined.
        self.credits: dict[bytes, _PutCredit] = {}
        self.told: set[bytes] = set()  # put transfers whose failure this connection reported

    def run(self) -> None:
        lane = self.lane
        while not self.server.closing:
            if not _readable(lane, IDLE_TIMEOUT_S):
                logger.debug("data lane connection idle for %.0f s; closed", IDLE_TIMEOUT_S)
                return
            frame = lane.read_frame()
            if frame.kind == DATA:
                self._receive(frame)
            elif frame.kind == FETCH:
                self._send_fetch(frame)
            elif frame.kind == PUSH:
                self._join_put(frame)
            elif frame.kind == CREDIT:
                pass  # credit a fetch no longer needed (it ended first)
            elif frame.kind == ERROR:
                lane.read_payload(frame.length, MAX_ERROR_BYTES)  # the client gave up a transfer
            else:
                raise ProtocolError(f"unexpected data lane frame kind {frame.kind}")

    # -------------------------------------------------------------- fetch

    def _send_fetch(self, frame: Frame) -> None:
        lane = self.lane
        transfer = self.transfers.fetch_transfer(frame.transfer, self.joiner)
        if transfer is None or not transfer.join(lane):
            failed = transfer.failed if transfer is not None else None
            if failed is not None:
                lane.send_error(frame.transfer, failed.code, failed.message)
            else:
                lane.send_error(frame.transfer, grpc.StatusCode.NOT_FOUND, "this data lane fetch is not open "
                                "(finished, expired, or joined by enough connections)")
            return
        # Waits of this transfer end by its deadline (the loop also shuts the socket then).
        lane.set_timeout(max(0.001, min(self.settings.io_timeout_s, transfer.deadline - time.monotonic())))
        try:
            self._send_blocks(transfer, frame.value, transfer_codec(frame.flags, transfer.codecs))
        finally:
            transfer.leave(lane)
            lane.set_timeout(self.settings.io_timeout_s)

    def _send_blocks(self, transfer: FetchTransfer, credit: int, codec: Codec = Codec.RAW) -> None:
        lane = self.lane
        need = transfer.block_bytes
        while True:
            # Credit for a whole block first: a block is taken only when it can go at once.
            while credit < need:
                end = transfer.finished()
                if end is not None:  # no block left to send: END needs no credit
                    lane.send_frame(END, transfer.id, block=end)
                    return
                failed = transfer.failed
                if failed is not None:
                    lane.send_error(transfer.id, failed.code, failed.message)
                    return
                if time.monotonic() > transfer.deadline:
                    lane.send_error(transfer.id, grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "the data lane fetch passed its deadline waiting for credit")
                    return
                if not _readable(lane, CREDIT_POLL_S):
                    continue
                got = lane.read_frame(transfer.deadline)
                if got.kind == CREDIT and got.transfer == transfer.id:
                    credit += got.value
                elif got.kind == ERROR:
                    lane.read_payload(got.length, MAX_ERROR_BYTES)
                    return  # the client gave the fetch up
                else:
                    raise ProtocolError(f"frame kind {got.kind} during a fetch; only CREDIT or ERROR")
            try:
                # As many ready blocks as the credit covers, up to a batch: small blocks
                # go many to one system call.
                item = transfer.take(transfer.deadline, send_batch(credit, need))
            except KVStoreError as exc:
                lane.send_error(transfer.id, exc.code, str(exc))
                return
            if isinstance(item, int):
                lane.send_frame(END, transfer.id, block=item)
                return
            try:
                wire = lane.send_blocks(transfer.id, [(b.position, b.data, b.checksum) for b in item], codec,
                                        transfer.itemsize)
            except BaseException as exc:
                transfer.abandon(str(exc), len(item))
                raise
            if codec is not Codec.RAW:
                self.server.counters.encoded("out", need * len(item), wire)
            transfer.sent(len(item))
            credit -= need * len(item)

    # -------------------------------------------------------------- put

    def _join_put(self, frame: Frame) -> None:
        lane = self.lane
        transfer = self.transfers.put_transfer(frame.transfer, self.joiner)
        if transfer is None or not transfer.join(lane):
            self._tell_failed(frame.transfer, transfer)
            return
        if len(self.credits) >= MAX_PUTS_PER_CONNECTION:
            self.credits.pop(next(iter(self.credits)))
        # A sender that stops mid-block is one that stopped sending (put_idle_timeout_s).
        lane.set_timeout(transfer.recv_timeout_s)
        credit = _PutCredit(transfer, max(1, self.settings.window_bytes // transfer.block_bytes))
        self.credits[transfer.id] = credit
        self.told.discard(transfer.id)
        self._grant(transfer, credit, wait=True)

    def _grant(self, transfer: PutTransfer, credit: _PutCredit, wait: bool) -> None:
        """Credit this connection up to its window, out of the put's reserved slots that
        no connection has credit for. With `wait` (the sender has none left), waits for
        the window to move on; CREDIT 0 then means this connection gets no more (the
        blocks left are covered by credit on the others)."""
        try:
            blocks = transfer.take_credit(credit.window_blocks - credit.blocks, wait)
        except KVStoreError:
            self._tell_failed(transfer.id, transfer)
            return
        if blocks or wait:
            credit.blocks += blocks
            self.lane.send_frame(CREDIT, transfer.id, value=blocks * transfer.block_bytes)

    def _receive(self, frame: Frame) -> None:
        lane = self.lane
        credit = self.credits.get(frame.transfer)
        if credit is None:
            raise ProtocolError("DATA for a put this connection did not join (send PUSH first)")
        left = credit.blocks * credit.block_bytes
        transfer = credit.transfer
        raw_len = frame.length
        if frame.flags:  # an encoded block: its raw size is the put's block size
            raw_len = credit.block_bytes
            if frame.length > raw_len or transfer_codec(frame.flags, transfer.codecs) is Codec.RAW:
                transfer.fail(grpc.StatusCode.INVALID_ARGUMENT, "a data lane sender used a codec the put did not offer")
                raise ProtocolError(f"a DATA frame in codec {frame.flags} of {frame.length} bytes; this put takes "
                                    f"codecs {transfer.codecs:#x} of at most {raw_len} bytes")
        if raw_len > left:
            transfer.fail(grpc.StatusCode.INVALID_ARGUMENT, "a data lane sender exceeded its credit")
            raise ProtocolError(f"a {frame.length}-byte block with {left} bytes of credit left; a sender never "
                                "sends more than it was granted")
        dest = transfer.claim(frame.block, raw_len, lane)
        if dest is None:
            lane.discard(frame.length + TRAILER.size, None)
            self._tell_failed(frame.transfer, transfer)
            return
        credit.blocks -= 1
        try:
            if frame.flags:
                got, want = lane.recv_encoded(dest, frame.length, frame.flags, frame.value, transfer.deadline)
                self.server.counters.encoded("in", raw_len, frame.length)
            else:
                got, want = lane.recv_block(dest, transfer.deadline)
        except BaseException as exc:
            transfer.broke(frame.block, exc, lane)
            raise
        transfer.landed(frame.block, got, want, lane)
        if transfer.failed is not None:
            self._tell_failed(frame.transfer, transfer)
            return
        if credit.blocks <= credit.window_blocks // 2:  # topped up once half of it is used
            self._grant(transfer, credit, wait=credit.blocks == 0)

    def _tell_failed(self, transfer_id: bytes, transfer: PutTransfer | None) -> None:
        """Report a failed or unknown put once on this connection; its sender stops there
        (frames it sent before it read this are within its credit, and are dropped)."""
        if transfer_id in self.told:
            return
        self.told.add(transfer_id)
        failed = transfer.failed if transfer is not None else self.transfers.put_failure(transfer_id, self.joiner)
        if failed is None:
            self.lane.send_error(transfer_id, grpc.StatusCode.NOT_FOUND,
                                 "this data lane put is not open (committed, aborted, or expired)")
        else:
            self.lane.send_error(transfer_id, failed.code, failed.message)


class _PutCredit:
    """One connection's credit for one put it joined, in blocks: granted and not yet
    arrived. It keeps the transfer, so a sender that comes back after the put failed
    and was let go hears why."""

    __slots__ = ("transfer", "window_blocks", "block_bytes", "blocks")

    def __init__(self, transfer: PutTransfer, window_blocks: int) -> None:
        self.transfer = transfer
        self.window_blocks = window_blocks
        self.block_bytes = transfer.block_bytes
        self.blocks = 0


def _source(sock: socket.socket, on_unix: bool) -> str:
    """The address a connection came from, as pending budgets and node-to-node checks
    name it: the IP address of a TCP peer, "unix" on a Unix socket."""
    if on_unix:
        return "unix"
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return ""


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def transfer_codec(flags: int, offered: int) -> Codec:
    """The codec a frame's `flags` name, if the transfer offered it (`offered`, a bitmask
    of `kvstore.codecs.codec_mask`); raw otherwise."""
    return Codec(flags) if flags and offered >> flags & 1 and flags in _CODEC_IDS else Codec.RAW


_CODEC_IDS = frozenset(int(c) for c in Codec)


def _readable(lane: LaneSocket, timeout_s: float) -> bool:
    """Whether a frame can be read from `lane` within `timeout_s` (or it was closed:
    the read that follows says so)."""
    sock = lane.sock
    if lane.buffered() or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
        return True
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
    except (OSError, ValueError):  # closed under us
        raise LaneClosed("the data lane connection was closed") from None
    return bool(poller.poll(timeout_s * 1000.0))


class DataLaneCollector(Collector):
    """`kvstore_datalane_*`: the lane's counters, read at scrape time."""

    DOCS = {
        "bytes_in": ("kvstore_datalane_received_bytes", "block bytes received on the data lane and verified"),
        "bytes_out": ("kvstore_datalane_sent_bytes", "block bytes sent on the data lane"),
        "blocks_in": ("kvstore_datalane_received_blocks", "blocks received on the data lane and verified"),
        "blocks_out": ("kvstore_datalane_sent_blocks", "blocks sent on the data lane"),
        "blocks_rejected": ("kvstore_datalane_rejected_blocks",
                            "blocks that failed their checksum on arrival (dropped; their put failed)"),
        "transfers_failed": ("kvstore_datalane_failed_transfers",
                             "transfers that failed, were aborted or expired (nothing of a failed put is stored)"),
        "connections_total": ("kvstore_datalane_connections", "data lane connections accepted"),
        "connections_refused": ("kvstore_datalane_refused_connections",
                                "data lane connections refused at their hello (every slot held by "
                                "authenticated connections)"),
        "connections_dropped": ("kvstore_datalane_dropped_connections",
                                "data lane connections dropped before their hello to make room for newer ones"),
    }

    def __init__(self, counters: DataLaneCounters) -> None:
        self._counters = counters

    def collect(self) -> Iterator[Any]:
        get = self._counters.get
        for field, (name, doc) in self.DOCS.items():
            yield CounterMetricFamily(name, doc, value=get(field))
        transfers = CounterMetricFamily("kvstore_datalane_transfers", "data lane transfers opened, by kind",
                                        labels=["kind"])
        transfers.add_metric(["fetch"], get("transfers_fetch"))
        transfers.add_metric(["put"], get("transfers_put"))
        yield transfers
        yield GaugeMetricFamily("kvstore_datalane_open_connections", "data lane connections open now",
                                value=get("connections"))
        for kind, doc in (("raw", "raw bytes of the blocks that moved encoded by a lossless codec (docs/codecs.md)"),
                          ("wire", "bytes those encoded blocks took on the data lane")):
            family = CounterMetricFamily(f"kvstore_datalane_encoded_{kind}_bytes", doc, labels=["direction"])
            family.add_metric(["out"], get(f"encoded_{kind}_bytes_out"))
            family.add_metric(["in"], get(f"encoded_{kind}_bytes_in"))
            yield family
        yield GaugeMetricFamily("kvstore_datalane_put_reserved_bytes",
                                "host-tier slots reserved for lane puts ahead of their bytes (at most "
                                "max_put_reserve_bytes per put)", value=get("put_reserved_bytes"))
        yield GaugeMetricFamily("kvstore_datalane_put_reserved_peak_bytes",
                                "the most kvstore_datalane_put_reserved_bytes has been since the daemon started",
                                value=get("put_reserved_peak_bytes"))
