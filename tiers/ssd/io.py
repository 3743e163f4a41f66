"""The SSD tier's I/O: the region files and the bytes of records moving in and out of them.

Primitives: `probe_direct_io` (whether a directory's filesystem accepts O_DIRECT),
`aligned_buffer` (page-aligned memory, as O_DIRECT needs), and `RegionFiles`: one
descriptor per region file, opened O_DIRECT or buffered, with `write_record` (header,
payload and zero padding in one pwrite) and `read_record` (one preadv, the header
checked, the payload decoded). Both run on the tier's I/O threads, each with its own
aligned buffer, grown on demand.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading

import xxhash

from kvstore.core.tier import BlockMeta, Slot
from kvstore.errors import DataLoss
from kvstore.tiers.codec import Encoded, decode
from kvstore.tiers.ssd.records import BODY, FLAG_HAS_PARENT, MAGIC, RECORD, parse_header

DIRECT_ALIGNMENT = 4096
BUFFERED_ALIGNMENT = 512


class IoMode:
    DIRECT = "direct"
    BUFFERED = "buffered"


def aligned_buffer(n: int) -> mmap.mmap:
    """A page-aligned, zero-filled buffer of `n` bytes (O_DIRECT needs aligned memory)."""
    return mmap.mmap(-1, max(n, mmap.PAGESIZE))


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
    buf = aligned_buffer(DIRECT_ALIGNMENT)
    try:
        os.pwrite(fd, buf, 0)
        return True
    except OSError:
        return False
    finally:
        buf.close()
        os.close(fd)
        os.unlink(path)


class RegionFiles:
    """The region files `region-NNNNN.kvr` of a directory, one open descriptor each."""

    def __init__(self, path: str, region_size: int, alignment: int) -> None:
        self.path = path
        self.region_size = region_size
        self.alignment = alignment
        self.fds: list[int] = []
        # One aligned buffer per I/O thread, grown on demand: mapping and faulting in a
        # fresh buffer per record cost as much as the copy itself.
        self._local = threading.local()

    def region_path(self, index: int) -> str:
        return os.path.join(self.path, f"region-{index:05d}.kvr")

    def open(self, regions: int, direct: bool) -> None:
        """Open (creating) the first `regions` region files; `fds` holds those opened so
        far if one fails."""
        flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if direct else 0)
        for i in range(regions):
            self.fds.append(os.open(self.region_path(i), flags, 0o600))

    def close(self, *, sync: bool) -> None:
        """Close every region file; with `sync`, fsync each first (errors ignored)."""
        for fd in self.fds:
            if sync:
                try:
                    os.fsync(fd)
                except OSError:
                    pass
            os.close(fd)
        self.fds = []

    def _buffer(self, size: int) -> mmap.mmap:
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            if buf is not None:
                buf.close()
            buf = aligned_buffer(size)
            self._local.buf = buf
        return buf

    def write_record(self, slot: Slot, seq: int, meta: BlockMeta, enc: Encoded) -> None:
        flags = FLAG_HAS_PARENT if meta.parent is not None else 0
        parent = meta.parent[16:] if meta.parent is not None else bytes(16)
        body = BODY.pack(MAGIC, int(enc.codec), meta.itemsize, flags, seq, meta.key, parent, meta.checksum,
                         enc.raw_len, len(enc.payload))
        buf = self._buffer(slot.size)
        end = RECORD.size + len(enc.payload)
        buf[: BODY.size] = body
        buf[BODY.size : RECORD.size] = struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
        buf[RECORD.size : end] = enc.payload
        buf[end : slot.size] = bytes(slot.size - end)  # no stale bytes in the padding
        region, offset = divmod(slot.offset, self.region_size)
        view = memoryview(buf)[: slot.size]
        try:
            written = os.pwrite(self.fds[region], view, offset)
        finally:
            view.release()
        if written != slot.size:
            raise OSError(errno.EIO, f"short write to ssd region {region}: {written} of {slot.size} bytes")

    def read_record(self, slot: Slot, nbytes: int) -> bytes:
        region, offset = divmod(slot.offset, self.region_size)
        buf = self._buffer(slot.size)
        mem = memoryview(buf)
        try:
            got = os.preadv(self.fds[region], [mem[: slot.size]], offset)
            head = parse_header(mem[: RECORD.size], offset, self.alignment)
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
