"""One contract, every copier: bytes land exactly, concurrent copies do not mix.

memcpy and bounce run everywhere; the HBM DMA copiers are marked gpu."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from kvstore.core.tier import Copier, Tier
from kvstore.tiers.copiers import BounceCopier, MemcpyCopier, make_copier
from kvstore.tiers.cuda import cuda_available
from kvstore.tiers.host import HostTier
from kvstore.tiers.memory import MemoryTier

CAPACITY = 4 << 20
BLOCK = 64 * 1024
gpu_only = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]


def _tier(kind: str) -> Tier:
    if kind == "memory":
        return MemoryTier(CAPACITY)
    if kind == "host":
        return HostTier(CAPACITY)
    from kvstore.tiers.hbm import HbmTier

    return HbmTier(CAPACITY)


PAIRS = [
    pytest.param(("memory", "host", "memcpy"), id="memory->host memcpy"),
    pytest.param(("host", "memory", "bounce"), id="host->memory bounce"),
    pytest.param(("host", "hbm", "auto"), id="host->hbm dma", marks=gpu_only),
    pytest.param(("hbm", "host", "auto"), id="hbm->host dma", marks=gpu_only),
]


@pytest.fixture(params=PAIRS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Tier, Tier, Copier]]:
    src_kind, dst_kind, how = request.param
    src, dst = _tier(src_kind), _tier(dst_kind)
    copier = {"memcpy": MemcpyCopier(), "bounce": BounceCopier()}.get(how) or make_copier(src, dst)
    try:
        yield src, dst, copier
    finally:
        src.close()
        dst.close()


async def test_copies_land_byte_exact_under_concurrency(pair: tuple[Tier, Tier, Copier]) -> None:
    src, dst, copier = pair
    n = 32
    datas = [os.urandom(BLOCK) for _ in range(n)]
    src_slots = [src.allocate(BLOCK) for _ in range(n)]
    dst_slots = [dst.allocate(BLOCK) for _ in range(n)]
    assert all(src_slots) and all(dst_slots)
    for slot, data in zip(src_slots, datas):
        await src.write(slot, 0, data)  # type: ignore[arg-type]
    await asyncio.gather(*(copier.copy(src, s, dst, d, BLOCK) for s, d in zip(src_slots, dst_slots)))
    got = [await dst.read(d, BLOCK) for d in dst_slots]  # type: ignore[arg-type]
    assert got == datas


def test_make_copier_picks_memcpy_between_host_views() -> None:
    a, b = MemoryTier(CAPACITY), HostTier(CAPACITY)
    try:
        assert isinstance(make_copier(a, b), MemcpyCopier)
        assert isinstance(make_copier(b, a), MemcpyCopier)
    finally:
        a.close()
        b.close()
