"""Held slots: empty host-tier slots the daemon keeps for a client's next put of one
block size (`reserve_ahead`), so that put takes one round trip instead of two.

`HeldReservations` is what a client holds, by block size: each answer to a put hands
out at most one reservation (`keep`), and each put takes at most one (`take`): the one
that fits, or the id of one that does not, for the two-trip put to hand back. Either
way a reservation serves one put. Threads (or tasks) sharing a client each take their
own, so a client holds as many as its puts ran at once, at most MAX_HELD per block size:
`keep` hands one more back to be released at once. (A client that kept one per block
size, each answer replacing the last, left its other threads' reservations on the
daemon with nobody to use them: their slots stayed taken until put_idle_timeout_s,
and four threads re-putting a few chains filled an 8 MiB host tier in a second.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.v1 import kvstore_pb2

# One-trip puts: the most empty slots a client asks the daemon to hold for its next put.
MAX_RESERVE_AHEAD = 1024
# Reservations a client holds per block size: one per put it runs at once, up to this.
MAX_HELD = 8


@dataclass(slots=True)
class HeldSlots:
    """A daemon-side reservation of empty host slots for this client's next put."""

    reservation_id: str
    offsets: list[int]
    usable_until: float  # monotonic; half the reservation's lifetime, so it never expires mid-copy
    boot_id: int = 0  # the start of the daemon that holds it (its slots are in that start's segment)


def check_reserve_ahead(count: int) -> int:
    if not 0 <= count <= MAX_RESERVE_AHEAD:
        raise InvalidArgument(f"reserve_ahead must be in [0, {MAX_RESERVE_AHEAD}], got {count}")
    return count


class HeldReservations:
    """The reservations the daemon holds for one client, by block size (module docstring).
    Safe to share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_size: dict[int, list[HeldSlots]] = {}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(held) for held in self._by_size.values())

    def room(self, block_bytes: int) -> bool:
        """Whether a put of this block size should ask for slots ahead (fewer than MAX_HELD held)."""
        with self._lock:
            return len(self._by_size.get(block_bytes, ())) < MAX_HELD

    def keep(self, reservation: kvstore_pb2.SlotReservation, boot_id: int = 0) -> HeldSlots | None:
        """Remember a reservation the daemon (start `boot_id`) returned; a reservation to
        hand back now instead (this one, when MAX_HELD of its size are held already)."""
        if not reservation.reservation_id:
            return None
        slots = HeldSlots(reservation.reservation_id, list(reservation.offsets),
                          time.monotonic() + reservation.expires_in_ms / 2000.0, boot_id)
        with self._lock:
            held = self._by_size.setdefault(reservation.block_bytes, [])
            if len(held) >= MAX_HELD:
                return slots
            held.append(slots)
        return None

    def take(self, block_bytes: int, num_blocks: int, boot_id: int = 0) -> tuple[HeldSlots | None, str]:
        """(a reservation to put `num_blocks` blocks in one round trip, if one fits; else
        the id of one that does not, for the two-trip put to hand back). One of another
        start of the daemon than `boot_id` went with that start, and is dropped; so is
        one past its usable time beyond the one handed back (the daemon frees it when it
        expires)."""
        now = time.monotonic()
        with self._lock:
            held = self._by_size.get(block_bytes)
            if not held:
                return None, ""
            fits = [s for s in held if s.boot_id == boot_id and now < s.usable_until]
            for i, slots in enumerate(fits):
                if len(slots.offsets) >= num_blocks:
                    del fits[i]
                    self._by_size[block_bytes] = fits
                    return slots, ""
            # None fits: hand back one of this start (a used-up one first), keep the rest.
            unfit = [s for s in held if s.boot_id == boot_id and now >= s.usable_until] or fits[:1]
            if unfit:
                fits = [s for s in fits if s is not unfit[0]]
            self._by_size[block_bytes] = fits
            return None, unfit[0].reservation_id if unfit else ""

    def keep_only(self, boot_id: int) -> None:
        """Drop every reservation of another start of the daemon (they went with it)."""
        with self._lock:
            self._by_size = {size: kept for size, held in self._by_size.items()
                             if (kept := [s for s in held if s.boot_id == boot_id])}

    def take_all(self) -> list[HeldSlots]:
        """Every reservation held, now no longer held (to hand them back on close)."""
        with self._lock:
            taken = [s for held in self._by_size.values() for s in held]
            self._by_size = {}
        return taken
