"""One-trip puts on the shared-memory plane: the daemon holds empty slots for a client's
next put (`reserve_ahead`), the client copies into them and publishes with one
`LocalCommit`. Against the real daemon: what the protocol answers, that every slot of a
reservation comes back (used, aborted, refused), and that the SDK's puts stay exact."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
import xxhash

from kvstore.client import AsyncClient, Client
from kvstore.convert import layout_to_proto
from kvstore.errors import InvalidArgument
from kvstore.shm import AttachedSegment
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc


def _blocks(layout, n):
    return [os.urandom(layout.bytes_per_block) for _ in range(n)]


def _header(layout, hashes):
    return kvstore_pb2.PutHeader(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(layout)),
                                 keys=kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=hashes)),
                                 num_blocks=len(hashes))


def _host_used(admin) -> int:
    stats = admin.Stats(admin_pb2.StatsRequest())
    return next(t.used_bytes for t in stats.tiers if t.name == "host")


def _fill(seg: AttachedSegment, offsets, blocks) -> list[int]:
    for off, data in zip(offsets, blocks):
        seg.data[off : off + len(data)] = data
    return [xxhash.xxh3_64_intdigest(b) for b in blocks]


def test_reserved_slots_take_a_put_in_one_commit(daemon_thread, layout):
    channel = grpc.insecure_channel(daemon_thread.unix_target)
    stub, admin = kvstore_pb2_grpc.KVStoreStub(channel), admin_pb2_grpc.AdminStub(channel)
    seg_info = stub.LocalSegment(kvstore_pb2.LocalSegmentRequest())
    seg = AttachedSegment(seg_info.path, seg_info.token)
    try:
        first = [os.urandom(16) for _ in range(3)]
        begun = stub.LocalPut(kvstore_pb2.LocalPutRequest(header=_header(layout, first), reserve_ahead=3))
        res = begun.reservation
        assert res.reservation_id and len(res.offsets) == 3 and res.block_bytes == layout.bytes_per_block
        assert not set(res.offsets) & set(begun.offsets)
        sums = _fill(seg, begun.offsets, _blocks(layout, 3))
        stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, checksums=sums))
        # 3 stored + 3 reserved.
        assert _host_used(admin) == 6 * layout.bytes_per_block

        # The second put: bytes into the reservation, then one call. Block 0 is a re-put
        # of a stored block (its slot goes back to the pool), blocks 1 and 2 are new.
        second = [first[0]] + [os.urandom(16) for _ in range(2)]
        data = _blocks(layout, 3)
        sums = _fill(seg, res.offsets, data)
        done = stub.LocalCommit(kvstore_pb2.LocalCommitRequest(
            header=_header(layout, second), reservation_id=res.reservation_id, checksums=sums, reserve_ahead=3))
        assert (done.stored, done.existing) == (2, 1)
        nxt = done.reservation
        assert nxt.reservation_id and nxt.reservation_id != res.reservation_id and len(nxt.offsets) == 3
        # 5 stored + 3 reserved: the unused slot was reused, nothing leaked.
        assert _host_used(admin) == 8 * layout.bytes_per_block
        with Client(daemon_thread.unix_target, data_plane="grpc") as kv:
            got = kv.fetch(layout, block_hashes=second[1:])
            assert [bytes(g) for g in got] == data[1:]

        # A reservation serves one put.
        with pytest.raises(grpc.RpcError) as info:
            stub.LocalCommit(kvstore_pb2.LocalCommitRequest(
                header=_header(layout, [os.urandom(16)]), reservation_id=res.reservation_id, checksums=[0]))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        # More blocks than reserved: refused, and the reservation's slots are freed.
        with pytest.raises(grpc.RpcError) as info:
            stub.LocalCommit(kvstore_pb2.LocalCommitRequest(
                header=_header(layout, [os.urandom(16) for _ in range(4)]), reservation_id=nxt.reservation_id,
                checksums=[0] * 4))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _host_used(admin) == 5 * layout.bytes_per_block

        # An abort frees a reservation at once.
        again = stub.LocalPut(kvstore_pb2.LocalPutRequest(header=_header(layout, [os.urandom(16)]), reserve_ahead=2))
        stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=again.txn_id, abort=True))
        assert _host_used(admin) == 7 * layout.bytes_per_block
        stub.LocalCommit(kvstore_pb2.LocalCommitRequest(reservation_id=again.reservation.reservation_id, abort=True))
        assert _host_used(admin) == 5 * layout.bytes_per_block
    finally:
        seg.close()
        channel.close()


def test_a_reservation_is_bounded(daemon_thread, layout):
    with grpc.insecure_channel(daemon_thread.unix_target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.LocalPut(kvstore_pb2.LocalPutRequest(header=_header(layout, [os.urandom(16)]), reserve_ahead=5000))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidArgument):
        Client(daemon_thread.unix_target, reserve_ahead=-1)


def test_sdk_puts_with_reserve_ahead_store_exact_bytes(daemon_thread, layout):
    with Client(daemon_thread.unix_target, data_plane="local", reserve_ahead=4) as kv:
        puts = [(list(range(i * 100, i * 100 + 16)), _blocks(layout, 4)) for i in range(5)]
        for tokens, blocks in puts:
            assert kv.put(layout, tokens, blocks).stored == 4
        # A put smaller than the reservation, and one re-putting stored blocks.
        assert kv.put(layout, list(range(900, 904)), _blocks(layout, 1)).stored == 1
        assert kv.put(layout, puts[0][0], puts[0][1]).existing == 4
        for tokens, blocks in puts:
            assert [bytes(b) for b in kv.fetch(layout, tokens)] == blocks
        host = next(t for t in kv.stats().tiers if t.name == "host")
        assert host.used_bytes == (21 + 4) * layout.bytes_per_block  # stored + the held reservation
    # Closing the client gave its reservation back.
    with Client(daemon_thread.unix_target, data_plane="grpc") as kv:
        host = next(t for t in kv.stats().tiers if t.name == "host")
        assert host.used_bytes == 21 * layout.bytes_per_block


async def test_async_client_puts_in_one_trip_too(daemon, layout):
    async with AsyncClient(daemon.unix_target, data_plane="local", reserve_ahead=2) as kv:
        puts = [(list(range(i * 100, i * 100 + 8)), _blocks(layout, 2)) for i in range(3)]
        for tokens, blocks in puts:
            assert (await kv.put(layout, tokens, blocks)).stored == 2
        for tokens, blocks in puts:
            assert [bytes(b) for b in await kv.fetch(layout, tokens)] == blocks


async def test_puts_running_at_once_each_keep_their_reservation_and_none_is_left_behind(daemon, layout):
    """Sixteen puts of one client at once (all sent before any is answered: one event
    loop) each get a reservation back. The client keeps MAX_HELD of them for its next
    puts and hands the others back at once; closing it hands back the rest: the host
    tier then holds exactly the blocks stored. (A client that kept one reservation per
    block size, each answer replacing the last, left the others' slots taken until they
    expired, put_idle_timeout_s later: with threads or tasks re-putting a few chains,
    the host tier filled with reservations nobody would use.)"""
    from kvstore.client._held import MAX_HELD

    ahead = 2
    puts = [(list(range(i * 100, i * 100 + 8)), _blocks(layout, 2)) for i in range(17)]
    async with AsyncClient(daemon.unix_target, data_plane="local", reserve_ahead=ahead) as kv:
        assert (await kv.put(layout, *puts[0])).stored == 2  # attached, one reservation held
        done = await asyncio.gather(*(kv.put(layout, tokens, blocks) for tokens, blocks in puts[1:]))
        assert [d.stored for d in done] == [2] * 16
        stored = 17 * 2
        host = next(t for t in (await kv.stats()).tiers if t.name == "host")
        assert host.used_bytes == (stored + MAX_HELD * ahead) * layout.bytes_per_block
        # Held ones serve the next puts (re-puts of stored chains here), and come back.
        for tokens, blocks in puts:
            assert (await kv.put(layout, tokens, blocks)).existing == 2
            assert [bytes(b) for b in await kv.fetch(layout, tokens)] == blocks
        host = next(t for t in (await kv.stats()).tiers if t.name == "host")
        assert host.used_bytes <= (stored + MAX_HELD * ahead) * layout.bytes_per_block
    async with AsyncClient(daemon.unix_target, data_plane="grpc") as kv:
        host = next(t for t in (await kv.stats()).tiers if t.name == "host")
    assert host.used_bytes == stored * layout.bytes_per_block


# ------------------------------------------------------------------ with tenants


def _token_file(path, entries: dict[str, str]) -> dict[str, str]:
    """A token file with one client tenant per entry (name -> extra TOML); their tokens."""
    from kvstore.server.auth import new_token

    tokens, lines = {}, []
    for name, extra in entries.items():
        token, token_hash = new_token()
        tokens[name] = token
        lines.append(f'[[tenant]]\nname = "{name}"\nrole = "client"\ntokens = ["{token_hash}"]\n{extra}')
    path.write_text("\n".join(lines))
    os.chmod(path, 0o600)
    return tokens


def test_reservations_belong_to_their_tenant_and_count_against_its_quota(tmp_path, layout):
    from conftest import daemon_in_thread, make_config

    tokens = _token_file(tmp_path / "tokens.toml", {
        "alpha": "local_plane = true\n", "beta": "local_plane = true\n",
        "small": 'local_plane = true\nquota = { host = "4KiB" }\n', "plain": ""})
    cfg = make_config(tmp_path, auth_token_file=str(tmp_path / "tokens.toml"))
    with daemon_in_thread(cfg) as running, grpc.insecure_channel(running.unix_target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        md = {name: (("authorization", f"Bearer {tok}"),) for name, tok in tokens.items()}
        begun = stub.LocalPut(kvstore_pb2.LocalPutRequest(header=_header(layout, [os.urandom(16)]), reserve_ahead=2),
                              metadata=md["alpha"])
        stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True), metadata=md["alpha"])
        res_id = begun.reservation.reservation_id
        assert res_id
        # Another tenant cannot use (or end) it: answered as if it were not open.
        with pytest.raises(grpc.RpcError) as info:
            stub.LocalCommit(kvstore_pb2.LocalCommitRequest(reservation_id=res_id, abort=True), metadata=md["beta"])
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        stub.LocalCommit(kvstore_pb2.LocalCommitRequest(reservation_id=res_id, abort=True), metadata=md["alpha"])

        # The device plane's RPCs need local_plane like the shared-memory ones.
        with pytest.raises(grpc.RpcError) as info:
            stub.DeviceSegment(kvstore_pb2.DeviceSegmentRequest(), metadata=md["plain"])
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

        # One-trip puts of a tenant with a 4 KiB quota (4 blocks) evict its own blocks.
        store = running.store
        with Client(running.unix_target, token=tokens["small"], data_plane="local", reserve_ahead=2) as kv:
            for i in range(6):
                data = _blocks(layout, 2)
                tokens_i = list(range(i * 100, i * 100 + 8))
                assert kv.put(layout, tokens_i, data).stored == 2
                assert store.tenancy.usage("small").get("host", 0) <= 4 * layout.bytes_per_block
                assert [bytes(b) for b in kv.fetch(layout, tokens_i)] == data


def test_a_writer_finds_room_made_ahead_of_its_next_put(tmp_path, layout):
    """With reserve_ahead, a full host tier is brought down in the background to room for
    the writer's next reservation, while the writer copies: its next one-trip put then
    finds its slots free. The blocks evicted are the policy's victims, as always, and
    every stored block that remains is exact."""
    import time
    from dataclasses import replace

    from conftest import daemon_in_thread, make_config

    block = layout.bytes_per_block
    cfg = replace(make_config(tmp_path), host_capacity=12 * block)
    with daemon_in_thread(cfg) as daemon, Client(daemon.unix_target, data_plane="local", reserve_ahead=2) as kv:
        def host():
            return next(t for t in kv.stats().tiers if t.name == "host")

        puts = [(list(range(i * 100, i * 100 + 2 * layout.block_size_tokens)), _blocks(layout, 2))
                for i in range(12)]
        for tokens, blocks in puts:
            assert kv.put(layout, tokens, blocks).stored == 2
            # Stored blocks, the held reservation, and room for the next one.
            deadline = time.monotonic() + 5
            while host().used_bytes > (12 - 2) * block and time.monotonic() < deadline:
                time.sleep(0.01)
            assert host().used_bytes <= (12 - 2) * block
        assert host().evictions > 0
        held = [(t, b) for t, b in puts if kv.lookup(layout, t).num_blocks == 2]
        assert held and puts[-1] in held  # the newest chain is never the victim
        for tokens, blocks in held:
            assert [bytes(b) for b in kv.fetch(layout, tokens)] == blocks
