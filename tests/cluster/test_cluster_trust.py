"""Trust between the daemons of a pool (SECURITY.md, *Between the daemons of a pool*),
over real daemons: each node's credential proves that node and no other, and only while
it is a member of the view (static list or etcd); revoking one node leaves the others'
credentials as they are; a credential that cannot work stops the daemon at start; and
operator commands that act on the pool ask first, whatever runs them.

The credentials are used here from the test's own process, as a stranger who stole them
would use them from another host: what they can do is what the node could.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from pathlib import Path

import grpc
import pytest
from conftest import SMALL_LAYOUT, make_config

from kvstore.client import AsyncClient
from kvstore.cluster.membership import EtcdMembership, EtcdSettings, Member, MembershipState
from kvstore.convert import layout_to_proto
from kvstore.data_lane import ERROR, HELLO, VERSION, WELCOME, LaneSocket, hello_payload
from kvstore.errors import ConfigError
from kvstore.server.daemon import Daemon
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.cluster.cluster_fixtures import EtcdServer, etcd  # noqa: F401
from tests.cluster.pool_fixtures import Tokens, chain, pool, unix_target
from tests.procs import clean_env

LAYOUT = SMALL_LAYOUT


async def cli(*args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    """`kvstore ARGS` in a process of its own, its standard input a pipe holding `stdin`
    (not a terminal: what a script gives it)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvstore.cli", *args, env=clean_env(),
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_scripted_drain_asks_like_flush_and_drains_nothing_without_a_yes(tmp_path: Path) -> None:
    async with pool(tmp_path, 2) as (a, b):
        target = unix_target(b)
        for answer in (b"", b"n\n"):
            code, _, err = await cli("cluster", "drain", "--target", target, stdin=answer)
            assert code == 1 and "nothing drained" in err, (answer, code, err)
            assert not b.cluster.left and not b.cluster.draining
            assert set(a.cluster.membership.view.members) == {"n0", "n1"}
        code, out, _ = await cli("cluster", "drain", "--target", target, stdin=b"y\n")
        assert code == 0 and "left the pool" in out
        assert b.cluster.left


def lookup_request(tokens: list[int]) -> kvstore_pb2.LookupRequest:
    return kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(LAYOUT)),
                                     keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens)))


async def peer_lookup(daemon: Daemon, token: str, node: str, tenant: str, tokens: list[int]) -> int | grpc.StatusCode:
    """A node-to-node Lookup on `daemon` with `token`, naming `node` as its sender: the
    blocks found, or the status it was refused with."""
    md = (("authorization", f"Bearer {token}"), ("x-kvstore-peer", node), ("x-kvstore-tenant", tenant))
    async with grpc.aio.insecure_channel(daemon.bound[1]) as channel:
        try:
            resp = await kvstore_pb2_grpc.KVStoreStub(channel).Lookup(lookup_request(tokens), metadata=md, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return int(resp.num_blocks)


async def lane_hello(daemon: Daemon, token: str) -> int:
    """The kind of frame `daemon`'s data lane answers a hello with `token` with (the
    daemon runs on this loop: the socket is worked from a thread)."""
    assert daemon.data_lane is not None
    host, _, port = daemon.data_lane.endpoints()[0].address.rpartition(":")

    def hello() -> int:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            lane = LaneSocket(sock, 5.0)
            lane.send_frame(HELLO, block=VERSION, payload=hello_payload(token))
            return lane.read_frame().kind

    return await asyncio.to_thread(hello)


DENIED = grpc.StatusCode.PERMISSION_DENIED


async def test_a_node_credential_proves_one_node_and_only_while_it_is_a_member(tmp_path: Path) -> None:
    tokens = Tokens(tmp_path / "tokens.toml")
    async with pool(tmp_path, 3, auth_token_file=str(tokens.path), per_node=tokens.per_node(3)) as (a, b, c):
        tok, blocks = chain(LAYOUT, 8, seed=43)
        async with AsyncClient(a.bound[1], token=tokens.tokens["alpha"]) as kv:
            put = await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)
        assert put.owner_committed_blocks == put.forwarded_blocks > 0
        n1 = tokens.node("n1")
        assert await peer_lookup(a, n1, "n1", "alpha", tok) == 8
        # n1's credential is n1's alone: not another member, not "no node", not a stranger.
        for claimed in ("n2", "n0", "", "n9"):
            assert await peer_lookup(a, n1, claimed, "alpha", tok) == DENIED, claimed
        # A node's valid credential, in every token file, whose node is not a member.
        assert await peer_lookup(a, tokens.node("n5"), "n5", "alpha", tok) == DENIED
        assert await lane_hello(a, tokens.node("n5")) == ERROR
        assert await lane_hello(a, n1) == WELCOME
        # The shared form (a peer entry naming no node) is taken as any member, no one else.
        assert await peer_lookup(a, tokens.tokens["pool"], "n1", "alpha", tok) == 8
        assert await peer_lookup(a, tokens.tokens["pool"], "n9", "alpha", tok) == DENIED

        # Revoke n2 on n0 and n1 (its entry out, and the shared one, a reload): its
        # credential stops working there at once, and n0 and n1 still take each other's,
        # unchanged.
        for d in (a, b):
            tokens.write(Path(d.config.auth_token_file), without=["node.n2", "pool"])
            assert d.reload_tokens()
        assert await peer_lookup(a, tokens.node("n2"), "n2", "alpha", tok) == grpc.StatusCode.UNAUTHENTICATED
        assert await lane_hello(a, tokens.node("n2")) == ERROR
        # Nor is it placed there any more, though it keeps its place in the view: nothing
        # is forwarded to it or asked of it by the nodes that revoked it.
        for d in (a, b):
            placed = {m.member.node_id: m.placed for m in d.cluster.status().members}
            assert placed == {"n0": True, "n1": True, "n2": False}, placed
        assert await peer_lookup(a, n1, "n1", "alpha", tok) == 8
        tok2, blocks2 = chain(LAYOUT, 8, seed=44)
        async with AsyncClient(b.bound[1], token=tokens.tokens["alpha"]) as kv:
            put = await kv.put(LAYOUT, tok2, blocks2, wait_for_owners=True)
        assert put.owner_committed_blocks == put.forwarded_blocks > 0
        async with AsyncClient(a.bound[1], token=tokens.tokens["alpha"]) as kv:
            assert (await kv.lookup(LAYOUT, tok2)).num_blocks == 8
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tok2)] == blocks2


async def test_a_node_that_left_the_view_is_refused(tmp_path: Path, etcd: EtcdServer,  # noqa: F811
                                                    request: pytest.FixtureRequest) -> None:
    tokens = Tokens(tmp_path / "tokens.toml")
    prefix = f"/trust-{request.node.name[-20:]}"
    async with pool(tmp_path, 3, etcd=etcd.endpoint, prefix=prefix, auth_token_file=str(tokens.path),
                    per_node=tokens.per_node(3)) as (a, b, c):
        await a.cluster.membership.wait_for(lambda v: v.node_ids == {"n0", "n1", "n2"}, 10)
        tok, _ = chain(LAYOUT, 4, seed=45)
        n2 = tokens.node("n2")
        assert await peer_lookup(a, n2, "n2", "alpha", tok) == 0
        assert await lane_hello(a, n2) == WELCOME
        await c.stop(grace_s=0)  # it leaves every view (its lease revoked)
        await a.cluster.membership.wait_for(lambda v: v.node_ids == {"n0", "n1"}, 10)
        # Whoever holds n2's credential now, and from wherever: nothing on the pool.
        assert await peer_lookup(a, n2, "n2", "alpha", tok) == DENIED
        assert await lane_hello(a, n2) == ERROR
        assert await peer_lookup(a, tokens.node("n1"), "n1", "alpha", tok) == 0  # the others' are unchanged


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ("client", "role client"),
    ("stranger", "does not list"),
    ("n1", "credential of node 'n1'"),
])
async def test_a_cluster_credential_that_cannot_work_stops_the_daemon_at_start(
        tmp_path: Path, content: str, message: str) -> None:
    tokens = Tokens(tmp_path / "tokens.toml")
    secret = tmp_path / "bad.token"
    secret.write_text({"": "", "client": tokens.tokens["alpha"], "stranger": "kvs_not-in-the-file",
                       "n1": tokens.node("n1")}[content] + "\n")
    secret.chmod(0o600)
    cfg = make_config(tmp_path, cluster=True, node_id="n0", cluster_peers=("n0=127.0.0.1:1",),
                      auth_token_file=str(tokens.path), cluster_token_file=str(secret))
    with pytest.raises(ConfigError, match=message):
        await Daemon(cfg).start()


def etcd_settings(etcd: EtcdServer, prefix: str, **kw: object) -> EtcdSettings:
    return EtcdSettings(endpoints=(etcd.endpoint,), prefix=prefix, lease_ttl_s=2, call_timeout_s=1.0,
                        backoff_initial_s=0.1, backoff_max_s=0.5, join_timeout_s=5.0, **kw)  # type: ignore[arg-type]


async def until(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.05)


async def test_two_processes_with_one_node_id_both_say_so_and_the_newcomer_does_not_take_it(
        etcd: EtcdServer, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    prefix = f"/dup-{request.node.name[-16:]}-{time.monotonic_ns() % 10**9}"
    caplog.set_level(logging.ERROR, logger="kvstore.cluster.membership")
    first = EtcdMembership(Member("x", addresses=("10.0.0.1:5000",), started_at=time.time()),
                           etcd_settings(etcd, prefix))
    copy = EtcdMembership(Member("x", addresses=("10.0.0.2:5000",), started_at=time.time()),
                          etcd_settings(etcd, prefix))
    watcher = EtcdMembership(Member("w", addresses=("10.0.0.3:5000",)), etcd_settings(etcd, prefix))
    try:
        await first.start()
        await watcher.start()
        await watcher.wait_for(lambda v: v.node_ids == {"x", "w"}, 5)
        await copy.start()
        await until(lambda: copy.status().state is MembershipState.CONFLICT)
        st = copy.status()
        assert st.degraded and not st.registered and "10.0.0.1:5000" in st.node_id_conflict
        assert set(copy.view.members) == {"x"} and copy.view.members["x"].addresses == ("10.0.0.2:5000",)
        # The holder heard of it and says so too; the pool still sees the holder's record.
        await until(lambda: first.status().node_id_claims_total == 1)
        assert first.status().state is MembershipState.JOINED
        assert watcher.view.members["x"].addresses == ("10.0.0.1:5000",)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("registered by another live process" in m for m in errors), errors
        assert any("tried to join as node id x" in m for m in errors), errors
        # Once the holder leaves, the newcomer joins under the id.
        await first.aclose()
        await until(lambda: copy.status().state is MembershipState.JOINED)
        await watcher.wait_for(lambda v: "x" in v and v.members["x"].addresses == ("10.0.0.2:5000",), 5)
        assert copy.status().node_id_conflict == ""
    finally:
        for m in (copy, watcher, first):
            await m.aclose()


async def test_replace_node_id_takes_a_live_members_id_and_both_log_it(
        etcd: EtcdServer, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    prefix = f"/dup2-{request.node.name[-16:]}-{time.monotonic_ns() % 10**9}"
    caplog.set_level(logging.ERROR, logger="kvstore.cluster.membership")
    first = EtcdMembership(Member("x", addresses=("10.0.0.1:5000",)), etcd_settings(etcd, prefix))
    forced = EtcdMembership(Member("x", addresses=("10.0.0.2:5000",)), etcd_settings(etcd, prefix,
                                                                                     replace_node_id=True))
    try:
        await first.start()
        await forced.start()
        assert forced.status().state is MembershipState.JOINED
        await until(lambda: "another process registered node id" in first.status().last_error)
    finally:
        for m in (forced, first):
            await m.aclose()


async def test_a_daemon_whose_node_id_is_taken_says_so_in_health_and_info(
        tmp_path: Path, etcd: EtcdServer, request: pytest.FixtureRequest) -> None:  # noqa: F811
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.cluster.pool_fixtures import info

    prefix = f"/dup3-{request.node.name[-16:]}-{time.monotonic_ns() % 10**9}"
    async with pool(tmp_path, 2, etcd=etcd.endpoint, prefix=prefix) as (a, b):
        d = tmp_path / "copy"
        d.mkdir()
        cfg = make_config(d, listen=(f"unix:{d / 'kv.sock'}", "127.0.0.1:0"), cluster=True, node_id="n0",
                          cluster_etcd=(etcd.endpoint,), cluster_prefix=prefix, cluster_lease_ttl_s=2)
        copy = Daemon(cfg)
        await copy.start()
        try:
            await until(lambda: info(copy).get("cluster_state") == "conflict")
            assert "held by another process" in info(copy)["cluster_node_id_conflict"]
            async with grpc.aio.insecure_channel(copy.bound[0]) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="kvstore.v1.Cluster"))
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            await until(lambda: info(a).get("cluster_node_id_claims") == "1")
            assert info(a)["cluster_state"] == "joined"
            assert set(b.cluster.membership.view.members["n0"].addresses) == set(
                a.cluster.membership.me.addresses)
        finally:
            await copy.stop(grace_s=0)


async def test_member_records_no_peer_can_dial_are_skipped_and_counted(
        etcd: EtcdServer, request: pytest.FixtureRequest) -> None:  # noqa: F811
    import aetcd

    prefix = f"/wild-{request.node.name[-16:]}-{time.monotonic_ns() % 10**9}"
    me = EtcdMembership(Member("a", addresses=("10.0.0.1:5000",)), etcd_settings(etcd, prefix))
    async with aetcd.Client(host="127.0.0.1", port=etcd.client_port) as c:
        for node, addresses in (("wild", ("0.0.0.0:5000",)), ("multi", ("224.0.0.1:5000",)),
                                ("none", ()), ("mixed", ("[::]:5000", "10.0.0.7:5000"))):
            await c.put(f"{prefix}/members/{node}".encode(), Member(node, addresses=addresses).to_json())
        try:
            await me.start()
            view = await me.wait_for(lambda v: v.etcd_reachable and "mixed" in v, 5)
            assert set(view.members) == {"a", "mixed"}
            assert view.members["mixed"].addresses == ("10.0.0.7:5000",)
            assert me.status().unroutable_records_total == 3
        finally:
            await me.aclose()


async def forward_as(daemon: Daemon, token: str, node: str, tenant: str, layout, toks: list[int],  # type: ignore[no-untyped-def]
                     blocks: list[bytes]) -> int | grpc.StatusCode:
    """What a node's forward looks like to its owner: a Put stream made with a node's
    credential for `tenant`. Blocks stored, or the status it was refused with."""
    md = (("authorization", f"Bearer {token}"), ("x-kvstore-peer", node), ("x-kvstore-tenant", tenant))
    header = kvstore_pb2.PutHeader(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(layout)),
                                   keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=toks)),
                                   position=0, explicit_end=True)

    async def messages():  # type: ignore[no-untyped-def]
        yield kvstore_pb2.PutRequest(header=header)
        for i, b in enumerate(blocks):
            yield kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=i, data=bytes(b)))
        yield kvstore_pb2.PutRequest(end=kvstore_pb2.PutEnd())

    async with grpc.aio.insecure_channel(daemon.bound[1]) as channel:
        try:
            resp = await kvstore_pb2_grpc.KVStoreStub(channel).Put(messages(), metadata=md, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return int(resp.stored)


async def test_forged_bytes_from_a_member_are_served_as_hits_unless_the_tenant_authenticates(
        tmp_path: Path) -> None:
    """A member is trusted for the bytes it holds and forwards (SECURITY.md): one that is
    compromised (here, its credential used by the test) can plant bytes of its choosing
    under a tenant's chain, checksummed, and they are served as hits on every node. This
    test states that for a plain namespace. With end-to-end block authentication the same
    forgery is a miss: the tenant's key never reaches a daemon, so no member can seal."""
    from kvstore.client.block_auth import TAG_BYTES, AsyncAuthenticatedClient, BlockKey

    tokens = Tokens(tmp_path / "tokens.toml")
    key = BlockKey.generate()
    async with pool(tmp_path, 2, auth_token_file=str(tokens.path), per_node=tokens.per_node(2)) as (a, b):
        tok, blocks = chain(LAYOUT, 6, seed=46)
        forged = [bytes(x ^ 0xFF for x in blk) for blk in blocks]
        n1 = tokens.node("n1")
        async with AsyncClient(a.bound[1], token=tokens.tokens["alpha"]) as kv:
            auth = AsyncAuthenticatedClient(kv, key)
            sealed = auth.sealed_layout(LAYOUT)
            # A stranger cannot forward: a client's token, another node's id, a node not in the pool.
            assert await forward_as(a, tokens.tokens["beta"], "n1", "alpha", LAYOUT, tok, forged) == DENIED
            assert await forward_as(a, n1, "n0", "alpha", LAYOUT, tok, forged) == DENIED
            assert await forward_as(a, tokens.node("n5"), "n5", "alpha", LAYOUT, tok, forged) == DENIED
            assert (await kv.lookup(LAYOUT, tok)).num_blocks == 0
            # Member n1, with its own valid credential, forwards forged bytes for alpha.
            assert await forward_as(a, n1, "n1", "alpha", LAYOUT, tok, forged) == 6
            assert await forward_as(a, n1, "n1", "alpha", sealed, tok,
                                    [f + bytes(TAG_BYTES) for f in forged]) == 6
            # Plain namespace: the forgery is served as a hit, and alpha's own put finds
            # its blocks `existing` (documented in SECURITY.md; this is what the opt-in is for).
            assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == forged
            assert (await kv.put(LAYOUT, tok, blocks)).existing == 6
            # Authenticated: a miss, never the forged bytes.
            assert (await auth.lookup(LAYOUT, tok)).num_blocks == 6
            assert await auth.fetch(LAYOUT, tok) == []
            assert auth.stats.rejected_blocks == 1
        # And through the pool: alpha's sealed blocks put on b are verified on a.
        tok2, blocks2 = chain(LAYOUT, 6, seed=47)
        async with AsyncClient(b.bound[1], token=tokens.tokens["alpha"]) as kv:
            put = await AsyncAuthenticatedClient(kv, key).put(LAYOUT, tok2, blocks2, wait_for_owners=True)
            assert put.owner_committed_blocks == put.forwarded_blocks > 0
        async with AsyncClient(a.bound[1], token=tokens.tokens["alpha"]) as kv:
            auth = AsyncAuthenticatedClient(kv, key)
            assert (await auth.lookup(LAYOUT, tok2)).num_blocks == 6
            assert [bytes(g) for g in await auth.fetch(LAYOUT, tok2)] == blocks2
