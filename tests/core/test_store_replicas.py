"""Replicas (copies of blocks another daemon of a pool owns): a tier's first victims,
oldest first, dropped rather than demoted, never written through to SSD; kept while
pinned; and `present`, the probe a cluster makes past a lookup's prefix."""

from __future__ import annotations

import os

from kvstore.core.policies import LRUPolicy, make_policy
from kvstore.core.store import Store, StoreTier
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout
from kvstore.tiers.memory import MemoryTier
from tests.fakes import ManualClock

LAYOUT = KVLayout(model="unit", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)
BLOCK = LAYOUT.bytes_per_block


def chain(n: int, start: int = 0) -> list[bytes]:
    return block_hashes(LAYOUT.namespace_id, list(range(start, start + n * 4)), 4)


async def put(store: Store, hashes: list[bytes]) -> None:
    ns = store.register(LAYOUT)
    async with store.begin_put(ns, hashes) as txn:
        for i in range(len(hashes)):
            await txn.write(i, os.urandom(BLOCK))
        await txn.commit()


def held(store: Store, hashes: list[bytes]) -> int:
    return sum(store.block(LAYOUT.namespace_id, h) is not None for h in hashes)


async def test_replicas_are_evicted_first_oldest_first() -> None:
    store = Store([StoreTier(MemoryTier(8 * BLOCK), LRUPolicy())], clock=ManualClock(1.0))
    owned, copies, more = chain(3, 0), chain(3, 1000), chain(4, 2000)
    await put(store, owned)
    await put(store, copies)
    assert store.mark_replicas(LAYOUT.namespace_id, copies) == 3
    # The owned blocks are the least recently used, yet the replicas go first.
    store.lookup(LAYOUT.namespace_id, copies)
    await put(store, more)
    assert held(store, owned) == 3 and held(store, more) == 4
    assert held(store, copies) == 1 and store.block(LAYOUT.namespace_id, copies[2]) is not None
    assert store.tiers[0].counters.evictions == 2


async def test_a_pinned_replica_stays_and_the_policy_order_takes_over() -> None:
    store = Store([StoreTier(MemoryTier(4 * BLOCK), LRUPolicy())], clock=ManualClock(1.0))
    owned, copies = chain(2, 0), chain(2, 1000)
    await put(store, owned)
    await put(store, copies)
    store.mark_replicas(LAYOUT.namespace_id, copies)
    pin = store.pin(LAYOUT.namespace_id, copies, ttl_ms=60_000)
    await put(store, chain(1, 3000))
    assert held(store, copies) == 2 and held(store, owned) == 1  # the policy's victim instead
    store.unpin(pin.lease_id)
    await put(store, chain(1, 4000))
    assert held(store, copies) == 1


async def test_replicas_are_dropped_not_demoted_and_not_written_through() -> None:
    top = StoreTier(MemoryTier(4 * BLOCK, name="hbm"), make_policy("lru"), 0.95, 0.5)
    below = StoreTier(MemoryTier(16 * BLOCK, name="host"), make_policy("lru"), 0.95, 0.5)
    store = Store([top, below], clock=ManualClock(1.0))
    copies, owned = chain(2, 1000), chain(3, 0)
    await put(store, copies)
    store.mark_replicas(LAYOUT.namespace_id, copies)
    await put(store, owned)
    await store.migrate_once(top)
    assert held(store, copies) < 2  # a replica left: dropped, not moved below
    assert below.tier.blocks + top.tier.blocks == held(store, copies) + held(store, owned)
    for h in copies:
        info = store.block(LAYOUT.namespace_id, h)
        assert info is None or "host" not in info.tiers


async def test_present_answers_which_blocks_are_held_without_counting() -> None:
    store = Store([StoreTier(MemoryTier(8 * BLOCK), LRUPolicy())], clock=ManualClock(1.0))
    hashes = chain(4)
    ns = store.register(LAYOUT)
    assert store.present(ns, b"".join(hashes)) == bytes([Store.ABSENT]) * 4
    await put(store, [hashes[1]])
    await put(store, [hashes[3]])
    before = (store.counters.lookups, store.tiers[0].counters.hits)
    tid = store.tier_id_names.index("memory")
    assert store.present(ns, b"".join(hashes)) == bytes([Store.ABSENT, tid, Store.ABSENT, tid])
    assert store.present(ns, b"") == b""
    assert (store.counters.lookups, store.tiers[0].counters.hits) == before
