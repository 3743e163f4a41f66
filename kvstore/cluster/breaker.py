"""Circuit breakers for the calls a node makes to the others: a peer whose calls keep
failing is marked suspect and skipped, so a dead or partitioned node costs at most a
couple of deadlines, not one per lookup.

A peer's breaker is closed while its calls succeed. `threshold` failures in a row open it
(the peer is suspect) for `cool_s`; then one call is let through (half-open): success
closes the breaker, failure opens it again for twice as long, up to `max_cool_s`. Time
comes from the injected clock.

The half-open call is claimed by the call itself, never by whoever plans calls: `ready`
answers whether a call may go out without claiming anything (a lookup round asks it of
every member while it decides whom to ask), and `attempt` is taken right before a call
is made. An `Attempt` ends with the call's verdict (`success`, `failure`) or, where the
call was not made or ended without one (nothing to send, cancelled, a local failure),
with `release`, which gives a probe back so the next call can be it; used as a context
manager it is released unless it got a verdict. A probe that nothing returned would keep
the peer suspect for good, whatever the others' calls find.

A peer that leaves the view and comes back, or restarts, is forgotten (`forget`): it
starts closed, and the verdicts of calls begun before that no longer count.

Primitives: `Breakers` (`ready`, `attempt`, `suspect`, `suspects`, `trips`, `forget`), `Attempt`.
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


class Attempt:
    """One call's claim on a peer's breaker, taken right before the call is made."""

    __slots__ = ("_breakers", "node", "_epoch", "probe", "_done")

    def __init__(self, breakers: Breakers, node: str, probe: bool) -> None:
        self._breakers = breakers
        self.node = node
        self._epoch = breakers._epochs.get(node, 0)  # how often the peer was forgotten before this call
        self.probe = probe  # this call is the half-open probe
        self._done = False

    def _current(self) -> _Breaker | None:
        """The peer's breaker (made if there is none), or None when the peer was forgotten
        since this call began: its verdict is of the peer as it was."""
        breakers = self._breakers
        if breakers._epochs.get(self.node, 0) != self._epoch:
            return None
        b = breakers._peers.get(self.node)
        if b is None:
            b = breakers._peers[self.node] = _Breaker()
        return b

    def success(self) -> None:
        if self._done:
            return
        self._done = True
        b = self._current()
        if b is not None:
            b.failures = 0
            b.open_until = 0.0
            b.cool_s = 0.0
            b.probing = False

    def failure(self) -> None:
        if self._done:
            return
        self._done = True
        b = self._current()
        if b is None:
            return
        b.failures += 1
        if (self.probe and b.probing) or (not b.open_until and b.failures >= self._breakers.threshold):
            breakers = self._breakers
            b.cool_s = min(breakers.max_cool_s, b.cool_s * 2 if b.cool_s else breakers.cool_s)
            b.open_until = breakers._clock() + b.cool_s
            b.probing = False
            b.trips += 1

    def release(self) -> None:
        """No verdict: the call was not made, or ended without one. A probe goes back."""
        if self._done:
            return
        self._done = True
        if self.probe:
            b = self._current()
            if b is not None:
                b.probing = False

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Breakers:
    def __init__(self, cool_s: float, *, threshold: int = DEFAULT_THRESHOLD, max_cool_s: float = DEFAULT_MAX_COOL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cool_s = cool_s
        self.threshold = threshold
        self.max_cool_s = max(max_cool_s, cool_s)
        self._clock = clock
        self._peers: dict[str, _Breaker] = {}
        self._epochs: dict[str, int] = {}  # node -> times forgotten

    def ready(self, node: str) -> bool:
        """Whether a call to `node` may go out now: its breaker is closed, or its cool-down
        is over and no probe is out. Claims nothing (see `attempt`)."""
        b = self._peers.get(node)
        return b is None or not b.open_until or (not b.probing and self._clock() >= b.open_until)

    def attempt(self, node: str) -> Attempt | None:
        """A claim for one call to `node` about to be made; None when it must not go out
        (suspect, or its probe is out). Where the breaker is half-open, this call is the
        probe: end it with a verdict, or `release` it."""
        b = self._peers.get(node)
        if b is None or not b.open_until:
            return Attempt(self, node, False)
        if b.probing or self._clock() < b.open_until:
            return None
        b.probing = True
        return Attempt(self, node, True)

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
        """`node` restarted, or left the view and came back: it starts closed, and calls
        begun before now no longer count for it."""
        self._peers.pop(node, None)
        self._epochs[node] = self._epochs.get(node, 0) + 1
