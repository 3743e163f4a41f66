"""`AsyncClient`: the asyncio SDK. Same methods as `Client`, awaited.

Each verb is a plan from `kvstore.client._ops`; this module holds what an asyncio
client adds to `ClientState`: its grpc.aio channel and stubs, its lane (`AioControlLane`), and
the driver that awaits each step. `Blocking` steps (shared-memory and device copies)
run in a worker thread, so they never stall the event loop; a caller cancelled during
one gets its `CancelledError` only once the thread has returned (`_in_thread`)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import grpc

from kvstore.client import _ops as ops
from kvstore.client._errors import fetch_cut_short, translate
from kvstore.client._local import LocalPlane
from kvstore.client._ops import Blocking, ClientState, Plan, Step, StreamFetch, StreamPut, Unary
from kvstore.client._options import CHANNEL_OPTIONS
from kvstore.client._requests import EngineNames, put_requests
from kvstore.client.control_lane import AioControlLane
from kvstore.client.results import LookupResult, PinResult, PrefetchResult, PutResult
from kvstore.client.security import aio_channel
from kvstore.control_lane_wire import RESPONSE_TYPES, method_path
from kvstore.layout import KVLayout
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2
from kvstore.wire import FETCH_METHOD, PUT_METHOD, fetch_response_deserializer, put_request_serializer

T = TypeVar("T")


async def _in_thread(fn: Callable[..., T], *args: Any, cancel: Callable[[], None] | None = None) -> T:
    """`fn(*args)` in a worker thread. If the caller is cancelled meanwhile, the
    cancellation is delivered once the thread has returned, not before: the work is a
    copy into slots the plan hands back to the daemon on that very error, and a copy still
    running then would write into slots the daemon may already have given to another put.
    `cancel`, if given, is called first so that work which can stop early (a data-lane
    transfer) does, instead of running on to its deadline."""
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    work = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        if cancel is not None:
            cancel()
        while not work.done():
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        if not work.cancelled():
            work.exception()  # retrieved: the cancellation is what the caller gets
        raise


class AsyncClient(ClientState):
    """Talks to a kvstore daemon from asyncio code (the arguments are described on
    `__init__`). Shared-memory and device copies run in a worker thread, so they
    never stall the event loop. `control_plane_in_use()` and `data_plane_in_use()` are
    coroutine methods here, properties on `Client`."""

    def _open(self, lane_path: str | None) -> None:
        self._channel = aio_channel(self.target, self.security, CHANNEL_OPTIONS)
        # Put and Fetch carry block payloads: use the copy-saving chunk codec (kvstore.wire).
        self._put = self._channel.stream_unary(PUT_METHOD, request_serializer=put_request_serializer,
                                               response_deserializer=kvstore_pb2.PutResponse.FromString)
        self._fetch = self._channel.unary_stream(FETCH_METHOD,
                                                 request_serializer=kvstore_pb2.FetchRequest.SerializeToString,
                                                 response_deserializer=fetch_response_deserializer)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        self._raw: dict[str, Any] = {}  # the unary methods' stubs, made on first use
        self._lane = AioControlLane(lane_path, self.security.token, self.control_plane == "lane") if lane_path else None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._run(ops.release_all(self))
        self._detach()
        if self._lane is not None:
            self._lane.close()
        await self._channel.close()

    # ------------------------------------------------------------------ driver

    async def control_plane_in_use(self) -> str:
        """`lane` when unary calls go over the daemon's local control lane, else `grpc`."""
        lane = self._lane
        return "lane" if lane is not None and await lane.in_use(self.timeout_s) else "grpc"

    async def data_plane_in_use(self) -> str:
        """`local` when block bytes move through shared memory, else `grpc`."""
        return await self._run(ops.data_plane_in_use(self))

    async def warm_up(self, timeout_s: float = 60.0) -> str:
        """Attach the data plane now and wait until the shared segment is mapped in, so
        the first puts and fetches run at full speed; returns the plane in use. Optional:
        without it the mapping is faulted in in the background after the first call."""
        return await self._run(ops.warm_up(self, timeout_s))

    async def _run(self, plan: Unary[T] | Plan[T]) -> T:
        """Drive a verb's plan to its result. A failed step is thrown into the plan where
        it was yielded, so the plan's own handlers see it."""
        if type(plan) is Unary:  # a one-call verb: no generator to drive
            return plan.answer(await self._unary(plan.name, plan.request, plan.timeout_s))
        gen = cast(Plan[T], plan)
        send: Callable[[Any], Step] = gen.send
        value: Any = None
        try:
            while True:
                step = send(value)
                try:
                    value = await self._step(step)
                    send = gen.send
                except BaseException as exc:  # cancellation too: a put aborts its slots
                    value, send = exc, gen.throw
        except StopIteration as stop:
            return stop.value

    async def _step(self, step: Step) -> Any:
        if type(step) is Unary:
            return step.answer(await self._unary(step.name, step.request, step.timeout_s))
        if type(step) is Blocking:
            return await _in_thread(step.fn, *step.args, cancel=step.cancel)
        try:  # the streams are gRPC calls of their own: their failures surface here
            if type(step) is StreamPut:
                return await self._put(put_requests(step.prepared, self.chunk_bytes), timeout=step.timeout_s)
            assert type(step) is StreamFetch
            async for msg in self._fetch(step.request, timeout=step.timeout_s):
                step.assembler.feed(msg)
            return None
        except grpc.RpcError as exc:
            if type(step) is StreamFetch and fetch_cut_short(exc):
                return None  # the verified blocks before the one the daemon dropped
            raise translate(exc) from None

    async def _unary(self, name: str, request: Any, timeout: float) -> Any:
        """One unary KVStore call: over the lane when it is up (or due for another try),
        else over gRPC. Failures raise `kvstore.errors` exceptions."""
        payload = request.SerializeToString()
        lane = self._lane
        if lane is not None:
            epoch = self._epoch
            told = await lane.call_told(name, payload, timeout)
            if told is not None:
                answer, boot_id = told
                if boot_id != self._generation:
                    # Another start of the daemon answered on the lane (it restarted): what
                    # this client holds of the old one goes before the next call uses it.
                    ops.learn(self, boot_id, epoch)
                return RESPONSE_TYPES[name].FromString(answer)
        stub = self._raw.get(name)
        if stub is None:
            stub = self._raw[name] = self._channel.unary_unary(method_path(name))
        try:
            return RESPONSE_TYPES[name].FromString(await stub(payload, timeout=timeout))
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def _local(self) -> LocalPlane | None:
        return self._plane if self._plane_tried else await self._run(ops.local_plane(self))

    # ------------------------------------------------------------------ verbs

    async def lookup(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                     block_hashes: Sequence[bytes] | None = None, lease_ms: int = 0,
                     session_id: str | None = None, expect_reuse_within_s: float | None = None,
                     timeout_s: float | None = None) -> LookupResult:
        """Longest prefix of the blocks the daemon holds. `lease_ms` pins the hit until a fetch;
        `session_id` + `expect_reuse_within_s` hint that the session will be back for it."""
        return await self._run(ops.lookup(layout, token_ids, block_hashes, lease_ms, session_id, expect_reuse_within_s,
                                          self._t(timeout_s)))

    async def put(self, layout: KVLayout, token_ids: Sequence[int] | None, blocks: Sequence[Any], *,
                  first_block: int = 0, block_hashes: Sequence[bytes] | None = None,
                  session_id: str | None = None, expect_reuse_within_s: float | None = None,
                  timeout_s: float | None = None, wait_for_owners: bool = False,
                  engine_names: EngineNames | None = None, quantized: bool = False) -> PutResult:
        """Store `blocks` (all or nothing). With token_ids, block i is block first_block + i of the prefix.

        In a pool (docs/cluster.md), `wait_for_owners` answers only once the blocks sent to
        other daemons (the owners of their placement units) are committed there, or the
        forward timed out: `PutResult.owner_committed_blocks` says how many made it.

        `engine_names`: what the engine calls these blocks (vLLM's block hashes), which the
        daemon's KV events in vLLM's format then carry (docs/operations.md). A quantized
        layout (`kv_codec`, docs/codecs.md) quantizes the blocks first; `quantized=True` says
        they are quantized already."""
        return await self._run(ops.put(self, layout, token_ids, blocks, first_block, block_hashes, session_id,
                                       expect_reuse_within_s, self._t(timeout_s), wait_for_owners,
                                       engine_names, quantized))

    async def fetch(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                    block_hashes: Sequence[bytes] | None = None, out: Sequence[Any] | None = None,
                    lease_id: str = "", timeout_s: float | None = None, quantized: bool = False) -> list[Any]:
        """Verified blocks of the longest held prefix, in order; fills `out` buffers if given.

        Without `out`, blocks come back as `bytes` over gRPC and as `bytearray` over shared
        memory and the data lane (equal content either way). A quantized layout's blocks
        come back dequantized into the layout's dtype (`out`: buffers of its
        `dense_block_bytes`), or as stored with `quantized=True`.
        """
        return await self._run(ops.fetch(self, layout, token_ids, block_hashes, out, lease_id, self._t(timeout_s),
                                           quantized))

    async def delete(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                     block_hashes: Sequence[bytes] | None = None, timeout_s: float | None = None) -> int:
        return await self._run(ops.delete(layout, token_ids, block_hashes, self._t(timeout_s)))

    async def pin(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                  block_hashes: Sequence[bytes] | None = None, ttl_ms: int = 0,
                  timeout_s: float | None = None) -> PinResult:
        return await self._run(ops.pin(layout, token_ids, block_hashes, ttl_ms, self._t(timeout_s)))

    async def hint(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                   block_hashes: Sequence[bytes] | None = None, session_id: str, expect_reuse_within_s: float,
                   timeout_s: float | None = None) -> int:
        """Protect the named blocks for `session_id` for about `expect_reuse_within_s`; returns
        how many were present. See docs/policies.md for when hints pay off."""
        return await self._run(ops.hint(layout, token_ids, block_hashes, session_id, expect_reuse_within_s,
                                        self._t(timeout_s)))

    async def end_session(self, session_id: str, *, timeout_s: float | None = None) -> None:
        """The session is over: release whatever its hints protect."""
        await self._run(ops.end_session(session_id, self._t(timeout_s)))

    async def unpin(self, lease_id: str, *, timeout_s: float | None = None) -> bool:
        return await self._run(ops.unpin(self, lease_id, self._t(timeout_s)))

    async def prefetch(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                       block_hashes: Sequence[bytes] | None = None, tier: str = "",
                       timeout_s: float | None = None) -> PrefetchResult:
        """Raise the named blocks into `tier` ("" = the daemon's top tier) ahead of a fetch."""
        return await self._run(ops.prefetch(layout, token_ids, block_hashes, tier, self._t(timeout_s)))

    async def verify(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                     block_hashes: Sequence[bytes] | None = None, timeout_s: float | None = None) -> int:
        """Ask the daemon to re-check the named blocks; returns how many it dropped."""
        return await self._run(ops.verify(layout, token_ids, block_hashes, self._t(timeout_s)))

    async def stats(self, *, timeout_s: float | None = None) -> admin_pb2.StatsResponse:
        try:
            return await self._admin.Stats(admin_pb2.StatsRequest(), timeout=self._t(timeout_s))
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def info(self, section: str = "", *, timeout_s: float | None = None) -> str:
        try:
            return (await self._admin.Info(admin_pb2.InfoRequest(section=section), timeout=self._t(timeout_s))).text
        except grpc.RpcError as exc:
            raise translate(exc) from None
