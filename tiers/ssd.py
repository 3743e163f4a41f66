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
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import mmap
import os
import resource
import socket
import struct
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
import xxhash

from kvstore.core.tier import BlockMeta, Slot, Tier
from kvstore.errors import ConfigError, DataLoss
from kvstore.tiers.codec import Codec, Encoded, decode, encode

logger = logging.getLogger(__name__)

MAGIC = b"KVR1"
# magic, codec, itemsize, flags, seq, key, parent hash, checksum, raw_len, payload_len
_BODY = struct.Struct("<4sBBHQ32s16sQII")
RECORD = struct.Struct("<4sBBHQ32s16sQIIQ")  # _BODY + header checksum
FLAG_HAS_PARENT = 1
DIRECT_ALIGNMENT = 4096
BUFFERED_ALIGNMENT = 512
DEFAULT_REGION_SIZE = 64 << 20
SNAPSHOT_NAME = "index.snapshot"
LOCK_NAME = "kvstore.lock"
GEOMETRY_NAME = "geometry.json"
# The on-disk format the geometry file records: records of RECORD with magic KVR1 in
# region files of the recorded size. A directory of a later format is refused.
FORMAT_VERSION = 1
# With one region, every reclaim would empty the whole tier (reclaim is region-level).
MIN_REGIONS = 2
# Open files the rest of the daemon may need next to one per region (sockets, segments).
FD_HEADROOM = 256
SNAPSHOT_VERSION = 3
# The snapshot is binary: a header, each region's write position, fixed-size records,
# and an XXH3-64 of all before it. Loading a million records is one struct pass, not a
# JSON parse with hex decoding.
SNAPSHOT_MAGIC = b"KVSNAP\x00\x03"
# magic, version, region size, alignment, regions, records, next sequence number
_SNAP_HEAD = struct.Struct("<8sIQIIQQ")
# The geometry at the head of every snapshot version: magic, version, region size,
# alignment, regions.
_SNAP_GEOMETRY = struct.Struct("<8sIQII")
# offset, size, seq, itemsize, has parent, key, parent hash, checksum, raw_len
_SNAP_REC = struct.Struct("<QIQBB32s16sQI")
# The same record as numpy columns: a snapshot loads as one array, without a Python
# object per record, and recovered records stay in that form until a region changes.
_REC_DTYPE = np.dtype([("offset", "<u8"), ("size", "<u4"), ("seq", "<u8"), ("itemsize", "u1"),
                       ("has_parent", "u1"), ("key", "V32"), ("parent", "V16"), ("checksum", "<u8"),
                       ("raw_len", "<u4")])
assert _REC_DTYPE.itemsize == _SNAP_REC.size
_SNAP_SUM = struct.Struct("<Q")
_SNAP_POS = struct.Struct("<Q")  # a region's write position
# Encoding blocks smaller than this inline costs less than the thread hand-off.
INLINE_CODEC_BYTES = 64 * 1024
# After this many blocks of a namespace in a row did not compress, only every
# CODEC_PROBE_EVERY-th block of it is tried: fp16 KV never pays, and trying costs as much
# CPU as the write itself. One success resets the count.
CODEC_GIVE_UP_AFTER = 8
CODEC_PROBE_EVERY = 16


class IoMode:
    DIRECT = "direct"
    BUFFERED = "buffered"


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
    """The recovered blocks as columns (`records`, a `_REC_DTYPE` array in offset order:
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


def _records_of(parsed: list[_Parsed]) -> np.ndarray[Any, Any]:
    """`_Parsed` records (a log scan's) as a `_REC_DTYPE` array, a field at a time."""
    n = len(parsed)
    rec = np.zeros(n, _REC_DTYPE)
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


def _parsed_of(records: np.ndarray[Any, Any]) -> list[_Parsed]:
    new, parsed_type = tuple.__new__, _Parsed
    return [
        new(parsed_type, (offset, size, seq, 0, itemsize, key, key[:16] + parent if has_parent else None, csum,
                          raw_len, 0))
        for offset, size, seq, itemsize, has_parent, key, parent, csum, raw_len
        in _SNAP_REC.iter_unpack(records.tobytes())
    ]


@dataclass(slots=True)
class _Region:
    index: int
    write_pos: int = 0
    live_count: int = 0
    live_bytes: int = 0
    sealed: bool = False
    records: dict[int, _Parsed] = field(default_factory=dict)  # live records by offset in region
    # Records recovered at start and not touched since, as columns (see `SsdTier._records`).
    recovered: np.ndarray[Any, Any] | None = None


class _Parsed(NamedTuple):
    offset: int
    size: int
    seq: int
    codec: int
    itemsize: int
    key: bytes
    parent: bytes | None
    checksum: int
    raw_len: int
    payload_len: int


def _aligned_buffer(n: int) -> mmap.mmap:
    """A page-aligned, zero-filled buffer of `n` bytes (O_DIRECT needs aligned memory)."""
    return mmap.mmap(-1, max(n, mmap.PAGESIZE))


_SEQ = attrgetter("seq")
_KEY = attrgetter("key")
_OFFSET = attrgetter("offset")
_SIZE = attrgetter("size")
_PARENT = attrgetter("parent")
_CHECKSUM = attrgetter("checksum")
_RAW_LEN = attrgetter("raw_len")
_ITEMSIZE = attrgetter("itemsize")


def _parse_header(buf: bytes | memoryview, offset: int, alignment: int) -> _Parsed | None:
    if len(buf) < RECORD.size:
        return None
    fields = RECORD.unpack_from(buf, 0)
    magic, codec, itemsize, flags, seq, key, parent, csum, raw_len, payload_len, hcsum = fields
    if magic != MAGIC or xxhash.xxh3_64_intdigest(bytes(buf[: _BODY.size])) != hcsum:
        return None
    size = _align(RECORD.size + payload_len, alignment)
    parent_key = key[:16] + parent if flags & FLAG_HAS_PARENT else None
    return _Parsed(offset, size, seq, codec, itemsize, key, parent_key, csum, raw_len, payload_len)


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def probe_direct_io(directory: str) -> bool:
    """Whether files in `directory` accept O_DIRECT writes of aligned buffers."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = os.path.join(directory, ".direct-probe")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flag, 0o600)
    except OSError:
        return False
    buf = _aligned_buffer(DIRECT_ALIGNMENT)
    try:
        os.pwrite(fd, buf, 0)
        return True
    except OSError:
        return False
    finally:
        buf.close()
        os.close(fd)
        os.unlink(path)


def size_text(n: int) -> str:
    """`n` bytes as a size the flags accept back exactly: 512KiB, 64MiB, 1000B."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


@dataclass(frozen=True, slots=True)
class Geometry:
    """How a directory's region log is laid out; recorded in `GEOMETRY_NAME`."""

    region_size: int
    regions: int
    alignment: int
    format: int = FORMAT_VERSION

    @property
    def capacity_bytes(self) -> int:
        return self.region_size * self.regions


def read_geometry(path: str) -> Geometry | None:
    """The geometry recorded in directory `path`; None when it records none."""
    file = os.path.join(path, GEOMETRY_NAME)
    try:
        with open(file, "rb") as fh:
            doc = json.loads(fh.read())
        fields = {k: doc[k] for k in ("region_size", "regions", "alignment", "format")}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"the SSD geometry file {file} is unreadable ({exc}); restore it, or empty {path} "
                          "to start over (its blocks are lost)") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in fields.values()):
        raise ConfigError(f"the SSD geometry file {file} holds {fields}, not positive whole numbers; restore it, "
                          f"or empty {path} to start over (its blocks are lost)")
    return Geometry(**fields)


def write_geometry(path: str, geometry: Geometry) -> None:
    """Record `geometry` in directory `path` atomically: a temp file, fsync, rename, and
    an fsync of the directory, so a crash leaves the old file or the new one."""
    file = os.path.join(path, GEOMETRY_NAME)
    tmp = file + ".tmp"
    doc = {"format": geometry.format, "region_size": geometry.region_size, "regions": geometry.regions,
           "alignment": geometry.alignment}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(json.dumps(doc, indent=1).encode() + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, file)
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _unrecorded_geometry(path: str) -> tuple[Geometry | None, int, int]:
    """What a directory without a geometry file shows of its layout (one written before
    the file existed): the geometry in its snapshot's header, if it has a snapshot that
    verifies, the number of region files up to the last that holds anything, and the
    size of the largest."""
    snapshot: Geometry | None = None
    try:
        with open(os.path.join(path, SNAPSHOT_NAME), "rb") as fh:
            data = fh.read()
    except OSError:
        data = b""
    head = _SNAP_GEOMETRY.size
    if len(data) >= head + _SNAP_SUM.size and data[:7] == SNAPSHOT_MAGIC[:7]:
        (want,) = _SNAP_SUM.unpack_from(data, len(data) - _SNAP_SUM.size)
        if xxhash.xxh3_64_intdigest(memoryview(data)[: len(data) - _SNAP_SUM.size]) == want:
            _, _, region_size, alignment, regions = _SNAP_GEOMETRY.unpack_from(data, 0)
            snapshot = Geometry(region_size, regions, alignment)
    files = largest = 0
    with os.scandir(path) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith("region-") and name.endswith(".kvr") and name[7:-4].isdigit():
                size = entry.stat().st_size
                if size:  # an empty file holds no blocks, whatever the settings
                    files = max(files, int(name[7:-4]) + 1)
                    largest = max(largest, size)
    return snapshot, files, largest


def plan_geometry(path: str, capacity_bytes: int, region_size: int, io_mode: str) -> tuple[Geometry, bool, bool]:
    """The geometry to open directory `path` with, whether to use O_DIRECT, and whether
    the geometry must be recorded (new, adopted or grown). ConfigError when the settings
    do not fit what the directory holds.

    A directory keeps its region size and alignment for its life: records sit at offsets
    and in files of that size, and another size would read them at the wrong places. More
    regions only add files. Fewer would lose the blocks of the others, so they are
    refused, as is any change that cannot be read: the operator chooses to empty the
    directory. A directory without a geometry file (written before it existed) is judged
    by its snapshot's header, else by its files: more files than regions, or a file
    larger than a region, is refused; otherwise it is adopted with the settings.
    """
    stored = recorded = read_geometry(path)
    files = largest = 0
    if recorded is None:
        recorded, files, largest = _unrecorded_geometry(path)
        if recorded is not None:
            logger.info("ssd directory %s has no %s; its snapshot shows %d regions of %d bytes", path,
                        GEOMETRY_NAME, recorded.regions, recorded.region_size)
    if recorded is not None and recorded.format > FORMAT_VERSION:
        raise ConfigError(f"SSD directory {path} is in format {recorded.format}, written by a newer kvstore (this one "
                          f"reads format {FORMAT_VERSION}); run that version, or empty {path} to start over")
    if recorded is None or recorded.alignment == DIRECT_ALIGNMENT:
        direct = probe_direct_io(path) if io_mode != IoMode.BUFFERED else False
        if io_mode == IoMode.DIRECT and not direct:
            raise ConfigError(f"the filesystem of {path} does not support O_DIRECT; use --ssd-io auto or buffered")
        # Buffered I/O reads records at any alignment: a directory written with O_DIRECT
        # keeps its 4096-byte records when the mode changes.
        alignment = recorded.alignment if recorded is not None else DIRECT_ALIGNMENT if direct else BUFFERED_ALIGNMENT
    elif recorded.alignment == BUFFERED_ALIGNMENT:
        if io_mode == IoMode.DIRECT:
            raise ConfigError(f"SSD directory {path} was written with buffered I/O ({BUFFERED_ALIGNMENT}-byte "
                              "records), which O_DIRECT cannot read; use --ssd-io auto or buffered, or empty "
                              f"{path} to start over (its blocks are lost)")
        direct, alignment = False, BUFFERED_ALIGNMENT
        if io_mode == "auto":
            logger.info("ssd directory %s was written with buffered I/O; it stays buffered", path)
    else:
        raise ConfigError(f"SSD directory {path} records an alignment of {recorded.alignment} bytes, which this "
                          f"kvstore does not write; empty {path} to start over")
    configured = region_size
    region_size = region_size // alignment * alignment
    if region_size < alignment:
        raise ConfigError(f"ssd_region_size {configured} is below the {alignment}-byte I/O alignment; "
                          "raise --ssd-region-size")
    regions = capacity_bytes // region_size
    if regions < MIN_REGIONS:
        most = capacity_bytes // MIN_REGIONS // alignment * alignment
        raise ConfigError(
            f"ssd_capacity {size_text(capacity_bytes)} holds {regions} region(s) of ssd_region_size "
            f"{size_text(region_size)}, and the SSD tier needs at least {MIN_REGIONS} regions: it reclaims "
            "a whole region at a time, so with one region every reclaim would empty it; raise "
            f"--ssd-capacity to at least {size_text(MIN_REGIONS * region_size)} or lower "
            f"--ssd-region-size to at most {size_text(most)}"
        )
    if recorded is not None:
        if region_size != recorded.region_size:
            raise ConfigError(
                f"ssd_region_size {size_text(configured)} differs from the {size_text(recorded.region_size)} "
                f"regions SSD directory {path} was written with, whose records would be read at the wrong "
                f"places; use --ssd-region-size {size_text(recorded.region_size)} as recorded, or empty {path} "
                "to start over with the new size (its blocks are lost)"
            )
        files = recorded.regions
    elif largest > region_size:
        raise ConfigError(
            f"ssd_region_size {size_text(configured)} is smaller than the regions of SSD directory {path} "
            f"(a region file there holds {size_text(largest)}; it was written before the directory recorded its "
            f"geometry): use the --ssd-region-size it was written with (at least {size_text(largest)}), or "
            f"empty {path} to start over (its blocks are lost)"
        )
    if regions < files:
        held = size_text(files * region_size)
        raise ConfigError(
            f"ssd_capacity {size_text(capacity_bytes)} is {regions} regions of {size_text(region_size)}, fewer "
            f"than the {files} regions ({held}) SSD directory {path} holds, whose blocks would be lost; use "
            f"--ssd-capacity {held} or more, or empty {path} to start smaller (its blocks are lost)"
        )
    geometry = Geometry(region_size, regions, alignment)
    if stored is not None and regions > stored.regions:
        logger.info("ssd directory %s grows from %d to %d regions", path, stored.regions, regions)
    return geometry, direct, geometry != stored


def reserve_open_files(geometry: Geometry, capacity_bytes: int) -> None:
    """Make sure the process may open a file per region and `FD_HEADROOM` more: raise
    the soft limit towards the hard one if needed, else refuse before any file is made."""
    want = geometry.regions + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    if hard == resource.RLIM_INFINITY or hard >= want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        logger.info("open-file limit raised from %d to %d for %d ssd regions", soft, want, geometry.regions)
        return
    fit = max(hard - FD_HEADROOM, MIN_REGIONS)
    least = geometry.region_size
    while capacity_bytes // least > fit:
        least *= 2
    raise ConfigError(
        f"ssd_capacity {size_text(capacity_bytes)} in regions of ssd_region_size {size_text(geometry.region_size)} "
        f"is {geometry.regions} regions, each an open file, but this process may have only {hard} open files "
        f"(ulimit -n); raise --ssd-region-size to {size_text(least)} or more, or the open-file limit to at least "
        f"{want} (ulimit -n, LimitNOFILE= in systemd)"
    )


def lock_directory(path: str) -> int:
    """Take the exclusive lock of the SSD directory `path`; the lock file's descriptor.

    An flock on `LOCK_NAME`, held for as long as the descriptor is open: it ends with
    `close` or with the process, so a daemon killed with -9 leaves no stale lock (the
    pid it wrote stays, but nobody holds the lock). flock rather than fcntl's record
    locks: those belong to the process, so a second tier in the same process would get
    the lock too, and closing any descriptor of the file would drop it. The file is
    never unlinked: a daemon that opened it just before the unlink would lock an inode
    that the next daemon no longer finds, and both would hold "the" lock.
    """
    lock_path = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot open the SSD lock file {lock_path}: {exc.strerror}; "
                          "fix --ssd-path or its permissions") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _lock_holder(fd)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise ConfigError(
                f"SSD directory {path} is in use by another kvstore daemon ({holder}): two daemons on one "
                "directory would overwrite each other's records; stop that daemon first, or give this one "
                "its own --ssd-path"
            ) from None
        raise ConfigError(f"cannot lock {lock_path}: {exc.strerror}; --ssd-path must be on a filesystem "
                          "with file locks (a local disk)") from None
    try:
        # Who holds it, for the message of the daemon that is refused. A daemon refused
        # between the lock and this write reads an empty file ("holder unknown").
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\nhost {socket.gethostname()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"cannot write the SSD lock file {lock_path}: {exc.strerror}; "
                          "fix --ssd-path or its permissions") from None
    return fd


def _lock_holder(fd: int) -> str:
    """The holder a lock file names: "pid N on host H"."""
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        text = ""
    fields = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
    if "pid" not in fields:
        return "holder unknown"
    return f"pid {fields['pid']} on host {fields.get('host', 'unknown')}"


class SsdTier(Tier):
    name = "ssd"
    addressable = False
    inclusive = True

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        *,
        region_size: int = DEFAULT_REGION_SIZE,
        io_mode: str = "auto",
        io_threads: int = 4,
        compress: bool = True,
    ) -> None:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create SSD directory {path}: {exc.strerror}; fix --ssd-path") from None
        if not os.access(path, os.W_OK):
            raise ConfigError(f"SSD directory {path} is not writable; fix --ssd-path or its permissions")
        if io_mode not in ("auto", IoMode.DIRECT, IoMode.BUFFERED):
            raise ConfigError(f"ssd io mode must be auto, direct or buffered, got {io_mode!r}")
        # Before anything in the directory is read or written: it may be another daemon's.
        self._lock_fd = lock_directory(path)
        self._fds: list[int] = []
        try:
            geometry, direct, record = plan_geometry(path, capacity_bytes, region_size, io_mode)
            reserve_open_files(geometry, capacity_bytes)
            self.io_mode = IoMode.DIRECT if direct else IoMode.BUFFERED
            self.alignment = geometry.alignment
            region_size, regions = geometry.region_size, geometry.regions
            super().__init__(geometry.capacity_bytes)
            self.path = path
            self.region_size = region_size
            self.compress = compress
            self._regions = [_Region(i) for i in range(regions)]
            self._free_regions: deque[int] = deque(range(regions))
            self._open: _Region | None = None
            self._next_seq = 1
            flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if direct else 0)
            for i in range(regions):
                self._fds.append(os.open(self._region_path(i), flags, 0o600))
            if record:
                # After the region files exist: a crash before this leaves files that
                # agree with the settings, which the next start adopts.
                write_geometry(path, geometry)
        except BaseException:
            for fd in self._fds:
                os.close(fd)
            os.close(self._lock_fd)
            raise
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-ssd")
        # One aligned buffer per I/O thread, grown on demand: mapping and faulting in a
        # fresh buffer per record cost as much as the copy itself.
        self._local = threading.local()
        self._closed = False
        self.bytes_written = 0
        self.bytes_read = 0
        self.compressed_blocks = 0
        self.codec_attempts = 0
        self._codec_misses: dict[bytes, int] = {}  # namespace id -> blocks in a row not compressed
        self._sizes: dict[int, int] = {}  # see _allocate
        logger.info("ssd tier at %s: %d regions of %d bytes, %s I/O", path, regions, region_size, self.io_mode)

    def _region_path(self, index: int) -> str:
        return os.path.join(self.path, f"region-{index:05d}.kvr")

    # ------------------------------------------------------------- accounting

    def accounted_size(self, nbytes: int) -> int:
        """Upper bound of a record's size: compression only ever makes it smaller."""
        return _align(RECORD.size + nbytes, self.alignment)

    def fits(self, nbytes: int) -> bool:
        return self.accounted_size(nbytes) <= self.region_size

    def has_room(self, nbytes: int) -> bool:
        size = self.accounted_size(nbytes)
        if self._open is not None and self._open.write_pos + size <= self.region_size:
            return True
        return bool(self._free_regions)

    @property
    def dead_bytes(self) -> int:
        return sum(r.write_pos - r.live_bytes for r in self._regions)

    @property
    def occupied_bytes(self) -> int:
        return sum(r.write_pos for r in self._regions)

    def _allocate(self, nbytes: int) -> Slot | None:
        size = _align(nbytes, self.alignment)
        if size > self.region_size:
            return None
        region = self._open
        if region is None or region.write_pos + size > self.region_size:
            if region is not None:
                self._seal(region)
            if not self._free_regions:
                self._open = None
                return None
            region = self._regions[self._free_regions.popleft()]
            region.write_pos = 0
            region.sealed = False
            self._open = region
        offset = region.write_pos
        region.write_pos += size
        region.live_count += 1
        region.live_bytes += size
        # Aligned sizes are few: one shared int object each, not one per record.
        return Slot(self.name, region.index * self.region_size + offset, self._sizes.setdefault(size, size))

    def _seal(self, region: _Region) -> None:
        region.sealed = True
        if region.live_count == 0:
            self._reclaim(region)

    def _reclaim(self, region: _Region) -> None:
        # The old records stay on disk until overwritten; their sequence numbers are
        # lower than anything written after reuse, so a scan ignores them.
        region.write_pos = 0
        region.sealed = False
        region.records.clear()
        region.recovered = None
        self._free_regions.append(region.index)
        logger.debug("ssd region %d reclaimed", region.index)

    def _free(self, slot: Slot) -> None:
        region = self._regions[slot.offset // self.region_size]
        self._records(region).pop(slot.offset % self.region_size, None)
        region.live_count -= 1
        region.live_bytes -= slot.size
        if region.sealed and region.live_count == 0:
            self._reclaim(region)

    def region_keys(self, slot: Slot, key: bytes = b"") -> list[bytes]:
        """Keys of the live records in `slot`'s region, oldest first (`key`'s among them)."""
        records = self._records(self._regions[slot.offset // self.region_size])
        return [records[o].key for o in sorted(records)]

    def _records(self, region: _Region) -> dict[int, _Parsed]:
        """The region's live records by offset, made from its recovered columns on the
        first change to the region (a region at a time, not a million at start)."""
        if region.recovered is not None:
            base = region.index * self.region_size
            parsed = _parsed_of(region.recovered)
            region.recovered = None
            fresh = dict(zip((p.offset - base for p in parsed), parsed))
            fresh.update(region.records)
            region.records = fresh
        return region.records

    # ------------------------------------------------------------- byte movement

    async def put_block(self, meta: BlockMeta, data: bytes | memoryview) -> Slot | None:
        if self._closed:
            raise DataLoss("the ssd tier is closed")
        loop = asyncio.get_running_loop()
        ns = meta.key[:16]
        misses = self._codec_misses.get(ns, 0)
        if not self.compress or (misses >= CODEC_GIVE_UP_AFTER and misses % CODEC_PROBE_EVERY):
            enc = Encoded(Codec.RAW, data, len(data))
            if self.compress:
                self._codec_misses[ns] = misses + 1
        else:
            self.codec_attempts += 1
            if len(data) > INLINE_CODEC_BYTES:
                enc = await loop.run_in_executor(self._executor, encode, data, meta.itemsize)
            else:
                enc = encode(data, meta.itemsize)
            self._codec_misses[ns] = 0 if enc.codec != Codec.RAW else misses + 1
        slot = self.allocate(RECORD.size + len(enc.payload))
        if slot is None:
            return None
        seq = self._next_seq
        self._next_seq += 1
        try:
            await loop.run_in_executor(self._executor, self._write_record, slot, seq, meta, enc)
        except BaseException:
            self.free(slot)
            raise
        # Only now is the record known to the tier: a crash before this point leaves a
        # record that the store never indexed.
        self._records(self._regions[slot.offset // self.region_size])[slot.offset % self.region_size] = _Parsed(
            slot.offset, slot.size, seq, int(enc.codec), meta.itemsize, meta.key, meta.parent, meta.checksum,
            enc.raw_len, len(enc.payload))
        if enc.codec != Codec.RAW:
            self.compressed_blocks += 1
        self.bytes_written += slot.size
        return slot

    def _buffer(self, size: int) -> mmap.mmap:
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            if buf is not None:
                buf.close()
            buf = _aligned_buffer(size)
            self._local.buf = buf
        return buf

    def _write_record(self, slot: Slot, seq: int, meta: BlockMeta, enc: Encoded) -> None:
        flags = FLAG_HAS_PARENT if meta.parent is not None else 0
        parent = meta.parent[16:] if meta.parent is not None else bytes(16)
        body = _BODY.pack(MAGIC, int(enc.codec), meta.itemsize, flags, seq, meta.key, parent, meta.checksum,
                          enc.raw_len, len(enc.payload))
        buf = self._buffer(slot.size)
        end = RECORD.size + len(enc.payload)
        buf[: _BODY.size] = body
        buf[_BODY.size : RECORD.size] = struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
        buf[RECORD.size : end] = enc.payload
        buf[end : slot.size] = bytes(slot.size - end)  # no stale bytes in the padding
        region, offset = divmod(slot.offset, self.region_size)
        view = memoryview(buf)[: slot.size]
        try:
            written = os.pwrite(self._fds[region], view, offset)
        finally:
            view.release()
        if written != slot.size:
            raise OSError(errno.EIO, f"short write to ssd region {region}: {written} of {slot.size} bytes")

    async def get_block(self, slot: Slot, nbytes: int) -> bytes:
        if self._closed:
            raise DataLoss("the ssd tier is closed")
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self._executor, self._read_record, slot, nbytes)
        self.bytes_read += slot.size
        return data

    def _read_record(self, slot: Slot, nbytes: int) -> bytes:
        region, offset = divmod(slot.offset, self.region_size)
        buf = self._buffer(slot.size)
        mem = memoryview(buf)
        try:
            got = os.preadv(self._fds[region], [mem[: slot.size]], offset)
            head = _parse_header(mem[: RECORD.size], offset, self.alignment)
            if head is None or got < RECORD.size + head.payload_len:
                raise DataLoss(f"ssd record at region {region} offset {offset} has a damaged header")
            if head.raw_len != nbytes:
                raise DataLoss(f"ssd record at region {region} offset {offset} holds {head.raw_len} bytes, "
                               f"expected {nbytes}")
            try:
                return decode(head.codec, mem[RECORD.size : RECORD.size + head.payload_len], head.itemsize,
                              head.raw_len)
            except ValueError as exc:
                raise DataLoss(f"ssd record at region {region} offset {offset}: {exc}") from None
        finally:
            mem.release()

    async def write(self, slot: Slot, offset: int, data: memoryview | bytes) -> None:
        raise NotImplementedError("the ssd tier stores whole blocks: use put_block")

    async def read(self, slot: Slot, nbytes: int) -> bytes:
        return await self.get_block(slot, nbytes)

    # ------------------------------------------------------------- recovery

    async def recover(self) -> RecoveryReport:
        """Rebuild the tier's tables from the snapshot, else from a scan of the log."""
        loop = asyncio.get_running_loop()
        loaded = await loop.run_in_executor(self._executor, self._load_snapshot)
        parsed: list[_Parsed] = []
        snap: np.ndarray[Any, Any] | None = None
        positions: list[int] = []
        if loaded is not None:
            snap, next_seq, positions = loaded
            from_snapshot, failures = True, 0
        else:
            results = await asyncio.gather(
                *(loop.run_in_executor(self._executor, self._scan_region, i) for i in range(len(self._regions)))
            )
            parsed = [p for ps, _, _ in results for p in ps]
            failures = sum(f for _, f, _ in results)
            # Above every header on disk, torn or left over ones included: a record
            # appended after the restart is then never taken for one of them.
            next_seq = max((top for _, _, top in results), default=0) + 1
            from_snapshot = False
        regions, region_size = self._regions, self.region_size
        if snap is not None and not _distinct_keys(snap):
            parsed = _parsed_of(snap)  # a key written twice: the newest record wins, below
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
                region.records.update((p.offset % region_size, p) for p in _parsed_of(records[lo:hi]))
            else:
                region.recovered = records[lo:hi]
        report = RecoveryReport(records, self.name, failures, from_snapshot)
        self._used_bytes += used
        self._blocks += len(records)
        assert self._used_bytes <= self.capacity_bytes, "tier accounting exceeded capacity"
        seqs = records["seq"]
        self._next_seq = max(next_seq, int(seqs.max()) + 1 if len(seqs) else 1)
        # The region that holds the newest record was being filled: appends continue in
        # it at its write position, so a restart costs no region. Its records past that
        # position (torn or from an earlier fill) all have lower sequence numbers than
        # anything appended now, so a scan takes them for leftovers, as it must.
        newest = int(offsets[int(np.argmax(seqs))]) // region_size if len(seqs) else -1
        self._free_regions.clear()
        self._open = None
        for region in self._regions:
            if region.live_count == 0:
                region.write_pos = 0
                self._free_regions.append(region.index)
            elif region.index == newest:
                self._open = region
            else:
                region.sealed = True  # full, or left when a record did not fit: drains by eviction
        logger.info("ssd tier recovered %d blocks (%s), %d failed verification, %d regions free%s",
                    len(records), "snapshot" if from_snapshot else "log scan", failures, len(self._free_regions),
                    f", appending to region {newest}" if self._open is not None else "")
        return report

    def _scan_region(self, index: int) -> tuple[list[_Parsed], int, int]:
        """Records of one region file that verify, how many did not, and the highest
        sequence number of any header in the file (torn and left over ones included)."""
        path = self._region_path(index)
        try:
            with open(path, "rb") as fh:
                # Never past the region's end: nothing there could be read back.
                data = fh.read(self.region_size)
        except FileNotFoundError:
            return [], 0, 0
        out: list[_Parsed] = []
        failures = 0
        top_seq = 0
        base = index * self.region_size
        pos, last_seq, step = 0, 0, self.alignment
        damaged_at = -1  # start of an unreadable stretch since the last good header
        while pos + RECORD.size <= len(data):
            head = _parse_header(memoryview(data)[pos : pos + RECORD.size], base + pos, self.alignment)
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

    def _snapshot_path(self) -> str:
        return os.path.join(self.path, SNAPSHOT_NAME)

    def _load_snapshot(self) -> tuple[np.ndarray[Any, Any], int, list[int]] | None:
        """The snapshot's records, next sequence number and region write positions."""
        path = self._snapshot_path()
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
        head_end = _SNAP_HEAD.size
        if len(data) < head_end + _SNAP_SUM.size or data[:8] != SNAPSHOT_MAGIC:
            logger.warning("ssd snapshot %s is not a snapshot of this version; scanning the log instead", path)
            return None
        (want,) = _SNAP_SUM.unpack_from(data, len(data) - _SNAP_SUM.size)
        body = memoryview(data)[: len(data) - _SNAP_SUM.size]
        if xxhash.xxh3_64_intdigest(body) != want:
            logger.warning("ssd snapshot %s fails its checksum; scanning the log instead", path)
            return None
        _, version, region_size, alignment, regions, count, next_seq = _SNAP_HEAD.unpack_from(body, 0)
        if version != SNAPSHOT_VERSION or region_size != self.region_size or alignment != self.alignment or \
                regions > len(self._regions):  # more regions than then: they are only added
            logger.info("ssd snapshot was written with another geometry; scanning the log instead")
            return None
        records_at = head_end + regions * _SNAP_POS.size
        if len(body) - records_at != count * _SNAP_REC.size:
            logger.warning("ssd snapshot %s malformed (%d records announced); scanning the log instead", path, count)
            return None
        positions = [p for (p,) in _SNAP_POS.iter_unpack(body[head_end:records_at])]
        if any(p > region_size for p in positions):
            logger.warning("ssd snapshot %s malformed (a region position past its end); scanning the log instead",
                           path)
            return None
        return np.frombuffer(body[records_at:], _REC_DTYPE).copy(), next_seq, positions

    def _write_snapshot(self) -> None:
        """Describe the live records for a fast start; written last on a clean close."""
        pack = _SNAP_REC.pack
        none = bytes(16)
        parts: list[bytes] = []
        count = 0
        for region in self._regions:
            if region.recovered is not None:  # untouched since the start: its columns as they are
                parts.append(region.recovered.tobytes())
                count += len(region.recovered)
            parts.extend(
                pack(p.offset, p.size, p.seq, p.itemsize, p.parent is not None, p.key,
                     p.parent[16:] if p.parent is not None else none, p.checksum, p.raw_len)
                for p in region.records.values()
            )
            count += len(region.records)
        head = _SNAP_HEAD.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, self.region_size, self.alignment,
                               len(self._regions), count, self._next_seq)
        positions = b"".join(_SNAP_POS.pack(r.write_pos) for r in self._regions)
        body = b"".join([head, positions, *parts])
        tmp = self._snapshot_path() + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(body)
            fh.write(_SNAP_SUM.pack(xxhash.xxh3_64_intdigest(body)))
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.replace(tmp, self._snapshot_path())
        except OSError:
            os.unlink(tmp)
            raise

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        for fd in self._fds:
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.close(fd)
        self._fds = []
        try:
            self._write_snapshot()
        except OSError as exc:
            logger.warning("ssd snapshot not written (%s); the next start scans the log", exc)
        # Last: the next daemon may start once the snapshot describes the log.
        os.close(self._lock_fd)

    def describe(self) -> dict[str, str]:
        return {
            "backing": f"region log, {len(self._regions)} x {self.region_size} bytes",
            "io_mode": self.io_mode,
            "regions_free": str(len(self._free_regions)),
            "dead_bytes": str(self.dead_bytes),
            "occupied_bytes": str(self.occupied_bytes),
            "compressed_blocks": str(self.compressed_blocks),
            "codec_attempts": str(self.codec_attempts),
            "bytes_written": str(self.bytes_written),
            "bytes_read": str(self.bytes_read),
        }
