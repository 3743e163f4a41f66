"""A pull over the data lane lands in one put reserved for all its runs (`_PullSink`):
the runs that landed whole are published together, verified bytes only, and a run cut
short is rolled back with the runs after it; replica runs are marked replicas."""

from __future__ import annotations

import os

from kvstore.checksum import checksum
from kvstore.cluster.breaker import Breakers
from kvstore.cluster.pull import Puller, PullRun, _PullSink
from kvstore.core.policies import LRUPolicy
from kvstore.core.store import Store, StoreTier
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout
from kvstore.tiers.memory import MemoryTier
from kvstore.wire import copy_frame
from tests.fakes import ManualClock

LAYOUT = KVLayout(model="unit", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)
BLOCK = LAYOUT.bytes_per_block
NS = LAYOUT.namespace_id


def setup(blocks: int) -> tuple[Store, Puller, list[tuple[str, list[tuple[PullRun, int]]]]]:
    store = Store([StoreTier(MemoryTier(blocks * BLOCK, name="host"), LRUPolicy())], clock=ManualClock(1.0))
    store.register(LAYOUT)
    puller = Puller(store, transport=None, breakers=Breakers(1.0), executor=None,  # type: ignore[arg-type]
                    max_running=1, timeout_s=1.0)
    told: list[tuple[str, list[tuple[PullRun, int]]]] = []
    puller.pulled = lambda node, landed: told.append((node, list(landed)))
    return store, puller, told


def runs_of(hashes: list[bytes], spans: list[tuple[int, int, bool]]) -> list[PullRun]:
    return [PullRun(NS, hashes[a:b], hashes[a - 1] if a else None, replica, a) for a, b, replica in spans]


async def served(store: Store, hashes: list[bytes]) -> list[bytes]:
    async with store.open_fetch(NS, hashes) as stream:
        return [bytes(f.messages[0]) async for f in stream.frames(copy_frame)]


async def test_the_runs_that_landed_whole_are_published_together_and_the_rest_rolled_back() -> None:
    store, puller, told = setup(32)
    hashes = block_hashes(NS, list(range(14 * 4)), 4)
    runs = runs_of(hashes, [(2, 5, False), (7, 10, True), (11, 14, False)])
    sink = _PullSink(puller, "b", runs)
    dests = await sink.destinations()
    assert len(dests) == 9 and store.tiers[0].tier.blocks == 9
    data = [os.urandom(BLOCK) for _ in dests]
    for view, payload in zip(dests, data):
        view[:] = payload
    # Seven blocks landed: the first two runs whole, the third cut short.
    await sink.landed(7, [checksum(d) for d in data[:7]], False)
    sink.abort()
    assert store.tiers[0].tier.blocks == 6  # the cut run's slots are free again
    assert await served(store, hashes[2:5]) == data[:3]
    assert await served(store, hashes[7:10]) == data[3:6]
    assert store.block(NS, hashes[11]) is None
    assert puller.counters.pulled_blocks == 6 and puller.counters.replica_blocks == 3
    assert puller.counters.rolled_back_blocks == 3
    assert [(node, [(r.position, n) for r, n in landed]) for node, landed in told] == [("b", [(2, 3), (7, 3)])]
    assert not puller.pending


async def test_a_block_that_does_not_match_its_checksum_is_never_served() -> None:
    store, puller, _ = setup(16)
    hashes = block_hashes(NS, list(range(6 * 4)), 4)
    sink = _PullSink(puller, "b", runs_of(hashes, [(0, 3, False)]))
    dests = await sink.destinations()
    data = [os.urandom(BLOCK) for _ in dests]
    for view, payload in zip(dests, data):
        view[:] = payload
    sums = [checksum(d) for d in data]
    dests[1][:4] = b"\xff\xff\xff\xff" if data[1][:4] != b"\xff\xff\xff\xff" else b"\x00\x00\x00\x00"
    await sink.landed(3, sums, False)
    sink.abort()
    assert await served(store, hashes[:3]) == data[:1]  # the bad block is dropped on read, nothing past it
