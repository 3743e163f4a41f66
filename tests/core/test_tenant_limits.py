"""Per-tenant lease caps in the store, on a hand-moved clock: a tenant over
`max_leases_per_tenant` is refused without touching anything, others keep leasing, and
counts go back to zero as leases end or expire."""

from __future__ import annotations

import pytest

from kvstore.core.policies import LRUPolicy
from kvstore.core.store import Store, StoreLimits, StoreTier
from kvstore.errors import ResourceExhausted
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout
from kvstore.tiers.host import HostTier
from tests.fakes import ManualClock

LAYOUT = KVLayout(model="unit", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)
BLOCK = LAYOUT.bytes_per_block


def chain(n: int, start: int = 0) -> list[bytes]:
    return block_hashes(LAYOUT.namespace_id, list(range(start, start + n * 4)), 4)


async def stored(store: Store, tenant: str, hashes: list[bytes]) -> bytes:
    ns = store.register(LAYOUT, tenant, tenant.encode())
    async with store.begin_put(ns, hashes) as txn:
        for i in range(len(hashes)):
            await txn.write(i, bytes([i + 1]) * BLOCK)
        await txn.commit()
    return ns


def pins(store: Store, ns: bytes, hashes: list[bytes]) -> list[int]:
    return [info.pins for h in hashes if (info := store.block(ns, h)) is not None]


async def test_a_tenant_over_its_lease_cap_is_refused_and_nothing_changes():
    clock = ManualClock(1000.0)
    store = Store([StoreTier(HostTier(16 * BLOCK), LRUPolicy())],
                  limits=StoreLimits(max_leases=100, max_leases_per_tenant=2), clock=clock)
    hashes = chain(2)
    a = await stored(store, "a", hashes)
    b = await stored(store, "b", hashes)
    first = store.pin(a, hashes, ttl_ms=10_000)
    store.lookup(a, hashes, lease_ms=5_000)
    assert store.tenant_leases("a") == 2 and pins(store, a, hashes) == [2, 2]
    lookups = store.counters.lookups
    # Every way of taking a lease is refused past the cap: pin, leased lookup, fetch lease.
    with pytest.raises(ResourceExhausted, match=r"tenant 'a' has 2 leases active, the most max_leases_per_tenant \(2\)"):
        store.pin(a, hashes, ttl_ms=10_000)
    with pytest.raises(ResourceExhausted, match="tenant 'a' has 2 leases"):
        store.lookup(a, hashes, lease_ms=5_000)
    with pytest.raises(ResourceExhausted, match="tenant 'a' has 2 leases"):
        store.lease_prefix(a, hashes, 5_000, "host")
    assert store.tenant_leases("a") == 2 and pins(store, a, hashes) == [2, 2]
    assert store.stats().leases_active == 2 and store.counters.lookups == lookups
    # Another tenant is not affected, and a lookup without a lease still answers.
    assert store.pin(b, hashes, ttl_ms=10_000).pinned == 2
    assert store.lease_prefix(b, hashes, 5_000, "host")[0].lease_id
    assert store.tenant_leases("b") == 2
    assert store.lookup(a, hashes).num_blocks == 2
    # Ending a lease gives room back; expiry brings the count to zero.
    assert store.unpin(first.lease_id)
    assert store.tenant_leases("a") == 1
    assert store.lookup(a, hashes, lease_ms=5_000).lease_id
    assert store.tenant_leases("a") == 2
    clock.now += 11.0
    assert store.tenant_leases("a") == 0 and store.tenant_leases("b") == 0
    assert store.stats().leases_active == 0 and pins(store, a, hashes) == [0, 0]
    assert store.pin(a, hashes, ttl_ms=10_000).pinned == 2


async def test_the_daemon_wide_cap_still_applies_under_the_tenant_cap():
    store = Store([StoreTier(HostTier(16 * BLOCK), LRUPolicy())],
                  limits=StoreLimits(max_leases=3, max_leases_per_tenant=2), clock=ManualClock(1000.0))
    hashes = chain(1)
    a = await stored(store, "a", hashes)
    b = await stored(store, "b", hashes)
    store.pin(a, hashes)
    store.pin(a, hashes)
    store.pin(b, hashes)
    with pytest.raises(ResourceExhausted, match="3 leases are active"):
        store.pin(b, hashes)
    assert store.tenant_leases("b") == 1


async def test_without_a_tenant_cap_only_max_leases_counts():
    store = Store([StoreTier(HostTier(16 * BLOCK), LRUPolicy())],
                  limits=StoreLimits(max_leases=5), clock=ManualClock(1000.0))
    hashes = chain(1)
    a = await stored(store, "a", hashes)
    for _ in range(5):
        store.pin(a, hashes)
    assert store.tenant_leases("a") == 5
