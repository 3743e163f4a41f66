"""The local control lane against the real daemon over real sockets: the same answers
and the same errors as gRPC, the same auth, the peer-credential check, hostile frames,
the shared-memory plane's control calls, leases, metrics, and fallback to gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from conftest import daemon_in_thread, make_config

from kvstore.client import AsyncClient, Client
from kvstore.control_lane_wire import HEADER, HELLO_ANSWER, MAGIC, METHOD_IDS, frame, lane_path
from kvstore.convert import layout_to_proto
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.server.auth import new_token
from kvstore.v1 import kvstore_pb2


def blocks_for(layout, n, seed=0):
    return [bytes([(seed + i) % 251]) * layout.bytes_per_block for i in range(n)]


def lane_of(running) -> str:
    return lane_path(running.unix_target[len("unix:"):])


def rpc_count(running, method: str, code: str = "OK") -> float:
    value = running.daemon.metrics.registry.get_sample_value(
        "kvstore_rpc_duration_seconds_count", {"method": method, "code": code})
    return value or 0.0


def raw_conn(path: str, token: str = "") -> socket.socket:
    """A lane connection that has said hello."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(frame(0, MAGIC + token.encode()))
    code, payload = read_frame(sock)
    assert code == 0 and HELLO_ANSWER.unpack(payload)[0] == MAGIC
    return sock


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    def exact(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise EOFError("closed")
            out += chunk
        return out

    length, code = HEADER.unpack(exact(HEADER.size))
    return code, exact(length)


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# ------------------------------------------------------------------ the socket


def test_lane_socket_is_0600_and_goes_away_with_the_daemon(tmp_path):
    with daemon_in_thread(make_config(tmp_path)) as running:
        path = lane_of(running)
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert running.daemon.bound_lanes == [path]
    assert not os.path.exists(path)


def test_no_lane_when_turned_off(tmp_path, layout):
    with daemon_in_thread(make_config(tmp_path, local_lane=False)) as running:
        assert not os.path.exists(lane_of(running))
        with Client(running.unix_target) as kv:
            assert kv.control_plane_in_use == "grpc"
            kv.put(layout, list(range(8)), blocks_for(layout, 2))
            assert kv.lookup(layout, list(range(8))).num_blocks == 2
        with pytest.raises(FailedPrecondition, match="control lane"):
            Client(running.unix_target, control_plane="lane").lookup(layout, list(range(8)))
    with pytest.raises(InvalidArgument, match="Unix socket"):
        Client("127.0.0.1:1", control_plane="lane")


# ------------------------------------------------------------------ same answers


def test_lookup_is_identical_over_lane_and_grpc(daemon_thread, layout):
    tokens = list(range(4 * 40))
    with Client(daemon_thread.unix_target) as lane, \
         Client(daemon_thread.unix_target, control_plane="grpc") as rpc:
        assert lane.control_plane_in_use == "lane" and rpc.control_plane_in_use == "grpc"
        lane.put(layout, tokens[: 4 * 30], blocks_for(layout, 30))
        served = daemon_thread.daemon.lanes[0].calls
        hashes = lane.lookup(layout, tokens).block_hashes
        assert len(hashes) == 30
        other = [os.urandom(16) for _ in range(3)]
        for kwargs in ({"token_ids": tokens}, {"token_ids": tokens[:4]}, {"token_ids": tokens[:3]},
                       {"token_ids": list(range(1000, 1040))}, {"block_hashes": hashes},
                       {"block_hashes": hashes[:1]}, {"block_hashes": hashes[:5] + other},
                       {"block_hashes": other}):
            a, b = lane.lookup(layout, **kwargs), rpc.lookup(layout, **kwargs)
            assert a == b
        a = lane.lookup(layout, tokens, lease_ms=5000, session_id="s", expect_reuse_within_s=2.0)
        b = rpc.lookup(layout, tokens, lease_ms=5000, session_id="s", expect_reuse_within_s=2.0)
        assert a.lease_id and b.lease_id and a.lease_id != b.lease_id
        assert replace(a, lease_id="") == replace(b, lease_id="")
        assert daemon_thread.daemon.lanes[0].calls > served


def test_errors_have_the_same_codes_and_messages(daemon_thread, layout):
    with Client(daemon_thread.unix_target) as lane, \
         Client(daemon_thread.unix_target, control_plane="grpc") as rpc:
        lane.put(layout, list(range(8)), blocks_for(layout, 2))
        cases = [
            (NotFound, kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(id=os.urandom(16)),
                                                 keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=[1])))),
            (InvalidArgument, kvstore_pb2.LookupRequest(
                namespace=kvstore_pb2.Namespace(layout=layout_to_proto(layout)),
                keys=kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=[b"x" * 15])))),
            (InvalidArgument, kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(layout)))),
        ]
        for cls, request in cases:
            errors = []
            for kv in (lane, rpc):
                with pytest.raises(cls) as info:
                    kv._unary("Lookup", request, timeout=5)
                errors.append(str(info.value))
            assert errors[0] == errors[1]
        # An unknown transaction id, through the SDK's own commit call.
        for kv in (lane, rpc):
            with pytest.raises(FailedPrecondition, match="not open"):
                kv._unary("LocalCommit", kvstore_pb2.LocalCommitRequest(txn_id="nope", checksums=[1]), timeout=5)
        assert lane.control_plane_in_use == "lane"  # errors do not drop the lane
    assert rpc_count(daemon_thread, "Lookup", "INVALID_ARGUMENT") >= 4
    assert rpc_count(daemon_thread, "Lookup", "NOT_FOUND") >= 2


async def test_a_request_over_the_daemons_limit_is_refused_before_it_is_sent(tmp_path, layout):
    """The SDK refuses a request larger than the daemon accepts (its hello said how much)
    without sending it, and the lane stays in use for the next call."""
    too_many = [os.urandom(16) for _ in range((1 << 20) // 16 + 1)]
    with daemon_in_thread(make_config(tmp_path, max_message_bytes=1 << 20)) as running:
        with Client(running.unix_target, control_plane="lane") as kv:
            kv.put(layout, list(range(8)), blocks_for(layout, 2))
            for _ in range(2):
                with pytest.raises(ResourceExhausted, match="more than the daemon accepts"):
                    kv.lookup(layout, block_hashes=too_many)
            served = running.daemon.lanes[0].calls
            assert kv.lookup(layout, list(range(8))).num_blocks == 2
            assert running.daemon.lanes[0].calls == served + 1
        async with AsyncClient(running.unix_target, control_plane="lane") as akv:
            assert (await akv.lookup(layout, list(range(8)))).num_blocks == 2
            with pytest.raises(ResourceExhausted, match="more than the daemon accepts"):
                await akv.lookup(layout, block_hashes=too_many)
            served = running.daemon.lanes[0].calls
            assert (await akv.lookup(layout, list(range(8)))).num_blocks == 2
            assert running.daemon.lanes[0].calls == served + 1


async def test_async_client_over_the_lane(daemon, layout):
    tokens = list(range(4 * 16))
    async with AsyncClient(daemon.unix_target) as lane, \
            AsyncClient(daemon.unix_target, control_plane="grpc") as rpc:
        assert await lane.control_plane_in_use() == "lane"
        assert await rpc.control_plane_in_use() == "grpc"
        await lane.put(layout, tokens, blocks_for(layout, 16))
        assert [bytes(b) for b in await lane.fetch(layout, tokens)] == blocks_for(layout, 16)
        assert await lane.lookup(layout, tokens) == await rpc.lookup(layout, tokens)
        # Calls in flight together each get a connection; all answer right.
        results = await asyncio.gather(*(lane.lookup(layout, tokens[: 4 * (i % 16 + 1)]) for i in range(24)))
        assert [r.num_blocks for r in results] == [i % 16 + 1 for i in range(24)]
        with pytest.raises(InvalidArgument):
            await lane._unary("Lookup", kvstore_pb2.LookupRequest(), timeout=5)
    assert daemon.daemon.lanes[0].calls >= 27


# ------------------------------------------------------------------ the data plane's control calls


def test_shared_memory_round_trip_runs_its_control_calls_on_the_lane(daemon_thread, layout):
    tokens = list(range(4 * 8))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(8)]
    before = {m: rpc_count(daemon_thread, m) for m in ("LocalSegment", "LocalPut", "LocalCommit", "LocalFetch")}
    lane_calls = daemon_thread.daemon.lanes[0].calls
    with Client(daemon_thread.unix_target, data_plane="local", reserve_ahead=8) as kv:
        assert kv.control_plane_in_use == "lane" and kv.data_plane_in_use == "local"
        assert kv.put(layout, tokens[:16], blocks[:4]).stored == 4
        assert kv.put(layout, tokens, blocks[4:], first_block=4).stored == 4  # one trip: reserved slots
        assert [bytes(b) for b in kv.fetch(layout, tokens)] == blocks
        out = [bytearray(layout.bytes_per_block) for _ in range(8)]
        assert kv.fetch(layout, tokens, out=out) == out and [bytes(b) for b in out] == blocks
    with Client(daemon_thread.unix_target, control_plane="grpc", data_plane="grpc") as rpc:
        assert [bytes(b) for b in rpc.fetch(layout, tokens)] == blocks
    assert daemon_thread.daemon.lanes[0].calls - lane_calls >= 6
    # Counted like gRPC calls, under the same method names.
    assert rpc_count(daemon_thread, "LocalSegment") == before["LocalSegment"] + 1
    assert rpc_count(daemon_thread, "LocalPut") == before["LocalPut"] + 1
    assert rpc_count(daemon_thread, "LocalCommit") >= before["LocalCommit"] + 2
    assert rpc_count(daemon_thread, "LocalFetch") == before["LocalFetch"] + 2


def test_leases_taken_over_the_lane_behave_as_over_grpc(daemon_thread, layout):
    tokens = list(range(4 * 4))
    store = daemon_thread.store
    with Client(daemon_thread.unix_target) as lane, \
         Client(daemon_thread.unix_target, control_plane="grpc") as rpc:
        lane.put(layout, tokens, blocks_for(layout, 4))
        active = store.stats().leases_active
        looked = lane.lookup(layout, tokens, lease_ms=60_000)
        pinned = lane.pin(layout, tokens, ttl_ms=60_000)
        assert looked.lease_id and pinned.pinned == 4
        assert store.stats().leases_active == active + 2
        # Either transport ends a lease the other took.
        assert rpc.unpin(looked.lease_id) is True
        assert lane.unpin(pinned.lease_id) is True
        assert lane.unpin(pinned.lease_id) is False
        assert store.stats().leases_active == active
        # A fetch under a lookup lease taken on the lane, over gRPC bytes.
        looked = lane.lookup(layout, tokens, lease_ms=60_000)
        got = rpc.fetch(layout, tokens, lease_id=looked.lease_id)
        assert [bytes(b) for b in got] == blocks_for(layout, 4)


# ------------------------------------------------------------------ auth


@pytest.fixture
def token_file(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    tokens: dict[str, str] = {}
    entries = []
    for name, extra in (("alpha", "local_plane = true\n"), ("beta", "")):
        token, token_hash = new_token()
        tokens[name] = token
        entries.append(f'[[tenant]]\nname = "{name}"\nrole = "client"\ntokens = ["{token_hash}"]\n{extra}')
    path = tmp_path / "tokens.toml"
    path.write_text("\n".join(entries))
    os.chmod(path, 0o600)
    return path, tokens


def test_auth_on_the_lane_matches_grpc(tmp_path, layout, token_file):
    path, tokens = token_file
    with daemon_in_thread(make_config(tmp_path, auth_token_file=str(path))) as running:
        target = running.unix_target
        for plane in ("auto", "grpc"):
            # No token, a wrong token: UNAUTHENTICATED either way.
            with Client(target, control_plane=plane, data_plane="grpc") as kv:
                with pytest.raises(Unauthenticated):
                    kv.lookup(layout, list(range(4)))
            with Client(target, control_plane=plane, data_plane="grpc", token="kvs_wrong") as kv:
                with pytest.raises(Unauthenticated):
                    kv.lookup(layout, list(range(4)))
            # A tenant without local_plane: PERMISSION_DENIED for the local plane's calls.
            with Client(target, control_plane=plane, token=tokens["beta"]) as kv:
                kv.put(layout, list(range(8)), blocks_for(layout, 2))  # falls back to gRPC bytes
                assert kv.data_plane_in_use == "grpc"
                with pytest.raises(PermissionDenied, match="local_plane"):
                    kv._unary("LocalSegment", kvstore_pb2.LocalSegmentRequest(), timeout=5)
        # Tenants see only their own blocks, over the lane as over gRPC.
        with Client(target, token=tokens["alpha"]) as alpha, Client(target, token=tokens["beta"]) as beta:
            assert alpha.control_plane_in_use == "lane"
            alpha.put(layout, list(range(8)), blocks_for(layout, 2))
            assert alpha.lookup(layout, list(range(8))).num_blocks == 2
            assert beta.lookup(layout, list(range(8))).num_blocks == 2  # its own put above
            assert beta.lookup(layout, list(range(100, 108))).num_blocks == 0
            # A lease id taken by one tenant is no lease for the other.
            lease = alpha.lookup(layout, list(range(8)), lease_ms=60_000).lease_id
            assert beta.unpin(lease) is False
            assert alpha.unpin(lease) is True
            # The per-tenant cap on calls in flight applies on the lane (the in-flight count
            # is set as if the tenant had that many calls running).
            running.daemon.auth.in_flight["alpha"] = running.daemon.config.max_calls_per_tenant
            try:
                with pytest.raises(ResourceExhausted, match="calls in flight"):
                    alpha.lookup(layout, list(range(8)))
            finally:
                running.daemon.auth.in_flight.pop("alpha")
            # Revoking a token ends it on connections already open.
            path.write_text(path.read_text().replace(
                next(line for line in path.read_text().splitlines() if line.startswith("tokens")), 'tokens = ["sha256:'
                + "00" * 16 + ":" + "00" * 32 + '"]', 1))
            os.chmod(path, 0o600)
            assert running.daemon.reload_tokens()
            with pytest.raises(Unauthenticated):
                alpha.lookup(layout, list(range(8)))
            assert beta.lookup(layout, list(range(8))).num_blocks == 2


def test_unix_socket_tenant_applies_to_the_lane(tmp_path, layout, token_file):
    path, _ = token_file
    config = make_config(tmp_path, auth_token_file=str(path), unix_socket_tenant="alpha")
    with daemon_in_thread(config) as running:
        with Client(running.unix_target) as kv:
            assert kv.control_plane_in_use == "lane"
            kv.put(layout, list(range(8)), blocks_for(layout, 2))
            assert kv.data_plane_in_use == "local"  # alpha may use the local plane
            assert kv.lookup(layout, list(range(8))).num_blocks == 2


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_another_uid_is_refused(tmp_path, layout):
    with daemon_in_thread(make_config(tmp_path)) as running:
        path = lane_of(running)
        # Loosen the file modes as a careless operator might: the peer check still holds.
        # (The child enters the socket's directory before it drops to another uid, so the
        # test's private parent directories need not change.)
        os.chmod(os.path.dirname(path), 0o711)
        os.chmod(path, 0o666)
        script = (
            "import os, socket, struct, sys\n"
            "os.chdir(os.path.dirname(sys.argv[1]))\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(os.path.basename(sys.argv[1]))\n"
            "data = b''\n"  # the daemon answers before any hello, and hangs up
            "while True:\n"
            "    c = s.recv(4096)\n"
            "    if not c: break\n"
            "    data += c\n"
            "print(data[4], data[5:].decode())\n"
        )
        out = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        code, _, message = out.stdout.strip().partition(" ")
        assert int(code) == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert "uid 65534" in message
        with Client(running.unix_target) as kv:  # still serving its own uid
            assert kv.control_plane_in_use == "lane"
            assert kv.lookup(layout, list(range(4))).num_blocks == 0


# ------------------------------------------------------------------ hostile frames


def test_garbage_and_oversize_frames_are_refused_and_the_lane_keeps_serving(daemon_thread, layout):
    path = lane_of(daemon_thread)
    with contextlib.ExitStack() as stack:
        check_hostile_frames(path, layout, stack)
    with Client(daemon_thread.unix_target) as kv:
        assert kv.control_plane_in_use == "lane"
        kv.put(layout, list(range(8)), blocks_for(layout, 2))
        assert kv.lookup(layout, list(range(8))).num_blocks == 2


def check_hostile_frames(path: str, layout, stack: contextlib.ExitStack) -> None:
    def conn(hello: bool = True) -> socket.socket:
        if hello:
            return stack.enter_context(raw_conn(path))
        sock = stack.enter_context(socket.socket(socket.AF_UNIX))
        sock.settimeout(10)
        sock.connect(path)
        return sock

    # Not a hello.
    sock = conn(hello=False)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    code, message = read_frame(sock)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"hello" in message
    assert closed(sock)
    # A hello with the wrong magic.
    sock = conn(hello=False)
    sock.sendall(frame(0, b"NOPE"))
    assert read_frame(sock)[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # A frame announcing 2 GiB: refused at once, without waiting for (or allocating) it.
    sock = conn()
    sock.sendall(HEADER.pack(0x7FFF_FFFF, METHOD_IDS["Lookup"]))
    code, message = read_frame(sock)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and b"max_message_bytes" in message
    assert closed(sock)
    # An unknown method and a request that does not parse: answered, connection kept.
    sock = conn()
    sock.sendall(frame(250, b"\x00\x01"))
    assert read_frame(sock)[0] == grpc.StatusCode.UNIMPLEMENTED.value[0]
    sock.sendall(frame(METHOD_IDS["Lookup"], b"\xff\xff\xff"))
    assert read_frame(sock)[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    request = kvstore_pb2.LookupRequest(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(layout)),
                                        keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=[1, 2, 3, 4])))
    sock.sendall(frame(METHOD_IDS["Lookup"], request.SerializeToString()))
    code, payload = read_frame(sock)
    assert code == 0 and kvstore_pb2.LookupResponse.FromString(payload).num_blocks == 0
    # A peer that hangs up mid-frame.
    half = conn()
    half.sendall(HEADER.pack(100, METHOD_IDS["Lookup"]) + b"\x0a")
    half.close()


def test_pipelined_calls_are_answered_in_order_when_one_waits(daemon_thread, layout):
    """Frames sent back to back on one connection: a Verify (which waits for its checksums
    on a worker thread, so it cannot answer at once) and Lookups behind it. The answers
    come back in the order of the calls, each the right one."""
    layout = replace(layout, block_bytes=256 << 10)  # large enough to be checksummed off the loop
    tokens = list(range(layout.block_size_tokens * 3))
    with Client(daemon_thread.unix_target, data_plane="grpc") as kv:
        kv.put(layout, tokens, blocks_for(layout, 3))
    ns = kvstore_pb2.Namespace(layout=layout_to_proto(layout))
    keys = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))
    verify = frame(METHOD_IDS["Verify"], kvstore_pb2.VerifyRequest(namespace=ns, keys=keys).SerializeToString())
    lookups = [kvstore_pb2.LookupRequest(namespace=ns, keys=kvstore_pb2.BlockKeys(
        tokens=kvstore_pb2.TokenIds(token_ids=tokens[: n * layout.block_size_tokens]))) for n in (1, 2, 3)]
    with contextlib.closing(raw_conn(lane_of(daemon_thread))) as sock:
        for _ in range(3):
            sock.sendall(verify + b"".join(frame(METHOD_IDS["Lookup"], r.SerializeToString()) for r in lookups)
                         + verify)
            code, payload = read_frame(sock)
            assert code == 0 and kvstore_pb2.VerifyResponse.FromString(payload).verified == 3
            for n in (1, 2, 3):
                code, payload = read_frame(sock)
                assert code == 0 and kvstore_pb2.LookupResponse.FromString(payload).num_blocks == n
            code, payload = read_frame(sock)
            assert code == 0 and kvstore_pb2.VerifyResponse.FromString(payload).verified == 3


def test_frames_of_any_size_arriving_in_any_pieces_are_read_whole(tmp_path, layout):
    """The lane reads into a buffer of its own: frames many reads long, frames cut
    anywhere (down to single bytes), and many frames in one read all come out whole; the
    connection keeps serving small frames after a large one (its buffer, grown past
    RECEIVE_KEEP for it, is then dropped)."""
    from kvstore.server.control_lane import RECEIVE_KEEP

    hashes = [os.urandom(16) for _ in range(3)]
    with daemon_in_thread(make_config(tmp_path, max_blocks_per_call=100_000)) as running:
        with Client(running.unix_target, data_plane="grpc") as kv:
            kv.put(layout, None, blocks_for(layout, 3), block_hashes=hashes)
        ns = kvstore_pb2.Namespace(layout=layout_to_proto(layout))

        def lookup(chain: list[bytes]) -> bytes:
            keys = kvstore_pb2.BlockKeys(packed_hashes=b"".join(chain), packed_reply=True)
            return frame(METHOD_IDS["Lookup"], kvstore_pb2.LookupRequest(namespace=ns, keys=keys).SerializeToString())

        large = lookup(hashes + [os.urandom(16) for _ in range(80_000)])
        assert len(large) > RECEIVE_KEEP
        small = [lookup(hashes[:n]) for n in (1, 2, 3)]
        with contextlib.closing(raw_conn(lane_of(running))) as sock:
            def answers(expected: list[int]) -> None:
                for n in expected:
                    code, payload = read_frame(sock)
                    assert code == 0, payload
                    resp = kvstore_pb2.LookupResponse.FromString(payload)
                    assert resp.num_blocks == n and resp.block_hashes_packed == b"".join(hashes[:n])

            sock.sendall(large)
            answers([3])
            # One byte at a time, across a frame boundary.
            pair = small[0] + small[1]
            for i in range(len(small[0]) + 5):
                sock.sendall(pair[i:i + 1])
            sock.sendall(pair[len(small[0]) + 5:])
            answers([1, 2])
            # Large frames in uneven pieces, with small frames around them in the same reads.
            stream = small[2] + large + small[0] + small[1] + large + small[2]
            cuts = [0, 7, len(small[2]) + 3, 70_000, 700_000, len(large) + 50, 2_000_000, len(stream)]
            for lo, hi in zip(cuts, cuts[1:]):
                sock.sendall(stream[lo:hi])
            answers([3, 3, 1, 2, 3, 3])


def test_request_limits_are_the_same_as_over_grpc(tmp_path, layout):
    config = make_config(tmp_path, max_tokens_per_call=64, max_blocks_per_call=8)
    with daemon_in_thread(config) as running:
        with Client(running.unix_target) as lane, Client(running.unix_target, control_plane="grpc") as rpc:
            for kv in (lane, rpc):
                with pytest.raises(InvalidArgument, match="max_tokens_per_call"):
                    kv.lookup(layout, list(range(65)))
                with pytest.raises(InvalidArgument, match="limit is 8"):
                    kv.lookup(layout, block_hashes=[os.urandom(16) for _ in range(9)])
            assert lane.control_plane_in_use == "lane"


# ------------------------------------------------------------------ fallback


def test_a_lane_that_goes_away_falls_back_to_grpc(tmp_path, layout):
    # As in the CLI: writing to the dead connection must be an error, not a SIGPIPE.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    with daemon_in_thread(make_config(tmp_path)) as running:
        with Client(running.unix_target) as kv:
            kv.put(layout, list(range(8)), blocks_for(layout, 2))
            assert kv.control_plane_in_use == "lane"
            lane = running.daemon.lanes[0]
            loop = running.daemon._sweeper.get_loop()  # the daemon's event loop
            asyncio.run_coroutine_threadsafe(lane.close(), loop).result(10)
            # The pooled connection is dead and no new one can be made: gRPC answers.
            assert kv.lookup(layout, list(range(8))).num_blocks == 2
            assert kv.control_plane_in_use == "grpc"
        with Client(running.unix_target, control_plane="lane") as kv:
            with pytest.raises(FailedPrecondition, match="control lane"):
                kv.lookup(layout, list(range(8)))



async def test_drain_refuses_new_lane_calls_but_lets_a_local_put_commit(daemon, layout):
    """As over gRPC: once shutdown begins, new calls on the lane are refused with
    UNAVAILABLE, but a co-located client's commit of a put it is copying is accepted."""
    d = daemon.daemon
    tokens = list(range(layout.block_size_tokens * 2))
    payload = memoryview(os.urandom(layout.bytes_per_block))
    async with AsyncClient(daemon.unix_target, control_plane="lane") as kv:
        plane = await kv._local()
        assert plane is not None
        header = kvstore_pb2.PutHeader(
            namespace=kvstore_pb2.Namespace(layout=layout_to_proto(layout)),
            keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens)))
        begun = await kv._unary("LocalPut", kvstore_pb2.LocalPutRequest(header=header), timeout=10)
        stop = asyncio.create_task(d.stop(grace_s=10))
        for _ in range(1000):
            if d._gate.closed:
                break
            await asyncio.sleep(0.01)
        assert d._gate.closed, "the drain never began"
        with pytest.raises(Unavailable, match="shutting down"):
            await kv.lookup(layout, tokens)
        sums = plane.copy_in(begun.offsets, [payload, payload])
        committed = await kv._unary("LocalCommit", kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, checksums=sums),
                                    timeout=10)
        assert committed.stored == 2
        await stop
    assert rpc_count(daemon, "Lookup", "UNAVAILABLE") == 1
    assert not os.path.exists(lane_of(daemon))


async def test_a_call_that_suspends_is_answered_before_what_it_scheduled_runs(daemon, layout):
    """A call that suspends is finished by a task, which writes its answer in the step the
    call returns in: a callback the call scheduled on its way out (a pool's lookup starts
    its pulls that way) finds the answer already on the socket. Written from a done
    callback instead, the answer would follow that callback by a loop turn."""
    (lane,) = [s for s in daemon.daemon.lanes if not s.tcp]
    method = lane._methods[METHOD_IDS["Lookup"]]
    real = method.handler
    seen: list[bytes] = []
    sock = await asyncio.to_thread(raw_conn, lane_of(daemon))
    sock.setblocking(False)  # `look` must not wait for the answer (it would wait on the loop)

    async def suspending(request, context):
        await asyncio.sleep(0)  # suspends: the lane hands the call to a task
        answer = await real(request, context)

        def look() -> None:  # what is on the client's socket, without taking it
            try:
                seen.append(sock.recv(HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT))
            except BlockingIOError:
                seen.append(b"")

        asyncio.get_running_loop().call_soon(look)
        return answer

    method.handler = suspending
    try:
        with contextlib.closing(sock):
            tokens = list(range(layout.block_size_tokens * 2))
            ns = kvstore_pb2.Namespace(layout=layout_to_proto(layout))
            request = kvstore_pb2.LookupRequest(namespace=ns, keys=kvstore_pb2.BlockKeys(
                tokens=kvstore_pb2.TokenIds(token_ids=tokens)))
            await asyncio.get_running_loop().sock_sendall(sock, frame(METHOD_IDS["Lookup"], request.SerializeToString()))
            for _ in range(2000):  # bounded: 10 s
                if seen:
                    break
                await asyncio.sleep(0.005)
            assert seen, "the call's callback never ran"
            assert len(seen) == 1 and len(seen[0]) == HEADER.size, "the answer was not on the socket yet"
            sock.settimeout(10)
            code, payload = await asyncio.to_thread(read_frame, sock)
            assert code == 0 and kvstore_pb2.LookupResponse.FromString(payload).num_blocks == 0
    finally:
        method.handler = real


async def test_a_lane_calls_pipeline_ends_once_after_its_answer(daemon, layout):
    """A call leaves its tenant's in-flight count before its answer is written, and its
    metrics (the in-flight gauge, the duration) are recorded once it is: exactly once per
    call, whether it answered at once, suspended, failed, or was given up when its client
    went away while it waited."""
    d = daemon.daemon
    (lane,) = [s for s in d.lanes if not s.tcp]
    method = lane._methods[METHOD_IDS["Lookup"]]
    real = method.handler
    steps = method.steps
    during: list[int] = []
    never = asyncio.Event()

    async def counting(request, context):
        during.append(steps.in_flight.n)
        if request.lease_ms == 7:
            await asyncio.sleep(0)  # suspends: answered by a task
        if request.lease_ms == 9:
            await never.wait()  # its client goes away first
        return await real(request, context)

    ns = kvstore_pb2.Namespace(layout=layout_to_proto(layout))
    tokens = list(range(layout.block_size_tokens * 2))

    def lookup(lease_ms: int = 0, bad: bool = False) -> bytes:
        keys = kvstore_pb2.BlockKeys(packed_hashes=b"x" * 5) if bad else \
            kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))
        return frame(METHOD_IDS["Lookup"], kvstore_pb2.LookupRequest(namespace=ns, keys=keys,
                                                                     lease_ms=lease_ms).SerializeToString())

    async def settled() -> None:
        for _ in range(2000):  # bounded: 10 s
            if steps.in_flight.n == 0 and not d.auth.in_flight:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"calls still in flight: {steps.in_flight.n}, {d.auth.in_flight}")

    method.handler = counting
    try:
        ok, bad = rpc_count(daemon, "Lookup"), rpc_count(daemon, "Lookup", "INVALID_ARGUMENT")
        cancelled = rpc_count(daemon, "Lookup", "CANCELLED")
        sock = await asyncio.to_thread(raw_conn, lane_of(daemon))
        with contextlib.closing(sock):
            for request in (lookup(), lookup(7), lookup(bad=True)):
                await asyncio.to_thread(sock.sendall, request)
                code, _ = await asyncio.to_thread(read_frame, sock)
                assert code == (3 if request == lookup(bad=True) else 0)
                await settled()
        assert rpc_count(daemon, "Lookup") == ok + 2
        assert rpc_count(daemon, "Lookup", "INVALID_ARGUMENT") == bad + 1
        sock = await asyncio.to_thread(raw_conn, lane_of(daemon))
        await asyncio.to_thread(sock.sendall, lookup(9))
        for _ in range(2000):  # bounded: 10 s, until the call waits in the handler
            if len(during) == 4:
                break
            await asyncio.sleep(0.005)
        assert steps.in_flight.n == 1
        sock.close()
        await settled()
        assert rpc_count(daemon, "Lookup", "CANCELLED") == cancelled + 1
        assert during == [1, 1, 1, 1]  # each call found only itself in flight: the ones before had ended
    finally:
        method.handler = real
