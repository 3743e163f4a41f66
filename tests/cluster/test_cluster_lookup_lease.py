"""A lookup's lease holds the whole answer in a pool, not only the local prefix: real
daemons (three on loopback, on the test's loop) with host tiers far smaller than what
they serve, four clients looking up chains on two nodes and fetching them at once. With
`lease_ms` every fetch returns every block its lookup promised, those copied from other
nodes and the replicas held past the prefix included (without a lease, some of them are
evicted first: a shorter prefix, never a wrong byte), and the fetches end every lease.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from conftest import SMALL_LAYOUT

from kvstore.client import AsyncClient
from tests.cluster.pool_fixtures import chain, pool, unix_target

LAYOUT = SMALL_LAYOUT  # 1 KiB blocks
HOST_BYTES = 512 << 10  # 512 blocks a node, for 3,840 blocks put


async def test_a_leased_lookup_then_fetch_gets_every_block_promised(tmp_path: Path) -> None:
    async with pool(tmp_path, 3, host_capacity=HOST_BYTES) as (a, b, c):
        chains = [chain(LAYOUT, 32, 2000 + i) for i in range(120)]
        async with AsyncClient(unix_target(a)) as kv:
            for tokens, blocks in chains:
                await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        promised = fetched = remote = 0

        async def engine(target: str, seed: int) -> None:
            nonlocal promised, fetched, remote
            rng = random.Random(seed)
            async with AsyncClient(target) as kv:
                for _ in range(40):
                    tokens, blocks = rng.choice(chains)
                    hit = await kv.lookup(LAYOUT, tokens, lease_ms=10_000)
                    got = await kv.fetch(LAYOUT, tokens[: hit.num_tokens], lease_id=hit.lease_id)
                    assert [bytes(g) for g in got] == blocks[: len(got)]
                    assert len(got) == hit.num_blocks, (len(got), hit.num_blocks, hit.remote_blocks)
                    promised += hit.num_blocks
                    fetched += len(got)
                    remote += hit.remote_blocks

        await asyncio.gather(*(engine(unix_target(d), k) for k, d in enumerate((b, c, b, c))))
        assert promised == fetched and remote > 0
        for d in (b, c):
            assert d.store.stats().leases_active == 0  # each fetch ended its lookup's lease
