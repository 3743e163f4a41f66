"""The host tier with one segment per space (auth on: per tenant), on its own: each
space's blocks in a segment of its own, no page shared between spaces, memory bounded by
the capacity, and pages kept where they are when a space can reuse its own."""

from __future__ import annotations

import os
import random

import pytest

from kvstore.tiers.extents import ExtentAllocator
from kvstore.tiers.host import PAGE_BYTES, SLACK_HOLD_S, SpacedHostTier
from kvstore.tiers.segment import Segment


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def tier_of(capacity: int, clock: Clock) -> SpacedHostTier:
    return SpacedHostTier(capacity, clock=clock)


def pages_of(tier: SpacedHostTier, slot) -> set[int]:  # type: ignore[no-untyped-def]
    start = tier.client_offsets(tier.space_of(slot), [slot.offset])[0]
    return set(range(start // PAGE_BYTES, (start + slot.size - 1) // PAGE_BYTES + 1))


def test_take_allocates_exactly_a_free_range():
    a = ExtentAllocator(64 * 1024, alignment=256, indexed=True)
    assert a.take(4096, 1024)
    assert not a.take(4096, 256)  # taken already
    assert not a.take(4096 - 256, 512)  # overlaps it
    assert a.take(0, 4096) and a.take(5120, 64 * 1024 - 5120)
    assert a.free_bytes == 0 and a.allocate(256) is None
    a.free(4096, 1024)
    assert a.fits(256, 8) == [(4096, 1024)]
    assert a.take(4096 + 512, 256) and a.free_bytes == 768


@pytest.mark.parametrize("seed", range(4))
def test_an_indexed_allocator_places_as_the_plain_one(seed):
    rng = random.Random(seed)
    plain, indexed = ExtentAllocator(1 << 20, 256), ExtentAllocator(1 << 20, 256, indexed=True)
    live: dict[int, int] = {}
    for _ in range(400):
        if live and rng.random() < 0.4:
            off = rng.choice(list(live))
            n = live.pop(off)
            plain.free(off, n)
            indexed.free(off, n)
        else:
            n, count = rng.choice([256, 1024, 4096, rng.randint(1, 9000)]), rng.randint(1, 8)
            got = plain.allocate_many(n, count)
            assert indexed.allocate_many(n, count) == got
            live.update((off, n) for off in got)
    assert plain.fits(1, 1 << 20) == indexed.fits(1, 1 << 20)  # the same free extents, in the same order


def test_an_anonymous_segment_has_no_path_and_cannot_be_resized():
    seg = Segment(1 << 20, anonymous=True)
    try:
        assert seg.path == "" and seg.fd >= 0
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 4096)  # sealed: a client holding it cannot shrink it
    finally:
        seg.close()


async def test_each_space_has_a_segment_of_its_own(clock):
    tier = tier_of(1 << 20, clock)
    try:
        a, b = tier.allocate(PAGE_BYTES, 1), tier.allocate(PAGE_BYTES, 2)
        assert a is not None and b is not None
        assert (tier.space_of(a), tier.space_of(b)) == (1, 2)
        await tier.write(a, 0, b"a" * PAGE_BYTES)
        await tier.write(b, 0, b"b" * PAGE_BYTES)
        assert await tier.read(a, PAGE_BYTES) == b"a" * PAGE_BYTES
        seg_a, seg_b = tier.segment_for(1), tier.segment_for(2)
        assert seg_a is not seg_b and seg_a.path == seg_b.path == ""
        assert b"b" not in bytes(seg_a.data) and b"a" not in bytes(seg_b.data)
        # What a client of space 2 is told: offsets in its segment, only for its slots.
        assert tier.client_offsets(2, [b.offset]) == [tier.client_offsets(2, [b.offset])[0]]
        assert tier.client_offsets(2, [b.offset, a.offset, b.offset]) == tier.client_offsets(2, [b.offset])
        assert tier.client_offsets(2, [a.offset]) == []
    finally:
        tier.close()


def test_spaces_never_share_a_page_and_the_capacity_is_as_without_spaces(clock):
    """1 KiB blocks of two spaces taking turns fill the whole tier, as in a tier without
    spaces, with no page holding blocks of both."""
    tier = tier_of(64 * 1024, clock)
    try:
        slots = [tier.allocate(1024, 1 + i % 2) for i in range(64)]
        assert all(s is not None for s in slots) and tier.used_bytes == 64 * 1024
        assert tier.allocate(256, 1) is None
        by_space: dict[int, set[int]] = {1: set(), 2: set()}
        for s in slots:
            by_space[tier.space_of(s)] |= pages_of(tier, s)
        assert not by_space[1] & by_space[2]
    finally:
        tier.close()


async def test_memory_stays_within_the_capacity_under_churn(clock):
    """Three spaces allocating, writing and freeing blocks of mixed sizes at random: the
    segments together never hold more than the capacity, plus a header page each."""
    rng = random.Random(7)
    capacity = 256 * 1024
    tier = tier_of(capacity, clock)
    live = []
    try:
        for step in range(3000):
            clock.now += 0.01
            if live and (rng.random() < 0.45 or tier.used_bytes > capacity * 0.9):
                tier.free(live.pop(rng.randrange(len(live))))
                continue
            size = rng.choice([1024, 4096, 8192, 5000, 12288])
            slot = tier.allocate(size, rng.choice([1, 2, 3]), reclaim=rng.random() < 0.3)
            if slot is None:
                continue
            await tier.write(slot, 0, os.urandom(size))
            live.append(slot)
            assert tier.resident_bytes <= capacity + int(tier.describe()["segments"]) * PAGE_BYTES, step
        assert tier.used_bytes == sum(s.size for s in live)
        for s in live:
            tier.free(s)
        assert tier.used_bytes == 0 and tier.allocate(capacity, 1, reclaim=True) is not None
    finally:
        tier.close()


async def test_a_space_reuses_its_own_pages_before_anyone_elses(clock):
    tier = tier_of(64 * PAGE_BYTES, clock)
    try:
        a = [tier.allocate(PAGE_BYTES, 1) for _ in range(32)]
        b = [tier.allocate(PAGE_BYTES, 2) for _ in range(32)]
        for s in a + b:
            await tier.write(s, 0, b"x" * PAGE_BYTES)
        # Each frees some, interleaved in address order; each takes back its own pages.
        for s in a[:8] + b[:8]:
            tier.free(s)
        again_b = [tier.allocate(PAGE_BYTES, 2) for _ in range(8)]
        again_a = [tier.allocate(PAGE_BYTES, 1) for _ in range(8)]
        assert {s.offset for s in again_a} == {s.offset for s in a[:8]}
        assert {s.offset for s in again_b} == {s.offset for s in b[:8]}
        assert tier.describe()["moved_bytes"] == "0"
    finally:
        tier.close()


async def test_free_pages_of_a_space_are_kept_for_it_until_nothing_else_is_left(clock):
    """When memory is short, pages a space has just freed are not handed to another space
    (which would evict instead), unless asked to reclaim them, or the space has not
    allocated for a while; pages that change space are punched out of the old one."""
    tier = tier_of(64 * PAGE_BYTES, clock)
    try:
        a = [tier.allocate(PAGE_BYTES, 1) for _ in range(32)]
        b = [tier.allocate(PAGE_BYTES, 2) for _ in range(32)]
        for s in a + b:
            await tier.write(s, 0, b"x" * PAGE_BYTES)
        full = tier.resident_bytes
        tier.free(a[0])
        assert tier.allocate(PAGE_BYTES, 2) is None  # space 1's, kept for it
        taken = tier.allocate(PAGE_BYTES, 2, reclaim=True)
        assert taken is not None and tier.describe()["moved_bytes"] == str(PAGE_BYTES)
        assert tier.resident_bytes == full - PAGE_BYTES  # punched out of space 1's segment
        await tier.write(taken, 0, b"y" * PAGE_BYTES)
        tier.free(a[1])
        clock.now += SLACK_HOLD_S + 1  # space 1 has not allocated since
        assert tier.allocate(PAGE_BYTES, 2) is not None
    finally:
        tier.close()


@pytest.mark.parametrize("seed", range(4))
def test_extents_marked_together_count_each_page_as_one_by_one(seed, clock):
    """`_mark_many` (a put's small blocks, summed per page) leaves the partial-page counts
    exactly as marking each extent alone does, on and off page boundaries, for extents
    under a page and over one, marked and unmarked."""
    rng = random.Random(seed)
    together, alone = tier_of(1 << 20, clock), tier_of(1 << 20, clock)
    try:
        for size in (256, 768, 1000, PAGE_BYTES - 256, PAGE_BYTES + 512):
            start = rng.randrange(0, 64) * 256
            offsets = [start + k * size for k in range(rng.randrange(8, 40))]
            for tier in (together, alone):
                tier._partial.clear()
            together._mark_many(offsets, size, 1)
            for o in offsets:
                alone._mark(o, size, 1)
            assert together._partial == alone._partial and together._partial
            half = offsets[::2]
            together._mark_many(half, size, -1)
            for o in half:
                alone._mark(o, size, -1)
            assert together._partial == alone._partial
    finally:
        together.close()
        alone.close()
