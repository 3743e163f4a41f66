"""A put's forwards to one owner are one job of several runs of its chain: one LanePut on
an owner whose data lane takes runs (each run's first block parented on the chain's
block before it), one put per run on one that does not; either way every forwarded
block is committed and served byte-exact. Runs are node-to-node only, and checked.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import SMALL_LAYOUT

from kvstore.client import AsyncClient
from kvstore.control_lane_wire import peer_envelope
from kvstore.convert import layout_to_proto
from kvstore.core.index import make_key
from kvstore.core.store import Store
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout
from kvstore.server.daemon import Daemon
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.cluster.pool_fixtures import Tokens, chain, pool, unix_target
from tests.cluster.test_cluster_peer_lane import OK, RawPeerLane

LAYOUT = SMALL_LAYOUT
N = 40


def lane_puts(d: Daemon) -> int:
    assert d.data_lane is not None
    return int(d.data_lane.counters.get("transfers_put"))


def held_runs(d: Daemon, hashes: list[bytes]) -> int:
    """How many runs of consecutive blocks of the chain `d` holds."""
    held = np.frombuffer(d.store.present(LAYOUT.namespace_id, b"".join(hashes)), np.uint8) != Store.ABSENT
    return int(np.count_nonzero(held[1:] & ~held[:-1]) + held[0])


def assert_parented_in_the_chain(d: Daemon, hashes: list[bytes], layout: KVLayout = LAYOUT) -> None:
    ns = layout.namespace_id
    for i, h in enumerate(hashes):
        entry = d.store.index.get(make_key(ns, h))
        if entry is not None:
            assert entry.parent == (make_key(ns, hashes[i - 1]) if i else None), i


async def put_and_check(a: Daemon, b: Daemon, seed: int) -> tuple[int, int]:
    """Put a chain on `a` waiting for its owners; (lane puts `b` received, runs `b` holds).
    Its blocks on `b` are parented in the chain, and the whole chain is a hit on `b`."""
    async with AsyncClient(unix_target(a)) as kv:
        await kv.put(LAYOUT, *chain(LAYOUT, 8, seed=seed + 1000), wait_for_owners=True)  # a's lanes are known
        tokens, blocks = chain(LAYOUT, N, seed=seed)
        before = lane_puts(b)
        put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
    assert put.owner_committed_blocks == put.forwarded_blocks > 0
    hashes = block_hashes(LAYOUT.namespace_id, tokens, LAYOUT.block_size_tokens)
    puts, runs = lane_puts(b) - before, held_runs(b, hashes)
    assert_parented_in_the_chain(b, hashes)
    async with AsyncClient(unix_target(b)) as kv:
        assert (await kv.lookup(LAYOUT, tokens)).num_blocks == N
        assert [bytes(g) for g in await kv.fetch(LAYOUT, tokens)] == blocks
    assert_parented_in_the_chain(b, hashes)  # the pulled runs too
    return puts, runs


async def test_an_owner_gets_the_runs_of_a_put_in_one_lane_put(tmp_path: Path) -> None:
    async with pool(tmp_path, 2) as (a, b):
        puts, runs = await put_and_check(a, b, seed=71)
        assert runs > 1 and puts == 1


async def test_an_owner_whose_lane_takes_no_runs_gets_one_put_per_run(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    async with pool(tmp_path, 2) as (a, b):
        assert b._transfers is not None
        offer = b._transfers.offer
        monkeypatch.setattr(b._transfers, "offer", lambda: kvstore_pb2.DataLaneResponse(
            **{f.name: getattr(offer(), f.name) for f in offer().DESCRIPTOR.fields if f.name != "put_runs"}))
        puts, runs = await put_and_check(a, b, seed=72)
        assert runs > 1 and puts == runs


def lane_put(tokens: list[int], runs: list[kvstore_pb2.PutRun], position: int = 0) -> kvstore_pb2.LanePutRequest:
    hashes = block_hashes(LAYOUT.namespace_id, tokens, LAYOUT.block_size_tokens)
    return kvstore_pb2.LanePutRequest(
        header=kvstore_pb2.PutHeader(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(LAYOUT)),
                                     keys=kvstore_pb2.BlockKeys(packed_hashes=b"".join(hashes[:6])), num_blocks=6,
                                     position=position),
        runs=runs, timeout_ms=2000)


async def test_runs_are_for_the_pools_daemons_and_checked(tmp_path: Path) -> None:
    tokens = Tokens(tmp_path / "tokens.toml")
    async with pool(tmp_path, 2, auth_token_file=str(tokens.path), per_node=tokens.per_node(2)) as (a, _):
        tok, _ = chain(LAYOUT, 12, seed=73)
        hashes = block_hashes(LAYOUT.namespace_id, tok, LAYOUT.block_size_tokens)
        good = [kvstore_pb2.PutRun(offset=3, parent_hash=hashes[5], position=6)]
        # A client may not send runs, however good.
        async with grpc.aio.insecure_channel(a.bound[1]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await kvstore_pb2_grpc.KVStoreStub(channel).LanePut(
                    lane_put(tok, good), metadata=(("authorization", f"Bearer {tokens.tokens['alpha']}"),))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        lane, code = await RawPeerLane.open(a, tokens.node("n1"))
        assert code == OK
        try:
            bad = [
                [kvstore_pb2.PutRun(offset=0, position=6)],  # not after the first run
                [kvstore_pb2.PutRun(offset=6, position=6)],  # past the put's blocks
                [kvstore_pb2.PutRun(offset=3, position=9), kvstore_pb2.PutRun(offset=2, position=12)],  # out of order
                [kvstore_pb2.PutRun(offset=3, position=2)],  # overlaps the first run
                [kvstore_pb2.PutRun(offset=3, parent_hash=b"short", position=6)],
            ]
            for runs in bad:
                code, message = await lane.call(
                    "LanePut", peer_envelope("n1", "alpha") + lane_put(tok, runs).SerializeToString())
                assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0], (runs, message)
            no_position = lane_put(tok, good)
            no_position.header.ClearField("position")
            code, _ = await lane.call("LanePut", peer_envelope("n1", "alpha") + no_position.SerializeToString())
            assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            # Good runs from a node are taken (and rolled back here: nothing is sent).
            code, answer = await lane.call("LanePut", peer_envelope("n1", "alpha") + lane_put(tok, good)
                                           .SerializeToString())
            assert code == OK and kvstore_pb2.LanePutResponse.FromString(answer).needed == b"\x01" * 6
            code, _ = await lane.call("LaneCommit", peer_envelope("n1", "alpha") + kvstore_pb2.LaneCommitRequest(
                transfer_id=kvstore_pb2.LanePutResponse.FromString(answer).transfer_id, abort=True)
                .SerializeToString())
            assert code == OK
        finally:
            await lane.close()
        assert all(a.store.block(LAYOUT.namespace_id, h) is None for h in hashes)  # nothing was stored



DEMO_LAYOUT = KVLayout(model="demo/tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64,
                       block_size_tokens=16)


@pytest.mark.parametrize("seed", [81, 82])
@pytest.mark.parametrize("layout", [LAYOUT, DEMO_LAYOUT], ids=["small", "demo"])
async def test_three_nodes_a_put_on_one_is_a_whole_hit_on_the_others(tmp_path: Path, seed: int,
                                                                     layout: KVLayout) -> None:
    """What `make run-cluster`'s demo does: a put on n0 waiting for its owners, then a
    lookup and a fetch on n1 and on n2, each of which holds its own units and asks the
    other two for the rest. Fresh daemons: the first put to each owner finds its lanes."""
    async with pool(tmp_path, 3) as nodes:
        tokens, blocks = chain(layout, 64, seed=seed)
        async with AsyncClient(unix_target(nodes[0])) as kv:
            put = await kv.put(layout, tokens, blocks, wait_for_owners=True)
        assert put.owner_committed_blocks == put.forwarded_blocks > 0
        hashes = block_hashes(layout.namespace_id, tokens, layout.block_size_tokens)
        for d in nodes[1:]:
            assert_parented_in_the_chain(d, hashes, layout)
        for d in nodes[1:]:
            async with AsyncClient(unix_target(d)) as kv:
                hit = await kv.lookup(layout, tokens)
                assert hit.num_blocks == 64, (d.config.node_id, hit.num_blocks, hit.remote_blocks)
                assert [bytes(g) for g in await kv.fetch(layout, tokens)] == blocks
