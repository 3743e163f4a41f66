"""Request building: the messages the SDK sends, checked before anything is sent.

Keys go packed: block hashes as one N x 16-byte string (`pack_hashes`, one C call),
token ids as little-endian u32 (`pack_tokens`), and every request asks for the answer's
hashes packed too (`BlockKeys.packed_reply`). The Namespace message of a layout is made
once and shared (`namespace_ref`). A put is validated as a whole (`prepare_put`: every
block's size against the layout) and streamed lazily from the caller's buffers
(`put_requests`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.client._buffers import as_buffer
from kvstore.convert import TIER_BY_NAME, layout_to_proto
from kvstore.errors import InvalidArgument
from kvstore.hashing import HASH_BYTES, token_bytes
from kvstore.layout import KVLayout
from kvstore.native import native as _native
from kvstore.v1 import kvstore_pb2
from kvstore.wire import PUT_END, encode_chunk

# vLLM's integer block hashes are the low 64 bits of its hash (maybe_convert_block_hash).
ENGINE_INT_BITS = 64
ENGINE_NAME_MAX_BYTES = 64


@dataclass(frozen=True, slots=True)
class EngineNames:
    """What the engine calls the blocks of a put: vLLM's block hashes. The daemon's KV
    events in vLLM's format (docs/operations.md) carry them instead of kvstore's own
    hashes, so a router keyed by the engine's hashes matches the blocks.

    `hashes`: one per block of the put, all integers (unsigned 64-bit, as vLLM publishes
    them by default) or all bytes (1..64 each). `parent`: the name of the block before the
    first (None: the chain starts here, or it is not known). `lora_name`: the LoRA
    adapter's name, as the engine's events give it. `token_ids`: for a put keyed by
    `block_hashes`, the blocks' token ids (block_size_tokens each), which the events then
    carry; a put keyed by token ids sends its tokens already."""

    hashes: Sequence[int | bytes]
    parent: int | bytes | None = None
    lora_name: str | None = None
    token_ids: Sequence[int] | None = None


def _engine_name(value: Any, integers: bool, what: str) -> bytes:
    if integers:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << ENGINE_INT_BITS:
            raise InvalidArgument(f"{what} must be an integer in [0, 2**64) like the other names, got {value!r}")
        return value.to_bytes(8, "big")
    if not isinstance(value, (bytes, bytearray)) or not 1 <= len(value) <= ENGINE_NAME_MAX_BYTES:
        raise InvalidArgument(f"{what} must be 1..{ENGINE_NAME_MAX_BYTES} bytes like the other names, got {value!r}")
    return bytes(value)


def engine_names_message(names: EngineNames, num_blocks: int, keyed_by_tokens: bool,
                         block_size_tokens: int) -> kvstore_pb2.EngineNames:
    """`names` as the put header's field, checked against the put's `num_blocks`."""
    if not isinstance(names, EngineNames):
        raise InvalidArgument(f"engine_names must be an EngineNames, got {type(names).__name__}")
    hashes = list(names.hashes)
    if len(hashes) != num_blocks:
        raise InvalidArgument(f"engine_names has {len(hashes)} hashes for a put of {num_blocks} blocks; "
                              "give one per block")
    integers = bool(hashes) and isinstance(hashes[0], int) and not isinstance(hashes[0], bool)
    msg = kvstore_pb2.EngineNames(names=[_engine_name(h, integers, f"engine_names.hashes[{i}]")
                                         for i, h in enumerate(hashes)], integers=integers)
    if names.parent is not None:
        msg.parent = _engine_name(names.parent, integers, "engine_names.parent")
    if names.lora_name:
        msg.lora_name = names.lora_name
    if names.token_ids is not None:
        if keyed_by_tokens:
            raise InvalidArgument("engine_names.token_ids is for a put keyed by block_hashes; this put sends its "
                                  "token ids already")
        packed = pack_tokens(names.token_ids)
        if len(packed) != num_blocks * block_size_tokens * 4:
            raise InvalidArgument(f"engine_names.token_ids has {len(packed) // 4} tokens; {num_blocks} blocks of "
                                  f"{block_size_tokens} tokens need {num_blocks * block_size_tokens}")
        msg.token_ids_packed = packed
    return msg


def reuse_hint(session_id: str | None, expect_reuse_within_s: float | None) -> kvstore_pb2.ReuseHint | None:
    """The hint message for a call, or None; both parts or neither."""
    if session_id is None and expect_reuse_within_s is None:
        return None
    if not session_id or expect_reuse_within_s is None:
        raise InvalidArgument("a reuse hint needs both session_id and expect_reuse_within_s")
    return kvstore_pb2.ReuseHint(session_id=session_id, expect_reuse_within_s=float(expect_reuse_within_s))


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


def prefetch_request(
    layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None, tier: str
) -> kvstore_pb2.PrefetchRequest:
    if tier and tier not in TIER_BY_NAME:
        raise InvalidArgument(f"unknown tier {tier!r}; use one of {', '.join(TIER_BY_NAME)} or '' for the top tier")
    return kvstore_pb2.PrefetchRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                       tier=TIER_BY_NAME.get(tier, kvstore_pb2.TIER_UNSPECIFIED))


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
    engine_names: EngineNames | None = None,
) -> PreparedPut:
    """Convert and size-check every block before anything is sent."""
    views = [as_buffer(b) for b in blocks]
    header = put_header(layout, token_ids, block_hashes, [len(v) for v in views], first_block, hint, engine_names)
    return PreparedPut(header, views)


def device_put_header(
    layout: KVLayout,
    token_ids: Sequence[int] | None,
    block_hashes: Sequence[bytes] | None,
    blocks: Sequence[Any],
    first_block: int,
    hint: kvstore_pb2.ReuseHint | None = None,
    engine_names: EngineNames | None = None,
) -> kvstore_pb2.PutHeader:
    """The header of a put of CUDA tensors (the device plane), size-checked like `prepare_put`."""
    sizes = [b.numel() * b.element_size() for b in blocks]
    return put_header(layout, token_ids, block_hashes, sizes, first_block, hint, engine_names)


def put_header(
    layout: KVLayout,
    token_ids: Sequence[int] | None,
    block_hashes: Sequence[bytes] | None,
    sizes: Sequence[int],
    first_block: int,
    hint: kvstore_pb2.ReuseHint | None,
    engine_names: EngineNames | None = None,
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
    header = kvstore_pb2.PutHeader(namespace=namespace_ref(layout), keys=keys, num_blocks=len(sizes), hint=hint)
    if engine_names is not None:
        header.engine_names.CopyFrom(engine_names_message(engine_names, len(sizes), token_ids is not None,
                                                          layout.block_size_tokens))
    return header


def put_requests(prepared: PreparedPut, chunk_bytes: int) -> Iterator[kvstore_pb2.PutRequest | bytes]:
    """The messages of one Put stream, made lazily as gRPC sends them: a header, then
    each block in chunks, encoded straight from the caller's buffer (see kvstore.wire),
    then the explicit end that alone commits it (`PutHeader.explicit_end`: a put this
    client cancels before its last message is never stored, whatever its library sends)."""
    prepared.header.explicit_end = True
    yield kvstore_pb2.PutRequest(header=prepared.header)
    for i, v in enumerate(prepared.views):
        for start in range(0, len(v), chunk_bytes):
            yield encode_chunk(i, v[start : start + chunk_bytes])
    yield PUT_END
