"""Which requests register a namespace, and when one is forgotten.

Only a put that publishes registers its layout. A read of a layout the daemon does not
know (Lookup, Fetch, Verify, Pin, Delete, Hint, Prefetch, LocalFetch) answers a miss and
registers nothing, so made-up layouts cannot fill `max_namespaces`; a put refused for
any reason leaves no namespace behind; a namespace whose blocks all went away is
forgotten after `namespace_grace_s`. Blocks recovered from SSD are still adopted by the
first request that names their layout, a read included.
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
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from tests.polling import eventually

pytestmark = pytest.mark.asyncio

WAIT_S = 10.0


def made_up(i: int) -> KVLayout:
    return KVLayout(model=f"made-up/{i}", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
                    block_size_tokens=4)


def ns(layout: KVLayout) -> kvstore_pb2.Namespace:
    return kvstore_pb2.Namespace(layout=layout_to_proto(layout))


def tokens_keys(tokens: list[int]) -> kvstore_pb2.BlockKeys:
    return kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))


def hash_keys(n: int) -> kvstore_pb2.BlockKeys:
    return kvstore_pb2.BlockKeys(packed_hashes=b"".join(i.to_bytes(16, "big") for i in range(1, n + 1)))


@dataclass
class Stubs:
    kv: kvstore_pb2_grpc.KVStoreStub
    admin: admin_pb2_grpc.AdminStub
    target: str

    async def namespaces(self) -> int:
        return (await self.admin.Stats(admin_pb2.StatsRequest())).namespaces

    async def host_used_at_least(self, nbytes: int) -> bool:
        stats = await self.admin.Stats(admin_pb2.StatsRequest())
        return next(t.used_bytes for t in stats.tiers if t.name == "host") >= nbytes

    async def put_failures_above(self, count: int) -> bool:
        return (await self.admin.Stats(admin_pb2.StatsRequest())).counters.put_failures > count


@contextlib.asynccontextmanager
async def running(tmp_path: Path, **settings: str) -> AsyncIterator[Stubs]:
    flags = {"listen": f"unix:{tmp_path / 'kv.sock'},127.0.0.1:0", "host_capacity": "16MiB", "grace_s": "1",
             "metrics_listen": "127.0.0.1:0", **settings}
    d = Daemon(load_config(flags, env={}))
    await d.start()
    try:
        async with grpc.aio.insecure_channel(d.bound[0]) as channel:
            yield Stubs(kvstore_pb2_grpc.KVStoreStub(channel), admin_pb2_grpc.AdminStub(channel), d.bound[0])
    finally:
        await d.stop(grace_s=0)


@pytest.fixture
async def stubs(tmp_path: Path) -> AsyncIterator[Stubs]:
    async with running(tmp_path) as s:
        yield s


async def put(s: Stubs, layout: KVLayout, tokens: list[int]) -> kvstore_pb2.PutResponse:
    n = len(tokens) // layout.block_size_tokens
    msgs = [kvstore_pb2.PutRequest(header=kvstore_pb2.PutHeader(namespace=ns(layout), keys=tokens_keys(tokens)))]
    msgs += [kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=b, data=os.urandom(layout.bytes_per_block)))
             for b in range(n)]
    return await s.kv.Put(iter(msgs))


async def test_made_up_lookups_register_nothing(stubs: Stubs) -> None:
    before = await stubs.namespaces()
    limit = asyncio.Semaphore(64)

    async def one(i: int) -> int:
        async with limit:
            request = kvstore_pb2.LookupRequest(namespace=ns(made_up(i)), keys=tokens_keys(list(range(8))))
            return (await stubs.kv.Lookup(request)).num_blocks

    hits = await asyncio.gather(*(one(i) for i in range(5000)))  # more than max_namespaces (4096)
    assert sum(hits) == 0
    assert await stubs.namespaces() == before
    # A new layout's put still works, and registers exactly its namespace.
    fresh = made_up(99_999)
    assert (await put(stubs, fresh, list(range(8)))).stored == 2
    assert await stubs.namespaces() == before + 1


async def test_a_lookup_of_an_unknown_layout_is_counted_as_a_miss(stubs: Stubs) -> None:
    """Registering nothing must not hide the lookup: an engine asking about a layout the
    daemon has never seen shows up in the stats as a lookup whose every block missed."""
    before = (await stubs.admin.Stats(admin_pb2.StatsRequest())).counters
    request = kvstore_pb2.LookupRequest(namespace=ns(made_up(7)), keys=tokens_keys(list(range(12))))
    assert (await stubs.kv.Lookup(request)).num_blocks == 0
    stats = await stubs.admin.Stats(admin_pb2.StatsRequest())
    after = stats.counters
    assert after.lookups == before.lookups + 1
    assert after.lookup_blocks == before.lookup_blocks + 3
    assert after.miss_blocks == before.miss_blocks + 3
    assert after.hit_blocks == before.hit_blocks
    assert [t.misses for t in stats.tiers if t.present] == [3]


async def test_every_read_of_an_unknown_layout_is_a_miss(stubs: Stubs) -> None:
    layout = made_up(1)
    ref, toks = ns(layout), tokens_keys(list(range(12)))
    kv = stubs.kv
    r = await kv.Lookup(kvstore_pb2.LookupRequest(namespace=ref, keys=toks, lease_ms=1000))
    assert (r.num_blocks, r.num_tokens, r.lease_id, r.block_size_tokens) == (0, 0, "", 4)
    assert r.namespace_id == layout.namespace_id
    r = await kv.Lookup(kvstore_pb2.LookupRequest(namespace=ref, keys=hash_keys(3)))
    assert r.num_blocks == 0 and r.tiers_packed == b""
    messages = [m async for m in kv.Fetch(kvstore_pb2.FetchRequest(namespace=ref, keys=toks))]
    assert len(messages) == 1 and messages[0].header.num_blocks == 0
    assert messages[0].header.block_bytes == layout.bytes_per_block
    assert (await kv.Verify(kvstore_pb2.VerifyRequest(namespace=ref, keys=toks))).verified == 0
    pin = await kv.Pin(kvstore_pb2.PinRequest(namespace=ref, keys=toks, ttl_ms=1000))
    assert (pin.pinned, pin.lease_id) == (0, "")
    assert (await kv.Delete(kvstore_pb2.DeleteRequest(namespace=ref, keys=toks))).deleted == 0
    hint = kvstore_pb2.ReuseHint(session_id="s", expect_reuse_within_s=5)
    assert (await kv.Hint(kvstore_pb2.HintRequest(namespace=ref, keys=toks, hint=hint))).hinted == 0
    pre = await kv.Prefetch(kvstore_pb2.PrefetchRequest(namespace=ref, keys=hash_keys(3)))
    assert (pre.requested, pre.missing, pre.raised) == (3, 3, 0)
    local = await kv.LocalFetch(kvstore_pb2.LocalFetchRequest(namespace=ref, keys=toks))
    assert (local.num_blocks, list(local.offsets), local.lease_id) == (0, [], "")
    assert local.block_bytes == layout.bytes_per_block
    assert await stubs.namespaces() == 0
    # Bad input is refused the same whether the layout is known or not.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await kv.Lookup(kvstore_pb2.LookupRequest(namespace=ref, keys=kvstore_pb2.BlockKeys(packed_hashes=b"x" * 17)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # An id the daemon never registered is NOT_FOUND, as the API says.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await kv.Lookup(kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(id=layout.namespace_id), keys=toks))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def refused_puts(s: Stubs, layout: KVLayout) -> list[grpc.StatusCode]:
    """Puts of `layout` that the daemon refuses, each for another reason; their codes, once
    the daemon has rolled back the last one (cancelled, so it answers nothing)."""
    block = layout.bytes_per_block
    ref = ns(layout)

    def head(tokens: list[int], **fields) -> kvstore_pb2.PutRequest:
        return kvstore_pb2.PutRequest(header=kvstore_pb2.PutHeader(namespace=ref, keys=tokens_keys(tokens), **fields))

    def piece(b: int, n: int) -> kvstore_pb2.PutRequest:
        return kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=b, data=os.urandom(n)))

    toks = list(range(2 * layout.block_size_tokens))  # two blocks
    streams = [
        [head(toks), piece(0, block), piece(1, block - 1)],  # a short block
        [head(toks), piece(0, block + 1)],  # a long one
        [head(toks), piece(1, block)],  # a skipped block
        [head(toks), piece(0, block)],  # a truncated stream
        [head(toks, hint=kvstore_pb2.ReuseHint(session_id="x" * 200, expect_reuse_within_s=5))],  # a bad hint
        [head(toks, num_blocks=5)],  # more blocks than the tokens make
        [kvstore_pb2.PutRequest(header=kvstore_pb2.PutHeader(
            namespace=ref, keys=hash_keys(2), parent_hash=b"short"))],  # a bad parent hash
        [kvstore_pb2.PutRequest(header=kvstore_pb2.PutHeader(namespace=ref, keys=hash_keys(4096)))],  # over the tier
    ]
    codes = []
    for msgs in streams:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.kv.Put(iter(msgs))
        codes.append(info.value.code())
    # Refused by the daemon's local planes too.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.kv.LocalPut(kvstore_pb2.LocalPutRequest(header=head(toks, num_blocks=9).header))
    codes.append(info.value.code())
    # A put cancelled before it half-closed, once the daemon holds slots for its blocks
    # (a put begun: there is something to roll back).
    call = s.kv.Put()
    await call.write(head(toks))
    await call.write(piece(0, block))
    await call.write(piece(1, block))
    await eventually(lambda: s.host_used_at_least(2 * block), "the put's blocks got slots")
    failed = (await s.admin.Stats(admin_pb2.StatsRequest())).counters.put_failures
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # The daemon counts a put that ended without publishing once it has rolled it back.
    await eventually(lambda: s.put_failures_above(failed), "the cancelled put was rolled back")
    return codes


async def test_refused_puts_leave_no_namespace(tmp_path: Path) -> None:
    big = KVLayout(model="made-up/big", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
                   block_size_tokens=64)  # 16 KiB blocks: 4096 of them do not fit a 16 MiB tier
    async with running(tmp_path) as s:
        codes = await refused_puts(s, big)
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.INVALID_ARGUMENT in codes
        assert await s.namespaces() == 0
        listed = await s.admin.ListNamespaces(admin_pb2.ListNamespacesRequest())
        assert list(listed.namespaces) == []
        stats = await s.admin.Stats(admin_pb2.StatsRequest())
        assert next(t.used_bytes for t in stats.tiers if t.name == "host") == 0


async def test_a_namespace_whose_blocks_went_away_is_forgotten_after_the_grace(tmp_path: Path) -> None:
    layout = made_up(2)
    async with running(tmp_path, namespace_grace_s="0.2") as s:
        assert (await put(s, layout, list(range(8)))).stored == 2
        assert await s.namespaces() == 1
        assert (await s.admin.Flush(admin_pb2.FlushRequest())).blocks == 2
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while await s.namespaces():
            assert asyncio.get_running_loop().time() < deadline, "an emptied namespace was never forgotten"
            await asyncio.sleep(0.05)
        # Putting the layout again registers it again.
        assert (await put(s, layout, list(range(8)))).stored == 2
        assert await s.namespaces() == 1


async def test_blocks_recovered_from_ssd_are_adopted_by_the_first_read(tmp_path: Path) -> None:
    layout = made_up(3)
    ssd = {"ssd_path": str(tmp_path / "ssd"), "ssd_capacity": "8MiB", "ssd_region_size": "1MiB"}
    tokens = list(range(12))
    async with running(tmp_path, **ssd) as s:
        async with AsyncClient(s.target) as kv:
            blocks = [os.urandom(layout.bytes_per_block) for _ in range(3)]
            await kv.put(layout, tokens, blocks)
    async with running(tmp_path, **ssd) as s:
        assert await s.namespaces() == 0  # layouts are not kept across restarts
        for i in range(100):  # made-up layouts still register nothing
            await s.kv.Lookup(kvstore_pb2.LookupRequest(namespace=ns(made_up(1000 + i)), keys=tokens_keys(tokens)))
        assert await s.namespaces() == 0
        hit = await s.kv.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=tokens_keys(tokens)))
        assert hit.num_blocks == 3
        assert await s.namespaces() == 1
        listed = await s.admin.ListNamespaces(admin_pb2.ListNamespacesRequest())
        assert [(n.blocks, n.used_bytes) for n in listed.namespaces] == [(3, 3 * layout.bytes_per_block)]
        async with AsyncClient(s.target) as kv:
            assert await kv.fetch(layout, tokens) == blocks
