"""Multi-tier store scenarios with real tiers (memory tiers in place of HBM, a real SSD log).

Each test builds a small store: `top` (memory) -> `host` (memory) -> `ssd` (region log),
puts blocks through the public verbs and checks where they are and that they fetch
byte-exact.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvstore.core.policies import make_policy
from kvstore.core.store import MigrationConfig, MigrationStatus, Store, StoreTier, WritePolicy
from kvstore.core.tier import Slot
from kvstore.hashing import HASH_BYTES
from kvstore.layout import KVLayout
from kvstore.tiers.copiers import make_copier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.ssd import SsdTier

LAYOUT = KVLayout(model="test/tiers", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=32,
                  block_size_tokens=4)  # 2 * 2 * 4 * 2 * 32 * 2 = 2048 bytes per block
BLOCK = LAYOUT.bytes_per_block


def build(tmp_path: Path, *, top_blocks: int = 4, host_blocks: int = 8, ssd: bool = True,
          policy: WritePolicy = WritePolicy.THROUGH, promote: bool = True, high: float = 0.9) -> Store:
    tiers = [
        StoreTier(MemoryTier(top_blocks * BLOCK, name="hbm"), make_policy("lru"), high, 0.5),
        StoreTier(MemoryTier(host_blocks * BLOCK, name="host"), make_policy("lru"), high, 0.5),
    ]
    if ssd:
        tiers.append(StoreTier(SsdTier(str(tmp_path / "ssd"), 1 << 20, region_size=64 << 10, io_threads=2),
                               make_policy("lru")))
    return Store(tiers, migration=MigrationConfig(write_policy=policy, promote_on_hit=promote, tick_s=3600),
                 make_copier=make_copier)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = build(tmp_path)
    await s.start()
    try:
        yield s
    finally:
        await s.aclose()


def hashes(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 100_000 + i).to_bytes(HASH_BYTES, "big") for i in range(n)]


async def put(store: Store, hs: list[bytes], blocks: list[bytes]) -> None:
    ns = store.register(LAYOUT)
    async with store.begin_put(ns, hs) as txn:
        for i, b in enumerate(blocks):
            await txn.write(i, b)
        await txn.commit()


async def fetch(store: Store, hs: list[bytes]) -> list[bytes]:
    ns = store.register(LAYOUT)
    async with store.open_fetch(ns, hs) as stream:
        return [b async for b in stream]


def where(store: Store, hs: list[bytes]) -> list[str]:
    return store.lookup(store.register(LAYOUT), hs).tiers


def tier_stats(store: Store, name: str):  # type: ignore[no-untyped-def]
    return next(t for t in store.stats().tiers if t.name == name)


async def test_puts_overflow_down_the_hierarchy_and_all_fetch_byte_exact(store: Store) -> None:
    # store 20 blocks into 4 + 8 memory slots -> the oldest end on SSD only
    hs = hashes(20)
    blocks = [os.urandom(BLOCK) for _ in hs]
    for i in range(0, 20, 2):
        await put(store, hs[i : i + 2], blocks[i : i + 2])
    assert await store.flush(10)
    assert len(where(store, hs)) == 20
    assert await fetch(store, hs) == blocks
    for name in ("hbm", "host"):
        t = tier_stats(store, name)
        assert t.used_bytes <= t.capacity_bytes
    assert tier_stats(store, "ssd").blocks == 20  # write-through: every block reached SSD


async def test_without_a_copier_choice_moves_between_memory_tiers_bounce_exactly() -> None:
    """A store given no copier choice moves blocks between memory tiers by `read` and
    `write` (the contract's `BounceCopier`): demoted and raised again, bytes stay exact."""
    tiers = [StoreTier(MemoryTier(4 * BLOCK, name="hbm"), make_policy("lru"), 0.5, 0.25),
             StoreTier(MemoryTier(8 * BLOCK, name="host"), make_policy("lru"), 0.9, 0.5)]
    store = Store(tiers, migration=MigrationConfig(tick_s=3600))
    try:
        hs = hashes(4)
        blocks = [os.urandom(BLOCK) for _ in hs]
        await put(store, hs, blocks)
        assert await store.migrate_once(tiers[0]) is MigrationStatus.OK
        assert where(store, hs).count("host") == 3
        assert (await store.prefetch(store.register(LAYOUT), hs, "hbm")).raised == 3
        assert where(store, hs) == ["hbm"] * 4
        assert await fetch(store, hs) == blocks
    finally:
        await store.aclose()


async def test_lower_tier_hit_is_served_and_promoted(store: Store) -> None:
    hs = hashes(16)
    blocks = [os.urandom(BLOCK) for _ in hs]
    for i in range(0, 16, 4):
        await put(store, hs[i : i + 4], blocks[i : i + 4])
    await store.flush(10)
    # Some blocks were pushed out of memory by the later ones.
    cold = where(store, hs).index("ssd")
    # Make headroom in the top tier so the hit can be promoted.
    await store.migrate_once(store.tiers[0])
    assert await fetch(store, [hs[cold]]) == [blocks[cold]]
    assert where(store, [hs[cold]]) == ["hbm"]
    assert tier_stats(store, "hbm").counters.promotions >= 1
    assert tier_stats(store, "ssd").blocks == 16  # promotion copies: the SSD copy stays


async def test_prefetch_raises_named_blocks_to_the_target_tier(store: Store) -> None:
    hs = hashes(16)
    blocks = [os.urandom(BLOCK) for _ in hs]
    for i in range(0, 16, 4):
        await put(store, hs[i : i + 4], blocks[i : i + 4])
    await store.flush(10)
    cold_idx = [i for i, t in enumerate(where(store, hs)) if t == "ssd"][:2]
    cold = [hs[i] for i in cold_idx]
    assert len(cold) == 2
    result = await store.prefetch(store.register(LAYOUT), cold + hashes(1, salt=9), "host")
    assert (result.tier, result.raised, result.missing) == ("host", 2, 1)
    assert where(store, cold) == ["host", "host"]
    assert await fetch(store, cold) == [blocks[i] for i in cold_idx]


async def test_migrator_demotes_from_high_to_low_watermark(store: Store) -> None:
    top = store.tiers[0]
    hs = hashes(4)
    await put(store, hs, [os.urandom(BLOCK) for _ in hs])  # 4 of 4 slots: over the 0.9 mark
    assert await store.migrate_once(top) is MigrationStatus.OK
    assert top.tier.used_bytes <= 0.5 * top.tier.capacity_bytes
    assert top.counters.demotions == 2
    assert sorted(where(store, hs)) == ["hbm", "hbm", "host", "host"]


async def test_write_back_reaches_ssd_only_on_demotion(tmp_path: Path) -> None:
    # Watermarks at 100%: no background demotion, only the puts' own, so the count is exact.
    store = build(tmp_path, top_blocks=2, host_blocks=2, policy=WritePolicy.BACK, high=1.0)
    await store.start()
    try:
        hs = hashes(6)
        blocks = [os.urandom(BLOCK) for _ in hs]
        await put(store, hs[:2], blocks[:2])
        assert await store.flush(5)
        assert tier_stats(store, "ssd").blocks == 0
        for i in range(2, 6):
            await put(store, hs[i : i + 1], blocks[i : i + 1])
        assert tier_stats(store, "ssd").blocks == 2  # only the demoted ones
        assert await fetch(store, hs) == blocks
    finally:
        await store.aclose()


async def test_restart_recovers_blocks_from_ssd(tmp_path: Path) -> None:
    store = build(tmp_path)
    await store.start()
    hs = hashes(10)
    blocks = [os.urandom(BLOCK) for _ in hs]
    await put(store, hs, blocks)
    await store.aclose()  # flushes the write-through queue
    again = build(tmp_path)
    await again.start()
    try:
        assert where(again, hs) == ["ssd"] * 10
        assert await fetch(again, hs) == blocks
        ns = next(n for n in again.namespaces() if n.layout == LAYOUT)
        assert ns.blocks == 10
    finally:
        await again.aclose()


async def test_last_tier_drops_and_counts(tmp_path: Path) -> None:
    store = build(tmp_path, top_blocks=2, host_blocks=2, ssd=False, high=1.0)
    await store.start()
    try:
        hs = hashes(6)
        blocks = [os.urandom(BLOCK) for _ in hs]
        for i in range(6):
            await put(store, hs[i : i + 1], blocks[i : i + 1])
        # put 4 and 5 found both tiers full: two blocks left the store from host.
        assert tier_stats(store, "host").counters.drops == 2
        ns = store.register(LAYOUT)
        present = [i for i, h in enumerate(hs) if store.lookup(ns, [h]).num_blocks]
        assert len(present) == 4
        for i in present:
            assert await fetch(store, [hs[i]]) == [blocks[i]]
    finally:
        await store.aclose()


async def test_a_block_being_read_is_not_lost_to_migration(store: Store) -> None:
    hs = hashes(4)
    blocks = [os.urandom(BLOCK) for _ in hs]
    await put(store, hs, blocks)
    ns = store.register(LAYOUT)
    async with store.open_fetch(ns, hs) as stream:
        # Held by the open fetch: the migrator can find no victim in the full top tier.
        assert await store.migrate_once(store.tiers[0]) is MigrationStatus.FAIL
        assert [b async for b in stream] == blocks


async def test_top_tier_of_each_hit_is_the_same_compiled_or_not(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup reads each hit's top tier in one compiled pass; the numpy form is the
    reference, for rows with one copy, with two (written through to SSD), and with a
    third for the moment of a move."""
    import numpy as np

    import kvstore.core.index as index_module

    hs = hashes(16)
    blocks = [os.urandom(BLOCK) for _ in hs]
    for i in range(0, 16, 4):
        await put(store, hs[i : i + 4], blocks[i : i + 4])
    await store.flush(10)
    ns = store.register(LAYOUT)
    rows = store.index.prefix_rows(ns, b"".join(hs))
    assert len(rows) == 16
    t = store.index.table
    assert (t.lt[rows, 1] != 0).any() and len(set(where(store, hs))) > 1  # two copies, several tiers
    first = store.index.top_ids(rows)
    result = store.lookup(ns, hs)
    # A third copy (in the top tier, mid-move) of a block with two below it.
    moving = next(int(r) for r, v in zip(rows.tolist(), first.tolist()) if v > 1 and t.lt[r, 1])
    t.extra_locs[moving] = [Slot("hbm", 0, BLOCK)]
    try:
        compiled = store.index.top_ids(rows)
        monkeypatch.setattr(index_module, "_native", None)
        reference = store.index.top_ids(rows)
    finally:
        del t.extra_locs[moving]
    assert compiled.dtype == reference.dtype == np.uint8
    assert compiled.tolist() == reference.tolist()
    assert compiled.tolist() == [1 if int(r) == moving else v for r, v in zip(rows.tolist(), first.tolist())]
    assert store.index.top_ids(rows).tolist() == first.tolist()
    # What the lookup answered: each block's top tier, by id and by name.
    assert result.tiers == [t.tier_names[i] for i in first.tolist()] == [store.block(ns, h).tier for h in hs]


async def test_the_migrator_expires_leases_before_it_demotes() -> None:
    """Leases end at the first moment after their deadline that anything reads pins: for
    an idle store, the migrator's next tick. Pinned blocks stay in a tier over its
    watermark; once the lease is past its deadline they are demoted, with no call made."""
    from tests.fakes import ManualClock

    clock = ManualClock(1000.0)
    tiers = [StoreTier(MemoryTier(4 * BLOCK, name="hbm"), make_policy("lru"), 0.5, 0.25),
             StoreTier(MemoryTier(8 * BLOCK, name="host"), make_policy("lru"), 0.9, 0.5)]
    store = Store(tiers, clock=clock, migration=MigrationConfig(tick_s=0.01), make_copier=make_copier)
    await store.start()
    try:
        ns = store.register(LAYOUT)
        hs = hashes(4)
        await put(store, hs, [os.urandom(BLOCK) for _ in hs])
        assert store.pin(ns, hs, ttl_ms=5_000).pinned == 4

        def served_from() -> list[str]:  # `block` reads no pins: it expires nothing itself
            return [info.tier for h in hs if (info := store.block(ns, h)) is not None]

        await asyncio.sleep(0.1)  # several ticks: everything is pinned, nothing moves
        assert served_from() == ["hbm"] * 4
        clock.now += 6.0
        for _ in range(200):
            await asyncio.sleep(0.01)
            if served_from().count("host") == 3:
                break
        assert served_from().count("host") == 3
        assert store.stats().leases_active == 0
    finally:
        await store.aclose()


async def test_replicas_marked_by_hash_in_the_memory_tier_of_their_top_copy(store: Store) -> None:
    """`mark_replicas` (one vectorized probe): a block with a memory copy and an SSD copy
    (written through) is marked in that memory tier; one on SSD alone, or not held, is
    not; its count says how many were marked."""
    hs = hashes(16)
    blocks = [os.urandom(BLOCK) for _ in hs]
    for i in range(0, 16, 4):
        await put(store, hs[i : i + 4], blocks[i : i + 4])
    await store.flush(10)
    tops = where(store, hs)
    in_memory = [h for h, t in zip(hs, tops) if t in ("hbm", "host")]
    on_ssd = [h for h, t in zip(hs, tops) if t == "ssd"]
    assert in_memory and on_ssd
    ns = store.register(LAYOUT)
    named = on_ssd[:1] + hashes(2, salt=7)[:1] + in_memory
    assert store.mark_replicas(ns, named) == len(in_memory)
    by_tier = {st.name: len(st.replicas) for st in store.tiers}
    assert by_tier["hbm"] == tops.count("hbm") and by_tier["host"] == tops.count("host")
    assert by_tier["ssd"] == 0
    assert store.mark_replicas(ns, []) == 0
