"""The store's control plane, driven directly: two-phase put, prefix lookup, leases,
accounting, eviction and verification. Real host tier, a manual clock for leases."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvstore.core.policies import LRUPolicy
from kvstore.core.store import Store, StoreLimits, StoreTier
from kvstore.errors import InvalidArgument, NotFound, ResourceExhausted
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout
from kvstore.tiers.host import HostTier
from tests.fakes import ManualClock

LAYOUT = KVLayout(model="unit", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)
BLOCK = LAYOUT.bytes_per_block  # 2 * 1 * 4 * 1 * 64 * 2 = 1024


def make_store(blocks_capacity: int = 8, clock: ManualClock | None = None, **limits: int) -> Store:
    tier = HostTier(blocks_capacity * BLOCK)
    return Store([StoreTier(tier, LRUPolicy())], limits=StoreLimits(**limits), clock=clock or ManualClock(1000.0))


def chain(n: int, start: int = 0) -> list[bytes]:
    return block_hashes(LAYOUT.namespace_id, list(range(start, start + n * 4)), 4)


async def put(store: Store, hashes: list[bytes], payloads: list[bytes] | None = None, parent: bytes | None = None):
    payloads = payloads or [os.urandom(BLOCK) for _ in hashes]
    ns = store.register(LAYOUT)
    async with store.begin_put(ns, hashes, parent) as txn:
        for i, p in enumerate(payloads):
            await txn.write(i, p[:300])
            await txn.write(i, p[300:])
        result = await txn.commit()
    return result, payloads


async def fetch_all(store: Store, hashes: list[bytes], lease_id: str = "") -> list[bytes]:
    async with store.open_fetch(LAYOUT.namespace_id, hashes, lease_id) as stream:
        return [b async for b in stream]


async def test_put_then_lookup_and_fetch_roundtrip():
    store = make_store()
    hashes = chain(3)
    result, payloads = await put(store, hashes)
    assert (result.stored, result.existing) == (3, 0)
    hit = store.lookup(LAYOUT.namespace_id, hashes)
    assert (hit.num_blocks, hit.num_tokens, hit.tiers) == (3, 12, ["host"] * 3)
    assert await fetch_all(store, hashes) == payloads


async def test_lookup_is_longest_prefix():
    store = make_store()
    hashes = chain(5)
    await put(store, hashes[:2])
    await put(store, hashes[3:], parent=hashes[2])  # block 2 missing: a gap
    assert store.lookup(LAYOUT.namespace_id, hashes).num_blocks == 2
    assert len(await fetch_all(store, hashes)) == 2


async def test_pending_blocks_are_invisible_until_commit():
    store = make_store()
    hashes = chain(2)
    ns = store.register(LAYOUT)
    async with store.begin_put(ns, hashes) as txn:
        await txn.write(0, os.urandom(BLOCK))
        await txn.write(1, os.urandom(BLOCK))
        # All bytes landed but not committed: still PENDING, not counted.
        assert store.lookup(ns, hashes).num_blocks == 0
        await txn.commit()
    assert store.lookup(ns, hashes).num_blocks == 2


async def test_failed_put_leaves_nothing_and_frees_capacity():
    store = make_store()
    hashes = chain(3)
    ns = store.register(LAYOUT)
    with pytest.raises(InvalidArgument, match="block 1 got 10 of its 1024 bytes"):
        async with store.begin_put(ns, hashes) as txn:
            await txn.write(0, os.urandom(BLOCK))
            await txn.write(1, b"x" * 10)
            await txn.write(2, os.urandom(BLOCK))
    assert store.lookup(ns, hashes).num_blocks == 0
    assert store.tiers[0].tier.used_bytes == 0
    assert store.counters.put_failures == 1


async def test_oversized_block_is_rejected_at_once():
    store = make_store()
    ns = store.register(LAYOUT)
    with pytest.raises(InvalidArgument, match="1025 bytes"):
        async with store.begin_put(ns, chain(1)) as txn:
            await txn.write(0, os.urandom(BLOCK + 1))
    assert store.tiers[0].tier.used_bytes == 0


async def test_cancelled_put_leaves_nothing():
    store = make_store()
    hashes = chain(2)
    ns = store.register(LAYOUT)
    started = asyncio.Event()

    async def slow_put() -> None:
        async with store.begin_put(ns, hashes) as txn:
            await txn.write(0, os.urandom(BLOCK))
            started.set()
            await asyncio.sleep(3600)  # the client stalls mid-stream

    task = asyncio.create_task(slow_put())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.lookup(ns, hashes).num_blocks == 0
    assert store.tiers[0].tier.used_bytes == 0


async def test_reput_is_idempotent_without_double_accounting():
    store = make_store()
    hashes = chain(3)
    _, payloads = await put(store, hashes)
    used = store.tiers[0].tier.used_bytes
    result, _ = await put(store, hashes, [os.urandom(BLOCK) for _ in hashes])
    assert (result.stored, result.existing) == (0, 3)
    assert store.tiers[0].tier.used_bytes == used == 3 * BLOCK
    assert store.tiers[0].tier.blocks == 3
    assert await fetch_all(store, hashes) == payloads  # the first bytes are kept


async def test_concurrent_puts_of_the_same_blocks_publish_once():
    store = make_store()
    hashes = chain(2)
    payloads = [os.urandom(BLOCK) for _ in hashes]
    results = await asyncio.gather(put(store, hashes, payloads), put(store, hashes, payloads))
    assert sorted(r.stored for r, _ in results) == [0, 2]
    assert store.tiers[0].tier.used_bytes == 2 * BLOCK


async def test_lru_eviction_keeps_capacity_exact():
    store = make_store(blocks_capacity=4)
    first = chain(2, start=0)
    second = chain(2, start=1000)
    third = chain(2, start=2000)
    await put(store, first)
    await put(store, second)
    store.lookup(LAYOUT.namespace_id, first)  # touch: `second` is now least recent
    await put(store, third)
    assert store.lookup(LAYOUT.namespace_id, first).num_blocks == 2
    assert store.lookup(LAYOUT.namespace_id, second).num_blocks == 0
    assert store.lookup(LAYOUT.namespace_id, third).num_blocks == 2
    tier = store.tiers[0].tier
    assert tier.used_bytes == 4 * BLOCK <= tier.capacity_bytes
    assert store.counters.evictions == 2


async def test_leased_blocks_are_not_evicted_and_leases_expire():
    clock = ManualClock(1000.0)
    store = make_store(blocks_capacity=2, clock=clock)
    held = chain(2)
    await put(store, held)
    hit = store.lookup(LAYOUT.namespace_id, held, lease_ms=5000)
    assert hit.lease_id
    with pytest.raises(ResourceExhausted, match="pinned"):
        await put(store, chain(1, start=500))
    assert store.lookup(LAYOUT.namespace_id, held).num_blocks == 2
    clock.now += 5.001  # the lease runs out by itself
    await put(store, chain(1, start=500))
    assert store.stats().leases_active == 0
    assert store.lookup(LAYOUT.namespace_id, held).num_blocks == 1  # the chain's tail made room


async def test_fetch_with_lease_releases_it():
    store = make_store()
    hashes = chain(2)
    _, payloads = await put(store, hashes)
    hit = store.lookup(LAYOUT.namespace_id, hashes, lease_ms=60_000)
    assert store.stats().leases_active == 1
    assert await fetch_all(store, hashes, hit.lease_id) == payloads
    assert store.stats().leases_active == 0


async def test_pin_and_unpin():
    clock = ManualClock(1000.0)
    store = make_store(blocks_capacity=2, clock=clock, max_lease_ms=10_000)
    hashes = chain(2)
    await put(store, hashes)
    pin = store.pin(LAYOUT.namespace_id, hashes, ttl_ms=60_000)
    assert pin.pinned == 2 and pin.expires_in_ms == 10_000  # bounded by max_lease_ms
    with pytest.raises(ResourceExhausted):
        await put(store, chain(1, start=500))
    assert store.unpin(pin.lease_id) is True
    assert store.unpin(pin.lease_id) is False
    await put(store, chain(1, start=500))


async def test_lease_table_is_bounded():
    store = make_store(max_leases=2)
    hashes = chain(1)
    await put(store, hashes)
    store.lookup(LAYOUT.namespace_id, hashes, lease_ms=1000)
    store.lookup(LAYOUT.namespace_id, hashes, lease_ms=1000)
    with pytest.raises(ResourceExhausted, match="leases"):
        store.lookup(LAYOUT.namespace_id, hashes, lease_ms=1000)


async def test_delete_wins_over_a_lease():
    store = make_store()
    hashes = chain(2)
    await put(store, hashes)
    hit = store.lookup(LAYOUT.namespace_id, hashes, lease_ms=60_000)
    assert store.delete(LAYOUT.namespace_id, hashes) == 2
    assert store.lookup(LAYOUT.namespace_id, hashes).num_blocks == 0
    assert store.tiers[0].tier.used_bytes == 0
    assert store.unpin(hit.lease_id) is True  # releasing a lease over deleted blocks is harmless


async def test_a_put_larger_than_the_tier_is_refused_up_front():
    store = make_store(blocks_capacity=2)
    with pytest.raises(ResourceExhausted, match="needs"):
        await put(store, chain(3))
    assert store.tiers[0].tier.used_bytes == 0


async def test_corrupted_block_is_never_served_and_is_counted():
    store = make_store()
    hashes = chain(3)
    _, payloads = await put(store, hashes)
    # Flip one byte of block 1 in place, behind the store's back (a bit flip in RAM).
    info = store.block(LAYOUT.namespace_id, hashes[1])
    assert info is not None and info.tier == "host"
    store.tiers[0].tier.view(info.slot, BLOCK)[7] ^= 0xFF
    got = await fetch_all(store, hashes)
    assert got == payloads[:1]
    assert store.counters.checksum_failures == 1
    assert store.lookup(LAYOUT.namespace_id, hashes).num_blocks == 1  # the bad block was dropped


async def test_unknown_namespace_and_bad_hashes():
    store = make_store()
    with pytest.raises(NotFound, match="not known"):
        store.lookup(b"\x01" * 16, chain(1))
    ns = store.register(LAYOUT)
    with pytest.raises(InvalidArgument, match="16 bytes"):
        store.lookup(ns, [b"short"])
    small = make_store(max_blocks_per_call=2)
    small.register(LAYOUT)
    with pytest.raises(InvalidArgument, match="limit"):
        small.lookup(ns, chain(3))


async def test_blocks_held_by_a_put_are_not_evicted_to_make_room_for_it():
    store = make_store(blocks_capacity=2)
    hashes = chain(2)
    await put(store, hashes[:1])
    # Re-put block 0 together with block 1, in a full tier with block 0 the only victim.
    await put(store, chain(1, start=900))  # fills the tier
    result, _ = await put(store, hashes)
    assert (result.stored, result.existing) == (1, 1)
    assert store.lookup(LAYOUT.namespace_id, hashes).num_blocks == 2


def touch_recording_store() -> tuple[Store, list[list[int]]]:
    """A store of four blocks whose policy records the rows of each touch, in order."""
    touched: list[list[int]] = []

    class Recording(LRUPolicy):
        def touch_rows(self, rows):
            touched.append(rows.tolist())
            super().touch_rows(rows)

    return Store([StoreTier(HostTier(4 * BLOCK), Recording())], clock=ManualClock(1000.0)), touched


async def test_a_lookups_touch_waits_for_the_reply_but_never_for_the_policys_next_use():
    """Lookup hits reach the policy after the call returns (a loop callback), yet before
    anything else uses the policy: the eviction that follows still sees them."""
    store, touched = touch_recording_store()
    a, b = chain(2, 0), chain(2, 100)
    await put(store, a)
    await put(store, b)
    rows_a = [store.index.get(store.namespace(LAYOUT.namespace_id).namespace_id + h).row for h in a]
    assert store.lookup(LAYOUT.namespace_id, a).num_blocks == 2
    assert touched == []  # not yet: the caller answers first
    await asyncio.sleep(0)
    assert touched == [rows_a[::-1]]  # then the loop applies it (tail first)
    # Touched again, and before the loop runs, a put needs room: the policy is brought up
    # to date first, so the least recently used blocks (b's) are the ones evicted.
    assert store.lookup(LAYOUT.namespace_id, a).num_blocks == 2
    await put(store, chain(2, 200))
    assert len(touched) == 2
    assert store.lookup(LAYOUT.namespace_id, a).num_blocks == 2
    assert store.lookup(LAYOUT.namespace_id, b).num_blocks == 0


async def test_a_puts_insert_reaches_the_policy_after_the_reply_and_in_call_order():
    """New blocks enter the policy after the commit returns, queued with lookups' touches
    in the order of the calls; anything that uses the policy first applies the queue, so
    an eviction before the loop runs still sees every put and touch."""
    calls: list[tuple[str, list[int]]] = []

    class Recording(LRUPolicy):
        def insert_rows(self, rows):
            calls.append(("insert", rows.tolist()))
            super().insert_rows(rows)

        def touch_rows(self, rows):
            calls.append(("touch", rows.tolist()))
            super().touch_rows(rows)

    store = Store([StoreTier(HostTier(4 * BLOCK), Recording())], clock=ManualClock(1000.0))
    a, b, c = chain(2, 0), chain(2, 100), chain(2, 200)
    await put(store, a)
    assert calls == []  # not yet: the caller answers first
    await asyncio.sleep(0)
    ns = store.namespace(LAYOUT.namespace_id).namespace_id
    rows = {h: store.index.get(ns + h).row for h in a}
    assert calls == [("insert", [rows[a[1]], rows[a[0]]])]  # tail first
    await put(store, b)
    assert store.lookup(LAYOUT.namespace_id, a).num_blocks == 2  # a touched after b's insert
    rows.update({h: store.index.get(ns + h).row for h in b})
    # Before the loop runs, c needs room: the queue is applied first, in call order, so b
    # (least recently used) is evicted, not a.
    await put(store, c)
    assert calls[1:3] == [("insert", [rows[b[1]], rows[b[0]]]), ("touch", [rows[a[1]], rows[a[0]]])]
    assert store.lookup(LAYOUT.namespace_id, a).num_blocks == 2
    assert store.lookup(LAYOUT.namespace_id, b).num_blocks == 0


async def test_a_held_deferral_applies_the_touch_on_release_without_a_loop_turn():
    """A server that answers a call and then applies its touches itself (the control lane)
    holds the store's deferral around the call: nothing is scheduled on the loop, and
    `release` applies the touches, in call order, at once."""
    store, touched = touch_recording_store()
    a, b = chain(2, 0), chain(2, 100)
    await put(store, a)
    await put(store, b)
    await asyncio.sleep(0)  # the puts' inserts
    ns = store.namespace(LAYOUT.namespace_id).namespace_id
    rows = {h: store.index.get(ns + h).row for h in a + b}
    loop = asyncio.get_running_loop()
    ready = len(loop._ready)  # type: ignore[attr-defined]
    store.deferral.hold()
    assert store.lookup(LAYOUT.namespace_id, a).num_blocks == 2
    assert store.lookup(LAYOUT.namespace_id, b).num_blocks == 2
    assert touched == [] and len(loop._ready) == ready  # type: ignore[attr-defined]
    store.deferral.release()
    assert touched == [[rows[a[1]], rows[a[0]]], [rows[b[1]], rows[b[0]]]]
    assert not store.deferral.held and store.tiers[0]._deferred == []
    # Released, the next lookup's touch goes back to a loop callback.
    assert store.lookup(LAYOUT.namespace_id, a).num_blocks == 2
    assert len(touched) == 2
    await asyncio.sleep(0)
    assert len(touched) == 3


def test_without_an_event_loop_a_lookup_touches_at_once() -> None:
    store = make_store()
    asyncio.run(put(store, chain(2)))
    st = store.tiers[0]
    assert store.lookup(LAYOUT.namespace_id, chain(2)).num_blocks == 2
    assert st._deferred == []


class _Events:
    def __init__(self) -> None:
        self.removed: list[tuple[bytes, bytes, str]] = []

    def blocks_stored(self, namespace_id, block_hashes, tier):
        pass

    def blocks_removed(self, namespace_id, block_hashes, tier):
        self.removed += [(namespace_id, h, tier) for h in block_hashes]

    def blocks_moved(self, namespace_id, block_hashes, from_tier, to_tier):
        pass


@pytest.mark.parametrize("policy", ["lru", "arc", "hint-arc", "s3fifo"])
async def test_a_batch_eviction_drops_what_single_evictions_would(policy):
    """Room for several blocks made in one batch (`reserve_slots`) against the same room
    made one eviction at a time, on two stores given the same puts and lookups: the same
    victims in the same order, the same counters, tenant usage, namespace totals and
    events, and every block left fetches exactly."""
    from kvstore.core.policies import make_policy

    stores, events = [], []
    for _ in range(2):
        tier = HostTier(12 * BLOCK)
        store = Store([StoreTier(tier, make_policy(policy))], clock=ManualClock(1000.0))
        store.observer = _Events()
        stores.append(store)
        events.append(store.observer)
    chains = [chain(3, start=100 * i) for i in range(4)]
    payloads = {}
    for store in stores:
        for c in chains:
            _, data = await put(store, c, [os.urandom(BLOCK) for _ in c])
            payloads.setdefault(store, []).append(data)
        store.lookup(LAYOUT.namespace_id, chains[1])  # a touch: chain 1 is not the oldest any more
        store.lookup(LAYOUT.namespace_id, chains[0][:1])
    batch, single = stores
    st_b, st_s = batch.tiers[0], single.tiers[0]
    slots = await batch.reserve_slots("host", BLOCK, 5)
    assert len(slots) == 5 and st_b.counters.evictions == 5
    for _ in range(5):
        await single.moves.evict_one(st_s, BLOCK)
    assert events[0].removed == events[1].removed and len(events[0].removed) == 5
    assert (st_b.counters.evictions, st_b.counters.drops) == (st_s.counters.evictions, st_s.counters.drops) == (5, 5)
    assert batch.counters.evictions == single.counters.evictions == 5
    info_b, info_s = batch.namespace(LAYOUT.namespace_id), single.namespace(LAYOUT.namespace_id)
    assert batch.tenancy.usage(info_b.tenant) == single.tenancy.usage(info_s.tenant) == {"host": 7 * BLOCK}
    assert (info_b.blocks, info_b.bytes) == (info_s.blocks, info_s.bytes) == (7, 7 * BLOCK)
    assert st_b.tier.used_bytes == 12 * BLOCK and st_s.tier.used_bytes == 7 * BLOCK
    for c, data_b, _data_s in zip(chains, payloads[batch], payloads[single]):
        held = batch.lookup(LAYOUT.namespace_id, c).num_blocks
        assert held == single.lookup(LAYOUT.namespace_id, c).num_blocks
        assert await fetch_all(batch, c[:held]) == data_b[:held]
    batch.free_slots(slots)
    assert st_b.tier.used_bytes == 7 * BLOCK
