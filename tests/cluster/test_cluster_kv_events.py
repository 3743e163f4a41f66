"""KV events in a pool: each node publishes its own blocks, with its node id as the
events' `ownership`, and forwards carry the engine's names so an owner publishes a
forwarded block under the name the engine gave it. A router that reads every node's
stream (one pool-level view: the union, by ownership) predicts what a lookup on any node
finds: a prefix held by any node is a hit from every node. Checked against real lookups.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from conftest import SMALL_LAYOUT

from kvstore.client import AsyncClient, EngineNames
from kvstore.server.daemon import Daemon
from tests.cluster.pool_fixtures import chain, pool, unix_target
from tests.kv_events_reader import StreamReader

LAYOUT = SMALL_LAYOUT
N = 24


# The daemons run on the test's own loop: a reader waits in a thread (asyncio.to_thread),
# or the daemons could not publish what it waits for.


def reader(d: Daemon) -> StreamReader:
    assert d.kv_events is not None
    endpoint, replay = d.kv_events.bound["default"]
    return StreamReader(endpoint, replay)


def held(events: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """The blocks a stream says its node holds: name -> the BlockStored that named it last."""
    out: dict[Any, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "AllBlocksCleared":
            out.clear()
        elif e["type"] == "BlockStored":
            out.update({h: e for h in e["block_hashes"]})
        elif e["type"] == "BlockRemoved":
            for h in e["block_hashes"]:
                out.pop(h, None)
    return out


def predicted(names: list[int], views: list[dict[Any, Any]]) -> int:
    """The router's rule: the longest prefix whose every block some node holds."""
    n = 0
    for name in names:
        if not any(name in v for v in views):
            break
        n += 1
    return n


async def test_a_router_reading_every_node_knows_what_the_pool_holds(tmp_path: Path) -> None:
    streams = {"kv_events_endpoint": ("tcp://127.0.0.1:0",), "kv_events_replay_endpoint": ("tcp://127.0.0.1:0",)}
    async with pool(tmp_path, 2, **streams) as (a, b):
        ra, rb = reader(a), reader(b)
        try:
            tokens, blocks = chain(LAYOUT, N, seed=3)
            names = [7000 + i for i in range(N)]
            async with AsyncClient(unix_target(a)) as kv:
                put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True, engine_names=EngineNames(names))
            assert put.owner_committed_blocks == put.forwarded_blocks > 0

            va = held(await asyncio.to_thread(ra.wait_for, lambda ev: len(held(ev)) == N, "node a's blocks"))
            vb = held(await asyncio.to_thread(rb.wait_for, lambda ev: len(held(ev)) >= put.forwarded_blocks,
                                              "the forwards on node b"))
            # Each node says it holds the blocks under the engine's names, with its own id.
            assert set(va) == set(names)
            assert set(vb) <= set(names) and len(vb) == put.forwarded_blocks
            assert {e["ownership"] for e in va.values()} == {"n0"} and {e["ownership"] for e in vb.values()} == {"n1"}
            # A forwarded block carries the put's tokens and its parent's engine name.
            for name, e in vb.items():
                i = e["block_hashes"].index(name)
                assert e["token_ids"][i * LAYOUT.block_size_tokens:(i + 1) * LAYOUT.block_size_tokens] == \
                    tokens[(name - 7000) * LAYOUT.block_size_tokens:(name - 6999) * LAYOUT.block_size_tokens]
                parent = e["block_hashes"][i - 1] if i else e["parent_block_hash"]
                assert parent == (name - 1 if name > 7000 else None)

            # The pool's view predicts every node's lookup.
            assert predicted(names, [va, vb]) == N
            for d in (a, b):
                async with AsyncClient(unix_target(d)) as kv:
                    assert (await kv.lookup(LAYOUT, tokens)).num_blocks == N, d.node_id
            # Node a drops its copies: what node b owns stays a hit from both nodes, and
            # the view says so. (Node b's lookup above copied the rest of the chain into
            # it; those copies are published under kvstore's hashes, so the view counts
            # them for no node: it can miss a hit there, never promise a miss.)
            async with AsyncClient(unix_target(a)) as kv:
                await kv.delete(LAYOUT, tokens)
            va = held(await asyncio.to_thread(ra.wait_for, lambda ev: not held(ev), "node a emptied"))
            vb = held(rb.events())
            expect = predicted(names, [va, vb])
            assert expect < N
            async with AsyncClient(unix_target(a)) as kv:
                assert (await kv.lookup(LAYOUT, tokens)).num_blocks == expect
            async with AsyncClient(unix_target(b)) as kv:
                assert (await kv.lookup(LAYOUT, tokens)).num_blocks >= expect
        finally:
            ra.close()
            rb.close()
