"""`SsdTier`: the SSD tier over a region log in one directory (see the package docstring).

It composes the parts: it locks the directory and plans its geometry (`directory`),
opens the region files (`io.RegionFiles`), allocates records in regions (`RegionLog`),
and recovers the log at start (`recovery`, `snapshot`). The event loop only encodes
small blocks, reserves offsets and keeps the tables; encoding large blocks and all file
work run in the tier's own bounded thread pool.

Primitives: `put_block`, `get_block`, `free`, `recover`, `region_keys`, `close`,
`describe`, `codec_choices`, and the accounting the store plans with (`accounted_size`,
`fits`, `has_room`, `dead_bytes`, `occupied_bytes`).

Which lossless codec a record is written with is chosen per namespace by a
`CodecChooser` (link "ssd"): from the measured time of this tier's writes (encode and
write, per raw byte) and the codecs' measured ratio and speed on that namespace's blocks,
the option expected to be fastest; a block the chosen codec shrinks by less than 5% is
written raw. Reads decode whatever a record says (docs/codecs.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstore.codec_chooser import LINK_SSD, Choice, CodecChooser
from kvstore.codecs import available, codec_named
from kvstore.core.tier import BlockMeta, Slot, Tier
from kvstore.errors import ConfigError, DataLoss
from kvstore.tiers.codec import Codec, Encoded, encode_with
from kvstore.tiers.ssd.directory import lock_directory, plan_geometry, reserve_open_files, write_geometry
from kvstore.tiers.ssd.io import IoMode, RegionFiles
from kvstore.tiers.ssd.records import RECORD, Parsed, align
from kvstore.tiers.ssd.recovery import RecoveryReport, restore, scan_region
from kvstore.tiers.ssd.regions import RegionLog
from kvstore.tiers.ssd.snapshot import load_snapshot, write_snapshot

# One logger for the whole tier, named for its package.
logger = logging.getLogger("kvstore.tiers.ssd")

DEFAULT_REGION_SIZE = 64 << 20
# Encoding blocks smaller than this inline costs less than the thread hand-off.
INLINE_CODEC_BYTES = 64 * 1024


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
        compress: bool | str = True,
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
        files: RegionFiles | None = None
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
            self._log = RegionLog(self.name, regions, region_size, self.alignment)
            self._next_seq = 1
            files = RegionFiles(path, region_size, self.alignment)
            files.open(regions, direct)
            if record:
                # After the region files exist: a crash before this leaves files that
                # agree with the settings, which the next start adopts.
                write_geometry(path, geometry)
        except BaseException:
            if files is not None:
                files.close(sync=False)
            os.close(self._lock_fd)
            raise
        self._files = files
        # Bound once: the I/O threads run these for every record.
        self._write_record = files.write_record
        self._read_record = files.read_record
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-ssd")
        self._closed = False
        self.bytes_written = 0
        self.bytes_read = 0
        self.compressed_blocks = 0
        self.codec_attempts = 0
        # True: chosen per namespace (every block write is one observation: a record is
        # one block, so no minimum size); False: raw; a codec's name: always tried.
        self.chooser = CodecChooser(available(), learn_min_bytes=0) if compress is True else None
        self.fixed_codec = codec_named(compress) if isinstance(compress, str) else Codec.RAW
        logger.info("ssd tier at %s: %d regions of %d bytes, %s I/O", path, regions, region_size, self.io_mode)

    # ------------------------------------------------------------- accounting

    def accounted_size(self, nbytes: int) -> int:
        """Upper bound of a record's size: compression only ever makes it smaller."""
        return align(RECORD.size + nbytes, self.alignment)

    def fits(self, nbytes: int) -> bool:
        return self.accounted_size(nbytes) <= self.region_size

    def has_room(self, nbytes: int) -> bool:
        return self._log.has_room(self.accounted_size(nbytes))

    @property
    def dead_bytes(self) -> int:
        return self._log.dead_bytes

    @property
    def occupied_bytes(self) -> int:
        return self._log.occupied_bytes

    def _allocate(self, nbytes: int) -> Slot | None:
        return self._log.allocate(nbytes)

    def _free(self, slot: Slot) -> None:
        self._log.free(slot)

    def region_keys(self, slot: Slot, key: bytes = b"") -> list[bytes]:
        """Keys of the live records in `slot`'s region, oldest first (`key`'s among them)."""
        return self._log.region_keys(slot)

    # ------------------------------------------------------------- byte movement

    async def put_block(self, meta: BlockMeta, data: bytes | memoryview) -> Slot | None:
        if self._closed:
            raise DataLoss("the ssd tier is closed")
        loop = asyncio.get_running_loop()
        ns = meta.key[:16]
        chooser = self.chooser
        codec = self.fixed_codec
        if chooser is not None:
            codec = chooser.choose(LINK_SSD, ns, chooser.codecs)
            if chooser.wants_sample(ns):  # what each codec does to this namespace's blocks
                await loop.run_in_executor(self._executor, chooser.sample, ns, meta.itemsize, data)
        started = time.perf_counter()
        if codec is Codec.RAW:
            enc = Encoded(Codec.RAW, data, len(data))
        else:
            self.codec_attempts += 1
            if len(data) > INLINE_CODEC_BYTES:
                enc = await loop.run_in_executor(self._executor, encode_with, codec, data, meta.itemsize)
            else:
                enc = encode_with(codec, data, meta.itemsize)
        encode_s = time.perf_counter() - started
        slot = self.allocate(RECORD.size + len(enc.payload))
        if slot is None:
            return None
        seq = self._next_seq
        self._next_seq += 1
        try:
            write_s = await loop.run_in_executor(self._executor, self._timed_write, slot, seq, meta, enc)
        except BaseException:
            self.free(slot)
            raise
        if chooser is not None:
            chooser.observed(LINK_SSD, ns, codec, enc.raw_len, len(enc.payload), encode_s + write_s)
        # Only now is the record known to the tier: a crash before this point leaves a
        # record that the store never indexed.
        self._log.add(slot, Parsed(slot.offset, slot.size, seq, int(enc.codec), meta.itemsize, meta.key, meta.parent,
                                   meta.checksum, enc.raw_len, len(enc.payload)))
        if enc.codec != Codec.RAW:
            self.compressed_blocks += 1
        self.bytes_written += slot.size
        return slot

    def _timed_write(self, slot: Slot, seq: int, meta: BlockMeta, enc: Encoded) -> float:
        """(on an I/O thread) Write a record; the seconds it took."""
        started = time.perf_counter()
        self._write_record(slot, seq, meta, enc)
        return time.perf_counter() - started

    def codec_choices(self) -> list[Choice]:
        return self.chooser.snapshot() if self.chooser is not None else []

    async def get_block(self, slot: Slot, nbytes: int) -> bytes:
        if self._closed:
            raise DataLoss("the ssd tier is closed")
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self._executor, self._read_record, slot, nbytes)
        self.bytes_read += slot.size
        return data

    async def write(self, slot: Slot, offset: int, data: memoryview | bytes) -> None:
        raise NotImplementedError("the ssd tier stores whole blocks: use put_block")

    async def read(self, slot: Slot, nbytes: int) -> bytes:
        return await self.get_block(slot, nbytes)

    # ------------------------------------------------------------- recovery

    async def recover(self) -> RecoveryReport:
        """Rebuild the tier's tables from the snapshot, else from a scan of the log."""
        loop = asyncio.get_running_loop()
        log = self._log
        loaded = await loop.run_in_executor(self._executor, load_snapshot, self.path, log)
        parsed: list[Parsed] = []
        snap: np.ndarray[Any, Any] | None = None
        positions: list[int] = []
        if loaded is not None:
            snap, next_seq, positions = loaded
            from_snapshot, failures = True, 0
        else:
            region_path, region_size, alignment = self._files.region_path, self.region_size, self.alignment
            results = await asyncio.gather(
                *(loop.run_in_executor(self._executor, scan_region, region_path(i), i, region_size, alignment)
                  for i in range(len(log.regions)))
            )
            parsed = [p for ps, _, _ in results for p in ps]
            failures = sum(f for _, f, _ in results)
            # Above every header on disk, torn or left over ones included: a record
            # appended after the restart is then never taken for one of them.
            next_seq = max((top for _, _, top in results), default=0) + 1
            from_snapshot = False
        records, offsets, used = restore(log, snap, parsed, positions)
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
        newest = int(offsets[int(np.argmax(seqs))]) // self.region_size if len(seqs) else -1
        log.resume(newest)
        logger.info("ssd tier recovered %d blocks (%s), %d failed verification, %d regions free%s",
                    len(records), "snapshot" if from_snapshot else "log scan", failures, len(log.free_regions),
                    f", appending to region {newest}" if log.open is not None else "")
        return report

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self._files.close(sync=True)
        try:
            write_snapshot(self.path, self._log, self._next_seq)
        except OSError as exc:
            logger.warning("ssd snapshot not written (%s); the next start scans the log", exc)
        # Last: the next daemon may start once the snapshot describes the log.
        os.close(self._lock_fd)

    def describe(self) -> dict[str, str]:
        return {
            "backing": f"region log, {len(self._log.regions)} x {self.region_size} bytes",
            "io_mode": self.io_mode,
            "regions_free": str(len(self._log.free_regions)),
            "dead_bytes": str(self.dead_bytes),
            "occupied_bytes": str(self.occupied_bytes),
            "compressed_blocks": str(self.compressed_blocks),
            "codec_attempts": str(self.codec_attempts),
            "bytes_written": str(self.bytes_written),
            "bytes_read": str(self.bytes_read),
        }
