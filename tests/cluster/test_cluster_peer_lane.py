"""The peer lane: the pool's unary node-to-node calls (lookups, the data lane's control
calls) on the control lane's framing over TCP (real daemons on the test's loop). Lookups
between nodes go on it and hit byte-exact; it checks what gRPC checks (the token at the
hello, the node and tenant each call names, only a pool's calls); a request without its
envelope is INVALID_ARGUMENT and the connection serves on; `peer_lane_listen = off`, a
single daemon, and a peer lane that goes away all mean gRPC, never an error; TLS is the
pool's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from conftest import SMALL_LAYOUT

import kvstore.cluster.peer_lane as peer_lane_module
from kvstore.client import AsyncClient
from kvstore.client.data_lane import LaneEndpoint
from kvstore.cluster.peer_lane import PeerLane
from kvstore.control_lane_wire import HEADER, HELLO, MAGIC, METHOD_IDS, frame, peer_envelope
from kvstore.convert import layout_to_proto
from kvstore.server.auth import DEFAULT_TENANT
from kvstore.server.daemon import Daemon
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.cluster.pki import make_pki
from tests.cluster.pool_fixtures import Tokens, chain, info, pool, unix_target

LAYOUT = SMALL_LAYOUT
OK = grpc.StatusCode.OK.value[0]


def calls(d: Daemon) -> tuple[int, int]:
    """(peer lane, gRPC) unary calls this node made to the others, from its INFO."""
    section = info(d)
    return int(section["cluster_peer_lane_calls"]), int(section["cluster_grpc_calls"])


def peer_lane_address(d: Daemon) -> tuple[str, int]:
    assert d._transfers is not None and d._transfers.peer_lane_endpoints
    host, _, port = d._transfers.peer_lane_endpoints[0].address.rpartition(":")
    return host, int(port)


class RawPeerLane:
    """One peer lane connection, spoken by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, d: Daemon, token: str) -> tuple[RawPeerLane, int]:
        """A connection and the status its hello got."""
        reader, writer = await asyncio.open_connection(*peer_lane_address(d))
        lane = cls(reader, writer)
        code, _ = await lane.roundtrip(frame(HELLO, MAGIC + token.encode()))
        return lane, code

    async def roundtrip(self, data: bytes) -> tuple[int, bytes]:
        self.writer.write(data)
        length, code = HEADER.unpack(await asyncio.wait_for(self.reader.readexactly(HEADER.size), 10))
        return code, await self.reader.readexactly(length)

    async def call(self, method: str, payload: bytes) -> tuple[int, bytes]:
        return await self.roundtrip(frame(METHOD_IDS[method], payload))

    async def close(self) -> None:
        self.writer.close()


def lookup_request(tokens: list[int]) -> bytes:
    return kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(LAYOUT)),
                                     keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))
                                     ).SerializeToString()


async def until_the_peer_lane_is_up(kv: AsyncClient, b: Daemon, seeds: range) -> None:
    """Lookups of fresh chains on `b` until one of its calls went on a peer lane (the
    first ones go over gRPC while it asks the others for their lanes)."""
    for seed in seeds:
        tok, _ = chain(LAYOUT, 8, seed=seed)
        await kv.lookup(LAYOUT, tok)
        if calls(b)[0]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no call went on the peer lane")


async def put_chains(d: Daemon, seeds: range, n: int = 8) -> None:
    async with AsyncClient(unix_target(d)) as kv:
        for seed in seeds:
            tok, blocks = chain(LAYOUT, n, seed=seed)
            await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)


async def remote_hit_once_the_peer_lane_is_up(a: Daemon, b: Daemon, n: int, seed: int) -> tuple[int, int]:
    """Put a chain on `a`; once `b` uses its peer lane, look it up and fetch it on `b`
    (a hit, part of it remote, byte-exact); `b`'s calls (peer lane, gRPC) just before."""
    await put_chains(a, range(100, 120))
    tok, blocks = chain(LAYOUT, n, seed=seed)
    async with AsyncClient(unix_target(a)) as kv:
        put = await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)
    assert put.forwarded_blocks > 0
    async with AsyncClient(unix_target(b)) as kv:
        await until_the_peer_lane_is_up(kv, b, range(100, 120))
        before = calls(b)
        hit = await kv.lookup(LAYOUT, tok)
        assert hit.num_blocks == n and hit.remote_blocks > 0
        assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == blocks
    return before


async def test_lookups_between_nodes_go_on_the_peer_lane_and_hit(tmp_path: Path) -> None:
    async with pool(tmp_path, 2) as (a, b):
        lane_before, grpc_before = await remote_hit_once_the_peer_lane_is_up(a, b, 24, seed=61)
        lane_after, grpc_after = calls(b)
        # The lookup and the pull's LaneFetch went on the peer lane, nothing on gRPC.
        assert lane_after >= lane_before + 2 and grpc_after == grpc_before
        assert a.peer_lanes and a.peer_lanes[0].calls > 0


async def test_the_peer_lane_checks_what_grpc_checks(tmp_path: Path) -> None:
    tokens = Tokens(tmp_path / "tokens.toml")
    async with pool(tmp_path, 2, auth_token_file=str(tokens.path), per_node=tokens.per_node(2)) as (a, b):
        tok, blocks = chain(LAYOUT, 4, seed=62)
        async with AsyncClient(a.bound[1], token=tokens.tokens["alpha"]) as kv:
            await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)
        req = lookup_request(tok)

        # No token, or a wrong one: refused at the hello.
        for token in ("", "not-a-token"):
            lane, code = await RawPeerLane.open(a, token)
            assert code == grpc.StatusCode.UNAUTHENTICATED.value[0], token
            await lane.close()

        lane, code = await RawPeerLane.open(a, tokens.node("n1"))
        assert code == OK
        try:
            # The tenant each call names is the one it acts for, as over gRPC.
            code, answer = await lane.call("Lookup", peer_envelope("n1", "alpha") + req)
            assert code == OK and kvstore_pb2.LookupResponse.FromString(answer).num_blocks == 4
            code, answer = await lane.call("Lookup", peer_envelope("n1", "beta") + req)
            assert code == OK and kvstore_pb2.LookupResponse.FromString(answer).num_blocks == 0
            refused = [
                ("Lookup", peer_envelope("n1", "nobody") + req, grpc.StatusCode.PERMISSION_DENIED),  # not in the file
                ("Delete", peer_envelope("n1", "alpha") + req, grpc.StatusCode.PERMISSION_DENIED),  # not a pool's call
                ("Lookup", b"", grpc.StatusCode.INVALID_ARGUMENT),  # no envelope
                ("Lookup", b"\x40ab", grpc.StatusCode.INVALID_ARGUMENT),  # an envelope cut short
                ("Lookup", peer_envelope("n1", "alpha") + b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT),
                # n1's credential acts as n1 only: not as another member, nor as a node not in the pool.
                ("Lookup", peer_envelope("n0", "alpha") + req, grpc.StatusCode.PERMISSION_DENIED),
                ("Lookup", peer_envelope("n9", "alpha") + req, grpc.StatusCode.PERMISSION_DENIED),
            ]
            for method, payload, status in refused:
                code, message = await lane.call(method, payload)
                assert code == status.value[0], (method, payload[:8], message)
            # The connection serves on after every refusal.
            code, answer = await lane.call("Lookup", peer_envelope("n1", "alpha") + req)
            assert code == OK and kvstore_pb2.LookupResponse.FromString(answer).num_blocks == 4
        finally:
            await lane.close()

        # A client's token passes the hello (it may look up for itself over gRPC), but may
        # not act for a tenant, itself included, on the peer lane.
        lane, code = await RawPeerLane.open(a, tokens.tokens["alpha"])
        try:
            assert code == OK
            code, _ = await lane.call("Lookup", peer_envelope("n9", "alpha") + req)
            assert code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        finally:
            await lane.close()

        # Nothing stored was touched by any of it.
        async with AsyncClient(b.bound[1], token=tokens.tokens["alpha"]) as kv:
            assert (await kv.lookup(LAYOUT, tok)).num_blocks == 4
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == blocks


async def test_without_a_peer_lane_lookups_go_over_grpc(tmp_path: Path) -> None:
    async with pool(tmp_path, 2, peer_lane_listen=("off",)) as (a, b):
        assert not a.peer_lanes and not b.peer_lanes
        tok, blocks = chain(LAYOUT, 16, seed=63)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)
        async with AsyncClient(unix_target(b)) as kv:
            for _ in range(3):
                assert (await kv.lookup(LAYOUT, tok)).num_blocks == 16
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == blocks
        lane, grpc_calls = calls(b)
        assert lane == 0 and grpc_calls > 0


async def test_a_single_daemon_offers_no_peer_lane(tmp_path: Path) -> None:
    from conftest import make_config

    d = tmp_path / "one"
    d.mkdir()
    daemon = Daemon(make_config(d, listen=(f"unix:{d / 'kv.sock'}", "127.0.0.1:0")))
    await daemon.start()
    try:
        assert not daemon.peer_lanes
        async with grpc.aio.insecure_channel(daemon.bound[0]) as channel:
            offer = await kvstore_pb2_grpc.KVStoreStub(channel).DataLane(kvstore_pb2.DataLaneRequest())
        assert offer.endpoints and not offer.peer_lane_endpoints
    finally:
        await daemon.stop()


async def test_a_peer_lane_that_goes_away_means_grpc_not_errors(tmp_path: Path) -> None:
    async with pool(tmp_path, 2) as (a, b):
        await put_chains(a, range(100, 120))
        tok, blocks = chain(LAYOUT, 16, seed=64)
        async with AsyncClient(unix_target(a)) as kv:
            await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)
        async with AsyncClient(unix_target(b)) as kv:
            await until_the_peer_lane_is_up(kv, b, range(100, 120))
            for lane in a.peer_lanes:  # its connections are cut, and no new one is accepted
                await lane.close()
            _, grpc_before = calls(b)
            hit = await kv.lookup(LAYOUT, tok)
            assert hit.num_blocks == 16 and hit.remote_blocks > 0
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == blocks
        assert calls(b)[1] > grpc_before


async def test_the_pools_tls_settings_are_the_peer_lanes(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    tls = {"tls_cert": str(pki / "node.pem"), "tls_key": str(pki / "node.key"), "tls_client_ca": str(pki / "ca.pem"),
           "cluster_tls_ca": str(pki / "ca.pem")}
    async with pool(tmp_path, 2, **tls) as (a, b):
        assert a._transfers is not None and all(ep.tls for ep in a._transfers.peer_lane_endpoints)
        lane_before, grpc_before = await remote_hit_once_the_peer_lane_is_up(a, b, 16, seed=65)
        assert calls(b)[0] > lane_before and calls(b)[1] == grpc_before
        # A plain connection to the TLS peer lane gets no answer it could read as one.
        reader, writer = await asyncio.open_connection(*peer_lane_address(a))
        writer.write(frame(HELLO, MAGIC))
        got = await asyncio.wait_for(reader.read(64), 10)
        writer.close()
        assert not got.startswith(HEADER.pack(8, OK))


async def test_a_call_given_up_at_its_deadline_leaves_a_fresh_connection_for_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A call that times out closes its connection (a late answer must not be read by the
    # next call); a replacement is made in the background at once, so the next call
    # finds one pooled rather than waiting for a connect and a hello of its own.
    # The daemons run on this loop: a deadline below the lane's 1 ms floor (lifted here)
    # is due in the loop turn that has the peer answer, before the answer is read.
    monkeypatch.setattr(peer_lane_module, "_left", lambda deadline: max(0.0, deadline - time.monotonic()))
    async with pool(tmp_path, 2) as (a, b):
        host, port = peer_lane_address(b)
        lane = PeerLane("b", LaneEndpoint("tcp", host, port), "", None)
        payload = peer_envelope("n0", DEFAULT_TENANT) + lookup_request(chain(LAYOUT, 4, seed=63)[0])
        try:
            assert kvstore_pb2.LookupResponse.FromString(await lane.call("Lookup", payload, 5.0)).num_blocks == 0
            (first,) = lane._idle
            with pytest.raises(TimeoutError):
                await lane.call("Lookup", payload, 1e-6)  # due before the answer can be read
            assert first.closed and first not in lane._idle
            warming = lane._warming
            assert warming is not None
            lane.warm()  # one attempt at a time
            assert lane._warming is warming
            for _ in range(500):
                if lane._idle:
                    break
                await asyncio.sleep(0.01)
            (fresh,) = lane._idle
            assert fresh is not first and not fresh.closed
            assert kvstore_pb2.LookupResponse.FromString(await lane.call("Lookup", payload, 5.0)).num_blocks == 0
            assert lane._idle == [fresh]  # the call went on it
        finally:
            lane.close()
