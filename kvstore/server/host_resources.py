"""What the daemon takes from the machine: memory and disk checked before the tiers are
built, the C allocator's thresholds, and the garbage collector kept off the index.

Primitives: `available_memory_bytes()`, `resolve_host_capacity(value, shm_dir)`,
`check_disk_capacity(path, capacity)` (each refuses, naming the setting, a capacity the
machine cannot give), `tune_malloc()`, `GcFreezer` (and the `GcPauses` it measures).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import time
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.server.config import AUTO
from kvstore.tiers import free_bytes
from kvstore.units import human_bytes

logger = logging.getLogger(__name__)

AUTO_HOST_CAPACITY = 4 << 30
# See GcFreezer.
GC_FREEZE_MIN_BLOCKS = 100_000
GC_FREEZE_GROWTH = 0.25
# See tune_malloc. glibc's mallopt parameters.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD = 4 << 20
MALLOC_TRIM_THRESHOLD = 256 << 20


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_host_capacity(value: int | str, shm_dir: str) -> int:
    """The host tier's size: `auto` picks min(4GiB, half of available memory, 90% of the
    shared-memory directory's free space); an explicit size must fit both."""
    available = available_memory_bytes()
    try:
        shm_free = free_bytes(shm_dir)
    except OSError as exc:
        raise ConfigError(f"cannot use shm_dir {shm_dir}: {exc.strerror}; point --shm-dir at a tmpfs directory") from None
    if value == AUTO:
        return min(AUTO_HOST_CAPACITY, available // 2, shm_free * 9 // 10)
    assert isinstance(value, int)
    if value > available:
        raise ConfigError(
            f"host_capacity {human_bytes(value)} is more than this machine's available memory "
            f"({human_bytes(available)}); lower --host-capacity"
        )
    if value > shm_free:
        # A tmpfs that fills up kills the daemon with SIGBUS on the next write: refuse now.
        raise ConfigError(
            f"host_capacity {human_bytes(value)} does not fit in {shm_dir} ({human_bytes(shm_free)} free); "
            "lower --host-capacity, enlarge the tmpfs, or point --shm-dir at a bigger one"
        )
    return value


def check_disk_capacity(path: str, capacity: int) -> None:
    """Refuse an SSD capacity the filesystem cannot hold (existing region files count as held)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.statvfs(path)
        names = os.listdir(path)
    except OSError as exc:
        raise ConfigError(f"cannot use ssd_path {path}: {exc.strerror}; choose a writable directory") from None
    free = st.f_bavail * st.f_frsize
    held = 0
    for name in names:
        if name.startswith("region-"):
            try:
                held += os.stat(os.path.join(path, name)).st_blocks * 512
            except OSError:
                pass
    if capacity > free + held:
        raise ConfigError(
            f"ssd_capacity {human_bytes(capacity)} is more than the filesystem of {path} can hold "
            f"({human_bytes(free + held)} free or already ours); lower --ssd-capacity or choose another --ssd-path"
        )


def tune_malloc() -> bool:
    """Keep block-sized buffers (a gRPC message of a 1 MiB chunk, its joined payload) in
    the C heap once freed, instead of returning them to the kernel and faulting fresh
    pages in for the next message: glibc's mmap and trim thresholds move with the
    allocation pattern, so they are fixed at 4 MiB and 256 MiB (the figures are in
    docs/operations.md). Larger allocations (the block table's columns at scale) are
    still mmapped. Skipped off glibc and when the operator set glibc's own
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_. Returns whether the thresholds were set.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return False
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


@dataclass(frozen=True, slots=True)
class GcPauses:
    collections: tuple[int, ...]
    pause_s: tuple[float, ...]
    longest_s: tuple[float, ...]
    frozen_at_blocks: int  # blocks stored or recovered when the last freeze ran
    freezes: int


class GcFreezer:
    """Keeps the cyclic garbage collector's full collections short.

    Index entries, a pool's owned units and the like are long-lived and hold no reference
    cycles, yet every full collection walks all of them: a stall of the event loop that
    grows with what the daemon holds (tens of milliseconds at a hundred thousand blocks,
    on a small machine). So what survives is frozen (`gc.freeze`), and later collections
    skip it:

    * once at least `GC_FREEZE_MIN_BLOCKS` blocks were stored since the last time, and at
      least a `GC_FREEZE_GROWTH` share of the index;
    * after each full collection the interpreter ran by itself (`watch`): what it left
      alive is long-lived by definition. The next full collection then walks only what
      came since.

    Before freezing, the young generations are collected, so recent cyclic garbage is not
    frozen with the survivors. A frozen object is still freed by reference counting when
    it is dropped; only cyclic garbage already in the oldest generation at that moment is
    kept.

    While watching it also times every collection (`pauses`): each one stops the event
    loop, so their count and length by generation are in INFO and the metrics. The number
    of frozen objects is not among them: `gc.get_freeze_count()` walks every one of them
    with the interpreter held, 20 ms at 160,000 objects on a busy small machine, which
    each freeze and each scrape would add to the calls waiting on the loop.
    """

    def __init__(self, min_blocks: int = GC_FREEZE_MIN_BLOCKS, growth: float = GC_FREEZE_GROWTH) -> None:
        self.min_blocks = min_blocks
        self.growth = growth
        self.freezes = 0
        self._stored_at_freeze = 0
        self._full_collections = 0  # seen by `watch` since the last freeze
        self._watching = False
        self._began = 0.0
        self._collections = [0, 0, 0]
        self._pause_s = [0.0, 0.0, 0.0]
        self._longest_s = [0.0, 0.0, 0.0]

    def watch(self) -> None:
        """Freeze after each full collection too (at the next `maybe_freeze`)."""
        if not self._watching:
            gc.callbacks.append(self._collected)
            self._watching = True

    def unwatch(self) -> None:
        if self._watching:
            gc.callbacks.remove(self._collected)
            self._watching = False

    def _collected(self, phase: str, info: dict[str, int]) -> None:
        # Runs inside the collector (one at a time), in whatever thread triggered it: only
        # notes here.
        if phase == "start":
            self._began = time.perf_counter()
            return
        if not self._began:
            return  # watching began during this collection
        took = time.perf_counter() - self._began
        self._began = 0.0
        generation = min(2, max(0, info.get("generation", 0)))
        self._collections[generation] += 1
        self._pause_s[generation] += took
        if took > self._longest_s[generation]:
            self._longest_s[generation] = took
        if generation == 2:
            self._full_collections += 1

    def pauses(self) -> GcPauses:
        """The collections timed since `watch`, by generation (0, 1, 2)."""
        return GcPauses(tuple(self._collections), tuple(self._pause_s), tuple(self._longest_s),
                        self._stored_at_freeze, self.freezes)

    def frozen_at(self, stored_total: int) -> None:
        """Count from here: everything up to `stored_total` blocks is frozen already."""
        self._stored_at_freeze = stored_total

    def maybe_freeze(self, stored_total: int, indexed: int) -> bool:
        """`stored_total`: blocks ever stored or recovered; `indexed`: blocks in the index now."""
        fresh = stored_total - self._stored_at_freeze
        grown = fresh >= self.min_blocks and fresh >= self.growth * indexed
        if not grown and not self._full_collections:
            return False
        gc.collect(1)
        gc.freeze()
        self._full_collections = 0
        self._stored_at_freeze = stored_total
        self.freezes += 1
        logger.debug("gc: what survives frozen after %d new blocks (freeze %d)", fresh, self.freezes)
        return True
