"""What one Put stream may hold ahead of its bytes, and for how long.

A header costs nothing until bytes follow: a header naming as many blocks as the host
tier holds, followed by silence, evicts nothing and blocks no one. Slots are reserved as
the chunks arrive, at most `max_put_reserve_bytes` ahead of them; a stream that stalls
for `put_idle_timeout_s` is rolled back. A put still publishes all or nothing: one that
cannot find room mid-stream fails with RESOURCE_EXHAUSTED and frees what it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.convert import layout_to_proto
from kvstore.layout import KVLayout
from kvstore.server.config import load_config
from kvstore.server.daemon import Daemon
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from tests.polling import eventually

pytestmark = pytest.mark.asyncio

LAYOUT = KVLayout(model="test/window", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
                  block_size_tokens=64)  # 16 KiB blocks
BLOCK = LAYOUT.bytes_per_block
NS = kvstore_pb2.Namespace(layout=layout_to_proto(LAYOUT))
WAIT_S = 10.0


def daemon_flags(tmp_path: Path, **settings: str) -> dict[str, str]:
    return {"listen": f"unix:{tmp_path / 'kv.sock'},127.0.0.1:0", "host_capacity": "16MiB", "grace_s": "1",
            "metrics_listen": "127.0.0.1:0", **settings}


@dataclass
class Stubs:
    kv: kvstore_pb2_grpc.KVStoreStub
    admin: admin_pb2_grpc.AdminStub
    daemon: Daemon


@contextlib.asynccontextmanager
async def running(tmp_path: Path, **settings: str) -> AsyncIterator[Stubs]:
    d = Daemon(load_config(daemon_flags(tmp_path, **settings), env={}))
    await d.start()
    try:
        async with grpc.aio.insecure_channel(d.bound[1]) as channel:
            yield Stubs(kvstore_pb2_grpc.KVStoreStub(channel), admin_pb2_grpc.AdminStub(channel), d)
    finally:
        await d.stop(grace_s=0)


@pytest.fixture
async def stubs(tmp_path: Path) -> AsyncIterator[Stubs]:
    async with running(tmp_path, max_put_reserve_bytes="256KiB") as s:
        yield s


def hashes(n: int, salt: int) -> list[bytes]:
    return [(salt << 32 | i).to_bytes(16, "big") for i in range(n)]


def keys(hs: list[bytes]) -> kvstore_pb2.BlockKeys:
    return kvstore_pb2.BlockKeys(packed_hashes=b"".join(hs))


def header(hs: list[bytes]) -> kvstore_pb2.PutRequest:
    return kvstore_pb2.PutRequest(header=kvstore_pb2.PutHeader(namespace=NS, keys=keys(hs)))


def chunk(block: int, data: bytes) -> kvstore_pb2.PutRequest:
    return kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=block, data=data))


async def put(s: Stubs, hs: list[bytes]) -> kvstore_pb2.PutResponse:
    msgs = [header(hs)] + [chunk(i, os.urandom(BLOCK)) for i in range(len(hs))]
    return await s.kv.Put(iter(msgs))


async def found(s: Stubs, hs: list[bytes]) -> int:
    return (await s.kv.Lookup(kvstore_pb2.LookupRequest(namespace=NS, keys=keys(hs)))).num_blocks


async def host(s: Stubs) -> Any:
    stats = await s.admin.Stats(admin_pb2.StatsRequest())
    return next(t for t in stats.tiers if t.name == "host")


async def test_a_header_naming_the_whole_tier_then_silence_holds_nothing(stubs: Stubs) -> None:
    before = hashes(10, 1)
    assert (await put(stubs, before)).stored == 10
    tier = await host(stubs)
    whole = hashes(tier.capacity_bytes // BLOCK, 2)
    hog = stubs.kv.Put()
    await hog.write(header(whole))
    try:
        tier = await host(stubs)
        assert tier.evictions == 0 and tier.drops == 0
        assert tier.used_bytes == 10 * BLOCK
        assert await found(stubs, before) == 10
        # Another client's put goes through while the header sits there.
        after = hashes(20, 3)
        assert (await put(stubs, after)).stored == 20
        assert await found(stubs, after) == 20
        # Nothing the daemon exposes says it has read a header whose bytes have not come,
        # so the checks above may have run before it did. Its answer to the end of the
        # stream says it had: the put it began from that header ended short. To reserve
        # the whole tier for the header, a daemon would have had to evict every block it
        # held (the header names as many blocks as the tier has room for), and evictions
        # are never undone: so the same checks, made after that answer, are conclusive.
        await hog.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(hog, WAIT_S)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"of the {len(whole)} blocks the header names" in (info.value.details() or "")
        tier = await host(stubs)
        assert tier.evictions == 0 and tier.drops == 0
        assert tier.used_bytes == 30 * BLOCK
        assert await found(stubs, before) == 10 and await found(stubs, after) == 20
    finally:
        hog.cancel()


async def test_slots_are_reserved_as_the_bytes_arrive_within_the_window(stubs: Stubs) -> None:
    whole = hashes((await host(stubs)).capacity_bytes // BLOCK, 4)
    call = stubs.kv.Put()
    try:
        await call.write(header(whole))
        await call.write(chunk(0, os.urandom(BLOCK // 2)))
        await call.write(chunk(0, os.urandom(BLOCK // 2)))
        await call.write(chunk(1, os.urandom(BLOCK)))

        async def slotted() -> bool:
            return (await host(stubs)).used_bytes >= 2 * BLOCK

        # The slots the chunks took are the daemon's sign that it has them (the first one
        # reserves the window's worth). A daemon that had reserved the whole header at
        # once shows them too, and fails the bound below.
        await eventually(slotted, "the blocks that arrived got slots")
        used = (await host(stubs)).used_bytes
        # Two blocks arrived; at most the window (256 KiB) is held ahead of them.
        assert 2 * BLOCK <= used <= 2 * BLOCK + 256 * 1024
    finally:
        call.cancel()
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while (await host(stubs)).used_bytes:
        assert asyncio.get_running_loop().time() < deadline, "the cancelled put's slots were never freed"
        await asyncio.sleep(0.02)


async def test_a_put_that_finds_no_room_mid_stream_fails_cleanly(stubs: Stubs) -> None:
    capacity = (await host(stubs)).capacity_bytes
    held = hashes(capacity // BLOCK // 2, 5)
    assert (await put(stubs, held)).stored == len(held)
    lease = await stubs.kv.Lookup(kvstore_pb2.LookupRequest(namespace=NS, keys=keys(held), lease_ms=60_000))
    assert lease.num_blocks == len(held)  # pinned: nothing can make room for the next put
    big = hashes(capacity // BLOCK // 2 + 8, 6)  # fits the tier, not beside the pinned half
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await put(stubs, big)
    # What the daemon answered (its metrics count each call by status code)...
    answered = 'kvstore_rpc_duration_seconds_count{code="RESOURCE_EXHAUSTED",method="Put"} 1.0'
    assert answered in stubs.daemon.metrics.exposition().decode()
    # ...is what the client got, unless it was still writing when the answer came:
    # grpc-python then reports its failed write instead of the status.
    raced = info.value.code() == grpc.StatusCode.INTERNAL and "Internal error from Core" in (info.value.details() or "")
    if not raced:
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert await found(stubs, big) == 0  # never published in part
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while (await host(stubs)).used_bytes != len(held) * BLOCK:
        assert asyncio.get_running_loop().time() < deadline, "the failed put's slots were never freed"
        await asyncio.sleep(0.02)
    assert await found(stubs, held) == len(held)
    assert (await stubs.kv.Unpin(kvstore_pb2.UnpinRequest(lease_id=lease.lease_id))).released
    assert (await put(stubs, big)).stored == len(big)  # with the pins gone, the same put fits


async def test_a_stalled_stream_is_rolled_back_after_the_idle_deadline(tmp_path: Path) -> None:
    async with running(tmp_path, put_idle_timeout_s="0.5") as s:
        hs = hashes(3, 7)
        call = s.kv.Put()
        await call.write(header(hs))
        await call.write(chunk(0, os.urandom(BLOCK // 2)))  # half a block, then nothing
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call, WAIT_S)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "put_idle_timeout_s" in (info.value.details() or "")
        assert (await host(s)).used_bytes == 0
        assert await found(s, hs) == 0


async def test_local_puts_expire_after_the_same_idle_deadline(tmp_path: Path) -> None:
    async with running(tmp_path, put_idle_timeout_s="0.5") as s:
        begun = await s.kv.LocalPut(kvstore_pb2.LocalPutRequest(header=header(hashes(2, 8)).header))
        assert begun.expires_in_ms == 500
