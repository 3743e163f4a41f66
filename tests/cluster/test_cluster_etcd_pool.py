"""A pool on a real etcd (Debian's etcd-server, one per module), daemons in-process on
loopback: a drained node hands its units off and leaves every view at once; with etcd
stopped the daemons keep serving on their last view and say so (health, INFO, metrics),
then rejoin when it is back; a fourth node moves about a quarter of the units and the
pool keeps answering through the change (previous owners are asked during the grace); a
member that places by another rule is never an owner.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import SMALL_LAYOUT
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import AsyncClient
from kvstore.server.daemon import Daemon
from tests.cluster.cluster_fixtures import EtcdServer, etcd  # noqa: F401
from tests.cluster.pool_fixtures import chain, info, pool, unix_target

pytest.importorskip("aetcd")

LAYOUT = SMALL_LAYOUT


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"/kvtest/{request.node.name}-{random.getrandbits(32):08x}"


async def wait_view(daemon: Daemon, ids: set[str], timeout_s: float = 10.0) -> None:
    assert daemon.cluster is not None
    await daemon.cluster.membership.wait_for(lambda v: v.node_ids == ids and v.etcd_reachable, timeout_s)


async def cluster_health(daemon: Daemon) -> int:
    async with grpc.aio.insecure_channel(unix_target(daemon)) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvstore.v1.Cluster"))
    return int(resp.status)


async def test_a_drained_node_hands_its_units_off_and_leaves(tmp_path: Path, etcd: EtcdServer, prefix: str) -> None:
    async with pool(tmp_path, 3, etcd=etcd.endpoint, prefix=prefix) as (a, b, c):
        for d in (a, b, c):
            await wait_view(d, {"n0", "n1", "n2"})
        chains = [chain(LAYOUT, 16, seed=100 + i) for i in range(6)]
        async with AsyncClient(unix_target(a)) as kv:
            for tok, blocks in chains:
                await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)
        assert b.cluster is not None
        result = await b.cluster.drain(timeout_s=20)
        assert result.left and result.units_pushed > 0 and result.units_failed == 0
        for d in (a, c):
            await wait_view(d, {"n0", "n2"}, timeout_s=2)
        # What b owned is on its next owners now: c answers every chain without b.
        await b.stop(grace_s=0)
        async with AsyncClient(unix_target(c)) as kv:
            for tok, blocks in chains:
                assert (await kv.lookup(LAYOUT, tok)).num_blocks == 16
                assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == blocks


async def test_with_etcd_gone_the_pool_serves_on_its_last_view_and_says_so(tmp_path: Path, etcd: EtcdServer,
                                                                            prefix: str) -> None:
    async with pool(tmp_path, 2, etcd=etcd.endpoint, prefix=prefix) as (a, b):
        for d in (a, b):
            await wait_view(d, {"n0", "n1"})
        assert await cluster_health(a) == health_pb2.HealthCheckResponse.SERVING
        etcd.stop()
        try:
            assert a.cluster is not None
            await a.cluster.membership.wait_for(lambda v: not v.etcd_reachable, 15)
            tok, blocks = chain(LAYOUT, 20, seed=200)
            async with AsyncClient(unix_target(a)) as kv:
                put = await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)
            assert put.owner_committed_blocks == put.forwarded_blocks > 0  # the last view still places units
            async with AsyncClient(unix_target(b)) as kv:
                hit = await kv.lookup(LAYOUT, tok)
                assert hit.num_blocks == 20
                assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == blocks
            st = info(a)
            assert st["cluster_degraded"] == "1" and st["cluster_etcd_reachable"] == "0"
            assert st["cluster_state"] == "unreachable" and st["cluster_members"] == "2"
            for _ in range(40):
                if await cluster_health(a) == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.1)
            assert await cluster_health(a) == health_pb2.HealthCheckResponse.NOT_SERVING
            async with grpc.aio.insecure_channel(unix_target(a)) as channel:
                served = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert served.status == health_pb2.HealthCheckResponse.SERVING  # the daemon itself serves on
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://{a.metrics_address}/metrics", timeout=10).read().decode())
            assert "kvstore_cluster_etcd_reachable 0.0" in body and "kvstore_cluster_degraded 1.0" in body
        finally:
            etcd.start()
        for d in (a, b):
            await wait_view(d, {"n0", "n1"}, timeout_s=20)
        assert info(a)["cluster_degraded"] == "0"
        for _ in range(40):
            if await cluster_health(a) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.1)
        assert await cluster_health(a) == health_pb2.HealthCheckResponse.SERVING


async def put_all(daemon: Daemon, chains: list[tuple[list[int], list[bytes]]]) -> None:
    """Put each chain through `daemon`, waiting for its units' owners."""
    async with AsyncClient(unix_target(daemon)) as kv:
        for tok, blocks in chains:
            await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)


async def assert_whole_hits(daemon: Daemon, chains: list[tuple[list[int], list[bytes]]]) -> None:
    """Every chain is a hit in full through `daemon`, and fetches byte-exact."""
    async with AsyncClient(unix_target(daemon)) as kv:
        assert [(await kv.lookup(LAYOUT, tok)).num_blocks for tok, _ in chains] == [len(b) for _, b in chains]
        for tok, blocks in chains:
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == blocks


async def test_in_the_grace_of_a_change_a_chain_put_since_hits_in_full(tmp_path: Path, etcd: EtcdServer,
                                                                      prefix: str) -> None:
    """Blocks put after a membership change are on their current owners only: a previous
    owner asked for a unit during the grace lacks it, and that must not cost the units it
    owns now (its answer is a prefix of the units asked of it). The daemons start one
    after another, so n0 and n1 are in the grace of the joins that followed theirs."""
    async with pool(tmp_path, 3, etcd=etcd.endpoint, prefix=prefix) as nodes:
        for d in nodes:
            await wait_view(d, {"n0", "n1", "n2"})
        chains = [chain(LAYOUT, 64, seed=400 + i) for i in range(4)]
        await put_all(nodes[2], chains)
        for x in nodes[:2]:
            assert x.cluster is not None and x.cluster.status().in_grace
            await assert_whole_hits(x, chains)


async def test_a_fourth_node_moves_about_a_quarter_of_the_units_and_hits_carry_on(
        tmp_path: Path, etcd: EtcdServer, prefix: str) -> None:
    rng = random.Random(300)
    keys = [rng.randbytes(16) for _ in range(4000)]
    async with pool(tmp_path, 3, etcd=etcd.endpoint, prefix=prefix) as three:
        for d in three:
            await wait_view(d, {"n0", "n1", "n2"})
        assert three[0].cluster is not None
        before = {k: three[0].cluster.placement.owners(k) for k in keys}  # on n0's view of three
        chains = [chain(LAYOUT, 24, seed=300 + i) for i in range(8)]
        await put_all(three[0], chains)
        async with pool(tmp_path, 1, etcd=etcd.endpoint, prefix=prefix, first=3) as (d,):
            for x in (*three, d):
                await wait_view(x, {"n0", "n1", "n2", "n3"})
            # Over the live views: the units that changed owner are those the newcomer wins,
            # 25% +- 3% of them (docs/cluster.md), and every node computes the same owners.
            after = {k: three[0].cluster.placement.owners(k) for k in keys}
            moved = [k for k in keys if before[k] != after[k]]
            assert abs(len(moved) / len(keys) - 0.25) < 0.03
            assert all(after[k] == ("n3",) for k in moved)
            for x in (*three[1:], d):
                assert x.cluster is not None
                assert all(x.cluster.placement.owners(k) == after[k] for k in keys)
            # Every chain still hits in full from the newcomer and from the old nodes: the
            # units n3 owns now are looked up on their previous owners during the grace.
            for x in (d, three[1]):
                await assert_whole_hits(x, chains)
            assert three[1].cluster is not None and three[1].cluster.status().in_grace
            # The traffic rebuilt the newcomer's units: each copy found on a previous owner
            # was also pushed to the unit's owner now, so n3 holds what it owns.
            assert d.cluster is not None
            ns = d.store.namespaces()[0].namespace_id
            for _ in range(100):
                owned = [u for tok, _ in chains for u in d.cluster.where(ns, _hashes(d, ns, tok))
                         if "n3" in u.owners]
                if owned and all(u.held_here == u.stop - u.start for u in owned):
                    break
                await asyncio.sleep(0.1)
            assert owned and all(u.held_here == u.stop - u.start for u in owned)


async def test_nodes_with_another_placement_rule_are_never_owners(tmp_path: Path, etcd: EtcdServer, prefix: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """One pool whose third member places by another rule (another unit size): every node
    sees all three, but a node never makes a member with another rule an owner, and says
    so once in its log; the units of a chain put on n0 go to n0 and n1 only."""
    with caplog.at_level("ERROR", logger="kvstore.cluster.pool"):
        async with pool(tmp_path, 3, etcd=etcd.endpoint, prefix=prefix,
                        per_node=[{}, {}, {"cluster_unit_blocks": 8}]) as (a, b, c):
            for d in (a, b, c):
                await wait_view(d, {"n0", "n1", "n2"})
            placed = {d.node_id: [m.member.node_id for m in d.cluster.status().members if m.placed]
                      for d in (a, b, c) if d.cluster is not None}
            assert placed == {"n0": ["n0", "n1"], "n1": ["n0", "n1"], "n2": ["n2"]}
            tokens, blocks = chain(LAYOUT, 8, seed=6)
            async with AsyncClient(unix_target(a)) as kv:
                put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
            assert put.owner_committed_blocks == put.forwarded_blocks
            assert a.cluster is not None
            units = a.cluster.where(a.store.namespaces()[0].namespace_id, list(put.block_hashes))
            assert units and all(set(u.owners) <= {"n0", "n1"} for u in units)
            async with AsyncClient(unix_target(b)) as kv:
                assert (await kv.lookup(LAYOUT, tokens)).num_blocks == 8
    said = [r.getMessage() for r in caplog.records if "places by" in r.getMessage()]
    # n0 and n1 about n2, n2 about each of them: once per node and member, whatever the views since.
    assert sorted(m.split()[2] for m in said) == ["n0", "n1", "n2", "n2"]
    assert all("it is not used as an owner" in m for m in said)
    assert all("places by 'units=8," in m for m in said if m.split()[2] == "n2")


def _hashes(daemon: Daemon, ns: bytes, tokens: list[int]) -> list[bytes]:
    from kvstore.hashing import token_bytes

    return daemon.store.hashes_for_tokens(ns, token_bytes(tokens))
