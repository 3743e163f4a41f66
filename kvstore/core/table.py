"""The block table: every block's metadata as rows of typed columns, no object per block.

A node indexes millions of blocks; one Python object per block costs hundreds of bytes
and a pointer chase per probe. Here a block is a row number into numpy columns (block
hash, namespace, parent, checksum, size, state flags, pins, readers, locations), and
its key maps to its row through an open-addressing hash table of row numbers.

Rows:
- A row is handed out by `new_row` (a PENDING block of a put, or a recovered block),
  published into the key table by `index_row`, taken out by `unindex_row` (the block is
  then REMOVED), and recycled once nothing refers to it any more: a removed row goes on
  a dead list and is reused only when it has no pins, no readers and no queued SSD
  write (`_reap`, run when the free list is empty). Handles (`kvstore.core.index.BlockEntry`)
  carry the row's generation; a row's generation changes when it is recycled, so a
  stale handle reads as removed instead of reading another block.
- Locations: a block has at most two copies most of its life (one memory tier, plus
  the inclusive SSD copy), held inline as (tier id, offset, size). A third one exists
  only for the moment of a move between memory tiers while an SSD copy exists; it goes
  into a small side dict.
- A namespace id is interned to a small integer; a key's fingerprint mixes the
  namespace with the 128-bit block hash (`key_hash`), and indexes the key table.

The key table: a power-of-two array of `tag << 32 | row + 1` (0 is empty), linear probing, load at
most one half, deletion by backward shift (no tombstones). A batch of keys probes all
at once (`find_rows`): one numpy pass per probe depth, not a Python step per key.
Each slot holds 31 bits of the key's hash as a tag next to the row, so a probe
rejects other keys without touching their rows. Growth doubles the columns (np.zeros pages are resident only once written) and
rebuilds the key table in one vectorized pass.

A chain's longest indexed prefix (`prefix_rows`, what every lookup asks) is probed key by
key in compiled code (kvstore/_native/table.c, the same walk as `find`), stopping at the first
absent key; where that module was not built, by `find_rows`. There, each key is first
looked for in the row after the previous key's, if that row is INDEXED: the blocks of a
chain put in one call sit in consecutive rows, and reading those rows in order costs
far less than a cache miss per key in the key table.

Primitives: `new_row`, `index_row`, `unindex_row`, `find`, `find_rows`, `prefix_rows`,
`free_row`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from kvstore.core.tier import Slot
from kvstore.hashing import split_hashes
from kvstore.native import native as _native  # the compiled chain probe; `find_rows` serves without it

PROBE_COMPILED = _native is not None
# Whether rows enter the key table through the compiled placement (tests turn it off to
# check the numpy one, which stays the reference).
PLACE_COMPILED = True

HASH_BYTES = 16
KEY_BYTES = 2 * HASH_BYTES
M64 = (1 << 64) - 1
_K1 = 0x9E3779B97F4A7C15
_C1 = 0xFF51AFD7ED558CCD
_C2 = 0xC4CEB9FE1A85EC53
_QQ = struct.Struct("<QQ")
_unpack_qq = _QQ.unpack_from
_pack_qq = _QQ.pack

# Row flags.
READY = 1
REMOVED = 2
SSD_QUEUED = 4
HAS_PARENT = 8
LIVE = 16  # handed out and not recycled
# Removed rows are looked at for reuse in batches of this many (a row or two at a time
# would pay numpy's per-call cost on every put).
_REAP_BATCH = 256
INDEXED = 32  # in the key table

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

# Slots a batch probe looks at before walking on one key at a time.
_WINDOWS = (np.arange(8, dtype=np.int64),)
_ARANGE = np.arange(4096, dtype=np.int64)


def _arange(n: int) -> I64:
    return _ARANGE[:n] if n <= len(_ARANGE) else np.arange(n, dtype=np.int64)


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer (a bijection that spreads every input bit)."""
    x ^= x >> 33
    x = (x * _C1) & M64
    x ^= x >> 33
    x = (x * _C2) & M64
    return x ^ (x >> 33)


def fmix64_array(x: U64) -> U64:
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(_C1)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(_C2)
    return x ^ (x >> np.uint64(33))  # type: ignore[no-any-return]


def namespace_fingerprint(namespace_id: bytes) -> int:
    a, b = _unpack_qq(namespace_id)
    return fmix64(a ^ ((b * _K1) & M64))


def key_hash(ns_fp: int, h0: int, h1: int) -> int:
    """The 64-bit fingerprint of a key (namespace fingerprint, block hash halves)."""
    return fmix64(h0 ^ ((h1 * _K1) & M64) ^ ns_fp)


def key_hash_array(ns_fp: int | U64, h0: U64, h1: U64) -> U64:
    return fmix64_array(h0 ^ (h1 * np.uint64(_K1)) ^ np.uint64(ns_fp) if isinstance(ns_fp, int)
                        else h0 ^ (h1 * np.uint64(_K1)) ^ ns_fp)


def slot_hash(ns_fp: int, h0: int, h1: int) -> int:
    """Where a key sits in the key table (high bits) and its tag (low bits). Cheaper than
    `key_hash`: block hashes are uniform already, so two multiplications spread them."""
    return (((h0 ^ ns_fp ^ ((h1 * _K1) & M64)) * _C1) & M64)


def slot_hash_array(ns_fp: int | U64, h0: U64, h1: U64) -> U64:
    fp = np.uint64(ns_fp) if isinstance(ns_fp, int) else ns_fp
    return (h0 ^ fp ^ (h1 * np.uint64(_K1))) * np.uint64(_C1)  # type: ignore[no-any-return]


def opaque_key_hash(key: bytes) -> int:
    """The fingerprint of a policy key: `key_hash` for a 32-byte store key, else XXH3-64."""
    if len(key) == KEY_BYTES:
        h0, h1 = _unpack_qq(key, HASH_BYTES)
        return key_hash(namespace_fingerprint(key[:HASH_BYTES]), h0, h1)
    return xxhash.xxh3_64_intdigest(key)


class BlockTable:
    """Columns of block metadata, a key table over them, and row recycling."""

    _COLUMNS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
        ("h0", "<u8", ()), ("h1", "<u8", ()), ("ns", "<u4", ()),
        ("ph0", "<u8", ()), ("ph1", "<u8", ()),
        ("csum", "<u8", ()), ("nbytes", "<u4", ()), ("item", "u1", ()), ("flags", "u1", ()),
        ("pins", "<u4", ()), ("readers", "<u4", ()), ("gen", "<u4", ()),
        ("lt", "u1", (2,)), ("lo", "<i8", (2,)), ("ls", "<u4", (2,)),
    )

    def __init__(self, capacity: int = 1024) -> None:
        self.cap = 0
        self.h0: U64 = np.zeros(0, np.uint64)
        self.h1: U64 = np.zeros(0, np.uint64)
        self.ns = np.zeros(0, np.uint32)
        self.ph0: U64 = np.zeros(0, np.uint64)
        self.ph1: U64 = np.zeros(0, np.uint64)
        self.csum: U64 = np.zeros(0, np.uint64)
        self.nbytes = np.zeros(0, np.uint32)
        self.item = np.zeros(0, np.uint8)
        self.flags = np.zeros(0, np.uint8)
        self.pins = np.zeros(0, np.uint32)
        self.readers = np.zeros(0, np.uint32)
        self.gen = np.zeros(0, np.uint32)
        self.lt = np.zeros((0, 2), np.uint8)
        self.lo = np.zeros((0, 2), np.int64)
        self.ls = np.zeros((0, 2), np.uint32)
        self.vh0 = self.vh1 = self.vns = self.vph0 = self.vph1 = self.vcsum = memoryview(b"")
        self.vnbytes = self.vitem = self.vflags = self.vpins = self.vreaders = self.vgen = memoryview(b"")
        self.vlt = self.vlo = self.vls = memoryview(b"")
        # Rows handed out at least once are below `high`; freed ones wait in `_free`.
        self.high = 0
        self._free = np.zeros(0, np.int64)
        self._nfree = 0
        self._dead = np.zeros(0, np.int64)
        self._ndead = 0
        self._reap_at = _REAP_BATCH
        # Per-namespace fingerprints (by interned id) and the ids themselves.
        self._ns_ids: dict[bytes, int] = {}
        self.ns_bytes: list[bytes] = []
        self.ns_fp = np.zeros(0, np.uint64)
        self._ns_fp_list: list[int] = []
        # Tier names by id (0 means no location).
        self._tier_ids: dict[str, int] = {}
        self.tier_names: list[str] = [""]
        # A third simultaneous location (rare), and slots taken away under readers.
        self.extra_locs: dict[int, list[Slot]] = {}
        self.retired: dict[int, list[Slot]] = {}
        # The key table.
        self._slots = np.zeros(0, np.int64)
        self._vslots = self._slots.data
        self._mask = 0
        self._shift = 64
        self.count = 0
        # What the compiled key-table calls read, as one argument (see `_bind_key_columns`).
        self.key_columns: tuple[object, ...] = ()
        self._grow(max(16, capacity))
        self._rehash(64)

    # ------------------------------------------------------------------ interning

    def ns_id(self, namespace_id: bytes) -> int:
        i = self._ns_ids.get(namespace_id)
        if i is None:
            if len(namespace_id) != HASH_BYTES:
                raise ValueError(f"a namespace id is {HASH_BYTES} bytes, got {len(namespace_id)}")
            i = len(self.ns_bytes)
            self._ns_ids[namespace_id] = i
            self.ns_bytes.append(namespace_id)
            fp = namespace_fingerprint(namespace_id)
            self._ns_fp_list.append(fp)
            self.ns_fp = np.array(self._ns_fp_list, np.uint64)
            self._bind_key_columns()
        return i

    def known_ns(self, namespace_id: bytes) -> int | None:
        return self._ns_ids.get(namespace_id)

    def tier_id(self, name: str) -> int:
        i = self._tier_ids.get(name)
        if i is None:
            i = len(self.tier_names)
            if i > 255:
                raise ValueError("at most 255 tier names")
            self._tier_ids[name] = i
            self.tier_names.append(name)
        return i

    # ------------------------------------------------------------------ rows

    def _grow(self, cap: int) -> None:
        for name, dtype, shape in self._COLUMNS:
            old = getattr(self, name)
            new = np.zeros((cap, *shape), dtype)
            new[: self.cap] = old
            setattr(self, name, new)
            # Scalar paths read and write through a memoryview: Python ints in and out,
            # several times cheaper than numpy's scalar indexing.
            setattr(self, "v" + name, new.data)
        self.cap = cap
        self._bind_key_columns()

    def _push(self, which: str, row: int) -> None:
        arr = self._free if which == "free" else self._dead
        n = self._nfree if which == "free" else self._ndead
        if n == len(arr):
            bigger = np.zeros(max(64, 2 * n), np.int64)
            bigger[:n] = arr
            arr = bigger
            setattr(self, "_free" if which == "free" else "_dead", arr)
        arr[n] = row
        if which == "free":
            self._nfree = n + 1
        else:
            self._ndead = n + 1

    def new_row(self, ns: int, h0: int, h1: int) -> int:
        """A fresh row (LIVE, not READY, not indexed) for the key (ns, h0, h1)."""
        if self._nfree == 0 and self._ndead >= self._reap_at:
            self._reap()
        if self._nfree:
            self._nfree -= 1
            row = int(self._free[self._nfree])
        else:
            if self.high == self.cap:
                self._grow(2 * self.cap)
            row = self.high
            self.high += 1
        self.vh0[row] = h0
        self.vh1[row] = h1
        self.vns[row] = ns
        self.vflags[row] = LIVE
        return row

    def new_rows(self, n: int) -> I64:
        """`n` fresh rows at the top (a rebuild or a batch): contiguous, fields zeroed."""
        if self.high + n > self.cap:
            cap = self.cap
            while self.high + n > cap:
                cap *= 2
            self._grow(cap)
        rows = np.arange(self.high, self.high + n, dtype=np.int64)
        self.high += n
        self.flags[rows] = LIVE
        return rows

    def take_rows(self, n: int) -> I64:
        """`n` rows for new blocks (recycled ones first): LIVE, no pins, readers or copies;
        the caller sets every other field."""
        if self._nfree < n and self._ndead >= self._reap_at:
            self._reap()
        k = min(n, self._nfree)
        reused = self._free[self._nfree - k:self._nfree][::-1].copy()
        self._nfree -= k
        rows = np.concatenate([reused, self.new_rows(n - k)]) if k < n else reused
        self.flags[rows] = LIVE
        return rows

    def free_row(self, row: int) -> None:
        """Recycle a row nothing refers to (a PENDING block given up, or a reaped one)."""
        assert not self.vflags[row] & INDEXED, "an indexed row is never freed"
        self.vgen[row] = (self.vgen[row] + 1) & 0xFFFFFFFF
        self.vflags[row] = 0
        self.vpins[row] = 0
        self.vreaders[row] = 0
        self.vlt[row, 0] = 0
        self.vlt[row, 1] = 0
        self.extra_locs.pop(row, None)
        self.retired.pop(row, None)
        self._push("free", row)

    def free_rows(self, rows: I64) -> None:
        """`free_row` of each row (distinct, none indexed), in whole-array steps."""
        if not len(rows):
            return
        assert not np.any(self.flags[rows] & INDEXED), "an indexed row is never freed"
        self.gen[rows] += np.uint32(1)  # wraps at 2**32, as free_row's mask does
        self.flags[rows] = 0
        self.pins[rows] = 0
        self.readers[rows] = 0
        self.lt[rows] = 0
        if self.extra_locs or self.retired:
            for row in rows.tolist():
                self.extra_locs.pop(row, None)
                self.retired.pop(row, None)
        n = self._nfree + len(rows)
        if n > len(self._free):
            bigger = np.zeros(max(64, 2 * n), np.int64)
            bigger[: self._nfree] = self._free[: self._nfree]
            self._free = bigger
        self._free[self._nfree : n] = rows
        self._nfree = n

    def _reap(self) -> None:
        """Recycle the removed rows that nothing holds any more (no pins, readers, queue)."""
        dead = self._dead[: self._ndead]
        idle = (self.pins[dead] == 0) & (self.readers[dead] == 0) & ((self.flags[dead] & SSD_QUEUED) == 0)
        held = dead[~idle]
        gone = dead[idle]
        if self.retired:  # rows still keeping a retired copy for a reader wait too
            keep = np.fromiter((row in self.retired for row in gone.tolist()), bool, len(gone))
            held, gone = np.concatenate([held, gone[keep]]), gone[~keep]
        self.free_rows(gone)
        self._dead[: len(held)] = held
        self._ndead = len(held)
        # Rows still held are looked at again only once as many more have died: a long
        # lease on many deleted blocks must not cost a scan on every put.
        self._reap_at = max(_REAP_BATCH, 2 * len(held))

    @property
    def live_rows(self) -> int:
        return self.high - self._nfree

    # ------------------------------------------------------------------ key table

    def _bind_key_columns(self) -> None:
        """Rebuild `key_columns`, the one argument of the compiled key-table calls:
        (slots, shift, h0, h1, ns, ns_fp, flags). Called whenever one of these arrays is
        replaced (growth, a rehash, a new namespace), never per call."""
        self.key_columns = (self._slots, self._shift, self.h0, self.h1, self.ns, self.ns_fp, self.flags)

    def _hash_of_rows(self, rows: I64) -> U64:
        return slot_hash_array(self.ns_fp[self.ns[rows]], self.h0[rows], self.h1[rows])

    def _home(self, row: int) -> int:
        return slot_hash(self._ns_fp_list[self.vns[row]], self.vh0[row], self.vh1[row]) >> self._shift

    def _rehash(self, size: int) -> None:
        bits = size.bit_length() - 1
        assert size == 1 << bits
        self._slots = np.zeros(size, np.int64)
        self._vslots = self._slots.data
        self._mask = size - 1
        self._shift = 64 - bits
        self._bind_key_columns()
        self._place(self.indexed_rows())

    def _entries(self, hv: U64, rows: I64) -> I64:
        """Key-table entries: the key hash's low 31 bits as a tag over `row + 1`."""
        return ((hv & np.uint64(0x7FFFFFFF)).astype(np.int64) << 32) | (rows + 1)

    def _place(self, rows: I64) -> None:
        """Insert rows known to be absent, all at once. Compiled: each at the first empty
        slot from its home, row after row, as `index_row` does (at 32 rows, about 5 us
        against 150). Otherwise in numpy rounds: each round, every pending row tries its
        next slot; of rows that want the same empty slot, the first wins."""
        if not len(rows):
            return
        if PLACE_COMPILED and _native is not None:
            _native.place_rows(np.ascontiguousarray(rows, np.int64), self.key_columns)
            return
        slots, mask = self._slots, self._mask
        hv = self._hash_of_rows(rows)
        pos = (hv >> np.uint64(self._shift)).astype(np.int64)
        pend = self._entries(hv, rows)
        while len(pend):
            # Every pending entry writes into its slot if empty; where several wanted one
            # slot, the last write stays, and the others see that they lost (entries are
            # distinct, as their rows are) and try the next slot.
            empty = slots[pos] == 0
            at = pos[empty]
            slots[at] = pend[empty]
            placed = empty.copy()
            placed[empty] = slots[at] == pend[empty]
            pend = pend[~placed]
            pos = (pos[~placed] + 1) & mask

    def _reserve(self, more: int) -> None:
        need = self.count + more
        size = len(self._slots)
        if 2 * need > size:
            while 2 * need > size:
                size *= 2
            self._rehash(size)

    def _walk(self, i: int, tag: int, ns: int, h0: int, h1: int) -> int:
        """Probe from slot `i` for the key; its row or -1."""
        slots, mask = self._vslots, self._mask
        H0, H1, NS = self.vh0, self.vh1, self.vns
        while True:
            e = slots[i]
            if e == 0:
                return -1
            if e >> 32 == tag:
                r = (e & 0xFFFFFFFF) - 1
                if H0[r] == h0 and H1[r] == h1 and NS[r] == ns:
                    return r
            i = (i + 1) & mask

    def find(self, ns: int, h0: int, h1: int) -> int:
        """The indexed row of the key, or -1."""
        hv = slot_hash(self._ns_fp_list[ns], h0, h1)
        return self._walk(hv >> self._shift, hv & 0x7FFFFFFF, ns, h0, h1)

    def find_key(self, key: bytes) -> int:
        ns = self._ns_ids.get(key[:HASH_BYTES])
        if ns is None or len(key) != KEY_BYTES:
            return -1
        h0, h1 = _unpack_qq(key, HASH_BYTES)
        return self.find(ns, h0, h1)

    def find_rows(self, ns: int, q0: U64, q1: U64, compiled: bool = True) -> I64:
        """The indexed row of each key (ns, q0[i], q1[i]), or -1.

        In compiled code where it was built (`compiled=False` takes the numpy probe,
        the reference it is tested against). There, all keys probe a window of slots at once (a gather and a compare of tags); the
        few whose run is longer than the window, or whose tag matched another key, walk
        on one by one."""
        n = len(q0)
        out = np.full(n, -1, np.int64)
        if not n or not self.count:
            return out
        if compiled and _native is not None:
            keys = np.empty((n, 2), "<u8")
            keys[:, 0], keys[:, 1] = q0, q1
            _native.prefix_rows(keys, self.key_columns, ns, out, True, INDEXED)
            return out
        slots, mask = self._slots, self._mask
        hv = slot_hash_array(self._ns_fp_list[ns], q0, q1)
        pos = (hv >> np.uint64(self._shift)).astype(np.int64)
        tag = (hv & np.uint64(0x7FFFFFFF)).astype(np.int64)
        H0, H1, NS = self.h0, self.h1, self.ns
        # With one namespace interned, every row is of it: its column need not be read.
        check_ns = len(self._ns_fp_list) > 1
        # Home slots first: at the table's load (at most 1/2) most keys sit in theirs, and
        # one gather per key beats a window of eight. An empty home slot is a miss.
        e = slots[pos]
        c = (e & 0xFFFFFFFF) - 1
        at_home = np.flatnonzero((e >> 32) == tag)
        ch = c[at_home]
        good = (H0[ch] == q0[at_home]) & (H1[ch] == q1[at_home]) & (e[at_home] != 0)
        if check_ns:
            good &= NS[ch] == ns
        out[at_home[good]] = ch[good]
        walk = (e != 0) & (out < 0)  # occupied by another key: walk on from the next slot
        pend = np.flatnonzero(walk)
        if not len(pend):
            return out
        pos, tag = (pos[pend] + 1) & mask, tag[pend]
        for window in _WINDOWS:
            k = len(pend)
            e = slots[(pos[:, None] + window) & mask]
            stop = (e == 0) | ((e >> 32) == tag[:, None])
            first = stop.argmax(axis=1)
            ends = stop[_arange(k), first]
            found = e[_arange(k), first]
            sel = np.flatnonzero(ends & (found != 0))
            c = (found[sel] & 0xFFFFFFFF) - 1
            good = (H0[c] == q0[pend[sel]]) & (H1[c] == q1[pend[sel]])
            if check_ns:
                good &= NS[c] == ns
            out[pend[sel[good]]] = c[good]
            # Walk on: keys past the window, and a tag that matched another key (1 in 2**31).
            bad = sel[~good]
            pos[bad] += first[bad] + 1 - len(window)
            more = ~ends
            more[bad] = True
            pend, pos, tag = pend[more], (pos[more] + len(window)) & mask, tag[more]
            if not len(pend):
                return out
        for k, i, t in zip(pend.tolist(), pos.tolist(), tag.tolist()):
            out[k] = self._walk(i, t, ns, int(q0[k]), int(q1[k]))
        return out

    def prefix_rows(self, ns: int, packed: bytes, compiled: bool = True) -> I64:
        """Rows of the longest prefix of a packed chain (N x 16-byte hashes) whose keys
        (ns, hash) are all indexed. `compiled=False` takes the numpy probe (the reference
        the compiled one is tested against)."""
        n = len(packed) // HASH_BYTES
        if not n or not self.count:
            return np.zeros(0, np.int64)
        if compiled and _native is not None:
            out = np.empty(n, np.int64)
            # Each key is looked for first in the row after the previous key's (a chain put
            # in one call fills consecutive rows), then in the key table.
            k = _native.prefix_rows(packed, self.key_columns, ns, out, False, INDEXED)
            return out[:k]
        q = np.frombuffer(packed, "<u8", 2 * n)
        rows = self.find_rows(ns, q[0::2], q[1::2], compiled=False)
        miss = np.flatnonzero(rows < 0)
        return rows[: miss[0]] if len(miss) else rows

    def index_row(self, row: int) -> None:
        """Publish a row (it must be READY and its key absent)."""
        self._reserve(1)
        ns, h0, h1 = self.vns[row], self.vh0[row], self.vh1[row]
        hv = slot_hash(self._ns_fp_list[ns], h0, h1)
        tag = hv & 0x7FFFFFFF
        assert self._walk(hv >> self._shift, tag, ns, h0, h1) < 0, "a key is published at most once"
        slots, mask = self._vslots, self._mask
        i = hv >> self._shift
        while slots[i] != 0:
            i = (i + 1) & mask
        slots[i] = (tag << 32) | (row + 1)
        self.vflags[row] |= INDEXED
        self.count += 1

    def index_rows(self, rows: I64) -> None:
        """Publish many rows (READY, keys absent and distinct) in one vectorized step."""
        if not len(rows):
            return
        self._reserve(len(rows))
        self._place(rows)
        self.flags[rows] |= INDEXED
        self.count += len(rows)

    def unindex_row(self, row: int) -> None:
        """Take a published row out of the key table (backward-shift deletion) and mark it
        REMOVED; it is recycled once nothing holds it."""
        slots, mask = self._vslots, self._mask
        i = self._home(row)
        while slots[i] & 0xFFFFFFFF != row + 1:
            assert slots[i] != 0, "row is not indexed"
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            e = slots[j]
            if e == 0:
                break
            k = self._home((e & 0xFFFFFFFF) - 1)
            # Move the entry back into the hole at i unless its home lies cyclically in (i, j].
            if (i < j and (k <= i or k > j)) or (i > j and (k <= i and k > j)):
                slots[i] = e
                i = j
        slots[i] = 0
        self.count -= 1
        self.vflags[row] = (self.vflags[row] & ~INDEXED) | REMOVED
        self._push("dead", row)

    def unindex_rows(self, rows: I64) -> None:
        """`unindex_row` of each row (indexed, distinct), in compiled code where it was built."""
        if not len(rows):
            return
        if not (PLACE_COMPILED and _native is not None):
            for row in rows.tolist():
                self.unindex_row(row)
            return
        assert np.all(self.flags[rows] & INDEXED), "only indexed rows are unindexed"
        _native.unindex_rows(np.ascontiguousarray(rows, np.int64), self.key_columns)
        self.count -= len(rows)
        self.flags[rows] = (self.flags[rows] & ~np.uint8(INDEXED)) | REMOVED
        for row in rows.tolist():
            self._push("dead", row)

    def indexed_rows(self) -> I64:
        """Every published row, in row order."""
        return np.flatnonzero(self.flags[: self.high] & INDEXED).astype(np.int64)

    # ------------------------------------------------------------------ keys

    def key(self, row: int) -> bytes:
        return self.ns_bytes[self.vns[row]] + _pack_qq(self.vh0[row], self.vh1[row])

    def parent_key(self, row: int) -> bytes | None:
        if not self.vflags[row] & HAS_PARENT:
            return None
        return self.ns_bytes[self.vns[row]] + _pack_qq(self.vph0[row], self.vph1[row])

    def keys(self, rows: Sequence[int] | I64) -> list[bytes]:
        rows = np.asarray(rows, np.int64)
        hashes = np.empty((len(rows), 2), np.uint64)
        hashes[:, 0] = self.h0[rows]
        hashes[:, 1] = self.h1[rows]
        raw = hashes.tobytes()
        nss = self.ns[rows].tolist()
        names = self.ns_bytes
        return [names[ns] + raw[i * 16:(i + 1) * 16] for i, ns in enumerate(nss)]

    def hashes(self, rows: Sequence[int] | I64) -> list[bytes]:
        """The block hashes (16 bytes, without the namespace) of `rows`, cut in one C call."""
        rows = np.asarray(rows, np.int64)
        packed = np.empty((len(rows), 2), np.uint64)
        packed[:, 0] = self.h0[rows]
        packed[:, 1] = self.h1[rows]
        return split_hashes(packed.tobytes())

    def parent_keys(self, rows: Sequence[int] | I64) -> list[bytes | None]:
        return [self.parent_key(r) for r in np.asarray(rows, np.int64).tolist()]

    def fingerprint(self, row: int) -> int:
        return key_hash(self._ns_fp_list[self.vns[row]], self.vh0[row], self.vh1[row])

    def fingerprints(self, rows: I64) -> U64:
        return key_hash_array(self.ns_fp[self.ns[rows]], self.h0[rows], self.h1[rows])

    def add_recovered(self, tier: str, records: npt.NDArray[np.void]) -> I64:
        """Index blocks a tier recovered at start (`kvstore.core.tier.RecoveredBlocks.records`:
        one copy each, in `tier`) as new READY rows, in whole-column steps; returns their
        rows in record order."""
        n = len(records)
        if not n:
            return np.zeros(0, np.int64)
        rows = self.new_rows(n)
        # Per key: namespace id (2 words), block hash (2 words).
        words = np.ascontiguousarray(records["key"]).view("<u8").reshape(n, 4)
        ns_words = words[:, :2]
        if np.all(ns_words == ns_words[0]):  # one namespace: the common case, no sort
            self.ns[rows] = self.ns_id(ns_words[0].tobytes())
        else:
            uniq, inverse = np.unique(np.ascontiguousarray(ns_words).view([("a", "<u8"), ("b", "<u8")]).ravel(),
                                      return_inverse=True)
            ids = np.array([self.ns_id(u.tobytes()) for u in uniq], np.uint32)
            self.ns[rows] = ids[inverse.ravel()]
        self.h0[rows] = words[:, 2]
        self.h1[rows] = words[:, 3]
        parents = np.ascontiguousarray(records["parent"]).view("<u8").reshape(n, 2)
        self.ph0[rows] = parents[:, 0]
        self.ph1[rows] = parents[:, 1]
        # A parent is always of the block's own namespace (the record keeps only its hash).
        self.flags[rows] = np.where(records["has_parent"] != 0, LIVE | READY | HAS_PARENT,
                                    LIVE | READY).astype(np.uint8)
        self.csum[rows] = records["checksum"]
        self.nbytes[rows] = records["raw_len"]
        self.item[rows] = records["itemsize"]
        self.lt[rows, 0] = self.tier_id(tier)
        self.lo[rows, 0] = records["offset"]
        self.ls[rows, 0] = records["size"]
        self.index_rows(rows)
        return rows
