"""Shared-memory segments: a file in a tmpfs directory, mapped shared, mode 0600.

The host tier keeps its slab in one segment so that clients on the same host, running
as the same user, can map it and move block bytes with one memcpy (the local data plane).
The file's mode is the access control: 0600 means only the daemon's user (and root) can
open it, which is exactly the set of local peers that could attach to the daemon's
process anyway.

Layout: a 4 KiB header, then the data area that tier offsets are relative to.

    magic    8 bytes  b"KVSTSEG1"
    token   16 bytes  random; returned by the daemon over RPC, so a client proves it
                      mapped the daemon's segment (same host, same daemon) before use
    data_offset  u64  where the data area starts (4096)
    capacity     u64  bytes in the data area

Segments are named `kvstore-<pid>-<random>`; at start-up the daemon removes segments
left by daemons of the same user that are no longer running (a crash leaves its file
behind, and tmpfs files hold memory until removed).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import struct
import tempfile
import threading
import weakref
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# madvise(MADV_POPULATE_WRITE), Linux >= 5.14: fault pages in writable without touching
# their contents. Not exported by Python 3.11's mmap module.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
POPULATE_CHUNK_BYTES = 64 << 20

MAGIC = b"KVSTSEG1"
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8s16sQQ")
_NAME = re.compile(r"^kvstore-(\d+)-[0-9a-f]{12}$")


def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    token: bytes
    data_offset: int
    capacity: int


def read_header(buf: memoryview | bytes) -> SegmentHeader:
    magic, token, data_offset, capacity = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ValueError("not a kvstore segment (bad magic)")
    return SegmentHeader(token, data_offset, capacity)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_stale_segments(directory: str) -> int:
    """Unlink segments of this user whose daemon is gone; returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    uid = os.getuid()
    for name in names:
        m = _NAME.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed += 1
                logger.info("removed stale segment %s", path)
            except OSError:
                pass
        except (PermissionError, OSError):
            continue
    return removed


class _Mapped:
    """A mapping of a segment file, owned or attached; can fault its pages in."""

    _map: mmap.mmap
    path: str
    #: "no" until populate() runs, then "running", "yes", "stopped" or "unsupported".
    populated: str = "no"

    def populate(self, stop: threading.Event | None = None) -> bool:
        """Fault every page in now, so puts do not pay a page fault per 4 KiB later
        (measured: fresh tmpfs pages take writes at a tenth of the speed of mapped ones).

        Safe while blocks are being written: it never touches contents. Runs in chunks so
        a shutdown (`stop`) interrupts it promptly. Returns False where the kernel lacks
        MADV_POPULATE_WRITE (pages then fault in on first use, as before).
        """
        size = len(self._map)
        self.populated = "running"
        for start in range(0, size, POPULATE_CHUNK_BYTES):
            if stop is not None and stop.is_set():
                self.populated = "stopped"
                return False
            try:
                self._map.madvise(MADV_POPULATE_WRITE, start, min(POPULATE_CHUNK_BYTES, size - start))
            except (OSError, ValueError) as exc:
                logger.info("cannot prefault segment %s (%s); pages fault in on first use", self.path, exc)
                self.populated = "unsupported"
                return False
        self.populated = "yes"
        return True


class Segment(_Mapped):
    """A created (owned) segment: mapped read-write, unlinked on close."""

    def __init__(self, capacity_bytes: int, directory: str | None = None) -> None:
        self.directory = directory or default_shm_dir()
        self.token = secrets.token_bytes(16)
        self.name = f"kvstore-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(self.directory, self.name)
        self.capacity = capacity_bytes
        size = HEADER_BYTES + capacity_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        # The file holds memory until unlinked: make sure it goes even if close() is
        # never called (garbage collection, interpreter exit).
        self._unlink = weakref.finalize(self, _unlink_quietly, self.path)
        _HEADER.pack_into(self._map, 0, MAGIC, self.token, HEADER_BYTES, capacity_bytes)
        self._view = memoryview(self._map)
        self.data = self._view[HEADER_BYTES:]

    def close(self) -> None:
        self.data.release()
        self._view.release()
        self._map.close()
        self._unlink()


class AttachedSegment(_Mapped):
    """Another process's segment, mapped by path; read-write so a client can fill slots
    it was handed. Checks the magic and the token the owner announced.

    Each process maps pages into its own page tables on first touch, so an attached
    mapping is slow until populated too; `populate_in_background` does that without
    delaying the caller."""

    def __init__(self, path: str, token: bytes) -> None:
        self.path = path
        self._stop = threading.Event()
        self._populator: threading.Thread | None = None
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        header = read_header(self._view)
        if header.token != token:
            self.close()
            raise ValueError(f"segment {path} belongs to another daemon (token mismatch)")
        self.data = self._view[header.data_offset : header.data_offset + header.capacity]
        self.capacity = header.capacity

    def populate_in_background(self) -> None:
        self._populator = threading.Thread(target=self.populate, args=(self._stop,), name="kvstore-populate",
                                           daemon=True)
        self._populator.start()

    def close(self) -> None:
        self._stop.set()
        if self._populator is not None:
            self._populator.join()
        if hasattr(self, "data"):
            self.data.release()
        self._view.release()
        self._map.close()
