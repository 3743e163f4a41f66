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
import socket
import sys
from pathlib import Path

import grpc
import pytest
from conftest import SMALL_LAYOUT, make_config

from kvstore.client import AsyncClient
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

        # Revoke n2 on n0 and n1 (its entry out, a reload): its credential stops working
        # there at once, and n0 and n1 still take each other's, unchanged.
        for d in (a, b):
            tokens.write(Path(d.config.auth_token_file), without=["node.n2"])
            assert d.reload_tokens()
        assert await peer_lookup(a, tokens.node("n2"), "n2", "alpha", tok) == grpc.StatusCode.UNAUTHENTICATED
        assert await lane_hello(a, tokens.node("n2")) == ERROR
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
