"""The client side of the local data plane: map the daemon's host-tier segment and move
block bytes with one copy, hashing each block while it is in cache.

`LocalPlane.attach(resp, fd)` maps the segment of a `LocalSegment` answer (by its path,
or the descriptor that came with it over the control lane: with auth on, the caller's
own tenant's segment) and checks its header token (proving it is this daemon's segment
on this host). `copy_in` copies
caller blocks into slots and returns their XXH3-64 checksums; `copy_out` copies slots
into caller buffers and verifies each copy against the checksum the daemon recorded at
put time, stopping at the first mismatch. On a fetch the hash reads the copy, so what
is verified is exactly what the caller gets; on a put it reads the source as each piece
is copied (see `_copy_hash`). The copy and the hash run without the GIL, so a large
batch is shared between the calling thread and a helper.

A plane belongs to one start of the daemon (`boot_id`, from the `LocalSegment` answer):
the SDK sends it with each call that names this plane's slots, and attaches anew once
the daemon has restarted (`kvstore.client._ops`). The old mapping is then `retire`d: it
is unmapped once the copies running in it (other threads' calls) have finished, never
under them.

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from kvstore.errors import RESTARTED_PREFIX, DaemonRestarted
from kvstore.native import XXH3, native
from kvstore.shm import AttachedSegment
from kvstore.v1 import kvstore_pb2

logger = logging.getLogger(__name__)

# Below this many bytes per call, a second thread costs more than it saves.
PARALLEL_MIN_BYTES = 4 << 20
THREADS = 2


def _copy_hash(dst: np.ndarray, src: np.ndarray, of_source: bool = False) -> int:
    """Copy `src` into `dst`; the XXH3-64 of the copy.

    Compiled (kvstore/_native/xxh.c): the block is copied and hashed in 64 KiB pieces, each
    hashed while it is still in cache, all without the GIL. With `of_source` (a put) the
    pieces are written with stores that bypass the cache (the segment is not read back
    here, and a cached store would first read each destination line from memory) and
    the hash reads the source piece just loaded: the copy is exact, and every later read
    of the block verifies what landed against this checksum, so a block the caller
    changed while it was being copied is dropped when first read, never served.
    Without the compiled module: one whole-block copy, then one hash of the copy through
    xxhash's streaming object, whose `update` releases the GIL in every xxhash release
    this package accepts (the one-shot `xxh3_64_intdigest` holds it in some), so two
    threads can hash at once."""
    if XXH3:
        return native.copy_hash(dst, src, of_source)
    np.copyto(dst, src)
    h = xxhash.xxh3_64()
    h.update(dst.data)
    return h.intdigest()


def _as_array(buf: memoryview) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


class LocalPlane:
    def __init__(self, segment: AttachedSegment, token: bytes = b"", boot_id: int = 0) -> None:
        self.segment = segment
        self.token = token  # the daemon's segment token (the device plane checks it too)
        self.boot_id = boot_id  # the start of the daemon this segment is of (0: not told)
        self._data = np.frombuffer(segment.data, dtype=np.uint8)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._users = 0  # copies running in the mapping now
        self._retired = False

    @classmethod
    def attach(cls, resp: kvstore_pb2.LocalSegmentResponse, fd: int | None = None) -> LocalPlane:
        """Map the daemon's segment (by path, or `fd`, which this takes); raises OSError or
        ValueError when this process cannot."""
        if fd is None and not resp.path:
            raise ValueError("the daemon named no segment and passed none")
        segment = AttachedSegment(resp.path, resp.token, fd)
        segment.populate_in_background()
        return cls(segment, resp.token, resp.boot_id)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until this process's mapping of the segment is faulted in."""
        return self.segment.wait_populated(timeout_s)

    def close(self) -> None:
        """Unmap now (the client's close: no call of it runs any more)."""
        with self._lock:
            self._retired = True
        self._unmap()

    def retire(self) -> None:
        """Unmap once the copies running in the mapping have finished (now, if none does);
        a copy that starts after this still runs, in the old mapping, and the call it is
        part of is refused by the daemon (it names the old start)."""
        with self._lock:
            self._retired = True
            idle = not self._users
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        with self._lock:
            if not hasattr(self, "_data"):
                return  # unmapped already
            del self._data
        if self._pool is not None:
            # Helpers run only inside `_run`, which waits for them: nothing left runs long.
            self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            self.segment.close()
        except BufferError:  # a view of the mapping is still referenced somewhere: it stays mapped
            logger.warning("a shared-memory mapping is still in use; left mapped")

    def _acquire(self) -> np.ndarray:
        """The mapping, held mapped for one copy until `_release`."""
        with self._lock:
            data = getattr(self, "_data", None)
            if data is None:
                raise DaemonRestarted(f"{RESTARTED_PREFIX}: this client let go of its mapping of the old start's "
                                      "segment; attach again")
            self._users += 1
            return data

    def _release(self) -> None:
        """One copy is done with the mapping (the caller dropped its views of it first)."""
        with self._lock:
            self._users -= 1
            last = self._retired and not self._users
        if last:
            self._unmap()

    @staticmethod
    def _slot(data: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or offset + nbytes > len(data):
            raise ValueError(f"slot [{offset}, +{nbytes}) lies outside the daemon's segment")
        return data[offset : offset + nbytes]

    def _run(self, pairs: list[tuple[np.ndarray, np.ndarray]], of_source: bool = False) -> list[int]:
        """`_copy_hash` of each (dst, src) pair, in order. A large batch is shared between
        the calling thread and THREADS - 1 helpers, each taking the next block as it
        finishes one (no per-block task or future, and an uneven core still gets work)."""
        total = sum(len(s) for _, s in pairs)
        if total < PARALLEL_MIN_BYTES or len(pairs) < 2 or THREADS < 2:
            return [_copy_hash(d, s, of_source) for d, s in pairs]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(THREADS - 1, thread_name_prefix="kvstore-copy")
        sums = [0] * len(pairs)
        todo = iter(range(len(pairs)))  # next() on it is atomic: each index goes to one thread
        # The helpers reach the blocks only through this box, emptied on return: a helper
        # cancelled while queued behind another call's stays in the pool's queue until a
        # thread drops it, and must not keep views of the segment alive meanwhile (the
        # segment cannot be unmapped while any view of it exists).
        box = [pairs]

        def work() -> None:
            for i in todo:
                sums[i] = _copy_hash(*box[0][i], of_source)

        helpers = [self._pool.submit(work) for _ in range(THREADS - 1)]
        try:
            work()
        finally:
            # A helper that never started (the pool busy with another call's) is not
            # waited for; one that did start finishes its block before we return.
            for helper in helpers:
                if not helper.cancel():
                    helper.result()
            box.clear()
        return sums

    def copy_in(self, offsets: Sequence[int], blocks: Sequence[memoryview]) -> list[int]:
        """Copy each block into its slot (offset -1: already stored, skipped); checksums of all."""
        todo = [(i, off) for i, off in enumerate(offsets) if off >= 0]
        sums = [0] * len(offsets)
        data = self._acquire()
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        try:
            pairs = [(self._slot(data, off, len(blocks[i])), _as_array(blocks[i])) for i, off in todo]
            for (i, _), csum in zip(todo, self._run(pairs, of_source=True)):
                sums[i] = csum
        finally:
            del data  # no view of the mapping outlives the copy (it may be unmapped now)
            pairs.clear()
            self._release()
        return sums

    def copy_out(self, offsets: Sequence[int], checksums: Sequence[int], block_bytes: int,
                 dsts: Sequence[memoryview]) -> int:
        """Copy slots into `dsts` and verify; returns how many leading blocks verified.
        `block_bytes` 0: each slot is as long as its destination (a grouped layout's parts)."""
        data = self._acquire()
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        try:
            pairs = [(_as_array(d), self._slot(data, off, block_bytes or len(d))) for off, d in zip(offsets, dsts)]
            sums = self._run(pairs)
        finally:
            del data  # no view of the mapping outlives the copy (it may be unmapped now)
            pairs.clear()
            self._release()
        for i, (got, want) in enumerate(zip(sums, checksums)):
            if got != want:
                logger.warning("block %d failed verification after a shared-memory copy; not returned", i)
                return i
        return len(offsets)
