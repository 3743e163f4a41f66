"""The host tier: one slab of host memory holding blocks at aligned offsets.

The slab lives in a shared-memory `Segment` (0600), so co-located clients can map it and
move bytes with one memcpy; the kernel commits pages only as blocks land in them.
Offsets come from a best-fit `ExtentAllocator`. Moving bytes in and out over RPC is a
memcpy on the event loop: for host memory a memcpy of a block is cheaper than the
hand-off to a thread, and the loop owns the slab, so no lock is needed.
"""

from __future__ import annotations

from kvstore.tiers.base import Slot, Tier
from kvstore.tiers.cuda import pin_host_memory
from kvstore.tiers.extents import ExtentAllocator
from kvstore.tiers.segment import Segment

HOST_ALIGNMENT = 256


class HostTier(Tier):
    name = "host"
    has_host_view = True

    def __init__(self, capacity_bytes: int, alignment: int = HOST_ALIGNMENT, shm_dir: str | None = None) -> None:
        super().__init__(capacity_bytes)
        self._extents = ExtentAllocator(capacity_bytes, alignment)
        self.segment = Segment(capacity_bytes, shm_dir)
        self._mem = self.segment.data
        self._pinned = pin_host_memory(self._mem)  # page-locked for HBM DMA when CUDA exists

    def accounted_size(self, nbytes: int) -> int:
        return self._extents.aligned(max(nbytes, 1))

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
