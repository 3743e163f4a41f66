"""Layouts with KV groups on every data plane, against a real daemon: parts put on gRPC
bytes, the shared-memory plane or the data lane come back byte-identical on each of
them (sync and asyncio), each plane is the one that moved the bytes, and a part
corrupted in the daemon's memory makes the whole prefix a miss on every plane, never a
partial block."""

from __future__ import annotations

import os

import grpc
import pytest

from kvstore.client import AsyncClient, Client, GroupKind, KVGroup, KVLayout
from kvstore.convert import layout_to_proto
from kvstore.groups import needed, part_order
from kvstore.shm import AttachedSegment
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

BST = 4
HYBRID = KVLayout(
    model="test/planes-hybrid", dtype="bfloat16", num_layers=3, num_kv_heads=1, head_dim=8, block_size_tokens=BST,
    groups=(
        KVGroup("full", GroupKind.FULL, "bfloat16", (2, 1, BST, 1, 8)),
        KVGroup("swa", GroupKind.SLIDING_WINDOW, "bfloat16", (2, 1, BST, 1, 8), window_tokens=9),
        KVGroup("idx_scale", GroupKind.AUXILIARY, "float32", (BST, 3)),
        KVGroup("ssm", GroupKind.STATE, "float32", (40,)),
    ),
)
PLANES = ("grpc", "local", "lane")


def blocks_for(layout: KVLayout, n: int) -> list[dict[str, bytes]]:
    return [{g.name: os.urandom(g.bytes_per_block) for g in layout.groups} for _ in range(n)]


def expected(layout: KVLayout, blocks: list[dict[str, bytes]], n: int) -> list[dict[str, bytes]]:
    out: list[dict[str, bytes]] = [{} for _ in range(n)]
    for need in needed(layout, n):
        name = layout.groups[need.group].name
        for j in range(need.start, need.stop):
            out[j][name] = blocks[j][name]
    return out


def as_bytes(got: list[dict[str, object]]) -> list[dict[str, bytes]]:
    return [{k: bytes(v) for k, v in block.items()} for block in got]  # type: ignore[call-overload]


def target(running, plane: str) -> str:
    return running.tcp_target if plane == "lane" else running.unix_target


def test_parts_put_on_each_plane_come_back_identical_on_every_plane(daemon_thread):
    counters = daemon_thread.store.counters
    for k, put_plane in enumerate(PLANES):
        tokens = list(range(1000 * k, 1000 * k + BST * 7))
        blocks = blocks_for(HYBRID, 7)
        local_in, bytes_in = counters.local_bytes_in, counters.bytes_in
        with Client(target(daemon_thread, put_plane), data_plane=put_plane) as kv:
            assert kv.data_plane_in_use == put_plane
            result = kv.put(HYBRID, tokens, blocks)
            assert (result.stored, result.existing) == (7, 0)
            lane = kv.data_lane_stats
            lane_sent = lane.bytes_sent if lane is not None else 0
        parts = sum(HYBRID.groups[g].bytes_per_block for g, _ in part_order(HYBRID, 7))
        assert counters.bytes_in - bytes_in == parts
        # The plane asked for is the one that moved the parts: bytes the daemon did not
        # receive in gRPC messages (counted apart, as its metrics do: shared memory and
        # the lane), and of those, what the client sent on the lane.
        assert counters.local_bytes_in - local_in == (0 if put_plane == "grpc" else parts)
        assert lane_sent == (parts if put_plane == "lane" else 0)
        for fetch_plane in PLANES:
            with Client(target(daemon_thread, fetch_plane), data_plane=fetch_plane) as kv:
                got = kv.fetch(HYBRID, tokens)
                assert as_bytes(got) == expected(HYBRID, blocks, 7), (put_plane, fetch_plane)
                # A prefix that ends inside the put has no window or state there: a miss
                # on every plane alike.
                assert kv.fetch(HYBRID, tokens[: 4 * BST]) == []
                lane = kv.data_lane_stats
                if fetch_plane == "lane":
                    assert lane is not None and lane.bytes_received == parts


def test_a_second_put_of_the_same_prefix_stores_nothing_on_each_plane(daemon_thread):
    tokens = list(range(BST * 5))
    blocks = blocks_for(HYBRID, 5)
    with Client(daemon_thread.unix_target, data_plane="grpc") as kv:
        kv.put(HYBRID, tokens, blocks)
    for plane in ("local", "lane"):
        with Client(target(daemon_thread, plane), data_plane=plane) as kv:
            result = kv.put(HYBRID, tokens, blocks)
            assert (result.stored, result.existing) == (0, 5)
            assert as_bytes(kv.fetch(HYBRID, tokens)) == expected(HYBRID, blocks, 5)


@pytest.mark.parametrize("plane", ["local", "lane"])
async def test_the_asyncio_client_moves_parts_on_the_plane(daemon, plane):
    tokens = list(range(500, 500 + BST * 6))
    blocks = blocks_for(HYBRID, 6)
    async with AsyncClient(target(daemon, plane), data_plane=plane) as kv:
        assert await kv.data_plane_in_use() == plane
        assert (await kv.put(HYBRID, tokens, blocks)).stored == 6
        assert (await kv.lookup(HYBRID, tokens)).num_blocks == 6
        assert as_bytes(await kv.fetch(HYBRID, tokens)) == expected(HYBRID, blocks, 6)
    # And gRPC bytes read the same parts back.
    async with AsyncClient(daemon.unix_target, data_plane="grpc") as kv:
        assert as_bytes(await kv.fetch(HYBRID, tokens)) == expected(HYBRID, blocks, 6)


def _raw(running):
    channel = grpc.insecure_channel(running.unix_target)
    return channel, kvstore_pb2_grpc.KVStoreStub(channel)


def flip_part(stub, tokens: list[int], part: int) -> None:
    """Corrupt part `part` (wire order) of the grouped prefix `tokens` in the daemon's host
    segment, behind its back."""
    namespace = kvstore_pb2.Namespace(layout=layout_to_proto(HYBRID))
    keys = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))
    leased = stub.LocalFetch(kvstore_pb2.LocalFetchRequest(namespace=namespace, keys=keys))
    stub.Unpin(kvstore_pb2.UnpinRequest(lease_id=leased.lease_id))
    assert len(leased.offsets) == len(part_order(HYBRID, leased.num_blocks))
    seg = stub.LocalSegment(kvstore_pb2.LocalSegmentRequest())
    mapped = AttachedSegment(seg.path, seg.token)
    try:
        mapped.data[leased.offsets[part] + 3] ^= 0x10
    finally:
        mapped.close()


@pytest.mark.parametrize("plane", PLANES)
def test_a_corrupted_part_is_a_miss_of_the_whole_prefix(daemon_thread, plane):
    n = 5
    tokens = list(range(7000, 7000 + BST * n))
    blocks = blocks_for(HYBRID, n)
    order = part_order(HYBRID, n)
    # A window part of the last block but one: a part no other prefix end needs as much.
    victim = next(k for k, (g, j) in enumerate(order) if HYBRID.groups[g].name == "swa" and j == n - 2)
    channel, stub = _raw(daemon_thread)
    with channel, Client(target(daemon_thread, plane), data_plane=plane) as kv:
        kv.put(HYBRID, tokens, blocks)
        flip_part(stub, tokens, victim)
        failures = daemon_thread.store.counters.checksum_failures
        assert kv.fetch(HYBRID, tokens) == []  # never a partial prefix, never the bad part
        assert daemon_thread.store.counters.checksum_failures == failures + 1
        # The daemon dropped that block whole: the window of the prefix end is gone.
        assert kv.lookup(HYBRID, tokens).num_blocks == 0
        # Blocks before it are still served where the hit rules allow nothing shorter:
        # a put of the prefix again makes it whole.
        assert kv.put(HYBRID, tokens, blocks).stored >= 1
        assert as_bytes(kv.fetch(HYBRID, tokens)) == expected(HYBRID, blocks, n)


def test_raw_lane_calls_take_a_grouped_layout_one_transfer_per_group(daemon_thread):
    tokens = list(range(BST * 4))
    with Client(daemon_thread.unix_target) as kv:
        kv.put(HYBRID, tokens, blocks_for(HYBRID, 4))
    namespace = kvstore_pb2.Namespace(layout=layout_to_proto(HYBRID))
    keys = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))
    with grpc.insecure_channel(daemon_thread.tcp_target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        grant = stub.LaneFetch(kvstore_pb2.LaneFetchRequest(fetch=kvstore_pb2.FetchRequest(namespace=namespace,
                                                                                            keys=keys)))
        assert grant.prefix_blocks == 4 and grant.num_blocks == len(part_order(HYBRID, 4))
        assert [(g.num_blocks, g.block_bytes) for g in grant.groups] == [
            (len(need), HYBRID.groups[need.group].bytes_per_block) for need in needed(HYBRID, 4)]
        put = stub.LanePut(kvstore_pb2.LanePutRequest(header=kvstore_pb2.PutHeader(namespace=namespace, keys=keys)))
        assert [g.needed for g in put.groups] == [bytes(len(need)) for need in needed(HYBRID, 4)]  # all stored
        assert stub.LaneCommit(kvstore_pb2.LaneCommitRequest(transfer_id=put.transfer_id)).existing == 4


@pytest.mark.parametrize("plane", PLANES)
def test_a_grouped_fetch_fills_the_callers_buffers(daemon_thread, plane):
    import numpy as np

    n = 4
    tokens = list(range(9000, 9000 + BST * n))
    blocks = blocks_for(HYBRID, n)
    out = [{g.name: np.zeros(g.bytes_per_block, np.uint8) for g in HYBRID.groups} for _ in range(n)]
    with Client(target(daemon_thread, plane), data_plane=plane) as kv:
        kv.put(HYBRID, tokens, blocks)
        got = kv.fetch(HYBRID, tokens, out=out)
        assert len(got) == n and got[0] is out[0]
        want = expected(HYBRID, blocks, n)
        for j in range(n):
            for g in HYBRID.groups:  # the parts the prefix needs are filled, the others untouched
                data = out[j][g.name].tobytes()
                assert data == want[j].get(g.name, bytes(g.bytes_per_block))
        with pytest.raises(Exception, match="one per block"):
            kv.fetch(HYBRID, tokens, out=out[:2])


@pytest.mark.parametrize("plane", ["local", "lane"])
async def test_the_asyncio_client_misses_a_corrupted_part(daemon_thread, plane):
    n = 4
    tokens = list(range(8000, 8000 + BST * n))
    blocks = blocks_for(HYBRID, n)
    async with AsyncClient(target(daemon_thread, plane), data_plane=plane) as kv:
        await kv.put(HYBRID, tokens, blocks)
        channel, stub = _raw(daemon_thread)  # blocking calls: the daemon runs on a loop of its own
        with channel:
            flip_part(stub, tokens, 0)  # block 0's full-attention part
        assert await kv.fetch(HYBRID, tokens) == []
        assert (await kv.lookup(HYBRID, tokens)).num_blocks == 0


def test_parts_in_a_lower_tier_reach_a_shared_memory_client_whole(tmp_path):
    from dataclasses import replace

    from kvstore.client.admin import AdminClient
    from tests.conftest import daemon_in_thread, make_config

    cfg = replace(make_config(tmp_path), ssd_path=str(tmp_path / "ssd"), ssd_capacity=8 << 20,
                  ssd_region_size=512 << 10)
    n = 5
    tokens = list(range(BST * n))
    blocks = blocks_for(HYBRID, n)
    with daemon_in_thread(cfg) as running:
        with Client(running.unix_target, data_plane="local") as kv:
            kv.put(HYBRID, tokens, blocks)
        with AdminClient(running.unix_target) as admin:
            admin.evict("host", 1 << 30)  # every part moves down to the SSD
        with Client(running.unix_target, data_plane="local") as kv:
            assert set(kv.lookup(HYBRID, tokens).tiers) == {"ssd"}
            assert as_bytes(kv.fetch(HYBRID, tokens)) == expected(HYBRID, blocks, n)


def _proxied(tmp_path, direction):
    from tests.conftest import daemon_in_thread, make_config
    from tests.lane_proxy import LaneProxy
    from tests.server.test_data_lane import lane_address

    proxy = LaneProxy("flip", direction)
    cfg = make_config(tmp_path, data_lane_listen=("127.0.0.1:0",), data_lane_advertise=(proxy.address,))
    return proxy, cfg, daemon_in_thread, lane_address


def test_a_part_flipped_on_the_lane_is_never_returned_nor_stored(tmp_path):
    from kvstore.errors import DataLoss

    n = 5
    tokens = list(range(BST * n))
    blocks = blocks_for(HYBRID, n)
    for direction in ("to_client", "to_daemon"):
        proxy, cfg, daemon_in_thread, lane_address = _proxied(tmp_path / direction, direction)
        try:
            with daemon_in_thread(cfg) as running:
                proxy.upstream = lane_address(running)
                with Client(running.tcp_target, data_plane="lane") as kv:
                    if direction == "to_client":
                        kv.put(HYBRID, tokens, blocks)  # the proxy flips only what goes to the client
                        assert kv.fetch(HYBRID, tokens) == []  # a miss, never a part that did not verify
                        assert kv.data_lane_stats.blocks_rejected == 1
                        # The daemon's parts were never wrong: the next fetch has them all.
                        assert as_bytes(kv.fetch(HYBRID, tokens)) == expected(HYBRID, blocks, n)
                    else:
                        with pytest.raises(DataLoss, match="checksum"):
                            kv.put(HYBRID, tokens, blocks)
                        assert kv.lookup(HYBRID, tokens).num_blocks == 0
                        assert running.store.counters.group_parts_stored == 0  # no part of it published
                        assert kv.put(HYBRID, tokens, blocks).stored == n
                        assert as_bytes(kv.fetch(HYBRID, tokens)) == expected(HYBRID, blocks, n)
                    assert proxy.hits == 1
        finally:
            proxy.close()
