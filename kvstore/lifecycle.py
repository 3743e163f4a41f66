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

# Calls that complete work begun before shutdown.
ALLOWED_WHILE_DRAINING = frozenset({"/kvstore.v1.KVStore/LocalCommit"})
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFUSAL = "kvstore is shutting down; retry against another daemon or after it restarts"


class DrainGate(grpc.aio.ServerInterceptor):
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
                await asyncio.wait_for(self._changed.wait(), min(left, 0.05))
            except TimeoutError:
                pass
        return True

    def _enter(self) -> None:
        self.in_flight += 1

    def _leave(self) -> None:
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
        refuse = self.closed and method not in ALLOWED_WHILE_DRAINING
        common = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary or handler.stream_unary:
            inner = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if refuse:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, REFUSAL)
                self._enter()
                try:
                    return await inner(request, context)
                finally:
                    self._leave()

            make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
            return make(unary, **common)

        inner_stream = handler.unary_stream or handler.stream_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if refuse:
                await context.abort(grpc.StatusCode.UNAVAILABLE, REFUSAL)
            self._enter()
            try:
                async for response in inner_stream(request, context):
                    yield response
            finally:
                self._leave()

        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return make(stream, **common)
