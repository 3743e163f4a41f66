"""What the sync and async clients share: targets, request building, payload
conversion, fetch assembly and error translation. No I/O happens here.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import grpc
import numpy as np

from kvstore.addresses import DEFAULT_TCP_LISTEN, default_unix_socket
from kvstore.convert import TIER_BY_NAME, TIER_NAMES, layout_to_proto
from kvstore.errors import FailedPrecondition, Internal, InvalidArgument, KVStoreError, error_for_status
from kvstore.hashing import HASH_BYTES, split_hashes, token_bytes
from kvstore.laneproto import IDEMPOTENT
from kvstore.layout import KVLayout
from kvstore.native import native as _native
from kvstore.v1 import kvstore_pb2
from kvstore.wire import RawChunk, encode_chunk

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 64 << 20

# Idempotent calls (laneproto.IDEMPOTENT, the one list) are retried by the channel on
# UNAVAILABLE.
_KVSTORE_METHODS = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].methods_by_name
_RETRY_METHODS = sorted(m for m in IDEMPOTENT if m in _KVSTORE_METHODS)
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "kvstore.v1.KVStore", "method": m} for m in _RETRY_METHODS]
                + [{"service": "kvstore.v1.Admin"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "0.5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.service_config", _SERVICE_CONFIG),
    ("grpc.enable_retries", 1),
]


def resolve_target(target: str | None) -> str:
    """A gRPC target from what a person typed: unix:PATH, a socket path, or HOST:PORT.

    None means `KVSTORE_TARGET`, else the default Unix socket if a daemon made one,
    else the default TCP address.
    """
    if not target:
        target = os.environ.get("KVSTORE_TARGET", "")
    if not target:
        sock = default_unix_socket()
        return f"unix:{sock}" if os.path.exists(sock) else DEFAULT_TCP_LISTEN
    if target.startswith("/") or target.startswith("./"):
        return f"unix:{target}"
    return target


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How much of a prefix the daemon holds."""

    num_blocks: int
    num_tokens: int
    tiers: list[str]
    block_hashes: list[bytes]
    namespace_id: bytes
    lease_id: str


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int
    existing: int
    block_hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class PinResult:
    lease_id: str
    pinned: int
    expires_in_ms: int


def reuse_hint(session_id: str | None, expect_reuse_within_s: float | None) -> kvstore_pb2.ReuseHint | None:
    """The hint message for a call, or None; both parts or neither."""
    if session_id is None and expect_reuse_within_s is None:
        return None
    if not session_id or expect_reuse_within_s is None:
        raise InvalidArgument("a reuse hint needs both session_id and expect_reuse_within_s")
    return kvstore_pb2.ReuseHint(session_id=session_id, expect_reuse_within_s=float(expect_reuse_within_s))


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What a prefetch did: blocks raised into `tier`, already there, or missing."""

    tier: str
    requested: int
    raised: int
    already: int
    missing: int
    skipped: int  # no room could be made in the target tier




def prefetch_request(
    layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None, tier: str
) -> kvstore_pb2.PrefetchRequest:
    if tier and tier not in TIER_BY_NAME:
        raise InvalidArgument(f"unknown tier {tier!r}; use one of {', '.join(TIER_BY_NAME)} or '' for the top tier")
    return kvstore_pb2.PrefetchRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                       tier=TIER_BY_NAME.get(tier, kvstore_pb2.TIER_UNSPECIFIED))


def prefetch_result(resp: kvstore_pb2.PrefetchResponse) -> PrefetchResult:
    return PrefetchResult(TIER_NAMES.get(resp.tier, "unknown"), resp.requested, resp.raised, resp.already,
                          resp.missing, resp.skipped)


# Namespace messages of recent layouts: an engine names the same one or two layouts on
# every call (a request copies the message it is given, so sharing one is safe).
_NAMESPACES: dict[KVLayout, kvstore_pb2.Namespace] = {}
_NAMESPACES_KEPT = 64


def namespace_ref(layout: KVLayout) -> kvstore_pb2.Namespace:
    if not isinstance(layout, KVLayout):
        raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
    msg = _NAMESPACES.get(layout)
    if msg is None:
        msg = kvstore_pb2.Namespace(layout=layout_to_proto(layout))
        if len(_NAMESPACES) >= _NAMESPACES_KEPT:
            _NAMESPACES.clear()
        _NAMESPACES[layout] = msg
    return msg


def block_keys(token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None) -> kvstore_pb2.BlockKeys:
    """The keys of a request, with block hashes packed (N x 16 bytes) and the answer's
    block hashes asked for packed too (`BlockKeys.packed_reply`)."""
    if (token_ids is None) == (block_hashes is None):
        raise InvalidArgument("name the blocks by token_ids or by block_hashes (exactly one)")
    if block_hashes is not None:
        return packed_keys(pack_hashes(block_hashes))
    return kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(packed_u32le=pack_tokens(token_ids)),
                                 packed_reply=True)


def packed_keys(packed: bytes) -> kvstore_pb2.BlockKeys:
    """BlockKeys naming a packed hash chain (N x 16 bytes)."""
    return kvstore_pb2.BlockKeys(packed_hashes=packed, packed_reply=True)


def pack_hashes(block_hashes: Sequence[bytes]) -> bytes:
    """16-byte hashes joined in one C call; checked without a Python step per hash in
    the common case, and one by one (to say which) only when something is wrong."""
    hashes = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
    if _native is not None:
        joined = _native.join_hashes(hashes)  # None unless each is a 16-byte bytes object
        if joined is not None:
            return joined
    try:
        packed = b"".join(hashes)
    except TypeError:
        packed = b""
    # Their bytes add up to 16 per hash and none is longer: every one is 16 bytes.
    if len(packed) == len(hashes) * HASH_BYTES and (not hashes or max(map(len, hashes)) == HASH_BYTES):
        return packed
    for i, h in enumerate(hashes):
        if not isinstance(h, (bytes, bytearray)) or len(h) != HASH_BYTES:
            raise InvalidArgument(f"block_hashes[{i}] must be {HASH_BYTES} bytes")
    return b"".join(hashes)


def response_hashes(resp: Any) -> list[bytes]:
    """The block hashes of a response that has them (LookupResponse, PutResponse,
    LocalPutResponse, LocalFetchResponse): the packed field, which the daemon fills for
    the SDK's requests, else the repeated one."""
    if resp.block_hashes_packed:
        return split_hashes(resp.block_hashes_packed)
    return list(resp.block_hashes)


def response_keys(resp: Any, start: int, stop: int) -> kvstore_pb2.BlockKeys:
    """BlockKeys naming blocks [start, stop) of a response's hashes."""
    if resp.block_hashes_packed:
        return packed_keys(resp.block_hashes_packed[start * HASH_BYTES : stop * HASH_BYTES])
    return packed_keys(b"".join(resp.block_hashes[start:stop]))


def pack_tokens(token_ids: Any) -> bytes:
    """Token ids as packed little-endian u32: a list, array, numpy array or tensor."""
    if hasattr(token_ids, "numpy") and type(token_ids).__module__.split(".", 1)[0] == "torch":
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise InvalidArgument("token_ids must be a 1-D array of integers")
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > 0xFFFFFFFF):
            raise InvalidArgument("token ids must be integers in [0, 4294967295]")
        return token_ids.astype("<u4", copy=False).tobytes()
    return token_bytes(token_ids)


def fetch_keys(
    layout: KVLayout,
    token_ids: Sequence[int] | None,
    block_hashes: Sequence[bytes] | None,
    out: Sequence[Any] | None,
) -> kvstore_pb2.BlockKeys:
    """Keys of a fetch, cut to the number of `out` buffers when the caller gave some."""
    if out is not None:
        if token_ids is not None:
            token_ids = token_ids[: len(out) * layout.block_size_tokens]
        elif block_hashes is not None:
            block_hashes = list(block_hashes)[: len(out)]
    return block_keys(token_ids, block_hashes)


def _is_tensor(obj: object) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "torch"


def as_buffer(block: Any) -> memoryview:
    """A flat byte view of a block: bytes-like, numpy array, or CPU torch tensor."""
    if _is_tensor(block):
        from kvstore.client.tensors import tensor_bytes

        return tensor_bytes(block)
    try:
        view = memoryview(block)
    except TypeError:
        raise InvalidArgument(
            f"a block must be bytes-like, a numpy array or a torch tensor, got {type(block).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument("a block buffer must be C-contiguous; call .copy() or np.ascontiguousarray first")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


@dataclass(frozen=True, slots=True)
class PreparedPut:
    """A validated put: its header and a flat byte view of each block."""

    header: kvstore_pb2.PutHeader
    views: list[memoryview]


def prepare_put(
    layout: KVLayout,
    token_ids: Sequence[int] | None,
    block_hashes: Sequence[bytes] | None,
    blocks: Sequence[Any],
    first_block: int,
    hint: kvstore_pb2.ReuseHint | None = None,
) -> PreparedPut:
    """Convert and size-check every block before anything is sent."""
    views = [as_buffer(b) for b in blocks]
    header = put_header(layout, token_ids, block_hashes, [len(v) for v in views], first_block, hint)
    return PreparedPut(header, views)


def device_put_header(
    layout: KVLayout,
    token_ids: Sequence[int] | None,
    block_hashes: Sequence[bytes] | None,
    blocks: Sequence[Any],
    first_block: int,
    hint: kvstore_pb2.ReuseHint | None = None,
) -> kvstore_pb2.PutHeader:
    """The header of a put of CUDA tensors (the device plane), size-checked like `prepare_put`."""
    sizes = [b.numel() * b.element_size() for b in blocks]
    return put_header(layout, token_ids, block_hashes, sizes, first_block, hint)


def put_header(
    layout: KVLayout,
    token_ids: Sequence[int] | None,
    block_hashes: Sequence[bytes] | None,
    sizes: Sequence[int],
    first_block: int,
    hint: kvstore_pb2.ReuseHint | None,
) -> kvstore_pb2.PutHeader:
    """A put's header, once each block's size (`sizes`, in bytes) matches the layout."""
    expected = layout.bytes_per_block
    for i, nbytes in enumerate(sizes):
        if nbytes != expected:
            raise InvalidArgument(
                f"block {i} is {nbytes} bytes but the layout says {expected} bytes per block "
                f"({layout.num_layers} layers x {layout.block_size_tokens} tokens x {layout.num_kv_heads} heads x "
                f"{layout.head_dim} dims x K/V in {layout.dtype})"
            )
    if not sizes:
        raise InvalidArgument("put needs at least one block")
    if first_block < 0:
        raise InvalidArgument(f"first_block must be >= 0, got {first_block}")
    keys = block_keys(token_ids, block_hashes)
    if token_ids is not None:
        keys.tokens.first_block = first_block
    elif first_block:
        raise InvalidArgument("first_block applies to token_ids; with block_hashes send exactly the blocks' hashes")
    return kvstore_pb2.PutHeader(namespace=namespace_ref(layout), keys=keys, num_blocks=len(sizes), hint=hint)


def _is_cuda(obj: object) -> bool:
    return _is_tensor(obj) and getattr(obj, "is_cuda", False) is True


def host_blocks(blocks: Sequence[Any]) -> Sequence[Any]:
    """`blocks` with CUDA tensors copied to host memory (when the device plane is not in
    use); everything else as given."""
    if not any(_is_cuda(b) for b in blocks):
        return blocks
    return [b.detach().cpu() if _is_cuda(b) else b for b in blocks]


def upload_blocks(blocks: Sequence[Any], dsts: Sequence[Any]) -> None:
    """Copy host blocks (bytes-like) into caller buffers, CUDA tensors included."""
    for i, (src, dst) in enumerate(zip(blocks, dsts)):
        if _is_cuda(dst):
            from kvstore.client.tensors import upload

            upload(src, dst, i)
        else:
            view = writable_view(dst, i, len(memoryview(src)))
            view[:] = memoryview(src).cast("B")


def put_requests(prepared: PreparedPut, chunk_bytes: int) -> Iterator[kvstore_pb2.PutRequest | bytes]:
    """The messages of one Put stream, made lazily as gRPC sends them: a header, then
    each block in chunks, encoded straight from the caller's buffer (see kvstore.wire)."""
    yield kvstore_pb2.PutRequest(header=prepared.header)
    for i, v in enumerate(prepared.views):
        for start in range(0, len(v), chunk_bytes):
            yield encode_chunk(i, v[start : start + chunk_bytes])


# One-trip puts: the most empty slots a client asks the daemon to hold for its next put.
MAX_RESERVE_AHEAD = 1024


@dataclass(slots=True)
class HeldSlots:
    """A daemon-side reservation of empty host slots for this client's next put."""

    reservation_id: str
    offsets: list[int]
    usable_until: float  # monotonic; half the reservation's lifetime, so it never expires mid-copy


def check_reserve_ahead(count: int) -> int:
    if not 0 <= count <= MAX_RESERVE_AHEAD:
        raise InvalidArgument(f"reserve_ahead must be in [0, {MAX_RESERVE_AHEAD}], got {count}")
    return count


def keep_held(held: dict[int, HeldSlots], reservation: kvstore_pb2.SlotReservation) -> None:
    """Remember a reservation the daemon returned (replacing any for that block size)."""
    if reservation.reservation_id:
        held[reservation.block_bytes] = HeldSlots(
            reservation.reservation_id, list(reservation.offsets),
            time.monotonic() + reservation.expires_in_ms / 2000.0)


def take_held(held: dict[int, HeldSlots], block_bytes: int, num_blocks: int) -> tuple[HeldSlots | None, str]:
    """(the reservation to put `num_blocks` blocks in one round trip, if one fits; else
    the id of the one that does not, for the two-trip put to hand back). A reservation
    serves one put either way."""
    slots = held.pop(block_bytes, None)
    if slots is None:
        return None, ""
    if len(slots.offsets) < num_blocks or time.monotonic() >= slots.usable_until:
        return None, slots.reservation_id
    return slots, ""


DATA_PLANES = ("auto", "local", "grpc")
CONTROL_PLANES = ("auto", "lane", "grpc")
# After the lane could not be used, calls go through gRPC; the lane is tried again this
# much later (a daemon restarted, or started without the lane, and so on).
LANE_RETRY_S = 5.0

logger = logging.getLogger(__name__)


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


def check_control_plane(control_plane: str, target: str) -> str:
    if control_plane not in CONTROL_PLANES:
        raise InvalidArgument(f"control_plane must be one of {', '.join(CONTROL_PLANES)}, got {control_plane!r}")
    if control_plane == "lane" and not target.startswith("unix:"):
        raise InvalidArgument(f"control_plane='lane' needs a Unix socket target (unix:PATH), not {target!r}")
    return control_plane


def check_data_plane(data_plane: str) -> str:
    if data_plane not in DATA_PLANES:
        raise InvalidArgument(f"data_plane must be one of {', '.join(DATA_PLANES)}, got {data_plane!r}")
    return data_plane


def may_be_local(target: str) -> bool:
    """Whether `auto` should try the shared-memory plane: a Unix socket or a loopback
    address. The segment's token check decides for sure."""
    if target.startswith("unix:"):
        return True
    host = target.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def out_buffers(out: Sequence[Any] | None, count: int, block_bytes: int) -> list[Any]:
    """Destinations for `count` blocks: the caller's buffers, or new bytearrays."""
    if out is None:
        return [bytearray(block_bytes) for _ in range(count)]
    return list(out[:count])


def writable_view(buf: Any, index: int, block_bytes: int) -> memoryview:
    view = as_buffer(buf)
    if len(view) != block_bytes:
        raise InvalidArgument(f"out[{index}] holds {len(view)} bytes; a block is {block_bytes} bytes")
    if view.readonly:
        raise InvalidArgument(f"out[{index}] is read-only")
    return view


class FetchAssembler:
    """Collects a Fetch stream into whole blocks, optionally into caller buffers.

    With `out`, each chunk is copied straight to its place in the block's buffer as it
    arrives (one copy per byte whatever the chunk size, and no received message is kept
    past its chunk); a buffer past the blocks returned may hold part of a block when the
    stream broke off. Without `out`, a block's chunks are joined into one `bytes`.
    """

    def __init__(self, out: Sequence[Any] | None) -> None:
        self.out = list(out) if out is not None else None
        self.block_bytes = 0
        self.blocks: list[bytes] = []
        self._parts: list[memoryview] = []
        self._index = 0
        self._filled = 0
        self._dst: memoryview | None = None  # the current block's buffer (with `out`)
        self._offset = 0  # bytes of the current block received so far

    def feed(self, msg: kvstore_pb2.FetchResponse | RawChunk) -> None:
        if isinstance(msg, RawChunk):
            block, data = msg.block, msg.data
        elif msg.WhichOneof("msg") == "header":
            self.block_bytes = msg.header.block_bytes
            return
        else:
            block, data = msg.chunk.block, memoryview(msg.chunk.data)
        if block != self._index:
            self._finish_block()
            self._index = block
        end = self._offset + len(data)
        if end > self.block_bytes:
            raise KVStoreError(f"fetched block {self._index} has at least {end} bytes, expected {self.block_bytes}")
        if self.out is None:
            self._parts.append(data)
        else:
            if self._dst is None:
                # fetch_keys() asked for at most len(out) blocks, so there is a buffer for each.
                self._dst = writable_view(self.out[self._filled], self._filled, self.block_bytes)
            self._dst[self._offset : end] = data
        self._offset = end

    def _finish_block(self) -> None:
        if not self._offset and not self._parts:
            return
        if self._offset != self.block_bytes:
            raise KVStoreError(f"fetched block {self._index} has {self._offset} bytes, expected {self.block_bytes}")
        self._offset = 0
        if self.out is None:
            parts, self._parts = self._parts, []
            self.blocks.append(bytes(parts[0]) if len(parts) == 1 else b"".join(parts))
            return
        self._dst = None
        self._filled += 1

    def result(self) -> list[Any]:
        self._finish_block()
        if self.out is None:
            return self.blocks
        return self.out[: self._filled]


def fetch_cut_short(exc: grpc.RpcError) -> bool:
    """Whether a Fetch stream's error only ended it early: DATA_LOSS, a block that failed
    verification on the daemon with no intact copy (it dropped it). The blocks received
    before it verified: they are the fetch's answer, a shorter prefix (a miss is a value)."""
    return exc.code() == grpc.StatusCode.DATA_LOSS


def translate(exc: grpc.RpcError) -> KVStoreError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return translate_status(code, details or "")


def translate_status(code: grpc.StatusCode, details: str) -> KVStoreError:
    """The exception for a failed call's status, whichever transport carried it."""
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"kvstore daemon unavailable: {details}; is it running, and is the target right?"
    return error_for_status(code, details)


def tier_names(tiers: Sequence[Any]) -> list[str]:
    """Tier names of a lookup's blocks. Usually every block sits in one tier: then one
    name repeated, without a dictionary step per block."""
    values: list[Any] = list(tiers)
    if values and values.count(values[0]) == len(values):
        return [TIER_NAMES.get(values[0], "unknown")] * len(values)
    return list(map(TIER_NAMES.get, values, repeat("unknown", len(values))))


_TIER_NAME_BY_VALUE: dict[int, str] = {int(value): name for value, name in TIER_NAMES.items()}


def packed_tier_names(packed: bytes) -> list[str]:
    """Tier names from LookupResponse.tiers_packed (one Tier value per byte): one name
    repeated when every block sits in one tier, found by one C-level count."""
    n = len(packed)
    if n and packed.count(packed[:1]) == n:
        return [_TIER_NAME_BY_VALUE.get(packed[0], "unknown")] * n
    return list(map(_TIER_NAME_BY_VALUE.get, packed, repeat("unknown", n)))


def lookup_request(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
                   lease_ms: int = 0, hint: kvstore_pb2.ReuseHint | None = None,
                   ) -> tuple[kvstore_pb2.LookupRequest, list[bytes] | None]:
    """A Lookup request, and the caller's own hashes when the answer can hand them back as
    they are (a list or tuple of 16-byte bytes objects): the request then asks the daemon
    to leave them out of its answer (LookupRequest.omit_hashes). The packed chain is
    written into the request's keys in place, not copied in from a message of its own."""
    req = kvstore_pb2.LookupRequest(namespace=namespace_ref(layout), lease_ms=lease_ms, hint=hint)
    if token_ids is None and isinstance(block_hashes, (list, tuple)) and _native is not None:
        mine = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        joined = _native.join_hashes(mine)  # None unless each is a 16-byte bytes object
        if joined is not None:
            keys = req.keys
            keys.packed_hashes = joined
            keys.packed_reply = True
            req.omit_hashes = True
            return req, mine
    req.keys.CopyFrom(block_keys(token_ids, block_hashes))
    return req, None


def lookup_result(resp: kvstore_pb2.LookupResponse, mine: list[bytes] | None = None) -> LookupResult:
    """The result of a Lookup. `mine`: the caller's hashes (`lookup_request`), of which the
    hits are the first ones; those very objects are handed back. A daemon that honours
    `omit_hashes` sends none; one that predates it sends them, and they are checked
    against the caller's (one C pass that packs them, one compare)."""
    got = resp.block_hashes_packed
    hashes: list[bytes] | None = None
    if mine is not None:
        n = resp.num_blocks
        if n > len(mine):
            raise Internal(f"the daemon answered {n} hits for a {len(mine)}-block chain")
        # `mine` exists only where the compiled helpers do (`lookup_request`).
        if (not got and not resp.block_hashes) or _native.join_hashes(mine[:n]) == got:
            hashes = mine[:n]
    if hashes is None:
        hashes = response_hashes(resp)
    return LookupResult(
        num_blocks=resp.num_blocks,
        num_tokens=resp.num_tokens,
        tiers=packed_tier_names(resp.tiers_packed) if resp.tiers_packed else tier_names(resp.tiers),
        block_hashes=hashes,
        namespace_id=resp.namespace_id,
        lease_id=resp.lease_id,
    )
