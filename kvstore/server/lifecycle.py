"""The drain gate: how the daemon stops taking work without cutting work short.

Primitives: `DrainGate` (`close`, `refuses`, `enter`/`leave`, `wait_idle`, `in_flight`),
one of the steps of the per-call pipeline (`kvstore.server.pipeline`).

Why not only `grpc.aio.Server.stop(grace)`: it refuses every new RPC at once, and a
co-located client finishing a put through the shared-memory plane commits with a new
RPC (`LocalCommit`) after copying its bytes. Refusing it would lose a put the client
had every reason to expect to land. So shutdown first closes the gate: new RPCs are
answered UNAVAILABLE ("shutting down", which clients retry elsewhere or later), except
the ones that finish work already begun; then it waits until nothing is in flight (or
the grace time is spent), and only then stops the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvstore.deadlines import within

# Calls that complete work begun before shutdown.
ALLOWED_WHILE_DRAINING = frozenset({"/kvstore.v1.KVStore/LocalCommit", "/kvstore.v1.KVStore/LaneCommit"})
REFUSAL = "kvstore is shutting down; retry against another daemon or after it restarts"


class DrainGate:
    def __init__(self) -> None:
        self.closed = False
        self.in_flight = 0
        self._changed = asyncio.Event()

    def close(self) -> None:
        """From now on, refuse new calls except those in `ALLOWED_WHILE_DRAINING`."""
        self.closed = True

    async def wait_idle(self, deadline: float, also: Callable[[], bool] = lambda: True) -> bool:
        """Wait until no call is in flight and `also()` holds, or the loop time `deadline`;
        True if idle in time."""
        loop = asyncio.get_running_loop()
        while not (self.in_flight == 0 and also()):
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                # `also` may change without a call ending (a put rolled back by the sweep):
                # look again at least every 50 ms.
                await within(self._changed.wait(), min(left, 0.05))
            except TimeoutError:
                pass
        return True

    def refuses(self, method: str) -> bool:
        """Whether a new call of `method` (a gRPC method path) is refused now."""
        return self.closed and method not in ALLOWED_WHILE_DRAINING

    def enter(self) -> None:
        """An admitted call begins (on any transport)."""
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        self._changed.set()
