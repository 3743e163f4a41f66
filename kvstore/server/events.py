"""Block events for KV-aware routers: which blocks a daemon holds, as it changes.

Like vLLM's KV events, a subscriber sees `STORED` (blocks became visible in a tier),
`REMOVED` (blocks left the daemon) and `MOVED` (blocks changed tier), each with the
namespace id, the block hashes and the tier. A router applies them to its own map of
"which node holds which prefix".

Primitives: `EventBus` (the store's observer; `subscribe`, `close`), `Subscription` (an
async iterator of `BlockEvent`), `EventKind`.

Slow consumers never block the store. The store calls the bus synchronously from the
event loop and the bus only appends to bounded per-subscriber queues. When a queue is
full, the subscriber has already lost track, so its buffered events are discarded, the
loss is counted, and a single `RESYNC` marker (with how many events were lost) takes their
place; events after the marker are delivered normally. A consumer that sees `RESYNC`
re-reads the daemon's state (subscribe again with `snapshot`) and carries on.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from kvstore.core.store import BlockGroup
from kvstore.errors import ResourceExhausted, Unavailable

logger = logging.getLogger(__name__)

# Each subscriber may buffer a full queue; the cap bounds the memory all of them can take.
MAX_SUBSCRIBERS = 256


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    MOVED = "moved"
    RESYNC = "resync"


@dataclass(frozen=True, slots=True)
class BlockEvent:
    seq: int  # bus-wide, increasing; gaps mean events this subscriber did not get
    kind: EventKind
    namespace_id: bytes
    block_hashes: tuple[bytes, ...]
    # By name (config and stats speak of tiers so); WatchEvents sends each as the Tier enum too.
    tier: str  # STORED/MOVED: where the blocks are now; REMOVED: where they were
    from_tier: str = ""  # MOVED only
    dropped: int = 0  # RESYNC only: events lost since the last delivered one


class Subscription:
    """One consumer's bounded queue. Iterate it; `close` it when done."""

    def __init__(self, bus: EventBus, namespace_id: bytes, queue_size: int) -> None:
        self._bus = bus
        self.namespace_id = namespace_id
        self.queue_size = queue_size
        self._queue: deque[BlockEvent] = deque()
        self._wakeup = asyncio.Event()
        self._lost = 0
        self.closed = False

    def _offer(self, event: BlockEvent) -> None:
        if self.namespace_id and event.namespace_id != self.namespace_id:
            return
        if len(self._queue) >= self.queue_size:
            # Everything buffered is now useless to a consumer that must resync anyway.
            lost = sum(1 for e in self._queue if e.kind is not EventKind.RESYNC) + 1
            self._lost += lost
            self._bus.dropped += lost
            self._queue.clear()
            self._queue.append(BlockEvent(event.seq, EventKind.RESYNC, b"", (), "", dropped=self._lost))
            self._wakeup.set()
            return
        self._queue.append(event)
        self._wakeup.set()

    def _push_front(self, events: Sequence[BlockEvent]) -> None:
        self._queue.extendleft(reversed(events))
        if events:
            self._wakeup.set()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._bus._subscribers.discard(self)
            self._wakeup.set()

    def __aiter__(self) -> AsyncIterator[BlockEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[BlockEvent]:
        while True:
            while self._queue:
                event = self._queue.popleft()
                if event.kind is EventKind.RESYNC:
                    self._lost = 0
                yield event
            if self.closed:
                return
            self._wakeup.clear()
            await self._wakeup.wait()


class EventBus:
    """Fans store changes out to subscribers; the store's observer (see `Store.observer`)."""

    def __init__(self, queue_size: int = 4096) -> None:
        self.queue_size = queue_size
        self._subscribers: set[Subscription] = set()
        self._seq = 0
        self.published = 0
        self.dropped = 0
        self._closed = False

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(
        self, namespace_id: bytes = b"", queue_size: int = 0, snapshot: Sequence[BlockGroup] = ()
    ) -> Subscription:
        """A new subscription, optionally starting with STORED events for `snapshot`.

        Call it in the same synchronous step that took the snapshot: no event can fall
        between the two, so the consumer's view is exact.
        """
        if self._closed:
            raise Unavailable("the daemon is shutting down; watch another daemon or retry after it restarts")
        if len(self._subscribers) >= MAX_SUBSCRIBERS:
            raise ResourceExhausted(
                f"{MAX_SUBSCRIBERS} event streams are already open; close unused WatchEvents streams"
            )
        size = min(queue_size, self.queue_size) if queue_size > 0 else self.queue_size
        sub = Subscription(self, namespace_id, size)
        initial = [
            BlockEvent(self._seq, EventKind.STORED, g.namespace_id, g.block_hashes, g.tier)
            for g in snapshot
            if not namespace_id or g.namespace_id == namespace_id
        ]
        # The snapshot is not bounded by the queue size: it is the state, not a backlog.
        sub._push_front(initial)
        self._subscribers.add(sub)
        return sub

    def publish(
        self, kind: EventKind, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str, from_tier: str = ""
    ) -> None:
        if not block_hashes:
            return
        self._seq += 1
        self.published += 1
        if not self._subscribers:
            return
        event = BlockEvent(self._seq, kind, namespace_id, tuple(block_hashes), tier, from_tier)
        for sub in list(self._subscribers):
            sub._offer(event)

    # The store's observer hooks.
    def blocks_stored(self, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str) -> None:
        self.publish(EventKind.STORED, namespace_id, block_hashes, tier)

    def blocks_removed(self, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str) -> None:
        self.publish(EventKind.REMOVED, namespace_id, block_hashes, tier)

    def blocks_moved(self, namespace_id: bytes, block_hashes: Sequence[bytes], from_tier: str, to_tier: str) -> None:
        self.publish(EventKind.MOVED, namespace_id, block_hashes, to_tier, from_tier)

    def close(self) -> None:
        """End every subscription (their iterators finish after what is buffered) and
        refuse new ones: a stream opened during the drain would hold it open."""
        self._closed = True
        for sub in list(self._subscribers):
            sub.close()
