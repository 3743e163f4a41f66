"""Array-backed orders for policies keyed by block-table rows (no object per block).

`RowLists` keeps several LRU lists over integer rows. Per row: which list holds it
(u8, 0 for none) and its position in that list's log (i32). Each list is an append-only
log of rows; appending a row that is already somewhere leaves its old log entry stale
(the row's position no longer points at it). The valid entries of a log, in log order,
are exactly an OrderedDict's keys after the same inserts and `move_to_end`s, so the
order is the same one an OrderedDict-based policy keeps. Appending a batch is one pass
of compiled code (`kvstore._native.rows_append`), or a few array steps without it.

Stale entries are skipped lazily at the head, and squeezed out incrementally: once a log
is two-thirds full, every append also compacts a few times as many entries as it adds,
front to back, in place (the write cursor never passes the read cursor), until the
compaction reaches the tail, which then moves back to the end of the compacted entries.
No single append pays for the whole log, so a lookup's touch never stalls for the length
of a million-entry log. Entries between the two cursors are stale by construction (a
moved row's position points at its new entry), so readers need not know a compaction is
running; `first` merely jumps over that gap. A log that is mostly live when it reaches
two-thirds full grows instead, by the same slices: each append copies a few times as many
entries as it adds into a log twice as long, at the same indices, which takes over when
the copy reaches the tail.

`GhostList` is a bounded FIFO of 64-bit key fingerprints with membership, for ARC's
ghost lists B1 and B2: a ring of fingerprints and an open-addressing table from a
fingerprint to its ring position, 16 bytes a ghost instead of a Python bytes key in an
OrderedDict (about 170).

`RowKeys` maps opaque keys to rows for a policy used on its own (trace replay, tests);
in the daemon a policy is bound to the store's block table and uses its rows instead.

Primitives: `append`, `append_many`, `discard`, `first`; `push`, `pop_oldest`, `delete`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from kvstore.core.policies.base import BlockKey, Clock, EvictionPolicy
from kvstore.core.table import BlockTable, fmix64, fmix64_array, opaque_key_hash
from kvstore.native import native as _native  # appends and compaction steps in one pass each

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


_AT = np.arange(1 << 16, dtype=np.int32)


# Up to this many rows, `append_many` appends them one by one.
SCALAR_APPEND_MAX = 8
# Incremental compaction (see the module docstring): logs at least this long compact step
# by step, from two-thirds full; each append then compacts COMPACT_RATE entries per entry
# it adds, and at least COMPACT_MIN, which ends a compaction before the tail reaches the
# end of the log (it starts with at most 2/3 of the log to read, and gains at least 3
# entries on the tail per entry appended, so the tail stays below 8/9 of the log).
COMPACT_FROM = 4096
COMPACT_RATE = 4
COMPACT_MIN = 256


def _arange32(start: int, n: int) -> npt.NDArray[np.int32]:
    return _AT[:n] + np.int32(start) if n <= len(_AT) else np.arange(start, start + n, dtype=np.int32)


class RowLists:
    """`nlists` LRU lists (ids 1..nlists) over rows; oldest first."""

    def __init__(self, nlists: int, capacity: int = 1024) -> None:
        self.lst = np.zeros(capacity, np.uint8)
        self.pos = np.zeros(capacity, np.int32)
        # Scalar steps go through memoryviews (Python ints, no numpy scalar per access).
        self._vlst, self._vpos = self.lst.data, self.pos.data
        self._logs = [np.zeros(0, np.int32)] + [np.zeros(64, np.int32) for _ in range(nlists)]
        self._vlogs = [log.data for log in self._logs]
        self._head = [0] * (nlists + 1)
        self._tail = [0] * (nlists + 1)
        self.size = [0] * (nlists + 1)
        # A running compaction's write and read cursors; -1 when none runs.
        self._cw = [-1] * (nlists + 1)
        self._cr = [-1] * (nlists + 1)
        # A log twice as long, filled alongside a compaction that may end over half full
        # (the compaction then ends by switching to it, with no copy of the whole log), or
        # by a growth copy, whose cursor is `_gc` (-1 when none runs).
        self._into: list[npt.NDArray[np.int32] | None] = [None] * (nlists + 1)
        self._gc = [-1] * (nlists + 1)

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
            self._vlst, self._vpos = lst.data, pos.data

    def list_of(self, row: int) -> int:
        return self._vlst[row] if row < len(self.lst) else 0

    def _room(self, which: int, more: int) -> None:
        """Room for `more` entries at the tail of list `which`'s log."""
        log = self._logs[which]
        cap = len(log)
        budget = COMPACT_RATE * more + COMPACT_MIN
        if self._cr[which] >= 0:
            self._compact_step(which, budget)
        elif self._gc[which] >= 0:
            self._grow_step(which, budget)
        elif cap >= COMPACT_FROM and self._tail[which] + more > cap * 2 // 3:
            head = self._head[which]
            if 8 * (self._tail[which] - head - self.size[which]) < self._tail[which] - head:
                # Under 1/8 of the entries are stale: a compaction would gain little and read
                # every row's list and position to find that out. Grow instead, copying the
                # log as it is, a slice per append, at the same rate.
                self._into[which] = np.zeros(2 * cap, np.int32)
                self._gc[which] = head
                self._grow_step(which, budget)
            else:
                self._cw[which], self._cr[which] = 0, head
                self._head[which] = 0  # every entry before the old head is stale
                # Appends while it runs add at most 2/9 of the log, so past 2/7 live it may
                # end over half full: grow alongside (np.zeros is mapped lazily).
                self._into[which] = np.zeros(2 * cap, np.int32) if 7 * self.size[which] > 2 * cap else None
                self._compact_step(which, budget)
        self._room_now(which, more)

    def _room_now(self, which: int, more: int) -> None:
        if self._tail[which] + more <= len(self._logs[which]):
            return
        # A small log, or a batch larger than the room left: compact it all at once.
        self._cw[which] = self._cr[which] = self._gc[which] = -1
        self._into[which] = None
        log = self._logs[which]
        cap = len(log)
        head, tail = self._head[which], self._tail[which]
        live = self._valid(which, head, tail)
        n = len(live)
        while n + more > cap // 2 and n + more > cap - 64:
            cap *= 2
        if cap != len(log):
            log = np.zeros(cap, np.int32)
            self._logs[which] = log
            self._vlogs[which] = log.data
        log[:n] = live
        self.pos[live] = np.arange(n, dtype=np.int32)
        self._head[which], self._tail[which] = 0, n

    def _compact_step(self, which: int, budget: int) -> None:
        """Move the next `budget` entries' valid ones down to the write cursor."""
        log = self._logs[which]
        w, r, tail = self._cw[which], self._cr[which], self._tail[which]
        stop = min(tail, r + budget)
        into = self._into[which]
        if _native is not None:
            n = _native.rows_compact(log, self.lst, self.pos, which, w, r, stop, into) - w
        else:
            live = self._valid(which, r, stop)  # a copy: safe to write below `stop`
            n = len(live)
            log[w:w + n] = live
            if into is not None:
                into[w:w + n] = live  # entries below w never change again: mirror them
            self.pos[live] = _arange32(w, n)
        if self._head[which] > w:
            self._head[which] = w  # valid entries now sit from w on
        w += n
        if stop < tail:
            self._cw[which], self._cr[which] = w, stop
            return
        # The compaction reached the tail: the log now ends with the compacted entries.
        self._cw[which] = self._cr[which] = -1
        self._tail[which] = w
        self._into[which] = None
        if into is not None and w <= len(log) // 2:
            into = None  # it ended under half full after all: keep the log's length
        if into is None and w > len(log) // 2:  # over half full, unforeseen: grow by a copy
            into = np.zeros(2 * len(log), np.int32)
            into[:w] = log[:w]
        if into is not None:  # the indices stay as they are
            self._logs[which] = into
            self._vlogs[which] = into.data

    def _grow_step(self, which: int, budget: int) -> None:
        """Copy the next `budget` entries into the longer log, at the same indices; once the
        copy reaches the tail, switch to it (stale entries come along: few, by design)."""
        log, into = self._logs[which], self._into[which]
        assert into is not None
        r, tail = self._gc[which], self._tail[which]
        stop = min(tail, r + budget)
        into[r:stop] = log[r:stop]
        if stop < tail:
            self._gc[which] = stop
            return
        self._gc[which] = -1
        self._into[which] = None
        self._logs[which] = into
        self._vlogs[which] = into.data

    def _valid(self, which: int, start: int, stop: int) -> npt.NDArray[np.int32]:
        entries = self._logs[which][start:stop]
        ok = (self.lst[entries] == which) & (self.pos[entries] == np.arange(start, stop, dtype=np.int32))
        return entries[ok]

    def discard(self, row: int) -> int:
        """Take `row` out of its list; returns the list it was in (0 for none)."""
        which: int = self._vlst[row]
        if which:
            self.size[which] -= 1
            self._vlst[row] = 0
        return which

    def append(self, which: int, row: int) -> None:
        """Make `row` the newest of list `which` (taking it out of any list first)."""
        self.discard(row)
        self._room(which, 1)
        tail = self._tail[which]
        self._vlogs[which][tail] = row
        self._vlst[row] = which
        self._vpos[row] = tail
        self._tail[which] = tail + 1
        self.size[which] += 1

    def touch_many(self, which: int, rows: I64) -> None:
        """`append` to list `which` each of `rows` that is in some list now (a policy's
        touch: untracked rows stay out), in order."""
        if _native is not None and len(rows) > SCALAR_APPEND_MAX:
            self._append_compiled(which, rows, True)
            return
        held = self.lst[rows]
        tracked = held != 0
        if tracked.all():
            self.append_many(which, rows, held)
        else:
            self.append_many(which, rows[tracked])

    def append_many(self, which: int, rows: I64, held: npt.NDArray[np.uint8] | None = None) -> None:
        """`append` each row in order. A row named twice ends where its last append puts it.
        `held`, when the caller has it, is `lst[rows]` (the list each row is in now)."""
        n = len(rows)
        if not n:
            return
        if n <= SCALAR_APPEND_MAX:  # a few rows: plain appends cost less than the array steps
            for row in rows.tolist():
                self.append(which, row)
            return
        if _native is not None:
            self._append_compiled(which, rows, False)
            return
        self._room(which, n)
        tail = self._tail[which]
        pos = self.pos
        # Duplicates without a sort: the last write of each row's position wins.
        at = _arange32(tail, n)
        pos[rows] = at
        last = pos[rows] == at
        if not last.all():
            rows = rows[last]
            n = len(rows)
            at = _arange32(tail, n)
            pos[rows] = at
            held = None
        moved = np.bincount(self.lst[rows] if held is None else held, minlength=len(self.size)).tolist()
        for other in range(1, len(self.size)):
            self.size[other] -= moved[other]
        self._logs[which][tail:tail + n] = rows
        self.lst[rows] = which
        self._tail[which] = tail + n
        self.size[which] += n

    def _append_compiled(self, which: int, rows: I64, tracked_only: bool) -> None:
        """`append` each row in order, in one compiled pass: a row named twice leaves its
        earlier entry stale, as any moved row does (the array steps drop it instead)."""
        self._room(which, len(rows))
        moved = np.zeros(len(self.size), np.int64)
        tail = self._tail[which]
        end = _native.rows_append(self._logs[which], self.lst, self.pos, which, tail,
                                  np.ascontiguousarray(rows, np.int64), tracked_only, moved)
        size = self.size
        for other, k in enumerate(moved.tolist()):
            size[other] -= k
        size[which] += end - tail
        self._tail[which] = end

    def distinct_untracked(self, rows: I64) -> bool:
        """Whether `rows`, none of them in a list, are all different (no sort: an untracked
        row's position is free to scribble on)."""
        at = _arange32(0, len(rows))
        self.pos[rows] = at
        return bool(np.all(self.pos[rows] == at))

    def first(self, which: int, accept: Callable[[int], bool]) -> int | None:
        """The oldest row of list `which` that `accept`s, or None."""
        log = self._logs[which]
        vlog = self._vlogs[which]
        start, tail = self._head[which], self._tail[which]
        lst, pos = self._vlst, self._vpos
        # A running compaction's gap between its cursors holds only stale entries.
        gap_lo, gap_hi = self._cw[which], self._cr[which]
        # The common case in a few scalar steps: the oldest entries are valid (or stale
        # and skipped for good) and the first valid one is accepted.
        for _ in range(8):
            if gap_lo <= start < gap_hi:
                start = gap_hi
            if start >= tail:
                return None
            row = vlog[start]
            if lst[row] != which or pos[row] != start:
                start += 1
                self._head[which] = start
                continue
            if accept(row):
                return row
            break
        skipping = True
        while start < tail:
            if gap_lo <= start < gap_hi:
                start = gap_hi
                continue
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
        self._vring = self._ring.data
        self._head = 0
        self._tail = 0  # entries live in [head, tail); one deleted since is not in the table
        self._n = 0
        self._set_table(16)

    def _set_table(self, size: int) -> None:
        self._keys = np.zeros(size, np.uint64)
        self._vals = np.full(size, -1, np.int64)  # ring position, -1 empty
        self._vk, self._vv = self._keys.data, self._vals.data
        self._mask = size - 1

    def __len__(self) -> int:
        return self._n

    def _slot(self, fp: int) -> int:
        # Fingerprints are already mixed; fmix again so that low bits of a weak one spread.
        mask = self._mask
        i = fmix64(fp) & mask
        keys, vals = self._vk, self._vv
        while vals[i] >= 0 and keys[i] != fp:
            i = (i + 1) & mask
        return i

    def __contains__(self, fp: object) -> bool:
        assert isinstance(fp, int)
        return self._vv[self._slot(fp)] >= 0

    def contains_many(self, fps: U64) -> npt.NDArray[np.bool_]:
        if not self._n or not len(fps):
            return np.zeros(len(fps), bool)
        return self._lookup_vals(fps) >= 0

    def push(self, fp: int) -> None:
        """Add `fp` as the newest (it must not be present)."""
        if 2 * (self._n + 1) > len(self._keys):
            self._rebuild(2 * len(self._keys))
        if self._tail == len(self._ring):
            self._rebuild(len(self._keys))
        i = self._slot(fp)
        assert self._vv[i] < 0, "a ghost is pushed once"
        self._vk[i] = fp
        self._vv[i] = self._tail
        self._vring[self._tail] = fp
        self._tail += 1
        self._n += 1

    def delete(self, fp: int) -> bool:
        i = self._slot(fp)
        if self._vv[i] < 0:
            return False
        self._erase(i)
        return True

    def pop_oldest(self) -> int:
        while True:
            at = self._head
            fp: int = self._vring[at]
            self._head += 1
            i = self._slot(fp)
            if self._vv[i] == at:
                self._erase(i)
                return fp

    def _erase(self, i: int) -> None:
        keys, vals, mask = self._vk, self._vv, self._mask
        j = i
        while True:
            j = (j + 1) & mask
            if vals[j] < 0:
                break
            k = fmix64(keys[j]) & mask
            if (i < j and (k <= i or k > j)) or (i > j and (k <= i and k > j)):
                keys[i], vals[i] = keys[j], vals[j]
                i = j
        vals[i] = -1
        self._n -= 1

    def _live(self) -> U64:
        fps = self._ring[self._head:self._tail]
        if not len(fps):
            return fps
        at = np.arange(self._head, self._tail, dtype=np.int64)
        return fps[self._lookup_vals(fps) == at]

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

    def _rebuild(self, size: int) -> None:
        """Squeeze deleted ghosts out of the ring and rebuild the table (`size` slots), in
        whole-array steps."""
        fps = self._live()
        n = len(fps)
        ring = len(self._ring)
        while n + 1 > ring // 2:
            ring *= 2
        self._ring = np.zeros(ring, np.uint64)
        self._ring[:n] = fps
        self._vring = self._ring.data
        self._head, self._tail, self._n = 0, n, n
        self._set_table(size)
        keys, vals, mask = self._keys, self._vals, self._mask
        pos = (fmix64_array(fps) & np.uint64(mask)).astype(np.int64)
        pend = np.arange(n, dtype=np.int64)
        while len(pend):
            empty = vals[pos] < 0
            cand, cand_pos = pend[empty], pos[empty]
            _, first = np.unique(cand_pos, return_index=True)
            keys[cand_pos[first]] = fps[cand[first]]
            vals[cand_pos[first]] = cand[first]
            placed = np.zeros(len(pend), bool)
            placed[np.flatnonzero(empty)[first]] = True
            pend, pos = pend[~placed], (pos[~placed] + 1) & mask

    def __iter__(self) -> Iterator[int]:
        return iter(self._live().tolist())


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


class RowKeyedPolicy(EvictionPolicy):
    """A policy that orders rows: of its block table once bound, else of its own
    `RowKeys` (a policy used on its own, keyed by opaque keys)."""

    _lists: RowLists  # each subclass keeps its order here

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._keys: RowKeys | None = RowKeys()

    def bind(self, table: BlockTable) -> None:
        assert len(self) == 0, "bind a policy before it tracks blocks"
        super().bind(table)
        self._keys = None

    def _row(self, key: BlockKey) -> int:
        """The row of a tracked-or-not key; -1 if it has none."""
        if self._keys is not None:
            row = self._keys.row(key)
            return -1 if row is None else row
        return self._bound().find_key(key)

    def _key(self, row: int) -> BlockKey:
        return self._keys.key(row) if self._keys is not None else self._bound().key(row)

    def _insert_key(self, key: BlockKey) -> int:
        """The row a key being inserted takes: a fresh one of its own, or its table row."""
        if self._keys is not None:
            return self._keys.add(key)
        row = self._bound().find_key(key)
        assert row >= 0, "a bound policy tracks indexed blocks only"
        return row

    # -- the key-facing calls, through the row-facing ones

    def insert_many(self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> None:
        for key in keys:
            self.insert(key)

    def touch_many(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            self.touch(key)

    def remove(self, key: BlockKey) -> None:
        row = self._row(key)
        if row >= 0:
            self.remove_row(row)

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        row = self.victim_row(lambda r: evictable(self._key(r)))
        return None if row is None else self._key(row)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        row = self._row(key)
        return row >= 0 and self._lists.list_of(row) != 0


def key_fingerprint(key: bytes) -> int:
    return opaque_key_hash(key)
