"""Recovery of the SSD log at start: what survived, as columns, and which record wins.

Primitives: `scan_region` (the records of one region file that verify, skipping a
damaged header by probing the next aligned offsets and ignoring records left over from
the region's previous fill), `restore` (the winners among the snapshot's or the scan's
records, for the same key the highest sequence number, accounted into their regions),
and `RecoveryReport`, what `SsdTier.recover` hands the store: the recovered blocks as
`REC_DTYPE` columns, no object per block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
import xxhash

from kvstore.core.tier import Slot
from kvstore.tiers.codec import decode
from kvstore.tiers.ssd.records import REC_DTYPE, RECORD, Parsed, parse_header, parsed_of
from kvstore.tiers.ssd.regions import RegionLog

# One logger for the whole tier, named for its package.
logger = logging.getLogger("kvstore.tiers.ssd")


class RecoveredBlock(NamedTuple):
    """A block found in the log at start: what the store needs to index it again."""

    key: bytes
    parent: bytes | None
    checksum: int
    nbytes: int
    itemsize: int
    slot: Slot


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """The recovered blocks as columns (`records`, a `REC_DTYPE` array in offset order:
    position i is block i): a restart indexes a million blocks without an object per
    block. The list views below are built on demand."""

    records: np.ndarray[Any, Any]
    tier: str
    checksum_failures: int
    from_snapshot: bool

    def __len__(self) -> int:
        return len(self.records)

    @property
    def keys(self) -> list[bytes]:
        raw = self.records["key"].tobytes()
        return [raw[i:i + 32] for i in range(0, len(raw), 32)]

    @property
    def parents(self) -> list[bytes | None]:
        return [k[:16] + bytes(p) if has else None
                for k, has, p in zip(self.keys, self.records["has_parent"].tolist(), self.records["parent"].tolist())]

    @property
    def checksums(self) -> list[int]:
        return self.records["checksum"].tolist()  # type: ignore[no-any-return]

    @property
    def nbytes(self) -> list[int]:
        return self.records["raw_len"].tolist()  # type: ignore[no-any-return]

    @property
    def itemsizes(self) -> list[int]:
        return self.records["itemsize"].tolist()  # type: ignore[no-any-return]

    @property
    def slots(self) -> list[Slot]:
        return [Slot(self.tier, o, z) for o, z in zip(self.records["offset"].tolist(), self.records["size"].tolist())]

    @property
    def blocks(self) -> list[RecoveredBlock]:
        """One `RecoveredBlock` per recovered block."""
        return list(map(RecoveredBlock, self.keys, self.parents, self.checksums, self.nbytes, self.itemsizes,
                        self.slots))


_SEQ = attrgetter("seq")
_KEY = attrgetter("key")
_OFFSET = attrgetter("offset")
_SIZE = attrgetter("size")
_PARENT = attrgetter("parent")
_CHECKSUM = attrgetter("checksum")
_RAW_LEN = attrgetter("raw_len")
_ITEMSIZE = attrgetter("itemsize")


def _records_of(parsed: list[Parsed]) -> np.ndarray[Any, Any]:
    """`Parsed` records (a log scan's) as a `REC_DTYPE` array, a field at a time."""
    n = len(parsed)
    rec = np.zeros(n, REC_DTYPE)
    if not n:
        return rec
    for name, get in (("offset", _OFFSET), ("size", _SIZE), ("seq", _SEQ), ("itemsize", _ITEMSIZE),
                      ("checksum", _CHECKSUM), ("raw_len", _RAW_LEN)):
        rec[name] = np.fromiter(map(get, parsed), rec.dtype[name], n)
    rec["key"] = np.frombuffer(b"".join(map(_KEY, parsed)), "V32")
    parents = list(map(_PARENT, parsed))
    rec["has_parent"] = np.fromiter((p is not None for p in parents), np.uint8, n)
    none = bytes(16)
    rec["parent"] = np.frombuffer(b"".join([p[16:] if p is not None else none for p in parents]), "V16")
    return rec


def _distinct_keys(records: np.ndarray[Any, Any]) -> bool:
    """No key twice among `records` (a sort of one 64-bit mix per key; equal mixes are
    then compared in full)."""
    n = len(records)
    if n < 2:
        return True
    w = np.ascontiguousarray(records["key"]).view("<u8").reshape(n, 4)
    mix = w[:, 0] ^ (w[:, 1] * np.uint64(0x9E3779B97F4A7C15)) ^ w[:, 2] ^ (w[:, 3] * np.uint64(0xC2B2AE3D27D4EB4F))
    order = np.argsort(mix, kind="stable")
    same = np.flatnonzero(mix[order][1:] == mix[order][:-1])
    if not len(same):
        return True
    keys = records["key"]
    return not any(keys[order[i]] == keys[order[i + 1]] for i in same.tolist())


def scan_region(path: str, index: int, region_size: int, alignment: int) -> tuple[list[Parsed], int, int]:
    """Records of region file `path` (region `index`) that verify, how many did not, and
    the highest sequence number of any header in the file (torn and left over ones
    included)."""
    try:
        with open(path, "rb") as fh:
            # Never past the region's end: nothing there could be read back.
            data = fh.read(region_size)
    except FileNotFoundError:
        return [], 0, 0
    out: list[Parsed] = []
    failures = 0
    top_seq = 0
    base = index * region_size
    pos, last_seq, step = 0, 0, alignment
    damaged_at = -1  # start of an unreadable stretch since the last good header
    while pos + RECORD.size <= len(data):
        head = parse_header(memoryview(data)[pos : pos + RECORD.size], base + pos, alignment)
        if head is None:
            if damaged_at < 0 and any(data[pos : pos + RECORD.size]):
                # Not a header: a damaged header, or stale or torn bytes. Probe the
                # next aligned offset rather than give up on the rest of the region.
                damaged_at = pos
            pos += step
            continue
        top_seq = max(top_seq, head.seq)
        if head.seq <= last_seq:
            pos += step  # left over from this region's previous fill
            continue
        if damaged_at >= 0:
            # Unreadable bytes between two records of this fill: a record whose header
            # was damaged (or a write a crash cut off). Past the fill's last record the
            # same bytes are only stale, and no later record of this fill follows them.
            failures += 1
            logger.warning("ssd region %d offset %d: unreadable record header; skipped to offset %d",
                           index, damaged_at, pos)
            damaged_at = -1
        end = pos + RECORD.size + head.payload_len
        ok = end <= len(data) and head.raw_len < (1 << 31)
        if ok:
            try:
                raw = decode(head.codec, memoryview(data)[pos + RECORD.size : end], head.itemsize, head.raw_len)
                ok = xxhash.xxh3_64_intdigest(raw) == head.checksum
            except ValueError:
                ok = False
        if ok:
            out.append(head)
        else:
            failures += 1
            logger.warning("ssd region %d offset %d: record failed verification; dropped", index, pos)
        last_seq = head.seq
        pos += head.size
    return out, failures, top_seq


def restore(log: RegionLog, snap: np.ndarray[Any, Any] | None, parsed: list[Parsed],
            positions: list[int]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int]:
    """Account the winning records into `log`'s regions: those of the snapshot `snap`
    (with its region write `positions`), else those a scan found (`parsed`). The winners
    as `REC_DTYPE` columns in offset order, their offsets, and their bytes on disk."""
    regions, region_size = log.regions, log.region_size
    if snap is not None and not _distinct_keys(snap):
        parsed = parsed_of(snap)  # a key written twice: the newest record wins, below
        snap = None
    if snap is not None:
        # Every key once, in offset order: the records are the winners as they are.
        records = snap
        offsets = records["offset"].astype(np.int64)
        if len(offsets) > 1 and not np.all(offsets[1:] > offsets[:-1]):
            order = np.argsort(offsets, kind="stable")
            records, offsets = records[order], offsets[order]
    else:
        best = dict(zip(map(_KEY, parsed), parsed))
        if len(best) == len(parsed):
            # Every key once (a log unless a key was written again): every record is a
            # winner and the seq order is not needed.
            winners = sorted(parsed, key=_OFFSET)
        else:
            # For the same key the highest sequence number wins: sorted by seq, later wins.
            by_seq = sorted(parsed, key=_SEQ)
            best = dict(zip(map(_KEY, by_seq), by_seq))
            winners = sorted(best.values(), key=_OFFSET)
            for p in parsed:  # every record found, winner or not, occupies its region up to its end
                region = regions[p.offset // region_size]
                end = p.offset % region_size + p.size
                if end > region.write_pos:
                    region.write_pos = end
        records = _records_of(winners)
        offsets = records["offset"].astype(np.int64)
    # Per-region accounting on whole columns; each region keeps its run of records as
    # columns until something changes in it.
    sizes = records["size"].astype(np.int64)
    used = int(sizes.sum())
    which = offsets // region_size
    bounds = np.searchsorted(which, np.arange(len(regions) + 1))
    for region, lo, hi in zip(regions, bounds[:-1].tolist(), bounds[1:].tolist()):
        if region.index < len(positions):
            region.write_pos = positions[region.index]  # dead records at its end included
        if hi == lo:
            continue
        region.live_count += hi - lo
        region.live_bytes += int(sizes[lo:hi].sum())
        region.write_pos = max(region.write_pos, int(offsets[hi - 1] + sizes[hi - 1]) - region.index * region_size)
        if region.records:
            region.records.update((p.offset % region_size, p) for p in parsed_of(records[lo:hi]))
        else:
            region.recovered = records[lo:hi]
    return records, offsets, used
