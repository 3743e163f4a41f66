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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.tiers.base import Slot


class BlockState(enum.Enum):
    PENDING = "pending"  # bytes are landing; owned by a put transaction
    READY = "ready"  # fully written and checksummed; visible to lookups


@dataclass(slots=True, eq=False)
class BlockEntry:
    """One block's metadata. Mutable: pins and state change over its life."""

    key: bytes
    parent: bytes | None
    nbytes: int
    checksum: int
    locations: dict[str, Slot] = field(default_factory=dict)
    state: BlockState = BlockState.PENDING
    # Element size of the namespace's dtype: the SSD codec shuffles byte planes by it.
    itemsize: int = 2
    # Leases (lookup pins and explicit pins) holding this block in place.
    pins: int = 0
    # Reads in flight; a removed block's slot is freed only when the last one ends.
    readers: int = 0
    removed: bool = False
    # Locations taken away while readers held the entry; freed when the last one ends.
    retired: list[Slot] = field(default_factory=list)
    # Waiting in the SSD write-through queue.
    ssd_queued: bool = False

    @property
    def evictable(self) -> bool:
        return self.pins == 0 and self.readers == 0 and self.state is BlockState.READY


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

    def remove(self, key: bytes) -> BlockEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.removed = True
        return entry

    def longest_ready_prefix(self, keys: Sequence[bytes]) -> list[BlockEntry]:
        """Entries of the longest prefix of `keys` that is READY, in order."""
        out: list[BlockEntry] = []
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                break
            out.append(entry)
        return out
