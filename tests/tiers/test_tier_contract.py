"""One contract, every tier: memory, host, ssd, and hbm (marked gpu, skipped without CUDA)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.checksum import checksum
from kvstore.core.tier import BlockMeta, Tier
from kvstore.tiers.cuda import cuda_available
from kvstore.tiers.host import HostTier, SpacedHostTier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.ssd import SsdTier

CAPACITY = 256 * 1024
BLOCK = 4096


def _make(kind: str, tmp_path: Path) -> Tier:
    if kind == "memory":
        return MemoryTier(CAPACITY)
    if kind == "host":
        return HostTier(CAPACITY)
    if kind == "spaced-host":
        return SpacedHostTier(CAPACITY)
    if kind == "ssd":
        return SsdTier(str(tmp_path / "ssd"), CAPACITY, region_size=64 * 1024, io_threads=2)
    if kind == "hbm":
        from kvstore.tiers.hbm import HbmTier

        return HbmTier(CAPACITY)
    raise AssertionError(kind)


gpu_only = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")


@pytest.fixture(params=["memory", "host", "spaced-host", "ssd", pytest.param("hbm", marks=[pytest.mark.gpu, gpu_only])])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    t = _make(request.param, tmp_path)
    try:
        yield t
    finally:
        t.close()


def meta(i: int, data: bytes) -> BlockMeta:
    return BlockMeta(key=i.to_bytes(32, "big"), parent=None, checksum=checksum(data), itemsize=2)


async def test_put_get_roundtrip_is_byte_exact(tier: Tier) -> None:
    blocks = [os.urandom(BLOCK) for _ in range(5)] + [bytes(BLOCK), b"\x01\x00" * (BLOCK // 2)]
    slots = []
    for i, data in enumerate(blocks):
        slot = await tier.put_block(meta(i, data), data)
        assert slot is not None and slot.tier == tier.name
        slots.append(slot)
    for slot, data in zip(slots, blocks):
        assert await tier.get_block(slot, len(data)) == data


async def test_accounting_is_exact_and_free_returns_it(tier: Tier) -> None:
    assert (tier.used_bytes, tier.blocks) == (0, 0)
    data = os.urandom(BLOCK)
    slot = await tier.put_block(meta(1, data), data)
    assert slot is not None
    assert tier.blocks == 1
    assert tier.used_bytes == slot.size <= tier.accounted_size(BLOCK)
    tier.free(slot)
    assert (tier.used_bytes, tier.blocks) == (0, 0)


async def test_full_tier_says_so_and_never_exceeds_capacity(tier: Tier) -> None:
    slots = []
    i = 0
    while True:
        data = os.urandom(BLOCK)
        slot = await tier.put_block(meta(i, data), data)
        if slot is None:
            break
        slots.append((slot, data))
        assert tier.used_bytes <= tier.capacity_bytes
        i += 1
    assert slots and not tier.has_room(BLOCK)
    # Freeing everything makes room again, and old blocks still read back until freed.
    for slot, data in slots[:3]:
        assert await tier.get_block(slot, BLOCK) == data
    for slot, _ in slots:
        tier.free(slot)
    assert tier.used_bytes == 0 and tier.has_room(BLOCK)
    data = os.urandom(BLOCK)
    again = await tier.put_block(meta(999, data), data)
    assert again is not None and await tier.get_block(again, BLOCK) == data


async def test_streamed_chunks_on_addressable_tiers(tier: Tier) -> None:
    if not tier.addressable:
        pytest.skip(f"{tier.name} stores whole blocks only")
    data = os.urandom(BLOCK)
    slot = tier.allocate(BLOCK)
    assert slot is not None
    for start in range(0, BLOCK, 1000):
        await tier.write(slot, start, data[start : start + 1000])
    assert await tier.read(slot, BLOCK) == data
    with pytest.raises(ValueError):
        await tier.write(slot, slot.size - 1, b"xx")


def test_describe_is_strings(tier: Tier) -> None:
    facts = tier.describe()
    assert facts and all(isinstance(k, str) and isinstance(v, str) for k, v in facts.items())


def test_allocate_many_accounts_like_allocate(tier: Tier) -> None:
    """A batch of slots: distinct, in the tier, accounted as that many single ones, and
    cut short (not failed) when the tier runs out; freeing them gives the room back."""
    if not tier.addressable:
        pytest.skip(f"{tier.name} stores whole blocks only")
    first = tier.allocate_many(BLOCK, 10)
    assert len(first) == 10 and len({s.offset for s in first}) == 10
    assert all(s.tier == tier.name and s.size == tier.accounted_size(BLOCK) for s in first)
    assert tier.used_bytes == 10 * tier.accounted_size(BLOCK) and tier.blocks == 10
    rest = tier.allocate_many(BLOCK, 1000)
    assert len(first) + len(rest) == CAPACITY // tier.accounted_size(BLOCK)
    assert not tier.has_room(BLOCK) and tier.allocate_many(BLOCK, 1) == []
    for slot in first + rest:
        tier.free(slot)
    assert tier.used_bytes == 0 and tier.blocks == 0


async def test_capabilities_are_declared_and_consistent(tier: Tier) -> None:
    """What the store plans with is declared on the contract: a tier either addresses its
    bytes and holds blocks exclusively (memory), or stores whole blocks and keeps them next
    to the copies above (SSD); `recover` is None or the blocks found; `region_keys` names
    the block itself among those sharing its room."""
    assert isinstance(tier.inclusive, bool) and tier.addressable != tier.inclusive
    report = await tier.recover()
    assert report is None or len(report) == 0  # a fresh tier recovers nothing
    data = os.urandom(BLOCK)
    key = meta(7, data).key
    slot = await tier.put_block(meta(7, data), data)
    assert slot is not None
    assert key in tier.region_keys(slot, key)
    tier.free(slot)
