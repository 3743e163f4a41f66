"""Held slots: empty host-tier slots the daemon keeps for a client's next put of one
block size (`reserve_ahead`), so that put takes one round trip instead of two.

A client keeps at most one `HeldSlots` per block size (`keep_held` records what an
answer handed out); `take_held` hands a reservation to the put that fits it, or the id
of one that does not fit, for the two-trip put to give back. Either way a reservation
serves one put.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.v1 import kvstore_pb2

# One-trip puts: the most empty slots a client asks the daemon to hold for its next put.
MAX_RESERVE_AHEAD = 1024


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


def keep_held(held: dict[int, HeldSlots], reservation: kvstore_pb2.SlotReservation, boot_id: int = 0) -> None:
    """Remember a reservation the daemon (start `boot_id`) returned (replacing any for
    that block size)."""
    if reservation.reservation_id:
        held[reservation.block_bytes] = HeldSlots(
            reservation.reservation_id, list(reservation.offsets),
            time.monotonic() + reservation.expires_in_ms / 2000.0, boot_id)


def take_held(held: dict[int, HeldSlots], block_bytes: int, num_blocks: int,
              boot_id: int = 0) -> tuple[HeldSlots | None, str]:
    """(the reservation to put `num_blocks` blocks in one round trip, if one fits; else
    the id of the one that does not, for the two-trip put to hand back). A reservation
    serves one put either way; one of another start of the daemon than `boot_id` went
    with that start, and is dropped."""
    slots = held.pop(block_bytes, None)
    if slots is None or slots.boot_id != boot_id:
        return None, ""
    if len(slots.offsets) < num_blocks or time.monotonic() >= slots.usable_until:
        return None, slots.reservation_id
    return slots, ""
