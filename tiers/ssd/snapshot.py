"""The SSD log's index snapshot: `index.snapshot`, written on a clean close, read at start.

The snapshot is binary: a header (`SNAP_HEAD`: magic, version, region size, alignment,
regions, records, next sequence number), each region's write position, fixed-size
records (`SNAP_REC` rows), and an XXH3-64 of all before it. Loading a million records is
one struct pass, not a JSON parse with hex decoding.

Primitives: `load_snapshot` (its records as `REC_DTYPE` columns, the next sequence
number and the write positions; None, and the log is scanned, when it is missing,
damaged or of another geometry; the file is deleted once read, before the log changes,
so a snapshot never describes a log it has not seen) and `write_snapshot` (atomically:
a temp file, fsync, rename).
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Any

import numpy as np
import xxhash

from kvstore.tiers.ssd.records import REC_DTYPE, SNAP_REC
from kvstore.tiers.ssd.regions import RegionLog

# One logger for the whole tier, named for its package.
logger = logging.getLogger("kvstore.tiers.ssd")

SNAPSHOT_NAME = "index.snapshot"
SNAPSHOT_VERSION = 3
SNAPSHOT_MAGIC = b"KVSNAP\x00\x03"
# magic, version, region size, alignment, regions, records, next sequence number
SNAP_HEAD = struct.Struct("<8sIQIIQQ")
# The geometry at the head of every snapshot version: magic, version, region size,
# alignment, regions.
SNAP_GEOMETRY = struct.Struct("<8sIQII")
SNAP_SUM = struct.Struct("<Q")
SNAP_POS = struct.Struct("<Q")  # a region's write position


def snapshot_path(directory: str) -> str:
    return os.path.join(directory, SNAPSHOT_NAME)


def load_snapshot(directory: str, log: RegionLog) -> tuple[np.ndarray[Any, Any], int, list[int]] | None:
    """The snapshot's records, next sequence number and region write positions."""
    path = snapshot_path(directory)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("ssd snapshot %s unreadable (%s); scanning the log instead", path, exc)
        if not os.path.isdir(path):  # a directory in its place is the operator's, not ours
            os.unlink(path)
        return None
    # From here on the log changes; a stale snapshot must never be read again.
    os.unlink(path)
    head_end = SNAP_HEAD.size
    if len(data) < head_end + SNAP_SUM.size or data[:8] != SNAPSHOT_MAGIC:
        logger.warning("ssd snapshot %s is not a snapshot of this version; scanning the log instead", path)
        return None
    (want,) = SNAP_SUM.unpack_from(data, len(data) - SNAP_SUM.size)
    body = memoryview(data)[: len(data) - SNAP_SUM.size]
    if xxhash.xxh3_64_intdigest(body) != want:
        logger.warning("ssd snapshot %s fails its checksum; scanning the log instead", path)
        return None
    _, version, region_size, alignment, regions, count, next_seq = SNAP_HEAD.unpack_from(body, 0)
    if version != SNAPSHOT_VERSION or region_size != log.region_size or alignment != log.alignment or \
            regions > len(log.regions):  # more regions than then: they are only added
        logger.info("ssd snapshot was written with another geometry; scanning the log instead")
        return None
    records_at = head_end + regions * SNAP_POS.size
    if len(body) - records_at != count * SNAP_REC.size:
        logger.warning("ssd snapshot %s malformed (%d records announced); scanning the log instead", path, count)
        return None
    positions = [p for (p,) in SNAP_POS.iter_unpack(body[head_end:records_at])]
    if any(p > region_size for p in positions):
        logger.warning("ssd snapshot %s malformed (a region position past its end); scanning the log instead",
                       path)
        return None
    return np.frombuffer(body[records_at:], REC_DTYPE).copy(), next_seq, positions


def write_snapshot(directory: str, log: RegionLog, next_seq: int) -> None:
    """Describe the live records for a fast start; written last on a clean close."""
    pack = SNAP_REC.pack
    none = bytes(16)
    parts: list[bytes] = []
    count = 0
    for region in log.regions:
        if region.recovered is not None:  # untouched since the start: its columns as they are
            parts.append(region.recovered.tobytes())
            count += len(region.recovered)
        parts.extend(
            pack(p.offset, p.size, p.seq, p.itemsize, p.parent is not None, p.key,
                 p.parent[16:] if p.parent is not None else none, p.checksum, p.raw_len)
            for p in region.records.values()
        )
        count += len(region.records)
    head = SNAP_HEAD.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, log.region_size, log.alignment,
                          len(log.regions), count, next_seq)
    positions = b"".join(SNAP_POS.pack(r.write_pos) for r in log.regions)
    body = b"".join([head, positions, *parts])
    tmp = snapshot_path(directory) + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(body)
        fh.write(SNAP_SUM.pack(xxhash.xxh3_64_intdigest(body)))
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.replace(tmp, snapshot_path(directory))
    except OSError:
        os.unlink(tmp)
        raise
