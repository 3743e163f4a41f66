"""Packed block hashes (BlockKeys.packed_hashes, the responses' block_hashes_packed) next to the
repeated form: both give the same answers, a request is answered in the form it asked
for (so clients built before the packed fields keep working), and bad packed input is
INVALID_ARGUMENT and changes nothing.
"""

from __future__ import annotations

import os

import grpc
import pytest
import xxhash
from conftest import make_config

from kvstore import errors
from kvstore.client import AsyncClient
from kvstore.client._requests import lookup_request
from kvstore.client.results import lookup_result, packed_tier_names
from kvstore.convert import layout_to_proto
from kvstore.hashing import block_hashes, block_hashes_packed, namespace_id, split_hashes, token_bytes
from kvstore.layout import KVLayout
from kvstore.server.daemon import Daemon
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

N = 6


@pytest.fixture
async def seeded(daemon, layout):
    """A daemon holding an N-block chain, with a raw stub, an SDK client and the chain's hashes."""
    tokens = list(range(layout.block_size_tokens * N))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(N)]
    channel = grpc.aio.insecure_channel(daemon.tcp_target)
    kv = AsyncClient(daemon.tcp_target)
    await kv.put(layout, tokens, blocks)
    hashes = block_hashes(namespace_id(layout), tokens, layout.block_size_tokens)
    try:
        yield kvstore_pb2_grpc.KVStoreStub(channel), admin_pb2_grpc.AdminStub(channel), kv, tokens, blocks, hashes
    finally:
        await kv.close()
        await channel.close()


def ns(layout: KVLayout) -> kvstore_pb2.Namespace:
    return kvstore_pb2.Namespace(layout=layout_to_proto(layout))


def repeated(hashes: list[bytes]) -> kvstore_pb2.BlockKeys:
    """Keys as a client built before packed hashes existed sends them."""
    return kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=hashes))


def packed(hashes: list[bytes]) -> kvstore_pb2.BlockKeys:
    return kvstore_pb2.BlockKeys(packed_hashes=b"".join(hashes))


async def expect_invalid(call, match: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert match in info.value.details()


async def snapshot(admin, kv, layout, tokens):
    stats = await admin.Stats(admin_pb2.StatsRequest())
    host = next(t for t in stats.tiers if t.name == "host")
    return host.used_bytes, host.blocks, await kv.fetch(layout, tokens)


async def test_lookup_answers_in_the_form_asked(seeded, layout):
    stub, _, _, tokens, _, hashes = seeded
    chain = hashes + [os.urandom(16)]  # one block past what is held
    old = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=repeated(chain)))
    new = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=packed(chain)))
    assert old.num_blocks == new.num_blocks == N
    assert (list(old.tiers), old.tiers_packed) == ([kvstore_pb2.TIER_HOST] * N, b"")
    assert (list(new.tiers), new.tiers_packed) == ([], bytes([kvstore_pb2.TIER_HOST]) * N)
    assert (list(old.block_hashes), old.block_hashes_packed) == (hashes, b"")
    assert (list(new.block_hashes), new.block_hashes_packed) == ([], b"".join(hashes))
    # Token lookups: the repeated field for old clients, the packed one when asked for.
    tok = kvstore_pb2.TokenIds(token_ids=tokens)
    old_tok = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout),
                                                          keys=kvstore_pb2.BlockKeys(tokens=tok)))
    new_tok = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout),
                                                          keys=kvstore_pb2.BlockKeys(tokens=tok, packed_reply=True)))
    assert (list(old_tok.block_hashes), old_tok.block_hashes_packed) == (hashes, b"")
    assert len(old_tok.tiers) == N and not new_tok.tiers and len(new_tok.tiers_packed) == N
    assert (list(new_tok.block_hashes), new_tok.block_hashes_packed) == ([], b"".join(hashes))
    # Repeated hashes may ask for a packed answer too.
    mixed = repeated(chain)
    mixed.packed_reply = True
    got = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=mixed))
    assert (got.num_blocks, list(got.block_hashes), got.block_hashes_packed) == (N, [], b"".join(hashes))


async def test_lookup_leaves_out_the_hashes_a_caller_named_when_asked(seeded, layout):
    stub, _, _, tokens, _, hashes = seeded
    chain = hashes + [os.urandom(16)]  # one block past what is held
    host = kvstore_pb2.TIER_HOST
    for keys, tiers in ((packed(chain), ([], bytes([host]) * N)), (repeated(chain), ([host] * N, b""))):
        got = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=keys, omit_hashes=True))
        assert got.num_blocks == N and not got.block_hashes and not got.block_hashes_packed
        assert (list(got.tiers), got.tiers_packed) == tiers
    # A chain named by token ids: only the daemon has its hashes, so they come back anyway.
    tok = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens), packed_reply=True)
    got = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=tok, omit_hashes=True))
    assert got.block_hashes_packed == b"".join(hashes)


def test_a_lookup_result_reads_hashes_from_daemons_that_send_them_or_not(layout):
    hashes = [os.urandom(16) for _ in range(4)]
    req, mine = lookup_request(layout, None, hashes, lease_ms=5)
    assert mine is hashes and req.keys.packed_hashes == b"".join(hashes)
    assert req.omit_hashes and req.keys.packed_reply and req.lease_ms == 5
    host = bytes([kvstore_pb2.TIER_HOST])
    # A daemon that honours omit_hashes: the caller's own objects, the first num_blocks.
    r = lookup_result(kvstore_pb2.LookupResponse(num_blocks=3, tiers_packed=host * 3), mine)
    assert r.block_hashes == hashes[:3] and all(a is b for a, b in zip(r.block_hashes, hashes))
    assert r.tiers == ["host"] * 3
    # One that predates it sends them back: checked, then the caller's objects again.
    r = lookup_result(kvstore_pb2.LookupResponse(num_blocks=2, block_hashes_packed=b"".join(hashes[:2])), mine)
    assert r.block_hashes == hashes[:2] and r.block_hashes[0] is hashes[0]
    # Hashes that are not the caller's are what the answer says, never the caller's.
    other = [os.urandom(16) for _ in range(2)]
    r = lookup_result(kvstore_pb2.LookupResponse(num_blocks=2, block_hashes_packed=b"".join(other)), mine)
    assert r.block_hashes == other
    with pytest.raises(errors.Internal, match="5 hits for a 4-block chain"):
        lookup_result(kvstore_pb2.LookupResponse(num_blocks=5), mine)
    # Forms the answer cannot hand back as they are ask for the hashes.
    for asked in ([bytearray(h) for h in hashes], iter(hashes)):
        req, mine = lookup_request(layout, None, asked)
        assert mine is None and req.keys.packed_hashes == b"".join(hashes) and not req.omit_hashes
    assert lookup_request(layout, None, tuple(hashes))[1] == hashes
    # Token ids: the daemon computes the hashes, so they come back.
    req, mine = lookup_request(layout, [1, 2, 3], None)
    assert mine is None and req.keys.WhichOneof("keys") == "tokens" and not req.omit_hashes
    with pytest.raises(errors.InvalidArgument, match="exactly one"):
        lookup_request(layout, [1], hashes)


async def test_local_fetch_answers_its_hashes_in_the_form_asked(seeded, layout):
    stub, _, _, _, _, hashes = seeded
    chain = hashes + [os.urandom(16)]  # one block past what is held
    for keys, want in ((repeated(chain), (hashes, b"")), (packed(chain), ([], b"".join(hashes)))):
        got = await stub.LocalFetch(kvstore_pb2.LocalFetchRequest(namespace=ns(layout), keys=keys))
        await stub.Unpin(kvstore_pb2.UnpinRequest(lease_id=got.lease_id))
        assert got.num_blocks == N
        assert (list(got.block_hashes), got.block_hashes_packed) == want


async def test_sdk_results_are_lists_of_hashes(seeded, layout):
    _, _, kv, tokens, blocks, hashes = seeded
    hit = await kv.lookup(layout, tokens)
    assert type(hit.block_hashes) is list and hit.block_hashes == hashes
    assert hit.tiers == ["host"] * N
    by_hash = await kv.lookup(layout, block_hashes=hashes[:4])
    assert by_hash.block_hashes == hashes[:4] and by_hash.num_blocks == 4
    put = await kv.put(layout, tokens, blocks)
    assert type(put.block_hashes) is list and put.block_hashes == hashes and put.existing == N


async def test_fetch_forms_agree(seeded, layout):
    stub, _, _, _, blocks, hashes = seeded

    async def fetched(keys: kvstore_pb2.BlockKeys) -> list[bytes]:
        out: dict[int, bytes] = {}
        async for msg in stub.Fetch(kvstore_pb2.FetchRequest(namespace=ns(layout), keys=keys)):
            if msg.WhichOneof("msg") == "chunk":
                out[msg.chunk.block] = out.get(msg.chunk.block, b"") + msg.chunk.data
        return [out[i] for i in sorted(out)]

    assert await fetched(repeated(hashes)) == await fetched(packed(hashes)) == blocks
    assert await fetched(packed(hashes[:2])) == blocks[:2]


async def test_put_forms_agree(daemon, layout):
    chain = block_hashes(namespace_id(layout), list(range(1000, 1000 + layout.block_size_tokens * 4)),
                         layout.block_size_tokens)
    data = [os.urandom(layout.bytes_per_block) for _ in range(4)]
    async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)

        def stream(keys: kvstore_pb2.BlockKeys, first: int, count: int):
            header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=keys, num_blocks=count,
                                           parent_hash=chain[first - 1] if first else b"")
            yield kvstore_pb2.PutRequest(header=header)
            for i in range(count):
                yield kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=i, data=data[first + i]))

        new = await stub.Put(stream(packed(chain[:2]), 0, 2))
        assert (new.stored, new.existing, list(new.block_hashes), new.block_hashes_packed) == \
            (2, 0, [], b"".join(chain[:2]))
        old = await stub.Put(stream(repeated(chain), 0, 4))
        assert (old.stored, old.existing, list(old.block_hashes), old.block_hashes_packed) == (2, 2, chain, b"")
        again = await stub.Put(stream(packed(chain[2:]), 2, 2))
        assert (again.stored, again.existing, again.block_hashes_packed) == (0, 2, b"".join(chain[2:]))
        hit = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=packed(chain)))
        assert hit.num_blocks == 4


async def test_prefetch_pin_delete_forms_agree(seeded, layout):
    stub, _, _, _, _, hashes = seeded
    for keys in (repeated(hashes), packed(hashes)):
        r = await stub.Prefetch(kvstore_pb2.PrefetchRequest(namespace=ns(layout), keys=keys))
        assert (r.requested, r.already, r.missing) == (N, N, 0)
        pin = await stub.Pin(kvstore_pb2.PinRequest(namespace=ns(layout), keys=keys, ttl_ms=1000))
        assert pin.pinned == N
        await stub.Unpin(kvstore_pb2.UnpinRequest(lease_id=pin.lease_id))
    assert (await stub.Delete(kvstore_pb2.DeleteRequest(namespace=ns(layout), keys=packed(hashes[4:])))).deleted == 2
    assert (await stub.Delete(kvstore_pb2.DeleteRequest(namespace=ns(layout), keys=repeated(hashes[3:])))).deleted == 1
    hit = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=packed(hashes)))
    assert hit.num_blocks == 3


async def test_bad_packed_hashes_are_refused_and_change_nothing(seeded, layout):
    stub, admin, kv, tokens, _, hashes = seeded
    before = await snapshot(admin, kv, layout, tokens)
    joined = b"".join(hashes)
    short = kvstore_pb2.BlockKeys(packed_hashes=joined[:-1])
    # What a daemon older than packed keys sees in a packed request: no keys at all.
    none = kvstore_pb2.BlockKeys(packed_reply=True)
    for keys, match in ((short, f"{len(joined) - 1} bytes, not a multiple of 16"), (none, "names no blocks")):
        await expect_invalid(stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=keys, lease_ms=1000)),
                             match)
        await expect_invalid(stub.Delete(kvstore_pb2.DeleteRequest(namespace=ns(layout), keys=keys)), match)
        await expect_invalid(stub.Pin(kvstore_pb2.PinRequest(namespace=ns(layout), keys=keys)), match)
        await expect_invalid(stub.Prefetch(kvstore_pb2.PrefetchRequest(namespace=ns(layout), keys=keys)), match)
        await expect_invalid(stub.Fetch(kvstore_pb2.FetchRequest(namespace=ns(layout), keys=keys)).read(), match)
        header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=keys)
        chunk = kvstore_pb2.BlockChunk(block=0, data=bytes(layout.bytes_per_block))
        await expect_invalid(stub.Put(iter([kvstore_pb2.PutRequest(header=header),
                                            kvstore_pb2.PutRequest(chunk=chunk)])), match)
    assert await snapshot(admin, kv, layout, tokens) == before


async def test_packed_hashes_obey_the_block_limit(tmp_path, layout):
    d = Daemon(make_config(tmp_path, max_blocks_per_call=4))
    await d.start()
    try:
        async with grpc.aio.insecure_channel(d.bound[1]) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            keys = packed([os.urandom(16) for _ in range(5)])
            await expect_invalid(stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=keys)),
                                 "the limit is 4")
        async with AsyncClient(d.bound[1]) as kv:
            with pytest.raises(errors.InvalidArgument, match="the limit is 4"):
                await kv.lookup(layout, block_hashes=[os.urandom(16) for _ in range(5)])
            with pytest.raises(errors.InvalidArgument, match=r"block_hashes\[1\] must be 16 bytes"):
                await kv.lookup(layout, block_hashes=[os.urandom(16), os.urandom(15), os.urandom(17)])
    finally:
        await d.stop(grace_s=0)


def _reference_chain(namespace: bytes, packed_tokens: bytes, bst: int) -> list[bytes]:
    """docs/hashing.md, written as plainly as possible."""
    out, prev, step = [], namespace, bst * 4
    for i in range(len(packed_tokens) // step):
        body = bst.to_bytes(4, "little") + packed_tokens[i * step : (i + 1) * step] + (0).to_bytes(4, "little")
        prev = xxhash.xxh3_128_digest(prev + body)
        out.append(prev)
    return out


@pytest.mark.parametrize("bst,n_blocks", [(1, 3), (16, 0), (16, 1), (16, 31), (16, 32), (16, 1000), (16, 2500), (7, 1030)])
def test_chained_hashes_match_the_spec(bst, n_blocks):
    ns_id = bytes(range(16))
    tokens = token_bytes(list(range(bst * n_blocks + bst - 1)))  # trailing tokens short of a block
    got = block_hashes_packed(ns_id, tokens, bst)
    assert got == _reference_chain(ns_id, tokens, bst) and len(got) == n_blocks
    assert block_hashes_packed(ns_id, memoryview(tokens), bst) == got


def test_packed_tier_names():
    host, ssd = kvstore_pb2.TIER_HOST, kvstore_pb2.TIER_SSD
    assert packed_tier_names(bytes([host]) * 3) == ["host"] * 3
    assert packed_tier_names(bytes([host, ssd, host, 99])) == ["host", "ssd", "host", "unknown"]
    assert packed_tier_names(b"") == []


def test_split_hashes():
    raw = os.urandom(16 * 2100)
    assert split_hashes(raw) == [raw[i : i + 16] for i in range(0, len(raw), 16)]
    assert split_hashes(b"") == []
    with pytest.raises(errors.InvalidArgument, match="33 bytes, not a multiple of 16"):
        split_hashes(raw[:33])


def test_token_bytes_is_little_endian_u32_and_names_bad_ids() -> None:
    import random
    import struct as _struct

    import numpy as np

    rng = random.Random(5)
    ids = [0, 1, 0xFFFFFFFF] + [rng.randrange(1 << 32) for _ in range(5000)]
    want = b"".join(_struct.pack("<I", i) for i in ids)
    assert token_bytes(ids) == want
    assert token_bytes(tuple(ids)) == want
    assert token_bytes(iter(ids)) == want
    assert token_bytes(np.array(ids, np.uint64)) == want
    assert token_bytes([]) == b""
    for bad, match in (([1, -1], "integers in"), ([1 << 32], "integers in"), ([1.5], "sequence of integers"),
                       (["7"], "sequence of integers"), (None, "sequence of integers"),
                       (b"\x01\x00\x00\x00", "pass packed bytes")):
        with pytest.raises(errors.InvalidArgument, match=match):
            token_bytes(bad)


def test_hashes_are_joined_in_one_checked_pass():
    from kvstore import _native
    from kvstore.client._requests import pack_hashes

    hashes = [os.urandom(16) for _ in range(1000)]
    assert _native.join_hashes(hashes) == b"".join(hashes) == pack_hashes(hashes) == pack_hashes(tuple(hashes))
    assert _native.join_hashes([]) == b""
    # Anything but 16-byte bytes objects is left to the Python path, which names the culprit
    # or packs other bytes-like objects.
    for bad in ([*hashes[:3], hashes[3][:15], hashes[4] + b"x"], [*hashes[:2], "x" * 16], [bytearray(16)]):
        assert _native.join_hashes(bad) is None
    with pytest.raises(errors.InvalidArgument, match=r"block_hashes\[3\] must be 16 bytes"):
        pack_hashes([*hashes[:3], hashes[3][:15], hashes[4] + b"x"])
    assert pack_hashes([bytearray(hashes[0]), hashes[1]]) == hashes[0] + hashes[1]
    with pytest.raises(TypeError):
        _native.join_hashes(7)


async def test_a_lookup_by_hashes_hands_back_the_callers_hashes(seeded, layout):
    *_, kv, tokens, _, hashes = seeded
    other = [os.urandom(16) for _ in range(3)]
    got = await kv.lookup(layout, block_hashes=hashes + other)
    assert got.num_blocks == N and got.block_hashes == hashes
    assert all(a is b for a, b in zip(got.block_hashes, hashes))  # the same objects, not copies
    # Other sequences and bytes-like hashes answer the same, with bytes of their own.
    for asked in (tuple(hashes), [bytearray(h) for h in hashes], iter(hashes)):
        got = await kv.lookup(layout, block_hashes=asked)
        assert got.block_hashes == hashes and all(type(h) is bytes for h in got.block_hashes)
    assert (await kv.lookup(layout, block_hashes=other)).block_hashes == []
    assert (await kv.lookup(layout, tokens)).block_hashes == hashes
