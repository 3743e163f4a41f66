"""The `Tier` contract: a place that holds block bytes, with exact accounting.

A tier is data plane only: it stores, loads and frees whole blocks at a `Slot`, and
knows nothing of leases, policies or other tiers (the store's control plane does). The
base class owns capacity accounting; an implementation provides the `_primitives`.

Two levels of the contract:
- Every tier: `has_room`, `put_block` (store a whole block, None when there is no room),
  `get_block` (a copy of its bytes), `free`, `close`, `describe`. This is what the
  store uses to move blocks between tiers, and what the contract suite checks.
- Addressable tiers (`addressable = True`: memory, host, HBM) also let a caller
  `allocate` a slot and `write` chunks into it as they arrive (the streaming put path),
  and may hand out a zero-copy `view`.

Writes and reads are coroutines so that tiers whose bytes move off the event loop
(SSD files, CUDA streams) share one interface with the memory-addressable ones.

Capabilities the store plans with are declared here, never probed for: `addressable`,
`has_host_view`, `inclusive` (its copy stays next to the copies above it), `spaces` (it
keeps each space's blocks in memory of its own: `allocate` and `allocate_many` take the
space, and tiers without spaces ignore it), `recover` (blocks that survived a restart),
`region_keys` (what must go for a victim's room to come back), and `copier_from_host` /
`copier_to_host` (a tier's own transfer handlers).

`SharedWindow` is what the shared-memory data plane needs of the tier whose memory
co-located clients map (the host tier): the segment a space's clients map, where a slot
lies in it, and prefaulting. The server depends on it, not on the tier's class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import threading

    from kvstore.codec_chooser import Choice


class Slot(NamedTuple):
    """Where a block's bytes live inside one tier. `size` is the accounted size.

    Immutable and compared by value. A named tuple rather than a frozen dataclass: the
    same 64 bytes, but made several times faster (an index holds millions, and a
    restart makes one per block).
    """

    tier: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a tier may record next to a block's bytes (the SSD log writes it to disk).

    `key` is namespace id + block hash (32 bytes); `parent` the previous block's key in
    its chain, if any; `checksum` the XXH3-64 of the uncompressed bytes; `itemsize` the
    element size of the KV dtype, which the SSD codec's byte-plane shuffle uses.
    """

    key: bytes
    parent: bytes | None
    checksum: int
    itemsize: int = 2


class RecoveredBlocks(Protocol):
    """The blocks a tier found at start (`Tier.recover`), as columns, no object per block.

    `records` is a numpy structured array, one row per block, with the fields `key` (32
    bytes: namespace id + block hash), `parent` (the parent's 16-byte block hash; its
    namespace is the block's own), `has_parent`, `checksum`, `raw_len` (payload bytes),
    `itemsize`, and the slot's `offset` and `size`. `checksum_failures`: records dropped
    because they did not verify.
    """

    @property
    def records(self) -> np.ndarray[Any, Any]: ...

    @property
    def checksum_failures(self) -> int: ...

    def __len__(self) -> int: ...


class SharedSegment(Protocol):
    """A shared-memory segment as a co-located client is told of it (the layout is
    `kvstore.shm`'s): a named one by `path`, an anonymous one by its descriptor `fd`,
    passed over the control lane ("" and -1 where it has none); `token` proves a mapping
    is of this segment, `capacity` is the size of its data area in bytes."""

    path: str
    fd: int
    token: bytes
    capacity: int


@runtime_checkable
class SharedWindow(Protocol):
    """A tier whose memory co-located clients map, to move block bytes with one memcpy.
    A tier with `spaces` keeps each space's blocks in a segment of their own."""

    spaces: bool

    def segment_for(self, space: int) -> SharedSegment:
        """The segment `space`'s clients map (a tier without spaces has one)."""
        ...

    def client_offsets(self, space: int, offsets: list[int]) -> list[int]:
        """The offsets, in `space`'s segment, of the leading slot `offsets` that lie in it;
        the run stops at the first that does not."""
        ...

    def prefault(self, stop: threading.Event | None = None) -> bool:
        """Fault the memory in now, until done or `stop` is set; False where it was not."""
        ...


class Tier(ABC):
    """One level of the hierarchy: capacity, accounting, and byte movement."""

    #: The tier's name in config, stats and the proto enum: hbm, host, ssd, memory.
    name: str
    #: Whether `allocate`/`write`/`view` work (bytes addressable at an offset).
    addressable: ClassVar[bool] = True
    #: Whether `view` returns host memory (copiers memcpy between such tiers).
    has_host_view: ClassVar[bool] = False
    #: Whether the tier keeps its copy of a block next to copies in the tiers above it
    #: (the SSD log) instead of holding blocks exclusively, as the memory tiers do among
    #: themselves: a block raised out of it stays in it, a hit in it may leave a copy
    #: above, and it is where write-through writes.
    inclusive: ClassVar[bool] = False
    #: Whether the tier keeps blocks of different spaces in memory of their own (the
    #: host tier with auth on: one shared-memory segment per tenant, so that a client
    #: can map its tenant's blocks and nobody else's). A space is a small int the store
    #: derives from a block's tenant; 0 where there is none. A slot's space is the
    #: tier's to record (in its offset, say): the store only passes it to `allocate`.
    spaces: bool = False

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._used_bytes = 0
        self._blocks = 0

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def blocks(self) -> int:
        return self._blocks

    def allocate(self, nbytes: int, space: int = 0, reclaim: bool = False) -> Slot | None:
        """Reserve room for `nbytes` (in `space`, for a tier with `spaces`); None when no
        free extent fits (the caller evicts).

        A tier with spaces may also answer None while it keeps free memory for the spaces
        that freed it recently (their next blocks then land on pages their clients have
        mapped already); `reclaim=True` takes that memory too, which the caller asks for
        only when nothing is left to evict."""
        slot = self._allocate(nbytes)
        if slot is not None:
            self._account(slot)
        return slot

    def allocate_many(self, nbytes: int, count: int, space: int = 0) -> list[Slot]:
        """Up to `count` slots of `nbytes` (fewer when the tier runs out of room: the
        caller evicts for the rest), as `allocate` gives them one by one."""
        slots: list[Slot] = []
        while len(slots) < count and (slot := self.allocate(nbytes, space)) is not None:
            slots.append(slot)
        return slots

    def _account(self, slot: Slot) -> None:
        self._account_many(slot.size, 1)

    def _account_many(self, size: int, count: int) -> None:
        """Count `count` new slots of `size` accounted bytes each."""
        self._used_bytes += size * count
        self._blocks += count
        assert self._used_bytes <= self.capacity_bytes, "tier accounting exceeded capacity"

    def free(self, slot: Slot) -> None:
        self._free(slot)
        self._used_bytes -= slot.size
        self._blocks -= 1
        assert self._used_bytes >= 0 and self._blocks >= 0, "tier accounting went negative"

    def fits(self, nbytes: int) -> bool:
        """Whether a block of `nbytes` could ever fit, even with everything evicted."""
        return self.accounted_size(nbytes) <= self.capacity_bytes

    def accounted_size(self, nbytes: int) -> int:
        """How many bytes of capacity a block of `nbytes` takes (alignment included)."""
        return nbytes

    def has_room(self, nbytes: int) -> bool:
        """Whether `put_block`/`allocate` of `nbytes` would succeed now without evicting."""
        return self.capacity_bytes - self._used_bytes >= self.accounted_size(nbytes)

    async def put_block(self, meta: BlockMeta, data: bytes | memoryview) -> Slot | None:
        """Store a whole block; None when there is no room (the caller evicts and retries)."""
        slot = self.allocate(len(data))
        if slot is None:
            return None
        try:
            await self.write(slot, 0, data)
        except BaseException:
            self.free(slot)
            raise
        return slot

    async def get_block(self, slot: Slot, nbytes: int) -> bytes:
        """A copy of the block's `nbytes` uncompressed bytes (the caller verifies them)."""
        return await self.read(slot, nbytes)

    @abstractmethod
    def _allocate(self, nbytes: int) -> Slot | None: ...

    @abstractmethod
    def _free(self, slot: Slot) -> None: ...

    @abstractmethod
    async def write(self, slot: Slot, offset: int, data: memoryview | bytes) -> None:
        """Copy `data` into the slot at `offset`."""

    @abstractmethod
    async def read(self, slot: Slot, nbytes: int) -> bytes:
        """A copy of the first `nbytes` of the slot."""

    def view(self, slot: Slot, nbytes: int) -> memoryview | None:
        """A zero-copy view of the slot for memory-addressable tiers, else None."""
        return None

    async def recover(self) -> RecoveredBlocks | None:
        """The blocks that survived a restart, for the store to index again; None for a
        tier that keeps nothing across restarts (memory)."""
        return None

    def region_keys(self, slot: Slot, key: bytes) -> list[bytes]:
        """The keys of the live blocks that must all go for the room of `key`'s copy at
        `slot` to come back, `key` among them. A tier that reclaims whole regions (the SSD
        log) names every live block of the slot's region; by default, just `key`."""
        return [key]

    def copier_from_host(self, src: Tier) -> Copier | None:
        """This tier's own copier for blocks coming from `src` (e.g. a DMA from a host
        view into device memory), or None to let the generic copiers do it."""
        return None

    def copier_to_host(self, dst: Tier) -> Copier | None:
        """This tier's own copier for blocks going to `dst`, or None."""
        return None

    def close(self) -> None:
        """Release the tier's memory or files. The tier is unusable afterwards."""

    def describe(self) -> dict[str, str]:
        """Facts for `Info` and logs (backing, pinned, direct I/O...)."""
        return {}

    def codec_choices(self) -> list[Choice]:
        """What this tier's lossless codec chooser knows (a tier that encodes blocks on
        their way in: the SSD tier), for stats, INFO and metrics; none by default."""
        return []


class Copier(ABC):
    """Moves `nbytes` from `src_slot` of `src` into the start of `dst_slot` of `dst`."""

    name: str = "copier"

    @abstractmethod
    async def copy(self, src: Tier, src_slot: Slot, dst: Tier, dst_slot: Slot, nbytes: int) -> None: ...


class BounceCopier(Copier):
    """Any pair of addressable tiers: `read` into bytes, then `write`. What a store uses
    when it is given no copier choice (the data plane offers faster ones)."""

    name = "bounce"

    async def copy(self, src: Tier, src_slot: Slot, dst: Tier, dst_slot: Slot, nbytes: int) -> None:
        await dst.write(dst_slot, 0, await src.read(src_slot, nbytes))
