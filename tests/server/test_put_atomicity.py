"""A Put commits only on a complete, uncancelled stream.

A client that sends every chunk and then cancels, runs past its deadline, or dies before
it half-closes the stream is told the put failed; the daemon must agree: nothing is
stored, nothing stays reserved. Raw stubs over the real daemon, as a client written from
the proto alone would drive it; a control case half-closes the same stream and is stored.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
import pytest

from kvstore.convert import layout_to_proto
from kvstore.layout import KVLayout
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

pytestmark = pytest.mark.asyncio

BLOCKS = 3
SETTLE_S = 0.3  # for the daemon to take in what the client wrote
WAIT_S = 10.0


def header(layout: KVLayout, tokens: list[int]) -> kvstore_pb2.PutRequest:
    keys = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))
    ns = kvstore_pb2.Namespace(layout=layout_to_proto(layout))
    return kvstore_pb2.PutRequest(header=kvstore_pb2.PutHeader(namespace=ns, keys=keys))


def chunk(block: int, data: bytes) -> kvstore_pb2.PutRequest:
    return kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=block, data=data))


async def lookup(stub: kvstore_pb2_grpc.KVStoreStub, layout: KVLayout, tokens: list[int]) -> int:
    ns = kvstore_pb2.Namespace(layout=layout_to_proto(layout))
    keys = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))
    return (await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns, keys=keys))).num_blocks


async def host_used(admin: admin_pb2_grpc.AdminStub) -> int:
    stats = await admin.Stats(admin_pb2.StatsRequest())
    return next(t.used_bytes for t in stats.tiers if t.name == "host")


async def stored_after(stub: kvstore_pb2_grpc.KVStoreStub, admin: admin_pb2_grpc.AdminStub, layout: KVLayout,
                       tokens: list[int]) -> int:
    """How many of the put's blocks a lookup finds once the daemon has settled the put:
    its slots given back (rolled back) or its blocks visible (stored)."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while await host_used(admin) and not await lookup(stub, layout, tokens):
        assert asyncio.get_running_loop().time() < deadline, "the put was neither stored nor rolled back"
        await asyncio.sleep(0.02)
    found = await lookup(stub, layout, tokens)
    if not found:
        assert await host_used(admin) == 0, "a rolled-back put left slots reserved"
    return found


async def send_all_but_close(stub: kvstore_pb2_grpc.KVStoreStub, layout: KVLayout, tokens: list[int],
                             timeout: float | None = None) -> grpc.aio.StreamUnaryCall:
    """A Put with its header and every byte of every block written, not half-closed."""
    call = stub.Put(timeout=timeout)
    await call.write(header(layout, tokens))
    for b in range(BLOCKS):
        await call.write(chunk(b, os.urandom(layout.bytes_per_block)))
    await asyncio.sleep(SETTLE_S)
    return call


@pytest.fixture(params=["tcp", "unix"])
async def stubs(request, daemon):
    target = daemon.tcp_target if request.param == "tcp" else daemon.unix_target
    async with grpc.aio.insecure_channel(target) as channel:
        yield kvstore_pb2_grpc.KVStoreStub(channel), admin_pb2_grpc.AdminStub(channel), target


async def test_a_half_closed_stream_is_stored(stubs, layout):
    stub, admin, _ = stubs
    tokens = list(range(BLOCKS * layout.block_size_tokens))
    call = await send_all_but_close(stub, layout, tokens)
    await call.done_writing()
    assert (await call).stored == BLOCKS
    assert await lookup(stub, layout, tokens) == BLOCKS


async def test_a_cancel_after_the_last_chunk_stores_nothing(stubs, layout):
    stub, admin, _ = stubs
    for attempt in range(5):
        tokens = list(range(attempt * 1000, attempt * 1000 + BLOCKS * layout.block_size_tokens))
        call = await send_all_but_close(stub, layout, tokens)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await stored_after(stub, admin, layout, tokens) == 0, f"attempt {attempt}: a cancelled put was stored"
    stats = await admin.Stats(admin_pb2.StatsRequest())
    assert stats.counters.puts == 0 and stats.counters.blocks_stored == 0
    assert stats.counters.put_failures == 5


async def test_a_put_past_its_deadline_stores_nothing(stubs, layout):
    stub, admin, _ = stubs
    for attempt in range(3):
        tokens = list(range(attempt * 1000, attempt * 1000 + BLOCKS * layout.block_size_tokens))
        call = await send_all_but_close(stub, layout, tokens, timeout=SETTLE_S + 0.5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await stored_after(stub, admin, layout, tokens) == 0, \
            f"attempt {attempt}: a put past its deadline was stored"
    assert (await admin.Stats(admin_pb2.StatsRequest())).counters.blocks_stored == 0


KILLED_CLIENT = """
import asyncio, os, sys
import grpc
from kvstore.convert import layout_to_proto
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

async def main(target, blocks):
    layout = KVLayout(model="test/tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
                      block_size_tokens=4)
    tokens = list(range(blocks * layout.block_size_tokens))
    ns = kvstore_pb2.Namespace(layout=layout_to_proto(layout))
    keys = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))
    channel = grpc.aio.insecure_channel(target)
    call = kvstore_pb2_grpc.KVStoreStub(channel).Put()
    await call.write(kvstore_pb2.PutRequest(header=kvstore_pb2.PutHeader(namespace=ns, keys=keys)))
    for b in range(blocks):
        data = os.urandom(layout.bytes_per_block)
        await call.write(kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=b, data=data)))
    print("sent", flush=True)
    await asyncio.sleep(3600)  # never half-closes: killed here

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def test_a_client_killed_after_its_last_chunk_leaves_nothing(stubs, layout):
    stub, admin, target = stubs
    tokens = list(range(BLOCKS * layout.block_size_tokens))
    for _attempt in range(2):
        client = await asyncio.create_subprocess_exec(sys.executable, "-c", KILLED_CLIENT, target, str(BLOCKS),
                                                      stdout=asyncio.subprocess.PIPE)
        try:
            assert client.stdout is not None
            assert await asyncio.wait_for(client.stdout.readline(), WAIT_S * 3) == b"sent\n"
            await asyncio.sleep(SETTLE_S)
            client.send_signal(signal.SIGKILL)
            await client.wait()
        finally:
            if client.returncode is None:
                client.kill()
                await client.wait()
        assert await stored_after(stub, admin, layout, tokens) == 0, f"a put of a client killed on {target} was stored"
    assert (await admin.Stats(admin_pb2.StatsRequest())).counters.blocks_stored == 0
