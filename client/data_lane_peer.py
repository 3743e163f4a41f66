"""Another daemon's blocks over its data lane, from asyncio code, for a program that
holds namespace ids and block hashes rather than layouts and tokens. (The pool's own
node-to-node transport is `kvstore.cluster.data_lane_transport.DataLaneTransport`; both
run the transfers of `kvstore.client.data_lane`.)

Glossary of planes and lanes: docs/local-data-plane.md

Primitives: `DataLanePeer(target, ...)`: `fetch(namespace, hashes, dests)` -> how many leading
blocks landed verified in `dests`; `put(namespace, hashes, sources, parent_hash=)` ->
the PutResponse; `available()`; `stats()`; `close()`.

`namespace` is a `kvstore_pb2.Namespace` (a layout, or an id the peer knows); `hashes`
are 16-byte block hashes in chain order; `dests` and `sources` are writable / readable
buffers of one block each: memoryviews of host-tier slots, say, so a remote hit lands
in the slot it is served from with no copy in Python. Each call opens a transfer on the
peer's gRPC service (`LanePut` / `LaneFetch`), moves the bytes on its lane
(`kvstore.client.data_lane.DataLane`: one sendmsg per block out of `sources`, recv_into
`dests`, each block verified as it lands) and, for a put, publishes with `LaneCommit`,
all or nothing. A peer that offers no lane raises `FailedPrecondition` (use its Put and
Fetch instead); one that cannot be reached raises `Unavailable` and is left alone for
a while (`available()` is False meanwhile). A cancelled call ends its lane connections
at once and returns once nothing holds the buffers it was given; the peer releases what
the transfer held by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from kvstore.client._errors import translate
from kvstore.client._options import CHANNEL_OPTIONS, DEFAULT_TIMEOUT_S
from kvstore.client.data_lane import (
    DEFAULT_CONNECTIONS,
    DataLane,
    DataLaneStats,
    checkout_in_thread,
    choose_endpoint,
    fetch_transfer,
    put_transfer,
    run_transfer,
)
from kvstore.client.security import Security, aio_channel
from kvstore.control_lane_wire import RESPONSE_TYPES, method_path
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.hashing import HASH_BYTES
from kvstore.v1 import kvstore_pb2


class DataLanePeer:
    """A handle on one peer daemon's data lane (and the control calls that drive it)."""

    def __init__(self, target: str, *, token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, connections: int = DEFAULT_CONNECTIONS,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.connections = connections
        self._security = Security.resolve(token, None, tls_ca, tls_cert, tls_key)
        self._channel = aio_channel(target, self._security, CHANNEL_OPTIONS)
        self._stubs = {name: self._channel.unary_unary(method_path(name),
                                                       request_serializer=lambda m: m.SerializeToString(),
                                                       response_deserializer=RESPONSE_TYPES[name].FromString)
                       for name in ("DataLane", "LaneFetch", "LanePut", "LaneCommit")}
        self._lane: DataLane | None = None
        self._offered = False

    async def __aenter__(self) -> DataLanePeer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
            self._lane = None
        await self._channel.close()

    def available(self) -> bool:
        """False for a while after the peer's lane could not be reached."""
        return self._lane is None or self._lane.usable()

    def stats(self) -> DataLaneStats | None:
        return self._lane.stats() if self._lane is not None else None

    async def _call(self, name: str, request: Any, timeout_s: float) -> Any:
        try:
            return await self._stubs[name](request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def _data_lane(self, timeout_s: float) -> DataLane:
        if not self._offered:
            offer = await self._call("DataLane", kvstore_pb2.DataLaneRequest(), timeout_s)
            endpoint = choose_endpoint(offer, self.target)
            self._offered = True
            if endpoint is not None:
                self._lane = DataLane(endpoint, self._security,
                                      max_connections=min(offer.max_connections or 1, self.connections))
        if self._lane is None:
            raise FailedPrecondition(f"{self.target} offers no data lane; use its Put and Fetch")
        return self._lane

    async def fetch(self, namespace: kvstore_pb2.Namespace, hashes: Sequence[bytes], dests: Sequence[Any], *,
                    lease_id: str = "", timeout_s: float | None = None) -> int:
        """Fetch the longest present prefix of `hashes` into `dests` (block i into
        dests[i]); how many leading blocks landed verified (0 on a miss)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        views = [_view(d, i, writable=True) for i, d in enumerate(dests)]
        if len(views) < len(hashes):
            raise InvalidArgument(f"{len(hashes)} blocks asked for but only {len(views)} destinations")
        lane = await self._data_lane(timeout)
        request = kvstore_pb2.FetchRequest(namespace=namespace, keys=_keys(hashes), lease_id=lease_id)
        conns = await checkout_in_thread(lane, lane.connections_for(len(hashes)), timeout)

        def fitting(grant: kvstore_pb2.LaneFetchResponse) -> list[memoryview]:
            fit = views[: grant.num_blocks]
            if any(len(v) != grant.block_bytes for v in fit):
                raise InvalidArgument(f"a destination is not {grant.block_bytes} bytes, this namespace's block size")
            return fit

        got = await run_transfer(fetch_transfer(lane, conns, request, fitting, lambda: timeout), self._call)
        assert got is not None  # (no fall_back: a failed move raises)
        return got

    async def put(self, namespace: kvstore_pb2.Namespace, hashes: Sequence[bytes], sources: Sequence[Any], *,
                  parent_hash: bytes = b"", timeout_s: float | None = None) -> kvstore_pb2.PutResponse:
        """Store `sources` (block i under hashes[i], after `parent_hash` in its chain), all
        or nothing; blocks the peer holds already are not sent."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        views = [_view(s, i, writable=False) for i, s in enumerate(sources)]
        if len(views) != len(hashes):
            raise InvalidArgument(f"{len(views)} blocks for {len(hashes)} hashes")
        lane = await self._data_lane(timeout)
        header = kvstore_pb2.PutHeader(namespace=namespace, keys=_keys(hashes), parent_hash=parent_hash)
        conns = await checkout_in_thread(lane, lane.connections_for(len(hashes)), timeout)
        done = await run_transfer(put_transfer(lane, conns, header, views, lambda: timeout), self._call)
        assert done is not None  # (no fall_back: a failed move raises)
        return done[1]


def _keys(hashes: Sequence[bytes]) -> kvstore_pb2.BlockKeys:
    if any(len(h) != HASH_BYTES for h in hashes):
        raise InvalidArgument(f"block hashes are {HASH_BYTES} bytes each")
    return kvstore_pb2.BlockKeys(packed_hashes=b"".join(hashes), packed_reply=True)


def _view(buf: Any, index: int, *, writable: bool) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise InvalidArgument(f"buffer {index} must be C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if writable and view.readonly:
        raise InvalidArgument(f"destination {index} is read-only")
    return view
