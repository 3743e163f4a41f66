"""The SDK's Fetch assembly: chunks land straight in the caller's buffers (one copy per
byte whatever the chunk size), blocks come back whole, and a block of the wrong size is
refused."""

from __future__ import annotations

import os

import pytest

from kvstore.client._assembler import FetchAssembler
from kvstore.errors import KVStoreError
from kvstore.v1 import kvstore_pb2
from kvstore.wire import RawChunk


def raw(block: int, data: bytes) -> RawChunk:
    return RawChunk(block, memoryview(data))


def header(block_bytes: int) -> kvstore_pb2.FetchResponse:
    return kvstore_pb2.FetchResponse(header=kvstore_pb2.FetchHeader(num_blocks=2, block_bytes=block_bytes))


def test_the_sdk_writes_each_chunk_straight_into_the_callers_buffer() -> None:
    blocks = [os.urandom(1000) for _ in range(2)]
    out = [bytearray(1000) for _ in range(3)]
    assembler = FetchAssembler(out)
    assembler.feed(header(1000))
    for i, b in enumerate(blocks):
        for start in range(0, 1000, 300):  # four chunks, the last one short
            assembler.feed(raw(i, b[start : start + 300]))
    got = assembler.result()
    assert [bytes(o) for o in got] == blocks and got[0] is out[0] and got[1] is out[1]
    assert out[2] == bytearray(1000)  # no third block: untouched
    # Without buffers: one bytes object per block, joined from its chunks.
    plain = FetchAssembler(None)
    plain.feed(header(1000))
    for i, b in enumerate(blocks):
        plain.feed(raw(i, b[:400]))
        plain.feed(raw(i, b[400:]))
    assert plain.result() == blocks


@pytest.mark.parametrize("with_out", [True, False])
def test_the_sdk_refuses_a_block_of_the_wrong_size(with_out: bool) -> None:
    long = FetchAssembler([bytearray(100)] if with_out else None)
    long.feed(header(100))
    long.feed(raw(0, bytes(60)))
    with pytest.raises(KVStoreError, match="at least 120 bytes, expected 100"):
        long.feed(raw(0, bytes(60)))
    short = FetchAssembler([bytearray(100), bytearray(100)] if with_out else None)
    short.feed(header(100))
    short.feed(raw(0, bytes(60)))
    with pytest.raises(KVStoreError, match="block 0 has 60 bytes, expected 100"):
        short.feed(raw(1, bytes(100)))
