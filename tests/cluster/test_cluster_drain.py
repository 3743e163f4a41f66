"""`kvstore cluster drain` on real daemons (a static pool of three on loopback, on the
test's loop; the CLI in a process of its own): a drain that cannot hand every owned unit
off exits 1, says how many and what becomes of their blocks, and its `--json` has the
counts; units no longer held when the drain comes to them are counted apart (nothing is
lost by not sending them)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import SMALL_LAYOUT

from kvstore.client import AsyncClient
from tests.cluster.pool_fixtures import chain, pool, unix_target
from tests.cluster.test_cluster_pool import cli

LAYOUT = SMALL_LAYOUT


async def test_a_drain_that_leaves_units_behind_exits_1_and_says_what_becomes_of_them(tmp_path: Path) -> None:
    async with pool(tmp_path, 3) as (a, b, c):
        chains = [chain(LAYOUT, 16, seed=300 + i) for i in range(12)]
        async with AsyncClient(unix_target(a)) as kv:
            for tokens, blocks in chains:
                put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
                assert put.owner_committed_blocks == put.forwarded_blocks
        async with AsyncClient(unix_target(b)) as kv:
            # n1 owns some units of every chain; those of the first are deleted there.
            assert await kv.delete(LAYOUT, chains[0][0]) > 0
        # n2 is gone (a static pool keeps it in every view): units whose next owner it
        # is cannot be handed off.
        await c.stop(grace_s=0)
        code, out, err = await cli("cluster", "drain", "--target", unix_target(b), "--yes", "--json",
                                   "--drain-timeout", "10")
        drained = json.loads(out)
        assert code == 1, (out, err)
        assert set(drained) == {"units_pushed", "blocks_pushed", "units_failed", "left", "units_gone"}
        assert drained["left"] and drained["units_pushed"] > 0 and drained["blocks_pushed"] >= drained["units_pushed"]
        assert drained["units_failed"] > 0 and drained["units_gone"] > 0
        # The same as people read it, on n0 (its units' next owners: n1, which left but
        # still answers its peers, and n2, which is gone).
        code, text, _ = await cli("cluster", "drain", "--target", unix_target(a), "--yes", "--drain-timeout", "10")
        assert code == 1 and "left the pool" in text
        assert "could not be handed off" in text and "their blocks stay on this daemon" in text
        code, text, err = await cli("cluster", "drain", "--target", unix_target(a), "--yes")
        assert code == 1 and "left the pool already" in (text + err)
