"""The host tier: one slab of host memory holding blocks at aligned offsets.

The slab lives in a shared-memory `Segment` (0600), so co-located clients can map it and
move bytes with one memcpy; the kernel commits pages only as blocks land in them.
Offsets come from a best-fit `ExtentAllocator`. Moving bytes in and out over RPC is a
memcpy on the event loop: for host memory a memcpy of a block is cheaper than the
hand-off to a thread, and the loop owns the slab, so no lock is needed.
"""

from __future__ import annotations

from kvstore.tiers.cuda import pin_host_memory
from kvstore.tiers.segment import Segment
from kvstore.tiers.slab import MappedSlabTier

HOST_ALIGNMENT = 256


class HostTier(MappedSlabTier):
    name = "host"

    def __init__(self, capacity_bytes: int, alignment: int = HOST_ALIGNMENT, shm_dir: str | None = None) -> None:
        super().__init__(capacity_bytes, alignment)
        self.segment = Segment(capacity_bytes, shm_dir)
        self._mem = self.segment.data
        self._pinned = pin_host_memory(self._mem)  # page-locked for HBM DMA when CUDA exists

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
