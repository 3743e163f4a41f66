"""The client side of the data lane (framing in `kvstore.data_lane`; see docs/net.md): a
pool of connections to one daemon's lane, and the protocol of one transfer on it, written
once for the SDK and the cluster.

Glossary of planes and lanes: docs/local-data-plane.md

Primitives: `LaneEndpoint` and `choose_endpoint(offer, target)` (which of the daemon's
lane addresses to use), `client_tls(security)`; `DataLane`: `checkout(n, timeout_s)`,
`checkin(conns)`, `fetch_into(conns, transfer_id, block_bytes, dests, timeout_s)` -> how
many leading blocks landed verified, `put_from(conns, transfer_id, block_bytes, needed,
sources, timeout_s)`, `stats()`, all blocking and thread-safe; `checkout_in_thread` for
asyncio code; one transfer: `fetch_transfer`, `put_transfer` (and for a layout with KV
groups `grouped_fetch_transfer`, `grouped_put_transfer`: a transfer per group, each of
one part size, run one after another by `fetch_groups` / `put_groups`), their steps
`LaneCall` and `LaneMove`, `run_transfer`, `move_in_threads`.

Bytes: one `sendmsg` per block from the caller's buffer, `recv_into` straight into the
caller's destination, each block verified as it lands. Where the daemon offers lossless
codecs (`LaneCodecs`, from its LaneFetch / LanePut answer), the lane's `CodecChooser`
picks one per transfer (`codec="auto"`, docs/codecs.md) from what it measured of this
link and of the codecs on this namespace's blocks; an encoded block is decoded straight
into its destination and verified there. Each connection of a transfer
runs in its own thread; one that broke or timed out is closed, the others go back to the
pool. A block whose bytes do not match their checksum is dropped and counted
(`stats().blocks_rejected`), never returned: the fetch's result ends before it.

A transfer: connections are checked out first, so a lane that cannot be reached is found
before the daemon holds anything; `LaneFetch` / `LanePut` on the daemon's KVStore service
opens it; its bytes move; a put that failed is aborted, one whose bytes moved is
published by `LaneCommit`, all or nothing. Written as a plan without I/O, like the SDK's
verbs (`kvstore.client._ops`), which run its steps as their own; `run_transfer` runs it
for asyncio code that makes the control calls itself (`DataLanePeer`, the cluster's
`DataLaneTransport`). A cancelled move shuts its connections and returns once its
threads are done with the caller's buffers (slots of a tier's shared memory, say); a
failed one clears the frames that hold them, so no reference cycle keeps a segment from
being unmapped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import select
import socket
import ssl
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from kvstore.client.security import Security
from kvstore.codec_chooser import CodecChooser
from kvstore.codecs import Codec, codec_named, codecs_in
from kvstore.data_lane import (
    CREDIT,
    DATA,
    END,
    ERROR,
    FETCH,
    HEADER_BYTES,
    HELLO,
    MAX_ERROR_BYTES,
    PUSH,
    TRAILER,
    VERSION,
    WELCOME,
    Frame,
    Grant,
    LaneClosed,
    LaneSocket,
    LaneTimeout,
    ProtocolError,
    boot_id_of,
    checksum_of,
    hello_payload,
    send_batch,
    status_of,
    unpack,
)
from kvstore.errors import (
    RESTARTED_PREFIX,
    DaemonRestarted,
    DataLoss,
    DeadlineExceeded,
    KVStoreError,
    ResourceExhausted,
    Unavailable,
    error_for_status,
)
from kvstore.v1 import kvstore_pb2

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_CONNECTIONS = 4
# Credit this client grants a daemon per fetch connection: the most block bytes in
# flight to it (blocks land straight in their destinations, so this bounds only what
# sits in the sockets' buffers).
DEFAULT_WINDOW_BYTES = 32 << 20
CONNECT_TIMEOUT_S = 3.0
# After the lane could not be reached, the SDK uses gRPC for this long before trying again.
RETRY_AFTER_S = 10.0
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# DATA frames a fetch's connection lands in one pass where they are already received
# whole (`LaneSocket.buffered_blocks`).
RECEIVE_BATCH_BLOCKS = 256


@dataclass(frozen=True, slots=True)
class LaneEndpoint:
    kind: str  # "tcp" or "unix"
    host: str = ""
    port: int = 0
    path: str = ""
    tls: bool = False

    @property
    def address(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _split_host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep:
        return None
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


def choose_endpoint(offer: kvstore_pb2.DataLaneResponse, target: str) -> LaneEndpoint | None:
    """The lane address to use for a client of gRPC `target`: for a TCP target, the TCP
    endpoint on the host the client reached (a wildcard host means that one), else the
    first TCP endpoint; for a Unix socket target, a Unix endpoint. None if none fits."""
    unix_target = target.startswith("unix:")
    target_host = "" if unix_target else (_split_host_port(target) or ("", 0))[0]
    tcp: list[LaneEndpoint] = []
    for ep in offer.endpoints:
        if ep.address.startswith("unix:"):
            if unix_target:
                return LaneEndpoint("unix", path=ep.address[len("unix:"):])
            continue
        parsed = _split_host_port(ep.address)
        if parsed is None:
            continue
        host, port = parsed
        if host in WILDCARD_HOSTS:
            if unix_target:
                continue
            host = target_host
        tcp.append(LaneEndpoint("tcp", host=host, port=port, tls=ep.tls))
    if unix_target or not tcp:
        return None
    return next((ep for ep in tcp if ep.host == target_host), tcp[0])


def client_tls(security: Security) -> ssl.SSLContext | None:
    """The TLS context for TCP lanes: the SDK's roots, and its client certificate (mTLS)."""
    if security.tls_ca is None:
        return None
    ctx = ssl.create_default_context(cadata=security.tls_ca.decode("ascii", "replace"))
    if security.tls_cert is not None and security.tls_key is not None:
        # ssl loads a certificate chain only from files: a private directory, removed at once.
        with tempfile.TemporaryDirectory(prefix="kvstore-lane-") as tmp:
            cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            for path, data in ((cert, security.tls_cert), (key, security.tls_key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
            ctx.load_cert_chain(cert, key)
    return ctx


@dataclass(frozen=True, slots=True)
class LaneCodecs:
    """What a transfer's LaneFetch / LanePut answer offers: the codecs the daemon sends or
    takes (`kvstore.codecs.codec_mask`; 0: raw only, as from a daemon that predates
    codecs), the element size of the blocks, and their namespace (the chooser's key)."""

    mask: int
    itemsize: int
    namespace: bytes


def lane_codecs(grant: kvstore_pb2.LaneFetchResponse | kvstore_pb2.LanePutResponse) -> LaneCodecs:
    return LaneCodecs(grant.codecs, grant.itemsize or 1, grant.namespace_id)


CODEC_MODES = ("auto", "raw", *(c.label for c in Codec if c is not Codec.RAW))


def check_codec_mode(mode: str) -> str:
    """`auto` (chosen per transfer), `raw`, or a codec's name; InvalidArgument otherwise."""
    if mode not in CODEC_MODES:
        from kvstore.errors import InvalidArgument

        raise InvalidArgument(f"lane_codec must be one of {', '.join(CODEC_MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True, slots=True)
class DataLaneStats:
    """What a client's data lane moved (this process, this client)."""

    bytes_sent: int
    bytes_received: int
    blocks_rejected: int
    transfers: int
    connections_opened: int


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes_sent = self.bytes_received = self.blocks_rejected = self.transfers = self.connections = 0


class _FetchState:
    """What the connections of one fetch found, block by block."""

    def __init__(self, n: int, checksums: list[int] | None = None) -> None:
        self.lock = threading.Lock()
        self.status = bytearray(n)  # 0 waiting, 1 landed verified, 2 rejected, 3 arriving
        self.wire = 0  # payload bytes received (encoded blocks count their encoded size)
        self.end: int | None = None
        self.checksums = checksums  # each block's sender checksum, once it landed

    def claim(self, blocks: Iterable[int]) -> None:
        """Mark blocks as arriving, before any byte of them is written; a block sent
        twice (on any connection) is refused."""
        with self.lock:
            for i in blocks:
                if self.status[i]:
                    raise ProtocolError(f"the data lane sent block {i} twice")
                self.status[i] = 3

    def landed(self, blocks: Iterable[tuple[int, bool, int]], wire: int = 0) -> int:
        """Mark claimed blocks (block, whether its bytes matched, the sender's checksum)
        as landed or rejected, after `wire` payload bytes; how many were rejected."""
        bad = 0
        with self.lock:
            self.wire += wire
            for i, ok, want in blocks:
                self.status[i] = 1 if ok else 2
                if self.checksums is not None:
                    self.checksums[i] = want
                bad += not ok
        return bad


class _Push:
    """The blocks of one put still to send, in order, taken by whichever connection holds
    credit for one (never before: see `DataLane._push_on`)."""

    def __init__(self, positions: list[int]) -> None:
        self.todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for p in positions:
            self.todo.put(p)
        self.failed = False
        self.lock = threading.Lock()
        self.wire = 0  # payload bytes sent (encoded blocks count their encoded size)

    def next(self) -> int | None:
        if self.failed:
            return None
        try:
            return self.todo.get_nowait()
        except queue.Empty:
            return None

    def empty(self) -> bool:
        return self.failed or self.todo.empty()


class DataLane:
    """Connections to one daemon's data lane. Thread-safe; `close` ends them all."""

    def __init__(self, endpoint: LaneEndpoint, security: Security, *, max_connections: int = DEFAULT_CONNECTIONS,
                 window_bytes: int = DEFAULT_WINDOW_BYTES, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 io_timeout_s: float = 30.0, tls: ssl.SSLContext | None = None, codec: str = "auto",
                 chooser: CodecChooser | None = None, link: str = "", boot_id: int = 0) -> None:
        self.endpoint = endpoint
        self.link = link or endpoint.address  # the chooser's name for this link
        # Which lossless codec transfers use: chosen per transfer ("auto"), or fixed.
        self.codec_mode = check_codec_mode(codec)
        self.chooser = chooser if chooser is not None else CodecChooser()
        # The start of the daemon that offered this lane (its DataLane answer; 0: not
        # told). Sent with the transfers' calls; a connection whose WELCOME tells another
        # one is to a daemon that restarted since: `DaemonRestarted`, and the SDK asks
        # for the lane anew.
        self.boot_id = boot_id
        self.max_connections = max(1, max_connections)
        self.window_bytes = window_bytes
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self._token = security.token
        self._tls = tls if tls is not None else (client_tls(security) if endpoint.tls else None)
        if endpoint.tls and self._tls is None:
            raise Unavailable(f"the data lane at {endpoint.address} uses TLS; pass tls_ca (or KVSTORE_TLS_CA)")
        self._idle: list[LaneSocket] = []
        self._lock = threading.Lock()
        # The second and further connections of each transfer; several transfers at once
        # (an asyncio client's concurrent calls) each get theirs.
        self._pool = ThreadPoolExecutor(max_workers=4 * self.max_connections, thread_name_prefix="kvstore-lane")
        self._counters = _Counters()
        self.down_until = 0.0
        self.closed = False

    # -------------------------------------------------------------- connections

    def usable(self) -> bool:
        """False for a while after the lane could not be reached (`mark_down`)."""
        return time.monotonic() >= self.down_until

    def mark_down(self, reason: object) -> None:
        logger.info("data lane at %s unavailable (%s); block bytes go through gRPC for %.0f s",
                    self.endpoint.address, reason, RETRY_AFTER_S)
        self.down_until = time.monotonic() + RETRY_AFTER_S

    def connections_for(self, blocks: int) -> int:
        return max(1, min(self.max_connections, blocks))

    def _connect(self, timeout_s: float) -> LaneSocket:
        ep = self.endpoint
        timeout = max(0.05, min(self.connect_timeout_s, timeout_s))
        try:
            if ep.kind == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(ep.path)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((ep.host, ep.port), timeout=timeout)
            if self._tls is not None:
                try:
                    # Python's ssl matches an IP address against the certificate's IP SANs.
                    sock = self._tls.wrap_socket(sock, server_hostname=ep.host)
                except BaseException:
                    sock.close()
                    raise
        except (OSError, ssl.SSLError) as exc:
            raise Unavailable(f"cannot connect to the data lane at {ep.address}: {exc}") from None
        lane = LaneSocket(sock, timeout)
        try:
            lane.send_frame(HELLO, block=VERSION, payload=hello_payload(self._token))
            frame = lane.read_frame(time.monotonic() + timeout)
            if frame.kind == ERROR:
                raise _error_of(lane, frame.block, frame.length)
            if frame.kind != WELCOME:
                raise ProtocolError(f"the data lane answered the hello with frame kind {frame.kind}")
            told = boot_id_of(frame)
            if self.boot_id and told and told != self.boot_id:
                raise DaemonRestarted(f"{RESTARTED_PREFIX} since its data lane was offered (generation "
                                      f"{self.boot_id:016x}, now {told:016x}): ask for the lane again")
            lane.set_timeout(self.io_timeout_s)
        except (ResourceExhausted, DeadlineExceeded) as exc:
            # A lane that is full, or too busy to answer a hello: not this call's failure;
            # the caller moves its bytes through gRPC (docs/net.md).
            lane.close()
            raise Unavailable(f"the data lane at {ep.address} cannot take a connection now: {exc}") from None
        except BaseException:
            lane.close()
            raise
        with self._counters.lock:
            self._counters.connections += 1
        return lane

    def checkout(self, count: int, timeout_s: float) -> list[LaneSocket]:
        """Up to `count` ready connections (idle ones first, then new ones); at least one,
        or `Unavailable` (an auth refusal raises as itself)."""
        got: list[LaneSocket] = []
        with self._lock:
            while self._idle and len(got) < count:
                got.append(self._idle.pop())
        for conn in [c for c in got if not _alive(c)]:
            got.remove(conn)
            conn.close()
        deadline = time.monotonic() + timeout_s
        error: KVStoreError | None = None
        while len(got) < count:
            try:
                got.append(self._connect(deadline - time.monotonic()))
            except DaemonRestarted:
                for conn in got:
                    conn.close()  # the old start's connections are dead anyway
                raise
            except KVStoreError as exc:
                error = exc
                break
        if not got:
            assert error is not None
            raise error
        with self._lock:
            closed = self.closed
        if closed:  # closed while this thread connected: nobody would check these in
            for conn in got:
                conn.close()
            raise Unavailable(f"the data lane at {self.endpoint.address} was closed")
        return got

    def checkin(self, conns: Sequence[LaneSocket]) -> None:
        """Give back connections that finished their transfer cleanly."""
        with self._lock:
            if self.closed:
                for c in conns:
                    c.close()
                return
            self._idle.extend(conns)
            extra = self._idle[: max(0, len(self._idle) - self.max_connections)]
            del self._idle[: len(extra)]
        for c in extra:
            c.close()

    def abort(self, conns: Sequence[LaneSocket]) -> None:
        """End a transfer running on `conns` at once, from any thread: their sockets are
        shut, so the threads moving its bytes fail now (and close them)."""
        for conn in conns:
            conn.shutdown()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
        self._pool.shutdown(wait=False)

    def stats(self) -> DataLaneStats:
        c = self._counters
        with c.lock:
            return DataLaneStats(c.bytes_sent, c.bytes_received, c.blocks_rejected, c.transfers, c.connections)

    # -------------------------------------------------------------- transfers

    def _run_all(self, conns: Sequence[LaneSocket], work: Callable[..., None],
                 *args: object) -> list[BaseException | None]:
        """`work(conn, *args)` on every connection at once (the first on this thread).
        Each connection goes back to the pool if its part ended cleanly, else closed."""
        futures: list[Future[None]] = [self._pool.submit(_HandedOver(_part, work, c, *args)) for c in conns[1:]]
        errors: list[BaseException | None] = []
        try:
            _part(work, conns[0], *args)
            errors.append(None)
        except BaseException as exc:
            errors.append(exc)
        for f in futures:
            try:
                f.result()
                errors.append(None)
            except BaseException as exc:
                errors.append(exc)
        clean = [c for c, e in zip(conns, errors) if e is None]
        for c, e in zip(conns, errors):
            if e is not None:
                c.close()
        self.checkin(clean)
        with self._counters.lock:
            self._counters.transfers += 1
        return errors

    def _codec(self, offer: LaneCodecs | None, direction: str) -> Codec:
        """The codec of the next transfer with this offer (raw without one), `direction`
        "fetch" or "put": each way of a link is learned on its own (links may differ)."""
        if offer is None or not offer.mask or self.codec_mode == "raw":
            return Codec.RAW
        offered = codecs_in(offer.mask)
        if self.codec_mode != "auto":
            fixed = codec_named(self.codec_mode)
            return fixed if fixed in offered else Codec.RAW
        return self.chooser.choose(f"{self.link} {direction}", offer.namespace, offered)

    def _learn(self, offer: LaneCodecs | None, direction: str, codec: Codec, raw_bytes: int, wire_bytes: int,
               seconds: float, block: memoryview | None) -> None:
        """What a transfer taught the chooser; now and then a block of it sampled with
        every codec (what each does to this namespace's blocks, on this machine)."""
        if offer is None or not offer.mask:
            return
        self.chooser.observed(f"{self.link} {direction}", offer.namespace, codec, raw_bytes, wire_bytes, seconds)
        if block is not None and self.codec_mode == "auto" and self.chooser.wants_sample(offer.namespace):
            self.chooser.sample(offer.namespace, offer.itemsize, block)

    def fetch_into(self, conns: Sequence[LaneSocket], transfer_id: bytes, block_bytes: int,
                   dests: Sequence[memoryview], timeout_s: float, checksums: list[int] | None = None,
                   codecs: LaneCodecs | None = None) -> int:
        """Receive fetch `transfer_id`'s blocks into `dests` (block i into dests[i], each
        `block_bytes`) on `conns`, which this call owns; how many leading blocks landed
        verified. A rejected block, or one that never came, ends the result before it.
        `checksums` (one entry per dest), when given, gets the checksum the sender sent
        with each block that landed, whether its bytes matched it or not (a daemon sends
        the checksum it stored with the block, which its bytes matched before they left).
        `codecs`: what the daemon offered (LaneFetch's answer); the codec asked for is
        chosen here."""
        state = _FetchState(len(dests), checksums)
        codec = self._codec(codecs, "fetch")
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        errors = self._run_all(conns, self._fetch_on, transfer_id, block_bytes, dests, state, deadline, codec)
        if state.end is None:
            raise next(e for e in errors if e is not None)
        good = 0
        while good < state.end and state.status[good] == 1:
            good += 1
        if good < state.end and state.status[good] == 0 and any(errors):
            raise next(e for e in errors if e is not None)  # a block went missing with its connection
        if good == state.end:
            self._learn(codecs, "fetch", codec, good * block_bytes, state.wire, time.perf_counter() - start,
                        dests[good // 2] if good else None)
        return good

    def fetch_groups(self, conns: list[LaneSocket], groups: Sequence[kvstore_pb2.LaneGroupTransfer],
                     dests: Sequence[memoryview], timeout_s: float) -> int:
        """A grouped fetch's transfers, one group's after another (`fetch_into` each, its
        parts into the next of `dests`, in wire order): how many leading parts landed
        verified. Stops at the first group that came short. `conns` is updated in place
        with the connections the current transfer runs on (so a cancel shuts those)."""
        deadline = time.monotonic() + timeout_s
        landed = 0
        for k, group in enumerate(groups):
            if k:
                conns[:] = self.checkout(len(conns), deadline - time.monotonic())
            got = self.fetch_into(conns, group.transfer_id, group.block_bytes,
                                  dests[landed : landed + group.num_blocks], deadline - time.monotonic())
            landed += got
            if got < group.num_blocks:
                break
        return landed

    def put_groups(self, conns: list[LaneSocket], groups: Sequence[kvstore_pb2.LaneGroupTransfer],
                   sources: Sequence[memoryview], timeout_s: float) -> None:
        """A grouped put's transfers, one group's after another (`put_from` each, its parts
        from the next of `sources`, in wire order). `conns` as for `fetch_groups`."""
        deadline = time.monotonic() + timeout_s
        start = 0
        for k, group in enumerate(groups):
            if k:
                conns[:] = self.checkout(len(conns), deadline - time.monotonic())
            if any(group.needed):
                self.put_from(conns, group.transfer_id, group.block_bytes, group.needed,
                              sources[start : start + group.num_blocks], deadline - time.monotonic())
            else:
                self.checkin(conns)
            start += group.num_blocks

    def _fetch_on(self, lane: LaneSocket, transfer_id: bytes, block_bytes: int, dests: Sequence[memoryview],
                  state: _FetchState, deadline: float, codec: Codec = Codec.RAW) -> None:
        n = len(dests)
        # Any connection may carry every block: never more credit than the whole fetch.
        grant = Grant(max(self.window_bytes, block_bytes), n * block_bytes)
        self._bound_waits(lane, deadline)
        lane.send_frame(FETCH, transfer_id, value=grant.first, flags=int(codec))
        frame_bytes = HEADER_BYTES + block_bytes + TRAILER.size
        while True:
            if lane.buffered() >= frame_bytes:
                # Small blocks arrive many to a receive: those already here whole are
                # taken in one pass (the frame checks below hold for them as well).
                batch = lane.buffered_blocks(transfer_id, block_bytes, n, RECEIVE_BATCH_BLOCKS)
                if batch:
                    more = self._land_batch(lane, batch, block_bytes, dests, state, grant)
                    if more:
                        lane.send_frame(CREDIT, transfer_id, value=more)
                    continue
            frame = lane.read_frame(deadline)
            if frame.transfer != transfer_id:
                _skip_stale(lane, frame)
                continue
            if frame.kind == DATA:
                i = frame.block
                if not 0 <= i < n or not (0 < frame.length <= block_bytes if frame.flags
                                          else frame.length == block_bytes):
                    raise ProtocolError(f"the data lane sent block {i} of {frame.length} bytes; the fetch has {n} "
                                        f"blocks of {block_bytes}")
                state.claim((i,))
                if frame.flags:  # encoded: decoded straight into the destination, hashed there
                    got, want = lane.recv_encoded(dests[i], frame.length, frame.flags, frame.value, deadline)
                else:
                    got, want = lane.recv_block(dests[i], deadline)
                ok = got == want
                self._count_landed(1, state.landed(((i, ok, want),), frame.length), block_bytes)
                if not ok:
                    logger.warning("fetched block %d failed its checksum on arrival over the data lane; not returned",
                                   i)
                more = grant.landed(block_bytes)
                if more:
                    lane.send_frame(CREDIT, transfer_id, value=more)
            elif frame.kind == END:
                with state.lock:
                    state.end = frame.block if state.end is None else min(state.end, frame.block)
                return
            elif frame.kind == ERROR:
                raise _error_of(lane, frame.block, frame.length)
            else:
                raise ProtocolError(f"unexpected data lane frame kind {frame.kind} during a fetch")

    def _land_batch(self, lane: LaneSocket, batch: list[tuple[int, memoryview, int]], block_bytes: int,
                    dests: Sequence[memoryview], state: _FetchState, grant: Grant) -> int:
        """`_fetch_on` for DATA frames already received whole: each block claimed (a
        block sent twice is refused before any byte of it is copied), copied into its
        dest, hashed there, marked; the credit to grant after them."""
        state.claim(i for i, _, _ in batch)
        landed: list[tuple[int, bool, int]] = []
        digest = xxhash.xxh3_64_intdigest
        for i, payload, want in batch:
            dest = dests[i]
            dest[:] = payload
            landed.append((i, digest(dest) == want, want))
        lane.consume(len(batch), block_bytes)
        bad = state.landed(landed, len(batch) * block_bytes)
        self._count_landed(len(batch), bad, block_bytes)
        if bad:
            logger.warning("%d fetched blocks failed their checksum on arrival over the data lane; not returned", bad)
        return grant.landed(len(batch) * block_bytes)

    def _count_landed(self, blocks: int, rejected: int, block_bytes: int) -> None:
        counters = self._counters
        with counters.lock:
            counters.bytes_received += blocks * block_bytes
            counters.blocks_rejected += rejected

    def put_from(self, conns: Sequence[LaneSocket], transfer_id: bytes, block_bytes: int, needed: bytes,
                 sources: Sequence[memoryview], timeout_s: float, codecs: LaneCodecs | None = None) -> None:
        """Send put `transfer_id`'s needed blocks (needed[i] set: sources[i]) on `conns`,
        which this call owns; raises what the daemon reported meanwhile (e.g. a block that
        failed its checksum). The daemon may still be receiving the last of them when this
        returns: LaneCommit waits until every one has landed verified. `codecs`: what
        the daemon takes (LanePut's answer); the codec is chosen here."""
        positions = [i for i, flag in enumerate(needed) if flag]
        push = _Push(positions)
        codec = self._codec(codecs, "put")
        if codec is not Codec.RAW and codecs is not None:
            codec_args: tuple[Codec, int] = (codec, codecs.itemsize)
        else:
            codec_args = (Codec.RAW, 1)
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        errors = self._run_all(conns, self._push_on, transfer_id, block_bytes, sources, push, deadline, *codec_args)
        failures = [e for e in errors if e is not None]
        if not failures:
            self._learn(codecs, "put", codec, len(positions) * block_bytes, push.wire, time.perf_counter() - start,
                        sources[positions[len(positions) // 2]] if positions else None)
        if failures:
            # What the daemon said (a block that failed its checksum) over what it did to
            # the other connections meanwhile.
            raise min(failures, key=lambda e: (not isinstance(e, DataLoss), isinstance(e, (LaneClosed, LaneTimeout))))

    def _push_on(self, lane: LaneSocket, transfer_id: bytes, block_bytes: int, sources: Sequence[memoryview],
                 push: _Push, deadline: float, codec: Codec = Codec.RAW, itemsize: int = 1) -> None:
        self._bound_waits(lane, deadline)
        lane.send_frame(PUSH, transfer_id)
        counters = self._counters
        try:
            credit = more = self._credit(lane, transfer_id, deadline, push)
            while True:
                # Credit first, then a block: the daemon's credit, over all of a put's
                # connections, covers the slots it has reserved so far, in order; so a
                # block taken in order once its credit is held is always among them.
                while credit < block_bytes:
                    if not more or push.empty():
                        # Nothing left to send, or the daemon said so (CREDIT 0: the
                        # blocks left are covered by credit on other connections).
                        return  # LaneCommit waits for what is still on the way
                    more = self._credit(lane, transfer_id, deadline, push)
                    credit += more
                # As many of the next blocks as the credit covers, up to a batch: small
                # blocks go many to one system call.
                batch: list[int] = []
                for _ in range(send_batch(credit, block_bytes)):
                    i = push.next()
                    if i is None:
                        break
                    batch.append(i)
                if not batch:
                    return
                wire = lane.send_blocks(transfer_id, [(i, sources[i], checksum_of(sources[i])) for i in batch],
                                        codec, itemsize)
                with push.lock:
                    push.wire += wire
                credit -= block_bytes * len(batch)
                with counters.lock:
                    counters.bytes_sent += block_bytes * len(batch)
        except BaseException:
            push.failed = True
            raise

    def _bound_waits(self, lane: LaneSocket, deadline: float) -> None:
        """No single wait of this transfer outlasts its deadline (nor the I/O timeout)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise LaneTimeout("the data lane transfer passed its deadline before it began")
        lane.set_timeout(min(self.io_timeout_s, left))

    @staticmethod
    def _credit(lane: LaneSocket, transfer_id: bytes, deadline: float, push: _Push) -> int:
        """The next credit the daemon grants this put (frames of earlier transfers skipped)."""
        while True:
            frame = lane.read_frame(deadline)
            if frame.transfer != transfer_id:
                _skip_stale(lane, frame)
            elif frame.kind == CREDIT:
                return frame.value
            elif frame.kind == ERROR:
                push.failed = True
                raise _error_of(lane, frame.block, frame.length)
            else:
                raise ProtocolError(f"unexpected data lane frame kind {frame.kind} during a put")


async def checkout_in_thread(lane: DataLane, count: int, timeout_s: float,
                             orphans: set[asyncio.Future[Any]] | None = None) -> list[LaneSocket]:
    """`lane.checkout(count, timeout_s)` on a worker thread, for asyncio code. Cancelled,
    the thread goes on and the connections it makes go back to the pool once it is done
    (closed, if the lane was closed meanwhile); `orphans`, when given, holds the thread's
    future until then, for a close to wait on."""
    task = asyncio.ensure_future(asyncio.to_thread(lane.checkout, count, timeout_s))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: lane.checkin(t.result()) if not t.cancelled() and t.exception() is None
                               else None)
        if orphans is not None:
            orphans.add(task)
            task.add_done_callback(orphans.discard)
        raise


# -------------------------------------------------------------- one transfer

# A failed put's abort waits this long at most: the daemon rolls the put back at its
# deadline by itself anyway.
ABORT_TIMEOUT_S = 1.0


class LaneCall:
    """A transfer's step: control call `name` (`LaneFetch`, `LanePut`, `LaneCommit`) on
    the daemon's KVStore service; the plan receives its response. `cleanup`: a failed
    put's abort, whose own failure the plan ignores; `run_transfer` shields it, so a
    second cancellation does not cut it off."""

    __slots__ = ("name", "request", "timeout_s", "cleanup")

    def __init__(self, name: str, request: Any, timeout_s: float, cleanup: bool = False) -> None:
        self.name = name
        self.request = request
        self.timeout_s = timeout_s
        self.cleanup = cleanup


class LaneMove:
    """A transfer's step: its bytes moved on `conns` by `fn(conns, *args)`
    (`DataLane.fetch_into` or `put_from`). `run()` does that once, blocking, on whichever
    thread calls it (`_HandedOver`); the plan receives what `fn` returns. `cancel()` ends
    it at once, from any thread."""

    __slots__ = ("lane", "conns", "run")

    def __init__(self, lane: DataLane, conns: Sequence[LaneSocket], fn: Callable[..., Any], *args: Any) -> None:
        self.lane = lane
        self.conns = conns
        self.run = _HandedOver(fn, conns, *args)

    def cancel(self) -> None:
        self.lane.abort(self.conns)


TransferPlan = Generator[LaneCall | LaneMove, Any, T]


def lane_fetch_request(fetch: kvstore_pb2.FetchRequest, connections: int,
                       timeout_s: float) -> kvstore_pb2.LaneFetchRequest:
    """The LaneFetch that opens `fetch` for `connections` connections, given up on the
    daemon after `timeout_s`."""
    return kvstore_pb2.LaneFetchRequest(fetch=fetch, connections=connections, timeout_ms=_ms(timeout_s))


def _of_start(fetch: kvstore_pb2.FetchRequest, lane: DataLane) -> kvstore_pb2.FetchRequest:
    """`fetch`, naming the start of the daemon `lane` belongs to (its transfer is that start's)."""
    if lane.boot_id and not fetch.boot_id:
        named = kvstore_pb2.FetchRequest()
        named.CopyFrom(fetch)  # (every field: a grouped export's `group` too)
        named.boot_id = lane.boot_id
        return named
    return fetch


def fetch_transfer(lane: DataLane, conns: list[LaneSocket], fetch: kvstore_pb2.FetchRequest,
                   dests: Callable[[kvstore_pb2.LaneFetchResponse], Sequence[memoryview]],
                   left: Callable[[], float], *,
                   fall_back: Callable[[Exception], bool] | None = None) -> TransferPlan[int | None]:
    """Fetch `fetch`'s blocks on `conns`, which this plan takes over (checked in or closed
    on every path): LaneFetch opens the transfer, `dests(its answer)` says where the
    blocks land (block i in the i-th view, each `block_bytes`), and they land there,
    verified; how many leading blocks did (0 on a miss). `left()` is each step's timeout.
    A move that fails with an error `fall_back` accepts ends the plan with None (the
    caller fetches another way)."""
    try:
        timeout_s = left()
        grant = yield LaneCall("LaneFetch", lane_fetch_request(_of_start(fetch, lane), len(conns), timeout_s),
                               timeout_s)
        if not grant.num_blocks:
            lane.checkin(conns)
            return 0
        views = dests(grant)
    except BaseException:
        lane.checkin(conns)  # (an open transfer nobody joins expires on the daemon by itself)
        raise
    try:
        return int((yield LaneMove(lane, conns, lane.fetch_into, grant.transfer_id, grant.block_bytes, views,
                                   left(), None, lane_codecs(grant))))
    except Exception as exc:
        if fall_back is not None and fall_back(exc):
            return None
        raise


def put_transfer(lane: DataLane, conns: list[LaneSocket], header: kvstore_pb2.PutHeader,
                 sources: Sequence[memoryview], left: Callable[[], float], *,
                 runs: Sequence[kvstore_pb2.PutRun] = (),
                 check: Callable[[kvstore_pb2.LanePutResponse], None] | None = None,
                 fall_back: Callable[[Exception], bool] | None = None,
                 ) -> TransferPlan[tuple[kvstore_pb2.LanePutResponse, kvstore_pb2.PutResponse] | None]:
    """Store `sources` (block i under the header's i-th key; `runs`: where later runs of
    the chain start) on `conns`, which this plan takes over, all or nothing: LanePut
    opens the put and answers which blocks the daemon needs, `check(that answer)` may
    refuse it by raising, those blocks go on the lane as its credit allows (each verified
    as it lands), and LaneCommit publishes them: (LanePut's answer, LaneCommit's).
    `left()` is each step's timeout. A failure after LanePut aborts the put; a move that
    fails with an error `fall_back` accepts then ends the plan with None (the caller puts
    another way)."""
    try:
        timeout_s = left()
        grant = yield LaneCall("LanePut", kvstore_pb2.LanePutRequest(
            header=header, connections=len(conns), timeout_ms=_ms(timeout_s), runs=runs, boot_id=lane.boot_id),
            timeout_s)
    except BaseException:
        lane.checkin(conns)
        raise
    if not any(grant.needed):
        lane.checkin(conns)
    else:
        try:
            if check is not None:
                try:
                    check(grant)
                except BaseException:
                    lane.checkin(conns)
                    raise
            yield LaneMove(lane, conns, lane.put_from, grant.transfer_id, grant.block_bytes, grant.needed, sources,
                           left(), lane_codecs(grant))
        except GeneratorExit:
            raise  # closed where it stood: nothing more may be yielded (the daemon rolls it back)
        except BaseException as exc:
            try:
                yield LaneCall("LaneCommit", kvstore_pb2.LaneCommitRequest(transfer_id=grant.transfer_id, abort=True,
                                                                           boot_id=lane.boot_id),
                               min(ABORT_TIMEOUT_S, left()), cleanup=True)
            except Exception:  # noqa: BLE001 - it rolls back by itself at its deadline
                pass
            if fall_back is not None and isinstance(exc, Exception) and fall_back(exc):
                return None
            raise
    timeout_s = left()
    committed = yield LaneCall("LaneCommit", kvstore_pb2.LaneCommitRequest(transfer_id=grant.transfer_id,
                                                                         boot_id=lane.boot_id), timeout_s)
    return grant, committed


def grouped_fetch_transfer(lane: DataLane, conns: list[LaneSocket], fetch: kvstore_pb2.FetchRequest,
                           dests: Callable[[kvstore_pb2.LaneFetchResponse], Sequence[memoryview]],
                           left: Callable[[], float], *,
                           fall_back: Callable[[Exception], bool] | None = None) -> TransferPlan[tuple[int, int] | None]:
    """`fetch_transfer` of a layout with KV groups: LaneFetch answers one transfer per
    group (`LaneFetchResponse.groups`), `dests(its answer)` one buffer per part in wire
    order, each of its group's size, and the groups' parts land there one group after
    another, verified: (blocks of the prefix, leading parts that landed). Fewer parts
    than planned is a miss of the whole prefix for the caller."""
    try:
        timeout_s = left()
        grant = yield LaneCall("LaneFetch", lane_fetch_request(_of_start(fetch, lane), len(conns), timeout_s),
                               timeout_s)
        if not grant.num_blocks:
            lane.checkin(conns)
            return 0, 0
        if sum(g.num_blocks for g in grant.groups) != grant.num_blocks:
            raise KVStoreError(f"the daemon planned {grant.num_blocks} parts in transfers of "
                               f"{sum(g.num_blocks for g in grant.groups)}")
        views = dests(grant)
    except BaseException:
        lane.checkin(conns)
        raise
    try:
        landed = yield LaneMove(lane, conns, lane.fetch_groups, grant.groups, views, left())
    except Exception as exc:
        if fall_back is not None and fall_back(exc):
            return None
        raise
    return grant.prefix_blocks, int(landed)


def grouped_put_transfer(lane: DataLane, conns: list[LaneSocket], header: kvstore_pb2.PutHeader,
                         sources: Sequence[memoryview], left: Callable[[], float], *,
                         fall_back: Callable[[Exception], bool] | None = None,
                         ) -> TransferPlan[kvstore_pb2.PutResponse | None]:
    """`put_transfer` of a layout with KV groups: `sources` are the put's parts in wire
    order (`kvstore.groups.part_order`); LanePut answers one transfer per group
    (`LanePutResponse.groups`), the parts go on the lane one group after another, and
    one LaneCommit publishes them all, or nothing."""
    try:
        timeout_s = left()
        grant = yield LaneCall("LanePut", kvstore_pb2.LanePutRequest(
            header=header, connections=len(conns), timeout_ms=_ms(timeout_s), boot_id=lane.boot_id), timeout_s)
        if sum(g.num_blocks for g in grant.groups) != len(sources):
            raise KVStoreError(f"the daemon opened transfers of {sum(g.num_blocks for g in grant.groups)} parts "
                               f"for a put of {len(sources)}")
    except BaseException:
        lane.checkin(conns)
        raise
    try:
        yield LaneMove(lane, conns, lane.put_groups, grant.groups, sources, left())
    except GeneratorExit:
        raise
    except BaseException as exc:
        try:
            yield LaneCall("LaneCommit", kvstore_pb2.LaneCommitRequest(transfer_id=grant.transfer_id, abort=True,
                                                                       boot_id=lane.boot_id),
                           min(ABORT_TIMEOUT_S, left()), cleanup=True)
        except Exception:  # noqa: BLE001 - it rolls back by itself at its deadline
            pass
        if fall_back is not None and isinstance(exc, Exception) and fall_back(exc):
            return None
        raise
    timeout_s = left()
    return (yield LaneCall("LaneCommit", kvstore_pb2.LaneCommitRequest(transfer_id=grant.transfer_id,
                                                                       boot_id=lane.boot_id), timeout_s))


async def run_transfer(plan: TransferPlan[T], call: Callable[[str, Any, float], Awaitable[Any]]) -> T:
    """Run a transfer's plan from asyncio code: its control calls through `call(name,
    request, timeout_s)`, its moves through `move_in_threads`. A failed step is thrown
    into the plan where it was yielded, so the plan's own handlers see it."""
    send: Callable[[Any], LaneCall | LaneMove] = plan.send
    value: Any = None
    while True:
        try:
            step = send(value)
        except StopIteration as stop:
            return stop.value
        except BaseException:
            del value  # maybe the very error on its way out: no cycle through this frame
            raise
        try:
            if isinstance(step, LaneMove):
                value = await move_in_threads(step)
            elif step.cleanup:
                value = await asyncio.shield(call(step.name, step.request, step.timeout_s))
            else:
                value = await call(step.name, step.request, step.timeout_s)
            send = plan.send
        except BaseException as exc:  # cancellation too: a put aborts
            value, send = exc, plan.throw


async def move_in_threads(move: LaneMove) -> Any:
    """`move.run()` on a worker thread, for asyncio code. Cancelled, it shuts the
    transfer's connections and waits for its threads to let go of the buffers they were
    given, then raises. A failure is raised as the threads raised it, with the frames it
    passed on its way here cleared as well."""
    task = asyncio.ensure_future(asyncio.to_thread(move.run))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        move.cancel()
        while not task.done():
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                continue
        if not task.cancelled() and task.exception() is not None:
            _clear_frames(task.exception())  # (retrieved: the cancellation is what the caller gets)
        raise
    except BaseException:
        _clear_frames(task.exception())
        del task  # the error's traceback holds this frame: nothing in it may lead back to the error
        raise


class _HandedOver:
    """`fn(*args)` for an executor's thread, called once. It takes its arguments out as it
    starts, and clears the frames of a failure (`_clear_frames`) before raising it: an
    executor keeps a task, and the error it set, until its thread moves on to the next
    one, which may be after the caller saw the outcome and let go of the buffers it had
    passed (a host tier unmapping their segment)."""

    __slots__ = ("_call",)

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._call: tuple[Callable[..., Any], tuple[Any, ...]] | None = (fn, args)

    def __call__(self) -> Any:
        assert self._call is not None, "called twice"
        fn, args = self._call
        self._call = None
        try:
            return fn(*args)
        except BaseException as exc:
            del fn, args
            _clear_frames(exc)
            raise


def _clear_frames(error: BaseException | None) -> None:
    """Clear the frames of `error`'s traceback and of the errors it chains to. A thread
    that moved bytes keeps the other connections' failures in lists its frames hold, next
    to the buffers it was given: cycles only the collector would break. Once those
    frames are cleared, reference counting frees it all. Tracebacks keep their lines;
    a frame still running is left as it is.

    No frame's `f_locals` is read: on Python 3.11 that caches a copy of the locals on
    the frame, which `frame.clear()` leaves in place (buffers and all)."""
    todo = [error]
    seen: set[int] = set()
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        todo += (error.__context__, error.__cause__)


def _ms(timeout_s: float) -> int:
    """A transfer's timeout on the daemon, in whole milliseconds: at least 1 (0 would mean
    the daemon's own limit)."""
    return max(1, int(timeout_s * 1000))


def _skip_stale(lane: LaneSocket, frame: Frame) -> None:
    """A frame about an earlier transfer on this connection (the daemon reports a failed
    put once, maybe after its sender finished): its error is what that put's LaneCommit
    answered already."""
    if frame.kind == ERROR:
        lane.read_payload(frame.length, MAX_ERROR_BYTES)
    elif frame.kind != CREDIT:
        raise ProtocolError(f"a frame of kind {frame.kind} for another transfer")


def _part(work: Callable[..., None], lane: LaneSocket, *args: object) -> None:
    """One connection's share of a transfer. A daemon (or something between) that breaks
    the protocol is a broken lane to this client, not a request to fix."""
    try:
        work(lane, *args)
    except ProtocolError as exc:
        raise LaneClosed(f"the data lane broke its protocol: {exc}") from None


def _error_of(lane: LaneSocket, code: int, length: int) -> KVStoreError:
    message = lane.read_payload(length, MAX_ERROR_BYTES).decode("utf-8", "replace")
    return error_for_status(status_of(code), message or "the data lane refused the transfer")


def _alive(lane: LaneSocket) -> bool:
    """Whether an idle pooled connection is still good. CREDIT frames of a put that had
    finished sending (the daemon topped its credit up as the last blocks landed) are
    read and dropped; anything else waiting (the daemon closed it, or reported an error)
    means it is not."""
    if lane.buffered():  # received ahead with the transfer's last frames
        rest = lane.take_buffered()
        for at in range(0, len(rest), HEADER_BYTES):
            head = rest[at : at + HEADER_BYTES]
            if len(head) < HEADER_BYTES:
                return False
            frame = unpack(head)
            if frame.kind != CREDIT or frame.length:
                return False
    poller = select.poll()
    try:
        poller.register(lane.sock, select.POLLIN)
    except (OSError, ValueError):
        return False
    while poller.poll(0):
        if lane.tls:
            return False  # no peeking into TLS records: a fresh connection is cheaper
        try:
            head = lane.sock.recv(HEADER_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            if len(head) < HEADER_BYTES or unpack(head).kind != CREDIT:
                return False
            lane.sock.recv(HEADER_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
    return True


__all__ = ["ABORT_TIMEOUT_S", "CODEC_MODES", "DataLane", "DataLaneStats", "LaneCall", "LaneClosed", "LaneCodecs",
           "LaneEndpoint", "LaneMove", "check_codec_mode", "lane_codecs",
           "LaneTimeout", "TransferPlan", "checkout_in_thread", "choose_endpoint", "client_tls", "fetch_transfer",
           "lane_fetch_request", "move_in_threads", "put_transfer", "run_transfer"]
