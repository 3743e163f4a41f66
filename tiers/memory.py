"""The plain memory tier: a bytearray slab with best-fit extents.

Used by tests, and by migration logic on machines without a GPU, in place of the HBM
tier: it is addressable like HBM and host memory but owns no shared or pinned memory.
Copies are memcpys on the event loop (the loop owns the slab, so no lock is needed).
"""

from __future__ import annotations

from kvstore.tiers.slab import MappedSlabTier

MEMORY_ALIGNMENT = 64


class MemoryTier(MappedSlabTier):
    name = "memory"

    def __init__(self, capacity_bytes: int, alignment: int = MEMORY_ALIGNMENT, name: str = "memory") -> None:
        super().__init__(capacity_bytes, alignment)
        self.name = name
        self._buf = bytearray(self._extents.capacity_bytes)
        self._mem = memoryview(self._buf)

    def close(self) -> None:
        self._mem.release()

    def describe(self) -> dict[str, str]:
        return {"backing": "bytearray", "pinned": "no", "alignment": str(self._extents.alignment)}
