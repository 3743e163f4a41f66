"""A lookup's lease holds the whole answer in a pool, not only the local prefix: real
daemons (three on loopback, on the test's loop) with host tiers far smaller than what
they serve, four clients looking up chains on two nodes and fetching them at once. With
`lease_ms` every fetch returns every block its lookup promised, those copied from other
nodes and the replicas held past the prefix included (without a lease, some of them are
evicted first: a shorter prefix, never a wrong byte), and the fetches end every lease.

A pull that fails (its deadline passed on a loaded machine, no room for it) is a miss by
design, not a lease's failure: a fetch may come back short only while a pull of its node
failed (the node's `cluster_pull_failures` grew between its lookup and its fetch).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from conftest import SMALL_LAYOUT

from kvstore.client import AsyncClient
from kvstore.server.daemon import Daemon
from tests.cluster.pool_fixtures import chain, pool, unix_target

LAYOUT = SMALL_LAYOUT  # 1 KiB blocks
HOST_BYTES = 512 << 10  # 512 blocks a node, for 3,840 blocks put


async def test_a_leased_lookup_then_fetch_gets_every_block_promised(tmp_path: Path) -> None:
    async with pool(tmp_path, 3, host_capacity=HOST_BYTES) as (a, b, c):
        chains = [chain(LAYOUT, 32, 2000 + i) for i in range(120)]
        async with AsyncClient(unix_target(a)) as kv:
            for tokens, blocks in chains:
                await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        promised = fetched = remote = whole_with_remote = 0
        unexplained: list[tuple[int, int, int]] = []

        def pull_failures(d: Daemon) -> int:
            assert d.cluster is not None
            return d.cluster.puller.counters.failures

        async def engine(d: Daemon, seed: int) -> None:
            nonlocal promised, fetched, remote, whole_with_remote
            rng = random.Random(seed)
            async with AsyncClient(unix_target(d)) as kv:
                for _ in range(40):
                    tokens, blocks = rng.choice(chains)
                    failed = pull_failures(d)
                    hit = await kv.lookup(LAYOUT, tokens, lease_ms=10_000)
                    got = await kv.fetch(LAYOUT, tokens[: hit.num_tokens], lease_id=hit.lease_id)
                    assert [bytes(g) for g in got] == blocks[: len(got)]
                    if len(got) < hit.num_blocks and pull_failures(d) == failed:
                        unexplained.append((len(got), hit.num_blocks, hit.remote_blocks))
                    whole_with_remote += len(got) == hit.num_blocks and hit.remote_blocks > 0
                    promised += hit.num_blocks
                    fetched += len(got)
                    remote += hit.remote_blocks

        await asyncio.gather(*(engine(d, k) for k, d in enumerate((b, c, b, c))))
        assert unexplained == [], unexplained  # (fetched, promised, of them remote)
        assert remote > 0 and whole_with_remote > 0, (fetched, promised)  # pulls landed under leases
        for d in (b, c):
            assert d.store.stats().leases_active == 0  # each fetch ended its lookup's lease
