"""The host tier: host memory holding blocks at aligned offsets, in shared-memory segments
that co-located clients map, so they move bytes with one memcpy.

Both forms are the `SharedWindow` of the tier contract (`kvstore.core.tier`): what the
server's shared-memory plane uses of them. Two forms, chosen by the daemon:
- `HostTier`: one slab in one named segment (0600), mapped by path by every client of
  the daemon's uid. For auth off, where there is one tenant. The kernel commits pages
  as blocks land (or all at once: `prefault`).
- `SpacedHostTier`: one anonymous segment per space (the store's spaces are tenants),
  each a sparse memfd the size of the whole tier, handed to that tenant's clients only.
  Capacity stays one budget with one policy: one best-fit `ExtentAllocator` places every
  block, and a block of space s lives at its offset in s's segment. A slot records its
  space in the high bits of its offset (`SPACE_SHIFT`), decoded wherever the tier
  touches memory, so `Slot` stays three fields.

Memory of a spaced tier stays within its capacity: each page of the address range
belongs to at most one space at a time (`_owner`), and every live byte on a page is of
that space's blocks (`_live` counts them): a block is never placed on a page that holds
another space's live bytes (its start moves to the next page instead). When a block of
space s lands on pages another space t owned (and left empty), t's copy of those pages
is punched out (MADV_REMOVE) first. Moving a page between spaces is costly (the kernel
frees it, then zeroes a new one on first touch, and every client's mapping faults
again), so allocation prefers a space's own pages: the extents it freed itself, then
pages nobody owns, then other spaces' empty pages; and a space that freed memory
recently keeps up to a share of `SLACK_FRACTION` of the tier for its own next blocks,
unless nothing else is left to evict (`allocate(..., reclaim=True)`). With two tenants
taking turns, each put then lands on the pages its own victims left, whichever tenant
the policy evicts first. Capacity is accounted as in `HostTier` (256-byte alignment):
the same blocks fit.

Moving bytes in and out over RPC is a memcpy on the event loop: for host memory a memcpy
of a block is cheaper than the hand-off to a thread, and the loop owns the slab, so no
lock is needed.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from kvstore.core.tier import Slot
from kvstore.tiers.cuda import pin_host_memory
from kvstore.tiers.extents import ExtentAllocator
from kvstore.tiers.segment import Segment
from kvstore.tiers.slab import MappedSlabTier

HOST_ALIGNMENT = 256
PAGE_BYTES = mmap.PAGESIZE
PAGE_SHIFT = PAGE_BYTES.bit_length() - 1
# A slot's offset is (space << SPACE_SHIFT) | offset in that space's segment.
SPACE_SHIFT = 44
OFFSET_MASK = (1 << SPACE_SHIFT) - 1
NOBODY = 0xFFFF  # an owner map entry: the page is in no space's segment
MAX_SPACE = NOBODY - 1
# Up to this fraction of the tier may stay free as spaces' own (see the module
# docstring), shared by the spaces that freed pages in the last SLACK_HOLD_S.
SLACK_FRACTION = 1 / 8
SLACK_HOLD_S = 10.0
# Free extents looked at for one block before the tier answers that it has no room.
SEARCH_EXTENTS = 64
# Extents marked together below this many are marked one by one (`_mark_many`).
MARK_MANY_MIN = 8


def _pages(offset: int, size: int) -> slice:
    """The pages `[offset, offset + size)` touches, as a slice of the page maps."""
    return slice(offset >> PAGE_SHIFT, (offset + size + PAGE_BYTES - 1) >> PAGE_SHIFT)


class HostTier(MappedSlabTier):
    """The host tier in one named segment, mapped by path (auth off)."""

    name = "host"

    def __init__(self, capacity_bytes: int, alignment: int = HOST_ALIGNMENT, shm_dir: str | None = None) -> None:
        super().__init__(capacity_bytes, alignment)
        self.segment = Segment(capacity_bytes, shm_dir)
        self._mem = self.segment.data
        self._pinned = pin_host_memory(self._mem)  # page-locked for HBM DMA when CUDA exists

    def segment_for(self, space: int) -> Segment:
        """The segment holding space `space`'s blocks: here, the one segment."""
        return self.segment

    def client_offsets(self, space: int, offsets: list[int]) -> list[int]:
        """Slot offsets as offsets in the one segment: the same numbers."""
        return offsets

    def prefault(self, stop: threading.Event | None = None) -> bool:
        """Fault the whole segment in now (see `MappedSegment.populate`)."""
        return self.segment.populate(stop)

    def close(self) -> None:
        if self._pinned is not None:
            self._pinned.unpin()
        self.segment.close()

    def describe(self) -> dict[str, str]:
        return {
            "backing": "shared memory",
            "segment": self.segment.path,
            "pinned": "yes" if self._pinned is not None else "no",
            "prefaulted": self.segment.populated,
            "alignment": str(self._extents.alignment),
        }


class SpacedHostTier(MappedSlabTier):
    """The host tier in one anonymous segment per space (auth on: per tenant); see the
    module docstring. Not page-locked: registering a sparse segment with CUDA would
    commit all of it, so HBM copies from and to it are staged by the driver."""

    name = "host"
    spaces = True

    def __init__(self, capacity_bytes: int, alignment: int = HOST_ALIGNMENT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes > OFFSET_MASK:
            raise ValueError(f"a host tier with one segment per tenant holds at most {OFFSET_MASK} bytes")
        if PAGE_BYTES % alignment:
            raise ValueError(f"alignment {alignment} must divide the page size ({PAGE_BYTES})")
        super().__init__(capacity_bytes, alignment)
        self._extents = ExtentAllocator(capacity_bytes, alignment, indexed=True)
        self._clock = clock
        self._segments: dict[int, Segment] = {}
        self._data: dict[int, memoryview] = {}
        pages = -(-self._extents.capacity_bytes // PAGE_BYTES)
        self._owner = np.full(pages, NOBODY, np.uint16)
        # Live bytes on pages a block covers only in part (a page inside a block is that
        # block's alone, and a page inside a free extent holds none).
        self._partial: dict[int, int] = {}
        # Per space: the extents it freed, by size (newest last; checked when taken, as
        # other spaces may have taken the pages since), the free bytes of the pages it
        # owns, and when it last allocated.
        self._freed: dict[int, dict[int, list[int]]] = {}
        self._free_owned: dict[int, int] = {}
        self._active: dict[int, float] = {}
        self.punched_bytes = 0
        self._slack_total = int(self._extents.capacity_bytes * SLACK_FRACTION)

    # -- segments

    def segment_for(self, space: int) -> Segment:
        """Space `space`'s segment, made on first use."""
        seg = self._segments.get(space)
        if seg is None:
            if not 0 <= space <= MAX_SPACE:
                raise ValueError(f"space {space} is out of range [0, {MAX_SPACE}]")
            seg = self._segments[space] = Segment(self.capacity_bytes, anonymous=True)
            self._data[space] = seg.data
            self._free_owned[space] = 0
        return seg

    def prefault(self, stop: threading.Event | None = None) -> bool:
        """Nothing to fault in ahead: each segment gets pages as its blocks land."""
        return False

    @staticmethod
    def space_of(slot: Slot) -> int:
        """The space a slot of this tier is in."""
        return slot.offset >> SPACE_SHIFT

    def client_offsets(self, space: int, offsets: list[int]) -> list[int]:
        """The offsets in `space`'s segment of the leading `offsets` (slot offsets of this
        tier) that lie in `space`; the run stops at the first that does not."""
        out = []
        for off in offsets:
            if off >> SPACE_SHIFT != space:
                break
            out.append(off & OFFSET_MASK)
        return out

    # -- placement

    def allocate(self, nbytes: int, space: int = 0, reclaim: bool = False) -> Slot | None:
        slots = self._allocate_in(nbytes, 1, space, reclaim)
        return slots[0] if slots else None

    def allocate_many(self, nbytes: int, count: int, space: int = 0) -> list[Slot]:
        return self._allocate_in(nbytes, count, space, False)

    def _allocate(self, nbytes: int) -> Slot | None:
        return self.allocate(nbytes)

    def _allocate_in(self, nbytes: int, count: int, space: int, reclaim: bool) -> list[Slot]:
        """Up to `count` slots of `nbytes` in `space`: first extents the space freed, on
        pages it still owns (no page changes hands), then the best fit elsewhere."""
        size = self.accounted_size(nbytes)
        count = min(count, (self.capacity_bytes - self.used_bytes) // size)
        if count <= 0:
            return []
        self.segment_for(space)
        self._active[space] = self._clock()
        offsets = self._take_freed(size, count, space)
        while len(offsets) < count:
            placed = self._place(size, count - len(offsets), space, reclaim)
            if not placed:
                break
            offsets += placed
        if not offsets:
            return []
        if size & (PAGE_BYTES - 1) or any(o & (PAGE_BYTES - 1) for o in offsets):
            self._mark_many(offsets, size, 1)
        size = self._sizes.setdefault(size, size)
        self._account_many(size, len(offsets))
        tag, name = space << SPACE_SHIFT, self.name
        return [Slot(name, tag | o, size) for o in offsets]

    def _free(self, slot: Slot) -> None:
        space, offset, size = slot.offset >> SPACE_SHIFT, slot.offset & OFFSET_MASK, slot.size
        self._extents.free(offset, size)
        if (offset | size) & (PAGE_BYTES - 1):
            self._mark(offset, size, -1)
        self._free_owned[space] += size
        freed = self._freed.setdefault(space, {}).setdefault(size, [])
        freed.append(offset)
        if len(freed) > self._extents.capacity_bytes // size:
            # More than can be valid at once: drop repeats and extents the space lost.
            owner = self._owner
            freed[:] = [o for o in dict.fromkeys(freed) if (owner[_pages(o, size)] == space).all()]

    def _mark(self, offset: int, size: int, sign: int) -> None:
        """Count (`sign` 1) or stop counting (-1) the bytes of `[offset, offset + size)`
        on the pages it covers in part."""
        end = offset + size
        first, last = offset >> PAGE_SHIFT, (end - 1) >> PAGE_SHIFT
        edges = []
        if offset & (PAGE_BYTES - 1):
            edges.append((first, min(end, (first + 1) << PAGE_SHIFT) - offset))
        if end & (PAGE_BYTES - 1) and (last != first or not offset & (PAGE_BYTES - 1)):
            edges.append((last, end - max(offset, last << PAGE_SHIFT)))
        self._count_partial(edges, sign)

    def _count_partial(self, pages: Iterable[tuple[int, int]], sign: int) -> None:
        """Add (`sign` 1) or take away (-1) bytes on pages covered in part: (page, bytes)."""
        partial = self._partial
        for page, n in pages:
            live = partial.get(page, 0) + sign * n
            if live:
                partial[page] = live
            else:
                del partial[page]

    def _mark_many(self, offsets: list[int], size: int, sign: int) -> None:
        """`_mark` of many extents of one size. Extents under a page (small blocks, many
        to a page) are summed per page in array steps first: one count per page changes,
        not one per extent."""
        if size >= PAGE_BYTES or len(offsets) < MARK_MANY_MIN:
            for o in offsets:
                self._mark(o, size, sign)
            return
        # An extent under a page covers each of its one or two pages in part.
        start = np.asarray(offsets, np.int64)
        end = start + size
        first, last = start >> PAGE_SHIFT, (end - 1) >> PAGE_SHIFT
        two = last != first
        pages = np.concatenate([first, last[two]])
        amounts = np.concatenate([np.minimum(end, (first + 1) << PAGE_SHIFT) - start, end[two] - (last[two] << PAGE_SHIFT)])
        touched, at = np.unique(pages, return_inverse=True)
        sums = np.zeros(len(touched), np.int64)
        np.add.at(sums, at, amounts)
        self._count_partial(zip(touched.tolist(), sums.tolist()), sign)

    def _take_freed(self, size: int, count: int, space: int) -> list[int]:
        """Up to `count` extents of `size` that `space` freed, still free and on pages it
        still owns, newest first; contiguous ones are taken in one step."""
        freed = self._freed.get(space, {}).get(size)
        if not freed:
            return []
        picked = sorted(freed[-count:])
        del freed[-count:]
        owner, extents = self._owner, self._extents
        out: list[int] = []
        i = 0
        while i < len(picked):
            j = i + 1
            while j < len(picked) and picked[j] == picked[j - 1] + size:
                j += 1
            run_start, n = picked[i], j - i
            if (owner[_pages(run_start, n * size)] == space).all() and extents.take(run_start, n * size):
                out.extend(range(run_start, run_start + n * size, size))
            elif n > 1:
                out.extend(o for o in picked[i:j] if (owner[_pages(o, size)] == space).all() and extents.take(o, size))
            i = j
        self._free_owned[space] -= size * len(out)
        return out

    def _place(self, size: int, want: int, space: int, reclaim: bool) -> list[int]:
        """Offsets of up to `want` extents of `size` for `space`, cut from the best fit
        among free extents where they share no page with another space's live bytes (at
        the extent's start, or at its first page boundary), landing on other spaces'
        empty pages only where those may go; their pages are the space's now."""
        owner = self._owner
        for start, free_size in self._extents.fits(size, SEARCH_EXTENTS):
            for offset in (start, (start + PAGE_BYTES - 1) & ~(PAGE_BYTES - 1)):
                n = min(want, (start + free_size - offset) // size) if offset <= start + free_size else 0
                if n <= 0 or self._shares_a_page(offset, n * size, space):
                    continue
                pages = owner[_pages(offset, n * size)]
                foreign = (pages != space) & (pages != NOBODY)
                others: list[int] = np.unique(pages[foreign]).tolist() if foreign.any() else []
                if others and not reclaim and not self._may_take(others, size):
                    continue
                taken = self._extents.take(offset, n * size)
                assert taken, "a free extent's part is free"
                if others:
                    held = pages[foreign]
                    for other in others:
                        lost = int(np.count_nonzero(held == other)) << PAGE_SHIFT
                        self._free_owned[other] = max(0, self._free_owned[other] - lost)
                    self._punch(offset >> PAGE_SHIFT, pages, foreign)
                own = int(np.count_nonzero(pages == space)) << PAGE_SHIFT
                if own:
                    self._free_owned[space] = max(0, self._free_owned[space] - min(n * size, own))
                pages[:] = space
                return list(range(offset, offset + n * size, size))
        return []

    def _shares_a_page(self, offset: int, size: int, space: int) -> bool:
        """Whether `[offset, offset + size)` (free) begins or ends on a page that holds live
        bytes of another space: only a page it covers in part can."""
        end = offset + size
        if end > self._extents.capacity_bytes:
            return True
        partial, owner = self._partial, self._owner
        first, last = offset >> PAGE_SHIFT, (end - 1) >> PAGE_SHIFT
        if offset & (PAGE_BYTES - 1) and first in partial and owner[first] != space:
            return True
        return bool(end & (PAGE_BYTES - 1) and last in partial and owner[last] != space)

    def _may_take(self, others: list[int], size: int) -> bool:
        """Whether free pages of `others` may go to another space now: yes while the tier
        has more free than the spaces may keep, or once each of them keeps more than its
        share (or has not allocated for SLACK_HOLD_S)."""
        if self._extents.free_bytes + size > self._slack_total:
            return True
        now = self._clock()
        active = [s for s, at in self._active.items() if now - at < SLACK_HOLD_S]
        share = self._slack_total // max(1, len(active))
        return all(other not in active or self._free_owned.get(other, 0) > share for other in others)

    def _punch(self, first_page: int, pages: np.ndarray, foreign: np.ndarray) -> None:
        """Punch the runs of `pages` (owner entries from `first_page` on) marked `foreign`
        out of their owners' segments."""
        at = np.flatnonzero(foreign)
        owners = pages[at]
        cuts = np.flatnonzero((np.diff(at) != 1) | (np.diff(owners) != 0)) + 1
        for run in np.split(np.arange(len(at)), cuts):
            start, n = first_page + int(at[run[0]]), len(run)
            self._segments[int(owners[run[0]])].punch(start << PAGE_SHIFT, n << PAGE_SHIFT)
            self.punched_bytes += n << PAGE_SHIFT

    # -- bytes

    def _view(self, slot: Slot, nbytes: int) -> memoryview:
        start = slot.offset & OFFSET_MASK
        return self._data[slot.offset >> SPACE_SHIFT][start:start + nbytes]

    async def write(self, slot: Slot, offset: int, data: memoryview | bytes) -> None:
        n = len(data)
        if offset < 0 or offset + n > slot.size:
            raise ValueError(f"write of {n} bytes at {offset} overflows a {slot.size}-byte slot")
        start = (slot.offset & OFFSET_MASK) + offset
        self._data[slot.offset >> SPACE_SHIFT][start:start + n] = data

    async def read(self, slot: Slot, nbytes: int) -> bytes:
        return bytes(self._view(slot, nbytes))

    def view(self, slot: Slot, nbytes: int) -> memoryview | None:
        return self._view(slot, nbytes)

    @property
    def resident_bytes(self) -> int:
        """Memory the segments hold, headers included (at most the capacity plus a page
        per segment, unless a client wrote outside the slots it holds)."""
        return sum(seg.resident_bytes for seg in self._segments.values())

    def close(self) -> None:
        for data in self._data.values():
            data.release()
        self._data.clear()
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()

    def describe(self) -> dict[str, str]:
        return {
            "backing": "shared memory, one anonymous segment per tenant",
            "segments": str(len(self._segments)),
            "resident_bytes": str(self.resident_bytes),
            "kept_free_bytes": str(sum(self._free_owned.values())),
            "moved_bytes": str(self.punched_bytes),
            "pinned": "no",
            "prefaulted": "n/a (pages are faulted in as blocks land)",
            "alignment": str(self._extents.alignment),
        }
