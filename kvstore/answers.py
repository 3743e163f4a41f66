"""Result values that the daemon's store and the SDK share field for field: what a pin
granted and what a prefetch did. (A lookup's and a put's results differ between the two:
the store's carry tier ids and namespace ids the SDK reads differently, so each side
keeps its own, `PrefixLookup`/`PutOutcome` in the core and `LookupResult`/`PutResult`
in the SDK.)"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PinResult:
    """A pin: the lease that holds the blocks, how many it holds, and for how long."""

    lease_id: str
    pinned: int
    expires_in_ms: int


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What a prefetch did: blocks raised into `tier`, already there, or missing."""

    tier: str
    requested: int
    raised: int  # copied or moved up into the tier by this call
    already: int  # were in the tier (or above it) already
    missing: int  # not in the store, or failed verification on the way up
    skipped: int = 0  # no room in the target: everything there pinned, held or PENDING
