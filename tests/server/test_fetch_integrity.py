"""A Fetch whose block fails verification: served from an intact lower copy, or ended
with a status that says so.

A flipped byte in a block's host copy is found when the block is copied out; the bad
copy is dropped and counted. If the block has an SSD copy, that copy is verified and
sent instead, and the stream goes on. If it has none, the stream ends with DATA_LOSS,
whose message says how many of the header's blocks were sent and why, and whose
trailing metadata `kvstore-blocks-sent` carries the count; the SDK returns the verified
prefix, as a miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvstore.client import AsyncClient
from kvstore.convert import layout_to_proto
from kvstore.layout import KVLayout
from kvstore.server.config import load_config
from kvstore.server.daemon import Daemon
from kvstore.shm import AttachedSegment
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

pytestmark = pytest.mark.asyncio

LAYOUT = KVLayout(model="test/integrity", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
                  block_size_tokens=4)
NS = kvstore_pb2.Namespace(layout=layout_to_proto(LAYOUT))
TOKENS = list(range(3 * LAYOUT.block_size_tokens))
KEYS = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=TOKENS))
WAIT_S = 10.0


@dataclass
class Running:
    kv: kvstore_pb2_grpc.KVStoreStub
    admin: admin_pb2_grpc.AdminStub
    target: str

    async def tier(self, name: str) -> admin_pb2.TierStats:
        stats = await self.admin.Stats(admin_pb2.StatsRequest())
        return next(t for t in stats.tiers if t.name == name)


@contextlib.asynccontextmanager
async def running(tmp_path: Path, **settings: str) -> AsyncIterator[Running]:
    flags = {"listen": f"unix:{tmp_path / 'kv.sock'}", "host_capacity": "16MiB", "grace_s": "1",
             "metrics_listen": "127.0.0.1:0", **settings}
    d = Daemon(load_config(flags, env={}))
    await d.start()
    try:
        async with grpc.aio.insecure_channel(d.bound[0]) as channel:
            yield Running(kvstore_pb2_grpc.KVStoreStub(channel), admin_pb2_grpc.AdminStub(channel), d.bound[0])
    finally:
        await d.stop(grace_s=0)


async def put_three(r: Running) -> list[bytes]:
    blocks = [os.urandom(LAYOUT.bytes_per_block) for _ in range(3)]
    async with AsyncClient(r.target) as kv:
        await kv.put(LAYOUT, TOKENS, blocks)
    return blocks


async def flip_host_byte(r: Running, block: int) -> None:
    """Corrupt the host copy of block `block` behind the daemon's back, through a mapping
    of its shared-memory segment (as a stray write from a co-located process would)."""
    leased = await r.kv.LocalFetch(kvstore_pb2.LocalFetchRequest(namespace=NS, keys=KEYS))
    await r.kv.Unpin(kvstore_pb2.UnpinRequest(lease_id=leased.lease_id))
    seg = await r.kv.LocalSegment(kvstore_pb2.LocalSegmentRequest())
    mapped = AttachedSegment(seg.path, seg.token)
    try:
        mapped.data[leased.offsets[block] + 7] ^= 0x40
    finally:
        mapped.close()


async def fetch_raw(r: Running) -> tuple[kvstore_pb2.FetchHeader, list[bytes], grpc.aio.AioRpcError | None,
                                         dict[str, str]]:
    """The header, the blocks (joined chunks) and the error, if the stream ended with one."""
    call = r.kv.Fetch(kvstore_pb2.FetchRequest(namespace=NS, keys=KEYS))
    head = kvstore_pb2.FetchHeader()
    parts: dict[int, list[bytes]] = {}
    error = None
    try:
        async for msg in call:
            if msg.WhichOneof("msg") == "header":
                head = msg.header
            else:
                parts.setdefault(msg.chunk.block, []).append(msg.chunk.data)
    except grpc.aio.AioRpcError as exc:
        error = exc
    trailers = {k: v for k, v in (await call.trailing_metadata() or ())}
    return head, [b"".join(parts[i]) for i in sorted(parts)], error, trailers


async def test_a_bad_host_copy_is_replaced_by_its_ssd_copy(tmp_path: Path) -> None:
    ssd = {"ssd_path": str(tmp_path / "ssd"), "ssd_capacity": "8MiB", "ssd_region_size": "1MiB"}
    async with running(tmp_path, **ssd) as r:
        blocks = await put_three(r)
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while (t := await r.tier("ssd")).pending_writes or t.blocks < 3:  # written through to SSD
            assert asyncio.get_running_loop().time() < deadline, "the blocks never reached the SSD"
            await asyncio.sleep(0.02)
        await flip_host_byte(r, 1)
        head, got, error, _ = await fetch_raw(r)
        assert error is None, error.details() if error else ""
        assert head.num_blocks == 3
        assert got == blocks  # block 1 came from its SSD copy, verified
        assert (await r.tier("host")).checksum_failures == 1
        stats = await r.admin.Stats(admin_pb2.StatsRequest())
        assert stats.counters.checksum_failures == 1
        hit = await r.kv.Lookup(kvstore_pb2.LookupRequest(namespace=NS, keys=KEYS))
        assert hit.num_blocks == 3  # still there: only the bad copy went
        head, again, error, _ = await fetch_raw(r)
        assert error is None and again == blocks


async def test_a_bad_block_without_another_copy_ends_the_stream_with_data_loss(tmp_path: Path) -> None:
    async with running(tmp_path) as r:
        blocks = await put_three(r)
        await flip_host_byte(r, 1)
        head, got, error, trailers = await fetch_raw(r)
        assert head.num_blocks == 3
        assert got == blocks[:1]
        assert error is not None and error.code() == grpc.StatusCode.DATA_LOSS
        details = error.details() or ""
        assert "1 of 3 blocks" in details and "failed verification" in details
        assert trailers.get("kvstore-blocks-sent") == "1"
        assert (await r.admin.Stats(admin_pb2.StatsRequest())).counters.checksum_failures == 1
        hit = await r.kv.Lookup(kvstore_pb2.LookupRequest(namespace=NS, keys=KEYS))
        assert hit.num_blocks == 1  # the bad block was dropped


async def test_the_sdk_returns_the_verified_prefix(tmp_path: Path) -> None:
    async with running(tmp_path) as r:
        blocks = await put_three(r)
        await flip_host_byte(r, 2)
        async with AsyncClient(r.target, data_plane="grpc") as kv:
            assert await kv.fetch(LAYOUT, TOKENS) == blocks[:2]  # a miss is a value
            assert await kv.fetch(LAYOUT, TOKENS) == blocks[:2]
