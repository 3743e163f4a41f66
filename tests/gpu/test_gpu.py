"""GPU paths: the HBM tier's streams and events, pinning, and a bit-exact trip through
every tier. Marked `gpu`; skipped where CUDA is absent (run them with `make test-gpu`)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvstore.core.policies import make_policy
from kvstore.core.store import MigrationConfig, Store, StoreTier, WritePolicy
from kvstore.hashing import HASH_BYTES
from kvstore.layout import KVLayout
from kvstore.tiers.copiers import make_copier
from kvstore.tiers.cuda import cuda_available
from kvstore.tiers.host import HostTier
from kvstore.tiers.ssd import SsdTier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]

LAYOUT = KVLayout(model="test/gpu", dtype="bfloat16", num_layers=4, num_kv_heads=8, head_dim=128,
                  block_size_tokens=16)  # 256 KiB blocks
BLOCK = LAYOUT.bytes_per_block


def test_host_tier_is_pinned_when_cuda_exists() -> None:
    tier = HostTier(8 << 20)
    try:
        assert tier.describe()["pinned"] == "yes"
    finally:
        tier.close()


async def test_stream_ordering_under_load() -> None:
    from kvstore.tiers.hbm import HbmTier

    tier = HbmTier(64 << 20)
    try:
        slots = [tier.allocate(BLOCK) for _ in range(128)]
        assert all(s is not None for s in slots)
        for rnd in range(3):
            datas = [os.urandom(BLOCK) for _ in slots]
            # Each read is queued right behind its write, before the write has completed:
            # the store stream must wait for the load stream, or it reads stale bytes.
            writes = [asyncio.create_task(tier.write(s, 0, d)) for s, d in zip(slots, datas) if s]
            reads = [asyncio.create_task(tier.read(s, BLOCK)) for s in slots if s]
            await asyncio.gather(*writes)
            got = await asyncio.gather(*reads)
            assert got == datas, f"round {rnd}: a read overtook its write"
        assert tier.copier.loads == tier.copier.stores == 3 * 128
    finally:
        tier.close()


async def test_hbm_host_ssd_host_hbm_round_trip_is_bit_exact(tmp_path: Path) -> None:
    from kvstore.tiers.hbm import HbmTier

    # Watermarks at 1%: one migration step empties a tier into the next one down.
    tiers = [
        StoreTier(HbmTier(16 * BLOCK), make_policy("lru"), 0.01, 0.01),
        StoreTier(HostTier(16 * BLOCK), make_policy("lru"), 0.01, 0.01),
        StoreTier(SsdTier(str(tmp_path / "ssd"), 64 * BLOCK, region_size=16 * BLOCK), make_policy("lru")),
    ]
    store = Store(tiers, migration=MigrationConfig(write_policy=WritePolicy.BACK), make_copier=make_copier)
    try:
        ns = store.register(LAYOUT)
        hashes = [i.to_bytes(HASH_BYTES, "big") for i in range(8)]
        blocks = [os.urandom(BLOCK) for _ in hashes]
        async with store.begin_put(ns, hashes) as txn:
            for i, b in enumerate(blocks):
                await txn.write(i, b)
            await txn.commit()
        assert store.lookup(ns, hashes).tiers == ["hbm"] * 8
        await store.migrate_once(tiers[0])
        assert store.lookup(ns, hashes).tiers == ["host"] * 8
        await store.migrate_once(tiers[1])
        assert store.lookup(ns, hashes).tiers == ["ssd"] * 8
        assert (await store.prefetch(ns, hashes, "host")).raised == 8
        assert store.lookup(ns, hashes).tiers == ["host"] * 8
        assert (await store.prefetch(ns, hashes, "hbm")).raised == 8
        assert store.lookup(ns, hashes).tiers == ["hbm"] * 8
        async with store.open_fetch(ns, hashes) as stream:
            assert [b async for b in stream] == blocks
        assert store.stats().counters.checksum_failures == 0
    finally:
        await store.aclose()
