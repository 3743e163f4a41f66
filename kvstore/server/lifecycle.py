"""The drain gate: how the daemon stops taking work without cutting work short.

Primitives: `DrainGate` (a server interceptor; `close`, `wait_idle`, `in_flight`).

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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvstore.server.interceptors import StreamBehavior, UnaryBehavior, WrapCache, wrap_handler

# Calls that complete work begun before shutdown.
ALLOWED_WHILE_DRAINING = frozenset({"/kvstore.v1.KVStore/LocalCommit"})
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFUSAL = "kvstore is shutting down; retry against another daemon or after it restarts"


class DrainGate(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.closed = False
        self.in_flight = 0
        self._changed = asyncio.Event()
        self._cache = WrapCache()

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
                await asyncio.wait_for(self._changed.wait(), min(left, 0.05))
            except TimeoutError:
                pass
        return True

    def refuses(self, method: str) -> bool:
        """Whether a new call of `method` (a gRPC method path) is refused now."""
        return self.closed and method not in ALLOWED_WHILE_DRAINING

    def enter(self) -> None:
        """A call begins (calls that do not pass through gRPC count here too)."""
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        self._changed.set()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            # Never refused, never waited for: a health Watch stream lives as long as its
            # client, and probes must read NOT_SERVING during the drain.
            return handler
        return self._cache.get(method, handler, lambda: self._wrap(method, handler))

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        def unary(inner: UnaryBehavior) -> UnaryBehavior:
            async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if self.refuses(method):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, REFUSAL)
                self.enter()
                try:
                    return await inner(request, context)
                finally:
                    self.leave()

            return behavior

        def stream(inner: StreamBehavior) -> StreamBehavior:
            async def behavior(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if self.refuses(method):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, REFUSAL)
                self.enter()
                try:
                    async for response in inner(request, context):
                        yield response
                finally:
                    self.leave()

            return behavior

        return wrap_handler(handler, unary, stream)
