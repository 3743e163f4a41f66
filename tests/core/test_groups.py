"""Layouts with several KV groups, at the store: the hit rules of each group kind, parts
published all together or not at all, a corrupted part making its whole block a miss,
eviction never leaving a block half present, and a restart from SSD keeping groups
intact. Real memory, host and SSD tiers; blocks put and fetched as their parts."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from kvstore.core.policies import make_policy
from kvstore.core.store import MigrationConfig, Store, StoreTier, WritePolicy
from kvstore.errors import InvalidArgument
from kvstore.groups import full_bytes, needed, part_order, stored_bytes
from kvstore.hashing import HASH_BYTES, block_hashes, group_namespace_id
from kvstore.layout import GroupKind, KVGroup, KVLayout
from kvstore.tiers.copiers import make_copier
from kvstore.tiers.host import HostTier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.ssd import SsdTier

BST = 4
# Full attention, a sliding window of 9 tokens (the token computed and 8 before it: the
# last 2 blocks of a prefix), a Mamba-like state, and fp8 scales for every block.
HYBRID = KVLayout(
    model="test/hybrid", dtype="float16", num_layers=4, num_kv_heads=1, head_dim=8, block_size_tokens=BST,
    groups=(
        KVGroup("full", GroupKind.FULL, "float16", (2, 1, BST, 1, 8)),
        KVGroup("swa", GroupKind.SLIDING_WINDOW, "float16", (2, 1, BST, 1, 8), window_tokens=9),
        KVGroup("ssm", GroupKind.STATE, "float32", (64,)),
        KVGroup("scales", GroupKind.AUXILIARY, "float32", (2, BST)),
    ),
)
# Gemma-like: full and sliding-window layers only.
WINDOWED = KVLayout(
    model="test/windowed", dtype="bfloat16", num_layers=3, num_kv_heads=1, head_dim=16, block_size_tokens=BST,
    groups=(
        KVGroup("full", GroupKind.FULL, "bfloat16", (2, 1, BST, 1, 16)),
        KVGroup("swa", GroupKind.SLIDING_WINDOW, "bfloat16", (2, 2, BST, 1, 16), window_tokens=5),
    ),
)


def tokens(n_blocks: int, salt: int = 0) -> list[int]:
    return [salt * 100_000 + i for i in range(n_blocks * BST)]


def chain(layout: KVLayout, toks: list[int]) -> list[bytes]:
    return block_hashes(layout.namespace_id, toks, BST)


def parts_for(layout: KVLayout, n: int) -> list[bytes]:
    """Random bytes for every part a put of n blocks stores, in wire order."""
    return [os.urandom(layout.groups[g].bytes_per_block) for g, _ in part_order(layout, n)]


async def put(store: Store, layout: KVLayout, hashes: list[bytes], parts: Sequence[bytes] | None = None,
              parent: bytes | None = None) -> list[bytes]:
    parts = list(parts) if parts is not None else parts_for(layout, len(hashes))
    info = store.prepare_namespace(layout)
    async with store.begin_stream_put(info, hashes, parent) as txn:
        for k, data in enumerate(parts):
            await txn.write(k, data[:7])
            await txn.write(k, data[7:])
        await txn.commit()
    return parts


async def fetch(store: Store, layout: KVLayout, hashes: list[bytes]) -> tuple[int, list[bytes], str]:
    async with store.open_fetch(layout.namespace_id, hashes) as stream:
        got = [bytes(b) async for b in stream]
        return stream.prefix_blocks, got, stream.ended_early


def lookup(store: Store, layout: KVLayout, hashes: list[bytes]) -> int:
    return store.lookup(layout.namespace_id, hashes).num_blocks


def parts_held(store: Store, layout: KVLayout, h: bytes) -> set[str]:
    ns = layout.namespace_id
    return {g.name for i, g in enumerate(layout.groups) if store.block(group_namespace_id(ns, i), h) is not None}


def host_store(capacity: int = 1 << 20) -> Store:
    return Store([StoreTier(HostTier(capacity), make_policy("lru"), 0.9, 0.5)])


def test_hit_rules_need_every_block_the_window_and_the_end():
    # A prefix of 5 blocks: full and scales every block, the window the last 2, the state the last.
    assert [(n.start, n.stop) for n in needed(HYBRID, 5)] == [(0, 5), (3, 5), (4, 5), (0, 5)]
    assert [(n.start, n.stop) for n in needed(HYBRID, 1)] == [(0, 1), (0, 1), (0, 1), (0, 1)]
    assert part_order(HYBRID, 2) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 1), (3, 0), (3, 1)]
    saved = full_bytes(HYBRID, 100) - stored_bytes(HYBRID, 100)
    assert saved == 98 * 128 + 99 * 256  # the window parts of 98 blocks and 99 states are not kept


async def test_lookup_answers_the_longest_prefix_every_group_serves():
    store = host_store()
    toks = tokens(10)
    hs = chain(HYBRID, toks)
    parts = await put(store, HYBRID, hs)
    assert lookup(store, HYBRID, hs) == 10
    longer = chain(HYBRID, toks + tokens(3, salt=7))
    assert lookup(store, HYBRID, longer) == 10  # the put's end: the state is there
    # A prompt that shares 6 blocks and then differs: full attention has them, but neither
    # the window nor the state was kept at block 6, so nothing is a hit (never a partial one).
    branch = chain(HYBRID, toks[: 6 * BST] + tokens(4, salt=9))
    assert lookup(store, HYBRID, branch) == 0
    m, got, ended = await fetch(store, HYBRID, hs)
    assert (m, ended) == (10, "") and got == parts
    # The shared point put on its own becomes reusable: its blocks exist, only the window
    # and the state at its end are added.
    extra = await put(store, HYBRID, hs[:6])
    assert len(extra) == part_count_of(HYBRID, 6)
    assert lookup(store, HYBRID, branch) == 6
    assert parts_held(store, HYBRID, hs[5]) == {"full", "swa", "ssm", "scales"}
    assert parts_held(store, HYBRID, hs[2]) == {"full", "scales"}


def part_count_of(layout: KVLayout, n: int) -> int:
    return len(part_order(layout, n))


async def test_a_window_group_needs_only_its_window():
    store = host_store()
    toks = tokens(8)
    hs = chain(WINDOWED, toks)
    await put(store, WINDOWED, hs)
    # window 5 tokens: 1 block before the end. Blocks 0..6 keep no window part.
    assert [parts_held(store, WINDOWED, h) for h in hs] == [{"full"}] * 7 + [{"full", "swa"}]
    assert lookup(store, WINDOWED, hs) == 8
    assert lookup(store, WINDOWED, hs[:7]) == 0
    c = store.stats().counters
    assert c.group_bytes_skipped == full_bytes(WINDOWED, 8) - stored_bytes(WINDOWED, 8) == 7 * 512
    assert c.group_parts_stored == 9 and c.blocks_stored == 8 and c.puts == 1


async def test_parts_are_published_together_or_not_at_all():
    store = host_store()
    hs = chain(HYBRID, tokens(3))
    parts = parts_for(HYBRID, 3)
    info = store.prepare_namespace(HYBRID)
    async with store.begin_stream_put(info, hs) as txn:
        for k, data in enumerate(parts):
            await txn.write(k, data)
        assert lookup_or_zero(store, HYBRID, hs) == 0  # every byte arrived, nothing published
        await txn.commit()
    assert lookup(store, HYBRID, hs) == 3
    # A put that breaks off in its last group's parts publishes none of its groups.
    hs2 = chain(HYBRID, tokens(3, salt=1))
    with pytest.raises(InvalidArgument):
        async with store.begin_stream_put(store.prepare_namespace(HYBRID), hs2) as txn:
            for k, data in enumerate(parts[:-1]):
                await txn.write(k, data)
            await txn.commit()
    assert all(parts_held(store, HYBRID, h) == set() for h in hs2)
    assert store.stats().counters.put_failures == 1


def lookup_or_zero(store: Store, layout: KVLayout, hashes: list[bytes]) -> int:
    if not store.has_namespace(layout.namespace_id):
        return 0
    return lookup(store, layout, hashes)


async def test_a_corrupted_part_makes_the_whole_block_a_miss():
    tier = MemoryTier(1 << 20, name="memory")
    store = Store([StoreTier(tier, make_policy("lru"))])
    hs = chain(HYBRID, tokens(4))
    await put(store, HYBRID, hs)
    # Flip the state part's bytes in place (the part at the prefix end).
    info = store.block(group_namespace_id(HYBRID.namespace_id, 2), hs[3])
    assert info is not None
    await tier.write(info.slot, 0, b"\xff" * 16)
    m, got, ended = await fetch(store, HYBRID, hs)
    assert ended and "verification" in ended
    assert parts_held(store, HYBRID, hs[3]) == set()  # every part of block 3 left with it
    assert parts_held(store, HYBRID, hs[2]) == {"full", "swa", "scales"}
    assert lookup(store, HYBRID, hs) == 0  # no state at any end now: a miss, never a partial hit
    assert store.stats().counters.group_parts_dropped == 3


async def test_eviction_never_leaves_a_block_half_present():
    per_put = stored_bytes(WINDOWED, 3)
    store = Store([StoreTier(HostTier(4 * per_put), make_policy("lru"), 0.9, 0.5)],
                  migration=MigrationConfig(tick_s=3600))
    await store.start()
    try:
        expected: dict[bytes, set[str]] = {}
        for salt in range(12):
            hs = chain(WINDOWED, tokens(3, salt=salt))
            await put(store, WINDOWED, hs)
            for j, h in enumerate(hs):
                expected[h] = {"full"} | ({"swa"} if j == 2 else set())
            for other in (t for t in store.tiers):
                await store.migrate_once(other)
            for h, want in expected.items():
                assert parts_held(store, WINDOWED, h) in (want, set())
        assert sum(1 for h in expected if not parts_held(store, WINDOWED, h)) > 0  # eviction ran
        assert store.stats().counters.group_parts_dropped > 0
    finally:
        await store.aclose()


def ssd_store(tmp_path: Path) -> Store:
    tiers = [
        StoreTier(MemoryTier(64 << 10, name="host"), make_policy("lru"), 0.9, 0.5),
        StoreTier(SsdTier(str(tmp_path / "ssd"), 1 << 20, region_size=64 << 10, io_threads=2), make_policy("lru")),
    ]
    return Store(tiers, migration=MigrationConfig(write_policy=WritePolicy.THROUGH, tick_s=3600),
                 make_copier=make_copier)


@pytest.fixture
async def restarted(tmp_path: Path) -> AsyncIterator[tuple[Path, list[bytes], list[bytes]]]:
    store = ssd_store(tmp_path)
    await store.start()
    hs = chain(WINDOWED, tokens(6))
    parts = await put(store, WINDOWED, hs)
    await store.aclose()
    yield tmp_path, hs, parts


async def test_a_restart_from_ssd_keeps_every_group(restarted):
    tmp_path, hs, parts = restarted
    again = ssd_store(tmp_path)
    await again.start()
    try:
        assert again.has_recovered(WINDOWED.namespace_id, WINDOWED)
        again.register(WINDOWED)  # what a read of the layout does, to adopt the recovered parts
        assert lookup(again, WINDOWED, hs) == 6
        m, got, ended = await fetch(again, WINDOWED, hs)
        assert (m, ended) == (6, "") and got == parts
        (ns,) = again.namespaces()
        assert (ns.blocks, ns.bytes) == (6, stored_bytes(WINDOWED, 6))
    finally:
        await again.aclose()


async def test_a_block_whose_part_did_not_survive_a_restart_is_dropped_whole(restarted):
    tmp_path, hs, parts = restarted
    # Damage block 5's full-attention part on disk, as a crash mid-write would leave it;
    # the log is scanned (no snapshot), and that record fails its checksum. Block 5 also
    # has a window part (the put's end), which survived.
    (tmp_path / "ssd" / "index.snapshot").unlink()
    victim = parts[5]  # wire order: the full parts of blocks 0..5, then the window part of block 5
    for region in sorted((tmp_path / "ssd").glob("region*")):
        data = bytearray(region.read_bytes())
        at = data.find(victim)
        if at >= 0:
            data[at] ^= 0xFF
            region.write_bytes(bytes(data))
            break
    else:
        pytest.fail("the part's record was not found in the SSD log")
    again = ssd_store(tmp_path)
    await again.start()
    try:
        again.register(WINDOWED)
        assert parts_held(again, WINDOWED, hs[5]) == set()  # its surviving window part went with it
        assert again.stats().counters.group_parts_dropped == 1
        assert all(parts_held(again, WINDOWED, h) == {"full"} for h in hs[:5])
        # Blocks 0 to 4 are whole, but no prefix of them was a put's end: no window part was
        # kept for any, so nothing is served rather than a partial hit.
        assert lookup(again, WINDOWED, hs) == 0
    finally:
        await again.aclose()


def test_a_grouped_layout_is_hashed_apart_from_its_blocks_ids():
    ns = HYBRID.namespace_id
    ids = {group_namespace_id(ns, g) for g in range(4)}
    assert len(ids | {ns}) == 5 and all(len(i) == HASH_BYTES for i in ids)
