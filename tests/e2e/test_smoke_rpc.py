"""The README snippet, through the real daemon, over TCP and over the Unix socket."""

from __future__ import annotations

import os

from kvstore.client import AsyncClient, Client


def test_readme_roundtrip_sync(daemon_thread, layout):
    tokens = list(range(layout.block_size_tokens * 5 + 2))  # 5 full blocks + 2 spare tokens
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(5)]
    with Client(daemon_thread.tcp_target) as kv:
        kv.put(layout, tokens, blocks[:3])
        hit = kv.lookup(layout, tokens)
        assert (hit.num_blocks, hit.num_tokens) == (3, 3 * layout.block_size_tokens)
        assert hit.tiers == ["host"] * 3
        result = kv.put(layout, tokens, blocks[3:], first_block=hit.num_blocks)
        assert (result.stored, result.existing) == (2, 0)
        hit = kv.lookup(layout, tokens)
        assert hit.num_blocks == 5
        assert kv.fetch(layout, tokens[: hit.num_tokens]) == blocks


async def test_roundtrip_async_unix(daemon, layout):
    tokens = list(range(layout.block_size_tokens * 4))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(4)]
    async with AsyncClient(daemon.unix_target) as kv:
        await kv.put(layout, tokens, blocks)
        assert (await kv.lookup(layout, tokens)).num_blocks == 4
        assert await kv.fetch(layout, tokens) == blocks
