"""Bad input over the wire: each gets its exact gRPC status, and nothing stored changes.

Raw stubs send what the SDK would refuse to build; the SDK is checked to raise the
matching `kvstore.errors` class for the cases it can express.
"""

from __future__ import annotations

import os

import grpc
import pytest

from kvstore import errors
from kvstore.client import AsyncClient
from kvstore.convert import layout_to_proto
from kvstore.layout import KVLayout
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def seeded(daemon, layout):
    """A daemon holding 3 blocks, with a raw stub and an SDK client."""
    tokens = list(range(layout.block_size_tokens * 3))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(3)]
    channel = grpc.aio.insecure_channel(daemon.tcp_target)
    kv = AsyncClient(daemon.tcp_target)
    await kv.put(layout, tokens, blocks)
    try:
        yield kvstore_pb2_grpc.KVStoreStub(channel), admin_pb2_grpc.AdminStub(channel), kv, tokens, blocks
    finally:
        await kv.close()
        await channel.close()


async def snapshot(admin, kv, layout, tokens):
    stats = await admin.Stats(admin_pb2.StatsRequest())
    host = next(t for t in stats.tiers if t.name == "host")
    return host.used_bytes, host.blocks, await kv.fetch(layout, tokens)


def ns(layout: KVLayout) -> kvstore_pb2.Namespace:
    return kvstore_pb2.Namespace(layout=layout_to_proto(layout))


def token_keys(tokens: list[int]) -> kvstore_pb2.BlockKeys:
    return kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))


def hash_keys(hashes: list[bytes]) -> kvstore_pb2.BlockKeys:
    return kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=hashes))


async def expect_status(code: grpc.StatusCode, call, match: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()
    return info.value.details()


def put_stream(header: kvstore_pb2.PutHeader | None, chunks: list[tuple[int, bytes]]):
    msgs = [kvstore_pb2.PutRequest(header=header)] if header is not None else []
    msgs += [kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=b, data=d)) for b, d in chunks]
    return iter(msgs)


async def test_wrong_block_size_for_the_namespace(seeded, layout):
    stub, admin, kv, tokens, _ = seeded
    before = await snapshot(admin, kv, layout, tokens)
    new_tokens = list(range(1000, 1000 + layout.block_size_tokens * 2))
    header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=token_keys(new_tokens), num_blocks=2)
    short = [(0, os.urandom(layout.bytes_per_block)), (1, os.urandom(layout.bytes_per_block - 1))]
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_stream(header, short)), "bytes")
    long = [(0, os.urandom(layout.bytes_per_block + 1))]
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_stream(header, long)), "check the layout")
    assert await snapshot(admin, kv, layout, tokens) == before
    assert (await kv.lookup(layout, new_tokens)).num_blocks == 0
    with pytest.raises(errors.InvalidArgument, match="bytes per block"):
        await kv.put(layout, new_tokens, [b"x" * 7, b"y" * 7])


async def test_unknown_namespace_id(seeded, layout):
    stub, admin, kv, tokens, _ = seeded
    before = await snapshot(admin, kv, layout, tokens)
    unknown = kvstore_pb2.Namespace(id=b"\x07" * 16)
    await expect_status(grpc.StatusCode.NOT_FOUND,
                        stub.Lookup(kvstore_pb2.LookupRequest(namespace=unknown, keys=token_keys(tokens))), "not known")
    fetch = stub.Fetch(kvstore_pb2.FetchRequest(namespace=unknown, keys=token_keys(tokens)))
    await expect_status(grpc.StatusCode.NOT_FOUND, fetch.read(), "send the full layout")
    assert await snapshot(admin, kv, layout, tokens) == before


async def test_known_namespace_id_works_without_layout(seeded, layout):
    stub, _, _, tokens, _ = seeded
    by_id = kvstore_pb2.Namespace(id=layout.namespace_id)
    resp = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=by_id, keys=token_keys(tokens)))
    assert resp.num_blocks == 3


async def test_malformed_hashes(seeded, layout):
    stub, admin, kv, tokens, _ = seeded
    before = await snapshot(admin, kv, layout, tokens)
    bad = hash_keys([b"\x01" * 16, b"\x02" * 15])
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                        stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=bad)), "block hash 1 is 15 bytes")
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                        stub.Delete(kvstore_pb2.DeleteRequest(namespace=ns(layout), keys=bad)), "16 bytes")
    header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=bad)
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_stream(header, [])), "16 bytes")
    assert await snapshot(admin, kv, layout, tokens) == before


async def test_empty_requests(seeded, layout):
    stub, admin, kv, tokens, _ = seeded
    before = await snapshot(admin, kv, layout, tokens)
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Lookup(kvstore_pb2.LookupRequest()), "no namespace")
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                        stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout))), "names no blocks")
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(iter([])), "must start with a header")
    header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=hash_keys([]))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_stream(header, [])), "at least one block")
    # An empty token list is a valid lookup with nothing to find: a miss, not an error.
    resp = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=token_keys([])))
    assert resp.num_blocks == 0
    assert await snapshot(admin, kv, layout, tokens) == before


async def test_put_without_data_fails_cleanly(seeded, layout):
    stub, admin, kv, tokens, _ = seeded
    before = await snapshot(admin, kv, layout, tokens)
    new_tokens = list(range(5000, 5000 + layout.block_size_tokens))
    header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=token_keys(new_tokens), num_blocks=1)
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_stream(header, [])),
                        "the stream ended after 0 of the 1 blocks")
    assert await snapshot(admin, kv, layout, tokens) == before


async def test_chunks_out_of_order_or_out_of_range(seeded, layout):
    stub, admin, kv, tokens, _ = seeded
    before = await snapshot(admin, kv, layout, tokens)
    new_tokens = list(range(7000, 7000 + layout.block_size_tokens * 2))
    header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=token_keys(new_tokens), num_blocks=2)
    full = os.urandom(layout.bytes_per_block)
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                        stub.Put(put_stream(header, [(1, full), (0, full)])), "block 0 is missing")
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                        stub.Put(put_stream(header, [(0, full), (1, full), (2, full)])),
                        "the header names 2 blocks")
    second_header = kvstore_pb2.PutRequest(header=header)
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                        stub.Put(iter([second_header, second_header])), "a second header")
    assert await snapshot(admin, kv, layout, tokens) == before


async def test_put_range_beyond_tokens(seeded, layout):
    stub, admin, kv, tokens, _ = seeded
    header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=token_keys(tokens[:5]), num_blocks=3)
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_stream(header, [])), "full blocks")


async def test_too_many_blocks_in_one_call(tmp_path, layout):
    from dataclasses import replace

    from conftest import make_config

    from kvstore.server.daemon import Daemon

    d = Daemon(replace(make_config(tmp_path), max_blocks_per_call=4))
    await d.start()
    try:
        async with grpc.aio.insecure_channel(d.bound[1]) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            tokens = list(range(layout.block_size_tokens * 5))
            await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                                stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=token_keys(tokens))),
                                "the limit is 4")
            hashes = hash_keys([os.urandom(16) for _ in range(5)])
            await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                                stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=hashes)), "split")
            header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=token_keys(tokens), num_blocks=5)
            await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_stream(header, [])), "limit is 4")
            async with AsyncClient(d.bound[1]) as kv:
                with pytest.raises(errors.InvalidArgument, match="limit is 4"):
                    await kv.lookup(layout, tokens)
    finally:
        await d.stop(grace_s=0)


async def test_oversized_message_is_refused(seeded, layout):
    stub, admin, kv, tokens, _ = seeded
    before = await snapshot(admin, kv, layout, tokens)
    big = kvstore_pb2.LookupRequest(namespace=ns(layout), keys=token_keys(list(range(5_000_000))))
    await expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Lookup(big))
    assert await snapshot(admin, kv, layout, tokens) == before


async def test_bad_layouts(seeded, layout):
    stub, admin, kv, tokens, _ = seeded
    bad = kvstore_pb2.Layout(model="m", dtype="float13", num_layers=1, num_kv_heads=1, head_dim=8, block_size_tokens=4)
    req = kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(layout=bad), keys=token_keys([1, 2, 3, 4]))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Lookup(req), "give block_bytes explicitly")
    zero = kvstore_pb2.Layout(model="m", dtype="float16", num_layers=0, num_kv_heads=1, head_dim=8, block_size_tokens=4)
    req = kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(layout=zero), keys=token_keys([1, 2, 3, 4]))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, stub.Lookup(req), "num_layers")


async def test_layout_change_never_matches_old_blocks(seeded, layout):
    _, _, kv, tokens, _ = seeded
    fields = {k: getattr(layout, k) for k in KVLayout.__dataclass_fields__ if not k.startswith("_")}
    other = KVLayout(**{**fields, "num_layers": layout.num_layers * 2})
    assert (await kv.lookup(other, tokens)).num_blocks == 0
    assert await kv.fetch(other, tokens) == []


async def test_unknown_info_section(seeded):
    _, admin, _, _, _ = seeded
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, admin.Info(admin_pb2.InfoRequest(section="bogus")),
                        "unknown info section")


async def test_unpin_of_unknown_lease_is_not_an_error(seeded):
    stub, _, _, _, _ = seeded
    assert (await stub.Unpin(kvstore_pb2.UnpinRequest(lease_id="nope"))).released is False


async def test_packed_token_ids(seeded, layout):
    import struct

    stub, admin, kv, tokens, _ = seeded
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    keys = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(packed_u32le=packed))
    resp = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=keys))
    assert resp.num_blocks == 3  # the same blocks as the repeated form named
    both = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(packed_u32le=packed, token_ids=tokens))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                        stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=both)), "not both")
    odd = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(packed_u32le=packed[:-1]))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                        stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=odd)), "multiple of 4")
