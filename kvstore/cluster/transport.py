"""How bytes and questions travel between the daemons of a pool: the `PeerTransport` seam
and its implementation on the daemons' own gRPC API (`GrpcPeerTransport`); the one a
daemon uses, which moves block bytes on the peers' data lanes, is
`kvstore.cluster.data_lane_transport.DataLaneTransport`.

A node asks three things of another (and nothing else: the other side refuses the rest):

* `lookup`: how many of these blocks, from the first, do you hold? (`Lookup`, local only
  on the other side: a node never asks further); always a small unary gRPC call;
* `fetch`: send me the longest held prefix of these blocks, each verified against the
  checksum taken when it was stored. Over gRPC (`Fetch` with `with_checksums`) the
  bytes are handed, chunk by chunk, to a `FetchSink`, which writes them into the slots
  of a local put and verifies them against the holder's checksums; over the lane the
  sink hands out its slots first (`destinations`) and the bytes land in them directly,
  each block checked as it lands against the checksum the holder sends with it, which
  is the one it stored (`landed`);
* `put`: store these blocks (`Put`, or `LanePut` + `LaneCommit`), with the chain
  position of the first one, made by the transport's own `framer` as they are read out
  of the local store.

Every call carries a `PeerCall`: the tenant it is made for and the layout of its
namespace (so the other side files it under that tenant's own salt, and registers the
namespace if it is new), and the sending node's id. Calls are authenticated with the
pool's credential (a bearer token of role `peer` or `admin`, `kvstore.server.auth`), over
TLS when the pool has roots for it. A call that fails, times out or is refused raises
`PeerError`: to the caller that is a miss, never an error for an engine.

What went which way is counted (`TransportCounters`: bytes and blocks over the lane and
over gRPC, each way).

Primitives: `PeerCall`, `PeerError`, `FetchSink`, `PeerTransport`, `TransportCounters`,
`GrpcPeerTransport` (also `control`, the lane's control calls on the same channel),
`chunk_framer`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from kvstore.control_lane_wire import RESPONSE_TYPES, method_path
from kvstore.v1 import kvstore_pb2
from kvstore.wire import (
    FETCH_METHOD,
    PUT_END,
    PUT_METHOD,
    Framed,
    RawChunk,
    encode_chunk,
    fetch_response_deserializer,
    put_request_serializer,
    varint,
)

if TYPE_CHECKING:
    from kvstore.core.fetch import FetchStream

logger = logging.getLogger(__name__)

# The metadata a node-to-node call carries (read by kvstore.server.auth.peer_call).
PEER_HEADER = "x-kvstore-peer"
TENANT_HEADER = "x-kvstore-tenant"
LOOKUP_METHOD = "/kvstore.v1.KVStore/Lookup"
DEFAULT_CHUNK_BYTES = 1 << 20
# Reconnect quickly to a peer that restarted: grpc's default backoff grows to minutes.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.enable_retries", 0),
)


@dataclass(frozen=True, slots=True)
class PeerCall:
    """What every call for one namespace carries: its tenant and layout."""

    tenant: str
    layout: kvstore_pb2.Layout
    # LookupRequest.namespace as wire bytes (field 1), made once: a lookup's request is
    # then these bytes and the keys, with no message built per call.
    namespace_field: bytes = b""

    @classmethod
    def of(cls, tenant: str, layout: kvstore_pb2.Layout) -> PeerCall:
        ns = kvstore_pb2.Namespace(layout=layout).SerializeToString()
        return cls(tenant, layout, b"\x0a" + varint(len(ns)) + ns)


def lookup_request_bytes(call: PeerCall, hashes: bytes) -> bytes:
    """A LookupRequest naming `hashes` (packed), answer packed, hashes omitted: the bytes
    protobuf would write for it (field order aside, which parsers accept in any order)."""
    namespace = call.namespace_field or _namespace_field(call.layout)
    keys = b"\x22" + varint(len(hashes)) + hashes + b"\x18\x01"  # packed_hashes, packed_reply
    return namespace + b"\x12" + varint(len(keys)) + keys + b"\x28\x01"  # keys, omit_hashes


def _namespace_field(layout: kvstore_pb2.Layout) -> bytes:
    ns = kvstore_pb2.Namespace(layout=layout).SerializeToString()
    return b"\x0a" + varint(len(ns)) + ns


def lookup_count(node: str, resp: kvstore_pb2.LookupResponse, hashes: bytes) -> int:
    """How many blocks `node`'s answer to a lookup of `hashes` says it holds (checked)."""
    n = int(resp.num_blocks)
    if n > len(hashes) // 16:
        raise PeerError(node, f"lookup answered {n} blocks of {len(hashes) // 16}")
    return n


class PeerError(Exception):
    """A call to another node failed: unreachable, timed out, refused, or malformed.
    `code`: the gRPC status the other side answered, when it answered one."""

    def __init__(self, node: str, what: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"node {node}: {what}")
        self.node = node
        self.code = code

    @property
    def timed_out(self) -> bool:
        """The call's deadline passed (the other side may just be slow)."""
        return self.code == grpc.StatusCode.DEADLINE_EXCEEDED


class FetchSink(Protocol):
    """Where a fetch's bytes go. A chunked transport (gRPC) says what is coming
    (`begin`), then hands each chunk in order (`chunk`). A transport that lands whole
    blocks in place (the lane) asks for the destinations first (`destinations`), then
    says how many leading blocks landed verified and their checksums (`landed`)."""

    def begin(self, num_blocks: int, block_bytes: int, checksums: Sequence[int]) -> None: ...

    async def chunk(self, block: int, data: memoryview) -> None: ...

    async def destinations(self) -> list[memoryview]:
        """One writable view per block asked for, block i's bytes to land in views[i]
        (the slots of local puts, reserved now); fewer when room ran out: ask only for
        the blocks that have one."""

    async def landed(self, blocks: int, checksums: Sequence[int], corrupt: bool) -> None:
        """The first `blocks` blocks landed whole, each matching its entry of `checksums`
        (the holder's); `corrupt`: the next one arrived and did not. Publishes what landed
        whole, gives back the rest (then raises `PeerError` if `corrupt`)."""


@dataclass(slots=True)
class TransportCounters:
    """Block bytes and blocks moved to and from the other nodes, by path; `fallbacks`:
    fetches and puts sent over gRPC because the peer's lane was not to be had; unary
    calls made on the peers' peer lanes and over gRPC."""

    lane_bytes_in: int = 0
    lane_bytes_out: int = 0
    lane_blocks_in: int = 0
    lane_blocks_out: int = 0
    grpc_bytes_in: int = 0
    grpc_bytes_out: int = 0
    grpc_blocks_in: int = 0
    grpc_blocks_out: int = 0
    fallbacks: int = 0
    # Unary calls to other nodes (lookups, the data lane's control calls), by path.
    peer_lane_calls: int = 0
    grpc_calls: int = 0


class PeerTransport(Protocol):
    """The calls a node makes to the others (see the module docstring)."""

    # Cuts a block that is to be sent into what `put` sends (the forwarder's local fetch
    # frames with it, so a block is copied out of its tier once).
    framer: Callable[[int, memoryview], Framed]

    def outgoing(self, stream: FetchStream) -> AsyncIterator[Framed]:
        """A local fetch's blocks as `put` takes them (framed by `framer`, or views where
        `put` sends blocks from where they are)."""
        ...

    def update(self, addresses: Mapping[str, Sequence[str]]) -> None:
        """The current members' addresses (node id -> host:port, best first)."""

    def forget(self, node: str) -> None:
        """`node` restarted or came back: what is open to it is closed, made anew on the next call."""

    async def reap(self) -> None:
        """Close what was replaced since the last call (its calls have had time to end)."""

    async def lookup(self, node: str, call: PeerCall, hashes: bytes, timeout_s: float) -> int:
        """How many of `hashes` (packed, in order) `node` holds, from the first."""

    async def fetch(self, node: str, call: PeerCall, hashes: bytes, sink: FetchSink, timeout_s: float) -> int:
        """The longest held prefix of `hashes` from `node` into `sink`; how many blocks
        arrived whole."""

    async def put(self, node: str, call: PeerCall, hashes: bytes, parent: bytes, position: int,
                  blocks: AsyncIterator[Framed], timeout_s: float,
                  runs: Sequence[tuple[int, bytes | None, int]] = (),
                  names: kvstore_pb2.EngineNames | None = None) -> tuple[int, int]:
        """Store `blocks` (framed by `framer`) on `node` as the chain `hashes` after
        `parent` from `position`; (stored, existing). `runs`: `hashes` are several runs
        of one chain, these (offset, parent, position) starting the later ones; only
        where `takes_runs(node)`. `names`: the engine's names of the blocks (one each),
        for the node's KV events."""

    def takes_runs(self, node: str) -> bool:
        """Whether one `put` to `node` may carry several runs of a chain (`runs`)."""
        ...

    async def aclose(self) -> None: ...

    @property
    def counters(self) -> TransportCounters: ...


def chunk_framer(chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Callable[[int, memoryview], Framed]:
    """A framer making a block into Put chunk messages of at most `chunk_bytes` (one copy:
    the block's bytes go straight into the messages)."""

    def frame(index: int, data: memoryview) -> Framed:
        messages: list[bytes] = []
        payload: list[memoryview] = []
        for start in range(0, len(data), chunk_bytes):
            piece = data[start : start + chunk_bytes]
            message = encode_chunk(index, piece)
            messages.append(message)
            payload.append(memoryview(message)[len(message) - len(piece) :])
        return Framed(messages, payload)

    return frame


class GrpcPeerTransport:
    """`PeerTransport` on the KVStore gRPC API: one channel per peer, made on first use and
    remade when the peer's address changes or it rejoins."""

    def __init__(self, node_id: str, *, token: str = "", tls_ca: bytes | None = None,
                 tls_cert: bytes | None = None, tls_key: bytes | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.node_id = node_id
        self.framer = chunk_framer(chunk_bytes)
        self.counters = TransportCounters()
        self._token = token
        self._credentials = (grpc.ssl_channel_credentials(tls_ca, tls_key, tls_cert)
                             if tls_ca is not None else None)
        self._addresses: dict[str, tuple[str, ...]] = {}
        self._channels: dict[str, tuple[str, grpc.aio.Channel, Any, Any, Any]] = {}
        self._controls: dict[tuple[grpc.aio.Channel, str], Any] = {}
        self._closing: list[grpc.aio.Channel] = []

    def outgoing(self, stream: FetchStream) -> AsyncIterator[Framed]:
        return stream.frames(self.framer)

    def update(self, addresses: Mapping[str, Sequence[str]]) -> None:
        # Channels of departed peers stay until their address changes: a peer that left is
        # still asked during the grace period (`Placement.lookup_targets`).
        for node, addrs in addresses.items():
            new = tuple(addrs)
            if self._addresses.get(node) != new:
                self._addresses[node] = new
                self.forget(node)

    def forget(self, node: str) -> None:
        """Close `node`'s channel (a new one is made on the next call)."""
        entry = self._channels.pop(node, None)
        if entry is not None:
            self._closing.append(entry[1])
            for key in [k for k in self._controls if k[0] is entry[1]]:
                del self._controls[key]

    def target(self, node: str) -> str:
        """The address `node` is called at ("" when none is known)."""
        addrs = self._addresses.get(node)
        return addrs[0] if addrs else ""

    def _metadata(self, call: PeerCall) -> tuple[tuple[str, str], ...]:
        pairs = [(PEER_HEADER, self.node_id), (TENANT_HEADER, call.tenant)]
        if self._token:
            pairs.append(("authorization", f"Bearer {self._token}"))
        return tuple(pairs)

    def _stubs(self, node: str) -> tuple[Any, Any, Any]:
        entry = self._channels.get(node)
        if entry is None:
            addrs = self._addresses.get(node)
            if not addrs:
                raise PeerError(node, "no address known")
            target = addrs[0]
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(target, self._credentials, options=list(CHANNEL_OPTIONS))
            else:
                channel = grpc.aio.insecure_channel(target, options=list(CHANNEL_OPTIONS))
            lookup = channel.unary_unary(LOOKUP_METHOD, request_serializer=_raw,
                                         response_deserializer=kvstore_pb2.LookupResponse.FromString)
            fetch = channel.unary_stream(FETCH_METHOD, request_serializer=kvstore_pb2.FetchRequest.SerializeToString,
                                         response_deserializer=fetch_response_deserializer)
            put = channel.stream_unary(PUT_METHOD, request_serializer=put_request_serializer,
                                       response_deserializer=kvstore_pb2.PutResponse.FromString)
            entry = self._channels[node] = (target, channel, lookup, fetch, put)
        return entry[2], entry[3], entry[4]

    async def control(self, node: str, call: PeerCall, name: str, request: Any, timeout_s: float) -> Any:
        """A unary call of the KVStore service by `name` (the data lane's `DataLane`,
        `LaneFetch`, `LanePut`, `LaneCommit`) on `node`'s channel, with the credentials
        and tenant of every node-to-node call."""
        self._stubs(node)
        channel = self._channels[node][1]
        stub = self._controls.get((channel, name))
        if stub is None:
            stub = self._controls[(channel, name)] = channel.unary_unary(
                method_path(name), request_serializer=_serialize,
                response_deserializer=RESPONSE_TYPES[name].FromString)
        self.counters.grpc_calls += 1
        try:
            return await stub(request, timeout=timeout_s, metadata=self._metadata(call))
        except grpc.RpcError as exc:
            raise PeerError(node, f"{name}: {_status(exc)}", exc.code() if hasattr(exc, "code") else None) from None

    async def lookup(self, node: str, call: PeerCall, hashes: bytes, timeout_s: float) -> int:
        lookup, _, _ = self._stubs(node)
        self.counters.grpc_calls += 1
        try:
            resp = await lookup(lookup_request_bytes(call, hashes), timeout=timeout_s, metadata=self._metadata(call))
        except grpc.RpcError as exc:
            raise PeerError(node, f"lookup: {_status(exc)}", exc.code() if hasattr(exc, "code") else None) from None
        return lookup_count(node, resp, hashes)

    async def fetch(self, node: str, call: PeerCall, hashes: bytes, sink: FetchSink, timeout_s: float) -> int:
        _, fetch, _ = self._stubs(node)
        req = kvstore_pb2.FetchRequest(namespace=kvstore_pb2.Namespace(layout=call.layout),
                                       keys=kvstore_pb2.BlockKeys(packed_hashes=hashes), with_checksums=True)
        began = False
        blocks = 0
        counters = self.counters
        try:
            async for msg in fetch(req, timeout=timeout_s, metadata=self._metadata(call)):
                if isinstance(msg, RawChunk):
                    block, data = msg.block, msg.data
                elif msg.WhichOneof("msg") == "header":
                    h = msg.header
                    if began or h.num_blocks > len(hashes) // 16 or len(h.checksums) != h.num_blocks:
                        raise PeerError(node, "fetch: a malformed header")
                    sink.begin(h.num_blocks, h.block_bytes, list(h.checksums))
                    began = True
                    continue
                else:
                    block, data = msg.chunk.block, memoryview(msg.chunk.data)
                if not began:
                    raise PeerError(node, "fetch: block bytes before the header")
                await sink.chunk(block, data)
                blocks = block + 1
                counters.grpc_bytes_in += len(data)
        except grpc.RpcError as exc:
            raise PeerError(node, f"fetch: {_status(exc)}") from None
        finally:
            counters.grpc_blocks_in += blocks
        return blocks

    def takes_runs(self, node: str) -> bool:
        return False  # a Put carries one run

    async def put(self, node: str, call: PeerCall, hashes: bytes, parent: bytes, position: int,
                  blocks: AsyncIterator[Framed], timeout_s: float,
                  runs: Sequence[tuple[int, bytes | None, int]] = (),
                  names: kvstore_pb2.EngineNames | None = None) -> tuple[int, int]:
        if runs:
            raise ValueError("a gRPC Put carries one run of a chain (takes_runs is False)")
        _, _, put = self._stubs(node)
        header = kvstore_pb2.PutHeader(namespace=kvstore_pb2.Namespace(layout=call.layout),
                                       keys=kvstore_pb2.BlockKeys(packed_hashes=hashes),
                                       num_blocks=len(hashes) // 16, parent_hash=parent, position=position,
                                       explicit_end=True)
        if names is not None:
            header.engine_names.CopyFrom(names)

        counters = self.counters

        async def messages() -> AsyncIterator[kvstore_pb2.PutRequest | bytes]:
            yield kvstore_pb2.PutRequest(header=header)
            async for framed in blocks:
                for message in framed.messages:
                    yield message
                counters.grpc_blocks_out += 1
                counters.grpc_bytes_out += sum(len(p) for p in framed.payload)
            yield PUT_END  # only this commits: a forward given up on midway stores nothing

        try:
            resp = await put(messages(), timeout=timeout_s, metadata=self._metadata(call))
        except grpc.RpcError as exc:
            raise PeerError(node, f"put: {_status(exc)}") from None
        return int(resp.stored), int(resp.existing)

    async def aclose(self) -> None:
        channels = [entry[1] for entry in self._channels.values()] + self._closing
        self._channels.clear()
        self._controls.clear()
        self._closing.clear()
        for channel in channels:
            await channel.close(grace=None)

    async def reap(self) -> None:
        """Close channels replaced since the last call (their calls have had time to end)."""
        closing, self._closing = self._closing, []
        for channel in closing:
            await channel.close(grace=1.0)


def _raw(data: bytes) -> bytes:
    return data


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def _status(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else ""
    return f"{code.name if code is not None else 'error'}: {details or ''}".strip()
