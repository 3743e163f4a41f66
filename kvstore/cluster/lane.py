"""Block bytes between the daemons of a pool on their data lanes: `LanePeerTransport`, the
`PeerTransport` a daemon uses unless `cluster_data_lane` is off.

Lookups and the lane's control calls are the small unary gRPC calls of
`GrpcPeerTransport` (one channel per peer, the pool's credential, the tenant's metadata).
Block bytes move on the peer's data lane (`kvstore.client.datalane.DataLane`):

* a fetch (a pull) reserves the local puts of its runs first (`FetchSink.destinations`),
  opens the transfer on the holder (`LaneFetch`), and receives each block straight into
  its PENDING slot, hashing it as it lands and comparing it with the checksum the holder
  sends with it. The holder sends a block only once its bytes matched the checksum it
  stored (`FetchStream.frames`), and sends that checksum: so this check is the pull's
  check against the holder's stored checksum, made once, while the bytes are in cache.
  What landed verified is published run by run (`FetchSink.landed`), with those
  checksums; the rest is rolled back;
* a put (a forward) takes the blocks as views of the local tier's memory, verified by the
  local fetch as it frames them (`lane_framer`), opens the put on the owner (`LanePut`),
  sends the blocks the owner lacks with one `sendmsg` each, and publishes with
  `LaneCommit`, all or nothing.

Which peers have a lane is asked once (`DataLane`) and remembered. A peer that offers none
(data_lane_listen = off), or predates the lane's node-to-node calls (it refuses or does
not know them), is used through gRPC, and asked again after NO_LANE_RECHECK_S. A lane
that cannot be connected to is left alone for LANE_RETRY_S, gRPC used meanwhile, and
then asked for again (a restarted peer's lane may listen on another port). Once a
transfer is under way a failure is a `PeerError` for that call: a miss for the pull
(its runs roll back), a failed forward; never a hang, since every transfer has the
call's deadline on both sides.

Threads: the lane's socket I/O is blocking and runs on worker threads (`asyncio.to_thread`
and the lane's own pool for a transfer's further connections). A cancelled call shuts its
connections and waits for those threads to finish before it returns, so the slots and
views it handed them are never given back while a thread may still use them.

Primitives: `LanePeerTransport`, `lane_framer`, `NO_LANE_RECHECK_S`, `LANE_RETRY_S`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import logging
import ssl
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.checksum import checksum
from kvstore.client._auth import Security
from kvstore.client.datalane import DEFAULT_CONNECTIONS, DataLane, LaneEndpoint, choose_endpoint, client_tls
from kvstore.cluster.transport import (
    DEFAULT_CHUNK_BYTES,
    FetchSink,
    GrpcPeerTransport,
    PeerCall,
    PeerError,
    TransportCounters,
)
from kvstore.datalane import LaneSocket
from kvstore.errors import KVStoreError
from kvstore.hashing import HASH_BYTES
from kvstore.v1 import kvstore_pb2
from kvstore.wire import Framed

logger = logging.getLogger(__name__)

# A peer that offers no lane is asked again after this long (it may have been restarted
# with one).
NO_LANE_RECHECK_S = 60.0
# A peer whose lane could not be connected to: gRPC for this long, then the lane is asked for anew.
LANE_RETRY_S = 10.0
# A DataLane answer that says "not here": a daemon that predates the lane does not know the
# call; one that predates its node-to-node use refuses it to a peer credential.
NO_LANE_CODES = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED)
NOT_LANDED = -1  # a checksum slot no block landed in (checksums are unsigned 64-bit)


def lane_framer(index: int, data: memoryview) -> Framed:
    """A block as the lane sends it: where it is (no message, no copy), with the checksum
    of those very bytes (what the local fetch verifies is what is sent)."""
    return Framed([], [data], checksum(data))


@dataclass(slots=True)
class _PeerLane:
    """What this node knows of one peer's lane: the lane, or none until `recheck_at`."""

    target: str
    lane: DataLane | None
    recheck_at: float = 0.0
    users: int = 0  # calls using the lane now: it is closed once they are done
    retired: bool = False


class LanePeerTransport:
    """`PeerTransport` with block bytes on the peers' data lanes (module docstring), gRPC
    for lookups, control calls and peers without a lane."""

    def __init__(self, node_id: str, *, token: str = "", tls_ca: bytes | None = None,
                 tls_cert: bytes | None = None, tls_key: bytes | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, connections: int = DEFAULT_CONNECTIONS,
                 io_timeout_s: float = 30.0) -> None:
        self.node_id = node_id
        self.grpc = GrpcPeerTransport(node_id, token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                      chunk_bytes=chunk_bytes)
        self.framer: Callable[[int, memoryview], Framed] = lane_framer
        self._security = Security(token, tls_ca, tls_cert, tls_key)
        self._tls: ssl.SSLContext | None = None  # made once a peer's lane uses TLS
        self._connections = connections
        self._io_timeout_s = io_timeout_s
        self._peers: dict[str, _PeerLane] = {}

    @property
    def counters(self) -> TransportCounters:
        return self.grpc.counters

    # -------------------------------------------------------------- peers

    def update(self, addresses: Mapping[str, Sequence[str]]) -> None:
        self.grpc.update(addresses)
        for node in [n for n, p in self._peers.items() if p.target != self.grpc.target(n)]:
            self._drop(node)

    def forget(self, node: str) -> None:
        """`node` restarted or came back: a new channel, and its lane asked for again."""
        self.grpc.forget(node)
        self._drop(node)

    def _drop(self, node: str) -> None:
        state = self._peers.pop(node, None)
        if state is not None and state.lane is not None:
            state.retired = True
            if not state.users:
                state.lane.close()

    @contextlib.contextmanager
    def _using(self, state: _PeerLane) -> Iterator[DataLane]:
        """`state`'s lane for one call; closed after it if it was dropped meanwhile."""
        assert state.lane is not None
        state.users += 1
        try:
            yield state.lane
        finally:
            state.users -= 1
            if state.retired and not state.users:
                state.lane.close()

    def _set(self, node: str, lane: DataLane | None, recheck_s: float) -> None:
        self._drop(node)
        self._peers[node] = _PeerLane(self.grpc.target(node), lane, time.monotonic() + recheck_s)

    async def _lane(self, node: str, call: PeerCall, timeout_s: float) -> _PeerLane | None:
        """`node`'s lane, asked for when not known (None: use gRPC)."""
        state = self._peers.get(node)
        if state is not None and (state.lane is not None or time.monotonic() < state.recheck_at):
            return state if state.lane is not None else None
        try:
            offer = await self.grpc.control(node, call, "DataLane", kvstore_pb2.DataLaneRequest(), timeout_s)
        except PeerError as exc:
            if exc.code not in NO_LANE_CODES:
                raise
            logger.info("cluster: node %s has no data lane for its peers (%s); block bytes go through gRPC", node, exc)
            offer = None
        state = self._peers.get(node)
        if state is not None and state.lane is not None:
            return state  # another call asked meanwhile
        lane = None if offer is None else self._lane_of(node, offer)
        self._set(node, lane, NO_LANE_RECHECK_S)
        return self._peers[node] if lane is not None else None

    def _lane_of(self, node: str, offer: kvstore_pb2.DataLaneResponse) -> DataLane | None:
        endpoint = choose_endpoint(offer, self.grpc.target(node))
        if endpoint is None:
            logger.info("cluster: node %s offers no data lane; block bytes go through gRPC", node)
            return None
        try:
            return DataLane(endpoint, self._security, max_connections=min(offer.max_connections or 1,
                                                                          self._connections),
                            io_timeout_s=self._io_timeout_s, tls=self._tls_for(endpoint))
        except KVStoreError as exc:  # its lane uses TLS and this node has no roots for it
            logger.warning("cluster: the data lane of node %s cannot be used (%s); block bytes go through gRPC",
                           node, exc)
            return None

    def _tls_for(self, endpoint: LaneEndpoint) -> ssl.SSLContext | None:
        if not endpoint.tls or self._security.tls_ca is None:
            return None
        if self._tls is None:
            self._tls = client_tls(self._security)
        return self._tls

    async def _checkout(self, node: str, lane: DataLane, blocks: int, timeout_s: float) -> list[LaneSocket] | None:
        """Connections for a transfer of `blocks`; None (and gRPC for a while) when the
        lane cannot be reached or refuses this node's credential."""
        task = asyncio.ensure_future(asyncio.to_thread(lane.checkout, lane.connections_for(blocks), timeout_s))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(functools.partial(_give_back, lane))  # the thread goes on: its connections
            raise
        except KVStoreError as exc:
            logger.info("cluster: the data lane of node %s is not available (%s); block bytes go through gRPC "
                        "for %.0f s", node, exc, LANE_RETRY_S)
            self._set(node, None, LANE_RETRY_S)
            return None

    # -------------------------------------------------------------- calls

    async def lookup(self, node: str, call: PeerCall, hashes: bytes, timeout_s: float) -> int:
        return await self.grpc.lookup(node, call, hashes, timeout_s)

    async def fetch(self, node: str, call: PeerCall, hashes: bytes, sink: FetchSink, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        state = await self._lane(node, call, timeout_s)
        if state is None:
            self.counters.fallbacks += 1
            return await self.grpc.fetch(node, call, hashes, sink, _left(deadline))
        with self._using(state) as lane:
            return await self._fetch(node, lane, call, hashes, sink, deadline)

    async def _fetch(self, node: str, lane: DataLane, call: PeerCall, hashes: bytes, sink: FetchSink,
                     deadline: float) -> int:
        conns = await self._checkout(node, lane, len(hashes) // HASH_BYTES, _left(deadline))
        if conns is None:
            self.counters.fallbacks += 1
            return await self.grpc.fetch(node, call, hashes, sink, _left(deadline))
        try:
            dests = await sink.destinations()
            grant = None
            if dests:
                block_bytes = len(dests[0])
                left = _left(deadline)
                grant = await self.grpc.control(node, call, "LaneFetch", kvstore_pb2.LaneFetchRequest(
                    fetch=kvstore_pb2.FetchRequest(namespace=kvstore_pb2.Namespace(layout=call.layout),
                                                   keys=kvstore_pb2.BlockKeys(
                                                       packed_hashes=hashes[: len(dests) * HASH_BYTES])),
                    connections=len(conns), timeout_ms=max(1, int(left * 1000))), left)
                if grant.num_blocks > len(dests):
                    raise PeerError(node, f"fetch: {grant.num_blocks} blocks answered for {len(dests)} asked")
                if grant.num_blocks and grant.block_bytes != block_bytes:
                    # (the transfer ends on the holder at its deadline)
                    raise PeerError(node, f"fetch: {grant.block_bytes}-byte blocks where this namespace's are "
                                          f"{block_bytes}")
        except BaseException:
            lane.checkin(conns)
            raise
        if grant is None or not grant.num_blocks:
            lane.checkin(conns)
            await sink.landed(0, (), False)
            return 0
        n = int(grant.num_blocks)
        sums = [NOT_LANDED] * n
        try:
            good = int(await _in_threads(lane, conns, lane.fetch_into, grant.transfer_id, grant.block_bytes,
                                         dests[:n], _left(deadline), sums))
        except KVStoreError as exc:
            raise PeerError(node, f"fetch over the data lane: {exc}") from None
        counters = self.counters
        counters.lane_blocks_in += good
        counters.lane_bytes_in += good * grant.block_bytes
        del dests
        await sink.landed(good, sums[:good], good < n and sums[good] != NOT_LANDED)
        return good

    async def put(self, node: str, call: PeerCall, hashes: bytes, parent: bytes, position: int,
                  blocks: AsyncIterator[Framed], timeout_s: float) -> tuple[int, int]:
        deadline = time.monotonic() + timeout_s
        state = await self._lane(node, call, timeout_s)
        if state is None:
            self.counters.fallbacks += 1
            return await self.grpc.put(node, call, hashes, parent, position, self._chunked(blocks), _left(deadline))
        with self._using(state) as lane:
            return await self._put(node, lane, call, hashes, parent, position, blocks, deadline)

    async def _put(self, node: str, lane: DataLane, call: PeerCall, hashes: bytes, parent: bytes, position: int,
                   blocks: AsyncIterator[Framed], deadline: float) -> tuple[int, int]:
        sources = await _collect(blocks)
        n = len(sources)
        if not n:
            return 0, 0
        conns = await self._checkout(node, lane, n, _left(deadline))
        if conns is None:
            self.counters.fallbacks += 1
            return await self.grpc.put(node, call, hashes[: n * HASH_BYTES], parent, position,
                                       self._chunked(_each(sources)), _left(deadline))
        try:
            left = _left(deadline)
            grant = await self.grpc.control(node, call, "LanePut", kvstore_pb2.LanePutRequest(
                header=kvstore_pb2.PutHeader(namespace=kvstore_pb2.Namespace(layout=call.layout),
                                             keys=kvstore_pb2.BlockKeys(packed_hashes=hashes[: n * HASH_BYTES]),
                                             num_blocks=n, parent_hash=parent, position=position),
                connections=len(conns), timeout_ms=max(1, int(left * 1000))), left)
        except BaseException:
            lane.checkin(conns)
            raise
        needed = grant.needed
        if not any(needed):
            lane.checkin(conns)
        else:
            try:
                if len(needed) != n or grant.block_bytes != len(sources[0]):
                    lane.checkin(conns)
                    raise PeerError(node, f"put: the owner wants {len(needed)} blocks of {grant.block_bytes} bytes "
                                          f"for {n} of {len(sources[0])}")
                await _in_threads(lane, conns, lane.put_from, grant.transfer_id, grant.block_bytes, needed, sources,
                                  _left(deadline))
            except BaseException as exc:
                await self._abort_put(node, call, grant.transfer_id)
                if isinstance(exc, KVStoreError):
                    raise PeerError(node, f"put over the data lane: {exc}") from None
                raise
        sent = needed.count(1)
        resp = await self.grpc.control(node, call, "LaneCommit",
                                       kvstore_pb2.LaneCommitRequest(transfer_id=grant.transfer_id), _left(deadline))
        counters = self.counters
        counters.lane_blocks_out += sent
        counters.lane_bytes_out += sent * grant.block_bytes
        return int(resp.stored), int(resp.existing)

    async def _abort_put(self, node: str, call: PeerCall, transfer_id: bytes) -> None:
        """Best effort: the owner rolls the put back at its deadline by itself anyway."""
        try:
            await asyncio.shield(self.grpc.control(node, call, "LaneCommit", kvstore_pb2.LaneCommitRequest(
                transfer_id=transfer_id, abort=True), 1.0))
        except PeerError:
            pass

    async def _chunked(self, blocks: AsyncIterator[Framed]) -> AsyncIterator[Framed]:
        """Lane-framed blocks made into Put chunk messages, for a peer without a lane."""
        frame = self.grpc.framer
        i = 0
        async for framed in blocks:
            yield frame(i, framed.payload[0])
            i += 1

    async def reap(self) -> None:
        await self.grpc.reap()

    async def aclose(self) -> None:
        for node in list(self._peers):
            self._drop(node)
        await self.grpc.aclose()
        # A failed transfer's exceptions may still hold, in cycles, views of tier memory
        # the lane's threads were given; the tiers unmap their segments next.
        gc.collect()


def _give_back(lane: DataLane, task: asyncio.Future[list[LaneSocket]]) -> None:
    if not task.cancelled() and task.exception() is None:
        lane.checkin(task.result())


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


async def _collect(blocks: AsyncIterator[Framed]) -> list[memoryview]:
    """Every block of a local fetch (a view of its tier's memory, or the bytes read), its
    stream closed at once either way (the fetch holds the blocks until it is closed)."""
    out: list[memoryview] = []
    try:
        async for framed in blocks:
            out.append(framed.payload[0])
    finally:
        aclose = getattr(blocks, "aclose", None)
        if aclose is not None:
            await aclose()
    return out


async def _each(sources: Sequence[memoryview]) -> AsyncIterator[Framed]:
    for data in sources:
        yield Framed([], [data])


class _LaneFailed(KVStoreError):
    """A transfer's threads failed: what they said, and nothing of theirs."""


async def _in_threads(lane: DataLane, conns: Sequence[LaneSocket], fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(conns, *args)` on a worker thread. Cancelled, it shuts the transfer's sockets
    and waits for the threads to let go of the memory they were given, then raises.

    A failure is raised as `_LaneFailed`, a message alone: the threads' exceptions hold
    their frames, which hold views of tier memory (the slots and blocks they were given),
    in reference cycles only the collector would break; a segment with views left cannot
    be unmapped. Those frames are cleared here and the exceptions dropped."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, conns, *args))
    del args
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        lane.abort(conns)
        while not task.done():
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                continue
        _forget(task)
        raise
    except Exception:  # noqa: BLE001 - taken from the task below
        pass
    error = task.exception()
    if error is None:
        return task.result()
    message = str(error) if isinstance(error, KVStoreError) else f"{type(error).__name__}: {error}"
    _forget(task)
    del task, error
    raise _LaneFailed(message)


def _forget(task: asyncio.Future[Any]) -> None:
    """Clear the frames of a finished thread task's exception, and of every exception
    those frames held (the other connections' failures, in lists and futures): see
    `_in_threads`. Their tracebacks keep their lines, not their locals."""
    if task.cancelled() or task.exception() is None:
        return
    todo: list[BaseException] = [task.exception()]  # type: ignore[list-item]
    seen: set[int] = set()
    while todo:
        error = todo.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            for value in tb.tb_frame.f_locals.values():
                for item in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(item, BaseException):
                        todo.append(item)
                    elif isinstance(item, concurrent.futures.Future) and item.done() and not item.cancelled():
                        held = item.exception(timeout=0)
                        if held is not None:
                            todo.append(held)
            tb = tb.tb_next
        traceback.clear_frames(error.__traceback__)
        todo += [e for e in (error.__context__, error.__cause__) if e is not None]
