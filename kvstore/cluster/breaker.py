"""Circuit breakers for the calls a node makes to the others: a peer whose calls keep
failing is marked suspect and skipped, so a dead or partitioned node costs at most a
couple of deadlines, not one per lookup.

A peer's breaker is closed while its calls succeed. `threshold` failures in a row open it
(the peer is suspect) for `cool_s`; then one call is let through (half-open): success
closes the breaker, failure opens it again for twice as long, up to `max_cool_s`. A peer
that leaves the view is forgotten (`forget`). Time comes from the injected clock.

Primitives: `Breakers` (`allow`, `success`, `failure`, `suspects`, `forget`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_THRESHOLD = 2
DEFAULT_MAX_COOL_S = 30.0


@dataclass(slots=True)
class _Breaker:
    failures: int = 0  # in a row
    open_until: float = 0.0  # suspect until then (0: closed)
    cool_s: float = 0.0  # the last opening's length
    probing: bool = False  # a half-open call is out
    trips: int = 0  # times it opened


class Breakers:
    def __init__(self, cool_s: float, *, threshold: int = DEFAULT_THRESHOLD, max_cool_s: float = DEFAULT_MAX_COOL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cool_s = cool_s
        self.threshold = threshold
        self.max_cool_s = max(max_cool_s, cool_s)
        self._clock = clock
        self._peers: dict[str, _Breaker] = {}

    def allow(self, node: str) -> bool:
        """Whether a call to `node` may go out now (a half-open probe counts as out)."""
        b = self._peers.get(node)
        if b is None or not b.open_until:
            return True
        if self._clock() < b.open_until or b.probing:
            return False
        b.probing = True
        return True

    def success(self, node: str) -> None:
        b = self._peers.get(node)
        if b is not None:
            b.failures = 0
            b.open_until = 0.0
            b.cool_s = 0.0
            b.probing = False

    def failure(self, node: str) -> None:
        b = self._peers.get(node)
        if b is None:
            b = self._peers[node] = _Breaker()
        b.failures += 1
        if b.probing or (not b.open_until and b.failures >= self.threshold):
            b.cool_s = min(self.max_cool_s, b.cool_s * 2 if b.cool_s else self.cool_s)
            b.open_until = self._clock() + b.cool_s
            b.probing = False
            b.trips += 1

    def suspect(self, node: str) -> bool:
        b = self._peers.get(node)
        return b is not None and bool(b.open_until)

    def suspects(self) -> dict[str, float]:
        """Suspect peers and how long until each is tried again (0: due for a probe)."""
        now = self._clock()
        return {n: max(0.0, b.open_until - now) for n, b in self._peers.items() if b.open_until}

    def trips(self, node: str) -> int:
        b = self._peers.get(node)
        return 0 if b is None else b.trips

    def forget(self, node: str) -> None:
        self._peers.pop(node, None)
