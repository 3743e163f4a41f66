"""The `kvstore.v1.KVStore` servicer: protobuf requests to store verbs and back.

Primitives: `KVStoreServicer`, `tier_enum_table(names)`.

Each method resolves what the request names through the `RequestResolver` (the server's
one validation boundary: namespaces, keys, sessions, the caller's lease ids), calls one
store verb, and builds the answer. A read of a layout the daemon holds nothing of is
answered as a miss without registering it (the resolver's `Miss`; a Lookup, which a pool
may answer from other nodes, takes `UnregisteredLayout` itself); only a Put that
publishes registers a namespace. The shared-memory and device planes are delegated to
`LocalPlaneService` and `DevicePlane`, the data lane's transfers to `DataLaneTransfers`.
Here, once for every plane: this start's boot id goes out with the planes' answers
(LocalSegment, DeviceSegment, DataLane), and each call that names something of a start
(slots, a reservation, a lease, a transfer) is checked against it first
(`kvstore.server.generation`): a client of an earlier start is refused before anything
is handed out or published.
The one piece of work beyond translation is the Fetch framer (`_frame`), which the
store's fetch calls to cut a block into wire messages, so that the checksum it verifies
is taken over the bytes that are sent.

A Put publishes only a complete stream of a call that is still alive. A header with
`explicit_end` makes the `PutEnd` message the only commit: a stream that ends without
it stores nothing, whatever ended it. Without it the half-close commits, and grpc ends
the request iterator the same way when the client half-closes and when it cancels, runs
past its deadline or disappears; so after the last message the servicer sends the
response headers (a round trip through grpc's core that fails, or is cancelled, on a
dead call) and hands the commit a check of the call (`_still_alive`) that runs in the
same synchronous step as the publish. That check cannot catch a client library that
sends END_STREAM and then resets the stream a moment later (the put looks half-closed
until the reset arrives), which is why the SDK and the pool send `explicit_end`.

A Fetch that cannot send every block its header promised ends with a status that says
so: DATA_LOSS when a block failed verification and no other copy of it did (a bad host
copy is replaced by its SSD copy in the store's fetch, so this means the block is gone),
with the count of blocks sent in its message and in the `kvstore-blocks-sent` trailer.
A block deleted while the fetch ran ends the stream with OK and the same trailer: the
blocks before it are what is there. Either way every block sent verified.

A Put stream holds little ahead of its bytes: its slots are reserved as its chunks
arrive (at most `put_window_bytes` ahead of them, `PutTxn`'s window), and a stream that
sends nothing for `put_idle_timeout_s` is rolled back, so a client that stalls or
vanishes without a reset holds nothing for long.

The per-call steps (request id, drain gate, auth, metrics, error mapping) are not here:
`kvstore.server.pipeline` runs them around every method, for gRPC and for the control
lane alike. Failures are `kvstore.errors` exceptions, mapped to a status there.

The servicer is built with this daemon's node of the pool (`PoolNode`: a pool's
`ClusterNode`, or a daemon alone's `SoloNode`, kvstore.server.pool_node). In a pool, a
lookup whose chain goes on past the local prefix asks the other nodes (`extend`), a
committed put (Put, or LaneCommit) is forwarded to its units' owners (`forward_put`), and
a fetch (Fetch, or LaneFetch) first waits for blocks a lookup is copying here; calls that
other nodes make (`Identity.peer`) are answered from this node alone. A daemon alone's
node answers each of those steps at once, and a lookup, which a pool counts once the
other nodes have answered, is counted by the store as it answers it (`_alone`).

`context` may be None. The control lane (`kvstore.server.control_lane`) calls the unary methods
itself, with the parsed request and no gRPC context, so no unary method reads or uses its
`context`: what a method needs from the call (the caller's identity, the request id) is
in contextvars the pipeline sets. Only the streaming methods (Put, Fetch), which the lane
does not carry, receive a real context.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from kvstore.convert import TIER_BY_NAME, TIER_NAMES, unknown_tier_message
from kvstore.core.store import PrefixLookup, Store
from kvstore.errors import Cancelled, DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.hashing import HASH_BYTES, split_hashes
from kvstore.native import XXH3, native
from kvstore.server.auth import current_identity
from kvstore.server.cluster import forward_put
from kvstore.server.data_lane.transfers import DataLaneTransfers
from kvstore.server.device_plane import DevicePlane
from kvstore.server.generation import Generation
from kvstore.server.local_plane import LocalPlaneService
from kvstore.server.pool_node import PoolNode, SoloNode
from kvstore.server.requests import Miss, RequestResolver, UnregisteredLayout, hash_fields, packed_reply
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvstore.wire import Framed, RawChunk, chunk_prefix, encode_chunk

# What one Put stream may hold ahead of its bytes, and how long it may send nothing (the
# daemon's max_put_reserve_bytes and put_idle_timeout_s).
DEFAULT_PUT_WINDOW_BYTES = 64 << 20
DEFAULT_PUT_IDLE_TIMEOUT_S = 30.0

# The trailing metadata of a Fetch that ended before the header's count: how many
# blocks it sent (with DATA_LOSS when a block failed verification and had no intact copy).
BLOCKS_SENT_TRAILER = "kvstore-blocks-sent"

if TYPE_CHECKING:
    from kvstore.cluster.pool import Extension

# A gRPC context, or None when the control lane calls (see the module docstring).
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any] | None"


@functools.lru_cache(maxsize=8)
def tier_enum_table(names: tuple[str, ...]) -> bytes:
    """A `bytes.translate` table from a store's tier ids (indexes into `names`) to Tier
    values: a lookup's tier ids become LookupResponse.tiers_packed in one C pass."""
    table = bytearray(256)
    for tid, name in enumerate(names):
        table[tid] = TIER_BY_NAME.get(name, kvstore_pb2.TIER_UNSPECIFIED)
    return bytes(table)


async def _confirm_half_close(context: grpc.aio.ServicerContext) -> None:
    """After a Put's request stream ended: return only if the client half-closed it. A
    cancelled, expired or vanished call raises (CancelledError, or Cancelled)."""
    try:
        await context.send_initial_metadata(())
    except asyncio.CancelledError:
        raise
    except Exception:  # grpc's batch failed: the call is gone
        raise Cancelled("the put's call ended before the stream was half-closed; nothing was stored") from None


def _still_alive(context: grpc.aio.ServicerContext) -> None:
    """Raise unless the call may still publish: not cancelled, its deadline not passed."""
    task = asyncio.current_task()
    if (task is not None and task.cancelling()) or context.done():
        raise Cancelled("the put was cancelled before it was published; nothing was stored")
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceeded("the put's deadline passed before it was published; nothing was stored: "
                               "give the call a longer timeout")


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: Store, resolver: RequestResolver, local: LocalPlaneService, device: DevicePlane,
                 node: PoolNode, chunk_bytes: int, put_window_bytes: int = DEFAULT_PUT_WINDOW_BYTES,
                 put_idle_timeout_s: float = DEFAULT_PUT_IDLE_TIMEOUT_S,
                 lane: DataLaneTransfers | None = None, generation: Generation | None = None) -> None:
        self.store = store
        # This start of the daemon: handed out with the planes' answers, checked on every
        # call that names a segment's slots, a reservation, a lease or a transfer.
        self.generation = generation if generation is not None else Generation()
        self._check = self.generation.check
        self.resolver = resolver
        self.local = local
        self.device = device
        self.node = node
        # A daemon alone: its store counts each lookup as it answers it, where a pool's
        # node counts an engine's lookup once the other nodes have answered, and another
        # node's among the pool's counters (`_lookup`).
        self._alone = isinstance(node, SoloNode)
        self.lane = lane
        self.chunk_bytes = chunk_bytes
        # What one Put stream may reserve ahead of its bytes, and how long it may send nothing.
        self.put_window_bytes = put_window_bytes
        self.put_idle_timeout_s = put_idle_timeout_s
        # Bound once: the lookup path pays one attribute read for each, as before the split.
        self._namespace = resolver.namespace
        self._known = resolver.known
        self._chain = resolver.chain
        self._hashes = resolver.hashes
        self._lease_out = resolver.tags.tag
        self._lease_in = resolver.tags.untag

    # -------------------------------------------------------------- store verbs

    async def Lookup(self, request: kvstore_pb2.LookupRequest, context: Context) -> kvstore_pb2.LookupResponse:
        try:
            ns_id = self._namespace(request.namespace)
        except UnregisteredLayout as unknown:
            if self._alone:
                self.store.counters.count_unknown_lookup(self.resolver.check_keys(request.keys, unknown.layout))
            elif current_identity().peer:  # another node's lookup: the pool's counters
                self.node.peer_looked_up(self.resolver.check_keys(request.keys, unknown.layout), 0)
            else:
                # The pool may hold what this daemon never saw: the layout is filed here
                # (forgotten after namespace_grace_s if nothing lands in it) and asked for.
                ns_id = self.resolver.namespace(request.namespace, register=True)
                return await self._lookup(request, ns_id)
            if request.HasField("hint"):
                self.resolver.session(request.hint.session_id, request.hint.expect_reuse_within_s)
                self.store.count_hint("lookup")
            return kvstore_pb2.LookupResponse(namespace_id=unknown.namespace_id,
                                              block_size_tokens=unknown.layout.block_size_tokens)
        return await self._lookup(request, ns_id)

    async def _lookup(self, request: kvstore_pb2.LookupRequest, ns_id: bytes) -> kvstore_pb2.LookupResponse:
        keys = request.keys
        chain = self._chain(ns_id, keys)
        session = self.resolver.session(request.hint.session_id, request.hint.expect_reuse_within_s) \
            if request.HasField("hint") else ""
        alone = self._alone
        # A node of the pool counts its engines' lookups with what the pool answered
        # (below), and another node's lookup in the pool's counters, not as one of its own.
        r = self.store.lookup(ns_id, chain, request.lease_ms, count=alone)
        if session:
            if r.num_blocks:
                self.store.hint(ns_id, r.block_hashes, session, request.hint.expect_reuse_within_s, carried_by="lookup")
            else:
                self.store.count_hint("lookup")
        if not alone:
            node = self.node
            n_asked = len(chain) // HASH_BYTES if isinstance(chain, bytes) else len(chain)
            if current_identity().peer:
                node.peer_looked_up(n_asked, r.num_blocks)
            else:
                ext = None
                lease_id = r.lease_id
                try:
                    if r.num_blocks < n_asked:
                        if request.lease_ms and not lease_id:
                            # Nothing here to lease: one for what the pool copies here for
                            # this answer (its pulls add their blocks), so the fetch finds them.
                            lease_id = self._open_lease(ns_id, request.lease_ms)
                        # The rest of the chain may be on other nodes of the pool (a chain
                        # held here is answered without asking them).
                        ext = await node.extend(ns_id, chain, r.num_blocks, lease_id)
                finally:
                    self.store.counters.count_lookup(self.store.registry.get(ns_id), n_asked,
                                                     r.num_blocks + (ext.blocks if ext is not None else 0))
                    if lease_id != r.lease_id and (ext is None or not ext.remote):
                        self.store.unpin(lease_id)  # nothing comes: not kept for nothing
                        lease_id = r.lease_id
                if ext is not None:
                    return self._extended(request, keys, r, ext, chain, lease_id)
        resp = kvstore_pb2.LookupResponse(
            num_blocks=r.num_blocks,
            num_tokens=r.num_tokens,
            namespace_id=ns_id,
            lease_id=self._lease_out(r.lease_id),
            block_size_tokens=r.block_size_tokens,
        )
        # The caller keeps the hashes it named: they need not come back (LookupRequest.omit_hashes).
        omit = request.omit_hashes and keys.WhichOneof("keys") != "tokens"
        # Tier values, one byte per block, in either form of the answer.
        tiers = r.tier_ids.translate(tier_enum_table(r.tier_names))
        if not packed_reply(keys):
            resp.tiers.extend(tiers)
            if not omit:
                resp.block_hashes.extend(r.block_hashes)
            return resp
        resp.tiers_packed = tiers
        if not omit:
            resp.block_hashes_packed = r.hashes_packed
        return resp

    def _open_lease(self, ns_id: bytes, lease_ms: int) -> str:
        """An empty store lease for a lookup answered from other nodes ("" when the
        tenant's leases are at their cap: the answer then comes without one)."""
        try:
            return self.store.open_lease(ns_id, lease_ms)
        except ResourceExhausted:
            return ""

    def _extended(self, request: kvstore_pb2.LookupRequest, keys: kvstore_pb2.BlockKeys, r: PrefixLookup,
                  ext: Extension, chain: bytes | list[bytes], lease_id: str) -> kvstore_pb2.LookupResponse:
        """A lookup's answer with the blocks the pool adds past the local prefix, under
        `lease_id` (the local prefix's lease, which also holds what the pulls land)."""
        n = r.num_blocks + ext.blocks
        resp = kvstore_pb2.LookupResponse(
            num_blocks=n, num_tokens=n * r.block_size_tokens, namespace_id=r.namespace_id,
            lease_id=self._lease_out(lease_id), block_size_tokens=r.block_size_tokens, remote_blocks=ext.remote)
        omit = request.omit_hashes and keys.WhichOneof("keys") != "tokens"
        tiers = r.tier_ids.translate(tier_enum_table(r.tier_names)) + ext.tiers
        packed = chain[: n * HASH_BYTES] if isinstance(chain, bytes) else b"".join(chain[:n])
        if not packed_reply(keys):
            resp.tiers.extend(tiers)
            if not omit:
                resp.block_hashes.extend(split_hashes(packed))
            return resp
        resp.tiers_packed = tiers
        if not omit:
            resp.block_hashes_packed = packed
        return resp

    async def Put(
        self, request_iterator: AsyncIterator[kvstore_pb2.PutRequest | RawChunk], context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        stream = request_iterator.__aiter__()
        idle_s = self.put_idle_timeout_s
        loop = asyncio.get_running_loop()
        # One timer for the stream: armed while it waits for the client, disarmed while the
        # daemon works on what arrived (making room is not the client's silence).
        idle = asyncio.timeout(loop.time() + idle_s)
        try:
            async with idle:
                first = await anext(stream, None)
                idle.reschedule(None)
                if first is None or isinstance(first, RawChunk) or first.WhichOneof("msg") != "header":
                    raise InvalidArgument("a Put stream must start with a header message")
                header = first.header
                info = self.resolver.put_namespace(header.namespace)
                ns_id = info.namespace_id
                hashes, parent = self.resolver.put_keys(info, header)
                session = self.resolver.put_session(header)
                spans = [(sp.group, sp.start, sp.stop) for sp in header.group_spans]
                async with self.store.begin_stream_put(info, hashes, parent, window_bytes=self.put_window_bytes,
                                                       spans=spans) as txn:
                    while True:
                        idle.reschedule(loop.time() + idle_s)
                        msg = await anext(stream, None)
                        idle.reschedule(None)
                        if msg is None:
                            if header.explicit_end:
                                # Only PutEnd commits such a stream: its end without one is
                                # a cancel (or a client that stopped), however grpc reports it.
                                raise Cancelled("the Put stream ended without its PutEnd message "
                                                "(PutHeader.explicit_end); nothing was stored")
                            await _confirm_half_close(context)
                            break
                        if isinstance(msg, RawChunk):  # the fast path: a view into the received message
                            await txn.write(msg.block, msg.data)
                            continue
                        which = msg.WhichOneof("msg")
                        if which == "end":
                            break  # the client's explicit commit: its half-close is not waited for
                        if which == "header":
                            raise InvalidArgument("a second header in one Put stream: a stream carries one "
                                                  "header, then its blocks' chunks (one put per stream)")
                        if which != "chunk":
                            raise InvalidArgument("a Put message with none of header, chunk or end set: after "
                                                  "the header, send BlockChunk messages, then PutEnd")
                        await txn.write(msg.chunk.block, msg.chunk.data)
                    result = await txn.commit(check=functools.partial(_still_alive, context))
        except TimeoutError:
            if not idle.expired():
                raise
            raise DeadlineExceeded(
                f"the Put stream sent nothing for {idle_s:g} s (put_idle_timeout_s); the put was rolled back: "
                "send its chunks without pauses, then half-close the stream"
            ) from None
        if session:
            self.store.hint(ns_id, hashes, session, header.hint.expect_reuse_within_s, carried_by="put")
        resp = kvstore_pb2.PutResponse(stored=result.stored, existing=result.existing, namespace_id=ns_id,
                                       **hash_fields(result.block_hashes, packed_reply(header.keys)))
        waiting = forward_put(self.node, self.resolver, ns_id, header, resp, hashes, parent)
        if waiting is not None:
            await waiting
        return resp

    async def Fetch(
        self, request: kvstore_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.FetchResponse | bytes]:
        self._check(request.boot_id)
        ns_id = self._known(request.namespace, request.keys)
        if isinstance(ns_id, Miss):
            lease_id = self._lease_in(request.lease_id)
            if lease_id:  # released when a fetch ends, whatever it found
                self.store.unpin(lease_id)
            yield kvstore_pb2.FetchResponse(header=kvstore_pb2.FetchHeader(
                block_bytes=ns_id.layout.bytes_per_block, namespace_id=ns_id.namespace_id))
            return
        hashes = self._hashes(ns_id, request.keys)
        node = self.node
        if current_identity().peer:
            node.peer_fetched(ns_id, hashes)
        elif node.pulling:
            await node.settle_fetch(ns_id, hashes)  # blocks a lookup is copying here
        async with self.store.open_fetch(ns_id, hashes, self._lease_in(request.lease_id), request.group) as stream:
            header = kvstore_pb2.FetchHeader(num_blocks=stream.num_blocks, block_bytes=stream.block_bytes,
                                             namespace_id=ns_id, prefix_blocks=stream.prefix_blocks)
            if request.with_checksums:
                header.checksums.extend(stream.checksums)
            yield kvstore_pb2.FetchResponse(header=header)
            # Each block goes out as wire messages made by one copy out of its tier, and the
            # checksum is taken over the payload inside those messages (kvstore.wire); a
            # block is framed only once the one before it has gone out.
            async for framed in stream.frames(self._frame):
                for message in framed.messages:
                    yield message
            if stream.ended_early:
                # The header promised more: say how many were sent and why, in the status
                # and (machine-readable) in the trailer.
                context.set_trailing_metadata(((BLOCKS_SENT_TRAILER, str(stream.sent)),))
                if stream.verification_failed:
                    raise DataLoss(f"{stream.sent} of {stream.num_blocks} blocks sent: {stream.ended_early}; "
                                   "the blocks sent are intact (recompute the rest)")

    def _frame(self, index: int, data: memoryview) -> Framed:
        """A block as chunk messages. Pure (no servicer or store state changes): for large
        blocks the fetch calls it on a hashing thread. Compiled, each piece is copied into
        its message and hashed there while in cache: one pass instead of a copy and a hash."""
        if XXH3 and len(data):
            sizes = [min(self.chunk_bytes, len(data) - start) for start in range(0, len(data), self.chunk_bytes)]
            copied, checksum = native.frame_copy([chunk_prefix(index, n) for n in sizes], data, self.chunk_bytes)
            return Framed(copied, [memoryview(m)[len(m) - n :] for m, n in zip(copied, sizes)], checksum)
        messages: list[bytes] = []
        payload: list[memoryview] = []
        for start in range(0, len(data), self.chunk_bytes):
            piece = data[start : start + self.chunk_bytes]
            message = encode_chunk(index, piece)
            messages.append(message)
            payload.append(memoryview(message)[len(message) - len(piece) :])
        return Framed(messages, payload)

    async def Delete(self, request: kvstore_pb2.DeleteRequest, context: Context) -> kvstore_pb2.DeleteResponse:
        ns_id = self._known(request.namespace, request.keys)
        if isinstance(ns_id, Miss):
            return kvstore_pb2.DeleteResponse()
        return kvstore_pb2.DeleteResponse(deleted=self.store.delete(ns_id, self._hashes(ns_id, request.keys)))

    async def Pin(self, request: kvstore_pb2.PinRequest, context: Context) -> kvstore_pb2.PinResponse:
        ns_id = self._known(request.namespace, request.keys)
        if isinstance(ns_id, Miss):
            return kvstore_pb2.PinResponse()
        r = self.store.pin(ns_id, self._hashes(ns_id, request.keys), request.ttl_ms)
        return kvstore_pb2.PinResponse(lease_id=self._lease_out(r.lease_id), pinned=r.pinned,
                                       expires_in_ms=r.expires_in_ms)

    async def Unpin(self, request: kvstore_pb2.UnpinRequest, context: Context) -> kvstore_pb2.UnpinResponse:
        self._check(request.boot_id)
        lease_id = self._lease_in(request.lease_id)
        return kvstore_pb2.UnpinResponse(released=bool(lease_id) and self.store.unpin(lease_id))

    async def Hint(self, request: kvstore_pb2.HintRequest, context: Context) -> kvstore_pb2.HintResponse:
        ns_id = self._known(request.namespace, request.keys)
        if isinstance(ns_id, Miss):
            self.resolver.session(request.hint.session_id, request.hint.expect_reuse_within_s)
            return kvstore_pb2.HintResponse()
        session = self.resolver.session(request.hint.session_id, request.hint.expect_reuse_within_s)
        hinted = self.store.hint(ns_id, self._hashes(ns_id, request.keys), session, request.hint.expect_reuse_within_s)
        return kvstore_pb2.HintResponse(hinted=hinted)

    async def EndSession(
        self, request: kvstore_pb2.EndSessionRequest, context: Context
    ) -> kvstore_pb2.EndSessionResponse:
        self.store.end_session(self.resolver.session(request.session_id))
        return kvstore_pb2.EndSessionResponse()

    async def Prefetch(
        self, request: kvstore_pb2.PrefetchRequest, context: Context
    ) -> kvstore_pb2.PrefetchResponse:
        tier = TIER_NAMES.get(request.tier, "") if request.tier else ""
        if request.tier and not tier:
            raise InvalidArgument(unknown_tier_message(request.tier, [t.name for t in self.store.memory_tiers]))
        ns_id = self._known(request.namespace, request.keys)
        if isinstance(ns_id, Miss):
            return kvstore_pb2.PrefetchResponse(tier=TIER_BY_NAME[self.store.prefetch_target(tier)],
                                                requested=ns_id.blocks, missing=ns_id.blocks)
        hashes = self._hashes(ns_id, request.keys)
        r = await self.store.prefetch(ns_id, hashes, tier)
        return kvstore_pb2.PrefetchResponse(
            tier=TIER_BY_NAME[r.tier], requested=r.requested, raised=r.raised, already=r.already, missing=r.missing,
            skipped=r.skipped,
        )

    async def Verify(self, request: kvstore_pb2.VerifyRequest, context: Context) -> kvstore_pb2.VerifyResponse:
        ns_id = self._known(request.namespace, request.keys)
        if isinstance(ns_id, Miss):
            return kvstore_pb2.VerifyResponse()
        verified, dropped = await self.store.verify(ns_id, self._hashes(ns_id, request.keys))
        return kvstore_pb2.VerifyResponse(verified=verified, dropped=dropped)

    # -------------------------------------------------------------- data planes

    async def LocalSegment(self, request: kvstore_pb2.LocalSegmentRequest,
                           context: Context) -> kvstore_pb2.LocalSegmentResponse:
        resp = self.local.segment()
        resp.boot_id = self.generation.boot_id
        return resp

    async def LocalPut(self, request: kvstore_pb2.LocalPutRequest, context: Context) -> kvstore_pb2.LocalPutResponse:
        self._check(request.boot_id)
        return await self.local.put(request)

    async def LocalCommit(self, request: kvstore_pb2.LocalCommitRequest, context: Context) -> kvstore_pb2.PutResponse:
        self._check(request.boot_id)
        return await self.local.commit(request)

    async def LocalFetch(self, request: kvstore_pb2.LocalFetchRequest,
                         context: Context) -> kvstore_pb2.LocalFetchResponse:
        self._check(request.boot_id)
        return await self.local.fetch(request)

    async def DeviceSegment(self, request: kvstore_pb2.DeviceSegmentRequest,
                            context: Context) -> kvstore_pb2.DeviceSegmentResponse:
        resp = self.device.segment()
        resp.boot_id = self.generation.boot_id
        return resp

    async def DeviceFetch(self, request: kvstore_pb2.LocalFetchRequest,
                          context: Context) -> kvstore_pb2.LocalFetchResponse:
        self._check(request.boot_id)
        return await self.device.fetch(request)

    async def DevicePut(self, request: kvstore_pb2.LocalPutRequest, context: Context) -> kvstore_pb2.LocalPutResponse:
        self._check(request.boot_id)
        return await self.device.put(request)

    async def DataLane(self, request: kvstore_pb2.DataLaneRequest, context: Context) -> kvstore_pb2.DataLaneResponse:
        resp = self.lane.offer() if self.lane is not None else kvstore_pb2.DataLaneResponse()
        resp.boot_id = self.generation.boot_id
        return resp

    async def LaneFetch(self, request: kvstore_pb2.LaneFetchRequest,
                        context: Context) -> kvstore_pb2.LaneFetchResponse:
        self._check(request.fetch.boot_id)
        return await self._lane().open_fetch(request)

    async def LanePut(self, request: kvstore_pb2.LanePutRequest, context: Context) -> kvstore_pb2.LanePutResponse:
        self._check(request.boot_id)
        return await self._lane().open_put(request)

    async def LaneCommit(self, request: kvstore_pb2.LaneCommitRequest, context: Context) -> kvstore_pb2.PutResponse:
        self._check(request.boot_id)
        # In a pool, the transfers forward a committed lane put and make a lane fetch wait
        # for pulls, as Put and Fetch do (kvstore.server.data_lane.transfers).
        return await self._lane().commit(request)

    def _lane(self) -> DataLaneTransfers:
        if self.lane is None or not self.lane.offer().endpoints:
            raise FailedPrecondition("this daemon serves no data lane (data_lane_listen is off); use Put and Fetch")
        return self.lane
