"""Leases: short, self-expiring pins that keep blocks from being evicted.

A lookup may take a lease on the blocks it promised so that the fetch that follows
cannot lose them; `Pin` takes a longer one on purpose. Every lease has a deadline, so a
client that vanishes never leaks a pin. Expiry is driven by the store (on each call and
by a periodic sweep) through a heap ordered by deadline; a released lease leaves a stale
heap item that the sweep skips.

A lease never blocks a delete: an explicit delete wins, and releasing a lease over a
deleted block is a no-op. A lease that `holds_bytes` (handed to a client that reads the
block's slot directly through shared memory) also counts as a reader, so a deleted
block's slot is not reused until that lease ends.
"""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.index import BlockEntry


@dataclass(slots=True, eq=False)
class Lease:
    lease_id: str
    entries: list[BlockEntry]
    expires_at: float
    holds_bytes: bool = False
    # The tenant the lease counts against (its namespace's tenant).
    tenant: str = "default"
    released: bool = field(default=False)


class LeaseTable:
    def __init__(self, end_read: Callable[[BlockEntry], None]) -> None:
        # Called for each block of a bytes-holding lease when it ends; frees the slot of a
        # block deleted meanwhile once its last reader is gone.
        self._end_read = end_read
        self._leases: dict[str, Lease] = {}
        self._deadlines: list[tuple[float, str]] = []
        # Active leases per tenant; a tenant leaves the map when its last lease ends.
        self._per_tenant: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def held(self, tenant: str) -> int:
        """How many leases `tenant` has active."""
        return self._per_tenant.get(tenant, 0)

    def acquire(
        self, entries: list[BlockEntry], expires_at: float, holds_bytes: bool = False, tenant: str = "default"
    ) -> Lease:
        lease = Lease(secrets.token_hex(12), entries, expires_at, holds_bytes, tenant)
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        for entry in entries:
            entry.pins += 1
            if holds_bytes:
                entry.readers += 1
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._deadlines, (expires_at, lease.lease_id))
        return lease

    def release(self, lease_id: str) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        lease.released = True
        left = self._per_tenant[lease.tenant] - 1
        if left:
            self._per_tenant[lease.tenant] = left
        else:
            del self._per_tenant[lease.tenant]
        for entry in lease.entries:
            entry.pins -= 1
            if lease.holds_bytes:
                self._end_read(entry)
        return lease

    def expire(self, now: float) -> int:
        """Release every lease whose deadline has passed; returns how many."""
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            if self.release(lease_id) is not None:
                expired += 1
        return expired

    def next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None
