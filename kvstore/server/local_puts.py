"""The local data plane's server side: puts in flight whose bytes a co-located client
copies straight into PENDING slots of the host tier's shared-memory segment.

Primitives: `begin(txn) -> txn_id`, `take(txn_id)`, `expire(now)`. A begun put holds its
slots until it is committed, aborted, or its deadline passes (`ttl_ms`: the daemon's
`put_idle_timeout_s`, the same time a streamed Put may send nothing); a client that
vanishes mid-put therefore never leaks capacity (the daemon's sweep rolls it back).

Reservations (`reserve(slots, ...) -> id`, `take_reservation(id)`) are empty slots held
for a client's next put, which then takes one round trip: the client copies into them
and commits with the put's header. They expire like open puts, their slots freed.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.core.store import GroupedPutTxn, PutTxn
from kvstore.core.tier import Slot
from kvstore.errors import FailedPrecondition, ResourceExhausted
from kvstore.v1 import kvstore_pb2

DEFAULT_PUT_TTL_MS = 30_000


@dataclass(slots=True, eq=False)
class OpenPut:
    txn: PutTxn | GroupedPutTxn  # a grouped layout's: its parts, group-major
    header: kvstore_pb2.PutHeader | None  # what applies at commit (hints)
    expires_at: float
    tenant: str = ""  # only the tenant that began a put may commit or abort it


@dataclass(slots=True, eq=False)
class Reservation:
    slots: list[Slot]
    block_bytes: int
    expires_at: float
    free: Callable[[list[Slot]], None]  # gives the slots back to the store
    tenant: str = ""  # only the tenant that got a reservation may use it


class LocalPuts:
    def __init__(self, max_pending: int = 1024, ttl_ms: int = DEFAULT_PUT_TTL_MS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_pending = max_pending
        self.ttl_ms = ttl_ms
        self._clock = clock
        self._pending: dict[str, OpenPut] = {}
        self._reserved: dict[str, Reservation] = {}
        self._deadlines: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def reservations(self) -> int:
        return len(self._reserved)

    def reserve(self, slots: list[Slot], block_bytes: int, free: Callable[[list[Slot]], None],
                tenant: str = "") -> str:
        """Hold `slots` for a client's next put; returns the reservation's id."""
        self.expire()
        if len(self._pending) + len(self._reserved) >= self.max_pending:
            free(slots)
            raise ResourceExhausted(
                f"{self.max_pending} local puts and reservations are open; commit or abort them first"
            )
        res_id = secrets.token_hex(12)
        expires_at = self._clock() + self.ttl_ms / 1000.0
        self._reserved[res_id] = Reservation(slots, block_bytes, expires_at, free, tenant)
        heapq.heappush(self._deadlines, (expires_at, res_id))
        return res_id

    def pop_reservation(self, res_id: str, tenant: str = "") -> Reservation | None:
        """Reservation `res_id` of `tenant` removed from the table, or None if it is not
        open (another tenant's id is answered as if it were not open)."""
        self.expire()
        res = self._reserved.get(res_id)
        if res is None or res.tenant != tenant:
            return None
        del self._reserved[res_id]
        return res

    def take_reservation(self, res_id: str, tenant: str = "") -> Reservation:
        """Reservation `res_id` of `tenant`, removed from the table (the caller adopts or
        frees its slots)."""
        res = self.pop_reservation(res_id, tenant)
        if res is None:
            raise FailedPrecondition(
                f"slot reservation {res_id!r} is not open: it was used, aborted, or expired after "
                f"{self.ttl_ms} ms; put the blocks with LocalPut"
            )
        return res

    def begin(self, txn: PutTxn | GroupedPutTxn, header: kvstore_pb2.PutHeader | None = None, tenant: str = "") -> str:
        self.expire()
        if len(self._pending) >= self.max_pending:
            txn.abort()
            raise ResourceExhausted(
                f"{self.max_pending} local puts are open; commit or abort them before beginning more"
            )
        txn_id = secrets.token_hex(12)
        expires_at = self._clock() + self.ttl_ms / 1000.0
        self._pending[txn_id] = OpenPut(txn, header, expires_at, tenant)
        heapq.heappush(self._deadlines, (expires_at, txn_id))
        return txn_id

    def take(self, txn_id: str, tenant: str = "") -> OpenPut:
        """The open put `txn_id` of `tenant`, removed from the table (the caller commits or
        aborts it). Another tenant's id is answered as if it were not open."""
        self.expire()
        pending = self._pending.get(txn_id)
        if pending is not None and pending.tenant == tenant:
            del self._pending[txn_id]
        else:
            pending = None
        if pending is None:
            raise FailedPrecondition(
                f"local put {txn_id!r} is not open: it was committed, aborted, or rolled back after "
                f"{self.ttl_ms} ms; begin the put again"
            )
        return pending

    def expire(self) -> int:
        now = self._clock()
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, txn_id = heapq.heappop(self._deadlines)
            pending = self._pending.pop(txn_id, None)
            if pending is not None:
                pending.txn.abort()
                expired += 1
            res = self._reserved.pop(txn_id, None)
            if res is not None:
                res.free(res.slots)
                expired += 1
        return expired

    def abort_all(self) -> None:
        for pending in self._pending.values():
            pending.txn.abort()
        self._pending.clear()
        for res in self._reserved.values():
            res.free(res.slots)
        self._reserved.clear()
        self._deadlines.clear()
