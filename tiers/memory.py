"""The plain memory tier: a bytearray slab with best-fit extents.

Used by tests, and by migration logic on machines without a GPU, in place of the HBM
tier: it is addressable like HBM and host memory but owns no shared or pinned memory.
Copies are memcpys on the event loop (the loop owns the slab, so no lock is needed).
"""

from __future__ import annotations

from kvstore.tiers.base import Slot, Tier
from kvstore.tiers.extents import ExtentAllocator

MEMORY_ALIGNMENT = 64


class MemoryTier(Tier):
    name = "memory"
    has_host_view = True

    def __init__(self, capacity_bytes: int, alignment: int = MEMORY_ALIGNMENT, name: str = "memory") -> None:
        super().__init__(capacity_bytes)
        self.name = name
        self._extents = ExtentAllocator(capacity_bytes, alignment)
        self._buf = bytearray(self._extents.capacity_bytes)
        self._mem = memoryview(self._buf)

    def accounted_size(self, nbytes: int) -> int:
        return self._extents.aligned(max(nbytes, 1))

    def has_room(self, nbytes: int) -> bool:
        return self._extents.largest_free >= self.accounted_size(nbytes)

    def _allocate(self, nbytes: int) -> Slot | None:
        offset = self._extents.allocate(nbytes)
        if offset is None:
            return None
        return Slot(self.name, offset, self._extents.aligned(max(nbytes, 1)))

    def _free(self, slot: Slot) -> None:
        self._extents.free(slot.offset, slot.size)

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

    def close(self) -> None:
        self._mem.release()

    def describe(self) -> dict[str, str]:
        return {"backing": "bytearray", "pinned": "no", "alignment": str(self._extents.alignment)}
