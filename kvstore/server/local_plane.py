"""The shared-memory data plane's calls: LocalSegment, LocalPut, LocalCommit, LocalFetch.

Primitives: `LocalPlaneService` (`segment()`, `put(request)`, `commit(request)`, `fetch(request)`,
and `begin_put` / `lease_blocks` for a given tier, which the device plane shares).
The open puts and reservations themselves are kept in `kvstore.server.local_puts`.
In a pool, a committed put is forwarded through the daemon's node of the pool, and a
fetch first waits for blocks a lookup is copying here (`PoolNode`,
kvstore.server.pool_node); a daemon alone's node answers both at once.

A co-located client moves block bytes by memcpy into and out of the host tier's segment;
these calls carry only offsets. A layout with KV groups moves its parts the same way, one
slot per part in wire order (group-major, `kvstore.groups.part_order`), each of its
group's size: LocalPut answers an offset per part, LocalCommit takes a checksum per part
and publishes them all or none, and LocalFetch leases every part of the longest prefix
every group serves, or none when any of them is not in host memory (the client then
fetches the prefix as a stream). A fetch leases the leading blocks held in the tier and
answers their offsets and checksums; the lease ends on the side of a later call
(`release_lease_ids`) or by expiry. A put takes two round trips (LocalPut reserves
PENDING slots, the client copies, LocalCommit publishes) or, in steady state, one:

The one-trip put. A put or commit may ask for `reserve_ahead` empty slots, held as a
reservation for the client's next put; that put copies into them first and then
commits once, naming the reservation and the put's header (`_commit_reserved`). The
slots of a reservation belong to exactly one owner at every step, so each is freed
exactly once, whatever fails:
- while the reservation is open: `LocalPuts` (expiry and shutdown free them);
- once taken, until the put adopts the filled ones: this call (any failure frees all);
- after the adoption: the put owns the filled slots (its abort frees them), this call
  the spare ones (freed on failure, or passed on as the next reservation);
- a put that reuses a reservation it does not need (`reuse_reservation_id`) takes its
  slots as spares for the next reservation, or frees them if they do not fit.

Whose memory a client maps: the host tier's, through its `SharedWindow` (the tier
contract's, `kvstore.core.tier`). With auth off there is one tenant: every client maps
the host tier's one segment, by path. With auth on the host tier keeps one segment per
tenant (it has `spaces`): `LocalSegment` hands the caller its own tenant's segment, as
a file descriptor over the control lane (`kvstore.server.control_lane.PASSED_FDS`; over gRPC it
is refused, FAILED_PRECONDITION, and the SDK moves bytes through Put and Fetch), and
every offset a client is given is one of its tenant's slots, in that segment: a put's
slots and a reservation's come from the caller's space, a put into a namespace of
another space (an admin naming it by id) is refused, and a fetch's leased run stops at
the first block of another space (the client fetches the rest as bytes).

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from kvstore.core.store import Store
from kvstore.core.tier import SharedSegment, SharedWindow, Slot
from kvstore.core.types import NamespaceInfo
from kvstore.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.server.auth import current_identity
from kvstore.server.cluster import forward_put
from kvstore.server.control_lane import PASSED_FDS
from kvstore.server.local_puts import LocalPuts
from kvstore.server.pool_node import PoolNode
from kvstore.server.requests import Miss, RequestResolver, UnregisteredLayout, hash_fields, packed_reply
from kvstore.shm import HEADER_BYTES
from kvstore.tiers import HOST
from kvstore.v1 import kvstore_pb2

# The tier the shared-memory plane serves from and puts into.
LOCAL_TIER = HOST
# Leases a local call may end on the side (clients batch the releases of their fetches).
MAX_PIGGYBACK_RELEASES = 64
DEFAULT_LOCAL_LEASE_MS = 10_000
# Empty slots one reservation may hold for a client's next put (one-trip puts).
MAX_RESERVE_AHEAD = 1024


NO_SEGMENT = "this daemon has no shared-memory segment; use Put and Fetch"
SEGMENT_NEEDS_LANE = (
    "with auth on, each tenant's shared-memory segment is handed out only over the local control lane "
    "(the Unix socket's .lane), which passes it as a file descriptor; call LocalSegment there, or use Put and Fetch"
)
ANOTHER_SPACE = ("this namespace's blocks live in another tenant's shared-memory segment; "
                 "put them with Put, or from a client of that tenant")


class LocalPlaneService:
    def __init__(self, store: Store, resolver: RequestResolver, host: SharedWindow | None,
                 puts: LocalPuts, node: PoolNode) -> None:
        self.store = store
        self.resolver = resolver
        self._host = host
        # One segment per tenant (auth on): offsets are translated and checked.
        self._spaced: SharedWindow | None = host if host is not None and host.spaces else None
        # The daemon's own table: its sweep and shutdown must see these puts.
        self.puts = puts
        # This daemon's node of the pool (kvstore.server.pool_node): a committed put is
        # forwarded through it, and a fetch waits for the blocks its pulls are copying here.
        self.node = node

    def require_segment(self) -> SharedSegment:
        """The segment the caller's blocks are in (its tenant's, with auth on)."""
        return self._require_host().segment_for(self._caller_space())

    def _require_host(self) -> SharedWindow:
        if self._host is None:
            raise FailedPrecondition(NO_SEGMENT)
        return self._host

    def _caller_space(self) -> int:
        return self.store.registry.space_of_tenant(current_identity().tenant) if self._spaced is not None else 0

    def _in_another_space(self, info: NamespaceInfo) -> bool:
        """Whether a namespace's blocks live in another segment than the caller's (its
        tenant is not the caller's: an admin naming it by id)."""
        return self._spaced is not None and self.store.registry.space_of_tenant(info.tenant) != self._caller_space()

    def segment(self) -> kvstore_pb2.LocalSegmentResponse:
        if self._spaced is None:
            seg = self.require_segment()
            return kvstore_pb2.LocalSegmentResponse(
                path=seg.path, token=seg.token, data_offset=HEADER_BYTES, capacity_bytes=seg.capacity
            )
        fds = PASSED_FDS.get()
        if fds is None:
            raise FailedPrecondition(SEGMENT_NEEDS_LANE)
        seg = self.require_segment()
        fds.append(seg.fd)
        return kvstore_pb2.LocalSegmentResponse(token=seg.token, data_offset=HEADER_BYTES, capacity_bytes=seg.capacity)

    def _client_offsets(self, slots: Sequence[Slot | None], space: int) -> list[int]:
        """What a client is told of `slots` (host slots of `space`; None: a block already
        held, -1): offsets in its segment. Refused if any lies in another space."""
        spaced = self._spaced
        if spaced is None:
            return [-1 if slot is None else slot.offset for slot in slots]
        offsets = spaced.client_offsets(space, [slot.offset for slot in slots if slot is not None])
        if len(offsets) != sum(slot is not None for slot in slots):
            raise FailedPrecondition(ANOTHER_SPACE)
        mine = iter(offsets)
        return [-1 if slot is None else next(mine) for slot in slots]

    async def put(self, request: kvstore_pb2.LocalPutRequest) -> kvstore_pb2.LocalPutResponse:
        if self._host is None:
            raise FailedPrecondition(NO_SEGMENT)
        return await self.begin_put(request, LOCAL_TIER)

    async def fetch(self, request: kvstore_pb2.LocalFetchRequest) -> kvstore_pb2.LocalFetchResponse:
        if self._host is None:
            raise FailedPrecondition(NO_SEGMENT)
        node = self.node
        if node.pulling:
            # Blocks a lookup is copying here from other nodes: served once they landed.
            with contextlib.suppress(UnregisteredLayout):  # nothing was put in it: a miss below
                ns_id = self.resolver.namespace(request.namespace)
                await node.settle_fetch(ns_id, self.resolver.chain(ns_id, request.keys))
        return self.lease_blocks(request, LOCAL_TIER)

    def release_leases(self, lease_ids: Sequence[str]) -> None:
        if len(lease_ids) > MAX_PIGGYBACK_RELEASES:
            raise InvalidArgument(
                f"{len(lease_ids)} leases to release in one call; at most {MAX_PIGGYBACK_RELEASES} (use Unpin)"
            )
        untag = self.resolver.tags.untag
        for tagged in lease_ids:
            lease_id = untag(tagged)
            if lease_id:
                self.store.unpin(lease_id)

    async def begin_put(self, request: kvstore_pb2.LocalPutRequest, tier: str) -> kvstore_pb2.LocalPutResponse:
        """Reserve PENDING slots in `tier` for a co-located client to copy into."""
        resolver, store = self.resolver, self.store
        self.release_leases(request.release_lease_ids)
        info = resolver.put_namespace(request.header.namespace)
        if request.header.group_spans:
            raise InvalidArgument("group_spans (an import's parts) go with Put, not the shared-memory or device plane")
        ns_id = info.namespace_id
        hashes, parent = resolver.put_keys(info, request.header)
        resolver.put_session(request.header)  # checked now; applied at commit
        if tier == LOCAL_TIER and self._in_another_space(info):
            raise FailedPrecondition(ANOTHER_SPACE)
        # A grouped layout's slots are its parts', group-major, of each group's size;
        # reservations hold slots of one size, so its puts take two round trips.
        grouped = bool(info.layout.groups)
        txn = (store.begin_stream_put(info, hashes, parent, tier=tier) if grouped
               else store.begin_put(info, hashes, parent, tier=tier))
        await txn.reserve()
        try:
            offsets = (self._client_offsets(txn.slots(), self._caller_space()) if tier == LOCAL_TIER
                       else [-1 if slot is None else slot.offset for slot in txn.slots()])
        except BaseException:
            txn.abort()
            raise
        tenant = current_identity().tenant
        txn_id = self.puts.begin(txn, request.header, tenant)
        resp = kvstore_pb2.LocalPutResponse(
            txn_id=txn_id,
            offsets=offsets,
            block_bytes=txn.block_bytes,
            namespace_id=ns_id,
            expires_in_ms=self.puts.ttl_ms,
            **hash_fields(hashes, packed_reply(request.header.keys)),
        )
        spare: list[Slot] = []
        if request.reuse_reservation_id:
            old = self.puts.pop_reservation(request.reuse_reservation_id, tenant)
            if old is not None:
                if old.block_bytes == txn.block_bytes and tier == LOCAL_TIER:
                    spare = old.slots
                else:
                    store.free_slots(old.slots)
        if request.reserve_ahead and tier == LOCAL_TIER and not grouped:
            reservation = await self._reserve_ahead(txn.block_bytes, request.reserve_ahead, spare)
            if reservation is not None:
                resp.reservation.CopyFrom(reservation)
        else:
            store.free_slots(spare)
        return resp

    async def _reserve_ahead(self, block_bytes: int, count: int,
                             spare: list[Slot]) -> kvstore_pb2.SlotReservation | None:
        """Hold `count` empty host slots (reusing `spare` ones first) for the client's next
        put. None when no room can be made: the next put then takes two round trips."""
        store = self.store
        if count > MAX_RESERVE_AHEAD:
            store.free_slots(spare)
            raise InvalidArgument(f"reserve_ahead is {count}; at most {MAX_RESERVE_AHEAD} slots")
        keep, extra = spare[:count], spare[count:]
        store.free_slots(extra)
        space = self._caller_space()
        try:
            slots = keep + await store.reserve_slots(LOCAL_TIER, block_bytes, count - len(keep), space)
        except ResourceExhausted:
            store.free_slots(keep)
            return None
        try:
            offsets = self._client_offsets(slots, space)
        except BaseException:
            store.free_slots(slots)
            raise
        res_id = self.puts.reserve(slots, block_bytes, store.free_slots, current_identity().tenant)
        # The put after next will want as many slots again: evict for them while the client
        # copies into these, rather than inside its next call.
        store.make_room_soon(LOCAL_TIER, block_bytes * count, block_bytes)
        return kvstore_pb2.SlotReservation(reservation_id=res_id, offsets=offsets,
                                           block_bytes=block_bytes, expires_in_ms=self.puts.ttl_ms)

    async def commit(self, request: kvstore_pb2.LocalCommitRequest) -> kvstore_pb2.PutResponse:
        """Publish (or abort) a put begun by LocalPut, or a one-trip put into a reservation."""
        if request.reservation_id:
            return await self._commit_reserved(request)
        open_put = self.puts.take(request.txn_id, current_identity().tenant)
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
        header = open_put.header
        if header is not None:
            session = self.resolver.put_session(header)
            if session:
                self.store.hint(result.namespace_id, result.block_hashes, session, header.hint.expect_reuse_within_s,
                                carried_by="put")
        packed = header is not None and packed_reply(header.keys)
        resp = kvstore_pb2.PutResponse(
            stored=result.stored, existing=result.existing, namespace_id=result.namespace_id,
            **hash_fields(result.block_hashes, packed),
        )
        if header is not None:
            waiting = forward_put(self.node, self.resolver, result.namespace_id, header, resp)
            if waiting is not None:
                await waiting
        return resp

    async def _commit_reserved(self, request: kvstore_pb2.LocalCommitRequest) -> kvstore_pb2.PutResponse:
        """A put in one round trip: its blocks already sit in the slots of a reservation
        (who frees which slot when: see the module docstring)."""
        store, resolver = self.store, self.resolver
        res = self.puts.take_reservation(request.reservation_id, current_identity().tenant)
        if request.abort:
            store.free_slots(res.slots)
            return kvstore_pb2.PutResponse()
        header = request.header
        try:
            self._require_host()
            self.release_leases(request.release_lease_ids)
            info = resolver.put_namespace(header.namespace)
            hashes, parent = resolver.put_keys(info, header)
            session = resolver.put_session(header)
            block_bytes = info.layout.bytes_per_block
            if info.layout.groups:
                raise InvalidArgument("a layout with KV groups is put with LocalPut (its parts differ in size; a "
                                      "reservation's slots are of one size)")
            if block_bytes != res.block_bytes:
                raise InvalidArgument(f"the reservation holds {res.block_bytes}-byte slots; this namespace's "
                                      f"blocks are {block_bytes} bytes; put them with LocalPut")
            if len(hashes) > len(res.slots):
                raise InvalidArgument(f"a put of {len(hashes)} blocks into a reservation of {len(res.slots)} "
                                      "slots; put them with LocalPut")
            if self._in_another_space(info):
                raise FailedPrecondition(ANOTHER_SPACE)
            txn = store.begin_put(info, hashes, parent, tier=LOCAL_TIER)
        except BaseException:
            store.free_slots(res.slots)
            raise
        filled, spare = res.slots[: len(hashes)], res.slots[len(hashes) :]
        try:
            spare = await txn.adopt(filled) + spare
        except BaseException:
            txn.abort()  # adopt took no slot
            store.free_slots(res.slots)
            raise
        try:
            txn.mark_written()
            result = await txn.commit(list(request.checksums))
        except BaseException:
            txn.abort()  # frees the adopted slots
            store.free_slots(spare)
            raise
        if session:
            store.hint(result.namespace_id, result.block_hashes, session, header.hint.expect_reuse_within_s,
                       carried_by="put")
        resp = kvstore_pb2.PutResponse(stored=result.stored, existing=result.existing,
                                       namespace_id=result.namespace_id,
                                       **hash_fields(result.block_hashes, packed_reply(header.keys)))
        waiting = forward_put(self.node, resolver, result.namespace_id, header, resp, hashes, parent)
        if waiting is not None:
            await waiting
        if request.reserve_ahead:
            reservation = await self._reserve_ahead(block_bytes, request.reserve_ahead, spare)
            if reservation is not None:
                resp.reservation.CopyFrom(reservation)
        else:
            store.free_slots(spare)
        return resp

    def lease_blocks(self, request: kvstore_pb2.LocalFetchRequest, tier: str) -> kvstore_pb2.LocalFetchResponse:
        """The leading blocks of the held prefix that sit in `tier`, by offset, under a lease."""
        resolver = self.resolver
        self.release_leases(request.release_lease_ids)
        ns_id = resolver.known(request.namespace, request.keys)
        if isinstance(ns_id, Miss):
            return kvstore_pb2.LocalFetchResponse(block_bytes=ns_id.layout.bytes_per_block,
                                                  namespace_id=ns_id.namespace_id,
                                                  block_size_tokens=ns_id.layout.block_size_tokens)
        chain = resolver.chain(ns_id, request.keys)
        result, offsets, checksums = self.store.lease_prefix(
            ns_id, chain, request.lease_ms or DEFAULT_LOCAL_LEASE_MS, tier=tier
        )
        if self._spaced is not None and tier == LOCAL_TIER and offsets:
            # Only the caller's own segment is mapped on its side: the run stops at a block
            # of another space (the lease still covers the rest until it ends).
            mine = self._spaced.client_offsets(self._caller_space(), offsets)
            # A grouped prefix's parts go all or none (the client then fetches it as a stream).
            grouped = bool(self.store.namespace(ns_id).layout.groups)
            offsets = [] if grouped and len(mine) != len(offsets) else mine
            checksums = checksums[: len(offsets)]
        return kvstore_pb2.LocalFetchResponse(
            num_blocks=result.num_blocks,
            offsets=offsets,
            checksums=checksums,
            block_bytes=self.store.namespace(ns_id).layout.bytes_per_block,
            lease_id=resolver.tags.tag(result.lease_id),
            namespace_id=ns_id,
            block_size_tokens=result.block_size_tokens,
            **hash_fields(result.hashes_packed, packed_reply(request.keys)),
        )
