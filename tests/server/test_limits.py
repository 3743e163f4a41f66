"""Input limits against the real daemon: each violation answers a precise status and
leaves the store as it was."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from conftest import daemon_in_thread, make_config

from kvstore.client import Client
from kvstore.convert import layout_to_proto
from kvstore.layout import KVLayout
from kvstore.server.daemon import Daemon
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc


def _ns(layout: KVLayout) -> kvstore_pb2.Namespace:
    return kvstore_pb2.Namespace(layout=layout_to_proto(layout))


def _snapshot(store) -> tuple[int, int, int]:
    s = store.stats()
    return (sum(t.blocks for t in s.tiers), sum(t.used_bytes for t in s.tiers), len(store.namespaces()))


def test_too_many_tokens_in_one_call(tmp_path, layout):
    with daemon_in_thread(make_config(tmp_path, max_tokens_per_call=64)) as running, \
            Client(running.unix_target, data_plane="grpc") as kv:
        kv.put(layout, list(range(16)), [b"\1" * layout.bytes_per_block] * 4)
        before = _snapshot(running.store)
        from kvstore.errors import InvalidArgument

        with pytest.raises(InvalidArgument, match="65 token ids in one call; the limit is max_tokens_per_call = 64"):
            kv.lookup(layout, list(range(65)))
        with pytest.raises(InvalidArgument, match="max_tokens_per_call"):
            kv.put(layout, list(range(68)), [b"\2" * layout.bytes_per_block] * 17)
        assert _snapshot(running.store) == before
        assert kv.lookup(layout, list(range(64))).num_blocks == 4


def test_blocks_larger_than_max_block_bytes_are_refused(tmp_path, layout):
    big = replace(layout, block_bytes=2 << 20)
    with daemon_in_thread(make_config(tmp_path, max_block_bytes=1 << 20)) as running, \
            Client(running.unix_target, data_plane="grpc") as kv:
        before = _snapshot(running.store)
        from kvstore.errors import InvalidArgument

        with pytest.raises(InvalidArgument, match="2097152 bytes per block, more than max_block_bytes"):
            kv.lookup(big, list(range(8)))
        assert _snapshot(running.store) == before  # not even the namespace was registered
        # The servicer remembers only layouts that passed its checks: a refused one is
        # refused again, however often it is sent, while an accepted one keeps its id.
        for _ in range(2):
            with pytest.raises(InvalidArgument, match="more than max_block_bytes"):
                kv.lookup(big, list(range(8)))
        kv.put(layout, list(range(8)), [bytes(layout.bytes_per_block)] * 2)  # a put registers an accepted layout
        first = kv.lookup(layout, list(range(8))).namespace_id
        assert kv.lookup(layout, list(range(8))).namespace_id == first
        assert len(running.store.namespaces()) == before[2] + 1


def test_a_message_over_max_message_bytes_is_resource_exhausted(tmp_path):
    layout = KVLayout(model="test/big", dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=1,
                      block_size_tokens=4, block_bytes=2 << 20)
    cfg = make_config(tmp_path, max_message_bytes=1 << 20, chunk_bytes=256 << 10)
    with daemon_in_thread(cfg) as running, grpc.insecure_channel(
        running.unix_target, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        before = _snapshot(running.store)
        header = kvstore_pb2.PutHeader(
            namespace=_ns(layout), keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=[1, 2, 3, 4]))
        )
        messages = [
            kvstore_pb2.PutRequest(header=header),
            kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=0, data=b"\0" * (2 << 20))),
        ]
        with pytest.raises(grpc.RpcError) as err:
            stub.Put(iter(messages))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        blocks, used, _ = _snapshot(running.store)
        assert (blocks, used) == before[:2]
        lookup = stub.Lookup(kvstore_pb2.LookupRequest(
            namespace=_ns(layout), keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=[1, 2, 3, 4]))))
        assert lookup.num_blocks == 0


async def test_calls_in_flight_per_tenant_are_capped(tmp_path, layout):
    d = Daemon(make_config(tmp_path, max_calls_per_tenant=2))
    await d.start()
    try:
        async with grpc.aio.insecure_channel(d.bound[0]) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            header = kvstore_pb2.PutHeader(
                namespace=_ns(layout), keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=list(range(4))))
            )
            # Two puts left open (header sent, no blocks yet) hold two calls in flight.
            open_puts = [stub.Put() for _ in range(2)]
            for call in open_puts:
                await call.write(kvstore_pb2.PutRequest(header=header))
            while d.auth.in_flight.get("default", 0) < 2:  # wait until both reached the server
                await asyncio.sleep(0.01)
            lookup = kvstore_pb2.LookupRequest(
                namespace=_ns(layout), keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=list(range(4))))
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(lookup)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 calls in flight" in err.value.details() and "max_calls_per_tenant" in err.value.details()
            for call in open_puts:
                call.cancel()
            while d.auth.in_flight.get("default", 0):
                await asyncio.sleep(0.01)
            assert (await stub.Lookup(lookup)).num_blocks == 0
            assert d.store.stats().counters.blocks_stored == 0
    finally:
        await d.stop(grace_s=0)



def test_max_tokens_per_call_changes_live(tmp_path, layout):
    from kvstore.client.admin import AdminClient
    from kvstore.errors import InvalidArgument

    with daemon_in_thread(make_config(tmp_path)) as running, \
            Client(running.unix_target, data_plane="grpc") as kv, AdminClient(running.unix_target) as admin:
        assert kv.lookup(layout, list(range(64))).num_blocks == 0
        admin.set_config("max_tokens_per_call", "32")
        with pytest.raises(InvalidArgument, match="max_tokens_per_call = 32"):
            kv.lookup(layout, list(range(64)))
