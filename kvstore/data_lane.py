"""The data lane's framing and socket primitives, shared by the daemon, the SDK and the
cluster: block bytes between machines on a TCP (or Unix) stream socket of their own,
one large frame per block, instead of in gRPC messages.

Why not in `kvstore.control_lane_wire`: the control lane carries protobuf messages of unary calls
on a local socket, one call at a time; this lane carries only raw block bytes, on many
connections, under credit-based flow control, and never a protobuf message. Control stays
on the RPCs (`DataLane` offers the lane, `LaneFetch`/`LanePut` open a transfer and
answer its id, `LaneCommit` publishes a put); a transfer's bytes then move here.

Glossary of planes and lanes: docs/local-data-plane.md

Frames, both ways: a 40-byte header

    u8 kind | u8 flags | u16 reserved (0) | u32 block | 16s transfer | u64 length | u64 value

then `length` payload bytes (HELLO, DATA, ERROR), and for DATA an 8-byte trailer, the
XXH3-64 (seed 0) of the block's raw bytes, little-endian: a sender may hash each piece
just before it sends it, and the receiver hashes each piece as it lands in its destination.

Codecs (`kvstore.codecs`): a DATA frame's `flags` name the lossless codec its payload is
in (0: raw), and then `value` is the element size its byte-plane shuffle used and
`length` the encoded size; the block's raw size is the transfer's block size, and the
trailer is still the checksum of the raw bytes, so a receiver decodes into the block's
destination and hashes it there. A FETCH frame's `flags` ask the daemon for that codec;
which codecs a daemon sends and takes, and the element size of the transfer's blocks,
its LaneFetch / LanePut answer says (`codecs`, `itemsize`): a daemon that predates codecs
answers none, and gets raw frames only. Credit always counts raw bytes (a block's
`block_bytes`), whatever its frame carries.

| kind | from | meaning |
|---|---|---|
| HELLO   | client | first frame: payload `MAGIC` + bearer token (UTF-8, may be empty); block = VERSION |
| WELCOME | daemon | the hello passed; block = VERSION, value = largest DATA payload accepted, transfer = the daemon's boot id (u64le, then zeros; all zero: not told) |
| FETCH   | client | join fetch transfer `transfer`; value = the credit granted, in bytes; flags = the codec asked for |
| PUSH    | client | join put transfer `transfer`; the daemon answers CREDIT |
| CREDIT  | receiver | `value` more payload bytes may be sent for `transfer` (0, to a put's sender: no more on this connection) |
| DATA    | sender | block `block` of `transfer`: `length` bytes, then the trailer; flags = its codec, value = its element size |
| END     | daemon | fetch `transfer` is complete on this connection; block = blocks in the result |
| ERROR   | either | `transfer` (all zero: the connection) failed; block = gRPC status code, payload = message |

Flow control: a receiver grants credit in bytes; a sender never has more DATA payload in
flight on a connection than it was granted (a daemon that receives more closes the
connection). A receiver grants a window ahead, never more than the transfer can still
bring, and tops it up once half of it is used (`Grant`), so a transfer that fits its
window costs no CREDIT frame beyond the first. Blocks land straight in their destination
(a host-tier slot, a caller's buffer), so a connection holds no more memory than the
socket's own buffers.

A put's credit, summed over all its connections, covers only the slots the daemon has
reserved, and it reserves them in order, a window at a time, as blocks land. So a
put's sender takes its needed blocks in order, each only once it holds credit for it
(then whatever it sends has a slot; a block sent ahead of the reservation fails the
put). A CREDIT of 0 answers a sender that has none left when every block still to come
is covered by credit on the put's other connections: it stops there.

Primitives: `Frame`, `pack`, `unpack`, `hello_payload`, `parse_hello`, `boot_id_field`,
`boot_id_of`, `status_of`, `Grant`, `LaneSocket` (one blocking socket, plain or TLS:
`send_frame`, `send_data`, `send_blocks` (encoding them), `read_frame`, `recv_block`,
`recv_encoded`, `discard`, `read_payload`, timeouts), `checksum_of`, `NOT_DECODED`.
"""

from __future__ import annotations

import errno
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from typing import NamedTuple

import grpc
import xxhash

from kvstore.codecs import Codec, CodecError, decode, encode
from kvstore.errors import DeadlineExceeded, InvalidArgument, Unavailable

MAGIC = b"KVD1"
VERSION = 1
HEADER = struct.Struct("<BBHI16sQQ")
TRAILER = struct.Struct("<Q")
HEADER_BYTES = HEADER.size
NO_TRANSFER = bytes(16)
TRANSFER_ID_BYTES = 16

HELLO, WELCOME, FETCH, PUSH, CREDIT, DATA, END, ERROR = range(1, 9)
KIND_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", FETCH: "FETCH", PUSH: "PUSH", CREDIT: "CREDIT", DATA: "DATA",
              END: "END", ERROR: "ERROR"}
# The hello is the magic and a token (at most 256 characters); an error, one message.
MAX_HELLO_BYTES = 4096
MAX_ERROR_BYTES = 4096
# Receives land in pieces of this size, each hashed right after it arrives (still in cache).
RECV_PIECE_BYTES = 256 << 10
# TLS records carry at most 16 KiB; sends are cut in pieces of this size.
TLS_SEND_PIECE_BYTES = 256 << 10
# Reads shorter than this (a frame's header and trailer, a small block) are served from
# a receive buffer, which one system call fills with whatever has arrived, up to
# RECV_BUFFER_BYTES: small blocks come in many to a call instead of three calls each.
SMALL_READ_BYTES = 16 << 10
RECV_BUFFER_BYTES = 64 << 10
# Blocks a sender puts in one system call, at most (those it holds credit for, of a
# fetch's ready ones or a put's next ones): so many and so many bytes. A sendmsg takes
# at most 1,024 buffers, three per block.
SEND_BATCH_BLOCKS = 64
SEND_BATCH_BYTES = 1 << 20


def send_batch(credit: int, block_bytes: int) -> int:
    """How many blocks of `block_bytes` to send in one call with `credit` bytes of credit
    (at least one)."""
    return max(1, min(credit // block_bytes, SEND_BATCH_BYTES // block_bytes, SEND_BATCH_BLOCKS))

_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
# What `recv_encoded` reports as the checksum of a payload that did not decode: never an
# XXH3-64 (those are unsigned), so it never matches the trailer.
NOT_DECODED = -1


class Frame(NamedTuple):
    kind: int
    block: int
    transfer: bytes
    length: int
    value: int
    flags: int = 0


def pack(kind: int, transfer: bytes = NO_TRANSFER, block: int = 0, length: int = 0, value: int = 0,
         flags: int = 0) -> bytes:
    return HEADER.pack(kind, flags, 0, block, transfer, length, value)


def unpack(header: bytes | bytearray | memoryview) -> Frame:
    kind, flags, _reserved, block, transfer, length, value = HEADER.unpack(header)
    return Frame(kind, block, transfer, length, value, flags)


_BOOT_ID = struct.Struct("<Q8x")


def boot_id_field(boot_id: int) -> bytes:
    """A WELCOME's transfer field: the daemon's boot id (kvstore.server.generation)."""
    return _BOOT_ID.pack(boot_id)


def boot_id_of(welcome: Frame) -> int:
    """The boot id a WELCOME carries (0 from a daemon that does not tell it)."""
    return int(_BOOT_ID.unpack(welcome.transfer)[0])


def hello_payload(token: str) -> bytes:
    return MAGIC + token.encode("utf-8")


def parse_hello(payload: bytes) -> str:
    """The bearer token of a hello's payload; `InvalidArgument` if it is not a lane hello."""
    if payload[: len(MAGIC)] != MAGIC:
        raise InvalidArgument("not a kvstore data lane hello (bad magic)")
    try:
        return payload[len(MAGIC) :].decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument("the data lane hello's token is not UTF-8") from None


def status_of(value: int) -> grpc.StatusCode:
    return _STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def checksum_of(data: memoryview | bytes | bytearray) -> int:
    """XXH3-64 of a block: what a DATA frame's trailer carries."""
    h = xxhash.xxh3_64()
    h.update(data)  # the streaming update releases the GIL for large inputs
    return h.intdigest()


class Grant:
    """A receiver's credit on one connection for one transfer: at most `window` bytes
    granted ahead of what arrived, at most `total` bytes in all; topped up once half of
    the window is used. `first` is the opening grant; `landed(n)` returns what to grant
    after `n` more bytes arrived (0: nothing to send)."""

    __slots__ = ("window", "total", "granted", "received")

    def __init__(self, window: int, total: int) -> None:
        self.window = window
        self.total = total
        self.granted = min(window, total)
        self.received = 0

    @property
    def first(self) -> int:
        return self.granted

    @property
    def left(self) -> int:
        """What the sender may still send."""
        return self.granted - self.received

    def landed(self, nbytes: int) -> int:
        self.received += nbytes
        outstanding = self.granted - self.received
        if self.granted >= self.total or outstanding > self.window // 2:
            return 0
        more = min(self.window - outstanding, self.total - self.granted)
        self.granted += more
        return more


class LaneClosed(Unavailable):
    """The peer closed the connection or it broke."""


class LaneTimeout(DeadlineExceeded):
    """The peer made no progress within the connection's timeout, or a deadline passed."""


class ProtocolError(InvalidArgument):
    """The peer sent something the lane's protocol does not allow."""


class _mapped_io_errors:
    """A socket's failures as the lane's errors (a context manager, like
    `contextlib.suppress`), for receives and sends alike: no progress within the
    connection's timeout is `LaneTimeout` ("the data lane peer `stalled` for `timeout_s`
    s"), any other failure (a reset, a failed TLS session) `LaneClosed`. A slotted class
    rather than a generator: it wraps every receive."""

    __slots__ = ("stalled", "timeout_s")

    def __init__(self, stalled: str, timeout_s: float) -> None:
        self.stalled = stalled
        self.timeout_s = timeout_s

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, (TimeoutError, BlockingIOError)):
            raise LaneTimeout(f"the data lane peer {self.stalled} for {self.timeout_s:g} s") from None
        if isinstance(exc, ssl.SSLError):
            raise LaneClosed(f"the data lane's TLS session failed: {exc}") from None
        if isinstance(exc, OSError):
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise LaneTimeout(f"the data lane peer {self.stalled} for {self.timeout_s:g} s") from None
            raise LaneClosed(f"the data lane connection broke: {exc.strerror or exc}") from None


def _kernel_timeout(seconds: float) -> bytes:
    seconds = max(seconds, 0.001)
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1e6))


class LaneSocket:
    """One lane connection's socket, in blocking mode, plain or TLS.

    Plain sockets use the kernel's own timeouts (SO_RCVTIMEO / SO_SNDTIMEO), so a receive
    with MSG_WAITALL waits for a whole piece in one system call and a send of a block is
    one `sendmsg` of the header, the block's memory and the trailer (no copy in Python).
    TLS sockets cannot do either: they use Python's socket timeout, and send piece by
    piece (the encryption copies anyway). `deadline` arguments are `time.monotonic()`
    values; a call that passes one raises `LaneTimeout`.
    """

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.timeout_s = 0.0
        self._header = bytearray(HEADER_BYTES)
        self._header_view = memoryview(self._header)
        self._trailer = bytearray(TRAILER.size)
        self._scratch: bytearray | None = None
        # Bytes received ahead of what was asked for: _rbuf[_rstart:_rend].
        self._rbuf = bytearray(RECV_BUFFER_BYTES)
        self._rview = memoryview(self._rbuf)
        self._rstart = self._rend = 0
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.set_timeout(timeout_s)

    def set_timeout(self, timeout_s: float) -> None:
        """How long one receive or send may wait for progress before `LaneTimeout`."""
        if timeout_s == self.timeout_s:
            return
        self.timeout_s = timeout_s
        if self.tls:
            self.sock.settimeout(timeout_s)
            return
        self.sock.settimeout(None)
        tv = _kernel_timeout(timeout_s)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    # -------------------------------------------------------------- receiving

    def buffered(self) -> int:
        """Bytes received and not read yet (a poll of the socket does not see them)."""
        return self._rend - self._rstart

    def take_buffered(self) -> bytes:
        """The bytes received and not read yet, which are then gone."""
        out = bytes(self._rview[self._rstart : self._rend])
        self._rstart = self._rend = 0
        return out

    def _recv_into(self, view: memoryview, deadline: float | None) -> int:
        """Fill `view` (all of it); its length. Bytes received ahead come first; a short
        read is served from the receive buffer, a long one lands in `view` directly."""
        n = len(view)
        got = 0
        start, end = self._rstart, self._rend
        if end > start:
            got = min(end - start, n)
            view[:got] = self._rview[start : start + got]
            start += got
            self._rstart, self._rend = (start, end) if start < end else (0, 0)
        sock = self.sock
        waitall = 0 if self.tls else socket.MSG_WAITALL
        while got < n:
            if deadline is not None and time.monotonic() > deadline:
                raise LaneTimeout("the data lane transfer passed its deadline")
            small = n - got < SMALL_READ_BYTES
            with _mapped_io_errors("sent nothing", self.timeout_s):
                if small:  # whatever has arrived, at least one byte, into the buffer
                    k = sock.recv_into(self._rview, RECV_BUFFER_BYTES)
                else:
                    k = sock.recv_into(view[got:], n - got, waitall)
            if k == 0:
                raise LaneClosed("the data lane peer closed the connection")
            if small:
                take = min(k, n - got)
                view[got : got + take] = self._rview[:take]
                if take < k:
                    self._rstart, self._rend = take, k
                k = take
            got += k
        return n

    def read_frame(self, deadline: float | None = None) -> Frame:
        self._recv_into(self._header_view, deadline)
        return unpack(self._header)

    def read_payload(self, length: int, limit: int, deadline: float | None = None) -> bytes:
        """A small payload (hello, error message) of at most `limit` bytes."""
        if length > limit:
            raise ProtocolError(f"a {length}-byte control payload on the data lane; at most {limit}")
        buf = bytearray(length)
        if length:
            self._recv_into(memoryview(buf), deadline)
        return bytes(buf)

    def recv_block(self, dest: memoryview, deadline: float | None) -> tuple[int, int]:
        """Receive a DATA frame's payload straight into `dest` (its whole length), hashing
        each piece as it lands, then its trailer: (checksum of what landed, the sender's)."""
        h = xxhash.xxh3_64()
        n = len(dest)
        for start in range(0, n, RECV_PIECE_BYTES):
            piece = dest[start : start + RECV_PIECE_BYTES]
            self._recv_into(piece, deadline)
            h.update(piece)
        self._recv_into(memoryview(self._trailer), deadline)
        return h.intdigest(), TRAILER.unpack(self._trailer)[0]

    def buffered_blocks(self, transfer: bytes, block_bytes: int, blocks: int,
                        most: int) -> list[tuple[int, memoryview, int]]:
        """The DATA frames of `transfer` already received whole (header, `block_bytes`
        of payload, trailer), up to `most`: (block, its payload in the receive buffer, the
        sender's checksum) each, in order, with no system call (a receive of small blocks
        brings hundreds at once). They stay unread until `consume` says how many were
        taken; it stops at the first frame that is not such a one, or names a block past
        `blocks`, which is then read the usual way (`read_frame`)."""
        out: list[tuple[int, memoryview, int]] = []
        buf = self._rview
        start, end = self._rstart, self._rend
        frame_bytes = HEADER_BYTES + block_bytes + TRAILER.size
        unpack_from, trailer = HEADER.unpack_from, TRAILER.unpack_from
        while end - start >= frame_bytes and len(out) < most:
            kind, flags, _reserved, block, tid, length, _value = unpack_from(buf, start)
            if kind != DATA or flags or tid != transfer or length != block_bytes or not 0 <= block < blocks:
                break
            p = start + HEADER_BYTES
            out.append((block, buf[p : p + block_bytes], trailer(buf, p + block_bytes)[0]))
            start += frame_bytes
        return out

    def consume(self, frames: int, block_bytes: int) -> None:
        """Drop the first `frames` frames `buffered_blocks` returned (their views go stale)."""
        start = self._rstart + frames * (HEADER_BYTES + block_bytes + TRAILER.size)
        assert start <= self._rend
        self._rstart, self._rend = (start, self._rend) if start < self._rend else (0, 0)

    def recv_encoded(self, dest: memoryview, length: int, codec: int, itemsize: int,
                     deadline: float | None) -> tuple[int, int]:
        """Receive an encoded DATA frame's `length`-byte payload, decode it straight into
        `dest` (the block's raw bytes, all of it) and hash it there, then read the
        trailer: (checksum of what was decoded, the sender's). A payload that does not
        decode gives `NOT_DECODED`, which matches no checksum."""
        if self._scratch is None or len(self._scratch) < length:
            self._scratch = bytearray(max(length, RECV_PIECE_BYTES))
        payload = memoryview(self._scratch)[:length]
        self._recv_into(payload, deadline)
        self._recv_into(memoryview(self._trailer), deadline)
        want = TRAILER.unpack(self._trailer)[0]
        try:
            decode(codec, payload, itemsize, len(dest), dest)
        except CodecError:
            return NOT_DECODED, want
        return checksum_of(dest), want

    def discard(self, nbytes: int, deadline: float | None) -> None:
        """Read and drop `nbytes` (a DATA frame nobody wants, with its trailer)."""
        if self._scratch is None:
            self._scratch = bytearray(RECV_PIECE_BYTES)
        view = memoryview(self._scratch)[:RECV_PIECE_BYTES]
        while nbytes:
            k = min(nbytes, len(view))
            self._recv_into(view[:k], deadline)
            nbytes -= k

    # -------------------------------------------------------------- sending

    def _send(self, buffers: list[memoryview]) -> None:
        sock = self.sock
        with _mapped_io_errors("took nothing", self.timeout_s):
            if self.tls:
                for buf in buffers:
                    for start in range(0, len(buf), TLS_SEND_PIECE_BYTES):
                        sock.sendall(buf[start : start + TLS_SEND_PIECE_BYTES])
                return
            while buffers:
                sent = sock.sendmsg(buffers)
                while sent:
                    head = buffers[0]
                    if sent >= len(head):
                        sent -= len(head)
                        buffers.pop(0)
                    else:
                        buffers[0] = head[sent:]
                        sent = 0
                while buffers and not len(buffers[0]):
                    buffers.pop(0)

    def send_frame(self, kind: int, transfer: bytes = NO_TRANSFER, block: int = 0, value: int = 0,
                   payload: bytes = b"", flags: int = 0) -> None:
        self._send([memoryview(pack(kind, transfer, block, len(payload), value, flags)), memoryview(payload)])

    def send_data(self, transfer: bytes, block: int, data: memoryview, checksum: int) -> None:
        """A DATA frame: the header, `data` itself (never copied here) and the trailer."""
        self._send([memoryview(pack(DATA, transfer, block, len(data))), data, memoryview(TRAILER.pack(checksum))])

    def send_blocks(self, transfer: bytes, blocks: Sequence[tuple[int, memoryview, int]],
                    codec: Codec = Codec.RAW, itemsize: int = 1) -> int:
        """DATA frames of (block, data, checksum) each, in one `sendmsg` where the socket
        takes them (`send_data`'s frames laid end to end); the payload bytes sent. With a
        codec, each block goes encoded where that makes it smaller, raw otherwise."""
        if len(blocks) == 1 and codec is Codec.RAW:
            self.send_data(transfer, *blocks[0])
            return len(blocks[0][1])
        buffers: list[memoryview] = []
        sent = 0
        for block, data, checksum in blocks:
            flags = value = 0
            if codec is not Codec.RAW:
                packed = encode(codec, data, itemsize)
                if len(packed) < len(data):
                    data, flags, value = memoryview(packed), int(codec), itemsize
            sent += len(data)
            buffers += (memoryview(pack(DATA, transfer, block, len(data), value, flags)), data,
                        memoryview(TRAILER.pack(checksum)))
        self._send(buffers)
        return sent

    def send_error(self, transfer: bytes, code: grpc.StatusCode, message: str) -> None:
        self.send_frame(ERROR, transfer, code.value[0], payload=message.encode("utf-8")[:MAX_ERROR_BYTES])

    # -------------------------------------------------------------- closing

    def shutdown(self) -> None:
        """Wake whatever blocks on this socket (it fails at once); safe from any thread."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
