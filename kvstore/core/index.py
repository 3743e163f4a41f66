"""The block index: which READY blocks exist, where, and with what checksum.

Control plane only: metadata on the event loop, no bytes, no locks. A key is the 16-byte
namespace id followed by the 16-byte block hash. Only READY blocks are in the index;
a block being put is PENDING inside its put transaction and is invisible until the
whole transaction commits (publish after the data lands).

Per-tier presence: an entry has one `Slot` per tier that holds a copy (`locations`,
keyed by tier name). The memory tiers (HBM, host, memory) are exclusive among
themselves: a move adds the new location and only then removes the old one, so a block
is readable somewhere at every instant. The SSD tier is inclusive: its copy stays
next to a memory copy until the SSD tier itself evicts it. The entry leaves the index
when its last location goes. Reads are served from the highest location (the store
knows the tier order).

A location removed while readers still hold the entry is `retired`: its bytes are freed
when the last reader lets go, never under a read in flight.

Storage: every block is a row of a columnar `BlockTable` (kvstore.core.table), not an object.
A `BlockEntry` is a small handle (table, row, generation) made on demand, whose
properties read and write the row, so the store's per-block code reads as before; the
bulk paths (a lookup's prefix probe, a put's publish, a restart) work on arrays of rows,
through the row-level steps of `BlockIndex` (`add_pending`, `publish`, `top_ids`,
`remove_sole_copies`...): the store's modules write the table only through this index.

Primitives: `get`, `add`, `remove`, `prefix_rows`, `longest_ready_prefix` (`ready_prefix`:
with the rows), `hold_pins`/`release_pins` (leases), `hold_readers`/`release_readers`.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstore.core.table import (
    HAS_PARENT,
    HASH_BYTES,
    I64,
    INDEXED,
    KEY_BYTES,
    LIVE,
    PROBE_COMPILED,
    READY,
    REMOVED,
    SSD_QUEUED,
    U64,
    BlockTable,
)
from kvstore.core.tier import Slot
from kvstore.core.types import BlockRef
from kvstore.native import native as _native  # the compiled top-tier pass; numpy serves without it

_new_entry = object.__new__
_unpack_qq = struct.Struct("<QQ").unpack_from
_EMPTY_I64 = np.zeros(0, np.int64)


@dataclass(frozen=True, slots=True)
class RunParents:
    """The runs after the first of a put made of several runs of one chain laid end to
    end: each one's first position in the put (increasing), and its parent's hash halves
    (`has_parent` false: a run that starts its chain)."""

    starts: I64
    q0: U64
    q1: U64
    has_parent: npt.NDArray[np.bool_]

    @classmethod
    def of(cls, runs: Sequence[tuple[int, bytes | None]]) -> RunParents:
        q = np.frombuffer(b"".join(p if p is not None else bytes(HASH_BYTES) for _, p in runs), "<u8")
        return cls(np.fromiter((s for s, _ in runs), np.int64, len(runs)), q[0::2].copy(), q[1::2].copy(),
                   np.fromiter((p is not None for _, p in runs), bool, len(runs)))
_iter_qq = struct.Struct("<QQ").iter_unpack
# Chains up to this long are probed key by key (see `BlockIndex.prefix_rows`).
SCALAR_PROBE_MAX = 16


class BlockState(enum.Enum):
    PENDING = "pending"  # bytes are landing; owned by a put transaction
    READY = "ready"  # fully written and checksummed; visible to lookups


# Entries made outside an index (tests, a put before it publishes) live here until an
# index adopts them.
_DETACHED = BlockTable(16)


class BlockEntry:
    """A handle on one block's row of a `BlockTable`: (table, row, generation).

    The metadata lives in the table's columns; this object is made on demand and holds
    nothing else, so the index costs no Python object per block. Mutable through its
    properties (`entry.pins += 1` writes the column). A handle whose row has been
    recycled (its generation moved on) reads as removed, with no pins, readers or copies.
    """

    __slots__ = ("_t", "_row", "_gen")

    def __init__(
        self,
        key: bytes,
        parent: bytes | None,
        nbytes: int,
        checksum: int,
        locations: Mapping[str, Slot] | None = None,
        state: BlockState = BlockState.PENDING,
        *,
        itemsize: int = 2,
        pins: int = 0,
        readers: int = 0,
        table: BlockTable | None = None,
    ) -> None:
        t = table if table is not None else _DETACHED
        if len(key) != KEY_BYTES:
            raise ValueError(f"a block key is {KEY_BYTES} bytes (namespace id + block hash), got {len(key)}")
        h0, h1 = _unpack_qq(key, HASH_BYTES)
        row = t.new_row(t.ns_id(key[:HASH_BYTES]), h0, h1)
        self._t = t
        self._row = row
        self._gen = t.vgen[row]
        if parent is not None:
            self.parent = parent
        t.vnbytes[row] = nbytes
        t.vcsum[row] = checksum
        t.vitem[row] = itemsize
        t.vpins[row] = pins
        t.vreaders[row] = readers
        if state is BlockState.READY:
            t.vflags[row] |= READY
        if locations:
            for name, slot in locations.items():
                assert slot.tier == name, f"slot of tier {slot.tier} filed under {name}"
                self.add_slot(slot)

    @classmethod
    def of(cls, table: BlockTable, row: int) -> BlockEntry:
        self = _new_entry(cls)
        self._t = table
        self._row = row
        self._gen = int(table.vgen[row])
        return self

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BlockEntry) and self._t is other._t and self._row == other._row
                and self._gen == other._gen)

    def __hash__(self) -> int:
        return hash((id(self._t), self._row, self._gen))

    def __repr__(self) -> str:
        return (f"BlockEntry(key={self.key.hex()}, state={self.state.value}, tiers={self.tier_names()}, "
                f"pins={self.pins}, readers={self.readers}, removed={self.removed})")

    @property
    def row(self) -> int:
        return self._row

    @property
    def table(self) -> BlockTable:
        return self._t

    @property
    def stale(self) -> bool:
        """The row was recycled: this handle's block is gone."""
        return self._t.gen[self._row] != self._gen

    def _live(self) -> int:
        assert self._t.gen[self._row] == self._gen, "write through a stale block handle"
        return self._row

    # -- fields

    @property
    def key(self) -> bytes:
        return self._t.key(self._row)

    @property
    def parent(self) -> bytes | None:
        return self._t.parent_key(self._row)

    @parent.setter
    def parent(self, parent: bytes | None) -> None:
        t, row = self._t, self._live()
        if parent is None:
            t.vflags[row] &= ~HAS_PARENT & 0xFF
            return
        if len(parent) != KEY_BYTES or t.known_ns(parent[:HASH_BYTES]) != t.vns[row]:
            raise ValueError("a block's parent is a key of the same namespace")
        t.vph0[row], t.vph1[row] = _unpack_qq(parent, HASH_BYTES)
        t.vflags[row] |= HAS_PARENT

    @property
    def nbytes(self) -> int:
        return int(self._t.nbytes[self._row])

    @property
    def checksum(self) -> int:
        return int(self._t.csum[self._row])

    @checksum.setter
    def checksum(self, value: int) -> None:
        self._t.csum[self._live()] = value

    @property
    def itemsize(self) -> int:
        return int(self._t.item[self._row])

    @property
    def state(self) -> BlockState:
        return BlockState.READY if self._t.flags[self._row] & READY else BlockState.PENDING

    @state.setter
    def state(self, value: BlockState) -> None:
        t, row = self._t, self._live()
        if value is BlockState.READY:
            t.vflags[row] |= READY
        else:
            t.vflags[row] &= ~READY & 0xFF

    @property
    def pins(self) -> int:
        t, row = self._t, self._row
        return t.vpins[row] if t.vgen[row] == self._gen else 0

    @pins.setter
    def pins(self, value: int) -> None:
        assert value >= 0, "pins below zero"
        self._t.pins[self._live()] = value

    @property
    def readers(self) -> int:
        t, row = self._t, self._row
        return t.vreaders[row] if t.vgen[row] == self._gen else 0

    @readers.setter
    def readers(self, value: int) -> None:
        assert value >= 0, "readers below zero"
        self._t.readers[self._live()] = value

    @property
    def removed(self) -> bool:
        t, row = self._t, self._row
        return t.vgen[row] != self._gen or bool(t.vflags[row] & REMOVED)

    @property
    def ssd_queued(self) -> bool:
        t, row = self._t, self._row
        return t.vgen[row] == self._gen and bool(t.vflags[row] & SSD_QUEUED)

    @ssd_queued.setter
    def ssd_queued(self, value: bool) -> None:
        t, row = self._t, self._row
        if t.vgen[row] != self._gen:
            return  # recycled: nothing of it is queued any more
        if value:
            t.vflags[row] |= SSD_QUEUED
        else:
            t.vflags[row] &= ~SSD_QUEUED & 0xFF

    @property
    def retired(self) -> list[Slot] | None:
        if self.stale:
            return None
        return self._t.retired.get(self._row)

    @retired.setter
    def retired(self, value: list[Slot] | None) -> None:
        row = self._live()
        if value is None:
            self._t.retired.pop(row, None)
        else:
            self._t.retired[row] = value

    @property
    def evictable(self) -> bool:
        t, row = self._t, self._row
        return (t.vgen[row] == self._gen and t.vpins[row] == 0 and t.vreaders[row] == 0
                and bool(t.vflags[row] & READY))

    # -- locations (one Slot per tier holding a copy, in the order they were added)

    @property
    def locations(self) -> Locations:
        """The copies by tier name, as a mutable mapping view (no copy)."""
        return Locations(self)

    def slots(self) -> tuple[Slot, ...]:
        t, row = self._t, self._row
        if t.vgen[row] != self._gen:
            return ()
        a, b = t.vlt[row, 0], t.vlt[row, 1]
        if not a:
            return ()
        names = t.tier_names
        first = Slot(names[a], t.vlo[row, 0], t.vls[row, 0])
        if not b:
            return (first,)
        second = Slot(names[b], t.vlo[row, 1], t.vls[row, 1])
        extra = t.extra_locs.get(row)
        return (first, second, *extra) if extra else (first, second)

    def tier_names(self) -> list[str]:
        return [s.tier for s in self.slots()]

    def only_tier(self) -> str | None:
        """The tier of the single copy, or None when there are none or several (the fast path)."""
        t, row = self._t, self._row
        if t.vgen[row] != self._gen:
            return None
        a, b = t.vlt[row, 0], t.vlt[row, 1]
        return t.tier_names[a] if a and not b else None

    def slot_in(self, tier: str) -> Slot | None:
        for s in self.slots():
            if s.tier == tier:
                return s
        return None

    def add_slot(self, slot: Slot) -> None:
        """Record a copy; replaces the copy in the same tier, if any."""
        rest = [s for s in self.slots() if s.tier != slot.tier]
        self._set([*rest, slot])

    def pop_slot(self, tier: str) -> Slot:
        slot = self.slot_in(tier)
        if slot is None:
            raise KeyError(tier)
        self._set([s for s in self.slots() if s.tier != tier])
        return slot

    def clear_slots(self) -> None:
        if not self.stale:
            self._set([])

    def _set(self, slots: list[Slot]) -> None:
        t, row = self._t, self._live()
        lt, lo, ls = t.lt, t.lo, t.ls
        for i in range(2):
            if i < len(slots):
                s = slots[i]
                lt[row, i] = t.tier_id(s.tier)
                lo[row, i] = s.offset
                ls[row, i] = s.size
            else:
                lt[row, i] = 0
        if len(slots) > 2:
            t.extra_locs[row] = slots[2:]
        else:
            t.extra_locs.pop(row, None)

    def retire(self, slot: Slot) -> None:
        retired = self.retired
        if retired is None:
            self.retired = [slot]
        else:
            retired.append(slot)

    def _move_to(self, table: BlockTable) -> None:
        """Copy this (detached) entry's row into `table` and point the handle there."""
        src, row = self._t, self._live()
        key, parent, slots, retired = self.key, self.parent, self.slots(), self.retired
        h0, h1 = _unpack_qq(key, HASH_BYTES)
        new = table.new_row(table.ns_id(key[:HASH_BYTES]), h0, h1)
        for col in ("csum", "nbytes", "item", "pins", "readers"):
            getattr(table, col)[new] = getattr(src, col)[row]
        table.vflags[new] |= int(src.vflags[row]) & (READY | REMOVED | SSD_QUEUED)
        src.free_row(row)
        self._t, self._row, self._gen = table, new, int(table.vgen[new])
        self.parent = parent
        self._set(list(slots))
        if retired:
            self.retired = list(retired)


class Locations(MutableMapping[str, Slot]):
    """A dict-like view of an entry's copies by tier name."""

    __slots__ = ("_entry",)

    def __init__(self, entry: BlockEntry) -> None:
        self._entry = entry

    def __getitem__(self, tier: str) -> Slot:
        slot = self._entry.slot_in(tier)
        if slot is None:
            raise KeyError(tier)
        return slot

    def __setitem__(self, tier: str, slot: Slot) -> None:
        if slot.tier != tier:
            raise ValueError(f"slot of tier {slot.tier} filed under {tier}")
        self._entry.add_slot(slot)

    def __delitem__(self, tier: str) -> None:
        self._entry.pop_slot(tier)

    def __contains__(self, tier: object) -> bool:
        return isinstance(tier, str) and self._entry.slot_in(tier) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entry.tier_names())

    def __len__(self) -> int:
        return len(self._entry.slots())

    def clear(self) -> None:
        self._entry.clear_slots()


def make_key(namespace_id: bytes, block_hash: bytes) -> bytes:
    return namespace_id + block_hash


def hold_pins(table: BlockTable, rows: I64) -> None:
    """One more pin of each of `rows` (current, indexed rows of `table`; a row named twice
    counts twice), in one array step: a lease taken (`kvstore.core.leases`)."""
    np.add.at(table.pins, rows, 1)


def release_pins(table: BlockTable, rows: I64) -> None:
    """One pin fewer of each of `rows` (pinned by `hold_pins`), in one array step."""
    assert int(table.pins[rows].min()) > 0, "pins below zero"
    np.subtract.at(table.pins, rows, 1)


def hold_readers(table: BlockTable, rows: I64) -> None:
    """One more reader of each of `rows` (current rows of `table`; a row named twice
    counts twice), in one array step: `CopyBook.hold` of each."""
    np.add.at(table.readers, rows, 1)


def release_readers(table: BlockTable, rows: I64, readers_gone: Callable[[BlockEntry], None]) -> None:
    """One reader fewer of each of `rows` (held by `hold_readers` or a lease), in one
    array step; `readers_gone` of each whose last reader that was and that has a slot to
    free (deleted, or with a retired copy): `CopyBook.release` of each."""
    if not len(rows):
        return
    assert int(table.readers[rows].min()) > 0, "readers below zero"
    np.subtract.at(table.readers, rows, 1)
    idle = np.unique(rows[table.readers[rows] == 0])
    gone = idle[(table.flags[idle] & REMOVED) != 0].tolist()
    if table.retired:
        gone += [r for r in idle.tolist() if r in table.retired and r not in gone]
    for row in gone:
        readers_gone(BlockEntry.of(table, row))


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """What one namespace's indexed blocks hold: how many, their payload bytes, and the
    payload bytes of their copies in each tier."""

    blocks: int
    nbytes: int
    by_tier: dict[str, int]


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    """Blocks of one namespace that left the index together; `hashes` (block hashes, in
    the order of the rows given) only where they were asked for."""

    namespace_id: bytes
    blocks: int
    nbytes: int
    hashes: list[bytes]


class BlockIndex:
    """READY blocks by key: the published rows of a `BlockTable`."""

    def __init__(self, table: BlockTable | None = None) -> None:
        self.table = table if table is not None else BlockTable()

    def __len__(self) -> int:
        return self.table.count

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.table.find_key(key) >= 0

    def __iter__(self) -> Iterator[BlockEntry]:
        t = self.table
        return (BlockEntry.of(t, row) for row in t.indexed_rows().tolist())

    def entry(self, row: int) -> BlockEntry:
        return BlockEntry.of(self.table, row)

    def new_entry(self, key: bytes, parent: bytes | None, nbytes: int, checksum: int, *,
                  itemsize: int = 2) -> BlockEntry:
        """A PENDING entry with its row in this index's table (published by `add`)."""
        return BlockEntry(key, parent, nbytes, checksum, itemsize=itemsize, table=self.table)

    def get(self, key: bytes) -> BlockEntry | None:
        row = self.table.find_key(key)
        return None if row < 0 else BlockEntry.of(self.table, row)

    def ancestor(self, namespace_id: bytes, block_hash: bytes, steps: int) -> bytes | None:
        """The hash `steps` parents above `block_hash` (0: itself), through the parents of
        the blocks held; None where the walk meets a block not held or a chain's start."""
        h: bytes | None = block_hash
        for _ in range(steps):
            if h is None:
                break
            entry = self.get(namespace_id + h)
            up = entry.parent if entry is not None else None
            h = up[HASH_BYTES:] if up is not None else None
        return h

    def chain_position(self, namespace_id: bytes, block_hash: bytes, max_position: int) -> int | None:
        """The position of `block_hash` in its chain (0: the first block), by walking the
        parents held; None where one of them is not held or the chain goes on past
        `max_position` blocks before it."""
        h: bytes | None = block_hash
        depth = 0
        while h is not None and depth <= max_position:
            entry = self.get(namespace_id + h)
            if entry is None:
                return None
            up = entry.parent
            h = up[HASH_BYTES:] if up is not None else None
            depth += 1
        return depth - 1 if h is None else None

    def _adopt(self, entry: BlockEntry) -> None:
        if entry._t is not self.table:
            entry._move_to(self.table)

    def add(self, entry: BlockEntry) -> None:
        assert entry.state is BlockState.READY, "only READY blocks enter the index"
        self._adopt(entry)
        self.table.index_row(entry._row)

    def add_many(self, entries: Sequence[BlockEntry]) -> None:
        """`add` each entry (a put's blocks), checked, then inserted in one step."""
        for e in entries:
            assert e.state is BlockState.READY, "only READY blocks enter the index"
            self._adopt(e)
        rows = np.fromiter((e._row for e in entries), np.int64, len(entries))
        self.add_rows(rows)

    def add_rows(self, rows: I64) -> None:
        """Publish READY rows of this index's table in one vectorized step."""
        t = self.table
        if not len(rows):
            return
        assert np.all(t.flags[rows] & READY), "only READY blocks enter the index"
        h0, h1, ns = t.h0[rows], t.h1[rows], t.ns[rows]
        if len(np.unique(h0)) != len(rows):  # the full check only where a half collides
            keys = np.empty((len(rows), 3), np.uint64)
            keys[:, 0], keys[:, 1], keys[:, 2] = h0, h1, ns
            assert len(np.unique(keys, axis=0)) == len(rows), "a key is published at most once"
        first = int(ns[0])
        for n in ([first] if np.all(ns == first) else np.unique(ns).tolist()):
            sel = ns == n
            assert not np.any(t.find_rows(n, h0[sel], h1[sel]) >= 0), "a key is published at most once"
        t.index_rows(rows)

    def add_recovered(self, tier: str, records: npt.NDArray[np.void]) -> I64:
        """Index blocks a tier recovered at start as READY rows, one copy each, in `tier`
        (`BlockTable.add_recovered`); their rows, in record order."""
        return self.table.add_recovered(tier, records)

    def namespaces_of(self, rows: I64) -> list[bytes]:
        """The namespace ids of `rows`' blocks, each once."""
        t = self.table
        return [t.ns_bytes[i] for i in np.unique(t.ns[rows]).tolist()]

    def remove(self, key: bytes) -> BlockEntry | None:
        row = self.table.find_key(key)
        if row < 0:
            return None
        self.table.unindex_row(row)
        return BlockEntry.of(self.table, row)

    def remove_entry(self, entry: BlockEntry) -> None:
        """Unpublish an indexed entry (it then reads as removed)."""
        t, row = entry._t, entry._row
        if t is self.table and not entry.stale and t.vflags[row] & INDEXED:
            t.unindex_row(row)

    def prefix_rows(self, namespace_id: bytes, packed: bytes) -> I64:
        """Rows of the longest READY prefix of a packed chain (N x 16-byte hashes, N x 16
        bytes long) in the namespace: one probe of the key table, no object per block."""
        ns = self.table.known_ns(namespace_id)
        if ns is None or not packed:
            return np.zeros(0, np.int64)
        if len(packed) <= SCALAR_PROBE_MAX * HASH_BYTES and not PROBE_COMPILED:
            # A short chain: scalar probes cost less than the batch probe's fixed numpy work.
            t = self.table
            found: list[int] = []
            for h0, h1 in _iter_qq(packed):
                row = t.find(ns, h0, h1)
                if row < 0:
                    break
                found.append(row)
            return np.array(found, np.int64)
        return self.table.prefix_rows(ns, packed)

    def longest_ready_prefix(self, keys: Sequence[bytes]) -> list[BlockEntry]:
        """Entries of the longest prefix of `keys` that is READY, in order."""
        return self.ready_prefix(keys)[0]

    def ready_prefix(self, keys: Sequence[bytes]) -> tuple[list[BlockEntry], I64 | None]:
        """`longest_ready_prefix`, and the entries' rows (of `table`) where they were
        found in one array step (keys of one namespace), else None."""
        t = self.table
        out: list[BlockEntry] = []
        if not keys:
            return out, None
        ns_id = keys[0][:HASH_BYTES]
        if all(len(k) == KEY_BYTES for k in keys) and all(k[:HASH_BYTES] == ns_id for k in keys):
            rows = self.prefix_rows(ns_id, b"".join([k[HASH_BYTES:] for k in keys]))
            return [BlockEntry.of(t, r) for r in rows.tolist()], rows
        for key in keys:
            row = t.find_key(key)
            if row < 0:
                break
            out.append(BlockEntry.of(t, row))
        return out, None

    # -- row-level steps: the bulk paths' only writes to the table

    def evictable_row(self, row: int) -> bool:
        """Whether the block at `row` could leave now: READY, indexed, no pins, no readers
        (the predicate policies pick victims with)."""
        t = self.table
        return (row >= 0 and t.vpins[row] == 0 and t.vreaders[row] == 0
                and (t.vflags[row] & (READY | INDEXED)) == (READY | INDEXED))

    def only_copy_in(self, row: int, tier_id: int) -> bool:
        """Whether the block at `row` has one copy, in tier `tier_id`."""
        t = self.table
        return not t.vlt[row, 1] and t.vlt[row, 0] == tier_id

    def sole_copy(self, entry: BlockEntry, tier_id: int) -> bool:
        """Whether `entry` is an indexed block of this index with no reader whose only copy
        is in tier `tier_id` (what `remove_sole_copies` takes)."""
        t, row = entry._t, entry._row
        return (t is self.table and not entry.stale and not t.vreaders[row] and self.only_copy_in(row, tier_id)
                and bool(t.vflags[row] & INDEXED))

    def top_ids(self, rows: I64) -> npt.NDArray[np.uint8]:
        """The tier id of each row's top copy (the lowest id: the store numbers its tiers
        top first), as u8."""
        t = self.table
        if _native is not None:
            tops = np.empty(len(rows), np.uint8)
            if not _native.top_tiers(np.ascontiguousarray(rows, np.int64), t.lt, tops) or not t.extra_locs:
                return tops
            second = t.lt[rows, 1].astype(np.int64)
        else:
            # Both location tiers of a row in one 16-bit gather: the first in the low byte.
            both = t.lt.view("<u2")[:, 0][rows]
            if not len(both) or int(both.max()) < 256:  # one copy each: the common case
                return both.astype(np.uint8)
            first, second = both & 0xFF, both >> 8
            tops = np.where((second != 0) & (second < first), second, first).astype(np.uint8)
        if t.extra_locs:  # a third copy, for the moment of a move
            for i in np.flatnonzero(second != 0).tolist():
                extra = t.extra_locs.get(int(rows[i]))
                if extra:
                    tops[i] = min([int(tops[i])] + [t.tier_id(s.tier) for s in extra])
        return tops

    def remove_sole_copies(self, rows: I64, free: Callable[[Slot], None],
                           with_hashes: bool) -> list[RemovedBlocks]:
        """Take indexed rows out of the index with their only copy, `free`d here (rows
        with no reader, each copy in the same tier), in whole-array steps; what left, by
        namespace."""
        if not len(rows):
            return []
        t = self.table
        nbytes = t.nbytes[rows].astype(np.int64)
        offsets, sizes = t.lo[rows, 0].tolist(), t.ls[rows, 0].tolist()
        name = t.tier_names[int(t.lt[rows[0], 0])]
        t.lt[rows, 0] = 0
        for offset, size in zip(offsets, sizes):
            free(Slot(name, offset, size))
        ns = t.ns[rows]
        hashes = t.hashes(rows) if with_hashes else []
        t.unindex_rows(rows)
        out = []
        for n in np.unique(ns).tolist():
            sel = ns == n
            chosen = [hashes[i] for i in np.flatnonzero(sel).tolist()] if with_hashes else []
            out.append(RemovedBlocks(t.ns_bytes[n], int(sel.sum()), int(nbytes[sel].sum()), chosen))
        return out

    def namespace_usage(self, namespace_id: bytes) -> NamespaceUsage | None:
        """What a namespace's indexed blocks hold (blocks recovered before it registered);
        None if the table has never seen the namespace."""
        t = self.table
        nsid = t.known_ns(namespace_id)
        if nsid is None:
            return None
        rows = t.indexed_rows()
        rows = rows[t.ns[rows] == nsid]
        nbytes = t.nbytes[rows].astype(np.int64)
        by_tier: dict[str, int] = {}
        lt = t.lt[rows]
        for tid in range(1, len(t.tier_names)):
            held = (lt[:, 0] == tid) | (lt[:, 1] == tid)
            if held.any():
                by_tier[t.tier_names[tid]] = int(nbytes[held].sum())
        for row in t.extra_locs.keys() & set(rows.tolist()):
            for slot in t.extra_locs[row]:
                by_tier[slot.tier] = by_tier.get(slot.tier, 0) + t.vnbytes[row]
        return NamespaceUsage(len(rows), int(nbytes.sum()), by_tier)

    def chains(self, namespace_ids: set[bytes]) -> list[BlockRef]:
        """Every READY block of these namespaces (a block hash once, whichever of them
        holds it first), parents before children, chains consecutive (depth-first from
        each root), so the list replays as chained puts."""
        # Block hash -> parent hash (b"" at a chain's start), first part seen of each block.
        blocks: dict[bytes, bytes] = {}
        for e in self:
            if e.key[:HASH_BYTES] in namespace_ids:
                blocks.setdefault(e.key[HASH_BYTES:], e.parent[HASH_BYTES:] if e.parent is not None else b"")
        children: dict[bytes, list[bytes]] = {}
        roots = []
        for h, parent in blocks.items():
            if parent and parent in blocks:
                children.setdefault(parent, []).append(h)
            else:
                roots.append(h)
        out: list[BlockRef] = []
        stack = list(reversed(roots))
        while stack:
            h = stack.pop()
            out.append(BlockRef(h, blocks[h]))
            stack.extend(reversed(children.get(h, ())))
        return out

    def find_chain(self, namespace_id: bytes, q0: U64, q1: U64) -> I64:
        """The indexed row of each block (hash halves q0[i], q1[i]) of a namespace, or -1."""
        t = self.table
        return t.find_rows(t.ns_id(namespace_id), q0, q1)

    def find_packed(self, namespace_id: bytes, packed: bytes) -> I64:
        """`find_chain` of packed 16-byte hashes (N x 16 bytes, not necessarily a chain's
        prefix), in one vectorized probe."""
        q = np.frombuffer(packed, "<u8")
        return self.find_chain(namespace_id, q[0::2], q[1::2])

    def add_pending(self, namespace_id: bytes, q0: U64, q1: U64, at: I64, parent_hash: bytes | None,
                    nbytes: int, itemsize: int, slots: Sequence[Slot], runs: RunParents | None = None) -> I64:
        """PENDING rows for the blocks at positions `at` of a chain (hash halves q0, q1),
        block `at[k]` with one copy, in slots[k], in whole-column steps. A block's parent
        is the chain's block before it, or `parent_hash` for the chain's first block.
        `runs`: the blocks are runs of one chain laid end to end, and the first block of
        each later run has the parent given there instead (`RunParents`)."""
        t = self.table
        rows = t.take_rows(len(at))
        t.ns[rows] = t.ns_id(namespace_id)
        t.h0[rows] = q0[at]
        t.h1[rows] = q1[at]
        prev = at - 1
        chained = prev >= 0
        heads = _EMPTY_I64
        if runs is not None and len(runs.starts):
            k = np.minimum(np.searchsorted(runs.starts, at), len(runs.starts) - 1)
            head = runs.starts[k] == at
            chained &= ~head
            heads = np.flatnonzero(head)
            k = k[heads]
            given = runs.has_parent[k]
            heads, k = heads[given], k[given]
        t.ph0[rows[chained]] = q0[prev[chained]]
        t.ph1[rows[chained]] = q1[prev[chained]]
        flags = np.full(len(rows), LIVE, np.uint8)
        flags[chained] |= HAS_PARENT
        if len(heads):
            assert runs is not None
            t.ph0[rows[heads]] = runs.q0[k]
            t.ph1[rows[heads]] = runs.q1[k]
            flags[heads] |= HAS_PARENT
        if parent_hash is not None and at[0] == 0:
            t.vph0[rows[0]], t.vph1[rows[0]] = _unpack_qq(parent_hash)
            flags[0] |= HAS_PARENT
        t.flags[rows] = flags
        t.nbytes[rows] = nbytes
        t.item[rows] = itemsize
        t.csum[rows] = 0
        names = {s.tier for s in slots}
        if len(names) == 1:
            t.lt[rows, 0] = t.tier_id(next(iter(names)))
        else:
            t.lt[rows, 0] = [t.tier_id(s.tier) for s in slots]
        t.lt[rows, 1] = 0
        t.lo[rows, 0] = [s.offset for s in slots]
        t.ls[rows, 0] = [s.size for s in slots]
        return rows

    def set_checksums(self, rows: I64, checksums: Sequence[int]) -> None:
        self.table.csum[rows] = np.array(checksums, np.uint64)

    def published_already(self, namespace_id: bytes, rows: I64) -> npt.NDArray[np.bool_]:
        """Which PENDING rows' keys a concurrent put has published meanwhile (one probe)."""
        t = self.table
        return t.find_rows(t.ns_id(namespace_id), t.h0[rows], t.h1[rows]) >= 0

    def discard_pending(self, row: int) -> None:
        """Give up a PENDING row (its put will not publish it); the caller frees its slot."""
        BlockEntry.of(self.table, row).clear_slots()
        self.table.free_row(row)

    def publish(self, rows: I64) -> None:
        """Make PENDING rows READY and publish them, in one vectorized step."""
        self.table.flags[rows] |= READY
        self.add_rows(rows)

    def queue_ssd_writes(self, rows: I64) -> list[BlockEntry]:
        """Mark rows as queued for an SSD write (so they are not recycled before the writer
        has seen them); their entries, in order."""
        t = self.table
        t.flags[rows] |= SSD_QUEUED
        return [BlockEntry.of(t, row) for row in rows.tolist()]

    def unqueue_ssd_writes(self, rows: I64) -> None:
        """Clear rows' queued SSD write (`queue_ssd_writes`): the write-through writer
        skips them (replicas, `CopyBook.mark_replicas`)."""
        self.table.flags[rows] &= np.uint8(~SSD_QUEUED & 0xFF)

    def sole_tier_ids(self, rows: I64) -> npt.NDArray[np.uint8]:
        """The tier id of each row's only copy; 0 for a row with more than one copy (a
        third one comes only after a second) or none."""
        lt = self.table.lt
        return np.where(lt[rows, 1] == 0, lt[rows, 0], 0).astype(np.uint8)

    def generations(self, rows: I64) -> list[int]:
        """Each row's generation (what a handle of it carries; see `held`)."""
        return self.table.gen[rows].tolist()  # type: ignore[no-any-return]

    def nbytes_of(self, rows: I64) -> I64:
        return self.table.nbytes[rows].astype(np.int64)

    @staticmethod
    def rows_of(entries: Sequence[BlockEntry]) -> tuple[I64, I64]:
        """The rows of `entries` and the generation each was read at, as arrays (for
        `held`, which tells the ones still there in one step)."""
        n = len(entries)
        return (np.fromiter((e._row for e in entries), np.int64, n),
                np.fromiter((e._gen for e in entries), np.int64, n))

    def held(self, rows: I64, gens: I64) -> npt.NDArray[np.bool_]:
        """Which of these entries (`rows_of`) are still the blocks they were and not
        removed: `BlockEntry.removed` negated, for many at once."""
        t = self.table
        return (t.gen[rows] == gens) & ((t.flags[rows] & REMOVED) == 0)  # type: ignore[no-any-return]

    def checksums_of(self, rows: I64) -> list[int]:
        return self.table.csum[rows].tolist()  # type: ignore[no-any-return]

    def offsets_in(self, rows: I64, tier_id: int) -> list[int]:
        """The offset of each row's copy in tier `tier_id` (every row has one there)."""
        t = self.table
        lt, lo = t.lt[rows], t.lo[rows]
        second = lt[:, 1] == tier_id
        offsets: list[int] = np.where(second, lo[:, 1], lo[:, 0]).tolist()
        name = t.tier_names[tier_id]
        for i in np.flatnonzero(~second & (lt[:, 0] != tier_id)).tolist():
            offsets[i] = BlockEntry.of(t, int(rows[i])).locations[name].offset  # a third copy, mid-move
        return offsets
