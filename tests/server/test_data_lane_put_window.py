"""What a data lane put holds ahead of its bytes, and for how long.

A lane put reserves host-tier slots in a window of at most `max_put_reserve_bytes`
ahead of the blocks that have landed (as a streamed Put does), and the credit it grants
on its connections only ever covers slots it has reserved: a put many times its window
evicts older blocks as it goes, never all at once, and a block sent ahead of the window
is refused. A put whose client sends nothing for `put_idle_timeout_s` is rolled back
(DEADLINE_EXCEEDED, naming the setting) and its slots freed. The window is observed
through `kvstore_datalane_put_reserved_bytes` and its `_peak` twin, and the host tier's
used bytes and evictions.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from conftest import RunningDaemon, daemon_in_thread, make_config

from kvstore.client import Client
from kvstore.convert import layout_to_proto
from kvstore.data_lane import (
    CREDIT,
    DATA,
    ERROR,
    HELLO,
    PUSH,
    VERSION,
    WELCOME,
    LaneSocket,
    LaneTimeout,
    checksum_of,
    hello_payload,
    pack,
    status_of,
)
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

# 64 KiB blocks; a 1 MiB window is 16 of them; the host tier holds 64.
LAYOUT = KVLayout(model="test/lane-window", dtype="float16", num_layers=4, num_kv_heads=4, head_dim=64,
                  block_size_tokens=16)
BB = LAYOUT.bytes_per_block
WINDOW = 1 << 20
HOST = 4 << 20
NS = kvstore_pb2.Namespace(layout=layout_to_proto(LAYOUT))


def config(tmp_path, **overrides):
    # Each connection could be granted 4 MiB: only the put's window keeps it to 1 MiB.
    return make_config(tmp_path, host_capacity=HOST, max_put_reserve_bytes=WINDOW, data_lane_window=4 << 20,
                       **overrides)


def blocks_for(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BB, dtype=np.uint8).tobytes() for _ in range(n)]


def tokens(n_blocks: int, start: int) -> list[int]:
    return list(range(start, start + n_blocks * LAYOUT.block_size_tokens))


def keys(toks: list[int]) -> kvstore_pb2.BlockKeys:
    return kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=toks))


def call(running: RunningDaemon, method: str, request: object) -> object:
    with grpc.insecure_channel(running.tcp_target) as channel:
        return getattr(kvstore_pb2_grpc.KVStoreStub(channel), method)(request, timeout=10)


def open_put(running: RunningDaemon, toks: list[int], timeout_ms: int = 60_000) -> kvstore_pb2.LanePutResponse:
    return call(running, "LanePut", kvstore_pb2.LanePutRequest(
        header=kvstore_pb2.PutHeader(namespace=NS, keys=keys(toks)), timeout_ms=timeout_ms))


def commit(running: RunningDaemon, transfer_id: bytes) -> kvstore_pb2.PutResponse:
    return call(running, "LaneCommit", kvstore_pb2.LaneCommitRequest(transfer_id=transfer_id))


def gauge(running: RunningDaemon, name: str) -> int:
    text = running.daemon.metrics.exposition().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"{name} is not exposed"
    return int(float(found.group(1)))


def reserved(running: RunningDaemon) -> int:
    return gauge(running, "kvstore_datalane_put_reserved_bytes")


def peak(running: RunningDaemon) -> int:
    return gauge(running, "kvstore_datalane_put_reserved_peak_bytes")


def host(running: RunningDaemon):
    return next(t for t in running.store.stats().tiers if t.name == "host")


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0, what: str = "timed out") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def raw_lane(running: RunningDaemon) -> LaneSocket:
    """A lane connection made by hand, past its hello."""
    lane_server = running.daemon.data_lane
    assert lane_server is not None
    addr = lane_server.bound[0]
    lane = LaneSocket(socket.create_connection((addr.host, addr.port), timeout=5), 5.0)
    lane.send_frame(HELLO, block=VERSION, payload=hello_payload(""))
    assert lane.read_frame().kind == WELCOME
    return lane


def read_credit(lane: LaneSocket, wait_s: float) -> int:
    """The credit the daemon grants within `wait_s` of quiet."""
    lane.set_timeout(wait_s)
    got = 0
    with contextlib.suppress(LaneTimeout):
        while True:
            frame = lane.read_frame()
            assert frame.kind == CREDIT, frame
            got += frame.value
    lane.set_timeout(5.0)
    return got


def fill_with_older_blocks(running: RunningDaemon, n: int) -> list[int]:
    toks = tokens(n, 900_000)
    with Client(running.tcp_target, data_plane="grpc") as kv:
        assert kv.put(LAYOUT, toks, blocks_for(n, seed=99)).stored == n
    return toks


# ------------------------------------------------------------------ the window


def test_a_lane_put_reserves_its_slots_in_a_window_ahead_of_the_bytes(tmp_path):
    n = 48  # three windows; beside 48 older blocks it needs more room than the tier has
    data = blocks_for(n, seed=1)
    with daemon_in_thread(config(tmp_path)) as running:
        older = fill_with_older_blocks(running, 48)
        grant = open_put(running, tokens(n, 0))
        assert grant.needed == b"\x01" * n
        # Opened: one window reserved, nothing evicted for bytes that have not come.
        assert 0 < reserved(running) <= WINDOW
        assert host(running).counters.evictions == 0
        lane = raw_lane(running)
        with lane.sock:
            lane.send_frame(PUSH, grant.transfer_id)
            granted = read_credit(lane, 0.5)
            assert 0 < granted <= WINDOW  # credit covers reserved slots only, not data_lane_window
            sent = 0
            while sent < n:
                # Send the credit granted so far, then see what it grew to: never more
                # than a window ahead of what landed.
                while sent * BB < granted:
                    lane.send_data(grant.transfer_id, sent, memoryview(data[sent]), checksum_of(data[sent]))
                    sent += 1
                granted += read_credit(lane, 0.3)
                assert granted <= sent * BB + WINDOW
                assert reserved(running) <= WINDOW
                assert granted <= n * BB
        assert peak(running) <= WINDOW
        result = commit(running, grant.transfer_id)
        assert (result.stored, result.existing) == (n, 0)
        assert reserved(running) == 0
        tier = host(running)
        assert tier.counters.evictions > 0 and tier.used_bytes <= HOST  # older blocks made room as the window moved
        with Client(running.tcp_target, data_plane="grpc") as kv:
            assert [bytes(b) for b in kv.fetch(LAYOUT, tokens(n, 0))] == data
            assert kv.lookup(LAYOUT, older).num_blocks < 48


def test_a_block_sent_ahead_of_the_window_is_refused_and_nothing_is_stored(tmp_path):
    n = 40
    data = blocks_for(n, seed=2)
    with daemon_in_thread(config(tmp_path)) as running:
        grant = open_put(running, tokens(n, 0))
        lane = raw_lane(running)
        with lane.sock:
            lane.send_frame(PUSH, grant.transfer_id)
            assert read_credit(lane, 0.5) >= BB
            # Within the connection's credit, but its slot is not reserved yet.
            lane.send_data(grant.transfer_id, n - 1, memoryview(data[-1]), checksum_of(data[-1]))
            frame = lane.read_frame()
            assert frame.kind == ERROR and status_of(frame.block) == grpc.StatusCode.INVALID_ARGUMENT
            assert "window" in lane.read_payload(frame.length, 4096).decode()
        with pytest.raises(grpc.RpcError) as info:
            commit(running, grant.transfer_id)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "window" in info.value.details()
        wait_until(lambda: host(running).used_bytes == 0, what="the refused put's slots were never freed")
        assert reserved(running) == 0
        with Client(running.tcp_target, data_plane="grpc") as kv:
            assert kv.lookup(LAYOUT, tokens(n, 0)).num_blocks == 0


@pytest.mark.parametrize("connections", [1, 4])
def test_sdk_puts_many_windows_long_match_grpc_and_stay_in_the_window(tmp_path, connections):
    n = 48
    with daemon_in_thread(config(tmp_path)) as running:
        fill_with_older_blocks(running, 48)
        with Client(running.tcp_target, data_plane="lane", data_lane_connections=connections) as lane, \
                Client(running.tcp_target, data_plane="grpc") as grpc_kv:
            assert lane.data_plane_in_use == "lane"
            for r in range(3):
                data = blocks_for(n, seed=10 + r)
                toks = tokens(n, r * 10_000)
                result = lane.put(LAYOUT, toks, data)
                assert (result.stored, result.existing) == (n, 0)
                assert [bytes(b) for b in lane.fetch(LAYOUT, toks)] == data
                assert [bytes(b) for b in grpc_kv.fetch(LAYOUT, toks)] == data
                assert lane.put(LAYOUT, toks, data).existing == grpc_kv.put(LAYOUT, toks, data).existing == n
            stats = lane.data_lane_stats
            assert stats is not None and stats.connections_opened <= connections  # every connection reused
        assert peak(running) <= WINDOW
        assert reserved(running) == 0
        assert host(running).counters.evictions > 0


# ------------------------------------------------------------------ a client that stops


def test_a_lane_put_that_stalls_between_blocks_is_rolled_back_after_the_idle_timeout(tmp_path):
    n = 8
    data = blocks_for(n, seed=3)
    with daemon_in_thread(config(tmp_path, put_idle_timeout_s=1.0)) as running:
        transfers = running.daemon.data_lane.transfers
        grant = open_put(running, tokens(n, 0))  # its own deadline is a minute away
        lane = raw_lane(running)
        with lane.sock:
            lane.send_frame(PUSH, grant.transfer_id)
            assert read_credit(lane, 0.3) >= 2 * BB
            for i in range(2):
                lane.send_data(grant.transfer_id, i, memoryview(data[i]), checksum_of(data[i]))
            start = time.monotonic()
            wait_until(lambda: len(transfers) == 0, 10, "the stalled put was never rolled back")
            assert 0.8 < time.monotonic() - start < 8
            wait_until(lambda: host(running).used_bytes == 0, 5, "the stalled put's slots were never freed")
            assert reserved(running) == 0
            # Its sender, back, is told why.
            lane.send_data(grant.transfer_id, 2, memoryview(data[2]), checksum_of(data[2]))
            frame = lane.read_frame()
            while frame.kind == CREDIT:
                frame = lane.read_frame()
            assert frame.kind == ERROR and status_of(frame.block) == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "put_idle_timeout_s" in lane.read_payload(frame.length, 4096).decode()
        with pytest.raises(grpc.RpcError) as info:
            commit(running, grant.transfer_id)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "put_idle_timeout_s" in info.value.details()
        with Client(running.tcp_target, data_plane="grpc") as kv:
            assert kv.lookup(LAYOUT, tokens(n, 0)).num_blocks == 0


def test_a_lane_put_that_stalls_mid_block_or_is_never_joined_is_rolled_back(tmp_path):
    n = 4
    data = blocks_for(n, seed=4)
    with daemon_in_thread(config(tmp_path, put_idle_timeout_s=1.0)) as running:
        transfers = running.daemon.data_lane.transfers
        never_joined = open_put(running, tokens(n, 50_000))
        grant = open_put(running, tokens(n, 0))
        assert host(running).used_bytes == 2 * n * BB
        lane = raw_lane(running)
        with lane.sock:
            lane.send_frame(PUSH, grant.transfer_id)
            assert read_credit(lane, 0.3) >= 2 * BB
            lane.send_data(grant.transfer_id, 0, memoryview(data[0]), checksum_of(data[0]))
            lane.sock.sendall(pack(DATA, grant.transfer_id, 1, BB) + data[1][: BB // 2])  # half a DATA frame
            wait_until(lambda: len(transfers) == 0, 10, "the stalled puts were never rolled back")
            wait_until(lambda: host(running).used_bytes == 0, 5, "the stalled puts' slots were never freed")
        for transfer_id in (grant.transfer_id, never_joined.transfer_id):
            with pytest.raises(grpc.RpcError) as info:
                commit(running, transfer_id)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
            assert "put_idle_timeout_s" in info.value.details()
        assert reserved(running) == 0
        with Client(running.tcp_target, data_plane="lane") as kv:
            assert kv.lookup(LAYOUT, tokens(n, 0)).num_blocks == 0
            assert kv.put(LAYOUT, tokens(n, 0), data).stored == n  # and a retry stores it all
            assert [bytes(b) for b in kv.fetch(LAYOUT, tokens(n, 0))] == data
