"""What README's "Use it from any language" tells a client written from the proto alone,
checked against the real daemon with raw gRPC calls (no SDK): every RPC the proto has is
named there and none it lacks, the bearer token's metadata, the message cap a 4 MiB
client must raise, block indexes within a Put or Fetch, `num_blocks: 0`, and sending
the layout again after NOT_FOUND."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from conftest import SMALL_LAYOUT, make_config

from kvstore.convert import layout_to_proto
from kvstore.layout import KVLayout
from kvstore.server.auth import new_token
from kvstore.server.daemon import Daemon
from kvstore.v1 import admin_pb2, kvstore_pb2, kvstore_pb2_grpc

README = Path(__file__).resolve().parents[2] / "README.md"


def any_language_section() -> str:
    text = README.read_text()
    start = text.index("## Use it from any language")
    return text[start : text.index("\n## ", start + 1)]


def test_the_readme_names_every_rpc_and_no_other():
    section = any_language_section()
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", section))
    for file, service in ((kvstore_pb2, "KVStore"), (admin_pb2, "Admin")):
        methods = {m.name for m in file.DESCRIPTOR.services_by_name[service].methods}
        assert methods <= named, f"{service} RPCs missing from README: {sorted(methods - named)}"
    assert not {"Export", "Import"} & named
    assert "export/import)" not in section  # once listed as Admin calls, which the proto lacks


def ns(layout: KVLayout) -> kvstore_pb2.Namespace:
    return kvstore_pb2.Namespace(layout=layout_to_proto(layout))


def tokens_keys(tokens: list[int], first_block: int = 0) -> kvstore_pb2.BlockKeys:
    return kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens, first_block=first_block))


async def fetch_raw(stub: kvstore_pb2_grpc.KVStoreStub, request: kvstore_pb2.FetchRequest,
                    **kwargs) -> tuple[kvstore_pb2.FetchHeader, list[kvstore_pb2.BlockChunk]]:
    messages = [m async for m in stub.Fetch(request, timeout=10, **kwargs)]
    return messages[0].header, [m.chunk for m in messages[1:]]


async def test_put_chunks_count_from_zero_within_the_request_and_num_blocks_0_means_the_rest(daemon):
    layout = SMALL_LAYOUT
    bst, size = layout.block_size_tokens, layout.bytes_per_block
    tokens = list(range(bst * 5 + 1))  # five full blocks and a token short of a sixth
    blocks = [os.urandom(size) for _ in range(5)]
    async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        first = kvstore_pb2.PutHeader(namespace=ns(layout), keys=tokens_keys(tokens[: bst * 2]), num_blocks=2)
        await stub.Put(iter([kvstore_pb2.PutRequest(header=first)] + [
            kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=i, data=blocks[i])) for i in range(2)]))
        # The rest: the whole prefix, first_block 2, num_blocks 0 (every full block from 2),
        # and chunks for blocks 0, 1, 2 of this request (the chain's blocks 2, 3, 4), in halves.
        rest = kvstore_pb2.PutHeader(namespace=ns(layout), keys=tokens_keys(tokens, first_block=2))
        chunks = [kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=i, data=blocks[2 + i][half]))
                  for i in range(3) for half in (slice(0, size // 2), slice(size // 2, size))]
        put = await stub.Put(iter([kvstore_pb2.PutRequest(header=rest), *chunks]))
        assert (put.stored, put.existing) == (3, 0)
        hit = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=tokens_keys(tokens)))
        assert hit.num_blocks == 5
        # Fetch's chunks count from 0 within its request too.
        tail = kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=list(hit.block_hashes[3:])))
        header, chunks_out = await fetch_raw(stub, kvstore_pb2.FetchRequest(namespace=ns(layout), keys=tail))
        assert header.num_blocks == 2 and sorted({c.block for c in chunks_out}) == [0, 1]
        got = [b"".join(c.data for c in chunks_out if c.block == i) for i in range(2)]
        assert got == blocks[3:]


async def test_an_unknown_namespace_id_is_not_found_until_a_put_sends_the_layout(tmp_path: Path):
    """A daemon forgets namespaces on restart: the id a client kept is NOT_FOUND until it
    sends the layout again. A read by layout is a miss that registers nothing; a put by
    layout registers it, and the id works from then on."""
    layout = SMALL_LAYOUT
    tokens = list(range(layout.block_size_tokens))
    config = make_config(tmp_path)
    for _ in range(2):  # one daemon, then another on the same socket: a restart
        d = Daemon(config)
        await d.start()
        try:
            async with grpc.aio.insecure_channel(d.bound[1]) as channel:
                stub = kvstore_pb2_grpc.KVStoreStub(channel)
                by_id = kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(id=layout.namespace_id),
                                                  keys=tokens_keys(tokens))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Lookup(by_id)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND and "send the full layout" in \
                    info.value.details()
                by_layout = await stub.Lookup(kvstore_pb2.LookupRequest(namespace=ns(layout), keys=tokens_keys(tokens)))
                assert by_layout.namespace_id == layout.namespace_id  # auth off: the public id
                assert by_layout.num_blocks == 0
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Lookup(by_id)  # the read registered nothing
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=tokens_keys(tokens))
                await stub.Put(iter([kvstore_pb2.PutRequest(header=header),
                                     kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(
                                         block=0, data=os.urandom(layout.bytes_per_block)))]))
                assert (await stub.Lookup(by_id)).num_blocks == 1
        finally:
            await d.stop(grace_s=0)


@pytest.fixture
async def auth_daemon(tmp_path: Path) -> AsyncIterator[tuple[Daemon, dict[str, str]]]:
    tokens, lines = {}, []
    for name in ("alpha", "beta"):
        token, token_hash = new_token()
        tokens[name] = token
        lines.append(f'[[tenant]]\nname = "{name}"\ntokens = ["{token_hash}"]\n')
    path = tmp_path / "tokens.toml"
    path.write_text("\n".join(lines))
    path.chmod(0o600)
    d = Daemon(make_config(tmp_path, auth_token_file=str(path)))
    await d.start()
    try:
        yield d, tokens
    finally:
        await d.stop(grace_s=0)


async def test_the_bearer_token_and_ids_that_differ_per_tenant(auth_daemon):
    d, tokens = auth_daemon
    layout = SMALL_LAYOUT
    request = kvstore_pb2.LookupRequest(namespace=ns(layout), keys=tokens_keys(list(range(4))))
    async with grpc.aio.insecure_channel(d.bound[1]) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Lookup(request)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        alpha = await stub.Lookup(request, metadata=(("authorization", f"Bearer {tokens['alpha']}"),))
        beta = await stub.Lookup(request, metadata=(("authorization", f"Bearer {tokens['beta']}"),))
        assert len({alpha.namespace_id, beta.namespace_id, layout.namespace_id}) == 3
        # alpha's id means nothing to beta: NOT_FOUND, and beta sends its layout instead.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Lookup(kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(id=alpha.namespace_id),
                                                        keys=tokens_keys(list(range(4)))),
                              metadata=(("authorization", f"Bearer {tokens['beta']}"),))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_client_with_a_4mib_receive_limit_must_raise_it(tmp_path: Path):
    """A message over 4 MiB (here a Fetch chunk, with chunk_bytes raised) is refused by a
    client left at grpc's usual default, and received once the channel allows the
    daemon's max_message_bytes."""
    d = Daemon(make_config(tmp_path, host_capacity=64 << 20, chunk_bytes=8 << 20))
    await d.start()
    layout = KVLayout(model="test/big", dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=1,
                      block_size_tokens=4, block_bytes=6 << 20)
    block = os.urandom(layout.bytes_per_block)
    try:
        async with grpc.aio.insecure_channel(d.bound[1]) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            header = kvstore_pb2.PutHeader(namespace=ns(layout), keys=tokens_keys([1, 2, 3, 4]))
            await stub.Put(iter([kvstore_pb2.PutRequest(header=header),
                                 kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=0, data=block))]))
        fetch = kvstore_pb2.FetchRequest(namespace=ns(layout), keys=tokens_keys([1, 2, 3, 4]))
        four_mib = [("grpc.max_receive_message_length", 4 << 20)]
        async with grpc.aio.insecure_channel(d.bound[1], options=four_mib) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await fetch_raw(kvstore_pb2_grpc.KVStoreStub(channel), fetch)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        raised = [("grpc.max_receive_message_length", d.config.max_message_bytes)]
        async with grpc.aio.insecure_channel(d.bound[1], options=raised) as channel:
            _, chunks = await fetch_raw(kvstore_pb2_grpc.KVStoreStub(channel), fetch)
            assert b"".join(c.data for c in chunks) == block
    finally:
        await d.stop(grace_s=0)
