"""The SDK against the real daemon: tensors, caller buffers, hashes, pins, deletes, chunking."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvstore.client import AsyncClient, Client, block_hashes
from kvstore.errors import InvalidArgument


def test_import_does_not_pull_torch():
    code = "import sys, kvstore, kvstore.client; sys.exit(1 if 'torch' in sys.modules or 'cupy' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_tensors_in_and_out(daemon_thread, layout):
    tokens = list(range(layout.block_size_tokens * 3))
    shape = (2, layout.num_layers, layout.block_size_tokens, layout.num_kv_heads, layout.head_dim)
    blocks = [torch.randn(shape, dtype=torch.float16) for _ in range(3)]
    out = [torch.empty(shape, dtype=torch.float16) for _ in range(3)]
    with Client(daemon_thread.unix_target) as kv:
        kv.put(layout, tokens, blocks)
        got = kv.fetch(layout, tokens, out=out)
        assert len(got) == 3 and all(g is o for g, o in zip(got, out))
        assert all(torch.equal(a, b) for a, b in zip(blocks, out))
        as_bytes = kv.fetch(layout, tokens)
        assert as_bytes[1] == blocks[1].numpy().tobytes()


def test_bfloat16_and_numpy_blocks(daemon_thread):
    from kvstore.client import KVLayout

    layout = KVLayout(model="bf", dtype="bfloat16", num_layers=1, num_kv_heads=1, head_dim=8, block_size_tokens=2)
    tokens = [5, 6, 7, 8]
    t = torch.randn(2, 1, 2, 1, 8, dtype=torch.bfloat16)
    arr = np.frombuffer(os.urandom(layout.bytes_per_block), dtype=np.uint8).copy()
    with Client(daemon_thread.tcp_target) as kv:
        kv.put(layout, tokens, [t, arr])
        out = [torch.empty_like(t), np.zeros_like(arr)]
        kv.fetch(layout, tokens, out=out)
        assert torch.equal(out[0], t) and np.array_equal(out[1], arr)


def test_out_buffers_limit_the_fetch(daemon_thread, layout):
    tokens = list(range(layout.block_size_tokens * 4))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(4)]
    out = [bytearray(layout.bytes_per_block) for _ in range(2)]
    with Client(daemon_thread.tcp_target) as kv:
        kv.put(layout, tokens, blocks)
        got = kv.fetch(layout, tokens, out=out)
        assert [bytes(b) for b in got] == blocks[:2]
        with pytest.raises(InvalidArgument, match="read-only"):
            kv.fetch(layout, tokens, out=[bytes(layout.bytes_per_block)])
        with pytest.raises(InvalidArgument, match="holds"):
            kv.fetch(layout, tokens, out=[bytearray(10)])


def test_client_side_hashes_match_server_side(daemon_thread, layout):
    tokens = list(range(100, 100 + layout.block_size_tokens * 3))
    hashes = block_hashes(layout.namespace_id, tokens, layout.block_size_tokens)
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(3)]
    with Client(daemon_thread.tcp_target) as kv:
        put = kv.put(layout, None, blocks, block_hashes=hashes)
        assert put.block_hashes == hashes
        hit = kv.lookup(layout, tokens)
        assert hit.num_blocks == 3 and hit.block_hashes == hashes
        assert kv.fetch(layout, block_hashes=hashes) == blocks


def test_large_blocks_stream_in_chunks(daemon_thread):
    from kvstore.client import KVLayout

    layout = KVLayout(model="big", dtype="float16", num_layers=4, num_kv_heads=8, head_dim=128, block_size_tokens=64)
    assert layout.bytes_per_block == 1 << 20
    tokens = list(range(64 * 3))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(3)]
    with Client(daemon_thread.tcp_target, chunk_bytes=300_000) as kv:
        kv.put(layout, tokens, blocks)
        assert kv.fetch(layout, tokens) == blocks


def test_pin_delete_and_lease_roundtrip(daemon_thread, layout):
    tokens = list(range(layout.block_size_tokens * 2))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(2)]
    with Client(daemon_thread.tcp_target) as kv:
        kv.put(layout, tokens, blocks)
        pin = kv.pin(layout, tokens, ttl_ms=10_000)
        assert pin.pinned == 2 and pin.lease_id
        assert kv.unpin(pin.lease_id) is True
        hit = kv.lookup(layout, tokens, lease_ms=10_000)
        assert hit.lease_id
        assert kv.fetch(layout, tokens, lease_id=hit.lease_id) == blocks
        assert kv.unpin(hit.lease_id) is False  # the fetch released it
        assert kv.delete(layout, tokens) == 2
        assert kv.lookup(layout, tokens).num_blocks == 0
        assert kv.fetch(layout, tokens) == []


def test_sdk_rejects_bad_arguments_before_sending(layout):
    with Client("127.0.0.1:1") as kv:  # nothing listens there; none of these may reach the wire
        with pytest.raises(InvalidArgument, match="exactly one"):
            kv.lookup(layout)
        with pytest.raises(InvalidArgument, match="bytes-like"):
            kv.put(layout, [1, 2, 3, 4], [object()])
        with pytest.raises(InvalidArgument, match="KVLayout"):
            kv.lookup("not a layout", [1, 2, 3, 4])  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="first_block"):
            kv.put(layout, [1, 2, 3, 4], [bytes(layout.bytes_per_block)], first_block=-1)


def test_unreachable_daemon_is_unavailable(layout):
    from kvstore.errors import Unavailable

    with Client("127.0.0.1:1", timeout_s=2) as kv:
        with pytest.raises(Unavailable, match="is it running"):
            kv.lookup(layout, [1, 2, 3, 4])


async def test_async_client_concurrent_puts_and_reads(daemon, layout):
    import asyncio

    async with AsyncClient(daemon.unix_target) as kv:
        prompts = [list(range(i * 1000, i * 1000 + layout.block_size_tokens * 3)) for i in range(8)]
        payloads = [[os.urandom(layout.bytes_per_block) for _ in range(3)] for _ in prompts]
        await asyncio.gather(*(kv.put(layout, p, b) for p, b in zip(prompts, payloads)))
        got = await asyncio.gather(*(kv.fetch(layout, p) for p in prompts))
        assert got == payloads


def test_blocks_larger_than_a_chunk_come_back_whole_over_grpc(tmp_path):
    from dataclasses import replace

    from conftest import daemon_in_thread, make_config

    from kvstore.client import KVLayout

    cfg = replace(make_config(tmp_path), chunk_bytes=4096)  # a 64 KiB block is 16 messages
    layout = KVLayout(model="chunks", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64,
                      block_size_tokens=64)
    tokens = list(range(64 * 3))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(3)]
    with daemon_in_thread(cfg) as daemon, Client(daemon.tcp_target, data_plane="grpc") as kv:
        kv.put(layout, tokens, blocks)
        assert kv.fetch(layout, tokens) == blocks
        out = [bytearray(layout.bytes_per_block) for _ in range(3)]
        kv.fetch(layout, tokens, out=out)
        assert [bytes(o) for o in out] == blocks
