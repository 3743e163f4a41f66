"""Block bytes between the daemons of a pool on their data lanes: `DataLaneTransport`, the
`PeerTransport` a daemon uses unless `cluster_data_lane` is off.

Glossary of planes and lanes: docs/local-data-plane.md

Lookups and the lane's control calls (`LaneFetch`, `LanePut`, `LaneCommit`) go on the
peer's peer lane (`kvstore.cluster.peer_lane.PeerLane`), where the peer offers one; else
they are the small unary gRPC calls of `GrpcPeerTransport` (one channel per peer, the
pool's credential, the tenant's metadata). Block bytes move on the peer's data
lane (`kvstore.client.data_lane.DataLane`):

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

Which peers have a lane, and a peer lane, is asked once (`DataLane`) and remembered; until
the answer is in (it is asked in the background by a lookup), lookups use gRPC. A peer
lane that cannot be connected to is left alone for LANE_RETRY_S (gRPC meanwhile). A
peer that offers no data lane (data_lane_listen = off), or predates the lane's node-to-node calls (it refuses or does
not know them), is used through gRPC, and asked again after NO_LANE_RECHECK_S. A lane
that cannot be connected to is left alone for LANE_RETRY_S, gRPC used meanwhile, and
then asked for again (a restarted peer's lane may listen on another port). Once a
transfer is under way a failure is a `PeerError` for that call: a miss for the pull
(its runs roll back), a failed forward; never a hang, since every transfer has the
call's deadline on both sides.

The transfers are the SDK's (`kvstore.client.data_lane`): a forward is its `put_transfer`,
and a pull opens its fetch with the same request and moves it the same way, but
overlaps the opening with reserving room here and drains what it cannot keep. Their
socket I/O is blocking and runs on worker threads (`move_in_threads`). A cancelled call
shuts its connections and waits for those threads to finish before it returns, so the
slots and views it handed them are never given back while a thread may still use them.

Primitives: `DataLaneTransport`, `lane_framer`, `NO_LANE_RECHECK_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from kvstore.checksum import checksum
from kvstore.client.data_lane import (
    DEFAULT_CONNECTIONS,
    DataLane,
    LaneEndpoint,
    LaneMove,
    check_codec_mode,
    checkout_in_thread,
    choose_endpoint,
    client_tls,
    lane_codecs,
    lane_fetch_request,
    move_in_threads,
    put_transfer,
    run_transfer,
)
from kvstore.client.security import Security
from kvstore.cluster.peer_lane import CONNECT_TIMEOUT_S, LANE_RETRY_S, PeerLane
from kvstore.cluster.transport import (
    DEFAULT_CHUNK_BYTES,
    FetchSink,
    GrpcPeerTransport,
    PeerCall,
    PeerError,
    TransportCounters,
    lookup_count,
    lookup_request_bytes,
)
from kvstore.codec_chooser import CodecChooser
from kvstore.control_lane_wire import RESPONSE_TYPES, peer_envelope
from kvstore.data_lane import LaneSocket
from kvstore.eager import Started, start
from kvstore.errors import DaemonRestarted, KVStoreError
from kvstore.hashing import HASH_BYTES
from kvstore.v1 import kvstore_pb2
from kvstore.wire import Framed

if TYPE_CHECKING:
    from kvstore.core.fetch import FetchStream

logger = logging.getLogger(__name__)

# A peer that offers no lane is asked again after this long (it may have been restarted
# with one).
NO_LANE_RECHECK_S = 60.0
# A DataLane answer that says "not here": a daemon that predates the lane does not know the
# call; one that predates its node-to-node use refuses it to a peer credential.
NO_LANE_CODES = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED)
NOT_LANDED = -1  # a checksum slot no block landed in (checksums are unsigned 64-bit)
# Blocks a forward's local fetch checks in one step (they are all read before the put).
FORWARD_BATCH_BLOCKS = 256


async def _outgoing(stream: FetchStream) -> AsyncIterator[Framed]:
    batches = stream.view_batches(FORWARD_BATCH_BLOCKS)
    try:
        async for batch in batches:
            for block in batch:
                yield Framed([], [block.data], block.checksum)
    finally:
        await batches.aclose()


def lane_framer(index: int, data: memoryview) -> Framed:
    """A block as the lane sends it: where it is (no message, no copy), with the checksum
    of those very bytes (what the local fetch verifies is what is sent)."""
    return Framed([], [data], checksum(data))


@dataclass(slots=True)
class _PeerLanes:
    """What this node knows of one peer's lanes: the data lane, or none until `recheck_at`,
    and its peer lane (None: it offers none)."""

    target: str
    lane: DataLane | None
    recheck_at: float = 0.0
    users: int = 0  # calls using the lane now: it is closed once they are done
    retired: bool = False
    calls: PeerLane | None = None
    put_runs: bool = False  # its LanePut takes several runs of a chain (DataLaneResponse.put_runs)


class DataLaneTransport:
    """`PeerTransport` with block bytes on the peers' data lanes (module docstring), gRPC
    for lookups, control calls and peers without a lane."""

    def __init__(self, node_id: str, *, token: str = "", tls_ca: bytes | None = None,
                 tls_cert: bytes | None = None, tls_key: bytes | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, connections: int = DEFAULT_CONNECTIONS,
                 io_timeout_s: float = 30.0, codec: str = "auto", chooser: CodecChooser | None = None) -> None:
        self.node_id = node_id
        # The lossless codec of pulls and forwards: chosen per transfer, per peer and
        # namespace, by `chooser` (shown in stats, INFO and metrics), or fixed.
        self.codec = check_codec_mode(codec)
        self.chooser = chooser if chooser is not None else CodecChooser()
        self.grpc = GrpcPeerTransport(node_id, token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                      chunk_bytes=chunk_bytes)
        self.framer: Callable[[int, memoryview], Framed] = lane_framer
        self._security = Security(token, tls_ca, tls_cert, tls_key)
        self._tls: ssl.SSLContext | None = None  # made once a peer's lane uses TLS
        self._connections = connections
        self._io_timeout_s = io_timeout_s
        self._peers: dict[str, _PeerLanes] = {}
        # Peers whose lanes are being asked for in the background (by a lookup).
        self._asking: dict[str, asyncio.Task[Any]] = {}
        # Connection threads whose call was cancelled (`_checkout`).
        self._orphans: set[asyncio.Future[Any]] = set()

    def outgoing(self, stream: FetchStream) -> AsyncIterator[Framed]:
        """A forward's blocks as they leave from where they are, many checked in one step
        (`FetchStream.view_batches`); what falls back to gRPC is chunked from those views."""
        return _outgoing(stream)

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
        if state is not None and state.calls is not None:
            state.calls.close()
        if state is not None and state.lane is not None:
            state.retired = True
            if not state.users:
                state.lane.close()

    @contextlib.contextmanager
    def _using(self, state: _PeerLanes) -> Iterator[DataLane]:
        """`state`'s lane for one call; closed after it if it was dropped meanwhile."""
        assert state.lane is not None
        state.users += 1
        try:
            yield state.lane
        finally:
            state.users -= 1
            if state.retired and not state.users:
                state.lane.close()

    def _set(self, node: str, lane: DataLane | None, recheck_s: float, calls: PeerLane | None = None,
             put_runs: bool = False) -> None:
        kept = self._peers.get(node)
        if calls is None and kept is not None and kept.calls is not None and not kept.calls.closed:
            calls, kept.calls = kept.calls, None  # the data lane failed, not the peer lane: keep it
        self._drop(node)
        self._peers[node] = _PeerLanes(self.grpc.target(node), lane, time.monotonic() + recheck_s, calls=calls,
                                      put_runs=put_runs and lane is not None)

    def takes_runs(self, node: str) -> bool:
        state = self._peers.get(node)
        return state is not None and state.lane is not None and state.put_runs

    async def _lane(self, node: str, call: PeerCall, timeout_s: float) -> _PeerLanes | None:
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
        self._set(node, lane, NO_LANE_RECHECK_S, None if offer is None else self._peer_lane_of(node, offer),
                  offer is not None and offer.put_runs)
        return self._peers[node] if lane is not None else None

    def _peer_lane_of(self, node: str, offer: kvstore_pb2.DataLaneResponse) -> PeerLane | None:
        endpoint = choose_endpoint(kvstore_pb2.DataLaneResponse(endpoints=offer.peer_lane_endpoints),
                                   self.grpc.target(node))
        if endpoint is None:
            return None
        tls = self._tls_for(endpoint)
        if endpoint.tls and tls is None:
            logger.warning("cluster: the peer lane of node %s uses TLS and this node has no roots for it "
                           "(cluster_tls_ca); its calls go through gRPC", node)
            return None
        calls = PeerLane(node, endpoint, self._security.token, tls)
        calls.warm()
        return calls

    def _ask_soon(self, node: str, call: PeerCall) -> None:
        """Ask `node` for its lanes in the background (the caller uses gRPC meanwhile)."""
        if node in self._asking:
            return
        task = asyncio.get_running_loop().create_task(self._lane(node, call, self._io_timeout_s),
                                                      name=f"kvstore-lanes-{node}")
        self._asking[node] = task
        task.add_done_callback(functools.partial(self._asked, node))

    def _asked(self, node: str, task: asyncio.Task[Any]) -> None:
        if self._asking.get(node) is task:
            del self._asking[node]
        if not task.cancelled() and task.exception() is not None:
            logger.debug("cluster: asking node %s for its lanes failed: %s", node, task.exception())

    async def _unary(self, node: str, call: PeerCall, name: str, request: bytes, timeout_s: float) -> Any:
        """`name` on `node`'s peer lane: its answer (parsed), or None where there is no
        peer lane to use now (the caller uses gRPC)."""
        state = self._peers.get(node)
        if state is None or (state.lane is None and time.monotonic() >= state.recheck_at):
            self._ask_soon(node, call)
        if state is None or state.calls is None:
            return None
        try:
            answer = await state.calls.call(name, peer_envelope(self.node_id, call.tenant) + request, timeout_s)
        except KVStoreError as exc:
            raise PeerError(node, f"{name}: {exc.code.name}: {exc}", exc.code) from None
        if answer is None:
            return None
        self.counters.peer_lane_calls += 1
        try:
            return RESPONSE_TYPES[name].FromString(answer)
        except DecodeError:
            raise PeerError(node, f"{name}: an answer that does not parse") from None

    async def _control(self, node: str, call: PeerCall, name: str, request: Any, timeout_s: float) -> Any:
        """A control call of the data lane: on the peer lane, else gRPC."""
        try:
            answer = await self._unary(node, call, name, request.SerializeToString(), timeout_s)
        except TimeoutError:
            raise PeerError(node, f"{name}: no answer within {timeout_s:g} s", grpc.StatusCode.DEADLINE_EXCEEDED) \
                from None
        if answer is None:
            return await self.grpc.control(node, call, name, request, timeout_s)
        return answer

    def _lane_of(self, node: str, offer: kvstore_pb2.DataLaneResponse) -> DataLane | None:
        endpoint = choose_endpoint(offer, self.grpc.target(node))
        if endpoint is None:
            logger.info("cluster: node %s offers no data lane; block bytes go through gRPC", node)
            return None
        try:
            return DataLane(endpoint, self._security, max_connections=min(offer.max_connections or 1,
                                                                          self._connections),
                            io_timeout_s=self._io_timeout_s, tls=self._tls_for(endpoint), codec=self.codec,
                            chooser=self.chooser, link=f"node {node}", boot_id=offer.boot_id)
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
        try:
            # Cancelled, the thread goes on; `aclose` waits for it (`_orphans`).
            return await checkout_in_thread(lane, lane.connections_for(blocks), timeout_s, self._orphans)
        except DaemonRestarted as exc:
            # The peer restarted since it offered this lane (a static pool has no record to
            # say so): gRPC for this call, and its lanes asked for anew by the next one.
            logger.info("cluster: node %s restarted (%s); its lanes are asked for again", node, exc)
            self._drop(node)
            return None
        except KVStoreError as exc:
            logger.info("cluster: the data lane of node %s is not available (%s); block bytes go through gRPC "
                        "for %.0f s", node, exc, LANE_RETRY_S)
            self._set(node, None, LANE_RETRY_S)
            return None

    # -------------------------------------------------------------- calls

    async def lookup(self, node: str, call: PeerCall, hashes: bytes, timeout_s: float) -> int:
        resp = await self._unary(node, call, "Lookup", lookup_request_bytes(call, hashes), timeout_s)
        if resp is None:
            return await self.grpc.lookup(node, call, hashes, timeout_s)
        return lookup_count(node, resp, hashes)

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
        asked = len(hashes) // HASH_BYTES
        left = _left(deadline)
        try:
            # Asked first, and the local put reserved while the holder opens its fetch
            # (each takes a millisecond or two for hundreds of blocks).
            opening = start(self._control(node, call, "LaneFetch", lane_fetch_request(
                kvstore_pb2.FetchRequest(namespace=kvstore_pb2.Namespace(layout=call.layout),
                                         keys=kvstore_pb2.BlockKeys(packed_hashes=hashes)),
                len(conns), left), left))
        except BaseException:
            lane.checkin(conns)
            raise
        try:
            dests = await sink.destinations()
        except Exception:
            await self._drain(lane, conns, opening, deadline)  # which takes `conns`
            raise
        except BaseException:
            opening.close()
            lane.checkin(conns)
            raise
        try:
            grant = await opening
            n = int(grant.num_blocks)
            if n > asked:
                raise PeerError(node, f"fetch: {n} blocks answered for {asked} asked")
            if n and dests and grant.block_bytes != len(dests[0]):
                # (the transfer ends on the holder at its deadline)
                raise PeerError(node, f"fetch: {grant.block_bytes}-byte blocks where this namespace's are "
                                      f"{len(dests[0])}")
        except BaseException:
            lane.checkin(conns)
            raise
        if not n or not dests:
            if n:  # no room here for any of it: the holder's blocks are let go of at once
                await self._drain(lane, conns, None, deadline, grant)
            else:
                lane.checkin(conns)
            await sink.landed(0, (), False)
            return 0
        room = min(n, len(dests))
        # Blocks past the room reserved here land in scratch memory, dropped.
        targets = dests[:room] + [memoryview(bytearray(grant.block_bytes))] * (n - room)
        sums = [NOT_LANDED] * n
        try:
            good = int(await move_in_threads(LaneMove(lane, conns, lane.fetch_into, grant.transfer_id,
                                                      grant.block_bytes, targets, _left(deadline), sums,
                                                      lane_codecs(grant))))
        except Exception as exc:
            raise PeerError(node, f"fetch over the data lane: {_said(exc)}") from None
        good = min(good, room)
        counters = self.counters
        counters.lane_blocks_in += good
        counters.lane_bytes_in += good * grant.block_bytes
        del dests, targets
        await sink.landed(good, sums[:good], good < room and sums[good] != NOT_LANDED)
        return good

    async def _drain(self, lane: DataLane, conns: list[LaneSocket], opening: Started[Any] | None,
                     deadline: float, grant: Any = None) -> None:
        """Take a fetch this node asked for and cannot keep into scratch memory, so the
        holder lets go of its blocks now rather than at the fetch's deadline (`grant`:
        its answer, else awaited from `opening`); `conns` are checked in (or closed)
        either way, and a failure here is the holder's to time out."""
        if grant is None:
            assert opening is not None
            try:
                grant = await opening
            except (KVStoreError, PeerError, TimeoutError):
                grant = None
            except BaseException:
                lane.checkin(conns)
                raise
        if grant is None or not grant.num_blocks:
            lane.checkin(conns)
            return
        scratch = [memoryview(bytearray(grant.block_bytes))] * int(grant.num_blocks)
        try:  # (`fetch_into` checks the connections in, or closes them)
            await move_in_threads(LaneMove(lane, conns, lane.fetch_into, grant.transfer_id, grant.block_bytes, scratch,
                                           _left(deadline)))
        except Exception:  # noqa: BLE001 - the holder's to time out
            pass

    async def put(self, node: str, call: PeerCall, hashes: bytes, parent: bytes, position: int,
                  blocks: AsyncIterator[Framed], timeout_s: float,
                  runs: Sequence[tuple[int, bytes | None, int]] = (),
                  names: kvstore_pb2.EngineNames | None = None) -> tuple[int, int]:
        deadline = time.monotonic() + timeout_s
        state = await self._lane(node, call, timeout_s)
        if runs and (state is None or not state.put_runs):
            raise PeerError(node, "put: several runs in one put, and the node's data lane does not take them")
        if state is None:
            self.counters.fallbacks += 1
            return await self.grpc.put(node, call, hashes, parent, position, self._chunked(blocks), _left(deadline),
                                       names=names)
        with self._using(state) as lane:
            return await self._put(node, lane, call, hashes, parent, position, blocks, deadline, runs, names)

    async def _put(self, node: str, lane: DataLane, call: PeerCall, hashes: bytes, parent: bytes, position: int,
                   blocks: AsyncIterator[Framed], deadline: float,
                   runs: Sequence[tuple[int, bytes | None, int]] = (),
                   names: kvstore_pb2.EngineNames | None = None) -> tuple[int, int]:
        sources = await _collect(blocks)
        n = len(sources)
        if not n:
            return 0, 0
        runs = [run for run in runs if run[0] < n]
        conns = await self._checkout(node, lane, n, _left(deadline))
        if conns is None:
            if runs:
                raise PeerError(node, "put: the node's data lane cannot be reached for a put of several runs")
            self.counters.fallbacks += 1
            return await self.grpc.put(node, call, hashes[: n * HASH_BYTES], parent, position,
                                       self._chunked(_each(sources)), _left(deadline), names=_first(names, n))
        header = kvstore_pb2.PutHeader(namespace=kvstore_pb2.Namespace(layout=call.layout),
                                       keys=kvstore_pb2.BlockKeys(packed_hashes=hashes[: n * HASH_BYTES]),
                                       num_blocks=n, parent_hash=parent, position=position)
        names = _first(names, n)
        if names is not None:
            header.engine_names.CopyFrom(names)

        def fits(grant: kvstore_pb2.LanePutResponse) -> None:
            if len(grant.needed) != n or grant.block_bytes != len(sources[0]):
                raise PeerError(node, f"put: the owner wants {len(grant.needed)} blocks of {grant.block_bytes} "
                                      f"bytes for {n} of {len(sources[0])}")

        try:
            done = await run_transfer(put_transfer(
                lane, conns, header, sources, functools.partial(_left, deadline), check=fits,
                runs=[kvstore_pb2.PutRun(offset=offset, parent_hash=run_parent or b"", position=run_position)
                      for offset, run_parent, run_position in runs]),
                functools.partial(self._control, node, call))
        except PeerError:
            raise
        except Exception as exc:  # the move's (the control calls fail as PeerError)
            raise PeerError(node, f"put over the data lane: {_said(exc)}") from None
        assert done is not None  # without `fall_back` a failed move raises
        grant, resp = done
        sent = grant.needed.count(1)
        counters = self.counters
        counters.lane_blocks_out += sent
        counters.lane_bytes_out += sent * grant.block_bytes
        return int(resp.stored), int(resp.existing)

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
        asking = list(self._asking.values())
        for task in asking:
            task.cancel()
        await asyncio.gather(*asking, return_exceptions=True)
        for node in list(self._peers):
            self._drop(node)
        if self._orphans:
            # Their lanes are closed now: each closes what it connected once it is done
            # (within its connect timeout), and none outlives this transport.
            await asyncio.wait(list(self._orphans), timeout=CONNECT_TIMEOUT_S)
        await self.grpc.aclose()
        # A failed transfer's exceptions may still hold, in cycles, views of tier memory
        # the lane's threads were given; the tiers unmap their segments next.
        gc.collect()


def _first(names: kvstore_pb2.EngineNames | None, n: int) -> kvstore_pb2.EngineNames | None:
    """The names of the first `n` blocks (a forward sends the prefix its owner still holds)."""
    if names is None or len(names.names) == n:
        return names
    cut = kvstore_pb2.EngineNames(names=names.names[:n], integers=names.integers, lora_name=names.lora_name,
                                  parents=names.parents[:n], parent=names.parent)
    if names.token_ids_packed:
        per_block = len(names.token_ids_packed) // len(names.names)
        cut.token_ids_packed = names.token_ids_packed[: n * per_block]
    return cut


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


def _said(error: Exception) -> str:
    """What a failed move said, for its `PeerError`."""
    return str(error) if isinstance(error, KVStoreError) else f"{type(error).__name__}: {error}"
