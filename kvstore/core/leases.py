"""Leases: short, self-expiring pins that keep blocks from being evicted.

A lookup may take a lease on the blocks it promised so that the fetch that follows
cannot lose them; `Pin` takes a longer one on purpose. Every lease has a deadline, so a
client that vanishes never leaks a pin. Expiry is driven by the store (kvstore.core.store
says when) through a heap ordered by deadline; a released lease leaves a stale heap item
that expiry skips. `grant` applies the caps (leases in all, per tenant, longest time).

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

import numpy as np
import numpy.typing as npt

from kvstore.core.index import BlockEntry, hold_pins, hold_readers, release_pins, release_readers
from kvstore.core.table import BlockTable
from kvstore.core.types import StoreLimits
from kvstore.errors import InvalidArgument, ResourceExhausted


@dataclass(slots=True, eq=False)
class Lease:
    """A lease on rows of one block table: their pins (and readers, if it `holds_bytes`)
    are counted up by one for as long as it lasts. Pinned rows are never recycled, so
    the rows still name the same blocks when the lease ends."""

    lease_id: str
    table: BlockTable
    rows: npt.NDArray[np.int64]
    expires_at: float
    holds_bytes: bool = False
    # The tenant the lease counts against (its namespace's tenant).
    tenant: str = "default"
    released: bool = field(default=False)


class LeaseTable:
    def __init__(self, readers_gone: Callable[[BlockEntry], None]) -> None:
        # Called, when a bytes-holding lease ends, for each of its blocks that this left
        # without readers and that has a slot to free (deleted, or a copy retired
        # meanwhile): frees it, now that nobody reads it.
        self._readers_gone = readers_gone
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
        self, table: BlockTable, rows: npt.NDArray[np.int64], expires_at: float, holds_bytes: bool = False,
        tenant: str = "default",
    ) -> Lease:
        """A lease on `rows` of `table` (current, indexed rows), counted in one array step
        each for pins and readers, not a step per block."""
        rows = np.array(rows, np.int64)  # the lease's own copy
        lease = Lease(secrets.token_hex(12), table, rows, expires_at, holds_bytes, tenant)
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        hold_pins(table, rows)
        if holds_bytes:
            hold_readers(table, rows)
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._deadlines, (expires_at, lease.lease_id))
        return lease

    def grant(
        self, table: BlockTable, rows: npt.NDArray[np.int64], ttl_ms: int, now: float, limits: StoreLimits,
        holds_bytes: bool = False, tenant: str = "default",
    ) -> Lease:
        """`acquire` for `ttl_ms` (at most `limits.max_lease_ms`), counted against `tenant`
        (the namespace's tenant) and the caps in `limits`. Checked before anything
        changes: a refused lease leaves no pin behind."""
        if ttl_ms < 0:
            raise InvalidArgument(f"lease time must be >= 0 ms, got {ttl_ms}")
        per_tenant = limits.max_leases_per_tenant
        if per_tenant is not None and (held := self.held(tenant)) >= per_tenant:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {held} leases active, the most max_leases_per_tenant ({per_tenant}) allows; "
                "release leases (Unpin) or wait for them to expire"
            )
        if len(self._leases) >= limits.max_leases:
            raise ResourceExhausted(
                f"{limits.max_leases} leases are active; release leases (Unpin) or wait for them to expire"
            )
        ttl_ms = min(ttl_ms, limits.max_lease_ms)
        return self.acquire(table, rows, now + ttl_ms / 1000.0, holds_bytes, tenant)

    def extend(self, lease_id: str, rows: npt.NDArray[np.int64]) -> bool:
        """Hold `rows` (current, indexed rows of the lease's table) under a lease still
        held, until it ends; False when it has ended already."""
        lease = self._leases.get(lease_id)
        if lease is None or not len(rows):
            return lease is not None
        rows = np.array(rows, np.int64)
        hold_pins(lease.table, rows)
        if lease.holds_bytes:
            hold_readers(lease.table, rows)
        lease.rows = np.concatenate([lease.rows, rows])
        return True

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
        t, rows = lease.table, lease.rows
        if not len(rows):
            return lease
        release_pins(t, rows)
        if lease.holds_bytes:
            release_readers(t, rows, self._readers_gone)
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
