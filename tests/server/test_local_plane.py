"""The shared-memory data plane against the real daemon: identical bytes to the gRPC
path, slots never reused while leased, verification of what was copied, rollback of
abandoned puts, and fallback when the segment cannot be mapped."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import grpc
import numpy as np
import pytest
import xxhash

from kvstore.client import AsyncClient, Client
from kvstore.client._local import PARALLEL_MIN_BYTES
from kvstore.convert import layout_to_proto
from kvstore.errors import FailedPrecondition
from kvstore.layout import KVLayout
from kvstore.shm import AttachedSegment
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc


def blocks_for(layout, n):
    return [os.urandom(layout.bytes_per_block) for _ in range(n)]


def test_local_and_grpc_paths_give_identical_bytes(daemon_thread, layout):
    with Client(daemon_thread.unix_target, data_plane="local") as local, \
         Client(daemon_thread.unix_target, data_plane="grpc") as remote:
        assert local.data_plane_in_use == "local" and remote.data_plane_in_use == "grpc"
        a_tokens, b_tokens = list(range(12)), list(range(100, 112))
        a, b = blocks_for(layout, 3), blocks_for(layout, 3)
        assert local.put(layout, a_tokens, a).stored == 3
        assert remote.put(layout, b_tokens, b).stored == 3
        for kv in (local, remote):
            assert [bytes(x) for x in kv.fetch(layout, a_tokens)] == a
            assert [bytes(x) for x in kv.fetch(layout, b_tokens)] == b
        # Re-put through the other plane is a no-op; partial puts compose across planes.
        assert local.put(layout, b_tokens, b).existing == 3
        c_tokens = list(range(200, 212))
        c = blocks_for(layout, 3)
        local.put(layout, c_tokens, c[:1])
        remote.put(layout, c_tokens, c[1:], first_block=1)
        assert [bytes(x) for x in local.fetch(layout, c_tokens)] == c


def test_auto_picks_local_for_unix_and_loopback(daemon_thread):
    with Client(daemon_thread.unix_target) as kv:
        assert kv.data_plane_in_use == "local"
    with Client(daemon_thread.tcp_target) as kv:
        assert kv.data_plane_in_use == "local"


def test_fetch_into_caller_buffers_over_shared_memory(daemon_thread, layout):
    import torch

    tokens = list(range(16))
    shape = (2, layout.num_layers, layout.block_size_tokens, layout.num_kv_heads, layout.head_dim)
    src = [torch.randn(shape, dtype=torch.float16) for _ in range(4)]
    out = [torch.empty(shape, dtype=torch.float16) for _ in range(4)]
    with Client(daemon_thread.unix_target, data_plane="local") as kv:
        kv.put(layout, tokens, src)
        got = kv.fetch(layout, tokens, out=out[:3])  # three buffers: three blocks
        assert len(got) == 3 and all(torch.equal(s, o) for s, o in zip(src[:3], out[:3]))


def _raw(daemon):
    channel = grpc.insecure_channel(daemon.unix_target)
    return channel, kvstore_pb2_grpc.KVStoreStub(channel), admin_pb2_grpc.AdminStub(channel)


def _ns(layout):
    return kvstore_pb2.Namespace(layout=layout_to_proto(layout))


def _tokens(tokens):
    return kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))


def test_a_leased_slot_is_never_reused(tmp_path, layout):
    from conftest import daemon_in_thread, make_config

    # Room for exactly 4 blocks (1 KiB each, 256-byte aligned).
    cfg = replace(make_config(tmp_path), host_capacity=4 * layout.bytes_per_block)
    with daemon_in_thread(cfg) as daemon:
        target = daemon.unix_target
        with Client(target, data_plane="local") as kv, grpc.insecure_channel(target) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            held_tokens = list(range(8))
            held = blocks_for(layout, 2)
            kv.put(layout, held_tokens, held)
            leased = stub.LocalFetch(kvstore_pb2.LocalFetchRequest(namespace=_ns(layout), keys=_tokens(held_tokens),
                                                                   lease_ms=60_000))
            assert len(leased.offsets) == 2 and leased.lease_id
            # Delete the leased blocks, then churn the tier: the two free slots fill, and
            # the next put must evict those rather than reuse the leased slots.
            assert kv.delete(layout, held_tokens) == 2
            kv.put(layout, list(range(100, 108)), blocks_for(layout, 2))
            kv.put(layout, list(range(200, 208)), blocks_for(layout, 2))
            assert kv.lookup(layout, list(range(100, 108))).num_blocks == 0  # evicted instead
            host = next(t for t in kv.stats().tiers if t.name == "host")
            assert host.used_bytes == 4 * layout.bytes_per_block  # 2 live + 2 held by the lease
            seg = stub.LocalSegment(kvstore_pb2.LocalSegmentRequest())
            mapped = AttachedSegment(seg.path, seg.token)
            try:
                for off, want in zip(leased.offsets, held):
                    assert bytes(mapped.data[off : off + layout.bytes_per_block]) == want
            finally:
                mapped.close()
            # Once released, the slots are free again: no eviction is needed for two more.
            assert stub.Unpin(kvstore_pb2.UnpinRequest(lease_id=leased.lease_id)).released
            host = next(t for t in kv.stats().tiers if t.name == "host")
            assert host.used_bytes == 2 * layout.bytes_per_block
            assert kv.put(layout, list(range(300, 308)), blocks_for(layout, 2)).stored == 2
            assert kv.lookup(layout, list(range(200, 208))).num_blocks == 2


def flip_byte(stub, layout, tokens, block: int, at: int, mask: int) -> None:
    """Corrupt stored block `block` of `tokens` in place, behind the daemon's back: XOR the
    byte `at` into it with `mask`, through a mapping of the daemon's segment."""
    leased = stub.LocalFetch(kvstore_pb2.LocalFetchRequest(namespace=_ns(layout), keys=_tokens(tokens)))
    stub.Unpin(kvstore_pb2.UnpinRequest(lease_id=leased.lease_id))
    seg = stub.LocalSegment(kvstore_pb2.LocalSegmentRequest())
    mapped = AttachedSegment(seg.path, seg.token)
    try:
        mapped.data[leased.offsets[block] + at] ^= mask
    finally:
        mapped.close()


def test_a_corrupted_slot_is_never_returned_and_is_dropped(daemon_thread, layout):
    tokens = list(range(12))
    blocks = blocks_for(layout, 3)
    channel, stub, admin = _raw(daemon_thread)
    with channel, Client(daemon_thread.unix_target, data_plane="local") as kv:
        kv.put(layout, tokens, blocks)
        flip_byte(stub, layout, tokens, 1, 5, 0x01)  # a stray write into block 1
        got = kv.fetch(layout, tokens)
        assert [bytes(g) for g in got] == blocks[:1]
        stats = admin.Stats(admin_pb2.StatsRequest())
        assert stats.counters.checksum_failures == 1
        assert kv.lookup(layout, tokens).num_blocks == 1  # the daemon re-checked and dropped it


def test_wrong_client_checksums_are_caught_on_read(daemon_thread, layout):
    tokens = list(range(4))
    block = os.urandom(layout.bytes_per_block)
    channel, stub, admin = _raw(daemon_thread)
    with channel:
        header = kvstore_pb2.PutHeader(namespace=_ns(layout), keys=_tokens(tokens), num_blocks=1)
        begun = stub.LocalPut(kvstore_pb2.LocalPutRequest(header=header))
        seg = stub.LocalSegment(kvstore_pb2.LocalSegmentRequest())
        mapped = AttachedSegment(seg.path, seg.token)
        try:
            mapped.data[begun.offsets[0] : begun.offsets[0] + len(block)] = block
        finally:
            mapped.close()
        stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, checksums=[12345]))
    with Client(daemon_thread.unix_target, data_plane="grpc") as kv:
        assert kv.fetch(layout, tokens) == []
        assert kv.stats().counters.checksum_failures == 1


def test_abandoned_local_put_is_invisible_and_rolled_back(daemon_thread, layout):
    tokens = list(range(8))
    channel, stub, admin = _raw(daemon_thread)
    with channel:
        header = kvstore_pb2.PutHeader(namespace=_ns(layout), keys=_tokens(tokens), num_blocks=2)
        begun = stub.LocalPut(kvstore_pb2.LocalPutRequest(header=header))
        used = next(t for t in admin.Stats(admin_pb2.StatsRequest()).tiers if t.name == "host").used_bytes
        assert used == 2 * layout.bytes_per_block  # reserved, PENDING
        with Client(daemon_thread.unix_target) as kv:
            assert kv.lookup(layout, tokens).num_blocks == 0
        stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True))
        used = next(t for t in admin.Stats(admin_pb2.StatsRequest()).tiers if t.name == "host").used_bytes
        assert used == 0
        with pytest.raises(grpc.RpcError) as info:
            stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, checksums=[0, 0]))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _host_used(kv: Client) -> int:
    return next(t for t in kv.stats().tiers if t.name == "host").used_bytes


@pytest.mark.parametrize("reserve_ahead", [0, 2], ids=["two-trip", "one-trip"])
async def test_a_copy_that_fails_hands_its_slots_back_at_once(daemon_thread, layout, monkeypatch, reserve_ahead):
    """Both clients: when the copy into a put's slots fails, the SDK aborts the put (or
    gives back the reservation it was copying into) before the error reaches the caller,
    so the slots are free at once instead of when the put would expire."""
    from kvstore.client._local import LocalPlane

    def broken_copy_in(self, offsets, blocks):  # type: ignore[no-untyped-def]
        raise OSError("the copy failed")

    reserved = 2 * layout.bytes_per_block if reserve_ahead else 0  # slots held for the next put
    with Client(daemon_thread.unix_target, data_plane="local", reserve_ahead=reserve_ahead) as kv:
        async with AsyncClient(daemon_thread.unix_target, data_plane="local", reserve_ahead=reserve_ahead) as akv:
            for n, put in enumerate((kv.put, akv.put)):
                warm, tokens = list(range(1000 * n, 1000 * n + 8)), list(range(1000 * n + 100, 1000 * n + 108))
                data = blocks_for(layout, 2)
                first = put(layout, warm, blocks_for(layout, 2))
                assert (await first if n else first).stored == 2
                used = _host_used(kv)
                with monkeypatch.context() as patch:
                    patch.setattr(LocalPlane, "copy_in", broken_copy_in)
                    with pytest.raises(OSError, match="the copy failed"):
                        failed = put(layout, tokens, data)
                        await failed if n else failed
                assert _host_used(kv) == used - reserved
                assert kv.lookup(layout, tokens).num_blocks == 0
                again = put(layout, tokens, data)
                assert (await again if n else again).stored == 2
                assert kv.fetch(layout, tokens) == data


async def test_local_puts_expire_on_their_own(layout):
    from kvstore.core.policies import LRUPolicy
    from kvstore.core.store import Store, StoreTier
    from kvstore.server.local_puts import LocalPuts
    from kvstore.tiers.host import HostTier

    now = [0.0]
    store = Store([StoreTier(HostTier(1 << 20), LRUPolicy())])
    puts = LocalPuts(ttl_ms=1000, clock=lambda: now[0])
    ns = store.register(layout)
    from kvstore.hashing import block_hashes

    txn = store.begin_put(ns, block_hashes(ns, list(range(8)), 4), tier="host")
    await txn.reserve()  # may make room by demoting, which awaits copies
    txn_id = puts.begin(txn)
    assert store.tiers[0].tier.used_bytes > 0
    now[0] = 1.5
    assert puts.expire() == 1
    assert store.tiers[0].tier.used_bytes == 0
    with pytest.raises(FailedPrecondition, match="rolled back"):
        puts.take(txn_id)
    store.close()


def test_unmappable_segment_falls_back_to_grpc(daemon_thread, layout):
    seg_path = daemon_thread.store.tiers[0].tier.segment.path
    os.unlink(seg_path)  # the daemon keeps its mapping; nobody else can open it now
    with Client(daemon_thread.unix_target) as kv:
        assert kv.data_plane_in_use == "grpc"
        kv.put(layout, list(range(4)), blocks_for(layout, 1))
        assert kv.lookup(layout, list(range(4))).num_blocks == 1
    with Client(daemon_thread.unix_target, data_plane="local") as kv:
        with pytest.raises(FailedPrecondition, match="shared-memory"):
            kv.put(layout, list(range(4)), blocks_for(layout, 1))


async def test_async_client_over_shared_memory(daemon, layout):
    async with AsyncClient(daemon.unix_target, data_plane="local") as kv:
        assert await kv.data_plane_in_use() == "local"
        prompts = [list(range(i * 100, i * 100 + 12)) for i in range(6)]
        payloads = [blocks_for(layout, 3) for _ in prompts]
        await asyncio.gather(*(kv.put(layout, p, b) for p, b in zip(prompts, payloads)))
        got = await asyncio.gather(*(kv.fetch(layout, p) for p in prompts))
        assert [[bytes(x) for x in g] for g in got] == payloads


def test_fetch_leases_end_with_the_next_local_call_or_close(daemon_thread, layout):
    tokens = list(range(8))
    with Client(daemon_thread.tcp_target, data_plane="grpc") as admin, \
         Client(daemon_thread.unix_target, data_plane="local") as kv:
        kv.put(layout, tokens, blocks_for(layout, 2))
        kv.fetch(layout, tokens)
        assert admin.stats().counters.leases_active == 1  # the slots stay held until the next call
        kv.put(layout, list(range(100, 104)), blocks_for(layout, 1))
        assert admin.stats().counters.leases_active == 0
        kv.fetch(layout, tokens)
        kv.close()
        assert admin.stats().counters.leases_active == 0


# Blocks of 1 MiB in batches of 8: large enough that the shared-memory plane shares the
# copies and hashes between two threads, and that gRPC moves each block as its own
# message (or, with a small chunk size, as several).
BIG_LAYOUT = KVLayout(model="big-blocks", dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=1 << 15,
                      block_size_tokens=16)
BIG_BATCH = 8


@pytest.mark.parametrize("nbytes", [0, 1, 65535, 65536, 65537, (1 << 20) + 3])
def test_copy_and_hash_gives_the_copy_and_its_xxh3(nbytes):
    from kvstore.native import XXH3, native

    assert XXH3  # bound wherever the compiled module is built
    src = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    want = xxhash.xxh3_64_intdigest(src.tobytes())
    assert native.copy_hash(dst, src) == want
    assert dst.tobytes() == src.tobytes()
    # Streamed past the cache and hashed from the source (a put), at every alignment.
    for shift in (0, 1, 16):
        room = np.zeros(nbytes + 32, dtype=np.uint8)
        out = room[shift : shift + nbytes]
        assert native.copy_hash(out, src, True) == want
        assert out.tobytes() == src.tobytes() and not room[:shift].any() and not room[shift + nbytes :].any()


def test_copy_and_hash_refuses_bad_buffers():
    from kvstore.native import native

    with pytest.raises(ValueError, match="copy of 5 bytes into 4 bytes"):
        native.copy_hash(bytearray(4), b"12345")
    with pytest.raises((BufferError, TypeError)):
        native.copy_hash(b"1234", b"1234")  # the destination is read-only


@pytest.fixture(params=["compiled", "python"])
def copy_path(request, monkeypatch):
    """The client's copy-and-hash, compiled and in numpy/xxhash."""
    import kvstore.client._local

    if request.param == "python":
        monkeypatch.setattr(kvstore.client._local, "XXH3", False)
    return request.param


def test_large_batches_give_identical_bytes_on_both_planes(daemon_thread, copy_path):
    assert BIG_LAYOUT.bytes_per_block * BIG_BATCH >= PARALLEL_MIN_BYTES  # the two-thread copy path
    a_tokens, b_tokens = list(range(16 * BIG_BATCH)), list(range(10_000, 10_000 + 16 * BIG_BATCH))
    a, b = blocks_for(BIG_LAYOUT, BIG_BATCH), blocks_for(BIG_LAYOUT, BIG_BATCH)
    # An odd chunk size: each block crosses gRPC as several messages, split mid-block.
    with Client(daemon_thread.unix_target, data_plane="local") as local, \
         Client(daemon_thread.unix_target, data_plane="grpc", chunk_bytes=300_001) as remote:
        assert local.data_plane_in_use == "local" and remote.data_plane_in_use == "grpc"
        assert local.put(BIG_LAYOUT, a_tokens, a).stored == BIG_BATCH
        assert remote.put(BIG_LAYOUT, b_tokens, b).stored == BIG_BATCH
        for kv in (local, remote):
            for tokens, want in ((a_tokens, a), (b_tokens, b)):
                assert [bytes(x) for x in kv.fetch(BIG_LAYOUT, tokens)] == want
                out = [np.zeros(BIG_LAYOUT.bytes_per_block, dtype=np.uint8) for _ in range(BIG_BATCH)]
                got = kv.fetch(BIG_LAYOUT, tokens, out=out)
                assert len(got) == BIG_BATCH and [o.tobytes() for o in out] == want


@pytest.mark.parametrize("plane", ["local", "grpc"])
def test_a_corrupted_slot_in_a_large_batch_is_never_returned(daemon_thread, plane, copy_path):
    """A stray write into one slot of a batch: whichever plane fetches, the blocks before
    it come back intact, it and the ones after it do not, and the daemon drops it."""
    tokens = list(range(16 * BIG_BATCH))
    blocks = blocks_for(BIG_LAYOUT, BIG_BATCH)
    bad = 5
    channel, stub, admin = _raw(daemon_thread)
    with channel, Client(daemon_thread.unix_target, data_plane="local") as writer:
        writer.put(BIG_LAYOUT, tokens, blocks)
        flip_byte(stub, BIG_LAYOUT, tokens, bad, BIG_LAYOUT.bytes_per_block - 1, 0x80)  # its very last byte
        with Client(daemon_thread.unix_target, data_plane=plane) as kv:
            out = [np.zeros(BIG_LAYOUT.bytes_per_block, dtype=np.uint8) for _ in range(BIG_BATCH)]
            got = kv.fetch(BIG_LAYOUT, tokens, out=out)
            assert len(got) == bad
            assert [o.tobytes() for o in out[:bad]] == blocks[:bad]
            assert admin.Stats(admin_pb2.StatsRequest()).counters.checksum_failures == 1
            assert kv.lookup(BIG_LAYOUT, tokens).num_blocks == bad  # dropped, not just skipped
            assert [bytes(x) for x in kv.fetch(BIG_LAYOUT, tokens)] == blocks[:bad]


def test_a_plane_closes_while_a_cancelled_helper_waits_in_its_pool(tmp_path):
    """A large batch whose helper is queued behind another job is copied by the calling
    thread alone, and its cancelled helper holds no view of the segment: the plane
    closes (unmapping the segment) as soon as the pool is free again."""
    import threading

    import xxhash

    from kvstore.client._local import PARALLEL_MIN_BYTES, LocalPlane
    from kvstore.tiers.segment import Segment

    block, n = 1 << 20, PARALLEL_MIN_BYTES // (1 << 20) + 2
    owner = Segment(block * n, str(tmp_path))
    plane = LocalPlane(AttachedSegment(owner.path, owner.token), owner.token)
    try:
        plane._run([(np.zeros(1, np.uint8), np.ones(1, np.uint8))] * 2)  # small: no pool yet
        from concurrent.futures import ThreadPoolExecutor
        plane._pool = ThreadPoolExecutor(1)
        release = threading.Event()
        busy = plane._pool.submit(release.wait, 10)
        blocks = [os.urandom(block) for _ in range(n)]
        sums = plane.copy_in([i * block for i in range(n)], [memoryview(b) for b in blocks])
        assert sums == [xxhash.xxh3_64_intdigest(b) for b in blocks]
        release.set()
        plane.close()  # at once: raises BufferError if a view of the segment were still held
        assert busy.result(10) is True
    finally:
        release.set()
        plane.close()
        owner.close()


def test_concurrent_batches_on_one_plane_copy_and_verify_each_block(tmp_path):
    """Several threads copying large batches through one mapping at once (the async client
    runs each call's copies in a thread): every block lands where it belongs, with the
    checksum of its own bytes, whichever thread copied it."""
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    from kvstore.client._local import LocalPlane
    from kvstore.tiers.segment import Segment

    block, per_batch, batches = 1 << 20, 6, 3
    owner = Segment(block * per_batch * batches, str(tmp_path))
    plane = LocalPlane(AttachedSegment(owner.path, owner.token), owner.token)
    try:
        srcs = [[os.urandom(block) for _ in range(per_batch)] for _ in range(batches)]
        offsets = [[(b * per_batch + i) * block for i in range(per_batch)] for b in range(batches)]
        with ThreadPoolExecutor(batches) as pool:
            sums = list(pool.map(lambda b: plane.copy_in(offsets[b], [memoryview(x) for x in srcs[b]]),
                                 range(batches)))
            assert sums == [[xxhash.xxh3_64_intdigest(x) for x in batch] for batch in srcs]
            outs = [[bytearray(block) for _ in range(per_batch)] for _ in range(batches)]
            good = list(pool.map(lambda b: plane.copy_out(offsets[b], sums[b], block,
                                                          [memoryview(o) for o in outs[b]]), range(batches)))
        assert good == [per_batch] * batches
        assert [[bytes(o) for o in batch] for batch in outs] == srcs
        # A wrong checksum for the fourth block: the first three are reported good.
        wrong = list(sums[0])
        wrong[3] ^= 1
        assert plane.copy_out(offsets[0], wrong, block, [memoryview(o) for o in outs[0]]) == 3
    finally:
        plane.close()
        owner.close()
