"""Tenants across a pool: the daemons share one token file (the same tenants and salts on
every node) and authenticate each other with a peer credential. A tenant's blocks are a
hit on every node for that tenant and never for another; a forwarded put is filed under
the original tenant on its owner; the tenant a node-to-node call names is trusted only
from a peer or admin credential, and only for the calls a pool makes.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from conftest import SMALL_LAYOUT

from kvstore.client import AsyncClient
from kvstore.convert import layout_to_proto
from kvstore.errors import ConfigError
from kvstore.server.daemon import Daemon
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from tests.cluster.pool_fixtures import Tokens, chain, pool

LAYOUT = SMALL_LAYOUT


def auth(tokens: Tokens, n: int, **more: object) -> dict[str, object]:
    """Every daemon of an `n`-node pool reads `tokens` and presents its own node's credential."""
    return {"auth_token_file": str(tokens.path), "per_node": tokens.per_node(n), **more}


async def test_a_tenant_hits_on_every_node_and_no_other_tenant_does(tmp_path: Path) -> None:
    tokens = Tokens(tmp_path / "tokens.toml")
    async with pool(tmp_path, 3, **auth(tokens, 3)) as (a, b, c):
        tok, blocks = chain(LAYOUT, 24, seed=21)
        async with AsyncClient(a.bound[1], token=tokens.tokens["alpha"]) as kv:
            put = await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)
        assert put.owner_committed_blocks == put.forwarded_blocks > 0
        for d in (b, c):
            async with AsyncClient(d.bound[1], token=tokens.tokens["alpha"]) as kv:
                hit = await kv.lookup(LAYOUT, tok)
                assert hit.num_blocks == 24
                assert [bytes(g) for g in await kv.fetch(LAYOUT, tok)] == blocks
        for d in (a, b, c):
            async with AsyncClient(d.bound[1], token=tokens.tokens["beta"]) as kv:
                miss = await kv.lookup(LAYOUT, tok)
                assert (miss.num_blocks, miss.remote_blocks) == (0, 0)
                assert await kv.fetch(LAYOUT, tok) == []
        # The owners filed what they received under alpha, the tenant that put it.
        for d in (b, c):
            async with grpc.aio.insecure_channel(d.bound[1]) as channel:
                listed = await admin_pb2_grpc.AdminStub(channel).ListNamespaces(
                    admin_pb2.ListNamespacesRequest(), metadata=(("authorization", f"Bearer {tokens.tokens['ops']}"),))
            by_tenant = {ns.tenant: ns.blocks for ns in listed.namespaces}
            assert by_tenant.get("alpha", 0) > 0 and by_tenant.get("beta", 0) == 0


async def test_only_a_peer_credential_may_act_for_a_tenant(tmp_path: Path) -> None:
    tokens = Tokens(tmp_path / "tokens.toml")
    async with pool(tmp_path, 2, **auth(tokens, 2)) as (a, b):
        tok, blocks = chain(LAYOUT, 4, seed=22)
        async with AsyncClient(a.bound[1], token=tokens.tokens["alpha"]) as kv:
            await kv.put(LAYOUT, tok, blocks, wait_for_owners=True)
        req = kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(LAYOUT)),
                                        keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tok)))

        async def lookup(token: str, *pairs: tuple[str, str], method: str = "lookup") -> int:
            md = (("authorization", f"Bearer {token}"), *pairs)
            async with grpc.aio.insecure_channel(a.bound[1]) as channel:
                stub = kvstore_pb2_grpc.KVStoreStub(channel)
                if method == "segment":
                    await stub.LocalSegment(kvstore_pb2.LocalSegmentRequest(), metadata=md)
                    return -1
                return int((await stub.Lookup(req, metadata=md)).num_blocks)

        peer = ("x-kvstore-peer", "n1")
        n1 = tokens.node("n1")
        # Node n1's credential acting for alpha sees alpha's blocks.
        assert await lookup(n1, peer, ("x-kvstore-tenant", "alpha")) == 4
        assert await lookup(n1, peer, ("x-kvstore-tenant", "beta")) == 0
        refused = [
            (tokens.tokens["beta"], (peer, ("x-kvstore-tenant", "alpha")), "lookup"),  # a client acting for another
            (n1, (), "lookup"),  # a peer token alone
            (n1, (peer, ("x-kvstore-tenant", "nobody")), "lookup"),  # a tenant not in the file
            (n1, (peer, ("x-kvstore-tenant", "alpha")), "segment"),  # not a pool's call
            (tokens.tokens["ops"], (peer, ("x-kvstore-tenant", "alpha")), "lookup"),  # an admin is no node
        ]
        for token, pairs, method in refused:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await lookup(token, *pairs, method=method)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (pairs, method)
        async with grpc.aio.insecure_channel(a.bound[1]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await admin_pb2_grpc.AdminStub(channel).Stats(
                    admin_pb2.StatsRequest(), metadata=(("authorization", f"Bearer {tokens.tokens['pool']}"),))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_without_a_token_file_a_call_for_another_tenant_is_refused(tmp_path: Path) -> None:
    async with pool(tmp_path, 1) as (a,):
        async with grpc.aio.insecure_channel(a.bound[1]) as channel:
            req = kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(LAYOUT)),
                                            keys=kvstore_pb2.BlockKeys(packed_hashes=b"\x00" * 16))
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            ok = await stub.Lookup(req, metadata=(("x-kvstore-peer", "n0"), ("x-kvstore-tenant", "default")))
            assert ok.num_blocks == 0
            for node, tenant in (("n0", "alpha"), ("n9", "default")):  # another tenant; a node not in the pool
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Lookup(req, metadata=(("x-kvstore-peer", node), ("x-kvstore-tenant", tenant)))
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_pool_with_a_token_file_needs_a_cluster_credential(tmp_path: Path) -> None:
    tokens = Tokens(tmp_path / "tokens.toml")
    with pytest.raises(ConfigError, match="cluster_token_file"):
        async with pool(tmp_path, 1, auth_token_file=str(tokens.path)):
            pass


def test_the_peer_metadata_names_agree() -> None:
    from kvstore.cluster import transport
    from kvstore.server import auth as server_auth

    assert (transport.PEER_HEADER, transport.TENANT_HEADER) == (server_auth.PEER_HEADER, server_auth.TENANT_HEADER)


def test_token_new_makes_peer_credentials(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli.main import main
    from kvstore.server.auth import parse_token_file

    path = tmp_path / "tokens.toml"
    assert main(["token", "new", "--tenant", "pool", "--role", "peer", "--file", str(path)]) == 0
    assert main(["token", "new", "--node", "n1", "--file", str(path)]) == 0
    table = parse_token_file(str(path))
    assert table.identities["pool"].role == "peer" and not table.identities["pool"].node
    assert (table.identities["node.n1"].role, table.identities["node.n1"].node) == ("peer", "n1")
    assert main(["token", "new", "--node", "n1", "--file", str(path)]) != 0  # one entry per node
    assert main(["token", "new", "--node", "n 1", "--file", str(path)]) != 0
    capsys.readouterr()
    _ = Daemon  # the daemon reads such a file as any other
