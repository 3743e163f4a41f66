"""Server interceptor: request ids in a contextvar, and `KVStoreError` -> gRPC status.

Servicers raise `kvstore.errors` exceptions; this is the one place they become a status
with the exception's message. Anything else that escapes a handler is a bug: it is
logged with its traceback and answered INTERNAL without leaking internals.
"""

from __future__ import annotations

import contextvars
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record so formats can print it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


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


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        common = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary or handler.stream_unary:
            inner = handler.unary_unary or handler.stream_unary

            async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
                request_id.set(_request_id(context))
                try:
                    return await inner(request, context)
                except Exception as exc:  # task boundary: map, log, answer
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await _abort(context, method, exc)

            make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
            return make(unary_response, **common)

        inner_stream = handler.unary_stream or handler.stream_stream

        async def stream_response(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request_id.set(_request_id(context))
            try:
                async for response in inner_stream(request, context):
                    yield response
            except Exception as exc:  # task boundary: map, log, answer
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await _abort(context, method, exc)

        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return make(stream_response, **common)
