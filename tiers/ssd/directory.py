"""The SSD tier's directory: who holds it, how its log is laid out, and what it may open.

Primitives: `lock_directory` (an flock on `kvstore.lock`, held from before the tier
touches the directory until it closes; a second tier is refused with the holder's pid
and host), `Geometry` with `read_geometry` / `write_geometry` (`geometry.json`: region
size, region count, alignment and format, written atomically), `plan_geometry` (the
geometry to open the directory with, from its recorded one or, in a directory from
before the file existed, from its snapshot's header or its region files; a change that
would lose or misread blocks is refused, naming the recorded value) and
`reserve_open_files` (an open file per region fits the process's limit, else refused).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import resource
import socket
from dataclasses import dataclass

import xxhash

from kvstore.errors import ConfigError
from kvstore.tiers.ssd.io import BUFFERED_ALIGNMENT, DIRECT_ALIGNMENT, IoMode, probe_direct_io
from kvstore.tiers.ssd.snapshot import SNAP_GEOMETRY, SNAP_SUM, SNAPSHOT_MAGIC, SNAPSHOT_NAME

# One logger for the whole tier, named for its package.
logger = logging.getLogger("kvstore.tiers.ssd")

LOCK_NAME = "kvstore.lock"
GEOMETRY_NAME = "geometry.json"
# The on-disk format the geometry file records: records of RECORD with magic KVR1 in
# region files of the recorded size. A directory of a later format is refused.
FORMAT_VERSION = 1
# With one region, every reclaim would empty the whole tier (reclaim is region-level).
MIN_REGIONS = 2
# Open files the rest of the daemon may need next to one per region (sockets, segments).
FD_HEADROOM = 256


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
    head = SNAP_GEOMETRY.size
    if len(data) >= head + SNAP_SUM.size and data[:7] == SNAPSHOT_MAGIC[:7]:
        (want,) = SNAP_SUM.unpack_from(data, len(data) - SNAP_SUM.size)
        if xxhash.xxh3_64_intdigest(memoryview(data)[: len(data) - SNAP_SUM.size]) == want:
            _, _, region_size, alignment, regions = SNAP_GEOMETRY.unpack_from(data, 0)
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

