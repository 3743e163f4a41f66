"""Array-backed orders for policies keyed by block-table rows (no object per block).

`RowLists` keeps several LRU lists over integer rows. Per row: which list holds it
(u8, 0 for none) and its position in that list's log (i32). Each list is an append-only
log of rows; appending a row that is already somewhere leaves its old log entry stale
(the row's position no longer points at it). The valid entries of a log, in log order,
are exactly an OrderedDict's keys after the same inserts and `move_to_end`s, so the
order is the same one an OrderedDict-based policy keeps. Stale entries are skipped
lazily at the head and squeezed out when a log fills up (amortized O(1)), which keeps a
log at most about twice its live length. Appending a batch is one vectorized step.

`GhostList` is a bounded FIFO of 64-bit key fingerprints with membership, for ARC's
ghost lists B1 and B2: a ring of fingerprints and an open-addressing table from a
fingerprint to its ring position, 16 bytes a ghost instead of a Python bytes key in an
OrderedDict (about 170).

`RowKeys` maps opaque keys to rows for a policy used on its own (trace replay, tests);
in the daemon a policy is bound to the store's block table and uses its rows instead.

Primitives: `append`, `append_many`, `discard`, `first`; `push`, `pop_oldest`, `delete`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt

from kvstore.table import fmix64, fmix64_array, opaque_key_hash

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


class RowLists:
    """`nlists` LRU lists (ids 1..nlists) over rows; oldest first."""

    def __init__(self, nlists: int, capacity: int = 1024) -> None:
        self.lst = np.zeros(capacity, np.uint8)
        self.pos = np.zeros(capacity, np.int32)
        self._logs = [np.zeros(0, np.int32)] + [np.zeros(64, np.int32) for _ in range(nlists)]
        self._head = [0] * (nlists + 1)
        self._tail = [0] * (nlists + 1)
        self.size = [0] * (nlists + 1)

    def ensure(self, rows: int) -> None:
        """Room for rows below `rows`."""
        cap = len(self.lst)
        if rows > cap:
            while rows > cap:
                cap *= 2
            lst = np.zeros(cap, np.uint8)
            lst[: len(self.lst)] = self.lst
            pos = np.zeros(cap, np.int32)
            pos[: len(self.pos)] = self.pos
            self.lst, self.pos = lst, pos

    def list_of(self, row: int) -> int:
        return int(self.lst[row]) if row < len(self.lst) else 0

    def _room(self, which: int, more: int) -> None:
        log, head, tail = self._logs[which], self._head[which], self._tail[which]
        if tail + more <= len(log):
            return
        live = self._valid(which, head, tail)
        n = len(live)
        cap = len(log)
        while n + more > cap // 2 and n + more > cap - 64:
            cap *= 2
        if cap != len(log):
            log = np.zeros(cap, np.int32)
            self._logs[which] = log
        log[:n] = live
        self.pos[live] = np.arange(n, dtype=np.int32)
        self._head[which], self._tail[which] = 0, n

    def _valid(self, which: int, start: int, stop: int) -> npt.NDArray[np.int32]:
        entries = self._logs[which][start:stop]
        ok = (self.lst[entries] == which) & (self.pos[entries] == np.arange(start, stop, dtype=np.int32))
        return entries[ok]

    def discard(self, row: int) -> int:
        """Take `row` out of its list; returns the list it was in (0 for none)."""
        which = int(self.lst[row])
        if which:
            self.size[which] -= 1
            self.lst[row] = 0
        return which

    def append(self, which: int, row: int) -> None:
        """Make `row` the newest of list `which` (taking it out of any list first)."""
        self.discard(row)
        self._room(which, 1)
        tail = self._tail[which]
        self._logs[which][tail] = row
        self.lst[row] = which
        self.pos[row] = tail
        self._tail[which] = tail + 1
        self.size[which] += 1

    def append_many(self, which: int, rows: I64) -> None:
        """`append` each row in order; rows must be distinct."""
        n = len(rows)
        if not n:
            return
        old = self.lst[rows]
        for other in np.unique(old).tolist():
            if other:
                self.size[other] -= int(np.count_nonzero(old == other))
        self.lst[rows] = 0
        self._room(which, n)
        tail = self._tail[which]
        self._logs[which][tail:tail + n] = rows
        self.lst[rows] = which
        self.pos[rows] = np.arange(tail, tail + n, dtype=np.int32)
        self._tail[which] = tail + n
        self.size[which] += n

    def first(self, which: int, accept: Callable[[int], bool]) -> int | None:
        """The oldest row of list `which` that `accept`s, or None."""
        log = self._logs[which]
        start, tail = self._head[which], self._tail[which]
        skipping = True
        while start < tail:
            stop = min(tail, start + 256)
            entries = log[start:stop]
            ok = (self.lst[entries] == which) & (self.pos[entries] == np.arange(start, stop, dtype=np.int32))
            if skipping:
                valid_at = np.flatnonzero(ok)
                if not len(valid_at):
                    self._head[which] = stop  # all stale: never valid again
                    start = stop
                    continue
                self._head[which] = start + int(valid_at[0])
                skipping = False
            for row in entries[ok].tolist():
                if accept(row):
                    return int(row)
            start = stop
        return None

    def rows(self, which: int) -> list[int]:
        """The rows of list `which`, oldest first."""
        return [int(r) for r in self._valid(which, self._head[which], self._tail[which])]

    def __iter__(self) -> Iterator[int]:
        for which in range(1, len(self._logs)):
            yield from self.rows(which)


class GhostList:
    """A FIFO of distinct 64-bit fingerprints with O(1) membership and deletion."""

    def __init__(self) -> None:
        self._ring = np.zeros(64, np.uint64)
        self._head = 0
        self._tail = 0  # entries live in [head, tail); a deleted one is marked by the table
        self._n = 0
        self._keys = np.zeros(16, np.uint64)
        self._vals = np.full(16, -1, np.int64)  # ring position, -1 empty
        self._mask = 15

    def __len__(self) -> int:
        return self._n

    def _slot(self, fp: int) -> int:
        # Fingerprints are already mixed; fmix again so that low bits of a weak one spread.
        i = fmix64(fp) & self._mask
        keys, vals = self._keys, self._vals
        while vals[i] >= 0 and keys[i] != fp:
            i = (i + 1) & self._mask
        return i

    def __contains__(self, fp: object) -> bool:
        assert isinstance(fp, int)
        return bool(self._vals[self._slot(fp)] >= 0)

    def contains_many(self, fps: U64) -> npt.NDArray[np.bool_]:
        out = np.zeros(len(fps), bool)
        if not self._n or not len(fps):
            return out
        keys, vals, mask = self._keys, self._vals, self._mask
        pos = (fmix64_array(fps) & np.uint64(mask)).astype(np.int64)
        pend = np.arange(len(fps))
        while len(pend):
            v = vals[pos]
            empty = v < 0
            hit = ~empty & (keys[pos] == fps[pend])
            out[pend[hit]] = True
            more = ~(empty | hit)
            pend, pos = pend[more], (pos[more] + 1) & mask
        return out

    def push(self, fp: int) -> None:
        """Add `fp` as the newest (it must not be present)."""
        if 2 * (self._n + 1) > len(self._keys):
            self._rehash(2 * len(self._keys))
        if self._tail == len(self._ring):
            self._compact()
        i = self._slot(fp)
        assert self._vals[i] < 0, "a ghost is pushed once"
        self._keys[i] = fp
        self._vals[i] = self._tail
        self._ring[self._tail] = fp
        self._tail += 1
        self._n += 1

    def delete(self, fp: int) -> bool:
        i = self._slot(fp)
        if self._vals[i] < 0:
            return False
        self._erase(i)
        return True

    def pop_oldest(self) -> int:
        while True:
            fp = int(self._ring[self._head])
            at = self._head
            self._head += 1
            i = self._slot(fp)
            if self._vals[i] == at:
                self._erase(i)
                return fp

    def _erase(self, i: int) -> None:
        keys, vals, mask = self._keys, self._vals, self._mask
        j = i
        while True:
            j = (j + 1) & mask
            if vals[j] < 0:
                break
            k = fmix64(int(keys[j])) & mask
            if (i < j and (k <= i or k > j)) or (i > j and (k <= i and k > j)):
                keys[i], vals[i] = keys[j], vals[j]
                i = j
        vals[i] = -1
        self._n -= 1

    def _live(self) -> tuple[U64, I64]:
        at = np.arange(self._head, self._tail, dtype=np.int64)
        fps = self._ring[self._head:self._tail]
        if not len(fps):
            return fps, at
        slot_vals = self._lookup_vals(fps)
        ok = slot_vals == at
        return fps[ok], at[ok]

    def _lookup_vals(self, fps: U64) -> I64:
        out = np.full(len(fps), -1, np.int64)
        keys, vals, mask = self._keys, self._vals, self._mask
        pos = (fmix64_array(fps) & np.uint64(mask)).astype(np.int64)
        pend = np.arange(len(fps))
        while len(pend):
            v = vals[pos]
            empty = v < 0
            hit = ~empty & (keys[pos] == fps[pend])
            out[pend[hit]] = v[hit]
            more = ~(empty | hit)
            pend, pos = pend[more], (pos[more] + 1) & mask
        return out

    def _compact(self) -> None:
        fps, _ = self._live()
        n = len(fps)
        size = len(self._ring)
        while n + 1 > size // 2:
            size *= 2
        self._ring = np.zeros(size, np.uint64)
        self._ring[:n] = fps
        self._head, self._tail = 0, n
        self._rebuild(len(self._keys))

    def _rehash(self, size: int) -> None:
        fps, at = self._live()
        self._ring[: len(fps)] = fps
        self._head, self._tail = 0, len(fps)
        self._rebuild(size)

    def _rebuild(self, size: int) -> None:
        self._keys = np.zeros(size, np.uint64)
        self._vals = np.full(size, -1, np.int64)
        self._mask = size - 1
        self._n = 0
        for at in range(self._head, self._tail):
            fp = int(self._ring[at])
            i = self._slot(fp)
            self._keys[i] = fp
            self._vals[i] = at
            self._n += 1

    def __iter__(self) -> Iterator[int]:
        fps, _ = self._live()
        return iter(fps.tolist())


class RowKeys:
    """Opaque keys <-> rows for a policy that is not bound to a block table."""

    def __init__(self) -> None:
        self._rows: dict[bytes, int] = {}
        self._keys: list[bytes | None] = []
        self._free: list[int] = []

    def row(self, key: bytes) -> int | None:
        return self._rows.get(key)

    def add(self, key: bytes) -> int:
        row = self._rows.get(key)
        if row is None:
            if self._free:
                row = self._free.pop()
                self._keys[row] = key
            else:
                row = len(self._keys)
                self._keys.append(key)
            self._rows[key] = row
        return row

    def drop(self, row: int) -> None:
        key = self._keys[row]
        assert key is not None
        del self._rows[key]
        self._keys[row] = None
        self._free.append(row)

    def key(self, row: int) -> bytes:
        key = self._keys[row]
        assert key is not None
        return key

    @property
    def high(self) -> int:
        return len(self._keys)


def key_fingerprint(key: bytes) -> int:
    return opaque_key_hash(key)
