"""The SSD tier: a log of large regions on a directory (CacheLib Navy style).

Layout. The directory holds `regions` files `region-NNNNN.kvr`, each at most
`region_size` bytes. Blocks are appended to the open region as records, each aligned to
the I/O alignment:

    header (RECORD.size bytes, little-endian): magic "KVR1", codec, itemsize, flags,
    sequence number, key (namespace id + block hash), parent hash, checksum of the
    uncompressed bytes, uncompressed length, payload length, header checksum
    payload (payload length bytes, codec applied), then zero padding to the alignment.

Primitives: `put_block` (encode, reserve the next aligned range of the open region on the
event loop, write it off the loop), `get_block` (read, check the header, decode; the
caller verifies the checksum), `free` (a record becomes dead; a sealed region whose
records are all dead returns to the free list: reclaim is region-level), `recover`
(rebuild the index from the log), `region_keys` (the live keys sharing a victim's
region, so the store can empty a region at once).

Capacity is exact: `regions * region_size` bytes of files at most; `used_bytes` counts
live records (their padded on-disk size), `describe()` also shows dead and occupied bytes.
At least `MIN_REGIONS` (2) regions: with one, every reclaim would empty the tier.

Crash safety. A record is indexed only after its write returned, so nothing half-written
is ever served. At start the log is scanned: a header that does not verify is skipped by
probing the next aligned offsets (so one damaged record does not hide the rest of its
region), a payload that fails its checksum or does not decode is dropped and counted,
and a record whose sequence number is not above its predecessor's in the same region is
left over from the region's previous fill and is ignored. For the same key the highest
sequence number wins. A clean `close` writes `index.snapshot` (records, each region's
write position, the next sequence number); the next start loads it instead of scanning
and deletes it before writing anything, so a snapshot never describes a log it has not
seen (payloads are still verified on every read). A start appends to the region that
holds the newest record, at its write position, with sequence numbers above every header
on disk (the snapshot's count, or the scan's highest, torn and left over headers
included): whatever lies past that position then reads as left over, so a restart costs
no region and the rule above still tells the fills apart.

Geometry. `geometry.json` records the region size, region count, alignment and format
(written atomically, after the region files). A directory keeps its region size and
alignment for life; more regions only add files; fewer, another region size, or an
alignment the I/O mode cannot read are refused (`plan_geometry`), naming the recorded
value. A directory without the file (from before it existed) is judged by its
snapshot's header, else by its region files, and adopted when they agree. The scan
never reads past a region's end.

One daemon per directory: the tier holds an flock on `kvstore.lock` from before it
touches the directory until it closes (`lock_directory`); a second tier is refused with
the holder's pid and host.

I/O. O_DIRECT with page-aligned buffers (anonymous mmaps) where the filesystem accepts
it, detected by a probe write at start; buffered I/O otherwise. The mode is logged and
shown in `describe()`. All file work runs in the tier's own bounded thread pool; the
event loop only reserves offsets and keeps the tables.

Modules, one noun each: `records` (the record header and its in-memory forms), `io`
(the direct I/O probe and the region files), `regions` (regions and their allocation),
`directory` (lock, geometry, open-file limit), `snapshot` (the index snapshot),
`recovery` (the log scan and which record wins), `tier` (`SsdTier`, which composes them).
"""

from __future__ import annotations

from kvstore.tiers.ssd.directory import (
    FD_HEADROOM,
    FORMAT_VERSION,
    GEOMETRY_NAME,
    LOCK_NAME,
    MIN_REGIONS,
    Geometry,
    lock_directory,
    plan_geometry,
    read_geometry,
    reserve_open_files,
    size_text,
    write_geometry,
)
from kvstore.tiers.ssd.io import BUFFERED_ALIGNMENT, DIRECT_ALIGNMENT, IoMode, probe_direct_io
from kvstore.tiers.ssd.records import FLAG_HAS_PARENT, MAGIC, RECORD
from kvstore.tiers.ssd.recovery import RecoveredBlock, RecoveryReport
from kvstore.tiers.ssd.snapshot import SNAPSHOT_MAGIC, SNAPSHOT_NAME, SNAPSHOT_VERSION
from kvstore.tiers.ssd.tier import (
    DEFAULT_REGION_SIZE,
    INLINE_CODEC_BYTES,
    SsdTier,
)

__all__ = [
    "BUFFERED_ALIGNMENT", "DEFAULT_REGION_SIZE", "DIRECT_ALIGNMENT",
    "FD_HEADROOM", "FLAG_HAS_PARENT", "FORMAT_VERSION", "GEOMETRY_NAME", "INLINE_CODEC_BYTES", "LOCK_NAME", "MAGIC",
    "MIN_REGIONS", "RECORD", "SNAPSHOT_MAGIC", "SNAPSHOT_NAME", "SNAPSHOT_VERSION", "Geometry", "IoMode",
    "RecoveredBlock", "RecoveryReport", "SsdTier", "lock_directory", "plan_geometry", "probe_direct_io",
    "read_geometry", "reserve_open_files", "size_text", "write_geometry",
]
