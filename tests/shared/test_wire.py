"""The hand-coded chunk encoding is byte-for-byte protobuf's, and decodes what protobuf writes."""

from __future__ import annotations

import os

import pytest

from kvstore.v1 import kvstore_pb2
from kvstore.wire import RawChunk, decode_chunk, encode_chunk


@pytest.mark.parametrize("block", [0, 1, 127, 128, 300, 2**32 - 1])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 16384, 1 << 20])
def test_encoding_matches_protobuf_and_round_trips(block, size):
    data = os.urandom(size)
    for cls in (kvstore_pb2.PutRequest, kvstore_pb2.FetchResponse):
        expected = cls(chunk=kvstore_pb2.BlockChunk(block=block, data=data)).SerializeToString()
        assert encode_chunk(block, memoryview(data)) == expected
        got = decode_chunk(expected)
        if size:
            assert isinstance(got, RawChunk) and got.block == block and bytes(got.data) == data
        else:  # no data field at all: left to the generic parser
            assert got is None
        assert cls.FromString(encode_chunk(block, data)).chunk.data == data


def test_anything_else_falls_back_to_the_generic_parser():
    header = kvstore_pb2.PutRequest(header=kvstore_pb2.PutHeader(num_blocks=3)).SerializeToString()
    assert decode_chunk(header) is None
    # Fields in another order (data before block): valid protobuf, not the fast form.
    odd = b"\x12" + bytes([2 + 2 + 2]) + b"\x12\x02hi" + b"\x08\x05"
    assert decode_chunk(odd) is None
    assert kvstore_pb2.PutRequest.FromString(odd).chunk.block == 5
    trailing = encode_chunk(1, b"abc") + b"\x18\x01"  # an unknown field after the chunk
    assert decode_chunk(trailing) is None
    assert decode_chunk(b"") is None and decode_chunk(b"\x12\xff") is None


@pytest.mark.parametrize("size, chunk", [(0, 1 << 20), (1, 7), (100_000, 30_001), (1 << 20, 1 << 20), (3 << 20, 1 << 20)])
def test_compiled_framing_matches_the_python_framing(size, chunk, monkeypatch):
    """A block framed for a Fetch: the compiled copy-and-hash gives the same messages as
    encoding each chunk in Python, and the checksum of the payload inside them."""
    import kvstore.server.servicer
    from kvstore.checksum import checksum
    from kvstore.native import XXH3
    from kvstore.server.servicer import KVStoreServicer

    assert XXH3
    data = memoryview(os.urandom(size))
    servicer = KVStoreServicer.__new__(KVStoreServicer)  # `_frame` reads chunk_bytes only
    servicer.chunk_bytes = chunk
    compiled = servicer._frame(9, data)
    monkeypatch.setattr(kvstore.server.servicer, "XXH3", False)
    python = servicer._frame(9, data)
    assert compiled.messages == python.messages
    assert [bytes(p) for p in compiled.payload] == [bytes(p) for p in python.payload]
    assert b"".join(bytes(p) for p in compiled.payload) == bytes(data)
    assert python.checksum is None
    assert compiled.checksum == (checksum(bytes(data)) if size else None)  # an empty block: no message
    for message in compiled.messages:
        assert kvstore_pb2.FetchResponse.FromString(message).chunk.block == 9


def test_compiled_framing_refuses_mismatched_prefixes():
    from kvstore.native import native

    with pytest.raises(ValueError, match="2 prefixes for 3 pieces"):
        native.frame_copy([b"", b""], b"x" * 9, 3)
    with pytest.raises(ValueError, match="chunk must be positive"):
        native.frame_copy([b""], b"x", 0)
    with pytest.raises(TypeError):
        native.frame_copy([1], b"x", 1)
