"""FetchStream: blocks leave one at a time, each right after its own copy verified.

A recording `frame` shows what was copied when: block i is copied only once block i-1
has been handed on, and a block that fails verification ends the stream with nothing
after it copied or sent, whether the copy runs on the loop (blocks up to
FETCH_INLINE_BYTES) or on a hashing thread (larger ones). Real host and SSD tiers.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import kvstore.core.fetch as fetch_mod
from kvstore.core.index import make_key
from kvstore.core.policies import LRUPolicy, make_policy
from kvstore.core.store import MigrationConfig, Store, StoreTier
from kvstore.hashing import HASH_BYTES
from kvstore.layout import KVLayout
from kvstore.tiers.host import HostTier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.ssd import SsdTier
from kvstore.wire import Framed, copy_frame
from tests.fakes import ManualClock

LAYOUT = KVLayout(model="fetch-stream", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64,
                  block_size_tokens=4)
BLOCK = LAYOUT.bytes_per_block  # 1024


class Recorder:
    """A `frame` that copies like the store's own and records which blocks it copied,
    on which thread; optionally slow, to hold a copy in flight."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.positions: list[int] = []
        self.threads: set[int] = set()
        self.delay_s = delay_s
        self.started = threading.Event()
        self.finished = 0

    def __call__(self, index: int, data: memoryview) -> Framed:
        self.positions.append(index)
        self.threads.add(threading.get_ident())
        self.started.set()
        if self.delay_s:
            time.sleep(self.delay_s)
        framed = copy_frame(index, data)
        self.finished += 1
        return framed


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(2, thread_name_prefix="test-hash")
    yield pool
    pool.shutdown(wait=True)


def make_store(blocks: int, executor: ThreadPoolExecutor | None = None) -> Store:
    return Store([StoreTier(HostTier(blocks * BLOCK), LRUPolicy())], clock=ManualClock(1000.0), executor=executor)


def hashes(n: int) -> list[bytes]:
    return [(7_000 + i).to_bytes(HASH_BYTES, "big") for i in range(n)]


async def put(store: Store, hs: list[bytes]) -> list[bytes]:
    blocks = [os.urandom(BLOCK) for _ in hs]
    ns = store.register(LAYOUT)
    async with store.begin_put(ns, hs) as txn:
        for i, b in enumerate(blocks):
            await txn.write(i, b)
        await txn.commit()
    return blocks


def corrupt(store: Store, h: bytes) -> None:
    """Flip a byte of the block in its host slot, behind the store's back."""
    info = store.block(LAYOUT.namespace_id, h)
    assert info is not None and info.tier == "host"
    store.tiers[0].tier.view(info.slot, BLOCK)[11] ^= 0xFF


def readers(store: Store, hs: list[bytes]) -> list[int]:
    index = store.index
    return [index.get(make_key(LAYOUT.namespace_id, h)).readers for h in hs]


async def test_each_block_is_copied_only_after_the_one_before_it_went_out() -> None:
    store = make_store(16)
    hs = hashes(12)
    blocks = await put(store, hs)
    frame = Recorder()
    got = []
    async with store.open_fetch(LAYOUT.namespace_id, hs) as stream:
        async for framed in stream.frames(frame):
            # Nothing is copied ahead of the consumer: block i was the last one copied.
            assert frame.positions == list(range(len(got) + 1))
            got.append(framed.messages[0])
    assert got == blocks


@pytest.mark.parametrize("off_loop", [False, True], ids=["on-loop", "hashing-thread"])
async def test_a_corrupt_block_mid_stream_ends_it_and_nothing_after_it_is_copied(
    off_loop: bool, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    if off_loop:  # every block counts as large: copied and hashed on a hashing thread
        monkeypatch.setattr(fetch_mod, "FETCH_INLINE_BYTES", 0)
    store = make_store(16, executor)
    hs = hashes(10)
    blocks = await put(store, hs)
    corrupt(store, hs[4])
    frame = Recorder()
    async with store.open_fetch(LAYOUT.namespace_id, hs) as stream:
        got = [f.messages[0] async for f in stream.frames(frame)]
    assert got == blocks[:4]
    assert frame.positions == [0, 1, 2, 3, 4]  # the bad block was copied (and failed); none after it
    assert (threading.get_ident() not in frame.threads) is off_loop
    assert store.counters.checksum_failures == 1
    assert store.counters.blocks_fetched == 4
    # The bad copy was dropped; the blocks after it are intact and still served.
    assert store.block(LAYOUT.namespace_id, hs[4]) is None
    async with store.open_fetch(LAYOUT.namespace_id, hs[5:]) as stream:
        assert [b async for b in stream] == blocks[5:]
    assert readers(store, hs[:4] + hs[5:]) == [0] * 9


async def test_closing_mid_copy_waits_for_the_copy_before_letting_go_of_the_blocks(
    executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch_mod, "FETCH_INLINE_BYTES", 0)
    store = make_store(8, executor)
    hs = hashes(4)
    await put(store, hs)
    frame = Recorder(delay_s=0.2)

    async def consume() -> None:
        async with store.open_fetch(LAYOUT.namespace_id, hs) as stream:
            async for _ in stream.frames(frame):
                pass

    task = asyncio.create_task(consume())
    while not frame.started.is_set():
        await asyncio.sleep(0.001)
    task.cancel()  # the client went away while block 0 is being copied on a thread
    with pytest.raises(asyncio.CancelledError):
        await task
    # The stream closed only after that copy ended: the slot it read was still held.
    assert frame.finished == len(frame.positions) == 1
    assert readers(store, hs) == [0] * 4
    assert store.counters.blocks_fetched == 0


async def ssd_backed(tmp_path: Path, model: str, n: int) -> tuple[Store, SsdTier, bytes, list[bytes], list[bytes]]:
    """A started store of 4 memory slots over an SSD tier, holding `n` blocks put two at
    a time and written through, so most end on SSD only: (store, its SSD tier, namespace
    id, hashes, blocks). The caller closes it (`aclose`)."""
    layout = KVLayout(model=model, dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)
    ssd = SsdTier(str(tmp_path / "ssd"), 1 << 20, region_size=64 << 10, io_threads=2)
    store = Store([StoreTier(MemoryTier(4 * BLOCK, name="host"), make_policy("lru"), 0.9, 0.5),
                   StoreTier(ssd, make_policy("lru"))],
                  migration=MigrationConfig(promote_on_hit=False, tick_s=3600))
    await store.start()
    try:
        hs = hashes(n)
        ns = store.register(layout)
        blocks = [os.urandom(BLOCK) for _ in hs]
        for i in range(0, n, 2):
            async with store.begin_put(ns, hs[i : i + 2]) as txn:
                for j in range(2):
                    await txn.write(j, blocks[i + j])
                await txn.commit()
            assert await store.flush(10)  # written through to SSD: the memory copies may go
    except BaseException:
        await store.aclose()
        raise
    return store, ssd, ns, hs, blocks


async def test_blocks_on_ssd_are_read_ahead_concurrently_and_come_back_exact(tmp_path: Path) -> None:
    store, ssd, ns, hs, blocks = await ssd_backed(tmp_path, "fetch-stream-ssd", 12)
    try:
        on_ssd = store.lookup(ns, hs).tiers.count("ssd")
        assert on_ssd >= 8
        in_flight = peak = 0
        get_block = ssd.get_block

        async def counting_get_block(slot, nbytes):  # type: ignore[no-untyped-def]
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await get_block(slot, nbytes)
            finally:
                in_flight -= 1

        ssd.get_block = counting_get_block  # type: ignore[method-assign]
        async with store.open_fetch(ns, hs) as stream:
            assert [b async for b in stream] == blocks
        assert peak > 1  # the reads overlapped instead of one per block in turn
        assert store.counters.blocks_fetched == 12
    finally:
        await store.aclose()


async def test_served_blocks_count_as_hits_for_the_tier_policy() -> None:
    store = make_store(8)
    hs = hashes(4)
    await put(store, hs)
    policy = store.tiers[0].policy
    assert isinstance(policy, LRUPolicy)
    key = [make_key(LAYOUT.namespace_id, h) for h in hs]
    before = policy.order()
    assert sorted(before) == sorted(key)
    async with store.open_fetch(LAYOUT.namespace_id, hs[:2]) as stream:
        assert len([b async for b in stream]) == 2
    # The served blocks are now the most recent, in the order they were served.
    assert policy.order() == [k for k in before if k not in key[:2]] + key[:2]
    corrupt(store, hs[2])
    async with store.open_fetch(LAYOUT.namespace_id, hs) as stream:
        assert len([b async for b in stream]) == 2  # 0 and 1 again; 2 fails and is dropped
    assert policy.order() == [key[3], key[0], key[1]]


async def batches_of(stream: fetch_mod.FetchStream, most: int) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    async for batch in stream.view_batches(most):
        for b in batch:
            assert fetch_mod.checksum(b.data) == b.checksum
        out.append([bytes(b.data) for b in batch])
    return out


async def test_blocks_in_host_memory_come_in_batches_exact_and_touched_in_order() -> None:
    """A stream whose blocks all sit in host memory is taken in batches of views, each
    checked against its stored checksum, counted, and touched for the policy as `frames`
    touches what it serves."""
    store = make_store(16)
    hs = hashes(10)
    blocks = await put(store, hs)
    policy = store.tiers[0].policy
    assert isinstance(policy, LRUPolicy)
    key = [make_key(LAYOUT.namespace_id, h) for h in hs]
    async with store.open_fetch(LAYOUT.namespace_id, hs[5:] + hs[:5]) as stream:
        got = await batches_of(stream, 4)
        assert readers(store, hs) == [1] * 10  # held until the stream closes
    assert [len(b) for b in got] == [4, 4, 2]
    assert sum(got, []) == blocks[5:] + blocks[:5]
    assert stream.sent == 10 and not stream.ended_early
    assert store.counters.blocks_fetched == 10
    assert policy.order() == key[5:] + key[:5]
    assert readers(store, hs) == [0] * 10


async def test_a_corrupt_block_in_a_batch_ends_the_stream_there_and_its_copy_is_dropped() -> None:
    store = make_store(16)
    hs = hashes(10)
    blocks = await put(store, hs)
    corrupt(store, hs[6])
    async with store.open_fetch(LAYOUT.namespace_id, hs) as stream:
        got = await batches_of(stream, 4)
    assert got == [blocks[:4], blocks[4:6]]  # the batch stops before it; `frames` then fails it
    assert stream.sent == 6 and stream.verification_failed and "block 6" in stream.ended_early
    assert store.counters.checksum_failures == 1 and store.counters.blocks_fetched == 6
    assert store.block(LAYOUT.namespace_id, hs[6]) is None
    assert readers(store, hs[:6] + hs[7:]) == [0] * 9


async def test_a_block_deleted_while_the_stream_runs_ends_it_there() -> None:
    store = make_store(16)
    hs = hashes(8)
    blocks = await put(store, hs)
    async with store.open_fetch(LAYOUT.namespace_id, hs) as stream:
        store.delete(LAYOUT.namespace_id, [hs[3]])
        got = await batches_of(stream, 8)
    assert got == [blocks[:3]]
    assert stream.sent == 3 and not stream.verification_failed and "deleted" in stream.ended_early
    assert readers(store, hs[:3] + hs[4:]) == [0] * 7


async def test_blocks_not_all_in_host_memory_come_one_to_a_batch(tmp_path: Path) -> None:
    """Where some block's top copy has no host view (SSD), the stream goes the way
    `frames` takes it, one block per batch, and comes back exact."""
    store, _, ns, hs, blocks = await ssd_backed(tmp_path, "fetch-stream-mixed", 8)
    try:
        assert "ssd" in store.lookup(ns, hs).tiers
        async with store.open_fetch(ns, hs) as stream:
            got = await batches_of(stream, 4)
        assert [len(b) for b in got] == [1] * 8 and sum(got, []) == blocks
    finally:
        await store.aclose()


async def test_a_stream_holds_its_blocks_until_it_closes_and_frees_a_deleted_ones_slot_then() -> None:
    """A fetch of many blocks holds them in one array step (HOLD_ONE_BY_ONE): each is
    read once more per time the fetch names it, a block deleted meanwhile keeps its slot
    until the close, and the close lets go of every hold."""
    store = make_store(32)
    hs = hashes(16)
    await put(store, hs)
    tier = store.tiers[0].tier
    named = hs + hs[:4]
    assert len(named) > fetch_mod.HOLD_ONE_BY_ONE
    stream = store.open_fetch(LAYOUT.namespace_id, named)
    assert stream.num_blocks == len(named)
    assert readers(store, hs) == [2] * 4 + [1] * 12
    store.delete(LAYOUT.namespace_id, [hs[5]])
    assert tier.blocks == 16  # a reader holds it: its slot stays
    stream.close()
    assert tier.blocks == 15
    assert readers(store, hs[:5] + hs[6:]) == [0] * 15
    stream.close()  # once only
    assert readers(store, hs[:5] + hs[6:]) == [0] * 15
