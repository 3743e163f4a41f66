"""The SSD log's regions and their allocation: offsets and live records, never bytes.

A `Region` is one region file's state: its write position, its live records (count,
padded bytes, and the records by offset) and whether it is sealed. `RegionLog` holds
them all, the free list and the open region: `allocate` reserves the next aligned range
of the open region (sealing it and opening a free one when the record does not fit),
`free` makes a record dead, and a sealed region whose records are all dead is reclaimed
to the free list whole (`reclaim`). `resume` picks up after recovery: empty regions are
free, the region that holds the newest record stays open, the others are sealed.

All of it runs on the event loop; the bytes move in `RegionFiles` on the I/O threads.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.core.tier import Slot
from kvstore.tiers.ssd.records import Parsed, align, parsed_of

# One logger for the whole tier, named for its package.
logger = logging.getLogger("kvstore.tiers.ssd")


@dataclass(slots=True)
class Region:
    index: int
    write_pos: int = 0
    live_count: int = 0
    live_bytes: int = 0
    sealed: bool = False
    records: dict[int, Parsed] = field(default_factory=dict)  # live records by offset in region
    # Records recovered at start and not touched since, as columns (see `RegionLog.records`).
    recovered: np.ndarray[Any, Any] | None = None


class RegionLog:
    """`count` regions of `region_size` bytes, records aligned to `alignment`, handing
    out slots of the tier named `tier` (offsets span the regions end to end)."""

    def __init__(self, tier: str, count: int, region_size: int, alignment: int) -> None:
        self.tier = tier
        self.region_size = region_size
        self.alignment = alignment
        self.regions = [Region(i) for i in range(count)]
        self.free_regions: deque[int] = deque(range(count))
        self.open: Region | None = None
        self._sizes: dict[int, int] = {}  # see allocate

    def has_room(self, size: int) -> bool:
        if self.open is not None and self.open.write_pos + size <= self.region_size:
            return True
        return bool(self.free_regions)

    @property
    def dead_bytes(self) -> int:
        return sum(r.write_pos - r.live_bytes for r in self.regions)

    @property
    def occupied_bytes(self) -> int:
        return sum(r.write_pos for r in self.regions)

    def allocate(self, nbytes: int) -> Slot | None:
        size = align(nbytes, self.alignment)
        if size > self.region_size:
            return None
        region = self.open
        if region is None or region.write_pos + size > self.region_size:
            if region is not None:
                self.seal(region)
            if not self.free_regions:
                self.open = None
                return None
            region = self.regions[self.free_regions.popleft()]
            region.write_pos = 0
            region.sealed = False
            self.open = region
        offset = region.write_pos
        region.write_pos += size
        region.live_count += 1
        region.live_bytes += size
        # Aligned sizes are few: one shared int object each, not one per record.
        return Slot(self.tier, region.index * self.region_size + offset, self._sizes.setdefault(size, size))

    def seal(self, region: Region) -> None:
        region.sealed = True
        if region.live_count == 0:
            self.reclaim(region)

    def reclaim(self, region: Region) -> None:
        # The old records stay on disk until overwritten; their sequence numbers are
        # lower than anything written after reuse, so a scan ignores them.
        region.write_pos = 0
        region.sealed = False
        region.records.clear()
        region.recovered = None
        self.free_regions.append(region.index)
        logger.debug("ssd region %d reclaimed", region.index)

    def free(self, slot: Slot) -> None:
        region = self.regions[slot.offset // self.region_size]
        self.records(region).pop(slot.offset % self.region_size, None)
        region.live_count -= 1
        region.live_bytes -= slot.size
        if region.sealed and region.live_count == 0:
            self.reclaim(region)

    def add(self, slot: Slot, record: Parsed) -> None:
        """Make `record`, written at `slot`, known to its region."""
        self.records(self.regions[slot.offset // self.region_size])[slot.offset % self.region_size] = record

    def region_keys(self, slot: Slot) -> list[bytes]:
        """Keys of the live records in `slot`'s region, oldest first."""
        records = self.records(self.regions[slot.offset // self.region_size])
        return [records[o].key for o in sorted(records)]

    def records(self, region: Region) -> dict[int, Parsed]:
        """The region's live records by offset, made from its recovered columns on the
        first change to the region (a region at a time, not a million at start)."""
        if region.recovered is not None:
            base = region.index * self.region_size
            parsed = parsed_of(region.recovered)
            region.recovered = None
            fresh = dict(zip((p.offset - base for p in parsed), parsed))
            fresh.update(region.records)
            region.records = fresh
        return region.records

    def resume(self, newest: int) -> None:
        """Set the free list and the open region from the recovered regions: appends
        continue in region `newest` (-1: none), empty regions are free, the rest sealed."""
        self.free_regions.clear()
        self.open = None
        for region in self.regions:
            if region.live_count == 0:
                region.write_pos = 0
                self.free_regions.append(region.index)
            elif region.index == newest:
                self.open = region
            else:
                region.sealed = True  # full, or left when a record did not fit: drains by eviction
