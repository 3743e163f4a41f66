"""The per-call pipeline (`kvstore.server.pipeline`) as one gRPC server interceptor.

Primitives: `PipelineInterceptor(pipeline)`.

Each method's handler is wrapped once (`WrapCache`) in a behavior that reads what the
pipeline needs from the call (the `x-request-id` and `authorization` metadata, whether
the peer came through a Unix socket), runs the steps around the handler, and turns an
error into `context.abort(code, message)`. A handler that aborted by itself (grpc's
health servicer does) keeps its status; the metrics read it from the context.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvstore.server.auth import bearer_token
from kvstore.server.pipeline import CallSteps, Pipeline

UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]

MAX_REQUEST_ID_CHARS = 64
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def request_id_of(metadata: Any) -> str:
    """The caller's `x-request-id` (1 to 64 characters), or a fresh random one."""
    for key, value in metadata or ():
        if key == "x-request-id" and isinstance(value, str) and 0 < len(value) <= MAX_REQUEST_ID_CHARS:
            return value
    return secrets.token_hex(6)


def _status(context: grpc.aio.ServicerContext, failed: bool) -> grpc.StatusCode:
    """The status a call ended with, as the context holds it: an enum once a handler
    aborted or set one, else the core's int (0 for OK)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int) and not failed:
        return _STATUS_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK


def _enter(steps: CallSteps, context: grpc.aio.ServicerContext) -> Any:
    metadata = context.invocation_metadata()
    if steps.open:
        return steps.enter(None, False, request_id_of(metadata))
    return steps.enter(bearer_token(metadata), context.peer().startswith("unix:"), request_id_of(metadata))


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
    handler object per call are a measurable share of a small RPC). An entry is reused
    only while the inner handler is the same object."""

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


class PipelineInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline
        self._cache = WrapCache()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        path = handler_call_details.method
        return self._cache.get(path, handler, lambda: _wrap(self._pipeline.bind(path), handler))


def _wrap(steps: CallSteps, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def unary(inner: UnaryBehavior) -> UnaryBehavior:
        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            identity = None
            code = grpc.StatusCode.OK
            try:
                identity = _enter(steps, context)
                response = await inner(request, context)
                code = _status(context, False)
                return response
            except grpc.aio.AbortError:
                code = _status(context, True)
                raise
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED  # the client went away or the server is stopping
                raise
            except Exception as exc:  # task boundary: map, log, answer
                code, message = steps.failed(exc)
                await context.abort(code, message)
            finally:
                steps.leave(identity, code, start)

        return behavior

    def stream(inner: StreamBehavior) -> StreamBehavior:
        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            identity = None
            code = grpc.StatusCode.OK
            try:
                identity = _enter(steps, context)
                async for response in inner(request, context):
                    yield response
                code = _status(context, False)
            except grpc.aio.AbortError:
                code = _status(context, True)
                raise
            except (asyncio.CancelledError, GeneratorExit):
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:  # task boundary: map, log, answer
                code, message = steps.failed(exc)
                await context.abort(code, message)
            finally:
                steps.leave(identity, code, start)

        return behavior

    return wrap_handler(handler, unary, stream)
