"""Codecs in a pool (docs/codecs.md): quantized blocks keep their codec through forwards
and pulls (a remote hit is dequantized like a local one, and never answers a
full-precision lookup), and the pool's transfers use the lossless codec
`cluster_lane_codec` names, or the one its chooser picks, shown in each node's stats."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore.client import AsyncClient
from kvstore.layout import KVLayout
from kvstore.quant import quantizer_for
from kvstore.server.daemon import Daemon
from tests.cluster.pool_fixtures import pool, unix_target

FP8 = KVLayout(model="test/pool-codecs", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64,
               block_size_tokens=32, kv_layout="2,L,B,H,D", kv_codec="fp8-e4m3")
DENSE = FP8.without_codec()


def kv_blocks(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    count = FP8.dense_block_bytes // 2
    return [(rng.standard_normal(count).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
            for _ in range(n)]


def served_encoded(daemons: list[Daemon]) -> int:
    return sum(int(d.data_lane.counters.get("encoded_raw_bytes_out")) for d in daemons if d.data_lane is not None)


async def test_quantized_blocks_keep_their_codec_through_forwards_and_pulls(tmp_path: Path) -> None:
    tokens = list(range(40 * 32))
    data = kv_blocks(40, seed=1)
    q = quantizer_for(FP8)
    dense = q.dequantize(q.quantize(data))
    async with pool(tmp_path, 3, cluster_lane_codec="shuffle-zstd") as daemons:
        a, b, _ = daemons
        async with AsyncClient(unix_target(a)) as kv:
            put = await kv.put(FP8, tokens, data, wait_for_owners=True)
            # (the forwarder's counters say, on a failure, whether a forward failed, was
            # dropped, or was still on its way when the put's wait ended)
            assert put.owner_committed_blocks == put.forwarded_blocks > 0, (
                put.owner_committed_blocks, put.forwarded_blocks, a.node.forwarder.counters)
        async with AsyncClient(b.bound[1], data_plane="grpc") as kv:
            hit = await kv.lookup(FP8, tokens)
            assert hit.num_blocks == 40 and hit.remote_blocks > 0
            assert [bytes(x) for x in await kv.fetch(FP8, tokens)] == dense
            assert (await kv.lookup(DENSE, tokens)).num_blocks == 0
            stats = await kv.stats()
        pool_keys = [c for c in stats.codecs if c.path == "pool"]
        assert pool_keys and all(c.link.startswith("node ") for c in pool_keys)
        moved = {f.codec: f.raw_bytes for c in pool_keys for f in c.codecs}
        assert moved.get("shuffle-zstd", 0) > 0 and "raw" not in moved
        assert served_encoded(daemons) > 0  # the holders sent the pulls' frames encoded


async def test_the_pool_chooses_per_peer_by_default_and_shows_it(tmp_path: Path) -> None:
    tokens = list(range(24 * 32))
    data = kv_blocks(24, seed=2)
    async with pool(tmp_path, 2) as (a, b):
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(DENSE, tokens, data, wait_for_owners=True)
        async with AsyncClient(unix_target(b)) as kv:
            assert (await kv.lookup(DENSE, tokens)).num_blocks == 24  # what b lacks is pulled
            assert [bytes(x) for x in await kv.fetch(DENSE, tokens)] == data
        for d in (a, b):
            async with AsyncClient(unix_target(d)) as kv:
                info = await kv.info("codecs")
                stats = await kv.stats()
            for c in (c for c in stats.codecs if c.path == "pool"):
                assert c.choice in ("raw", "shuffle-lz4", "shuffle-zstd")
                assert f"codec_pool_{c.link.replace(' ', '_')}_{c.namespace_id.hex()}:choice={c.choice}" in info
        moved = [f.raw_bytes for d in (a, b) for c in (await _stats(d)).codecs if c.path == "pool" for f in c.codecs]
        assert sum(moved) > 0


async def _stats(d: Daemon):  # type: ignore[no-untyped-def]
    async with AsyncClient(unix_target(d)) as kv:
        return await kv.stats()
