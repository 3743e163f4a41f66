"""The extent allocator: exact accounting, best fit, coalescing, alignment."""

from __future__ import annotations

import random

import pytest

from kvstore.tiers.extents import ExtentAllocator


def test_alloc_free_coalesce_back_to_one_extent():
    a = ExtentAllocator(1024, alignment=64)
    offs = [a.allocate(100) for _ in range(8)]  # 128 each
    assert offs == [i * 128 for i in range(8)]
    assert a.allocate(1) is None and a.used_bytes == 1024
    for off in offs[::2] + offs[1::2]:
        a.free(off, 100)
    assert a.used_bytes == 0 and a.largest_free == 1024


def test_best_fit_prefers_the_smallest_hole():
    a = ExtentAllocator(1024, alignment=64)
    x, y, z, w = (a.allocate(n) for n in (256, 64, 128, 64))
    a.free(x, 256)
    a.free(z, 128)
    assert a.allocate(128) == z  # the 128-byte hole, not the 256-byte one


def test_random_workload_keeps_accounting_exact():
    rng = random.Random(7)
    a = ExtentAllocator(1 << 20, alignment=256)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            n = rng.randint(1, 20_000)
            off = a.allocate(n)
            if off is not None:
                assert all(off + a.aligned(n) <= o or o + a.aligned(m) <= off for o, m in live.items())
                live[off] = n
        assert a.used_bytes == sum(a.aligned(n) for n in live.values()) <= a.capacity_bytes
    for off, n in list(live.items()):
        a.free(off, n)
    assert a.used_bytes == 0 and a.largest_free == a.capacity_bytes


def test_rejects_bad_frees_and_alignment():
    a = ExtentAllocator(1024, alignment=64)
    with pytest.raises(ValueError):
        a.free(32, 64)
    with pytest.raises(ValueError):
        ExtentAllocator(1024, alignment=48)


def _fragmented(seed: int) -> tuple[ExtentAllocator, ExtentAllocator, dict[int, int]]:
    """Two allocators in the same random state of holes of mixed sizes."""
    rng = random.Random(seed)
    a, b = ExtentAllocator(1 << 20, alignment=256), ExtentAllocator(1 << 20, alignment=256)
    live: dict[int, int] = {}
    for _ in range(600):
        if live and rng.random() < 0.4:
            off = rng.choice(list(live))
            n = live.pop(off)
            a.free(off, n)
            b.free(off, n)
        else:
            n = rng.choice([256, 512, 1024, rng.randint(1, 9000)])
            off = a.allocate(n)
            assert b.allocate(n) == off
            if off is not None:
                live[off] = n
    return a, b, live


@pytest.mark.parametrize("seed", range(12))
def test_allocate_many_places_as_allocate_one_by_one(seed):
    """A batch lands exactly where as many single allocations would, and leaves the
    allocator in the same state, whether it takes exact holes, cuts larger ones or runs
    out of room."""
    a, b, live = _fragmented(seed)
    rng = random.Random(seed)
    for _ in range(40):
        n, count = rng.choice([256, 512, 700, 1024, 4096]), rng.randint(1, 60)
        one_by_one = []
        for _ in range(count):
            off = a.allocate(n)
            if off is None:
                break
            one_by_one.append(off)
        assert b.allocate_many(n, count) == one_by_one
        assert (b.used_bytes, b.largest_free, b._by_size) == (a.used_bytes, a.largest_free, a._by_size)
        for off in one_by_one:
            live[off] = n
        for off in rng.sample(list(live), min(len(live), rng.randint(0, 30))):
            size = live.pop(off)
            a.free(off, size)
            b.free(off, size)
    assert b.allocate_many(256, 0) == []


def test_allocate_many_on_a_full_allocator_gives_none():
    a = ExtentAllocator(1024, alignment=64)
    assert a.allocate_many(64, 100) == [i * 64 for i in range(16)]
    assert a.allocate_many(64, 1) == [] and a.used_bytes == 1024
