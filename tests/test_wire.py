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
