"""The `kvstore.v1.KVStore` servicer: protobuf requests to store verbs and back.

Primitives: `KVStoreServicer`, `tier_enum_table(names)`.

Each method resolves what the request names through the `RequestResolver` (the server's
one validation boundary: namespaces, keys, sessions, the caller's lease ids), calls one
store verb, and builds the answer. The shared-memory and device planes are delegated to
`LocalPlane` and `DevicePlane`. The one piece of work beyond translation is the Fetch
framer (`_frame`), which the store's fetch calls to cut a block into wire messages, so
that the checksum it verifies is taken over the bytes that are sent.

The per-call steps (request id, drain gate, auth, metrics, error mapping) are not here:
`kvstore.server.pipeline` runs them around every method, for gRPC and for the control
lane alike. Failures are `kvstore.errors` exceptions, mapped to a status there.

In a pool (`cluster`), a lookup whose chain goes on past the local prefix asks the other
nodes (`ClusterNode.extend`), a committed put is forwarded to its units' owners
(`forward_put`), and a fetch first waits for blocks a lookup is copying here; calls that
other nodes make (`Identity.peer`) are answered from this node alone.

`context` may be None. The control lane (`kvstore.server.lane`) calls the unary methods
itself, with the parsed request and no gRPC context, so no unary method reads or uses its
`context`: what a method needs from the call (the caller's identity, the request id) is
in contextvars the pipeline sets. Only the streaming methods (Put, Fetch), which the lane
does not carry, receive a real context.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from kvstore.convert import TIER_BY_NAME, TIER_NAMES, unknown_tier_message
from kvstore.core.store import LookupResult, Store
from kvstore.errors import InvalidArgument
from kvstore.hashing import HASH_BYTES, split_hashes
from kvstore.native import XXH3, native
from kvstore.server.auth import current_identity
from kvstore.server.cluster import forward_put
from kvstore.server.device_plane import DevicePlane
from kvstore.server.local_plane import LocalPlane
from kvstore.server.requests import RequestResolver, hash_fields, packed_reply
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvstore.wire import Framed, RawChunk, chunk_prefix, encode_chunk

if TYPE_CHECKING:
    from kvstore.cluster.pool import ClusterNode, Extension

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


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: Store, resolver: RequestResolver, local: LocalPlane, device: DevicePlane,
                 chunk_bytes: int) -> None:
        self.store = store
        self.resolver = resolver
        self.local = local
        self.device = device
        self.chunk_bytes = chunk_bytes
        # Bound once: the lookup path pays one attribute read for each, as before the split.
        self._namespace = resolver.namespace
        self._chain = resolver.chain
        self._hashes = resolver.hashes
        self._lease_out = resolver.tags.tag
        self._lease_in = resolver.tags.untag
        # The pool this daemon is one of (kvstore.server.cluster); None on a single daemon.
        self.cluster: ClusterNode | None = None

    # -------------------------------------------------------------- store verbs

    async def Lookup(self, request: kvstore_pb2.LookupRequest, context: Context) -> kvstore_pb2.LookupResponse:
        ns_id = self._namespace(request.namespace)
        keys = request.keys
        chain = self._chain(ns_id, keys)
        session = self.resolver.session(request.hint.session_id, request.hint.expect_reuse_within_s) \
            if request.HasField("hint") else ""
        r = self.store.lookup(ns_id, chain, request.lease_ms)
        if session and r.num_blocks:
            self.store.hint(ns_id, r.block_hashes, session, request.hint.expect_reuse_within_s)
        cluster = self.cluster
        if cluster is not None and r.num_blocks < (len(chain) // HASH_BYTES if isinstance(chain, bytes) else len(chain)) \
                and not current_identity().peer:
            # The rest of the chain may be on other nodes of the pool (a chain held here
            # is answered without asking them).
            ext = await cluster.extend(ns_id, chain, r.num_blocks)
            if ext is not None:
                return self._extended(request, keys, r, ext, chain)
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

    def _extended(self, request: kvstore_pb2.LookupRequest, keys: kvstore_pb2.BlockKeys, r: LookupResult,
                  ext: Extension, chain: bytes | list[bytes]) -> kvstore_pb2.LookupResponse:
        """A lookup's answer with the blocks the pool adds past the local prefix."""
        n = r.num_blocks + ext.blocks
        resp = kvstore_pb2.LookupResponse(
            num_blocks=n, num_tokens=n * r.block_size_tokens, namespace_id=r.namespace_id,
            lease_id=self._lease_out(r.lease_id), block_size_tokens=r.block_size_tokens, remote_blocks=ext.remote)
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
        first = await anext(stream, None)
        if first is None or isinstance(first, RawChunk) or first.WhichOneof("msg") != "header":
            raise InvalidArgument("a Put stream must start with a header message")
        header = first.header
        ns_id = self._namespace(header.namespace)
        hashes, parent = self.resolver.put_keys(ns_id, header)
        session = self.resolver.put_session(header)
        async with self.store.begin_put(ns_id, hashes, parent) as txn:
            async for msg in stream:
                if isinstance(msg, RawChunk):  # the fast path: a view into the received message
                    await txn.write(msg.block, msg.data)
                    continue
                if msg.WhichOneof("msg") != "chunk":
                    raise InvalidArgument("only block chunks may follow a Put header")
                await txn.write(msg.chunk.block, msg.chunk.data)
            result = await txn.commit()
        if session:
            self.store.hint(ns_id, hashes, session, header.hint.expect_reuse_within_s)
        resp = kvstore_pb2.PutResponse(stored=result.stored, existing=result.existing, namespace_id=ns_id,
                                       **hash_fields(result.block_hashes, packed_reply(header.keys)))
        if self.cluster is not None:
            await forward_put(self.cluster, ns_id, hashes, parent, header, resp, current_identity().peer)
        return resp

    async def Fetch(
        self, request: kvstore_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.FetchResponse | bytes]:
        ns_id = self._namespace(request.namespace)
        hashes = self._hashes(ns_id, request.keys)
        cluster = self.cluster
        if cluster is not None:
            peer = current_identity().peer
            if peer:
                cluster.peer_fetched(ns_id, hashes)
            else:
                await cluster.settle_fetch(ns_id, hashes)  # blocks a lookup is copying here
        async with self.store.open_fetch(ns_id, hashes, self._lease_in(request.lease_id)) as stream:
            header = kvstore_pb2.FetchHeader(num_blocks=stream.num_blocks, block_bytes=stream.block_bytes,
                                             namespace_id=ns_id)
            if request.with_checksums:
                header.checksums.extend(stream.checksums)
            yield kvstore_pb2.FetchResponse(header=header)
            # Each block goes out as wire messages made by one copy out of its tier, and the
            # checksum is taken over the payload inside those messages (kvstore.wire); a
            # block is framed only once the one before it has gone out.
            async for framed in stream.frames(self._frame):
                for message in framed.messages:
                    yield message

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
        ns_id = self._namespace(request.namespace)
        return kvstore_pb2.DeleteResponse(deleted=self.store.delete(ns_id, self._hashes(ns_id, request.keys)))

    async def Pin(self, request: kvstore_pb2.PinRequest, context: Context) -> kvstore_pb2.PinResponse:
        ns_id = self._namespace(request.namespace)
        r = self.store.pin(ns_id, self._hashes(ns_id, request.keys), request.ttl_ms)
        return kvstore_pb2.PinResponse(lease_id=self._lease_out(r.lease_id), pinned=r.pinned,
                                       expires_in_ms=r.expires_in_ms)

    async def Unpin(self, request: kvstore_pb2.UnpinRequest, context: Context) -> kvstore_pb2.UnpinResponse:
        lease_id = self._lease_in(request.lease_id)
        return kvstore_pb2.UnpinResponse(released=bool(lease_id) and self.store.unpin(lease_id))

    async def Hint(self, request: kvstore_pb2.HintRequest, context: Context) -> kvstore_pb2.HintResponse:
        ns_id = self._namespace(request.namespace)
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
        ns_id = self._namespace(request.namespace)
        hashes = self._hashes(ns_id, request.keys)
        tier = TIER_NAMES.get(request.tier, "") if request.tier else ""
        if request.tier and not tier:
            raise InvalidArgument(unknown_tier_message(request.tier, [t.name for t in self.store.memory_tiers]))
        r = await self.store.prefetch(ns_id, hashes, tier)
        return kvstore_pb2.PrefetchResponse(
            tier=TIER_BY_NAME[r.tier], requested=r.requested, raised=r.raised, already=r.already, missing=r.missing,
            skipped=r.skipped,
        )

    async def Verify(self, request: kvstore_pb2.VerifyRequest, context: Context) -> kvstore_pb2.VerifyResponse:
        ns_id = self._namespace(request.namespace)
        verified, dropped = await self.store.verify(ns_id, self._hashes(ns_id, request.keys))
        return kvstore_pb2.VerifyResponse(verified=verified, dropped=dropped)

    # -------------------------------------------------------------- data planes

    async def LocalSegment(self, request: kvstore_pb2.LocalSegmentRequest,
                           context: Context) -> kvstore_pb2.LocalSegmentResponse:
        return self.local.segment()

    async def LocalPut(self, request: kvstore_pb2.LocalPutRequest, context: Context) -> kvstore_pb2.LocalPutResponse:
        return await self.local.put(request)

    async def LocalCommit(self, request: kvstore_pb2.LocalCommitRequest, context: Context) -> kvstore_pb2.PutResponse:
        return await self.local.commit(request)

    async def LocalFetch(self, request: kvstore_pb2.LocalFetchRequest,
                         context: Context) -> kvstore_pb2.LocalFetchResponse:
        return await self.local.fetch(request)

    async def DeviceSegment(self, request: kvstore_pb2.DeviceSegmentRequest,
                            context: Context) -> kvstore_pb2.DeviceSegmentResponse:
        return self.device.segment()

    async def DeviceFetch(self, request: kvstore_pb2.LocalFetchRequest,
                          context: Context) -> kvstore_pb2.LocalFetchResponse:
        return await self.device.fetch(request)

    async def DevicePut(self, request: kvstore_pb2.LocalPutRequest, context: Context) -> kvstore_pb2.LocalPutResponse:
        return await self.device.put(request)
