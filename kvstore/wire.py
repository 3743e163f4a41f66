"""Hand-coded protobuf wire format for block chunks: the payload-carrying messages of
Put and Fetch, without the copies the generic protobuf runtime makes.

A chunk is `PutRequest{chunk: BlockChunk{block, data}}` (field 2) or
`FetchResponse{chunk: ...}` (field 2). This module writes exactly the bytes protobuf
would, straight from a memoryview (one copy instead of two), and reads them back as a
zero-copy view of the received message. Anything that is not a plain chunk — headers,
messages from other encoders that order fields differently or add unknown ones — falls
back to the generated classes, so the wire contract stays the .proto file's.

Primitives: `encode_chunk`, `decode_chunk`, and the (de)serializers that plug them into
gRPC for the Put and Fetch methods (`put_request_*`, `fetch_response_*`); `Framed`, what a
framer makes of a block for a fetch stream (kvstore.core.fetch), and `copy_frame`, the
plain one; `varint`, for other hand-written messages (the pool's lookup requests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.v1 import kvstore_pb2

CHUNK_FIELD = 2  # `chunk` in both PutRequest and FetchResponse
_CHUNK_TAG = bytes([CHUNK_FIELD << 3 | 2])
_BLOCK_TAG = b"\x08"  # BlockChunk.block, varint
_DATA_TAG = b"\x12"  # BlockChunk.data, length-delimited


@dataclass(frozen=True, slots=True)
class Framed:
    """A block made into messages; `payload` views, in order, cover exactly its bytes.
    `checksum`: the payload's, where the framing took it while copying (else None)."""

    messages: list[bytes]
    payload: list[memoryview]
    checksum: int | None = None


def copy_frame(index: int, data: memoryview) -> Framed:
    """One message: a plain copy of the block."""
    copy = bytes(data)
    return Framed([copy], [memoryview(copy)])


@dataclass(frozen=True, slots=True)
class RawChunk:
    """A decoded chunk: `data` is a view into the received message, not a copy."""

    block: int
    data: memoryview


def varint(n: int) -> bytes:
    """`n` as a protobuf base-128 varint (what a message's lengths and tags are written in)."""
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode_chunk(block: int, data: bytes | memoryview) -> bytes:
    """The wire bytes of a chunk message (PutRequest or FetchResponse: same layout).

    Like protobuf, fields holding their default (block 0, empty data) are left out."""
    return chunk_prefix(block, len(data)) + data


def chunk_prefix(block: int, size: int) -> bytes:
    """The bytes of a chunk message before its `size` bytes of data."""
    inner = (_BLOCK_TAG + varint(block) if block else b"") + (_DATA_TAG + varint(size) if size else b"")
    return b"".join((_CHUNK_TAG, varint(len(inner) + size), inner))


def decode_chunk(raw: bytes) -> RawChunk | None:
    """The chunk in `raw` if it is a plain chunk message, else None (use the generic parser)."""
    try:
        if raw[:1] != _CHUNK_TAG:
            return None
        length, pos = _read_varint(raw, 1)
        if pos + length != len(raw):
            return None
        block = 0
        if raw[pos : pos + 1] == _BLOCK_TAG:
            block, pos = _read_varint(raw, pos + 1)
        if raw[pos : pos + 1] != _DATA_TAG:
            return None
        size, pos = _read_varint(raw, pos + 1)
        if pos + size != len(raw):
            return None
        return RawChunk(block, memoryview(raw)[pos:])
    except ValueError:
        return None


# The last message of a Put stream whose header sets `explicit_end`: its commit.
PUT_END = kvstore_pb2.PutRequest(end=kvstore_pb2.PutEnd()).SerializeToString()


def put_request_serializer(msg: kvstore_pb2.PutRequest | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def put_request_deserializer(raw: bytes) -> kvstore_pb2.PutRequest | RawChunk:
    return decode_chunk(raw) or kvstore_pb2.PutRequest.FromString(raw)


def fetch_response_serializer(msg: kvstore_pb2.FetchResponse | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def fetch_response_deserializer(raw: bytes) -> kvstore_pb2.FetchResponse | RawChunk:
    return decode_chunk(raw) or kvstore_pb2.FetchResponse.FromString(raw)


PUT_METHOD = "/kvstore.v1.KVStore/Put"
FETCH_METHOD = "/kvstore.v1.KVStore/Fetch"

_HANDLER_MAKERS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_kvstore_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register a KVStore servicer like the generated helper does, but with the chunk
    fast path on Put's requests and Fetch's responses. Built from the service descriptor,
    so every RPC in the .proto is served."""
    service = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(kvstore_pb2, method.input_type.name)
        response_cls = getattr(kvstore_pb2, method.output_type.name)
        deserializer: Callable[[bytes], Any] = request_cls.FromString
        serializer: Callable[[Any], bytes] = response_cls.SerializeToString
        if method.name == "Put":
            deserializer = put_request_deserializer
        elif method.name == "Fetch":
            serializer = fetch_response_serializer
        make = _HANDLER_MAKERS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=deserializer,
                                     response_serializer=serializer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
