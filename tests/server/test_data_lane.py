"""The data lane between a real daemon and the SDK: the same bytes and results as gRPC
(Client and AsyncClient, TCP and a Unix socket), flow control by credit, deadlines and
peers that stop or vanish, auth and tenant isolation, TLS, and bytes flipped in flight
by a proxy (never served, never committed, counted)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import RunningDaemon, daemon_in_thread, make_config

from kvstore.client import AsyncClient, Client
from kvstore.data_lane import (
    CREDIT,
    DATA,
    END,
    ERROR,
    FETCH,
    HEADER_BYTES,
    HELLO,
    PUSH,
    TRAILER,
    VERSION,
    WELCOME,
    LaneClosed,
    LaneSocket,
    LaneTimeout,
    checksum_of,
    hello_payload,
    pack,
    status_of,
    unpack,
)
from kvstore.errors import (
    ConfigError,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    Unauthenticated,
    Unavailable,
)
from kvstore.layout import KVLayout
from kvstore.server.auth import hash_token, new_token
from kvstore.server.daemon import Daemon
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.lane_proxy import LaneProxy

# 32 KiB blocks: small enough for many of them in a 16 MiB host tier.
LAYOUT = KVLayout(model="test/lane", dtype="float16", num_layers=4, num_kv_heads=4, head_dim=64,
                  block_size_tokens=8)
BB = LAYOUT.bytes_per_block
# A block larger than one receive piece (kvstore.data_lane.RECV_PIECE_BYTES): hashed in pieces.
BIG = KVLayout(model="test/lane-big", dtype="float16", num_layers=5, num_kv_heads=4, head_dim=64,
               block_size_tokens=64)


def blocks_for(n: int, layout: KVLayout = LAYOUT, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, layout.bytes_per_block, dtype=np.uint8).tobytes() for _ in range(n)]


def tokens(n_blocks: int, start: int = 0, layout: KVLayout = LAYOUT) -> list[int]:
    return list(range(start, start + n_blocks * layout.block_size_tokens))


def ns(layout: KVLayout = LAYOUT) -> kvstore_pb2.Namespace:
    from kvstore.convert import layout_to_proto

    return kvstore_pb2.Namespace(layout=layout_to_proto(layout))


def token_keys(toks: list[int]) -> kvstore_pb2.BlockKeys:
    return kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=toks))


def lane_address(running: RunningDaemon) -> tuple[str, int]:
    lane = running.daemon.data_lane
    assert lane is not None
    addr = lane.bound[0]
    return addr.host, addr.port


def raw_lane(running: RunningDaemon, token: str = "", rcvbuf: int = 0) -> tuple[LaneSocket, int]:
    """A lane connection made by hand: (socket, kind of the hello's answer). `rcvbuf`: its
    receive buffer, fixed before it connects (no autotuning)."""
    sock = socket.socket()
    sock.settimeout(5)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    try:
        sock.connect(lane_address(running))
    except BaseException:
        sock.close()
        raise
    lane = LaneSocket(sock, 5.0)
    try:
        lane.send_frame(HELLO, block=VERSION, payload=hello_payload(token))
        frame = lane.read_frame()
        if frame.kind == ERROR:
            lane.read_payload(frame.length, 4096)
    except BaseException:
        lane.close()
        raise
    return lane, frame.kind


def read_block(lane: LaneSocket, length: int) -> tuple[bytes, int]:
    buf = bytearray(length)
    got, want = lane.recv_block(memoryview(buf), None)
    assert got == want
    return bytes(buf), got


def data_frames_waiting(lane: LaneSocket, wait_s: float) -> list[int]:
    """The DATA frames that arrive within `wait_s` of quiet (their blocks, read and dropped)."""
    lane.set_timeout(wait_s)
    seen = []
    try:
        while True:
            frame = lane.read_frame()
            assert frame.kind == DATA, frame
            read_block(lane, frame.length)
            seen.append(frame.block)
    except LaneTimeout:
        pass
    lane.set_timeout(5.0)
    return seen


# ------------------------------------------------------------------ same results either way


def test_put_and_fetch_are_byte_exact_on_the_lane_and_match_grpc(daemon_thread):
    target = daemon_thread.tcp_target
    with Client(target, data_plane="lane") as lane, Client(target, data_plane="grpc") as grpc_kv:
        assert lane.data_plane_in_use == "lane" and grpc_kv.data_plane_in_use == "grpc"
        a, b = blocks_for(9, seed=1), blocks_for(9, seed=2)
        ra = lane.put(LAYOUT, tokens(9), a)
        rb = grpc_kv.put(LAYOUT, tokens(9, 10_000), b)
        assert (ra.stored, ra.existing) == (rb.stored, rb.existing) == (9, 0)
        for kv in (lane, grpc_kv):
            assert [bytes(x) for x in kv.fetch(LAYOUT, tokens(9))] == a
            assert [bytes(x) for x in kv.fetch(LAYOUT, tokens(9, 10_000))] == b
        # Re-puts are no-ops on either plane, with the same answer (the lane sends no bytes).
        again_lane, again_grpc = lane.put(LAYOUT, tokens(9, 10_000), b), grpc_kv.put(LAYOUT, tokens(9), a)
        assert (again_lane.stored, again_lane.existing) == (again_grpc.stored, again_grpc.existing) == (0, 9)
        assert again_lane.block_hashes == rb.block_hashes
        # A put that half exists stores the other half; a fetch past the stored prefix
        # returns the prefix, as over gRPC.
        c = blocks_for(6, seed=3)
        grpc_kv.put(LAYOUT, tokens(6, 50_000), c[:3])
        r = lane.put(LAYOUT, tokens(6, 50_000), c[3:], first_block=3)
        assert (r.stored, r.existing) == (3, 0)
        partial = tokens(6, 50_000) + tokens(2, 90_000)
        got_lane, got_grpc = lane.fetch(LAYOUT, partial), grpc_kv.fetch(LAYOUT, partial)
        assert [bytes(x) for x in got_lane] == [bytes(x) for x in got_grpc] == c
        assert lane.fetch(LAYOUT, tokens(3, 70_000)) == grpc_kv.fetch(LAYOUT, tokens(3, 70_000)) == []
        stats = lane.data_lane_stats
        assert stats is not None and stats.bytes_sent == 12 * BB and stats.blocks_rejected == 0


def test_fetch_into_caller_buffers_and_by_hashes_with_a_lookup_lease(daemon_thread):
    with Client(daemon_thread.tcp_target, data_plane="lane") as kv:
        data = blocks_for(5, seed=4)
        hashes = kv.put(LAYOUT, tokens(5), data).block_hashes
        hit = kv.lookup(LAYOUT, block_hashes=hashes, lease_ms=5000)
        out = [np.zeros(BB, dtype=np.uint8) for _ in range(5)]
        got = kv.fetch(LAYOUT, block_hashes=hashes, out=out, lease_id=hit.lease_id)
        assert len(got) == 5 and all(g is o for g, o in zip(got, out))
        assert [o.tobytes() for o in out] == data


def test_blocks_larger_than_a_receive_piece_and_many_connections(daemon_thread):
    data = blocks_for(6, BIG, seed=5)
    with Client(daemon_thread.tcp_target, data_plane="lane") as kv:
        assert kv.put(BIG, tokens(6, layout=BIG), data).stored == 6
        assert [bytes(x) for x in kv.fetch(BIG, tokens(6, layout=BIG))] == data
        stats = kv.data_lane_stats
        assert stats is not None and stats.connections_opened >= 2  # the blocks went over several


def test_one_connection_whose_credit_the_fetch_uses_up_exactly(daemon_thread):
    """The whole fetch fits the window: the last block uses the last byte of credit, and
    the END after it needs none."""
    data = blocks_for(4, seed=18)
    with Client(daemon_thread.tcp_target, data_plane="lane", data_lane_connections=1, timeout_s=5) as kv:
        kv.put(LAYOUT, tokens(4), data)
        start = time.monotonic()
        for _ in range(3):
            assert [bytes(x) for x in kv.fetch(LAYOUT, tokens(4))] == data
        assert time.monotonic() - start < 4
        stats = kv.data_lane_stats
        assert stats is not None and stats.connections_opened == 1  # one connection, reused


def test_puts_larger_than_the_window_keep_their_connection(tmp_path):
    """The daemon tops a put's credit up as blocks land, maybe after the client sent its
    last block: those late CREDIT frames do not cost the pooled connection."""
    n = 2 * (1 << 20) // BB
    with daemon_in_thread(make_config(tmp_path, data_lane_window=1 << 20)) as running:
        # Two connections share the put's credit (each up to data_lane_window), as its
        # slots are reserved; whichever has credit sends the next block.
        with Client(running.tcp_target, data_plane="lane", data_lane_connections=2) as kv:
            for r in range(3):
                data = blocks_for(n, seed=30 + r)
                assert kv.put(LAYOUT, tokens(n, r * 10_000), data).stored == n
                assert [bytes(x) for x in kv.fetch(LAYOUT, tokens(n, r * 10_000))] == data
            stats = kv.data_lane_stats
            assert stats is not None and stats.connections_opened == 2


def test_the_daemon_counts_lane_bytes_under_their_own_plane(daemon_thread):
    with Client(daemon_thread.tcp_target, data_plane="lane") as kv:
        kv.put(LAYOUT, tokens(3), blocks_for(3))
        kv.fetch(LAYOUT, tokens(3))
    text = daemon_thread.daemon.metrics.exposition().decode()
    assert f'kvstore_data_in_bytes_total{{plane="lane"}} {float(3 * BB)}' in text
    assert f'kvstore_data_out_bytes_total{{plane="lane"}} {float(3 * BB)}' in text
    assert 'kvstore_data_in_bytes_total{plane="shm"} 0.0' in text
    assert 'kvstore_datalane_received_blocks_total 3.0' in text


async def test_async_client_on_the_lane_matches_grpc(daemon):
    async with AsyncClient(daemon.tcp_target, data_plane="lane") as lane, \
            AsyncClient(daemon.tcp_target, data_plane="grpc") as grpc_kv:
        assert await lane.data_plane_in_use() == "lane"
        prompts = [tokens(4, i * 1000) for i in range(5)]
        payloads = [blocks_for(4, seed=10 + i) for i in range(5)]
        results = await asyncio.gather(*(lane.put(LAYOUT, p, b) for p, b in zip(prompts, payloads)))
        assert [r.stored for r in results] == [4] * 5
        fetched = await asyncio.gather(*(lane.fetch(LAYOUT, p) for p in prompts))
        via_grpc = await asyncio.gather(*(grpc_kv.fetch(LAYOUT, p) for p in prompts))
        assert [[bytes(x) for x in f] for f in fetched] == [[bytes(x) for x in f] for f in via_grpc] == payloads


def test_a_unix_socket_lane(tmp_path):
    path = tmp_path / "kv.data"
    cfg = make_config(tmp_path, data_lane_listen=(f"unix:{path}",))
    with daemon_in_thread(cfg) as running:
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        with Client(running.unix_target, data_plane="lane") as kv:
            assert kv.data_plane_in_use == "lane"
            data = blocks_for(4, seed=6)
            assert kv.put(LAYOUT, tokens(4), data).stored == 4
            assert [bytes(x) for x in kv.fetch(LAYOUT, tokens(4))] == data
        with Client(running.unix_target) as auto:  # a Unix target's auto is shared memory, as before
            assert auto.data_plane_in_use == "local"
    assert not path.exists()


def test_no_lane_means_grpc_and_a_forced_lane_says_why(tmp_path):
    cfg = make_config(tmp_path, data_lane_listen=("off",))
    with daemon_in_thread(cfg) as running:
        assert running.daemon.data_lane is None
        with Client(running.tcp_target, data_plane="lane") as kv:
            with pytest.raises(FailedPrecondition, match="data lane"):
                kv.put(LAYOUT, tokens(2), blocks_for(2))
        with Client(running.tcp_target, data_plane="auto", token=None) as kv:
            kv.put(LAYOUT, tokens(2), blocks_for(2))
            assert kv.data_plane_in_use in ("local", "grpc")


def test_a_daemon_that_predates_the_lane_is_used_through_grpc():
    """An old daemon answers the DataLane offer UNIMPLEMENTED."""
    async def serve() -> None:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        box["port"] = port
        started.set()
        await stop.wait()
        await server.stop(0)

    box: dict[str, int] = {}
    started, stop = threading.Event(), asyncio.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    started.wait(10)
    try:
        with Client(f"127.0.0.1:{box['port']}", data_plane="lane", timeout_s=3) as kv:
            with pytest.raises(FailedPrecondition, match="cannot use the data lane"):
                kv.fetch(LAYOUT, tokens(1))
        with Client(f"127.0.0.1:{box['port']}", timeout_s=3) as kv:
            assert kv.data_plane_in_use == "grpc"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


def test_the_sdk_checks_its_lane_arguments():
    with pytest.raises(InvalidArgument, match="data_lane_connections"):
        Client("127.0.0.1:1", data_lane_connections=0)
    with pytest.raises(InvalidArgument, match="data_plane"):
        Client("127.0.0.1:1", data_plane="rdma")


def test_a_non_loopback_lane_needs_auth_and_tls(tmp_path):
    with pytest.raises(ConfigError, match="authentication"):
        Daemon(make_config(tmp_path, data_lane_listen=("0.0.0.0:0",)))
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(f'[[tenant]]\nname = "a"\ntokens = ["{hash_token("kvs_x")}"]\n')
    os.chmod(tokens_file, 0o600)
    with pytest.raises(ConfigError, match="TLS"):
        Daemon(make_config(tmp_path, data_lane_listen=("0.0.0.0:0",), auth_token_file=str(tokens_file)))
    Daemon(make_config(tmp_path, data_lane_listen=("0.0.0.0:0",), auth_token_file=str(tokens_file),
                       insecure_remote=True))
    with pytest.raises(ConfigError, match="stand alone"):
        Daemon(make_config(tmp_path, data_lane_listen=("auto", "127.0.0.1:0")))
    # `kvstore config validate` applies the same rules.
    from kvstore.cli.main import main

    toml = tmp_path / "lane.toml"
    toml.write_text('data_lane_listen = "0.0.0.0:0"\n')
    assert main(["config", "validate", str(toml)]) == 1
    toml.write_text('data_lane_listen = "127.0.0.1:0"\n')
    assert main(["config", "validate", str(toml)]) == 0


# ------------------------------------------------------------------ flow control


def open_fetch(running: RunningDaemon, toks: list[int], connections: int = 1,
               timeout_ms: int = 10_000) -> kvstore_pb2.LaneFetchResponse:
    with grpc.insecure_channel(running.tcp_target) as channel:
        return kvstore_pb2_grpc.KVStoreStub(channel).LaneFetch(kvstore_pb2.LaneFetchRequest(
            fetch=kvstore_pb2.FetchRequest(namespace=ns(), keys=token_keys(toks)), connections=connections,
            timeout_ms=timeout_ms), timeout=10)


def lane_put_call(running: RunningDaemon, method: str, request: object) -> object:
    with grpc.insecure_channel(running.tcp_target) as channel:
        return getattr(kvstore_pb2_grpc.KVStoreStub(channel), method)(request, timeout=10)


def test_a_fetch_never_has_more_in_flight_than_the_receiver_granted(daemon_thread):
    data = blocks_for(8, seed=7)
    with Client(daemon_thread.tcp_target, data_plane="grpc") as kv:
        kv.put(LAYOUT, tokens(8), data)
    grant = open_fetch(daemon_thread, tokens(8))
    assert grant.num_blocks == 8 and grant.block_bytes == BB
    lane, kind = raw_lane(daemon_thread)
    assert kind == WELCOME
    with lane.sock:
        lane.send_frame(FETCH, grant.transfer_id, value=2 * BB)
        assert data_frames_waiting(lane, 0.5) == [0, 1]  # the credit, and not a byte more
        lane.send_frame(CREDIT, grant.transfer_id, value=BB)
        assert data_frames_waiting(lane, 0.5) == [2]
        lane.send_frame(CREDIT, grant.transfer_id, value=100 * BB)
        received = {}
        while True:
            frame = lane.read_frame()
            if frame.kind == END:
                assert frame.block == 8
                break
            received[frame.block] = read_block(lane, frame.length)[0]
        assert received == {i: data[i] for i in range(3, 8)}


def test_a_fetch_whose_second_connection_never_joins_is_released_soon_after(daemon_thread):
    with Client(daemon_thread.tcp_target, data_plane="grpc") as kv:
        kv.put(LAYOUT, tokens(3), blocks_for(3))
    grant = open_fetch(daemon_thread, tokens(3), connections=2, timeout_ms=60_000)
    transfers = daemon_thread.daemon.data_lane.transfers
    lane, _ = raw_lane(daemon_thread)
    with lane.sock:
        lane.send_frame(FETCH, grant.transfer_id, value=1 << 30)
        while (frame := lane.read_frame()).kind == DATA:
            read_block(lane, frame.length)
        assert frame.kind == END and frame.block == 3
        # The other connection the client announced never comes (it failed on its side):
        # the blocks are let go a moment later, not at the 60 s deadline.
        wait_until(lambda: len(transfers) == 0, 5)


def test_a_put_sender_past_its_credit_is_cut_off_and_nothing_is_stored(tmp_path):
    cfg = make_config(tmp_path, data_lane_window=1 << 20)
    n = (1 << 20) // BB + 4
    data = blocks_for(n, seed=8)
    with daemon_in_thread(cfg) as running:
        grant = lane_put_call(running, "LanePut", kvstore_pb2.LanePutRequest(
            header=kvstore_pb2.PutHeader(namespace=ns(), keys=token_keys(tokens(n)))))
        assert grant.needed == b"\x01" * n
        lane, _ = raw_lane(running)
        with lane.sock:
            lane.send_frame(PUSH, grant.transfer_id)
            frame = lane.read_frame()
            assert frame.kind == CREDIT and frame.value == 1 << 20  # data_lane_window, no more
            allowed = frame.value // BB
            for i in range(allowed):  # the whole credit, without waiting
                lane.send_data(grant.transfer_id, i, memoryview(data[i]), checksum_of(data[i]))
            # As the blocks land the daemon tops the credit up (once half of it is used),
            # never past what the put still needs.
            lane.set_timeout(0.5)
            returned = 0
            with contextlib.suppress(LaneTimeout):
                while True:
                    frame = lane.read_frame()
                    assert frame.kind == CREDIT
                    returned += frame.value
            lane.set_timeout(5.0)
            left = (1 << 20) + returned - allowed * BB
            assert 0 < returned and left + allowed * BB <= n * BB
            # A frame larger than the credit left: refused before a byte of it is read.
            lane.sock.sendall(pack(DATA, grant.transfer_id, allowed, left + BB))
            frame = lane.read_frame()
            assert frame.kind == ERROR and status_of(frame.block) == grpc.StatusCode.INVALID_ARGUMENT
            assert "credit" in lane.read_payload(frame.length, 4096).decode()
        with pytest.raises(grpc.RpcError) as info:
            lane_put_call(running, "LaneCommit", kvstore_pb2.LaneCommitRequest(transfer_id=grant.transfer_id))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "credit" in info.value.details()
        with Client(running.tcp_target, data_plane="grpc") as kv:
            assert kv.lookup(LAYOUT, tokens(n)).num_blocks == 0
        wait_until(lambda: running.store.stats().tiers[0].used_bytes == 0)


class FakeLane:
    """A lane server that answers the hello, grants `credit` bytes to one put, takes one
    block and then reads nothing more: a receiver that stopped."""

    def __init__(self, credit: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.credit = credit
        self.received_frames: list[int] = []
        self.rest: bytes = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        lane = LaneSocket(conn, 10.0)
        with conn:
            hello = lane.read_frame()
            lane.read_payload(hello.length, 4096)
            lane.send_frame(WELCOME, block=VERSION, value=1 << 30)
            push = lane.read_frame()
            assert push.kind == PUSH
            lane.send_frame(CREDIT, push.transfer, value=self.credit)
            frame = lane.read_frame()
            read_block(lane, frame.length)
            self.received_frames.append(frame.block)
            time.sleep(3)  # stops reading; the client must not send past the credit meanwhile
            conn.setblocking(False)
            try:
                self.rest = conn.recv(1 << 20)
            except BlockingIOError:
                self.rest = b""

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)


def test_a_client_sender_waits_for_credit_and_gives_up_at_its_deadline(tmp_path):
    fake = FakeLane(credit=BB)
    cfg = make_config(tmp_path, data_lane_advertise=(fake.address,))
    try:
        with daemon_in_thread(cfg) as running:
            with Client(running.tcp_target, data_plane="lane", timeout_s=1.5) as kv:
                start = time.monotonic()
                with pytest.raises(DeadlineExceeded):
                    kv.put(LAYOUT, tokens(6), blocks_for(6))
                assert time.monotonic() - start < 5
            fake.thread.join(10)
            assert fake.received_frames == [0]
            # After its one granted block the client sent nothing but, at most, the goodbye.
            assert fake.rest == b"" or unpack(fake.rest[:HEADER_BYTES]).kind in (ERROR,)
            with Client(running.tcp_target, data_plane="grpc") as kv:
                assert kv.lookup(LAYOUT, tokens(6)).num_blocks == 0
    finally:
        fake.close()


# ------------------------------------------------------------------ deadlines and vanishing peers


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_fetch_reader_that_stops_reading_is_dropped_and_its_blocks_released(tmp_path):
    cfg = make_config(tmp_path, data_lane_io_timeout_s=1.0, host_capacity=32 << 20)
    # 11 MiB: more than the daemon's send buffer (4 MiB at most, tcp_wmem) and this
    # reader's receive buffer (fixed at 64 KiB before it connects) hold together.
    n = 36
    big = blocks_for(n, BIG, seed=9)
    with daemon_in_thread(cfg) as running:
        with Client(running.tcp_target, data_plane="grpc") as kv:
            kv.put(BIG, tokens(n, layout=BIG), big)
        with grpc.insecure_channel(running.tcp_target) as channel:
            grant = kvstore_pb2_grpc.KVStoreStub(channel).LaneFetch(kvstore_pb2.LaneFetchRequest(
                fetch=kvstore_pb2.FetchRequest(namespace=ns(BIG), keys=token_keys(tokens(n, layout=BIG))),
                connections=1, timeout_ms=60_000), timeout=10)
        lane, _ = raw_lane(running, rcvbuf=64 << 10)
        transfers = running.daemon.data_lane.transfers
        with lane.sock:
            lane.send_frame(FETCH, grant.transfer_id, value=1 << 40)  # all the credit, then silence
            assert len(transfers) == 1
            wait_until(lambda: len(transfers) == 0, 15)  # the daemon's send timed out
        # Its blocks are no longer held: they are served and deleted like any others.
        with Client(running.tcp_target, data_plane="lane") as kv:
            assert [bytes(x) for x in kv.fetch(BIG, tokens(n, layout=BIG))] == big
            assert kv.delete(BIG, tokens(n, layout=BIG)) == n


def test_a_put_whose_sender_vanishes_mid_block_stores_nothing(daemon_thread):
    data = blocks_for(4, seed=11)
    grant = lane_put_call(daemon_thread, "LanePut", kvstore_pb2.LanePutRequest(
        header=kvstore_pb2.PutHeader(namespace=ns(), keys=token_keys(tokens(4)))))
    used_before = daemon_thread.store.stats().tiers[0].used_bytes
    assert used_before == 4 * BB  # the PENDING slots
    lane, _ = raw_lane(daemon_thread)
    lane.send_frame(PUSH, grant.transfer_id)
    assert lane.read_frame().kind == CREDIT
    lane.send_data(grant.transfer_id, 0, memoryview(data[0]), checksum_of(data[0]))
    lane.sock.sendall(pack(DATA, grant.transfer_id, 1, BB) + data[1][: BB // 2])
    lane.close()
    with pytest.raises(grpc.RpcError) as info:
        lane_put_call(daemon_thread, "LaneCommit", kvstore_pb2.LaneCommitRequest(transfer_id=grant.transfer_id))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "broke" in info.value.details()
    wait_until(lambda: daemon_thread.store.stats().tiers[0].used_bytes == 0)
    with Client(daemon_thread.tcp_target, data_plane="lane") as kv:
        assert kv.lookup(LAYOUT, tokens(4)).num_blocks == 0
        assert kv.put(LAYOUT, tokens(4), data).stored == 4  # and a retry stores it all


def test_an_uncommitted_put_rolls_back_at_its_deadline(daemon_thread):
    grant = lane_put_call(daemon_thread, "LanePut", kvstore_pb2.LanePutRequest(
        header=kvstore_pb2.PutHeader(namespace=ns(), keys=token_keys(tokens(3))), timeout_ms=300))
    assert daemon_thread.store.stats().tiers[0].used_bytes == 3 * BB
    wait_until(lambda: daemon_thread.store.stats().tiers[0].used_bytes == 0)
    with pytest.raises(grpc.RpcError) as info:
        lane_put_call(daemon_thread, "LaneCommit", kvstore_pb2.LaneCommitRequest(transfer_id=grant.transfer_id))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


class VanishingLane:
    """A lane server that answers each connection's hello and the frame after it with
    half a DATA frame, then closes: a daemon that died mid-fetch."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next = 0  # each connection sends the start of a different block
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        lane = LaneSocket(conn, 10.0)
        with conn:
            try:
                hello = lane.read_frame()
                lane.read_payload(hello.length, 4096)
                lane.send_frame(WELCOME, block=VERSION, value=1 << 30)
                join = lane.read_frame()
                with self._lock:
                    block, self._next = self._next, self._next + 1
                conn.sendall(pack(DATA, join.transfer, block, BB) + bytes(BB // 3))
            except KVStoreError:
                pass

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self.thread.join(10)


def test_a_lane_that_vanishes_mid_fetch_is_a_bounded_error_or_a_grpc_fallback(tmp_path, tenants):
    data = blocks_for(3, seed=12)
    for plane in ("lane", "auto"):
        fake = VanishingLane()
        cfg = make_config(tmp_path / plane, data_lane_advertise=(fake.address,), auth_token_file=tenants["file"])
        try:
            with daemon_in_thread(cfg) as running:
                with Client(running.tcp_target, token=tenants["beta"], data_plane="grpc") as kv:
                    kv.put(LAYOUT, tokens(3), data)
                # beta may not map shared memory, so its `auto` is the lane, then gRPC.
                with Client(running.tcp_target, token=tenants["beta"], data_plane=plane, timeout_s=5) as kv:
                    start = time.monotonic()
                    if plane == "lane":
                        with pytest.raises(Unavailable):
                            kv.fetch(LAYOUT, tokens(3))
                    else:
                        assert [bytes(x) for x in kv.fetch(LAYOUT, tokens(3))] == data  # over gRPC
                        assert kv.data_plane_in_use == "grpc"  # the lane is set aside for a while
                    assert time.monotonic() - start < 5
        finally:
            fake.close()


class SilentLane:
    """A lane server that welcomes each connection, takes its first frame and then says
    nothing; `joined` once a connection sent it, `closed` once one was closed on it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.joined, self.closed = threading.Event(), threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        lane = LaneSocket(conn, 30.0)
        with conn:
            try:
                hello = lane.read_frame()
                lane.read_payload(hello.length, 4096)
                lane.send_frame(WELCOME, block=VERSION, value=1 << 30)
                lane.read_frame()
                self.joined.set()
                while conn.recv(4096):  # until the client closes it
                    pass
                self.closed.set()
            except (KVStoreError, OSError):
                self.closed.set()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self.thread.join(5)
        for t in self._threads:
            t.join(5)


async def test_a_cancelled_async_fetch_ends_its_lane_connections_at_once(tmp_path):
    silent = SilentLane()
    daemon = Daemon(make_config(tmp_path, data_lane_advertise=(silent.address,)))
    await daemon.start()
    try:
        tcp = daemon.bound[1]
        async with AsyncClient(tcp, data_plane="grpc") as kv:
            await kv.put(LAYOUT, tokens(2), blocks_for(2))
        async with AsyncClient(tcp, data_plane="lane", timeout_s=60) as kv:
            task = asyncio.create_task(kv.fetch(LAYOUT, tokens(2)))
            assert await asyncio.to_thread(silent.joined.wait, 10)  # the fetch waits on the lane now
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Its worker thread did not wait for the 60 s deadline: the connection is gone.
            assert await asyncio.to_thread(silent.closed.wait, 5)
    finally:
        await daemon.stop(grace_s=0)
        silent.close()


# ------------------------------------------------------------------ auth and tenants


@pytest.fixture
def tenants(tmp_path: Path) -> dict[str, str]:
    found = {}
    lines = []
    for name, local in (("alpha", "true"), ("beta", "false")):
        token, digest = new_token()
        found[name] = token
        lines.append(f'[[tenant]]\nname = "{name}"\nrole = "client"\ntokens = ["{digest}"]\nlocal_plane = {local}\n')
    path = tmp_path / "tokens.toml"
    path.write_text("\n".join(lines))
    os.chmod(path, 0o600)
    found["file"] = str(path)
    return found


def test_the_lane_refuses_missing_and_wrong_tokens_and_keeps_tenants_apart(tmp_path, tenants):
    cfg = make_config(tmp_path, auth_token_file=tenants["file"])
    with daemon_in_thread(cfg) as running:
        for token in ("", "kvs_wrong"):
            lane, kind = raw_lane(running, token)
            lane.close()
            assert kind == ERROR
        a_data, b_data = blocks_for(3, seed=13), blocks_for(3, seed=14)
        with Client(running.tcp_target, token=tenants["alpha"], data_plane="lane") as alpha, \
                Client(running.tcp_target, token=tenants["beta"]) as beta:
            assert alpha.put(LAYOUT, tokens(3), a_data).stored == 3
            # beta may not map shared memory: `auto` gives it the lane, as from another host.
            assert beta.data_plane_in_use == "lane"
            assert beta.fetch(LAYOUT, tokens(3)) == []  # alpha's blocks are not beta's
            assert beta.put(LAYOUT, tokens(3), b_data).stored == 3
            assert [bytes(x) for x in alpha.fetch(LAYOUT, tokens(3))] == a_data
            assert [bytes(x) for x in beta.fetch(LAYOUT, tokens(3))] == b_data
        with Client(running.tcp_target, data_plane="lane", token="kvs_wrong") as wrong:
            with pytest.raises(Unauthenticated):
                wrong.fetch(LAYOUT, tokens(3))
        # A transfer alpha opened cannot be joined with beta's credentials.
        with grpc.insecure_channel(running.tcp_target) as channel:
            grant = kvstore_pb2_grpc.KVStoreStub(channel).LaneFetch(kvstore_pb2.LaneFetchRequest(
                fetch=kvstore_pb2.FetchRequest(namespace=ns(), keys=token_keys(tokens(3))), connections=1),
                metadata=[("authorization", f"Bearer {tenants['alpha']}")], timeout=10)
        assert grant.num_blocks == 3
        lane, kind = raw_lane(running, tenants["beta"])
        assert kind == WELCOME
        with lane.sock:
            lane.send_frame(FETCH, grant.transfer_id, value=1 << 30)
            frame = lane.read_frame()
            assert frame.kind == ERROR and status_of(frame.block) == grpc.StatusCode.NOT_FOUND
            lane.read_payload(frame.length, 4096)
        lane, _ = raw_lane(running, tenants["alpha"])
        with lane.sock:
            lane.send_frame(FETCH, grant.transfer_id, value=1 << 30)
            got = {}
            while (frame := lane.read_frame()).kind == DATA:
                got[frame.block] = read_block(lane, frame.length)[0]
            assert frame.kind == END and got == dict(enumerate(a_data))


# ------------------------------------------------------------------ bytes flipped in flight


@contextlib.contextmanager
def proxied_daemon(tmp_path: Path, direction: str) -> Iterator[tuple[RunningDaemon, LaneProxy]]:
    """A daemon whose DataLane offer names the proxy in front of its lane."""
    proxy = LaneProxy("flip", direction)
    cfg = make_config(tmp_path, data_lane_listen=("127.0.0.1:0",), data_lane_advertise=(proxy.address,))
    try:
        with daemon_in_thread(cfg) as running:
            proxy.upstream = lane_address(running)
            yield running, proxy
    finally:
        proxy.close()


def test_a_block_flipped_on_its_way_to_the_client_is_never_returned_and_is_counted(tmp_path):
    data = blocks_for(6, seed=15)
    with proxied_daemon(tmp_path, "to_client") as (running, proxy):
        with Client(running.tcp_target, data_plane="grpc") as kv:
            kv.put(LAYOUT, tokens(6), data)
        with Client(running.tcp_target, data_plane="lane") as kv:
            got = kv.fetch(LAYOUT, tokens(6))
            assert proxy.hits == 1 and proxy.hit_block is not None
            # The result ends before the flipped block; what it has is exact.
            assert len(got) == proxy.hit_block
            assert [bytes(x) for x in got] == data[: len(got)]
            stats = kv.data_lane_stats
            assert stats is not None and stats.blocks_rejected == 1
            # The daemon's copy was never wrong: the next fetch (not flipped) has it all.
            assert [bytes(x) for x in kv.fetch(LAYOUT, tokens(6))] == data
        assert running.store.stats().tiers[0].counters.checksum_failures == 0


def test_a_block_flipped_on_its_way_to_the_daemon_is_never_committed_and_is_counted(tmp_path):
    data = blocks_for(6, seed=16)
    with proxied_daemon(tmp_path, "to_daemon") as (running, proxy):
        with Client(running.tcp_target, data_plane="lane") as kv:
            with pytest.raises(DataLoss, match="checksum"):
                kv.put(LAYOUT, tokens(6), data)
            assert proxy.hits == 1
            assert kv.lookup(LAYOUT, tokens(6)).num_blocks == 0  # nothing of the put is visible
            lane = running.daemon.data_lane
            assert lane is not None and lane.counters.get("blocks_rejected") == 1
            assert "kvstore_datalane_rejected_blocks_total 1.0" in running.daemon.metrics.exposition().decode()
            wait_until(lambda: running.store.stats().tiers[0].used_bytes == 0)  # its slots were freed
            # Sent again (the proxy flips only once), it lands exactly.
            assert kv.put(LAYOUT, tokens(6), data).stored == 6
            assert [bytes(x) for x in kv.fetch(LAYOUT, tokens(6))] == data


# ------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make certificates")
    d = tmp_path_factory.mktemp("lane-pki")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=lane test CA")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", *ext)
    for key in d.glob("*.key"):
        os.chmod(key, 0o600)
    return d


def test_the_lane_speaks_tls_when_the_daemon_does(tmp_path, pki):
    cfg = make_config(tmp_path, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                      tls_client_ca=str(pki / "ca.pem"))
    with daemon_in_thread(cfg) as running:
        lane = running.daemon.data_lane
        assert lane is not None and all(ep.tls for ep in lane.endpoints())
        data = blocks_for(5, BIG, seed=17)
        with Client(running.tcp_target, data_plane="lane", tls_ca=str(pki / "ca.pem"),
                    tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key")) as kv:
            assert kv.put(BIG, tokens(5, layout=BIG), data).stored == 5
            assert [bytes(x) for x in kv.fetch(BIG, tokens(5, layout=BIG))] == data
        # Plain text is not spoken on a TLS lane.
        with pytest.raises(KVStoreError):
            plain, kind = raw_lane(running)
            plain.close()
            assert kind == WELCOME, "a plain-text hello was answered"


# ------------------------------------------------------------------ the peers' API


async def test_a_peer_fetches_into_and_puts_from_slot_memory_by_namespace_and_hashes(daemon):
    from kvstore.client.data_lane_peer import DataLanePeer
    from kvstore.hashing import block_hashes

    data = blocks_for(6, seed=19)
    hashes = block_hashes(LAYOUT.namespace_id, tokens(6), LAYOUT.block_size_tokens)
    region = bytearray(8 * BB)  # stands in for a host tier's segment
    slots = [memoryview(region)[i * BB : (i + 1) * BB] for i in range(8)]
    async with DataLanePeer(daemon.tcp_target) as peer:
        put = await peer.put(ns(), hashes[:4], [memoryview(d) for d in data[:4]])
        assert (put.stored, put.existing) == (4, 0)
        # The rest of the chain, after its parent, by the namespace's id this time.
        by_id = kvstore_pb2.Namespace(id=put.namespace_id)
        put = await peer.put(by_id, hashes[4:], [memoryview(d) for d in data[4:]], parent_hash=hashes[3])
        assert (put.stored, put.existing) == (2, 0)
        assert await peer.fetch(by_id, hashes, slots) == 6
        assert [bytes(s) for s in slots[:6]] == data
        assert await peer.fetch(ns(), [os.urandom(16)], slots) == 0  # a miss is a value
        stats = peer.stats()
        assert stats is not None and stats.bytes_received == 6 * BB and stats.bytes_sent == 6 * BB
    async with AsyncClient(daemon.tcp_target, data_plane="grpc") as kv:  # what any client sees
        assert [bytes(x) for x in await kv.fetch(LAYOUT, tokens(6))] == data


async def test_a_peer_without_a_lane_says_so(tmp_path):
    from kvstore.client.data_lane_peer import DataLanePeer

    daemon = Daemon(make_config(tmp_path, data_lane_listen=("off",)))
    await daemon.start()
    try:
        async with DataLanePeer(daemon.bound[1]) as peer:
            with pytest.raises(FailedPrecondition, match="no data lane"):
                await peer.fetch(ns(), [os.urandom(16)], [bytearray(BB)])
    finally:
        await daemon.stop(grace_s=0)


async def test_a_cancelled_peer_fetch_leaves_no_view_of_the_buffers_it_was_given(tmp_path, monkeypatch):
    """A peer's fetch cancelled while its lane waits: once the call is over, nothing
    holds the buffers it was given, not even a reference cycle through the exceptions of
    its threads (their frames hold the buffers), so a host tier can unmap the segment its
    slots are in. The collector is off meanwhile: only reference counting frees them."""
    import gc
    import mmap

    from kvstore.client.data_lane_peer import DataLanePeer
    from kvstore.hashing import block_hashes

    silent = SilentLane()
    daemon = Daemon(make_config(tmp_path, data_lane_advertise=(silent.address,)))
    await daemon.start()
    monkeypatch.setattr(daemon.gc_freezer, "maybe_freeze", lambda *args: False)
    segment = mmap.mmap(-1, 2 * BB)  # stands in for a host tier's segment
    try:
        async with AsyncClient(daemon.bound[1], data_plane="grpc") as kv:
            await kv.put(LAYOUT, tokens(2), blocks_for(2))
        hashes = block_hashes(LAYOUT.namespace_id, tokens(2), LAYOUT.block_size_tokens)
        gc.collect()
        gc.disable()
        try:
            async with DataLanePeer(daemon.bound[1], timeout_s=60) as peer:
                slots = [memoryview(segment)[i * BB : (i + 1) * BB] for i in range(2)]
                task = asyncio.create_task(peer.fetch(ns(), hashes, slots))
                del slots
                assert await asyncio.to_thread(silent.joined.wait, 10)  # the fetch waits on the lane now
                task.cancel()
                await asyncio.wait({task})
                assert task.cancelled()
                del task  # and with it the CancelledError, whose traceback holds the fetch's frames
            segment.close()  # a view of it left anywhere: BufferError
        finally:
            gc.enable()
    finally:
        await daemon.stop(grace_s=0)
        silent.close()


def test_a_lane_put_is_freed_once_done_without_the_garbage_collector(daemon_thread, monkeypatch):
    """A finished lane put (its slots, runs, events) is freed by reference counting once
    the connections that joined it let go: no reference cycle leaves it for the
    collector's full collections, which walk everything left over (a pool's forwards are
    such puts, hundreds of slots each). The collector is off meanwhile, the daemon's own
    collections too (its lease sweep's freeze)."""
    import gc

    from kvstore.server.data_lane.put import PutTransfer

    def alive() -> list[PutTransfer]:
        return [o for o in gc.get_objects() if type(o) is PutTransfer]  # (isinstance would ask proxies)

    monkeypatch.setattr(daemon_thread.daemon.gc_freezer, "maybe_freeze", lambda *args: False)
    gc.collect()
    gc.disable()
    try:
        assert alive() == []
        with Client(daemon_thread.tcp_target, data_plane="lane") as kv:
            for seed in range(3):
                assert kv.put(LAYOUT, tokens(12, 1000 * seed), blocks_for(12, seed=seed)).stored == 12
        for _ in range(300):  # bounded: 3 s, until the daemon saw the connections close
            if not alive():
                break
            time.sleep(0.01)
        assert alive() == [], "a finished lane put is left for the garbage collector"
    finally:
        gc.enable()


def test_small_frames_are_read_many_to_a_receive_and_long_ones_straight_in():
    """A lane connection reads short frames (headers, trailers, small blocks) through a
    receive buffer one system call fills with whatever arrived, and a long block straight
    into its destination: frames of any sizes, sent back to back, come out whole, each
    block with the checksum it was sent with."""
    a, b = socket.socketpair()
    with contextlib.closing(a), contextlib.closing(b):
        sender, receiver = LaneSocket(a, 5.0), LaneSocket(b, 5.0)
        blocks = [bytes([i]) * n for i, n in enumerate([256, 1, 4096, 300_000, 17, 256, 70_000])]
        transfer = b"t" * 16

        def send() -> None:
            sender.send_blocks(transfer, [(i, memoryview(x), checksum_of(x)) for i, x in enumerate(blocks[:3])])
            sender.send_blocks(transfer, [(3, memoryview(blocks[3]), checksum_of(blocks[3]))])
            sender.send_blocks(transfer, [(i + 4, memoryview(x), checksum_of(x)) for i, x in enumerate(blocks[4:])])
            sender.send_frame(END, transfer, block=len(blocks))

        t = threading.Thread(target=send)
        t.start()
        try:
            for i, want in enumerate(blocks):
                frame = receiver.read_frame(time.monotonic() + 5)
                assert (frame.kind, frame.block, frame.length) == (DATA, i, len(want))
                dest = bytearray(frame.length)
                got, sent = receiver.recv_block(memoryview(dest), time.monotonic() + 5)
                assert got == sent == checksum_of(want) and bytes(dest) == want
            assert receiver.read_frame(time.monotonic() + 5).kind == END
            assert receiver.buffered() == 0
        finally:
            t.join(10)


def test_an_idle_connection_drops_credit_read_ahead_and_nothing_else():
    """Frames received ahead with a transfer's last ones stay in the connection's
    buffer, out of a poll's sight: a pooled connection is still good with CREDIT frames
    there (dropped), and not with anything else."""
    from kvstore.client.data_lane import _alive

    for extra, alive in ((pack(CREDIT, b"t" * 16, 0, 0, 4096) * 2, True),
                         (pack(ERROR, b"t" * 16, 13, 0), False)):
        a, b = socket.socketpair()
        with contextlib.closing(a), contextlib.closing(b):
            sender, receiver = LaneSocket(a, 5.0), LaneSocket(b, 5.0)
            sender.send_frame(END, b"t" * 16, block=1)
            a.sendall(extra)
            time.sleep(0.05)
            assert receiver.read_frame(time.monotonic() + 5).kind == END
            assert receiver.buffered() == len(extra)
            assert _alive(receiver) is alive
            assert receiver.buffered() == 0


# Blocks of 256 B: small enough for many to go in one system call.
SMALL = KVLayout(model="test/lane-small", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64,
                 block_size_tokens=4)


def _sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of blocks of each `LaneSocket.send_blocks` from now on (both ends: the
    daemon runs in this process)."""
    calls: list[int] = []
    real = LaneSocket.send_blocks

    def counting(self, transfer, blocks, *codec):  # type: ignore[no-untyped-def]
        calls.append(len(blocks))
        return real(self, transfer, blocks, *codec)

    monkeypatch.setattr(LaneSocket, "send_blocks", counting)
    return calls


def test_a_fetch_of_small_blocks_sends_many_to_a_call(daemon_thread, monkeypatch):
    """Small blocks of a fetch go out as many DATA frames per system call as the credit
    and the batch allow, byte-exact."""
    calls = _sends(monkeypatch)
    want = [bytes([i % 251]) * SMALL.bytes_per_block for i in range(300)]
    toks = list(range(4 * 300))
    with Client(daemon_thread.tcp_target, data_plane="lane") as kv:
        kv.put(SMALL, toks, want)
        calls.clear()
        assert [bytes(g) for g in kv.fetch(SMALL, toks)] == want
    assert sum(calls) == 300 and max(calls) > 1 and len(calls) < 300 // 4


async def test_a_fetch_of_many_blocks_in_memory_lets_the_loop_serve_other_calls():
    """Blocks in host memory never make a fetch's pump wait, so it lets the event loop
    run between batches of them: other calls (an engine's lookups on the node that serves
    a pull) are not held up by all of a large fetch's blocks at once."""
    import grpc as grpc_mod

    from kvstore.core.fetch import ViewedBlock
    from kvstore.server.data_lane.fetch import PUMP_BATCH_BLOCKS, FetchTransfer
    from kvstore.server.data_lane.transfer import DataLaneCounters

    blocks = 5 * PUMP_BATCH_BLOCKS

    class InMemory:  # a fetch's stream whose blocks are all in host memory
        block_bytes = 16

        def view_batches(self, most):  # type: ignore[no-untyped-def]
            async def each():  # type: ignore[no-untyped-def]
                for start in range(0, blocks, most):
                    yield [ViewedBlock(memoryview(bytes([i % 251]) * 16), 0) for i in range(start, min(blocks, start + most))]
            return each()

        def close(self) -> None:
            pass

    loop = asyncio.get_running_loop()
    transfer = FetchTransfer(b"f" * 16, "default", time.monotonic() + 30, 1, loop, InMemory(), DataLaneCounters())
    seen: list[int] = []  # how many blocks were queued each time another task ran meanwhile

    async def other_calls() -> None:
        while len(transfer.ready) < blocks:
            seen.append(len(transfer.ready))
            await asyncio.sleep(0)

    others = asyncio.ensure_future(other_calls())
    pump = asyncio.ensure_future(transfer.pump())
    await asyncio.wait_for(others, 10)
    transfer.fail(grpc_mod.StatusCode.CANCELLED, "the test is done")  # no connection joins: end it
    await asyncio.wait_for(pump, 10)
    assert [n for n in seen if 0 < n < blocks] == [PUMP_BATCH_BLOCKS * k for k in range(1, 5)]
    assert transfer.counters.get("served_bytes_out") == blocks * 16


def test_a_put_of_small_blocks_sends_many_to_a_call(daemon_thread, monkeypatch):
    """A lane put's small blocks go out as many DATA frames per system call as its
    credit and the batch allow, and land byte-exact."""
    calls = _sends(monkeypatch)
    want = [bytes([(i + 7) % 251]) * SMALL.bytes_per_block for i in range(300)]
    toks = list(range(10_000, 10_000 + 4 * 300))
    with Client(daemon_thread.tcp_target, data_plane="lane") as kv:
        assert kv.put(SMALL, toks, want).stored == 300
        assert sum(calls) == 300 and max(calls) > 1 and len(calls) < 300 // 4
        assert [bytes(g) for g in kv.fetch(SMALL, toks)] == want


def test_small_blocks_received_whole_land_in_one_pass_and_a_bad_one_is_not_returned():
    """A fetch's small blocks that arrived together are taken from the receive buffer in
    one pass (`LaneSocket.buffered_blocks`): each lands byte-exact in its destination
    and is checked there against the checksum it came with; one whose bytes do not match
    ends the result before it and is counted, and a block sent twice is refused."""
    from kvstore.client.data_lane import DataLane, LaneEndpoint
    from kvstore.client.security import Security

    transfer = b"t" * 16
    blocks = [bytes([i]) * 256 for i in range(40)]

    def fetch(frames: bytes) -> tuple[int, list[bytes], DataLane]:
        a, b = socket.socketpair()
        with contextlib.closing(a), contextlib.closing(b):
            daemon, client = LaneSocket(a, 5.0), LaneSocket(b, 5.0)

            def serve() -> None:
                assert daemon.read_frame(time.monotonic() + 5).kind == FETCH
                a.sendall(frames)

            lane = DataLane(LaneEndpoint("unix", path="/nowhere"), Security())
            dests = [bytearray(256) for _ in blocks]
            t = threading.Thread(target=serve)
            t.start()
            try:
                got = lane.fetch_into([client], transfer, 256, [memoryview(d) for d in dests], 5.0)
            finally:
                t.join(10)
            return got, [bytes(d) for d in dests], lane

    def data(i: int, payload: bytes, sent_sum: int | None = None) -> bytes:
        s = checksum_of(payload) if sent_sum is None else sent_sum
        return pack(DATA, transfer, i, len(payload)) + payload + TRAILER.pack(s)

    calls: list[int] = []
    real = LaneSocket.buffered_blocks

    def counting(self, *args):  # type: ignore[no-untyped-def]
        out = real(self, *args)
        calls.append(len(out))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LaneSocket, "buffered_blocks", counting)
        whole = b"".join(data(i, x) for i, x in enumerate(blocks)) + pack(END, transfer, len(blocks))
        got, landed, lane = fetch(whole)
        assert got == 40 and landed == blocks
        assert max(calls) > 1 and sum(calls) <= 40  # many to a pass (the first frame is read the usual way)
        assert lane.stats().blocks_rejected == 0

        calls.clear()
        bad = b"".join(data(i, x, 12345 if i == 9 else None) for i, x in enumerate(blocks))
        got, landed, lane = fetch(bad + pack(END, transfer, len(blocks)))
        assert got == 9 and landed[:9] == blocks[:9] and max(calls) > 1
        assert lane.stats().blocks_rejected == 1

        twice = data(0, blocks[0]) + data(1, blocks[1]) + data(0, blocks[0]) + pack(END, transfer, 2)
        with pytest.raises(LaneClosed, match="sent block 0 twice"):
            fetch(twice)
