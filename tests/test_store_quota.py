"""Tenant accounting and quotas in the store, where concurrency can be arranged exactly:
puts held between reserve and commit."""

from __future__ import annotations

import pytest

from kvstore.errors import ResourceExhausted
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout
from kvstore.policies import LRUPolicy
from kvstore.store import Store, StoreTier
from kvstore.tiers.host import HostTier

LAYOUT = KVLayout(model="unit", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)
BLOCK = LAYOUT.bytes_per_block  # 1024


def make_store() -> Store:
    store = Store([StoreTier(HostTier(32 * BLOCK), LRUPolicy())])
    store.tenant_quotas = {"t": {"host": 4 * BLOCK}}
    return store


def chain(n: int, start: int) -> list[bytes]:
    return block_hashes(LAYOUT.namespace_id, list(range(start, start + n * 4)), 4)


async def test_concurrent_puts_cannot_overshoot_the_quota():
    store = make_store()
    ns = store.register(LAYOUT, "t", b"t")
    first = store.begin_put(ns, chain(2, 0))
    second = store.begin_put(ns, chain(2, 100))
    third = store.begin_put(ns, chain(1, 200))
    await first.reserve()
    await second.reserve()
    # Two puts in flight hold the whole quota; nothing of the tenant is evictable yet.
    with pytest.raises(ResourceExhausted, match="4096 on their way in"):
        await third.reserve()
    for txn in (first, second):
        txn.mark_written()
        await txn.commit([0, 0])
    assert store.tenant_usage("t") == {"host": 4 * BLOCK}
    # Now a put makes room by evicting the tenant's own oldest block.
    fourth = store.begin_put(ns, chain(1, 300))
    await fourth.reserve()
    fourth.mark_written()
    await fourth.commit([0])
    assert store.tenant_usage("t") == {"host": 4 * BLOCK}
    # One block of the earlier puts went (the policy's victim); the new one is held.
    held = sum(store.block(ns, h) is not None for h in chain(2, 0) + chain(2, 100))
    assert held == 3 and store.lookup(ns, chain(1, 300)).num_blocks == 1


async def test_an_aborted_put_gives_its_quota_back():
    store = make_store()
    ns = store.register(LAYOUT, "t", b"t")
    txn = store.begin_put(ns, chain(4, 0))
    await txn.reserve()
    txn.abort()
    again = store.begin_put(ns, chain(4, 0))
    await again.reserve()
    again.mark_written()
    await again.commit([0] * 4)
    assert store.tenant_usage("t") == {"host": 4 * BLOCK}


async def test_other_tenants_and_the_default_tenant_are_not_limited():
    store = make_store()
    other = store.register(LAYOUT, "u", b"u")
    default = store.register(LAYOUT)
    assert default == LAYOUT.namespace_id and other != default
    for ns in (other, default):
        txn = store.begin_put(ns, chain(8, 0))
        await txn.reserve()
        txn.mark_written()
        await txn.commit([0] * 8)
    assert store.tenant_usage("u") == {"host": 8 * BLOCK}
    assert store.tenant_usage("default") == {"host": 8 * BLOCK}
    store.purge()
    assert store.tenant_usage("u") == {} and store.tenant_usage("default") == {}
