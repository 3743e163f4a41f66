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

Primitives: `get`, `add`, `remove`, `longest_ready_prefix`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from operator import attrgetter

from kvstore.tiers.base import Slot


_new_entry = object.__new__


class BlockState(enum.Enum):
    PENDING = "pending"  # bytes are landing; owned by a put transaction
    READY = "ready"  # fully written and checksummed; visible to lookups


class BlockEntry:
    """One block's metadata. Mutable: pins and state change over its life.

    Kept small, because a node indexes millions of blocks: `__slots__`, no per-entry
    containers in the common case. A block lives in one tier most of its life, so its
    copies are held as one `Slot` (or a tuple of them while it has several, or None)
    rather than a dict; `locations` gives the dict-like view of them by tier name.
    `retired` is None until a location is taken away under a reader.
    """

    __slots__ = ("key", "parent", "nbytes", "checksum", "_locs", "state", "itemsize", "pins", "readers",
                 "removed", "retired", "ssd_queued")

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
    ) -> None:
        self.key = key
        self.parent = parent
        self.nbytes = nbytes
        self.checksum = checksum
        self._locs: Slot | tuple[Slot, ...] | None = None
        self.state = state
        # Element size of the namespace's dtype: the SSD codec shuffles byte planes by it.
        self.itemsize = itemsize
        # Leases (lookup pins and explicit pins) holding this block in place.
        self.pins = pins
        # Reads in flight; a removed block's slot is freed only when the last one ends.
        self.readers = readers
        self.removed = False
        # Locations taken away while readers held the entry; freed when the last one ends.
        self.retired: list[Slot] | None = None
        # Waiting in the SSD write-through queue.
        self.ssd_queued = False
        if locations:
            for name, slot in locations.items():
                assert slot.tier == name, f"slot of tier {slot.tier} filed under {name}"
                self.add_slot(slot)

    @classmethod
    def recovered(cls, key: bytes, parent: bytes | None, nbytes: int, checksum: int, itemsize: int,
                  slot: Slot) -> BlockEntry:
        """A READY entry with one copy in `slot` (a restart makes one per block: no
        keyword handling, no `add_slot` call, the same fields as `__init__` sets)."""
        self = _new_entry(cls)
        self.key = key
        self.parent = parent
        self.nbytes = nbytes
        self.checksum = checksum
        self._locs = slot
        self.state = BlockState.READY
        self.itemsize = itemsize
        self.pins = 0
        self.readers = 0
        self.removed = False
        self.retired = None
        self.ssd_queued = False
        return self

    def __repr__(self) -> str:
        return (f"BlockEntry(key={self.key.hex()}, state={self.state.value}, tiers={self.tier_names()}, "
                f"pins={self.pins}, readers={self.readers}, removed={self.removed})")

    @property
    def evictable(self) -> bool:
        return self.pins == 0 and self.readers == 0 and self.state is BlockState.READY

    # -- locations (one Slot per tier holding a copy, in the order they were added)

    @property
    def locations(self) -> Locations:
        """The copies by tier name, as a mutable mapping view (no copy)."""
        return Locations(self)

    def slots(self) -> tuple[Slot, ...]:
        locs = self._locs
        if locs is None:
            return ()
        if type(locs) is tuple:
            return locs
        return (locs,)  # type: ignore[return-value]

    def tier_names(self) -> list[str]:
        return [s.tier for s in self.slots()]

    def only_tier(self) -> str | None:
        """The tier of the single copy, or None when there are none or several (the fast path)."""
        locs = self._locs
        if locs is None or type(locs) is tuple:
            return None
        return locs.tier  # type: ignore[union-attr]

    def slot_in(self, tier: str) -> Slot | None:
        locs = self._locs
        if locs is None:
            return None
        if type(locs) is tuple:
            for s in locs:  # type: ignore[union-attr]
                if s.tier == tier:
                    return s
            return None
        return locs if locs.tier == tier else None  # type: ignore[union-attr,return-value]

    def add_slot(self, slot: Slot) -> None:
        """Record a copy; replaces the copy in the same tier, if any."""
        if self._locs is None:
            self._locs = slot
            return
        rest = [s for s in self.slots() if s.tier != slot.tier]
        self._set([*rest, slot])

    def pop_slot(self, tier: str) -> Slot:
        slot = self.slot_in(tier)
        if slot is None:
            raise KeyError(tier)
        self._set([s for s in self.slots() if s is not slot])
        return slot

    def clear_slots(self) -> None:
        self._locs = None

    def _set(self, slots: list[Slot]) -> None:
        self._locs = None if not slots else slots[0] if len(slots) == 1 else tuple(slots)

    def retire(self, slot: Slot) -> None:
        if self.retired is None:
            self.retired = [slot]
        else:
            self.retired.append(slot)


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


_KEY = attrgetter("key")
_STATE = attrgetter("state")


def make_key(namespace_id: bytes, block_hash: bytes) -> bytes:
    return namespace_id + block_hash


class BlockIndex:
    def __init__(self) -> None:
        self._entries: dict[bytes, BlockEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[BlockEntry]:
        return iter(self._entries.values())

    def get(self, key: bytes) -> BlockEntry | None:
        return self._entries.get(key)

    def add(self, entry: BlockEntry) -> None:
        assert entry.state is BlockState.READY, "only READY blocks enter the index"
        assert entry.key not in self._entries, "a key is published at most once"
        self._entries[entry.key] = entry

    def add_many(self, entries: Sequence[BlockEntry]) -> None:
        """`add` each entry (a rebuild or a put's blocks), checked, then inserted in one step."""
        fresh = dict(zip(map(_KEY, entries), entries))
        assert len(fresh) == len(entries) and self._entries.keys().isdisjoint(fresh), \
            "a key is published at most once"
        assert set(map(_STATE, entries)) <= {BlockState.READY}, "only READY blocks enter the index"
        if self._entries:
            self._entries.update(fresh)
        else:
            self._entries = fresh  # a rebuild into an empty index: no second table

    def remove(self, key: bytes) -> BlockEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.removed = True
        return entry

    def longest_ready_prefix(self, keys: Sequence[bytes]) -> list[BlockEntry]:
        """Entries of the longest prefix of `keys` that is READY, in order."""
        # One C-level pass, no Python step per block (lookups name up to thousands).
        out: list[BlockEntry | None] = list(map(self._entries.get, keys))
        try:
            del out[out.index(None):]
        except ValueError:
            pass
        return out  # type: ignore[return-value]  # no None is left
