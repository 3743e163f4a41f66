"""`BlockTracker`: what a KV-aware router keeps about one daemon, fed by its block events.

Primitives: `BlockTracker.apply` (one event), `BlockTracker.follow` (watch a daemon and
apply until stopped), `tier_of`, `prefix_length`.

The tracker holds, per namespace, the tier of every block the daemon reported. It starts
from a snapshot (a watch with `snapshot=True`) and applies STORED / REMOVED / MOVED
events after it. On RESYNC (the daemon dropped events because this consumer fell
behind) the map is no longer exact, so `follow` forgets it and watches again with a
fresh snapshot: the map is exact again once that snapshot has been applied.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvstore.client.admin import AdminClient
from kvstore.convert import TIER_NAMES
from kvstore.v1 import admin_pb2

logger = logging.getLogger(__name__)


class BlockTracker:
    def __init__(self) -> None:
        self._tiers: dict[bytes, dict[bytes, str]] = {}
        self.resyncs = 0
        self.events = 0

    def apply(self, event: admin_pb2.Event) -> bool:
        """Apply one event; False on RESYNC (the caller must reload a snapshot)."""
        self.events += 1
        if event.kind == admin_pb2.EVENT_RESYNC:
            self.resyncs += 1
            self._tiers.clear()
            return False
        blocks = self._tiers.setdefault(event.namespace_id, {})
        if event.kind in (admin_pb2.EVENT_STORED, admin_pb2.EVENT_MOVED):
            # The enum where the daemon sends it; the name from a daemon older than it.
            tier = TIER_NAMES.get(event.tier_enum, event.tier) if event.tier_enum else event.tier
            for h in event.block_hashes:
                blocks[h] = tier
        elif event.kind == admin_pb2.EVENT_REMOVED:
            for h in event.block_hashes:
                blocks.pop(h, None)
        return True

    def tier_of(self, namespace_id: bytes, block_hash: bytes) -> str | None:
        return self._tiers.get(namespace_id, {}).get(block_hash)

    def prefix_length(self, namespace_id: bytes, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a chain the daemon holds, as far as events tell."""
        blocks = self._tiers.get(namespace_id, {})
        n = 0
        for h in block_hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def blocks(self, namespace_id: bytes) -> int:
        return len(self._tiers.get(namespace_id, {}))

    def follow(self, admin: AdminClient, stop: threading.Event, *, namespace_id: bytes = b"",
               queue_size: int = 0) -> None:
        """Watch `admin`'s daemon and apply events until `stop` is set or the stream ends
        (the daemon shut down). Resubscribes with a snapshot after every RESYNC.

        A stream only notices `stop` when an event arrives; a caller that must stop at
        once closes the `AdminClient`, which ends the stream.
        """
        while not stop.is_set():
            self._tiers.clear()
            resync = False
            for event in admin.watch_events(namespace_id, snapshot=True, queue_size=queue_size):
                if not self.apply(event):
                    logger.info("block events: resync after %d dropped events", event.dropped)
                    resync = True
                    break
                if stop.is_set():
                    return
            if not resync:
                return
