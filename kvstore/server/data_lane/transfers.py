"""Data lane transfers: the puts and fetches whose bytes move on the lane
(`kvstore.server.data_lane.server`), opened by control calls (`DataLane`, `LaneFetch`,
`LanePut`, `LaneCommit`) that the servicer delegates here. A layout with KV groups moves
each group's parts (one size each) as a transfer of its own: a fetch's are pumped one
after another, a put's are published together by one LaneCommit (`GroupedPut`).

Primitives: `DataLaneTransfers` (`offer`, `open_fetch`, `open_put`, `commit`, and for the
lane's connection threads `fetch_transfer` / `put_transfer`).

The transfers themselves are `kvstore.server.data_lane.transfer` (what both kinds share, and how
the loop and the connection threads meet), `kvstore.server.data_lane.fetch` and
`kvstore.server.data_lane.put`.

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.codecs import available, codec_mask
from kvstore.core.groups import GroupedFetchStream, GroupedPutTxn
from kvstore.core.store import Store
from kvstore.core.types import NamespaceInfo, PutOutcome
from kvstore.data_lane import VERSION
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, ResourceExhausted, error_for_status
from kvstore.hashing import HASH_BYTES
from kvstore.layout import KVLayout
from kvstore.server.auth import current_identity
from kvstore.server.cluster import forward_put, put_position
from kvstore.server.data_lane.fetch import FetchTransfer
from kvstore.server.data_lane.put import PutTransfer
from kvstore.server.data_lane.transfer import DataLaneCounters, DataLaneSettings, Transfer, TransferFailed
from kvstore.server.pool_node import PoolNode
from kvstore.server.requests import Miss, RequestResolver, hash_fields, packed_reply
from kvstore.tiers import HOST
from kvstore.v1 import kvstore_pb2

logger = logging.getLogger(__name__)

# A transfer that names no deadline (timeout_ms 0), and the longest one may name.
DEFAULT_TRANSFER_S = 30.0
MAX_TRANSFER_S = 600.0


@dataclass(eq=False, slots=True)
class GroupedPut:
    """A put of a layout with KV groups on the lane: one `PutTransfer` per group (parts of
    one size each), published together by one LaneCommit naming `id`."""

    id: bytes
    txn: GroupedPutTxn
    transfers: list[PutTransfer]
    header: kvstore_pb2.PutHeader
    tenant: str
    peer: str
    timer: asyncio.TimerHandle | None = None


@dataclass(frozen=True, slots=True)
class Joiner:
    """Which transfers a lane connection may carry, from the identity its hello proved.
    A client's connection: only transfers its own tenant opened, never one a node-to-node
    call opened. A node's credential: only transfers that calls from that node opened
    (`node`), or, for a credential the pool shares, those of any node (`ANY_NODE`), never
    a client's. Without a token file nothing tells the two apart: both (`client` and
    `ANY_NODE`)."""

    tenant: str
    client: bool  # may join transfers clients of `tenant` opened
    node: str = ""  # may join transfers node-to-node calls from this node opened (ANY_NODE: any)

    def may_join(self, tenant: str, opened_by: str) -> bool:
        """Whether a transfer of `tenant` opened by node `opened_by` ("": by a client) is this connection's."""
        if opened_by:
            return self.node == ANY_NODE or (bool(self.node) and self.node == opened_by)
        return self.client and tenant == self.tenant


ANY_NODE = "*"


class DataLaneTransfers:
    """The open transfers of one daemon, and the control calls that open and end them."""

    def __init__(self, store: Store, resolver: RequestResolver, settings: DataLaneSettings,
                 endpoints: Callable[[], list[kvstore_pb2.DataLaneEndpoint]], node: PoolNode) -> None:
        self.store = store
        self.resolver = resolver
        self.settings = settings
        self.counters = DataLaneCounters()
        self._endpoints = endpoints
        # The peer lane's addresses (set by the daemon of a pool), offered with the lane's.
        self.peer_lane_endpoints: list[kvstore_pb2.DataLaneEndpoint] = []
        # This daemon's node of the pool (kvstore.server.pool_node): transfers meet it as
        # Put and Fetch do.
        self.node = node
        self._open: dict[bytes, Transfer] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timers: dict[bytes, asyncio.TimerHandle] = {}
        self._closing = False
        # Why recent puts failed, for their LaneCommit and senders that come late (they
        # are rolled back at once). Connection threads read it: under its own lock.
        self._failed_puts: OrderedDict[bytes, tuple[str, str, TransferFailed]] = OrderedDict()
        # Open puts of layouts with KV groups, by the id their LaneCommit names.
        self._grouped_puts: dict[bytes, GroupedPut] = {}
        self._failed_lock = threading.Lock()
        host = next((st.tier for st in store.tiers if st.name == HOST), None)
        self._host = host

    def __len__(self) -> int:
        return len(self._open)

    # -------------------------------------------------------------- control calls

    def offer(self) -> kvstore_pb2.DataLaneResponse:
        endpoints = self._endpoints()
        return kvstore_pb2.DataLaneResponse(
            endpoints=endpoints, max_connections=self.settings.max_connections_per_transfer if endpoints else 0,
            version=VERSION, max_block_bytes=self.settings.max_block_bytes,
            peer_lane_endpoints=self.peer_lane_endpoints, put_runs=bool(endpoints))

    def _deadline(self, timeout_ms: int) -> tuple[float, float]:
        """(monotonic deadline, loop deadline) of a transfer asking for `timeout_ms`."""
        seconds = min(timeout_ms / 1000.0 if timeout_ms else DEFAULT_TRANSFER_S, MAX_TRANSFER_S)
        return time.monotonic() + seconds, asyncio.get_running_loop().time() + seconds

    def _connections(self, asked: int) -> int:
        return max(1, min(asked or 1, self.settings.max_connections_per_transfer))

    def _admit(self) -> None:
        if self._closing:
            raise FailedPrecondition("the data lane is closing; use Put and Fetch")
        if len(self._open) >= self.settings.max_transfers:
            raise ResourceExhausted(f"{len(self._open)} data lane transfers are open, the most this daemon allows; "
                                    "retry, or use Put and Fetch")

    def _register(self, transfer: Transfer, loop_deadline: float) -> None:
        self._open[transfer.id] = transfer
        loop = asyncio.get_running_loop()
        self._timers[transfer.id] = loop.call_at(loop_deadline, self._expire, transfer.id)

    def _forget(self, transfer: Transfer) -> None:
        if self._open.get(transfer.id) is transfer:
            del self._open[transfer.id]
        timer = self._timers.pop(transfer.id, None)
        if timer is not None:
            timer.cancel()
        if isinstance(transfer, PutTransfer):
            if transfer.idle_timer is not None:
                transfer.idle_timer.cancel()
                transfer.idle_timer = None
            # Its failure callback refers to it (a cycle that only the garbage collector's
            # full collections break, with the put's slots and runs inside): a forgotten
            # put is past failing. The connections' credits keep it a while; once they
            # let go, it is freed at once.
            transfer.on_failed = None

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def open_fetch(self, request: kvstore_pb2.LaneFetchRequest) -> kvstore_pb2.LaneFetchResponse:
        self._admit()
        resolver = self.resolver
        fetch = request.fetch
        ns_id = resolver.known(fetch.namespace, fetch.keys)
        if isinstance(ns_id, Miss):  # a layout nothing was put in: a miss, as for Fetch
            lease_id = resolver.tags.untag(fetch.lease_id)
            if lease_id:  # released when a fetch ends, whatever it found
                self.store.unpin(lease_id)
            return kvstore_pb2.LaneFetchResponse(block_bytes=ns_id.layout.bytes_per_block,
                                                 namespace_id=ns_id.namespace_id)
        if fetch.group:
            raise InvalidArgument("FetchRequest.group (an export's read) goes with Fetch, not the data lane")
        hashes = resolver.hashes(ns_id, fetch.keys)
        node = self.node  # as for a gRPC Fetch
        if current_identity().peer:
            node.peer_fetched(ns_id, hashes)
        elif node.pulling:
            await node.settle_fetch(ns_id, hashes)  # blocks a lookup is copying here
        stream = self.store.open_fetch(ns_id, hashes, resolver.tags.untag(fetch.lease_id))
        if isinstance(stream, GroupedFetchStream):
            return self._open_grouped_fetch(request, ns_id, stream)
        resp = kvstore_pb2.LaneFetchResponse(num_blocks=stream.num_blocks, block_bytes=stream.block_bytes,
                                             namespace_id=ns_id)
        if not stream.num_blocks:
            stream.close()
            return resp
        deadline, loop_deadline = self._deadline(request.timeout_ms)
        transfer = FetchTransfer(secrets.token_bytes(16), current_identity().tenant, deadline,
                                 self._connections(request.connections), asyncio.get_running_loop(), stream,
                                 self.counters)
        transfer.peer = current_identity().peer
        self._offer_codecs(transfer, self.store.namespace(ns_id).layout)
        self._register(transfer, loop_deadline)
        self.counters.add("transfers_fetch")
        self._spawn(self._run_fetch(transfer), "kvstore-lane-fetch")
        resp.transfer_id = transfer.id
        resp.codecs, resp.itemsize = transfer.codecs, transfer.itemsize
        resp.expires_in_ms = int((deadline - time.monotonic()) * 1000)
        return resp

    def _offer_codecs(self, transfer: Transfer, layout: KVLayout) -> None:
        """The lossless codecs the transfer's frames may use: every one this daemon has
        (which one, the client chooses: `kvstore.codec_chooser`), unless `lane_codecs` is off."""
        if self.settings.codecs:
            transfer.codecs = codec_mask(available())
        transfer.itemsize = layout.stored_itemsize
    def _open_grouped_fetch(self, request: kvstore_pb2.LaneFetchRequest, ns_id: bytes,
                            grouped: GroupedFetchStream) -> kvstore_pb2.LaneFetchResponse:
        """A grouped prefix's parts on the lane: a `FetchTransfer` per group (parts of one
        size each), pumped one after another as the client takes them in turn."""
        resp = kvstore_pb2.LaneFetchResponse(num_blocks=grouped.num_blocks, block_bytes=grouped.block_bytes,
                                             namespace_id=ns_id, prefix_blocks=grouped.prefix_blocks)
        if not grouped.num_blocks:
            grouped.close()
            return resp
        deadline, loop_deadline = self._deadline(request.timeout_ms)
        caller = current_identity()
        transfers = []
        for stream in grouped.groups:
            transfer = FetchTransfer(secrets.token_bytes(16), caller.tenant, deadline,
                                     self._connections(request.connections), asyncio.get_running_loop(), stream,
                                     self.counters)
            transfer.peer = caller.peer
            self._register(transfer, loop_deadline)
            transfers.append(transfer)
            resp.groups.add(transfer_id=transfer.id, num_blocks=stream.num_blocks, block_bytes=stream.block_bytes)
        self.counters.add("transfers_fetch")
        self._spawn(self._run_grouped_fetch(grouped, transfers), "kvstore-lane-fetch")
        resp.transfer_id = transfers[0].id
        resp.expires_in_ms = int((deadline - time.monotonic()) * 1000)
        return resp

    async def _run_grouped_fetch(self, grouped: GroupedFetchStream, transfers: list[FetchTransfer]) -> None:
        """Pump the groups' transfers in turn; once one fails or ends early (a part that
        failed verification: its block is dropped whole), the prefix is a miss, and the
        later groups' transfers are failed at once, so their parts are let go now."""
        try:
            for k, transfer in enumerate(transfers):
                await self._run_fetch(transfer)
                if transfer.failed is not None or transfer.stream.ended_early:
                    for later in transfers[k + 1 :]:
                        later.fail(grpc.StatusCode.NOT_FOUND, "an earlier group's parts ended early: the grouped "
                                   "prefix is a miss")
                        later.stream.close()
                        self._forget(later)
                    return
        finally:
            for transfer in transfers:
                self._forget(transfer)
            grouped.close()  # every group's stream, and the lookup's lease

    async def _run_fetch(self, transfer: FetchTransfer) -> None:
        try:
            await transfer.pump()
        except Exception:  # task boundary: the transfer fails, its blocks are released
            logger.exception("data lane fetch failed")
            transfer.fail(grpc.StatusCode.INTERNAL, "the daemon failed this fetch; see its log")
        finally:
            if transfer.failed is not None:
                self.counters.add("transfers_failed")
            self._forget(transfer)

    async def open_put(self, request: kvstore_pb2.LanePutRequest) -> kvstore_pb2.LanePutResponse:
        self._admit()
        if self._host is None:
            raise FailedPrecondition("this daemon has no host tier for data lane puts; use Put")
        resolver, store, settings = self.resolver, self.store, self.settings
        header = request.header
        info = resolver.put_namespace(header.namespace)  # filed when the put publishes
        if header.group_spans:
            raise InvalidArgument("group_spans (an import's parts) go with Put, not the data lane")
        hashes, parent = resolver.put_keys(info, header)
        if info.layout.groups:
            return await self._open_grouped_put(request, info, hashes, parent)
        runs = put_runs(request, len(hashes), put_position(header))
        resolver.put_session(header)  # checked now; applied at commit
        # Slots are reserved a window at a time as the blocks land, as for a Put stream.
        txn = store.begin_put(info, hashes, parent, tier=HOST, window_bytes=settings.put_window_bytes,
                              runs=[(r.offset, r.parent_hash or None) for r in runs])
        await txn.reserve()
        try:
            deadline, loop_deadline = self._deadline(request.timeout_ms)
            transfer = PutTransfer(secrets.token_bytes(16), current_identity().tenant, deadline,
                                   self._connections(request.connections), asyncio.get_running_loop(), txn, header,
                                   len(hashes), self._host, self.counters, settings.put_idle_timeout_s,
                                   min(settings.io_timeout_s, settings.put_idle_timeout_s))
            # The first window now: the connections get credit as soon as they join.
            await transfer.reserve_ahead()
        except BaseException:
            txn.abort()
            raise
        transfer.peer = current_identity().peer
        transfer.runs = runs
        self._offer_codecs(transfer, info.layout)
        self._register(transfer, loop_deadline)
        transfer.on_failed = lambda: self._put_failed(transfer)
        self._arm_idle(transfer, settings.put_idle_timeout_s)
        if transfer.reserved < len(transfer.order):
            self._spawn(self._run_reserver(transfer), "kvstore-lane-reserve")
        self.counters.add("transfers_put")
        return kvstore_pb2.LanePutResponse(transfer_id=transfer.id, needed=transfer.needed,
                                           block_bytes=transfer.block_bytes, namespace_id=info.namespace_id,
                                           expires_in_ms=int((deadline - time.monotonic()) * 1000),
                                           codecs=transfer.codecs, itemsize=transfer.itemsize)

    async def _open_grouped_put(self, request: kvstore_pb2.LanePutRequest, info: NamespaceInfo,
                                hashes: list[bytes], parent: bytes | None) -> kvstore_pb2.LanePutResponse:
        """A grouped put on the lane: the parts its hit rules keep, a `PutTransfer` per
        group over that group's transaction (slots reserved a window at a time, each part
        verified as it lands), all published by one LaneCommit (`_commit_grouped`)."""
        if request.runs:
            raise InvalidArgument("a put of a layout with KV groups is one run of its chain")
        header, settings, caller = request.header, self.settings, current_identity()
        assert self._host is not None
        self.resolver.put_session(header)  # checked now; applied at commit
        txn = self.store.begin_stream_put(info, hashes, parent, tier=HOST, window_bytes=settings.put_window_bytes)
        assert isinstance(txn, GroupedPutTxn)
        await txn.reserve()
        try:
            deadline, loop_deadline = self._deadline(request.timeout_ms)
            transfers = []
            for sub in txn.groups:
                transfer = PutTransfer(secrets.token_bytes(16), caller.tenant, deadline,
                                       self._connections(request.connections), asyncio.get_running_loop(), sub,
                                       header, len(sub.slots()), self._host, self.counters,
                                       settings.put_idle_timeout_s,
                                       min(settings.io_timeout_s, settings.put_idle_timeout_s))
                await transfer.reserve_ahead()
                transfers.append(transfer)
        except BaseException:
            txn.abort()
            raise
        put = GroupedPut(secrets.token_bytes(16), txn, transfers, header, caller.tenant, caller.peer)
        resp = kvstore_pb2.LanePutResponse(transfer_id=put.id, block_bytes=txn.block_bytes,
                                           namespace_id=info.namespace_id,
                                           expires_in_ms=int((deadline - time.monotonic()) * 1000))
        for transfer in transfers:
            transfer.peer = caller.peer
            transfer.group = transfers
            self._register(transfer, loop_deadline)
            transfer.on_failed = functools.partial(self._put_failed, transfer)
            self._arm_idle(transfer, settings.put_idle_timeout_s)
            if transfer.reserved < len(transfer.order):
                self._spawn(self._run_reserver(transfer), "kvstore-lane-reserve")
            resp.groups.add(transfer_id=transfer.id, num_blocks=len(transfer.needed), block_bytes=transfer.block_bytes,
                            needed=transfer.needed)
        self._grouped_puts[put.id] = put
        put.timer = asyncio.get_running_loop().call_at(loop_deadline, self._expire_grouped, put.id)
        self.counters.add("transfers_put")
        return resp

    def _expire_grouped(self, put_id: bytes) -> None:
        put = self._grouped_puts.pop(put_id, None)
        if put is not None:  # its transfers expire by themselves; the parts they filled go with the put
            put.txn.abort()

    async def _commit_grouped(self, put: GroupedPut, request: kvstore_pb2.LaneCommitRequest) -> kvstore_pb2.PutResponse:
        """LaneCommit of a grouped put: every group's parts landed verified, then one
        publish of them all (`GroupedPutTxn.commit`); any failure rolls back every part."""
        del self._grouped_puts[put.id]
        if put.timer is not None:
            put.timer.cancel()
        transfers = put.transfers
        if request.abort:
            for transfer in transfers:
                self._end(transfer)
                transfer.fail(grpc.StatusCode.ABORTED, "the client aborted the put")
            put.txn.abort()
            return kvstore_pb2.PutResponse()
        for transfer in transfers:
            transfer.committing = True
            timer = self._timers.pop(transfer.id, None)
            if timer is not None:
                timer.cancel()
        try:
            try:
                for transfer in transfers:
                    await transfer.wait_landed(transfer.deadline - time.monotonic())
                    await transfer.close()
            finally:
                for transfer in transfers:
                    self._forget(transfer)
            sums: list[int] = []
            for transfer in transfers:
                transfer.txn.mark_written()
                sums += transfer.sums
            result = await put.txn.commit(sums)
        except BaseException as exc:
            if isinstance(exc, KVStoreError):
                self.counters.add("transfers_failed")
            for transfer in transfers:
                transfer.fail(grpc.StatusCode.ABORTED, "the put failed")
                self._end(transfer)
            put.txn.abort()
            raise
        self.counters.add("committed_bytes_in", sum(t.block_bytes * sum(t.needed) for t in transfers))
        header = put.header
        resp = self._committed(header, result)
        waiting = forward_put(self.node, self.resolver, result.namespace_id, header, resp)
        if waiting is not None:
            await waiting
        return resp

    def _committed(self, header: kvstore_pb2.PutHeader, result: PutOutcome) -> kvstore_pb2.PutResponse:
        """A committed lane put, plain or grouped: its session hint applied, its answer."""
        session = self.resolver.put_session(header)
        if session:
            self.store.hint(result.namespace_id, result.block_hashes, session, header.hint.expect_reuse_within_s,
                            carried_by="put")
        return kvstore_pb2.PutResponse(stored=result.stored, existing=result.existing,
                                       namespace_id=result.namespace_id,
                                       **hash_fields(result.block_hashes, packed_reply(header.keys)))

    async def _run_reserver(self, transfer: PutTransfer) -> None:
        try:
            await transfer.keep_reserving()
        except Exception:  # task boundary: the put fails, its slots are freed
            logger.exception("data lane put failed while reserving slots")
            transfer.fail(grpc.StatusCode.INTERNAL, "the daemon failed this put; see its log")

    def _arm_idle(self, transfer: PutTransfer, delay_s: float) -> None:
        transfer.idle_timer = asyncio.get_running_loop().call_later(delay_s, self._check_idle, transfer)

    def _check_idle(self, transfer: PutTransfer) -> None:
        """Roll back a put whose client sent nothing for `put_idle_timeout_s`. A block on
        its way is bounded by its connection's receive timeout instead, and the daemon's
        own work (making room) is not the client's silence."""
        transfer.idle_timer = None
        if transfer.ending or self._open.get(transfer.id) is not transfer:
            return
        idle_s = self.settings.put_idle_timeout_s
        now = time.monotonic()
        with transfer.lock:
            if transfer.committing and transfer.missing == 0:
                return  # every byte is in; the commit publishes
            if transfer.writers or transfer.reserving:
                transfer.active_at = now
            quiet_s = now - transfer.active_at
        if transfer.group:  # a grouped put's groups are sent one after another: quiet is all of them quiet
            quiet_s = min(now - t.active_at for t in transfer.group)
        if quiet_s < idle_s:
            self._arm_idle(transfer, idle_s - quiet_s)
            return
        logger.info("data lane put sent nothing for %g s; rolled back", idle_s)
        transfer.fail(grpc.StatusCode.DEADLINE_EXCEEDED, transfer.idle_message())

    def _put_failed(self, transfer: PutTransfer) -> None:
        """(on the loop) A put failed: roll it back now, and keep why for its LaneCommit.
        A commit under way rolls back itself."""
        failed = transfer.failed
        if transfer.ending or transfer.committing or failed is None:
            return
        with self._failed_lock:
            self._failed_puts[transfer.id] = (transfer.tenant, transfer.peer, failed)
            while len(self._failed_puts) > max(16, self.settings.max_transfers):
                self._failed_puts.popitem(last=False)
        self.counters.add("transfers_failed")
        self._end(transfer)

    def _end(self, transfer: PutTransfer) -> None:
        """Forget a put and roll it back (once no thread receives into its slots)."""
        if transfer.ending:
            return
        transfer.ending = True
        self._forget(transfer)
        self._spawn(self._roll_back(transfer), "kvstore-lane-abort")

    async def commit(self, request: kvstore_pb2.LaneCommitRequest) -> kvstore_pb2.PutResponse:
        transfer = self._open.get(request.transfer_id)
        caller = current_identity()
        tenant = caller.tenant
        # Only whoever opened a put commits it: the tenant's client for a client's put,
        # the same node for one a node-to-node call opened.
        joiner = Joiner(tenant, client=not caller.peer, node=caller.peer)
        grouped = self._grouped_puts.get(request.transfer_id)
        if grouped is not None and joiner.may_join(grouped.tenant, grouped.peer):
            return await self._commit_grouped(grouped, request)
        if (not isinstance(transfer, PutTransfer) or not joiner.may_join(transfer.tenant, transfer.peer)
                or transfer.committing or transfer.ending):
            why = self.put_failure(request.transfer_id, joiner)
            if why is not None:
                with self._failed_lock:
                    self._failed_puts.pop(request.transfer_id, None)
                if request.abort:
                    return kvstore_pb2.PutResponse()
                raise error_for_status(why.code, why.message)
            raise FailedPrecondition("this data lane put is not open: it was committed, aborted, or rolled back "
                                     "after its deadline; put the blocks again")
        txn = transfer.txn
        if request.abort:
            self._end(transfer)
            transfer.fail(grpc.StatusCode.ABORTED, "the client aborted the put")
            return kvstore_pb2.PutResponse()
        # Blocks may still be landing: the transfer stays findable by the lane's threads
        # until the commit is done; its deadline now bounds the wait below instead.
        transfer.committing = True
        timer = self._timers.pop(transfer.id, None)
        if timer is not None:
            timer.cancel()
        try:
            try:
                await transfer.wait_landed(transfer.deadline - time.monotonic())
                await transfer.close()
            finally:
                self._forget(transfer)
            txn.mark_written()
            result = await txn.commit(transfer.sums)
        except BaseException as exc:
            if isinstance(exc, KVStoreError):
                self.counters.add("transfers_failed")
            transfer.fail(grpc.StatusCode.ABORTED, "the put failed")
            # Not awaited here: a cancelled commit must still roll back, once no thread
            # receives into the slots.
            self._end(transfer)
            raise
        self.counters.add("committed_bytes_in", result.stored * transfer.block_bytes)
        header = transfer.header
        resp = self._committed(header, result)
        if transfer.runs:  # a peer's forward of several runs: the pool is told of all at once
            hashes, parent = self.resolver.put_keys(self.store.namespace(result.namespace_id), header)
            self.node.after_peer_put(result.namespace_id,
                                     split_runs(hashes, parent, put_position(header), transfer.runs))
        else:  # as for a gRPC Put: forwarded to its units' owners
            waiting = forward_put(self.node, self.resolver, result.namespace_id, header, resp)
            if waiting is not None:
                await waiting
        return resp

    async def _roll_back(self, transfer: PutTransfer) -> None:
        try:
            await transfer.close()
        finally:
            transfer.txn.abort()

    def _expire(self, transfer_id: bytes) -> None:
        transfer = self._open.get(transfer_id)
        self._timers.pop(transfer_id, None)
        if transfer is None:
            return
        logger.info("data lane %s transfer expired before it finished", transfer.kind)
        if isinstance(transfer, PutTransfer):
            self._end(transfer)
            self.counters.add("transfers_failed")
        transfer.fail(grpc.StatusCode.DEADLINE_EXCEEDED, f"the data lane {transfer.kind} passed its deadline")
        # A fetch's pump sees the failure, releases its blocks and forgets it.

    # -------------------------------------------------------------- connection threads

    def fetch_transfer(self, transfer_id: bytes, joiner: Joiner) -> FetchTransfer | None:
        """The open fetch `transfer_id`, if the connection `joiner` may carry it (`Joiner.may_join`)."""
        transfer = self._open.get(transfer_id)
        if isinstance(transfer, FetchTransfer) and joiner.may_join(transfer.tenant, transfer.peer):
            return transfer
        return None

    def put_failure(self, transfer_id: bytes, joiner: Joiner) -> TransferFailed | None:
        """Why put `transfer_id` failed, if it did so lately (and was let go) and `joiner`
        may carry it."""
        with self._failed_lock:
            failed = self._failed_puts.get(transfer_id)
        return failed[2] if failed is not None and joiner.may_join(failed[0], failed[1]) else None

    def put_transfer(self, transfer_id: bytes, joiner: Joiner) -> PutTransfer | None:
        transfer = self._open.get(transfer_id)
        if isinstance(transfer, PutTransfer) and joiner.may_join(transfer.tenant, transfer.peer):
            return transfer
        return None

    # -------------------------------------------------------------- shutdown

    def interrupt(self) -> None:
        """Fail every open transfer (the daemon is stopping): connection threads waiting
        on one (for credit, for blocks to send) wake and leave."""
        self._closing = True
        for transfer in list(self._open.values()):
            if isinstance(transfer, PutTransfer):
                self._end(transfer)
            transfer.fail(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")

    async def close(self) -> None:
        """Fail every open transfer and wait until their blocks and slots are released.
        Call after the lane's connections are shut (no thread is left to wait for)."""
        self.interrupt()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._open.clear()
        for put in self._grouped_puts.values():
            if put.timer is not None:
                put.timer.cancel()
            put.txn.abort()
        self._grouped_puts.clear()


def put_runs(request: kvstore_pb2.LanePutRequest, blocks: int,
             position: int | None) -> list[kvstore_pb2.PutRun]:
    """A lane put's later runs (`LanePutRequest.runs`), checked: node-to-node only, in
    order inside the put, each at a chain position past the run before it."""
    runs = list(request.runs)
    if not runs:
        return runs
    if not current_identity().peer:
        raise InvalidArgument("LanePutRequest.runs is for the daemons of a pool; a client puts one run per call")
    if request.header.keys.WhichOneof("keys") == "tokens" or position is None:
        raise InvalidArgument("a put of several runs names its blocks by hashes and sets header.position")
    last, at = 0, position
    for r in runs:
        if not last < r.offset < blocks:
            raise InvalidArgument(f"a run of the put starts at block {r.offset}: after {last} and before {blocks} "
                                  "expected")
        if r.parent_hash and len(r.parent_hash) != HASH_BYTES:
            raise InvalidArgument(f"a run's parent hash must be {HASH_BYTES} bytes, got {len(r.parent_hash)}")
        if r.position < at + (r.offset - last):
            raise InvalidArgument(f"a run at chain position {r.position} overlaps the run before it")
        last, at = r.offset, r.position
    return runs


def split_runs(hashes: Sequence[bytes], parent: bytes | None, position: int | None,
               runs: Sequence[kvstore_pb2.PutRun]) -> list[tuple[Sequence[bytes], bytes | None, int | None]]:
    """A put of several runs as (hashes, parent, position) per run."""
    starts = [0] + [r.offset for r in runs] + [len(hashes)]
    parents = [parent] + [r.parent_hash or None for r in runs]
    positions = [position] + [int(r.position) for r in runs]
    return [(hashes[starts[k] : starts[k + 1]], parents[k], positions[k]) for k in range(len(parents))]
