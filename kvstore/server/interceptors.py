"""The per-call pipeline (`kvstore.server.pipeline`) as one gRPC server interceptor.

Primitives: `PipelineInterceptor(pipeline)`; `parse_or_mark(deserializer, name,
streaming)` and `UNPARSED` (requests that do not parse, below).

Each method's handler is wrapped once (`WrapCache`) in a behavior that reads what the
pipeline needs from the call (the `x-request-id` and `authorization` metadata, whether
the peer came through a Unix socket), runs the steps around the handler, and turns an
error into `context.abort(code, message)`. A handler that aborted by itself (grpc's
health servicer does) keeps its status; the metrics read it from the context. A stream
handler is either an async generator (ours: the wrapper yields what it yields) or a
coroutine that answers with `context.write` (grpcio's health `Watch`: the wrapper awaits
it); both take the same steps.

Request bytes that do not parse are the caller's error, answered INVALID_ARGUMENT
through the same error mapping (one DEBUG line, no traceback), on every method. grpc
runs a handler's request deserializer before the behavior for a single request, and
reports a deserializer that raises as UNKNOWN with a traceback in the log; so each
deserializer is wrapped (`parse_or_mark`): a single request that does not parse
becomes `UNPARSED`, which the behavior refuses after the pipeline's steps have run
(the drain gate and auth first, so a caller without a token is answered
UNAUTHENTICATED, exactly as for a well-formed request); a message of a request stream
that does not parse raises `InvalidArgument` where the handler reads it, which is
after the steps too.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from kvstore.errors import InvalidArgument
from kvstore.server.auth import bearer_token, peer_call
from kvstore.server.pipeline import CallSteps, Pipeline

UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]

MAX_REQUEST_ID_CHARS = 64
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}

# What a wrapped deserializer hands grpc for a single request that does not parse.
UNPARSED: Any = object()


def parse_or_mark(deserializer: Callable[[bytes], Any] | None, name: str,
                  streaming: bool) -> Callable[[bytes], Any] | None:
    """`deserializer` that never raises into grpc's call setup: bytes that do not parse
    give `UNPARSED` (a single request) or raise `InvalidArgument` (a message of a request
    stream, raised where the handler reads it)."""
    if deserializer is None:
        return None
    parse = deserializer  # bound for the closures (mypy does not carry the narrowing into them)
    if streaming:
        def parse_message(raw: bytes) -> Any:
            try:
                return parse(raw)
            except (DecodeError, ValueError):
                raise InvalidArgument(f"a {name} request message does not parse") from None

        return parse_message

    def parse_request(raw: bytes) -> Any:
        try:
            return parse(raw)
        except (DecodeError, ValueError):
            return UNPARSED

    return parse_request


def refuse_unparsed(name: str) -> InvalidArgument:
    return InvalidArgument(f"the {name} request does not parse")


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
    return steps.enter(bearer_token(metadata), context.peer().startswith("unix:"), request_id_of(metadata),
                       peer_call(metadata))


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable[[UnaryBehavior], UnaryBehavior],
    wrap_stream: Callable[[StreamBehavior], StreamBehavior],
    name: str = "",
) -> grpc.RpcMethodHandler:
    """The same handler with its behavior wrapped: `wrap_unary` for methods that answer
    once, `wrap_stream` for methods that answer with a stream. The response serializer is
    kept, the request deserializer wrapped by `parse_or_mark` (`name` is the method's)."""
    common = dict(
        request_deserializer=parse_or_mark(handler.request_deserializer, name, handler.request_streaming),
        response_serializer=handler.response_serializer,
    )
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
                if request is UNPARSED:
                    raise refuse_unparsed(steps.name)
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

    def written(inner: Any) -> UnaryBehavior:
        """A stream handler that is not an async generator function: grpcio's health
        Watch is a coroutine that answers with `context.write` and never returns. It runs
        like a unary behavior (grpc awaits a coroutine's stream and ignores its result);
        an async generator it hands back all the same is written out here."""
        async def run(request: Any, context: grpc.aio.ServicerContext) -> None:
            result = inner(request, context)
            if inspect.isasyncgen(result):
                async for response in result:
                    await context.write(response)
            else:
                await result

        return unary(run)

    def stream(inner: StreamBehavior) -> StreamBehavior:
        if not inspect.isasyncgenfunction(inner):
            return cast(StreamBehavior, written(inner))

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            identity = None
            code = grpc.StatusCode.OK
            try:
                identity = _enter(steps, context)
                if request is UNPARSED:
                    raise refuse_unparsed(steps.name)
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

    return wrap_handler(handler, unary, stream, steps.name)
