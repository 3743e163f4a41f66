"""Daemons on one host forming a pool (static peer list, loopback TCP, real daemons on the
test's loop): a prefix put on one node is a hit on the others, byte-exact over gRPC and
shared memory; a chain held locally never asks the others; a put can wait for its
owners; another layout never serves; a dead node is a miss and becomes suspect; block
events carry the node id; the CLI shows members and placement; the settings are checked.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import SMALL_LAYOUT, make_config

from kvstore.client import AsyncClient, GroupKind, KVGroup, KVLayout
from kvstore.client.admin import AdminClient
from kvstore.core.store import Store
from kvstore.errors import ConfigError
from kvstore.hashing import block_hashes, namespace_id
from kvstore.server.config import load_config
from kvstore.server.daemon import Daemon
from kvstore.v1 import admin_pb2
from tests.cluster.pool_fixtures import chain, info, pool, unix_target
from tests.procs import clean_env

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = SMALL_LAYOUT


async def test_a_prefix_put_on_one_node_is_a_hit_on_every_node(tmp_path: Path) -> None:
    async with pool(tmp_path, 3) as (a, b, c):
        tokens, blocks = chain(LAYOUT, 40, seed=1)
        async with AsyncClient(unix_target(a)) as kv:
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        assert put.stored == 40 and put.forwarded_blocks == put.owner_committed_blocks > 0
        # B over gRPC bytes, C over shared memory: both byte-exact.
        async with AsyncClient(b.bound[1], data_plane="grpc") as kv:
            hit = await kv.lookup(LAYOUT, tokens)
            assert hit.num_blocks == 40 and 0 < hit.remote_blocks < 40
            assert hit.tiers.count("remote") == hit.remote_blocks and set(hit.tiers) == {"remote", "host"}
            got = await kv.fetch(LAYOUT, tokens)
            assert [bytes(g) for g in got] == blocks
            again = await kv.lookup(LAYOUT, tokens)
            assert (again.num_blocks, again.remote_blocks, set(again.tiers)) == (40, 0, {"host"})
        async with AsyncClient(unix_target(c), data_plane="local") as kv:
            hit = await kv.lookup(LAYOUT, tokens)
            assert hit.num_blocks == 40 and hit.remote_blocks > 0
            got = await kv.fetch(LAYOUT, tokens)
            assert [bytes(g) for g in got] == blocks
        for d in (b, c):
            st = info(d)
            assert int(st["cluster_pulled_blocks"]) > 0 and st["cluster_pull_checksum_failures"] == "0"


async def test_puts_and_fetches_on_the_data_lane_are_the_pools_too(tmp_path: Path) -> None:
    """A client on a node's data lane: its put is forwarded to the owners as a gRPC put
    is, and its fetch after a lookup waits for the blocks that lookup is copying in."""
    async with pool(tmp_path, 3) as (a, b, c):
        tokens, blocks = chain(LAYOUT, 40, seed=2)
        async with AsyncClient(a.bound[1], data_plane="lane") as kv:
            assert await kv.data_plane_in_use() == "lane"
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        assert put.stored == 40 and put.forwarded_blocks == put.owner_committed_blocks > 0
        for d in (b, c):
            async with AsyncClient(d.bound[1], data_plane="lane") as kv:
                hit = await kv.lookup(LAYOUT, tokens)
                assert hit.num_blocks == 40 and hit.remote_blocks > 0
                assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks
                stats = kv.data_lane_stats
                assert stats is not None and stats.bytes_received == 40 * LAYOUT.bytes_per_block


async def test_layouts_with_kv_groups_stay_on_the_node_that_computed_them(tmp_path: Path) -> None:
    """The pool carries whole blocks; a grouped layout's parts are neither forwarded nor
    looked for elsewhere: a hit where they were put, a plain miss on the other nodes."""
    hybrid = KVLayout(model="test/pool-hybrid", dtype="bfloat16", num_layers=2, num_kv_heads=1, head_dim=8,
                      block_size_tokens=4, groups=(
                          KVGroup("full", GroupKind.FULL, "bfloat16", (2, 1, 4, 1, 8)),
                          KVGroup("swa", GroupKind.SLIDING_WINDOW, "bfloat16", (2, 1, 4, 1, 8), window_tokens=5)))
    tokens = list(range(4 * 12))
    blocks = [{g.name: bytes([i]) * g.bytes_per_block for g in hybrid.groups} for i in range(12)]
    async with pool(tmp_path, 2) as (a, b):
        async with AsyncClient(unix_target(a)) as kv:
            put = await kv.put(hybrid, tokens, blocks, wait_for_owners=True)
            assert (put.stored, put.forwarded_blocks) == (12, 0)
            assert (await kv.lookup(hybrid, tokens)).num_blocks == 12
        async with AsyncClient(unix_target(b)) as kv:
            miss = await kv.lookup(hybrid, tokens)
            assert (miss.num_blocks, miss.remote_blocks) == (0, 0)
            assert await kv.fetch(hybrid, tokens) == []
        assert int(info(b)["cluster_remote_lookups"]) == 0


async def test_forwards_reach_their_owners_in_the_background(tmp_path: Path) -> None:
    async with pool(tmp_path, 3) as (a, b, c):
        tokens, blocks = chain(LAYOUT, 40, seed=11)
        async with AsyncClient(unix_target(a)) as kv:
            put = await kv.put(LAYOUT, tokens, blocks)
        assert put.forwarded_blocks > 0 and put.owner_committed_blocks == 0
        async with AsyncClient(unix_target(b)) as kv:
            for _ in range(200):
                if (await kv.lookup(LAYOUT, tokens)).num_blocks == 40:
                    break
                await asyncio.sleep(0.05)
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks
        assert int(info(a)["cluster_forwarded_blocks"]) == put.forwarded_blocks


async def test_a_fetch_without_a_lookup_first_serves_what_is_here(tmp_path: Path) -> None:
    """A fetch no lookup preceded asks nobody: it serves the prefix this node holds (here
    the units it owns, forwarded by the writer), byte-exact; a lookup then finds the rest."""
    async with pool(tmp_path, 2) as (a, b):
        tokens, blocks = chain(LAYOUT, 12, seed=8)  # b owns the first two units, not the third
        async with AsyncClient(unix_target(a)) as kv:
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        here = b.store.present(namespace_id(LAYOUT), b"".join(put.block_hashes)).find(bytes([Store.ABSENT]))
        assert 0 < here < 12
        async with AsyncClient(unix_target(b)) as kv:
            got = await kv.fetch(LAYOUT, tokens)
            assert [bytes(g) for g in got] == blocks[:here]
            st = info(b)
            assert (st["cluster_remote_lookups"], st["cluster_pulled_blocks"]) == ("0", "0")
            held = (await kv.lookup(LAYOUT, tokens)).num_blocks  # copies what is elsewhere
            got = await kv.fetch(LAYOUT, tokens)
            assert held == 12 and [bytes(g) for g in got] == blocks


async def test_a_chain_held_locally_never_asks_the_others(tmp_path: Path) -> None:
    async with pool(tmp_path, 3) as (a, b, c):
        tokens, blocks = chain(LAYOUT, 30, seed=3)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
            for _ in range(5):
                assert (await kv.lookup(LAYOUT, tokens)).num_blocks == 30
            assert (await kv.lookup(LAYOUT, tokens[: 10 * LAYOUT.block_size_tokens])).num_blocks == 10
        assert info(a)["cluster_remote_lookups"] == "0"
        async with AsyncClient(unix_target(b)) as kv:
            await kv.lookup(LAYOUT, tokens)
            await kv.fetch(LAYOUT, tokens)
            asked = info(b)["cluster_remote_lookups"]
            for _ in range(5):
                assert (await kv.lookup(LAYOUT, tokens)).num_blocks == 30
        assert info(b)["cluster_remote_lookups"] == asked == "1"


async def test_a_put_can_wait_for_its_owners(tmp_path: Path) -> None:
    async with pool(tmp_path, 3) as daemons:
        tokens, blocks = chain(LAYOUT, 24, seed=4)
        async with AsyncClient(unix_target(daemons[0])) as kv:
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        assert put.forwarded_blocks > 0 and put.owner_committed_blocks == put.forwarded_blocks
        # Every unit is held whole by each of its owners, and only there besides the writer.
        ns = daemons[0].store.namespaces()[0].namespace_id
        where = await asyncio.to_thread(_where, unix_target(daemons[0]), ns, tokens)
        by_id = {d.node_id: d for d in daemons}
        for unit in where.units:
            for owner in unit.owners:
                held = await asyncio.to_thread(_where, unix_target(by_id[owner]), ns, tokens)
                mine = next(u for u in held.units if u.start == unit.start)
                assert mine.held_here == unit.stop - unit.start


def _where(target: str, ns: bytes, tokens: list[int]) -> admin_pb2.ClusterWhereResponse:
    from kvstore.v1 import kvstore_pb2

    with AdminClient(target) as admin:
        return admin.cluster_where(kvstore_pb2.Namespace(id=ns),
                                   kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens)))


async def test_a_node_with_another_layout_never_serves(tmp_path: Path) -> None:
    async with pool(tmp_path, 3) as (a, b, c):
        tokens, blocks = chain(LAYOUT, 16, seed=5)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        other = replace(LAYOUT, num_layers=4)
        async with AsyncClient(unix_target(b)) as kv:
            miss = await kv.lookup(other, tokens)
            assert (miss.num_blocks, miss.remote_blocks) == (0, 0)
            assert await kv.fetch(other, tokens) == []
            assert (await kv.lookup(LAYOUT, tokens)).num_blocks == 16


async def test_a_dead_node_is_a_miss_within_the_deadline_and_becomes_suspect(tmp_path: Path) -> None:
    async with pool(tmp_path, 3, cluster_lookup_timeout_ms=200.0, cluster_suspect_s=30.0) as (a, b, c):
        tokens, blocks = chain(LAYOUT, 40, seed=7)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        await c.stop(grace_s=0)
        async with AsyncClient(unix_target(b)) as kv:
            for _ in range(4):
                began = time.monotonic()
                hit = await kv.lookup(LAYOUT, tokens)
                assert time.monotonic() - began < 0.2 + 1.0
                got = await kv.fetch(LAYOUT, tokens)
                assert [bytes(g) for g in got] == blocks[: len(got)]
                assert hit.num_blocks < 40  # some units were C's alone
        suspects = {m.member.node_id for m in b.cluster.status().members if m.suspect} if b.cluster else set()
        assert suspects == {"n2"}
        assert info(b)["cluster_suspect_peers"] == "1"


async def test_block_events_carry_the_node_id(tmp_path: Path) -> None:
    async with pool(tmp_path, 2) as (a, b):
        tokens, blocks = chain(LAYOUT, 4, seed=8)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks)

        def first_event() -> admin_pb2.Event:
            with AdminClient(unix_target(a)) as admin:
                return next(iter(admin.watch_events(snapshot=True, timeout_s=5)))

        event = await asyncio.to_thread(first_event)
        assert event.kind == admin_pb2.EVENT_STORED and event.node_id == "n0" and event.block_hashes


async def cli(*args: str) -> tuple[int, str, str]:
    """`kvstore ARGS` in a process of its own (the daemons run on this test's loop)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvstore.cli", *args, env=clean_env(),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_cli_shows_members_and_where_a_prefix_lives(tmp_path: Path) -> None:
    async with pool(tmp_path, 3) as (a, b, c):
        tokens, blocks = chain(LAYOUT, 10, seed=9)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        code, out, _ = await cli("cluster", "members", "--target", unix_target(b), "--json")
        members = json.loads(out)
        assert code == 0 and members["enabled"] and members["node_id"] == "n1"
        assert sorted(m["node_id"] for m in members["members"]) == ["n0", "n1", "n2"]
        assert all(m["placed"] and not m["suspect"] for m in members["members"])
        code, text, _ = await cli("cluster", "members", "--target", unix_target(b))
        assert code == 0 and "static membership" in text and "n1 *" in text
        ns = a.store.namespaces()[0].namespace_id.hex()
        code, out, _ = await cli("cluster", "where", ns, "--tokens", ",".join(map(str, tokens)),
                                 "--target", unix_target(a), "--json")
        where = json.loads(out)
        assert code == 0 and [(u["start"], u["stop"]) for u in where["units"]] == [(0, 1), (1, 2), (2, 4), (4, 6),
                                                                                  (6, 8), (8, 10)]
        assert all(u["held_here"] == u["stop"] - u["start"] and len(u["owners"]) == 1 for u in where["units"])
        code, text, _ = await cli("cluster", "where", ns, "--tokens", ",".join(map(str, tokens)),
                                  "--target", unix_target(a))
        assert code == 0 and "owners" in text
        # Careless token lists: a usage error that says what is wrong, never a traceback.
        for bad, why in (("1,x,3", "'x' is not a whole number"), ("-1", "out of range"),
                         (str(1 << 32), "out of range"), (" , ", "no token ids")):
            code, _, err = await cli("cluster", "where", ns, "--tokens", bad, "--target", unix_target(a))
            assert code == 2 and why in err and "Traceback" not in err, (bad, err)
        code, text, _ = await cli("cluster", "where", ns, "--tokens", "1,2", "--target", unix_target(a))
        assert code == 0 and "shorter than one block" in text


async def test_info_and_metrics_report_the_pool(tmp_path: Path) -> None:
    async with pool(tmp_path, 2) as (a, b):
        async with AsyncClient(unix_target(a)) as kv:
            text = await kv.info("cluster")
            full = await kv.info()
        assert "# Cluster" in text and "cluster_enabled:1" in text and "cluster_members:2" in text
        assert "# Cluster" in full
        tokens, blocks = chain(LAYOUT, 12, seed=10)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        async with AsyncClient(unix_target(b)) as kv:
            await kv.lookup(LAYOUT, tokens)  # asks a: per-peer series appear
        bodies = [await asyncio.to_thread(
            lambda d=d: urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=10).read().decode())
            for d in (a, b)]
        body = bodies[0]
        exported = {m for text in bodies for m in re.findall(r"^(kvstore_\w+?)(?:\{| )", text, re.MULTILINE)}
        dashboard = json.loads((ROOT / "deploy/grafana/kvstore-dashboard.json").read_text())
        used = {m for panel in dashboard["panels"] for t in panel.get("targets", ())
                for m in re.findall(r"\bkvstore_cluster_\w+", t["expr"])}
        assert used, "the dashboard has a cluster row"
        assert used <= exported, used - exported
        assert "kvstore_cluster_members 2.0" in body


async def test_a_single_daemon_says_it_is_not_in_a_pool(daemon: object) -> None:
    target = daemon.unix_target  # type: ignore[attr-defined]
    code, out, _ = await cli("cluster", "members", "--target", target)
    assert code == 0 and "not one of a pool" in out
    code, _, err = await cli("cluster", "drain", "--yes", "--target", target)
    assert code == 1 and "not one of a pool" in err
    async with AsyncClient(target) as kv:
        assert "cluster_enabled:0" in await kv.info("cluster")


@pytest.mark.parametrize("flags, message", [
    ({"cluster": "true"}, "names no members"),
    ({"cluster": "true", "cluster_etcd": "127.0.0.1:2379", "cluster_peers": "a=127.0.0.1:1"}, "not both"),
    ({"cluster_etcd": "127.0.0.1:2379"}, "cluster is off"),
    ({"cluster": "true", "cluster_etcd": "127.0.0.1:2379", "cluster_prefix": "kv"}, "start with '/'"),
    ({"cluster_lookup_timeout_ms": "0"}, "out of bounds"),
])
def test_cluster_settings_are_checked(flags: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(flags, env={})


def test_a_member_needs_a_stable_node_id_and_a_reachable_address(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, cluster=True, cluster_peers=("n0=127.0.0.1:1",))
    with pytest.raises(ConfigError, match="stable node id"):
        Daemon(cfg)
    with pytest.raises(ConfigError, match="not a valid node id"):
        Daemon(make_config(tmp_path, cluster=True, cluster_peers=("n0=127.0.0.1:1",), node_id="-bad"))
    kept = make_config(tmp_path, cluster=True, cluster_peers=("n0=127.0.0.1:1",), ssd_path=str(tmp_path / "ssd"),
                       ssd_capacity=4 << 20, ssd_region_size=1 << 20)
    node_id = Daemon(kept).node_id
    assert node_id and (tmp_path / "ssd" / "node-id").read_text().strip() == node_id
    assert Daemon(kept).node_id == node_id  # kept across restarts


async def test_a_static_list_must_name_this_node(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, cluster=True, cluster_peers=("other=127.0.0.1:1",), node_id="n0")
    d = Daemon(cfg)
    with pytest.raises(ConfigError, match="not in the static peer list"):
        await d.start()


def test_a_single_daemon_imports_no_cluster_code() -> None:
    import subprocess
    import sys

    code = ("import sys, kvstore.server.daemon, kvstore.cli.main; "
            "print(sorted(m for m in sys.modules if m.startswith(('kvstore.cluster', 'aetcd'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


async def test_a_node_is_asked_for_the_units_it_owns_before_the_others(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A node answers the prefix of the units asked of it that it holds: the units it owns
    go first, then those it is asked for as an extra or previous owner (which it may
    lack). Here on the general plan (R = 2), with the units' targets set by hand."""
    async with pool(tmp_path, 3, cluster_replicas=2) as (a, _, _):
        tokens, blocks = chain(LAYOUT, 4, seed=21)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks)  # the namespace is known on a
        packed = b"".join(block_hashes(LAYOUT.namespace_id, chain(LAYOUT, 8, seed=22)[0], LAYOUT.block_size_tokens))
        node = a.cluster
        assert node is not None and node.placement.owner_indices(packed[:16], 16) is None  # R = 2: general plan
        # 8 blocks, units of 2 after a one-block lead-in: 5 units, none held on a.
        owners = [("n1", "n2"), ("n2", "n0"), ("n1", "n2"), ("n2", "n0"), ("n1", "n2")]
        targets = [("n1", "n2"), ("n2", "n0", "n1"), ("n1", "n2"), ("n2", "n0", "n1"), ("n2", "n1")]
        monkeypatch.setattr(node.placement, "route_many", lambda keys: (owners[: len(keys)], targets[: len(keys)]))
        present = a.store.present(LAYOUT.namespace_id, packed)
        rnd = node.remote_lookup._round_from_held(LAYOUT.namespace_id, packed, 0, present)
        assert len(rnd.starts) == 5
        # By rank among the targets as placed (n0, the asking node, counted): owner, second
        # owner, previous owner.
        assert rnd.asks["n1"].tolist() == [0, 2, 4, 1, 3]
        assert rnd.asks["n2"].tolist() == [1, 3, 4, 0, 2]


async def test_cluster_advertise_beside_a_static_list_is_said_to_be_unused(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="kvstore.server.cluster"):
        async with pool(tmp_path, 2, per_node=[{"cluster_advertise": ("10.0.0.1:50052",)}]) as (a, _):
            assert a.cluster is not None
    said = [r.getMessage() for r in caplog.records if "cluster_advertise" in r.getMessage()]
    assert len(said) == 1 and "10.0.0.1:50052" in said[0] and "not used with a static peer list" in said[0]


async def test_past_the_grace_a_round_is_sent_before_what_is_held_is_read(tmp_path: Path) -> None:
    """Out of the grace after a change, a node sends its lookup round first and reads what
    it holds while the answers travel (`RemoteLookup._round_ahead`): hits stay whole and
    byte-exact, and a chain whose first block past the local prefix is the node's own
    unit asks nobody (its owner is the only node asked for it)."""
    async with pool(tmp_path, 3, cluster_grace_s=0) as (a, b, c):
        planned: list[int] = []
        for d in (b, c):
            assert d.cluster is not None and not d.cluster.placement.in_grace()
            lookup = d.cluster.remote_lookup
            plan = lookup._round_from_held
            lookup._round_from_held = (  # type: ignore[method-assign]
                lambda *args, _plan=plan: planned.append(1) or _plan(*args))
        tokens, blocks = chain(LAYOUT, 40, seed=21)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        for d in (b, c):
            async with AsyncClient(unix_target(d)) as kv:
                hit = await kv.lookup(LAYOUT, tokens)
                assert hit.num_blocks == 40 and hit.remote_blocks > 0
                assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks
        assert planned == []  # routed ahead, both times
        assert b.cluster is not None
        ns = a.store.namespaces()[0].namespace_id
        own = next(t for t in (chain(LAYOUT, 8, seed=100 + i)[0] for i in range(64))
                   if b.cluster.placement.owners(block_hashes(ns, t, LAYOUT.block_size_tokens)[0]) == ("n1",))
        asked = info(b)["cluster_remote_lookups"]
        async with AsyncClient(unix_target(b)) as kv:
            miss = await kv.lookup(LAYOUT, own)
        assert miss.num_blocks == 0 and info(b)["cluster_remote_lookups"] == asked


async def test_a_nodes_hit_ratio_counts_what_the_pool_answered_and_not_the_peers_lookups(tmp_path: Path) -> None:
    """A lookup on a node of the pool counts, in the node's stats, INFO and its namespace,
    the blocks its answer had, those other nodes held included; another node's lookup
    is counted in the pool's counters of the node it asked, not as that node's own."""
    async with pool(tmp_path, 2) as (a, b):
        tokens, blocks = chain(LAYOUT, 40, seed=12)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        a_before = a.store.counters.lookups
        async with AsyncClient(unix_target(b)) as kv:
            hit = await kv.lookup(LAYOUT, tokens)
            assert hit.num_blocks == 40 and 0 < hit.remote_blocks < 40
            c = (await kv.stats()).counters
        assert (c.lookups, c.lookup_blocks, c.hit_blocks, c.miss_blocks) == (1, 40, 40, 0)
        ns = b.store.namespace(namespace_id(LAYOUT))
        assert (ns.lookup_blocks, ns.hit_blocks) == (40, 40)
        assert a.store.counters.lookups == a_before  # b's round asked a: not one of a's lookups
        st = info(a)
        assert st["cluster_peer_lookups"] == "1"
        assert 0 < int(st["cluster_peer_hit_blocks"]) <= int(st["cluster_peer_lookup_blocks"])
        async with AsyncClient(unix_target(b)) as kv:  # a miss past what the pool holds is a miss
            longer, _ = chain(LAYOUT, 44, seed=12)
            hit = await kv.lookup(LAYOUT, longer)
            c = (await kv.stats()).counters
        assert hit.num_blocks == 40
        assert (c.lookups, c.lookup_blocks, c.hit_blocks, c.miss_blocks) == (2, 84, 80, 4)


async def test_a_tiers_hits_count_the_blocks_a_node_holds_past_its_local_prefix(tmp_path: Path) -> None:
    """The blocks of a node's answer it holds itself past where its local prefix ended
    (units it owns after one another node owns) are hits of the tier they are in, as the
    prefix's blocks are; the blocks other nodes hold are no tier's hits."""
    async with pool(tmp_path, 2) as (a, b):
        tokens, blocks = chain(LAYOUT, 40, seed=13)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        past_before = int(info(b)["cluster_local_past_prefix_blocks"])
        async with AsyncClient(unix_target(b)) as kv:
            before = {t.name: (t.hits, t.misses) for t in (await kv.stats()).tiers if t.present}
            hit = await kv.lookup(LAYOUT, tokens)
            after = {t.name: (t.hits, t.misses) for t in (await kv.stats()).tiers if t.present}
        assert hit.num_blocks == 40 and 0 < hit.remote_blocks < 40
        # The case this is about: b holds blocks past its local prefix.
        assert int(info(b)["cluster_local_past_prefix_blocks"]) > past_before
        assert set(hit.tiers) == {"remote", "host"}
        for name, (hits, misses) in after.items():
            held = hit.tiers.count(name)
            assert (hits - before[name][0], misses - before[name][1]) == (held, 40 - held), name


async def test_the_units_a_node_owns_are_kept_out_of_the_collectors_walks(tmp_path: Path) -> None:
    """Each node remembers the units it owns (for a drain's hand-off): tens of thousands
    on a busy node, kept as tuples of bytes that the garbage collector stops tracking,
    each with its blocks' hashes from the unit's first block on."""
    import gc

    async with pool(tmp_path, 3) as nodes:
        tokens, blocks = chain(LAYOUT, 40, seed=5)
        async with AsyncClient(unix_target(nodes[0])) as kv:
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        hashes = b"".join(put.block_hashes)
        gc.unfreeze()  # what the daemons' sweeps froze is out of a collection's reach
        gc.collect()
        owned = [u for d in nodes for u in d.cluster._owned.values()]
        assert owned and not any(gc.is_tracked(u) for u in owned)
        for _, key, position, packed, _ in owned:
            start = position * 16
            assert packed == hashes[start : start + len(packed)] and key == hashes[start : start + 16]
        # Every unit of the chain is remembered by its owner, from its first block to its last.
        assert sum(len(u[3]) for u in owned) == len(hashes)
