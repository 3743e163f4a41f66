"""Tenant accounting and quotas in the store, where concurrency can be arranged exactly:
puts held between reserve and commit."""

from __future__ import annotations

import pytest

from kvstore.core.policies import LRUPolicy
from kvstore.core.store import Store, StoreTier
from kvstore.errors import ResourceExhausted
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout
from kvstore.tiers.copiers import make_copier
from kvstore.tiers.host import HostTier

LAYOUT = KVLayout(model="unit", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)
BLOCK = LAYOUT.bytes_per_block  # 1024


def make_store() -> Store:
    store = Store([StoreTier(HostTier(32 * BLOCK), LRUPolicy())])
    store.tenancy.quotas = {"t": {"host": 4 * BLOCK}}
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
    assert store.tenancy.usage("t") == {"host": 4 * BLOCK}
    # Now a put makes room by evicting the tenant's own oldest block.
    fourth = store.begin_put(ns, chain(1, 300))
    await fourth.reserve()
    fourth.mark_written()
    await fourth.commit([0])
    assert store.tenancy.usage("t") == {"host": 4 * BLOCK}
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
    assert store.tenancy.usage("t") == {"host": 4 * BLOCK}


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
    assert store.tenancy.usage("u") == {"host": 8 * BLOCK}
    assert store.tenancy.usage("default") == {"host": 8 * BLOCK}
    store.purge()
    assert store.tenancy.usage("u") == {} and store.tenancy.usage("default") == {}


async def test_usage_matches_the_index_through_random_moves(tmp_path):
    """Puts, deletes, prefetches, fetches with promotion, migration, evictions and SSD
    write-through for two tenants (one with quotas), some of them concurrent: after every
    step each tenant's usage equals what the index holds for it, tier by tier."""
    import asyncio
    import random

    from kvstore.core.policies import make_policy
    from kvstore.core.store import MigrationConfig
    from kvstore.tiers.memory import MemoryTier
    from kvstore.tiers.ssd import SsdTier

    tiers = [
        StoreTier(MemoryTier(6 * BLOCK, name="hbm"), make_policy("lru"), 0.9, 0.5),
        StoreTier(MemoryTier(10 * BLOCK, name="host"), make_policy("lru"), 0.9, 0.5),
        StoreTier(SsdTier(str(tmp_path / "ssd"), 1 << 20, region_size=64 << 10, io_threads=2), make_policy("lru")),
    ]
    store = Store(tiers, migration=MigrationConfig(tick_s=3600), make_copier=make_copier)
    store.tenancy.quotas = {"q": {"hbm": 3 * BLOCK, "host": 5 * BLOCK, "ssd": 8 * BLOCK}}
    await store.start()
    rng = random.Random(7)
    namespaces = {"q": store.register(LAYOUT, "q", b"q"), "free": store.register(LAYOUT, "free", b"free")}
    chains: dict[str, list[list[bytes]]] = {"q": [], "free": []}

    def expected(tenant: str) -> dict[str, int]:
        ns = namespaces[tenant]
        out: dict[str, int] = {}
        for ref in store.namespace_blocks(ns):
            info = store.block(ns, ref.block_hash)
            assert info is not None
            for tier in info.tiers:
                out[tier] = out.get(tier, 0) + BLOCK
        return out

    async def put(tenant: str) -> None:
        hs = chain(rng.randint(1, 2), rng.randrange(10_000) * 8)
        txn = store.begin_put(namespaces[tenant], hs)
        try:
            await txn.reserve()
        except ResourceExhausted:
            return  # everything of the tenant held: refused, nothing changed
        for i in range(len(hs)):
            await txn.write(i, bytes([i]) * BLOCK)
        await txn.commit()
        chains[tenant].append(hs)

    async def step() -> None:
        tenant = rng.choice(["q", "free"])
        op = rng.random()
        known = chains[tenant]
        if op < 0.45 or not known:
            await put(tenant)
        elif op < 0.6:
            store.delete(namespaces[tenant], known.pop(rng.randrange(len(known))))
        elif op < 0.75:
            await store.prefetch(namespaces[tenant], rng.choice(known), rng.choice(["hbm", "host", ""]))
        elif op < 0.85:
            async with store.open_fetch(namespaces[tenant], rng.choice(known)) as stream:
                [b async for b in stream]
        elif op < 0.95:
            for st in store.tiers[:2]:
                await store.migrate_once(st)
        else:
            await store.evict_bytes(rng.choice(["hbm", "host", "ssd"]), 2 * BLOCK)

    try:
        for _ in range(60):
            await asyncio.gather(*(step() for _ in range(3)))
            await store.flush()
            for tenant in ("q", "free"):
                assert store.tenancy.usage(tenant) == expected(tenant)
            quota = store.tenancy.quotas["q"]
            usage = store.tenancy.usage("q")
            assert all(usage.get(tier, 0) <= limit for tier, limit in quota.items()), usage
        store.purge()
        assert store.tenancy.usage("q") == {} and store.tenancy.usage("free") == {}
    finally:
        await store.aclose()


async def test_a_block_deleted_while_it_is_demoted_is_not_subtracted_twice(tmp_path):
    import asyncio

    from kvstore.core.policies import make_policy
    from kvstore.core.store import MigrationConfig, WritePolicy
    from kvstore.tiers.memory import MemoryTier
    from kvstore.tiers.ssd import SsdTier

    host = StoreTier(MemoryTier(4 * BLOCK, name="host"), make_policy("lru"), 0.5, 0.25)
    ssd = StoreTier(SsdTier(str(tmp_path / "ssd"), 1 << 20, region_size=64 << 10, io_threads=1), make_policy("lru"))
    store = Store([host, ssd], migration=MigrationConfig(write_policy=WritePolicy.BACK, tick_s=3600))
    await store.start()
    try:
        ns = store.register(LAYOUT, "t", b"t")
        hs = chain(3, 0)
        txn = store.begin_put(ns, hs)
        await txn.reserve()
        for i in range(3):
            await txn.write(i, bytes([i]) * BLOCK)
        await txn.commit()
        assert store.tenancy.usage("t") == {"host": 3 * BLOCK}
        # Over the high watermark: the migrator demotes the LRU victim to SSD; the block is
        # deleted while its SSD write is in flight (the demotion holds it as a reader).
        task = asyncio.create_task(store.migrate_once(host))
        await asyncio.sleep(0)  # the demotion runs up to its first wait (the SSD write)
        assert not task.done()
        assert store.delete(ns, hs) == 3
        assert store.tenancy.usage("t") == {}
        await task
        await store.flush()
        assert all(store.block(ns, h) is None for h in hs)
        assert store.tenancy.usage("t") == {}
    finally:
        await store.aclose()


def test_ledger_counts_held_bytes_against_quotas_only():
    from kvstore.core.tenancy import TenantLedger

    ledger = TenantLedger()
    ledger.quotas = {"t": {"host": 100}}
    ledger.add("t", "host", 60)
    assert ledger.exceeded("t", "host", 40) == ""
    ledger.hold("t", "host", 30)
    assert ledger.usage("t") == {"host": 60}  # held bytes are not usage
    assert ledger.exceeded("t", "host", 40) == (
        "tenant 't' is at its host quota: 60 of 100 bytes used and 30 on their way in, 40 more needed")
    ledger.release("t", "host", 30)
    assert ledger.incoming("t", "host") == 0 and ledger.exceeded("t", "host", 40) == ""
    assert ledger.exceeded("t", "ssd", 10**9) == "" and ledger.exceeded("u", "host", 10**9) == ""  # no quota
    ledger.add("t", "host", -60)
    assert ledger.usage("t") == {} and ledger.tenants() == {"t"}  # still listed: it has a quota
