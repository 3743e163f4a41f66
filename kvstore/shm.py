"""The shared-memory segment protocol: what a daemon's host-tier segment looks like to
anyone who maps it, and a client's read-write attachment to it.

The daemon creates the segment (`kvstore.tiers.segment.Segment`); a client on the same
host maps it (`AttachedSegment`) after the daemon told it the token over RPC, and either
the path (one segment for every client: auth off) or nothing, the segment itself coming
as a file descriptor with the control lane's answer (one segment per tenant: auth on).
A segment that came as a descriptor is sparse (it has pages only where its tenant's
blocks are), so a client never faults all of it in; and it is mapped keeping no
descriptor of it (Python's mmap keeps a duplicate, which any process allowed to read
this one's /proc/<pid>/fd could open). Layout: a 4 KiB header, then the data area that
tier offsets are relative to.

    magic    8 bytes  b"KVSTSEG1"
    token   16 bytes  random; returned by the daemon over RPC, so a client proves it
                      mapped the daemon's segment (same host, same daemon) before use
    data_offset  u64  where the data area starts (4096)
    capacity     u64  bytes in the data area
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# madvise(MADV_POPULATE_WRITE), Linux >= 5.14: fault pages in writable without touching
# their contents. Not exported by Python 3.11's mmap module.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
POPULATE_CHUNK_BYTES = 64 << 20

MAGIC = b"KVSTSEG1"
HEADER_BYTES = 4096
HEADER = struct.Struct("<8s16sQQ")


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    token: bytes
    data_offset: int
    capacity: int


def read_header(buf: memoryview | bytes) -> SegmentHeader:
    magic, token, data_offset, capacity = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ValueError("not a kvstore segment (bad magic)")
    return SegmentHeader(token, data_offset, capacity)


class MappedSegment:
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


class _Mapping:
    """mmap(2) of a whole file, shared and read-write, that keeps no descriptor of it."""

    def __init__(self, fd: int, size: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"cannot map the segment: {os.strerror(ctypes.get_errno())}")
        self._munmap = libc.munmap
        self._addr, self._size = addr, size
        self._raw = memoryview((ctypes.c_ubyte * size).from_address(addr))
        self.view = self._raw.cast("B")

    def close(self) -> None:
        """Unmap; refused (BufferError, the memory stays mapped) while views of it exist."""
        self.view.release()
        self._raw.release()
        self._munmap(self._addr, self._size)


class AttachedSegment(MappedSegment):
    """Another process's segment, mapped by path or from a descriptor `fd` (which this
    takes: it is closed once mapped); read-write so a client can fill slots it was
    handed. Checks the magic and the token the owner announced.

    Each process maps pages into its own page tables on first touch, so an attached
    mapping is slow until populated too; `populate_in_background` does that without
    delaying the caller (never for a sparse segment: `sparse`)."""

    def __init__(self, path: str, token: bytes, fd: int | None = None) -> None:
        self.path = path or "(a descriptor from the daemon)"
        self.sparse = fd is not None
        self._stop = threading.Event()
        self._populator: threading.Thread | None = None
        self._mapping: _Mapping | None = None
        opened = fd if fd is not None else os.open(path, os.O_RDWR)
        try:
            size = os.fstat(opened).st_size
            if fd is not None:
                self._mapping = _Mapping(opened, size)
            else:
                self._map = mmap.mmap(opened, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(opened)
        self._view = self._mapping.view if self._mapping is not None else memoryview(self._map)
        try:
            header = read_header(self._view)
        except (ValueError, struct.error):
            self.close()
            raise
        if header.token != token:
            self.close()
            raise ValueError(f"segment {self.path} belongs to another daemon (token mismatch)")
        self.data = self._view[header.data_offset : header.data_offset + header.capacity]
        self.capacity = header.capacity

    def wait_populated(self, timeout_s: float | None = None) -> bool:
        """Block until a background populate has finished; True if it did in time."""
        if self._populator is None:
            return True
        self._populator.join(timeout_s)
        return not self._populator.is_alive()

    def populate_in_background(self) -> None:
        if self.sparse:
            return  # faulting a sparse segment in would give it the whole capacity
        self._populator = threading.Thread(target=self.populate, args=(self._stop,), name="kvstore-populate",
                                           daemon=True)
        self._populator.start()

    def close(self) -> None:
        self._stop.set()
        if self._populator is not None:
            self._populator.join()
        if hasattr(self, "data"):
            self.data.release()
        if self._mapping is not None:
            self._mapping.close()
            return
        self._view.release()
        self._map.close()
