"""The pool's block bytes on the daemons' data lanes (real daemons on the test's loop):
pulls and forwards go over the lane (its counters move, the gRPC ones do not) and are
byte-exact; `cluster_data_lane = false` and a node with no lane mean gRPC; a block
flipped on the lane is never published nor served, and a lane cut mid-transfer is a miss
within the deadline; tenants stay apart on the lane; the pool's TLS settings are the
lane's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import SMALL_LAYOUT

from kvstore.client import AsyncClient
from kvstore.client.data_lane import DataLane, choose_endpoint
from kvstore.client.security import Security
from kvstore.convert import layout_to_proto
from kvstore.errors import KVStoreError
from kvstore.server.daemon import Daemon
from kvstore.v1 import kvstore_pb2
from tests.cluster.pki import make_pki
from tests.cluster.pool_fixtures import Tokens, chain, free_port, info, pool, unix_target
from tests.lane_proxy import LaneProxy

LAYOUT = SMALL_LAYOUT
BPB = LAYOUT.bytes_per_block


def counters(d: Daemon) -> dict[str, int]:
    """The transport counters of a node's INFO, as ints."""
    return {k[len("cluster_"):]: int(v) for k, v in info(d).items()
            if k.startswith(("cluster_lane_", "cluster_grpc_"))}


def lane_served(d: Daemon, name: str) -> int:
    """A counter of the daemon's own lane (`kvstore_datalane_*`)."""
    assert d.data_lane is not None
    return int(d.data_lane.counters.get(name))


@asynccontextmanager
async def proxied_pool(tmp_path: Path, n: int, proxied: int, mode: str, direction: str,
                       **overrides: Any) -> AsyncIterator[tuple[list[Daemon], LaneProxy]]:
    """A pool whose node `proxied` offers its lane behind a `LaneProxy`."""
    proxy = LaneProxy(mode, direction)
    port = free_port()
    proxy.upstream = ("127.0.0.1", port)
    per_node: list[dict[str, Any]] = [{} for _ in range(n)]
    per_node[proxied] = {"data_lane_listen": (f"127.0.0.1:{port}",), "data_lane_advertise": (proxy.address,)}
    try:
        async with pool(tmp_path, n, per_node=per_node, **overrides) as daemons:
            yield daemons, proxy
    finally:
        proxy.close()


async def test_pulls_and_forwards_move_on_the_lane_byte_exact(tmp_path: Path) -> None:
    async with pool(tmp_path, 3) as (a, b, c):
        tokens, blocks = chain(LAYOUT, 40, seed=31)
        async with AsyncClient(unix_target(a)) as kv:
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        assert put.owner_committed_blocks == put.forwarded_blocks > 0
        assert info(a)["cluster_data_lane"] == "1"
        sent = counters(a)
        assert sent["lane_blocks_out"] == put.forwarded_blocks
        assert sent["lane_bytes_out"] == put.forwarded_blocks * BPB
        assert sent["grpc_blocks_out"] == sent["grpc_bytes_out"] == sent["lane_fallbacks"] == 0
        assert lane_served(b, "committed_bytes_in") + lane_served(c, "committed_bytes_in") == put.forwarded_blocks * BPB
        async with AsyncClient(b.bound[1], data_plane="grpc") as kv:
            hit = await kv.lookup(LAYOUT, tokens)
            assert hit.num_blocks == 40 and hit.remote_blocks > 0
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks
        got = counters(b)
        pulled = int(info(b)["cluster_pulled_blocks"])
        assert pulled == hit.remote_blocks and info(b)["cluster_pull_checksum_failures"] == "0"
        assert got["lane_blocks_in"] == pulled and got["lane_bytes_in"] == pulled * BPB
        assert got["grpc_blocks_in"] == got["grpc_bytes_in"] == 0
        assert lane_served(a, "served_bytes_out") + lane_served(c, "served_bytes_out") == pulled * BPB
        # The same numbers in the metrics.
        text = b.metrics.exposition().decode()
        assert f'kvstore_cluster_lane_bytes_total{{direction="in"}} {float(pulled * BPB)}' in text
        assert 'kvstore_cluster_grpc_bytes_total{direction="in"} 0.0' in text


async def test_a_node_stops_with_no_lane_connection_left_open(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull cancelled by the stop while its thread still connects: the stop waits for
    the thread, and what it connected is closed (it would otherwise be left to the
    collector, or to nobody once the event loop is gone)."""
    made: list[Any] = []
    connected, release = threading.Event(), threading.Event()
    checkout = DataLane.checkout

    def slow_checkout(self: DataLane, count: int, timeout_s: float) -> Any:
        conns = checkout(self, count, timeout_s)
        made.extend(conns)
        connected.set()
        release.wait(10)  # concurrency timing: the thread is still busy when the stop comes
        return conns

    async with pool(tmp_path, 2) as (a, b):
        tokens, blocks = chain(LAYOUT, 40, seed=37)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        monkeypatch.setattr(DataLane, "checkout", slow_checkout)
        async with AsyncClient(unix_target(b)) as kv:
            looking = asyncio.ensure_future(kv.lookup(LAYOUT, tokens))  # pulls a's units from a
            assert await asyncio.to_thread(connected.wait, 10)
            timer = threading.Timer(0.3, release.set)
            timer.start()
            try:
                await b.stop(grace_s=0)
            finally:
                timer.cancel()
                release.set()
            with contextlib.suppress(KVStoreError):
                await looking
        assert made and all(conn.sock.fileno() == -1 for conn in made)


async def test_a_lane_closed_while_its_thread_connects_keeps_no_connection(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    async with pool(tmp_path, 1) as (a,):
        assert a._transfers is not None
        endpoint = choose_endpoint(a._transfers.offer(), a.bound[1])
        assert endpoint is not None
        lane = DataLane(endpoint, Security(""))
        made: list[Any] = []
        connect = DataLane._connect

        def connect_then_close(self: DataLane, timeout_s: float) -> Any:
            conn = connect(self, timeout_s)
            made.append(conn)
            self.close()  # concurrency timing: closed (the node stopping) while this thread connects
            return conn

        monkeypatch.setattr(DataLane, "_connect", connect_then_close)
        with pytest.raises(KVStoreError, match="was closed"):
            await asyncio.to_thread(lane.checkout, 2, 5.0)
        assert len(made) == 2 and all(conn.sock.fileno() == -1 for conn in made)


async def test_cluster_data_lane_off_moves_everything_through_grpc(tmp_path: Path) -> None:
    async with pool(tmp_path, 2, cluster_data_lane=False) as (a, b):
        tokens, blocks = chain(LAYOUT, 24, seed=32)
        async with AsyncClient(unix_target(a)) as kv:
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        assert put.owner_committed_blocks == put.forwarded_blocks > 0
        async with AsyncClient(unix_target(b)) as kv:
            assert (await kv.lookup(LAYOUT, tokens)).num_blocks == 24
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks
        sent, got = counters(a), counters(b)
        assert info(a)["cluster_data_lane"] == "0"
        assert sent["grpc_blocks_out"] == put.forwarded_blocks and sent["grpc_bytes_out"] == put.forwarded_blocks * BPB
        assert got["grpc_blocks_in"] == int(info(b)["cluster_pulled_blocks"]) > 0
        assert sent["lane_bytes_out"] == got["lane_bytes_in"] == 0
        assert lane_served(a, "transfers_fetch") == lane_served(b, "transfers_put") == 0


async def test_a_node_without_a_lane_is_used_through_grpc(tmp_path: Path) -> None:
    per_node: list[dict[str, Any]] = [{}, {"data_lane_listen": ("off",)}, {}]
    async with pool(tmp_path, 3, per_node=per_node) as (a, b, c):
        assert b.data_lane is None or not b.data_lane.endpoints()
        tokens, blocks = chain(LAYOUT, 40, seed=33)
        async with AsyncClient(unix_target(a)) as kv:
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        assert put.owner_committed_blocks == put.forwarded_blocks > 0
        sent = counters(a)
        # To n2 on its lane, to n1 (no lane) through gRPC, remembered: one offer asked.
        assert sent["lane_blocks_out"] > 0 and sent["grpc_blocks_out"] > 0
        assert sent["lane_blocks_out"] + sent["grpc_blocks_out"] == put.forwarded_blocks
        assert sent["lane_fallbacks"] >= 1
        for d in (b, c):
            async with AsyncClient(unix_target(d)) as kv:
                assert (await kv.lookup(LAYOUT, tokens)).num_blocks == 40
                assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks
            got = counters(d)
            assert got["lane_blocks_in"] + got["grpc_blocks_in"] == int(info(d)["cluster_pulled_blocks"]) > 0
        # n1 itself pulls over the others' lanes.
        assert counters(b)["lane_blocks_in"] > 0


async def test_a_block_flipped_on_the_lane_is_never_published_nor_served(tmp_path: Path) -> None:
    async with proxied_pool(tmp_path, 2, 0, "flip", "to_client") as ((a, b), proxy):
        tokens, blocks = chain(LAYOUT, 40, seed=34)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        async with AsyncClient(unix_target(b)) as kv:
            hit = await kv.lookup(LAYOUT, tokens)
            assert hit.remote_blocks > 0
            got = [bytes(g) for g in await kv.fetch(LAYOUT, tokens)]
            assert proxy.hits == 1
            # What is served is exact; the pull whose block was flipped kept nothing past it.
            assert got == blocks[: len(got)] and len(got) < 40
            assert info(b)["cluster_pull_checksum_failures"] == "1"
            # The holder's copy was never wrong: asked again (the proxy flips once), it all lands.
            for _ in range(100):
                if (await kv.lookup(LAYOUT, tokens)).num_blocks == 40:
                    break
                await asyncio.sleep(0.05)
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks
        assert a.store.stats().tiers[0].counters.checksum_failures == 0


async def test_a_block_flipped_on_its_way_to_an_owner_is_never_committed(tmp_path: Path) -> None:
    async with proxied_pool(tmp_path, 2, 1, "flip", "to_daemon") as ((a, b), proxy):
        tokens, blocks = chain(LAYOUT, 40, seed=35)
        async with AsyncClient(unix_target(a)) as kv:
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        assert proxy.hits == 1 and put.forwarded_blocks > 0
        assert put.owner_committed_blocks < put.forwarded_blocks
        assert int(info(a)["cluster_forward_failed_blocks"]) > 0
        assert lane_served(b, "blocks_rejected") == 1
        # Whatever the owner serves is exact (what it lacks it pulls from the writer).
        async with AsyncClient(unix_target(b)) as kv:
            assert (await kv.lookup(LAYOUT, tokens)).num_blocks == 40
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks


async def test_a_lane_cut_mid_transfer_is_a_miss_within_the_deadline(tmp_path: Path) -> None:
    async with proxied_pool(tmp_path, 2, 0, "cut", "to_client", cluster_suspect_s=0.2,
                            cluster_fetch_timeout_s=2.0) as ((a, b), proxy):
        tokens, blocks = chain(LAYOUT, 40, seed=36)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        async with AsyncClient(unix_target(b)) as kv:
            hit = await kv.lookup(LAYOUT, tokens)
            assert hit.remote_blocks > 0
            began = time.monotonic()
            got = [bytes(g) for g in await kv.fetch(LAYOUT, tokens)]
            assert time.monotonic() - began < 2.0 + 3.0
            assert proxy.hits == 1
            # The blocks from the cut one on are a miss (their runs rolled back); what is
            # served is exact.
            assert got == blocks[: len(got)] and len(got) < 40
            # Asked again (the holder suspect for a moment at most), the chain comes whole.
            for _ in range(200):
                if (await kv.lookup(LAYOUT, tokens)).num_blocks == 40:
                    break
                await asyncio.sleep(0.05)
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks


async def test_tenants_stay_apart_on_the_lane(tmp_path: Path) -> None:
    tokens = Tokens(tmp_path / "tokens.toml")
    async with pool(tmp_path, 2, auth_token_file=str(tokens.path), per_node=tokens.per_node(2)) as (a, b):
        tok, blocks = chain(LAYOUT, 24, seed=37)
        async with AsyncClient(a.bound[1], token=tokens.tokens["alpha"]) as kv:
            put = await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)
        assert put.owner_committed_blocks == put.forwarded_blocks > 0
        assert counters(a)["lane_blocks_out"] == put.forwarded_blocks
        async with AsyncClient(b.bound[1], token=tokens.tokens["alpha"]) as kv:
            assert (await kv.lookup(LAYOUT, tok)).num_blocks == 24
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == blocks
        assert counters(b)["lane_blocks_in"] > 0 and counters(b)["grpc_blocks_in"] == 0
        async with AsyncClient(b.bound[1], token=tokens.tokens["beta"]) as kv:
            miss = await kv.lookup(LAYOUT, tok)
            assert (miss.num_blocks, miss.remote_blocks) == (0, 0)
            assert await kv.fetch(LAYOUT, tok) == []

        # On a's lane: a transfer a node-to-node call from n1 opened for alpha is carried
        # by a connection of n1's credential, never by a client's (not even alpha's: it
        # knows the transfer id here) nor by another node's; and a node's credential
        # carries no client's transfer.
        from kvstore.cluster.transport import GrpcPeerTransport, PeerCall

        layout = layout_to_proto(LAYOUT)
        peer = GrpcPeerTransport("n1", token=tokens.node("n1"))
        peer.update({"n0": [a.bound[1]]})
        call = PeerCall.of("alpha", layout)
        try:
            offer = await peer.control("n0", call, "DataLane", kvstore_pb2.DataLaneRequest(), 5.0)
            endpoint = choose_endpoint(offer, a.bound[1])
            assert endpoint is not None

            async def open_fetch() -> kvstore_pb2.LaneFetchResponse:
                return await peer.control("n0", call, "LaneFetch", kvstore_pb2.LaneFetchRequest(
                    fetch=kvstore_pb2.FetchRequest(namespace=kvstore_pb2.Namespace(layout=layout),
                                                   keys=kvstore_pb2.BlockKeys(
                                                       tokens=kvstore_pb2.TokenIds(token_ids=tok))),
                    connections=1, timeout_ms=5000), 5.0)

            async def fetch_with(token: str, grant: kvstore_pb2.LaneFetchResponse) -> int:
                lane = DataLane(endpoint, Security(token))
                try:
                    conns = await asyncio.to_thread(lane.checkout, 1, 5.0)
                    dests = [memoryview(bytearray(BPB)) for _ in range(grant.num_blocks)]
                    n = await asyncio.to_thread(lane.fetch_into, conns, grant.transfer_id, BPB, dests, 5.0)
                    assert [bytes(d) for d in dests[:n]] == blocks[:n]
                    return int(n)
                finally:
                    lane.close()

            grant = await open_fetch()
            assert grant.num_blocks == 24
            for stranger in (tokens.tokens["beta"], tokens.tokens["alpha"], tokens.node("n0")):
                with pytest.raises(KVStoreError, match="not open"):
                    await fetch_with(stranger, grant)
            assert await fetch_with(tokens.node("n1"), await open_fetch()) == 24
        finally:
            await peer.aclose()
        # A client's own transfer is its tenant's alone: the pool's credential is no client.
        async with AsyncClient(a.bound[1], token=tokens.tokens["alpha"], data_plane="lane") as kv:
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == blocks
        for node_token in (tokens.node("n1"), tokens.tokens["pool"]):
            async with AsyncClient(a.bound[1], token=node_token, data_plane="lane") as kv:
                with pytest.raises(KVStoreError):
                    await kv.fetch(LAYOUT, tok)


async def test_the_pools_tls_settings_are_the_lanes(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    tls = {"tls_cert": str(pki / "node.pem"), "tls_key": str(pki / "node.key"), "tls_client_ca": str(pki / "ca.pem"),
           "cluster_tls_ca": str(pki / "ca.pem")}
    async with pool(tmp_path, 2, **tls) as (a, b):
        for d in (a, b):
            assert d.data_lane is not None and all(ep.tls for ep in d.data_lane.endpoints())
        tokens, blocks = chain(LAYOUT, 24, seed=38)
        async with AsyncClient(unix_target(a)) as kv:
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        assert put.owner_committed_blocks == put.forwarded_blocks > 0
        async with AsyncClient(unix_target(b)) as kv:
            assert (await kv.lookup(LAYOUT, tokens)).num_blocks == 24
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks
        assert counters(a)["lane_blocks_out"] == put.forwarded_blocks and counters(a)["grpc_blocks_out"] == 0
        assert counters(b)["lane_blocks_in"] > 0 and counters(b)["grpc_blocks_in"] == 0


@pytest.mark.parametrize("room_runs", [1, 0], ids=["room-for-one-run", "no-room"])
async def test_a_pull_without_room_for_all_of_it_keeps_what_fits_and_lets_the_holder_go_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room_runs: int) -> None:
    """The puller asks the holder before its put has room (it reserves while the holder
    opens its fetch): where room is found for fewer runs than it asked for, or none, the
    runs that fit land byte-exact, the rest is a miss, never an error, and the holder's
    fetch is taken whole (the part without room into scratch memory) so it lets go of its
    blocks at once, not at the fetch's deadline."""
    import kvstore.cluster.pull as pull_mod
    from kvstore.errors import ResourceExhausted

    real_begin = pull_mod._PullSink._begin

    def begin(self, runs):  # type: ignore[no-untyped-def]
        txn = real_begin(self, runs)
        if len(runs) > room_runs:
            async def no_room(*args: Any, **kwargs: Any) -> None:
                raise ResourceExhausted("no room for the pull (test)")
            txn.reserve = no_room
        return txn

    monkeypatch.setattr(pull_mod._PullSink, "_begin", begin)
    async with pool(tmp_path, 2, cluster_fetch_timeout_s=60.0) as (a, b):
        tokens, blocks = chain(LAYOUT, 40, seed=31)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
        assert a.data_lane is not None
        async with AsyncClient(unix_target(b)) as kv:
            hit = await kv.lookup(LAYOUT, tokens)
            assert hit.num_blocks == 40 and hit.remote_blocks > 0
            got = await kv.fetch(LAYOUT, tokens)
        assert [bytes(g) for g in got] == blocks[: len(got)] and len(got) < 40
        # Its connections went back to the pool once each, open.
        assert b.cluster is not None
        peer = b.cluster.transport._peers["n0"]  # type: ignore[attr-defined]
        idle = peer.lane._idle
        assert len({id(c) for c in idle}) == len(idle) and all(c.sock.fileno() >= 0 for c in idle)
        deadline = time.monotonic() + 10.0
        while len(a.data_lane.transfers) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(a.data_lane.transfers) == 0  # well before the fetch's 60 s deadline
        assert (int(info(b)["cluster_pulled_blocks"]) > 0) == bool(room_runs)
