"""Daemon generations on the wire (a real daemon in-process): every plane hands out this
start's boot id, and every call that names something of a start (slots of its segment, a
reservation, a lease, a data lane transfer) is refused when it names another start, with
FAILED_PRECONDITION and a message the SDK turns into `DaemonRestarted` (naming the
current boot id), over gRPC and over the control lane alike, before anything is handed
out or stored. A call that names no start (boot id 0: a client that never attached, or
predates generations) is served as before."""

from __future__ import annotations

import grpc
import pytest
from conftest import SMALL_LAYOUT, RunningDaemon

from kvstore.client._errors import translate
from kvstore.client.control_lane import SyncControlLane, lane_socket
from kvstore.control_lane_wire import RESPONSE_TYPES, method_path
from kvstore.convert import layout_to_proto
from kvstore.errors import DaemonRestarted, FailedPrecondition
from kvstore.v1 import kvstore_pb2


def _ns() -> kvstore_pb2.Namespace:
    return kvstore_pb2.Namespace(layout=layout_to_proto(SMALL_LAYOUT))


def _keys() -> kvstore_pb2.BlockKeys:
    return kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=list(range(8))))


def _calls(stale: int) -> dict[str, object]:
    """One request per checked method, naming the start `stale`."""
    header = kvstore_pb2.PutHeader(namespace=_ns(), keys=_keys())
    fetch = kvstore_pb2.FetchRequest(namespace=_ns(), keys=_keys(), lease_id="x", boot_id=stale)
    return {
        "LocalPut": kvstore_pb2.LocalPutRequest(header=header, boot_id=stale),
        "LocalCommit": kvstore_pb2.LocalCommitRequest(txn_id="x", boot_id=stale),
        "LocalFetch": kvstore_pb2.LocalFetchRequest(namespace=_ns(), keys=_keys(), boot_id=stale),
        "DevicePut": kvstore_pb2.LocalPutRequest(header=header, boot_id=stale),
        "DeviceFetch": kvstore_pb2.LocalFetchRequest(namespace=_ns(), keys=_keys(), boot_id=stale),
        "Unpin": kvstore_pb2.UnpinRequest(lease_id="x", boot_id=stale),
        "LaneFetch": kvstore_pb2.LaneFetchRequest(fetch=fetch),
        "LanePut": kvstore_pb2.LanePutRequest(header=header, boot_id=stale),
        "LaneCommit": kvstore_pb2.LaneCommitRequest(transfer_id=b"x" * 16, boot_id=stale),
    }


def _grpc_call(target: str, name: str, request: object) -> object:
    with grpc.insecure_channel(target) as channel:
        stub = channel.unary_unary(method_path(name), request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=RESPONSE_TYPES[name].FromString)
        try:
            return stub(request, timeout=10)
        except grpc.RpcError as exc:
            raise translate(exc) from None


def test_every_plane_hands_out_this_start(daemon_thread: RunningDaemon) -> None:
    boot_id = daemon_thread.daemon.generation.boot_id
    assert boot_id
    with grpc.insecure_channel(daemon_thread.tcp_target) as channel:
        def call(name: str, request: object) -> object:
            return channel.unary_unary(method_path(name), request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=RESPONSE_TYPES[name].FromString)(request, timeout=10)

        assert call("LocalSegment", kvstore_pb2.LocalSegmentRequest()).boot_id == boot_id  # type: ignore[attr-defined]
        assert call("DataLane", kvstore_pb2.DataLaneRequest()).boot_id == boot_id  # type: ignore[attr-defined]
    lane = SyncControlLane(lane_socket(daemon_thread.unix_target) or "", "", True)
    try:
        assert lane.in_use(5) and lane.boot_id == boot_id
    finally:
        lane.close()


@pytest.mark.parametrize("over", ["grpc", "lane"])
def test_a_call_naming_another_start_is_refused_before_anything_happens(daemon_thread: RunningDaemon,
                                                                        over: str) -> None:
    boot_id = daemon_thread.daemon.generation.boot_id
    stale = boot_id ^ 0x5A5A
    lane = SyncControlLane(lane_socket(daemon_thread.unix_target) or "", "", True)
    try:
        for name, request in _calls(stale).items():
            with pytest.raises(DaemonRestarted) as refused:
                if over == "grpc":
                    _grpc_call(daemon_thread.tcp_target, name, request)
                else:
                    lane.call(name, request.SerializeToString(), 10)  # type: ignore[attr-defined]
            assert isinstance(refused.value, FailedPrecondition), name
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert str(refused.value).startswith("the daemon restarted"), name
            assert refused.value.boot_id == boot_id, name
    finally:
        lane.close()
    # Nothing was reserved or stored by the refused puts.
    st = daemon_thread.store
    assert st.counters.blocks_stored == 0 and not st.namespaces()


def test_a_fetch_of_another_start_is_refused_on_grpc_too(daemon_thread: RunningDaemon) -> None:
    stale = daemon_thread.daemon.generation.boot_id ^ 1
    request = kvstore_pb2.FetchRequest(namespace=_ns(), keys=_keys(), lease_id="x", boot_id=stale)
    with grpc.insecure_channel(daemon_thread.tcp_target) as channel:
        stream = channel.unary_stream(method_path("Fetch"), request_serializer=lambda m: m.SerializeToString(),
                                      response_deserializer=kvstore_pb2.FetchResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            list(stream(request, timeout=10))
    assert isinstance(translate(refused.value), DaemonRestarted)


def test_a_call_that_names_no_start_is_served_as_before(daemon_thread: RunningDaemon) -> None:
    """Boot id 0: a client that predates generations (or never attached a plane)."""
    resp = _grpc_call(daemon_thread.tcp_target, "Unpin", kvstore_pb2.UnpinRequest(lease_id="nothing"))
    assert resp.released is False  # type: ignore[attr-defined]
    put = _grpc_call(daemon_thread.tcp_target, "LocalPut", _calls(0)["LocalPut"])
    assert len(put.offsets) == 2  # type: ignore[attr-defined]
