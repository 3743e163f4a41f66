"""gRPC servicers: translate protobuf messages to store verbs and back, nothing more.

Validation of shapes (namespace refs, key lists, token ranges) happens here or in the
store; every failure is a `kvstore.errors` exception that the interceptor maps to its
status. No servicer method touches bytes beyond handing chunks to the store.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from kvstore import __version__
from kvstore.convert import TIER_BY_NAME, TIER_NAMES, layout_from_proto
from kvstore.core.namespaces import check_hint
from kvstore.core.results import StoreStatus
from kvstore.core.store import Store
from kvstore.core.tier import Slot
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvstore.hashing import HASH_BYTES, block_hashes_packed, split_hashes, tenant_namespace_id, token_bytes
from kvstore.layout import KVLayout
from kvstore.native import XXH3, native
from kvstore.server.auth import current_identity
from kvstore.server.info import render_info
from kvstore.server.local_puts import LocalPuts
from kvstore.shm import HEADER_BYTES
from kvstore.tiers.segment import Segment
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from kvstore.wire import Framed, RawChunk, chunk_prefix, encode_chunk

# Layouts whose namespace id the servicer remembers (see KVStoreServicer._namespace).
LAYOUT_IDS_KEPT = 1024


@functools.lru_cache(maxsize=8)
def tier_enum_table(names: tuple[str, ...]) -> bytes:
    """A `bytes.translate` table from a store's tier ids (indexes into `names`) to Tier
    values: a lookup's tier ids become LookupResponse.tiers_packed in one C pass."""
    table = bytearray(256)
    for tid, name in enumerate(names):
        table[tid] = TIER_BY_NAME.get(name, kvstore_pb2.TIER_UNSPECIFIED)
    return bytes(table)


def packed_reply(keys: kvstore_pb2.BlockKeys) -> bool:
    """Whether a request's answer carries its block hashes packed (`block_hashes_packed`)
    rather than in the repeated field older clients read (see BlockKeys.packed_reply)."""
    return keys.packed_reply or keys.WhichOneof("keys") == "packed_hashes"


def hash_fields(hashes: Sequence[bytes] | bytes, packed: bool) -> dict[str, Any]:
    """A response's block hash field, in the form the request asked for, from hashes given
    one by one or already packed (N x 16 bytes)."""
    if isinstance(hashes, bytes):
        return {"block_hashes_packed": hashes} if packed else {"block_hashes": split_hashes(hashes)}
    return {"block_hashes_packed": b"".join(hashes)} if packed else {"block_hashes": hashes}


LOCAL_TIER = "host"
# The tier the device (CUDA IPC) plane serves from and puts into.
DEVICE_TIER = "hbm"
# Leases a local call may end on the side (clients batch the releases of their fetches).
MAX_PIGGYBACK_RELEASES = 64
DEFAULT_LOCAL_LEASE_MS = 10_000
# Empty slots one reservation may hold for a client's next put (one-trip puts).
MAX_RESERVE_AHEAD = 1024


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: Store, chunk_bytes: int, segment: Segment | None = None,
                 local_puts: LocalPuts | None = None, *, max_tokens_per_call: int = 1 << 20,
                 max_block_bytes: int = 256 << 20, lease_key: bytes | None = None,
                 max_namespaces_per_tenant: int | None = None) -> None:
        self.store = store
        self.max_namespaces_per_tenant = max_namespaces_per_tenant
        # With auth on, lease ids leave tagged with a MAC of the caller's tenant, so one
        # tenant cannot end another's leases even with a leaked id (admins may end any).
        self.lease_key = lease_key
        self.max_tokens_per_call = max_tokens_per_call
        self.max_block_bytes = max_block_bytes
        self.chunk_bytes = chunk_bytes
        # (tenant, salt, layout message bytes) -> namespace id: an engine names its layout
        # in every call, and parsing, checking and hashing it each time cost more than a
        # short lookup itself. Only layouts that passed the checks below are kept.
        self._layout_ids: dict[tuple[str, bytes, bytes], bytes] = {}
        self.segment = segment
        # `is None`, not `or`: an empty table is falsy (it has a length), and the daemon's
        # own table must be the one used, or its sweep and shutdown never see these puts.
        self.local_puts = local_puts if local_puts is not None else LocalPuts()

    # -------------------------------------------------------------- translation

    def _lease_tag(self, tenant: str, lease_id: str) -> str:
        assert self.lease_key is not None
        msg = tenant.encode() + b"\0" + lease_id.encode()
        return hmac.new(self.lease_key, msg, hashlib.sha256).hexdigest()[:16]

    def _lease_out(self, lease_id: str) -> str:
        if not lease_id or self.lease_key is None:
            return lease_id
        return f"{lease_id}.{self._lease_tag(current_identity().tenant, lease_id)}"

    def _session(self, session_id: str, expect_reuse_within_s: float = 1.0) -> str:
        """The policies' key for a client's session id: the id itself with auth off; with
        auth on, a digest of tenant and id, so tenants choosing the same id (or ending
        another's) never touch each other's hints."""
        check_hint(session_id, expect_reuse_within_s)
        if self.lease_key is None:
            return session_id
        tenant = current_identity().tenant
        return "t:" + hashlib.sha256(tenant.encode() + b"\0" + session_id.encode()).hexdigest()[:32]

    def _lease_in(self, tagged: str) -> str:
        """The store's lease id behind `tagged`; empty (no lease) when the tag is not the
        caller's tenant's."""
        if not tagged or self.lease_key is None:
            return tagged
        lease_id, _, tag = tagged.rpartition(".")
        who = current_identity()
        if who.is_admin and lease_id:
            return lease_id
        if not lease_id or not hmac.compare_digest(tag.encode(), self._lease_tag(who.tenant, lease_id).encode()):
            return ""
        return lease_id

    def _namespace(self, ref: kvstore_pb2.Namespace) -> bytes:
        """The caller's namespace: a layout is filed under the caller's tenant (salted id);
        an id must name a namespace of the caller's tenant (admins may name any)."""
        who = current_identity()
        which = ref.WhichOneof("ref")
        if which == "layout":
            wire = ref.layout.SerializeToString()
            known = self._layout_ids.get((who.tenant, who.salt, wire))
            if known is not None and self.store.has_namespace(known):
                return known
            layout = layout_from_proto(ref.layout)
            if layout.bytes_per_block > self.max_block_bytes:
                raise InvalidArgument(
                    f"the layout describes {layout.bytes_per_block} bytes per block, more than max_block_bytes "
                    f"({self.max_block_bytes}); use smaller blocks (fewer tokens per block)"
                )
            if self.max_namespaces_per_tenant is not None:
                self._check_tenant_namespaces(layout, who.tenant, who.salt)
            ns_id = self.store.register(layout, who.tenant, who.salt)
            if len(self._layout_ids) >= LAYOUT_IDS_KEPT:
                self._layout_ids.clear()
            self._layout_ids[(who.tenant, who.salt, wire)] = ns_id
            return ns_id
        if which == "id":
            info = self.store.namespace(ref.id)
            if info.tenant != who.tenant and not who.is_admin:
                # The same answer as for an unknown id: another tenant's ids are not confirmed.
                raise NotFound(
                    f"namespace {ref.id.hex()} is not known to this daemon; "
                    "send the full layout instead of its id (the daemon forgets namespaces on restart)"
                )
            return info.namespace_id
        raise InvalidArgument("request names no namespace: set namespace.layout (or namespace.id once registered)")

    def _check_tenant_namespaces(self, layout: KVLayout, tenant: str, salt: bytes) -> None:
        """Refuse a tenant's new namespace past `max_namespaces_per_tenant` (counted only
        when the namespace is new, so the common path is one dictionary lookup)."""
        try:
            self.store.namespace(tenant_namespace_id(layout.namespace_id, salt))
            return
        except NotFound:
            pass
        limit = self.max_namespaces_per_tenant
        assert limit is not None
        held = sum(1 for ns in self.store.namespaces() if ns.tenant == tenant)
        if held >= limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} already holds {held} namespaces, the most max_namespaces_per_tenant allows; "
                "ask an operator to flush unused ones"
            )

    def _packed_tokens(self, tokens: kvstore_pb2.TokenIds) -> bytes:
        n = len(tokens.packed_u32le) // 4 + len(tokens.token_ids)
        if n > self.max_tokens_per_call:
            raise InvalidArgument(
                f"{n} token ids in one call; the limit is max_tokens_per_call = {self.max_tokens_per_call}: "
                "send fewer tokens (a lookup needs only the prefix it asks about)"
            )
        if tokens.packed_u32le:
            if len(tokens.token_ids):
                raise InvalidArgument("set token_ids or packed_u32le, not both")
            if len(tokens.packed_u32le) % 4:
                raise InvalidArgument(f"packed_u32le is {len(tokens.packed_u32le)} bytes, not a multiple of 4")
            return tokens.packed_u32le
        return token_bytes(tokens.token_ids)

    def _chain(self, keys: kvstore_pb2.BlockKeys, which: str) -> list[bytes]:
        """The hashes a BlockKeys names (repeated or packed), checked."""
        if which == "packed_hashes":
            packed = keys.packed_hashes
            if len(packed) % HASH_BYTES == 0:
                # Bounded before the hashes are cut out; each is 16 bytes by construction.
                self._check_block_count(len(packed) // HASH_BYTES)
            return split_hashes(packed)  # names the length when it is not a multiple of 16
        hashes = list(keys.hashes.hashes)
        self.store.check_hashes(hashes)
        return hashes

    def _check_block_count(self, n: int) -> None:
        limit = self.store.limits.max_blocks_per_call
        if n > limit:
            raise InvalidArgument(f"{n} block hashes in one call; the limit is {limit}: split the request")

    def _packed_chain(self, ns_id: bytes, keys: kvstore_pb2.BlockKeys) -> bytes:
        """The chain a request names, packed (N x 16 bytes) for the store, which checks its
        length: as it came, hashed from its tokens, or joined from the hashes it listed."""
        which = keys.WhichOneof("keys")
        if which == "packed_hashes":
            return keys.packed_hashes
        if which == "tokens":
            return self.store.chain_for_tokens(ns_id, self._chain_tokens(keys))
        return b"".join(self._hashes(ns_id, keys))

    def _hashes(self, ns_id: bytes, keys: kvstore_pb2.BlockKeys) -> list[bytes]:
        which = keys.WhichOneof("keys")
        if which == "hashes" or which == "packed_hashes":
            return self._chain(keys, which)
        if which == "tokens":
            return self.store.hashes_for_tokens(ns_id, self._chain_tokens(keys))
        raise InvalidArgument("request names no blocks: set keys.packed_hashes, keys.hashes or keys.tokens")

    def _chain_tokens(self, keys: kvstore_pb2.BlockKeys) -> bytes:
        """The packed token ids of a request outside a Put, which names its chain from block 0."""
        if keys.tokens.first_block:
            raise InvalidArgument("first_block is only meaningful in a Put")
        return self._packed_tokens(keys.tokens)

    def _put_keys(self, ns_id: bytes, header: kvstore_pb2.PutHeader) -> tuple[list[bytes], bytes | None]:
        which = header.keys.WhichOneof("keys")
        if which == "hashes" or which == "packed_hashes":
            hashes = self._chain(header.keys, which)
            if header.num_blocks and header.num_blocks != len(hashes):
                raise InvalidArgument(f"num_blocks is {header.num_blocks} but {len(hashes)} hashes were sent")
            return hashes, header.parent_hash or None
        if which == "tokens":
            tokens = header.keys.tokens
            packed = self._packed_tokens(tokens)
            first, count = tokens.first_block, header.num_blocks
            info = self.store.namespace(ns_id)
            bst = info.layout.block_size_tokens
            n_tokens = len(packed) // 4
            full = n_tokens // bst
            if count == 0:
                count = full - first
            if count <= 0 or first + count > full:
                raise InvalidArgument(
                    f"the put covers blocks [{first}, {first + max(count, 0)}) but {n_tokens} tokens "
                    f"make {full} full blocks of {bst} tokens; send the whole prefix up to the last block"
                )
            self.store.check_hashes([b"\0" * 16] * count)  # the per-call block limit, before hashing
            # The prefix before `first` is hashed too (the chain needs it) but not bounded
            # by the per-call block limit: it names no blocks of this put.
            all_hashes = block_hashes_packed(info.chain_seed or ns_id, memoryview(packed)[: (first + count) * bst * 4],
                                             bst)
            return all_hashes[first : first + count], all_hashes[first - 1] if first else None
        raise InvalidArgument("put header names no blocks: set keys.packed_hashes, keys.hashes or keys.tokens")

    # -------------------------------------------------------------- RPCs

    async def Lookup(self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.LookupResponse:
        ns_id = self._namespace(request.namespace)
        keys = request.keys
        chain = self._packed_chain(ns_id, keys)
        session = self._session(request.hint.session_id, request.hint.expect_reuse_within_s) \
            if request.HasField("hint") else ""
        r = self.store.lookup(ns_id, chain, request.lease_ms)
        if session and r.num_blocks:
            self.store.hint(ns_id, r.block_hashes, session, request.hint.expect_reuse_within_s)
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

    async def Put(
        self, request_iterator: AsyncIterator[kvstore_pb2.PutRequest | RawChunk], context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        stream = request_iterator.__aiter__()
        first = await anext(stream, None)
        if first is None or isinstance(first, RawChunk) or first.WhichOneof("msg") != "header":
            raise InvalidArgument("a Put stream must start with a header message")
        header = first.header
        ns_id = self._namespace(header.namespace)
        hashes, parent = self._put_keys(ns_id, header)
        if header.HasField("hint"):
            check_hint(header.hint.session_id, header.hint.expect_reuse_within_s)
        async with self.store.begin_put(ns_id, hashes, parent) as txn:
            async for msg in stream:
                if isinstance(msg, RawChunk):  # the fast path: a view into the received message
                    await txn.write(msg.block, msg.data)
                    continue
                if msg.WhichOneof("msg") != "chunk":
                    raise InvalidArgument("only block chunks may follow a Put header")
                await txn.write(msg.chunk.block, msg.chunk.data)
            result = await txn.commit()
        self._apply_put_hint(header, ns_id, hashes)
        return kvstore_pb2.PutResponse(stored=result.stored, existing=result.existing, namespace_id=ns_id,
                                       **hash_fields(result.block_hashes, packed_reply(header.keys)))

    async def Fetch(
        self, request: kvstore_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.FetchResponse | bytes]:
        ns_id = self._namespace(request.namespace)
        hashes = self._hashes(ns_id, request.keys)
        async with self.store.open_fetch(ns_id, hashes, self._lease_in(request.lease_id)) as stream:
            yield kvstore_pb2.FetchResponse(
                header=kvstore_pb2.FetchHeader(
                    num_blocks=stream.num_blocks, block_bytes=stream.block_bytes, namespace_id=ns_id
                )
            )
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

    async def Delete(self, request: kvstore_pb2.DeleteRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.DeleteResponse:
        ns_id = self._namespace(request.namespace)
        return kvstore_pb2.DeleteResponse(deleted=self.store.delete(ns_id, self._hashes(ns_id, request.keys)))

    async def Pin(self, request: kvstore_pb2.PinRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.PinResponse:
        ns_id = self._namespace(request.namespace)
        r = self.store.pin(ns_id, self._hashes(ns_id, request.keys), request.ttl_ms)
        return kvstore_pb2.PinResponse(lease_id=self._lease_out(r.lease_id), pinned=r.pinned,
                                       expires_in_ms=r.expires_in_ms)

    async def Unpin(self, request: kvstore_pb2.UnpinRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.UnpinResponse:
        lease_id = self._lease_in(request.lease_id)
        return kvstore_pb2.UnpinResponse(released=bool(lease_id) and self.store.unpin(lease_id))

    def _apply_put_hint(self, header: kvstore_pb2.PutHeader, ns_id: bytes, hashes: list[bytes]) -> None:
        if header.HasField("hint"):
            self.store.hint(ns_id, hashes, self._session(header.hint.session_id, header.hint.expect_reuse_within_s),
                            header.hint.expect_reuse_within_s)

    async def Hint(self, request: kvstore_pb2.HintRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.HintResponse:
        ns_id = self._namespace(request.namespace)
        session = self._session(request.hint.session_id, request.hint.expect_reuse_within_s)
        hinted = self.store.hint(ns_id, self._hashes(ns_id, request.keys), session, request.hint.expect_reuse_within_s)
        return kvstore_pb2.HintResponse(hinted=hinted)

    async def EndSession(
        self, request: kvstore_pb2.EndSessionRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.EndSessionResponse:
        self.store.end_session(self._session(request.session_id))
        return kvstore_pb2.EndSessionResponse()

    async def Prefetch(
        self, request: kvstore_pb2.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PrefetchResponse:
        ns_id = self._namespace(request.namespace)
        hashes = self._hashes(ns_id, request.keys)
        tier = TIER_NAMES.get(request.tier, "") if request.tier else ""
        r = await self.store.prefetch(ns_id, hashes, tier)
        return kvstore_pb2.PrefetchResponse(
            tier=TIER_BY_NAME[r.tier], requested=r.requested, raised=r.raised, already=r.already, missing=r.missing,
            skipped=r.skipped,
        )

    async def Verify(self, request: kvstore_pb2.VerifyRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.VerifyResponse:
        ns_id = self._namespace(request.namespace)
        verified, dropped = await self.store.verify(ns_id, self._hashes(ns_id, request.keys))
        return kvstore_pb2.VerifyResponse(verified=verified, dropped=dropped)

    # -------------------------------------------------------------- local data plane

    def _segment(self) -> Segment:
        if self.segment is None:
            raise FailedPrecondition("this daemon has no shared-memory segment; use Put and Fetch")
        return self.segment

    async def LocalSegment(
        self, request: kvstore_pb2.LocalSegmentRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LocalSegmentResponse:
        seg = self._segment()
        return kvstore_pb2.LocalSegmentResponse(
            path=seg.path, token=seg.token, data_offset=HEADER_BYTES, capacity_bytes=seg.capacity
        )

    def _release_leases(self, lease_ids: Sequence[str]) -> None:
        if len(lease_ids) > MAX_PIGGYBACK_RELEASES:
            raise InvalidArgument(
                f"{len(lease_ids)} leases to release in one call; at most {MAX_PIGGYBACK_RELEASES} (use Unpin)"
            )
        for tagged in lease_ids:
            lease_id = self._lease_in(tagged)
            if lease_id:
                self.store.unpin(lease_id)

    async def LocalPut(
        self, request: kvstore_pb2.LocalPutRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LocalPutResponse:
        self._segment()
        return await self._begin_put(request, LOCAL_TIER)

    async def _begin_put(self, request: kvstore_pb2.LocalPutRequest, tier: str) -> kvstore_pb2.LocalPutResponse:
        """Reserve PENDING slots in `tier` for a co-located client to copy into."""
        self._release_leases(request.release_lease_ids)
        ns_id = self._namespace(request.header.namespace)
        hashes, parent = self._put_keys(ns_id, request.header)
        if request.header.HasField("hint"):
            check_hint(request.header.hint.session_id, request.header.hint.expect_reuse_within_s)
        txn = self.store.begin_put(ns_id, hashes, parent, tier=tier)
        await txn.reserve()
        txn_id = self.local_puts.begin(txn, request.header, current_identity().tenant)
        resp = kvstore_pb2.LocalPutResponse(
            txn_id=txn_id,
            offsets=[-1 if slot is None else slot.offset for slot in txn.slots()],
            block_bytes=txn.block_bytes,
            namespace_id=ns_id,
            expires_in_ms=self.local_puts.ttl_ms,
            **hash_fields(hashes, packed_reply(request.header.keys)),
        )
        spare: list[Slot] = []
        if request.reuse_reservation_id:
            old = self.local_puts.pop_reservation(request.reuse_reservation_id, current_identity().tenant)
            if old is not None:
                if old.block_bytes == txn.block_bytes and tier == LOCAL_TIER:
                    spare = old.slots
                else:
                    self.store.free_slots(old.slots)
        if request.reserve_ahead and tier == LOCAL_TIER:
            reservation = await self._reserve_ahead(txn.block_bytes, request.reserve_ahead, spare)
            if reservation is not None:
                resp.reservation.CopyFrom(reservation)
        else:
            self.store.free_slots(spare)
        return resp

    async def _reserve_ahead(self, block_bytes: int, count: int,
                             spare: list[Slot]) -> kvstore_pb2.SlotReservation | None:
        """Hold `count` empty host slots (reusing `spare` ones first) for the client's next
        put. None when no room can be made: the next put then takes two round trips."""
        if count > MAX_RESERVE_AHEAD:
            self.store.free_slots(spare)
            raise InvalidArgument(f"reserve_ahead is {count}; at most {MAX_RESERVE_AHEAD} slots")
        keep, extra = spare[:count], spare[count:]
        self.store.free_slots(extra)
        try:
            slots = keep + await self.store.reserve_slots(LOCAL_TIER, block_bytes, count - len(keep))
        except ResourceExhausted:
            self.store.free_slots(keep)
            return None
        res_id = self.local_puts.reserve(slots, block_bytes, self.store.free_slots, current_identity().tenant)
        # The put after next will want as many slots again: evict for them while the client
        # copies into these, rather than inside its next call.
        self.store.make_room_soon(LOCAL_TIER, block_bytes * count, block_bytes)
        return kvstore_pb2.SlotReservation(reservation_id=res_id, offsets=[s.offset for s in slots],
                                           block_bytes=block_bytes, expires_in_ms=self.local_puts.ttl_ms)

    async def LocalCommit(
        self, request: kvstore_pb2.LocalCommitRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        if request.reservation_id:
            return await self._commit_reserved(request)
        open_put = self.local_puts.take(request.txn_id, current_identity().tenant)
        txn = open_put.txn
        if request.abort:
            txn.abort()
            return kvstore_pb2.PutResponse()
        try:
            txn.mark_written()
            result = await txn.commit(list(request.checksums))
        except BaseException:
            txn.abort()
            raise
        if open_put.header is not None:
            self._apply_put_hint(open_put.header, result.namespace_id, result.block_hashes)
        packed = open_put.header is not None and packed_reply(open_put.header.keys)
        return kvstore_pb2.PutResponse(
            stored=result.stored, existing=result.existing, namespace_id=result.namespace_id,
            **hash_fields(result.block_hashes, packed),
        )

    async def _commit_reserved(self, request: kvstore_pb2.LocalCommitRequest) -> kvstore_pb2.PutResponse:
        """A put in one round trip: its blocks already sit in the slots of a reservation."""
        res = self.local_puts.take_reservation(request.reservation_id, current_identity().tenant)
        if request.abort:
            self.store.free_slots(res.slots)
            return kvstore_pb2.PutResponse()
        try:
            self._segment()
            self._release_leases(request.release_lease_ids)
            ns_id = self._namespace(request.header.namespace)
            hashes, parent = self._put_keys(ns_id, request.header)
            if request.header.HasField("hint"):
                check_hint(request.header.hint.session_id, request.header.hint.expect_reuse_within_s)
            block_bytes = self.store.namespace(ns_id).layout.bytes_per_block
            if block_bytes != res.block_bytes:
                raise InvalidArgument(f"the reservation holds {res.block_bytes}-byte slots; this namespace's "
                                      f"blocks are {block_bytes} bytes; put them with LocalPut")
            if len(hashes) > len(res.slots):
                raise InvalidArgument(f"a put of {len(hashes)} blocks into a reservation of {len(res.slots)} "
                                      "slots; put them with LocalPut")
            txn = self.store.begin_put(ns_id, hashes, parent, tier=LOCAL_TIER)
        except BaseException:
            self.store.free_slots(res.slots)
            raise
        filled, spare = res.slots[: len(hashes)], res.slots[len(hashes) :]
        try:
            spare = await txn.adopt(filled) + spare
        except BaseException:
            txn.abort()  # adopt took no slot
            self.store.free_slots(res.slots)
            raise
        try:
            txn.mark_written()
            result = await txn.commit(list(request.checksums))
        except BaseException:
            txn.abort()  # frees the adopted slots
            self.store.free_slots(spare)
            raise
        self._apply_put_hint(request.header, result.namespace_id, result.block_hashes)
        resp = kvstore_pb2.PutResponse(stored=result.stored, existing=result.existing,
                                       namespace_id=result.namespace_id,
                                       **hash_fields(result.block_hashes, packed_reply(request.header.keys)))
        if request.reserve_ahead:
            reservation = await self._reserve_ahead(block_bytes, request.reserve_ahead, spare)
            if reservation is not None:
                resp.reservation.CopyFrom(reservation)
        else:
            self.store.free_slots(spare)
        return resp

    async def LocalFetch(
        self, request: kvstore_pb2.LocalFetchRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LocalFetchResponse:
        self._segment()
        return self._lease_blocks(request, LOCAL_TIER)

    def _lease_blocks(self, request: kvstore_pb2.LocalFetchRequest, tier: str) -> kvstore_pb2.LocalFetchResponse:
        """The leading blocks of the held prefix that sit in `tier`, by offset, under a lease."""
        self._release_leases(request.release_lease_ids)
        ns_id = self._namespace(request.namespace)
        chain = self._packed_chain(ns_id, request.keys)
        result, offsets, checksums = self.store.lease_prefix(
            ns_id, chain, request.lease_ms or DEFAULT_LOCAL_LEASE_MS, tier=tier
        )
        return kvstore_pb2.LocalFetchResponse(
            num_blocks=result.num_blocks,
            offsets=offsets,
            checksums=checksums,
            block_bytes=self.store.namespace(ns_id).layout.bytes_per_block,
            lease_id=self._lease_out(result.lease_id),
            namespace_id=ns_id,
            block_size_tokens=result.block_size_tokens,
            **hash_fields(result.hashes_packed, packed_reply(request.keys)),
        )

    # -------------------------------------------------------------- device data plane

    def _hbm(self) -> Any:
        """The HBM tier (a `kvstore.tiers.hbm.HbmTier`; not imported here: it imports torch)."""
        tier = next((st.tier for st in self.store.tiers if st.name == DEVICE_TIER), None)
        if tier is None:
            raise FailedPrecondition("this daemon has no HBM tier; use the shared-memory plane (LocalFetch)")
        return tier

    async def DeviceSegment(
        self, request: kvstore_pb2.DeviceSegmentRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.DeviceSegmentResponse:
        seg = self._segment()
        hbm = self._hbm()
        export = hbm.ipc_export()
        return kvstore_pb2.DeviceSegmentResponse(
            device_uuid=export.device_uuid, ipc_handle=export.ipc_handle, storage_bytes=export.storage_bytes,
            storage_offset=export.storage_offset, ref_counter_handle=export.ref_counter_handle,
            ref_counter_offset=export.ref_counter_offset, event_handle=export.event_handle,
            event_sync_required=export.event_sync_required, pid=os.getpid(), token=seg.token,
            # The slab itself: the allocator's capacity rounds the configured one down.
            capacity_bytes=export.storage_bytes,
        )

    async def DeviceFetch(
        self, request: kvstore_pb2.LocalFetchRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LocalFetchResponse:
        self._hbm()
        return self._lease_blocks(request, DEVICE_TIER)

    async def DevicePut(
        self, request: kvstore_pb2.LocalPutRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LocalPutResponse:
        self._hbm()
        return await self._begin_put(request, DEVICE_TIER)


def stats_to_proto(status: StoreStatus, uptime_s: float, absent: Sequence[tuple[str, str]] = ()) -> admin_pb2.StatsResponse:
    c = status.counters
    tiers = [
        admin_pb2.TierStats(
            name=t.name,
            present=True,
            capacity_bytes=t.capacity_bytes,
            used_bytes=t.used_bytes,
            blocks=t.blocks,
            hits=t.counters.hits,
            misses=t.counters.misses,
            evictions=t.counters.evictions,
            checksum_failures=t.counters.checksum_failures,
            policy=t.policy,
            promotions=t.counters.promotions,
            demotions=t.counters.demotions,
            drops=t.counters.drops,
            pending_writes=t.pending_writes,
            io_mode=t.facts.get("io_mode", ""),
            pinned=t.facts.get("pinned") == "yes",
            facts=t.facts,
        )
        for t in status.tiers
    ]
    tiers += [admin_pb2.TierStats(name=name, present=False, reason=reason) for name, reason in absent]
    return admin_pb2.StatsResponse(
        tiers=tiers,
        counters=admin_pb2.StoreCounters(
            lookups=c.lookups,
            lookup_blocks=c.lookup_blocks,
            hit_blocks=c.hit_blocks,
            miss_blocks=c.miss_blocks,
            puts=c.puts,
            blocks_stored=c.blocks_stored,
            blocks_existing=c.blocks_existing,
            bytes_in=c.bytes_in,
            fetches=c.fetches,
            blocks_fetched=c.blocks_fetched,
            bytes_out=c.bytes_out,
            deletes=c.deletes,
            evictions=c.evictions,
            checksum_failures=c.checksum_failures,
            leases_active=status.leases_active,
            put_failures=c.put_failures,
            prefetches=c.prefetches,
            ssd_write_failures=c.ssd_write_failures,
        ),
        namespaces=status.namespaces,
        uptime_s=uptime_s,
        version=__version__,
    )


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, store: Store, config_dict: dict[str, object], absent_tiers: Sequence[tuple[str, str]] = ()) -> None:
        self.store = store
        self.config_dict = config_dict
        self.absent_tiers = list(absent_tiers)
        self.started = time.monotonic()

    async def Stats(self, request: admin_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> admin_pb2.StatsResponse:
        return stats_to_proto(self.store.stats(), time.monotonic() - self.started, self.absent_tiers)

    async def Info(self, request: admin_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> admin_pb2.InfoResponse:
        text = render_info(
            self.store, time.monotonic() - self.started, self.config_dict, self.absent_tiers, request.section
        )
        return admin_pb2.InfoResponse(text=text)

