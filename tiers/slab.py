"""Slab tiers: blocks at aligned offsets of one contiguous region, placed by a best-fit
`ExtentAllocator`. HBM, host and plain memory tiers are all slabs; they differ only in
what the region is (a CUDA tensor, a shared-memory segment, a bytearray) and how bytes
reach it.

`SlabTier` owns placement and accounting; `MappedSlabTier` adds byte movement for
regions this process can address as a memoryview (host and memory): a memcpy on the
event loop, which owns the slab, so no lock is needed.
"""

from __future__ import annotations

from kvstore.core.tier import Slot, Tier
from kvstore.tiers.extents import ExtentAllocator


class SlabTier(Tier):
    def __init__(self, capacity_bytes: int, alignment: int) -> None:
        super().__init__(capacity_bytes)
        self._extents = ExtentAllocator(capacity_bytes, alignment)
        # One int object per distinct slot size, shared by every Slot of that size: an
        # int is 32 bytes, and a tier holds millions of slots of a few sizes.
        self._sizes: dict[int, int] = {}

    def accounted_size(self, nbytes: int) -> int:
        return self._extents.aligned(max(nbytes, 1))

    def has_room(self, nbytes: int) -> bool:
        return self._extents.largest_free >= self.accounted_size(nbytes)

    def _allocate(self, nbytes: int) -> Slot | None:
        offset = self._extents.allocate(nbytes)
        if offset is None:
            return None
        size = self.accounted_size(nbytes)
        return Slot(self.name, offset, self._sizes.setdefault(size, size))

    def allocate_many(self, nbytes: int, count: int, space: int = 0) -> list[Slot]:
        offsets = self._extents.allocate_many(nbytes, count)
        if not offsets:
            return []
        size = self.accounted_size(nbytes)
        size = self._sizes.setdefault(size, size)
        self._account_many(size, len(offsets))
        name = self.name
        return [Slot(name, offset, size) for offset in offsets]

    def _free(self, slot: Slot) -> None:
        self._extents.free(slot.offset, slot.size)


class MappedSlabTier(SlabTier):
    """A slab this process addresses directly through `self._mem`."""

    has_host_view = True
    _mem: memoryview

    async def write(self, slot: Slot, offset: int, data: memoryview | bytes) -> None:
        n = len(data)
        if offset < 0 or offset + n > slot.size:
            raise ValueError(f"write of {n} bytes at {offset} overflows a {slot.size}-byte slot")
        start = slot.offset + offset
        self._mem[start : start + n] = data

    async def read(self, slot: Slot, nbytes: int) -> bytes:
        return bytes(self._mem[slot.offset : slot.offset + nbytes])

    def view(self, slot: Slot, nbytes: int) -> memoryview | None:
        return self._mem[slot.offset : slot.offset + nbytes]
