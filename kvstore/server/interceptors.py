"""Server interceptor: request ids in a contextvar, and `KVStoreError` -> gRPC status.

Servicers raise `kvstore.errors` exceptions; this is the one place they become a status
with the exception's message. Anything else that escapes a handler is a bug: it is
logged with its traceback and answered INTERNAL without leaking internals.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvstore.errors import KVStoreError
from kvstore.logs import request_id

logger = logging.getLogger(__name__)

def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str) and 0 < len(value) <= 64:
            return value
    return secrets.token_hex(6)


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, KVStoreError):
        logger.debug("%s failed: %s: %s", method, exc.code.name, exc)
        await context.abort(exc.code, str(exc))
    logger.exception("%s failed unexpectedly", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the daemon's log")


UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable[[UnaryBehavior], UnaryBehavior],
    wrap_stream: Callable[[StreamBehavior], StreamBehavior],
) -> grpc.RpcMethodHandler:
    """The same handler with its behavior wrapped: `wrap_unary` for methods that answer
    once, `wrap_stream` for methods that answer with a stream. Serializers are kept."""
    common = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **common)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **common)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), **common)
    return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), **common)


class WrapCache:
    """Each method's wrapped handler, made once instead of on every call (closures and a
    handler object per interceptor per call are a measurable share of a small RPC). An
    entry is reused only while the inner handler is the same object."""

    def __init__(self) -> None:
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def get(self, method: str, handler: grpc.RpcMethodHandler,
            make: Callable[[], grpc.RpcMethodHandler]) -> grpc.RpcMethodHandler:
        hit = self._by_method.get(method)
        if hit is not None and hit[0] is handler:
            return hit[1]
        wrapped = make()
        self._by_method[method] = (handler, wrapped)
        return wrapped


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._cache = WrapCache()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        return self._cache.get(method, handler, lambda: self._wrap(method, handler))

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        def unary(inner: UnaryBehavior) -> UnaryBehavior:
            async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
                request_id.set(_request_id(context))
                try:
                    return await inner(request, context)
                except Exception as exc:  # task boundary: map, log, answer
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await _abort(context, method, exc)

            return behavior

        def stream(inner: StreamBehavior) -> StreamBehavior:
            async def behavior(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                request_id.set(_request_id(context))
                try:
                    async for response in inner(request, context):
                        yield response
                except Exception as exc:  # task boundary: map, log, answer
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await _abort(context, method, exc)

            return behavior

        return wrap_handler(handler, unary, stream)
