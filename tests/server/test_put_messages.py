"""A malformed Put stream is refused with a message that says what is wrong with it.

Raw stubs send what a client written from the proto alone might: chunks out of order, a
skipped block, a stream that ends early, a block with too many bytes, a block index
past the header's count, a chunk sent twice, a second header. Each is INVALID_ARGUMENT
naming the mistake (and nothing of the put is stored).
"""

from __future__ import annotations

import os

import grpc
import pytest

from kvstore.convert import layout_to_proto
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

pytestmark = pytest.mark.asyncio

BLOCKS = 3


@pytest.fixture
async def stub(daemon):
    async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
        yield kvstore_pb2_grpc.KVStoreStub(channel)


def header(layout, n: int = BLOCKS) -> kvstore_pb2.PutRequest:
    tokens = list(range(n * layout.block_size_tokens))
    keys = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))
    ns = kvstore_pb2.Namespace(layout=layout_to_proto(layout))
    return kvstore_pb2.PutRequest(header=kvstore_pb2.PutHeader(namespace=ns, keys=keys))


def chunk(block: int, nbytes: int) -> kvstore_pb2.PutRequest:
    return kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=block, data=os.urandom(nbytes)))


async def refused(stub, layout, msgs: list[kvstore_pb2.PutRequest]) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Put(iter(msgs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    ns = kvstore_pb2.Namespace(layout=layout_to_proto(layout))
    keys = header(layout).header.keys
    assert (await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns, keys=keys))).num_blocks == 0
    return info.value.details() or ""


async def test_chunks_out_of_order(stub, layout):
    full, half = layout.bytes_per_block, layout.bytes_per_block // 2
    message = await refused(stub, layout, [header(layout), chunk(0, full), chunk(1, half), chunk(0, half)])
    assert "out of order" in message and "block 0" in message and "block 1" in message


async def test_a_skipped_block(stub, layout):
    full = layout.bytes_per_block
    message = await refused(stub, layout, [header(layout), chunk(0, full), chunk(2, full)])
    assert "block 1 is missing" in message


async def test_a_block_cut_short_before_the_next_one(stub, layout):
    full, half = layout.bytes_per_block, layout.bytes_per_block // 2
    message = await refused(stub, layout, [header(layout), chunk(0, half), chunk(1, full)])
    assert f"block 0 got {half} of its {full} bytes before a chunk for block 1" in message


async def test_a_stream_that_ends_early(stub, layout):
    full, half = layout.bytes_per_block, layout.bytes_per_block // 2
    message = await refused(stub, layout, [header(layout), chunk(0, full), chunk(1, full)])
    assert "the stream ended after 2 of the 3 blocks" in message
    message = await refused(stub, layout, [header(layout), chunk(0, full), chunk(1, half)])
    assert f"the stream ended inside block 1 ({half} of its {full} bytes)" in message
    message = await refused(stub, layout, [header(layout)])
    assert "the stream ended after 0 of the 3 blocks" in message


async def test_too_many_bytes_for_a_block(stub, layout):
    full = layout.bytes_per_block
    message = await refused(stub, layout, [header(layout), chunk(0, full // 2), chunk(0, full // 2 + 1)])
    assert f"block 0 got {full + 1} bytes" in message and f"holds {full}" in message
    assert "check the layout" in message


async def test_a_block_index_beyond_the_header(stub, layout):
    full = layout.bytes_per_block
    message = await refused(stub, layout, [header(layout), chunk(0, full), chunk(1, full), chunk(2, full),
                                           chunk(3, full)])
    assert "block 3" in message and "the header names 3 blocks (0 to 2)" in message


async def test_a_duplicate_chunk(stub, layout):
    full = layout.bytes_per_block
    message = await refused(stub, layout, [header(layout), chunk(0, full), chunk(0, full)])
    assert "block 0 already has all its" in message and "sent twice" in message


async def test_a_second_header(stub, layout):
    message = await refused(stub, layout, [header(layout), header(layout)])
    assert "a second header" in message


async def test_a_chunk_before_the_header(stub, layout):
    message = await refused(stub, layout, [chunk(0, layout.bytes_per_block)])
    assert "must start with a header" in message
