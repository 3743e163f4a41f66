"""Connection floods against a daemon with few file descriptors: more idle connections
than its whole open-file limit, on TCP and on the control lane, silent or past their
handshake, must leave it serving health checks and calls within a deadline, close the
idle connections by themselves, and keep its log small (docs/operations.md, "Connection
limits")."""

from __future__ import annotations

import os
import re
import resource
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from conftest import daemon_in_thread, make_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import AsyncClient, Client
from kvstore.control_lane_wire import HELLO, MAGIC, frame, lane_path
from kvstore.server.daemon import Daemon
from tests import procs
from tests.polling import eventually, wait_until

FD_LIMIT = 128
SILENT_EACH = 200  # on each plane, more than the daemon's whole descriptor limit
GREETED_EACH = 40
HANDSHAKE_TIMEOUT_S = 1
IDLE_S = 2
SERVE_DEADLINE_S = 20.0
CLOSE_DEADLINE_S = 30.0
MAX_LOG_LINES = 60
# /proc/net/unix's state of a connected socket (a listening one is 01).
SS_CONNECTED = "03"
# The client's HTTP/2 connection preface and an empty SETTINGS frame: what a gRPC client
# sends first, after which the connection is past its handshake.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _low_fd_limit(args: list[str]) -> list[str]:
    """`args` run under an open-file limit of FD_LIMIT, set by a wrapper that execs them
    (not a preexec_fn: Popen would fork() instead of vfork(), and fork() runs the gRPC
    library's fork handlers, which can wait forever for its threads)."""
    wrapper = ("import os, resource, sys\n"
               f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT}))\n"
               "os.execv(sys.argv[1], sys.argv[1:])\n")
    return [sys.executable, "-c", wrapper, *args]


def _open(connect: Callable[[], socket.socket], count: int, first: bytes = b"") -> list[socket.socket]:
    """Up to `count` connections (a full accept queue ends the run early), each sent `first`."""
    out = []
    for _ in range(count):
        try:
            sock = connect()
        except OSError:
            break
        out.append(sock)
        if first:
            try:
                sock.sendall(first)
            except OSError:
                break
    return out


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass  # a GOAWAY, a refusal frame: then the end
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _lane_connections(path: str) -> int:
    """Connections the daemon holds open on the control lane at `path`. The kernel lists
    each Unix socket with the path it is bound to, and the daemon's end of an accepted
    connection carries its listener's path (a client's end carries none), so these are the
    connected sockets under `path`; one the daemon has closed is gone from the list."""
    with open("/proc/net/unix") as table:
        next(table)  # Num RefCount Protocol Flags Type St Inode Path
        rows = [line.split(None, 7) for line in table]
    return sum(1 for row in rows if len(row) == 8 and row[7].rstrip("\n") == path and row[5] == SS_CONNECTED)


def _health(target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.e2e
@pytest.mark.slow
def test_idle_connections_past_the_descriptor_limit_leave_the_daemon_serving(tmp_path: Path, layout):
    sock = tmp_path / "kv.sock"
    log = tmp_path / "daemon.log"
    args = procs.daemon_args(sock, "--host-capacity", "16MiB", "--no-host-prefault")
    args[args.index("--listen") + 1] = f"unix:{sock},127.0.0.1:0"
    args[args.index("--log-level") + 1] = "info"
    env = {"KVSTORE_HANDSHAKE_TIMEOUT_S": str(HANDSHAKE_TIMEOUT_S), "KVSTORE_CONNECTION_IDLE_S": str(IDLE_S)}
    proc = procs.start(_low_fd_limit(args), sock, log, env=env)
    flood: list[socket.socket] = []
    try:
        found = re.search(r"serving on [^\n]*?127\.0\.0\.1:(\d+)", log.read_text())  # gRPC first, data lanes last
        assert found, log.read_text()
        tcp = ("127.0.0.1", int(found.group(1)))
        lane = lane_path(str(sock))

        def to_lane() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(1)
                s.connect(lane)
            except BaseException:
                s.close()
                raise
            return s

        # Past their handshake first (they fill what the daemon holds), then silent ones.
        flood += _open(lambda: socket.create_connection(tcp, timeout=1), GREETED_EACH, HTTP2_PREFACE)
        flood += _open(to_lane, GREETED_EACH, frame(HELLO, MAGIC))
        time.sleep(0.5)
        flood += _open(lambda: socket.create_connection(tcp, timeout=1), SILENT_EACH)
        flood += _open(to_lane, SILENT_EACH)
        assert len(flood) > FD_LIMIT

        tokens = list(range(layout.block_size_tokens * 2))

        def lookup(target: str, plane: str) -> None:
            with Client(target, timeout_s=2, control_plane=plane) as kv:
                assert kv.lookup(layout, tokens).num_blocks == 0

        checks: dict[str, Callable[[], None]] = {
            "health over TCP": lambda: _health(f"{tcp[0]}:{tcp[1]}"),
            "health over the Unix socket": lambda: _health(f"unix:{sock}"),
            "Lookup over TCP": lambda: lookup(f"{tcp[0]}:{tcp[1]}", "grpc"),
            "Lookup over the lane": lambda: lookup(f"unix:{sock}", "lane"),
        }
        served: dict[str, float] = {}
        start = time.monotonic()
        while len(served) < len(checks) and time.monotonic() - start < SERVE_DEADLINE_S:
            for name, check in checks.items():
                if name not in served:
                    try:
                        check()
                    except Exception:  # refused or timed out under the flood: try again
                        continue
                    served[name] = time.monotonic() - start
            time.sleep(0.1)
        assert set(served) == set(checks), f"within {SERVE_DEADLINE_S:g}s only {served}"

        # Nothing the flood opened stays open: over the cap at once, silent ones after the
        # handshake timeout, greeted ones once idle.
        start = time.monotonic()
        while time.monotonic() - start < CLOSE_DEADLINE_S:
            open_now = [s for s in flood if not _closed_by_peer(s)]
            if not open_now:
                break
            time.sleep(0.5)
        assert not open_now, f"{len(open_now)} of {len(flood)} idle connections still open"
        assert proc.alive()
    finally:
        for s in flood:
            s.close()
        code = proc.stop()
    lines = log.read_text(errors="replace").splitlines()
    assert len(lines) <= MAX_LOG_LINES, "\n".join(lines[:20] + ["..."] + lines[-20:])
    assert code == 0


@pytest.mark.e2e
@pytest.mark.slow
def test_accept_out_of_descriptors_pauses_quietly_and_recovers(tmp_path: Path, layout):
    # Caps keep a daemon below its limit; lower the limit under a running daemon to make
    # accept() itself fail, as other files filling the descriptor table would.
    sock = tmp_path / "kv.sock"
    log = tmp_path / "daemon.log"
    args = procs.daemon_args(sock, "--host-capacity", "16MiB", "--no-host-prefault")
    proc = procs.start(_low_fd_limit(args), sock, log)
    flood: list[socket.socket] = []
    try:
        lines_before = len(log.read_text().splitlines())
        in_use = len(os.listdir(f"/proc/{proc.pid}/fd"))
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (in_use + 2, FD_LIMIT))
        lane = lane_path(str(sock))
        for _ in range(50):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(lane)
            except BlockingIOError:
                s.close()
                break
            flood.append(s)
        time.sleep(3)
        assert proc.alive()
        out_of_fds = len(log.read_text(errors="replace").splitlines()) - lines_before
        assert out_of_fds <= 5, log.read_text(errors="replace")[-3000:]

        for s in flood:
            s.close()
        flood.clear()
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
        start = time.monotonic()
        while True:
            try:
                with Client(f"unix:{sock}", timeout_s=2, control_plane="lane") as kv:
                    assert kv.lookup(layout, list(range(layout.block_size_tokens))).num_blocks == 0
                break
            except Exception:
                if time.monotonic() - start > SERVE_DEADLINE_S:
                    raise
                time.sleep(0.2)
    finally:
        for s in flood:
            s.close()
        code = proc.stop()
    assert code == 0


IDLE_CLOSE_S = 1.0


def test_clients_carry_on_when_the_daemon_closes_their_idle_connections(tmp_path: Path, layout):
    # Lane connections idle past connection_idle_s are closed; the next call, not safe to
    # repeat (a shared-memory put's LocalPut), goes out on a new connection.
    tokens = list(range(layout.block_size_tokens * 2))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(2)]
    with daemon_in_thread(make_config(tmp_path, connection_idle_s=IDLE_CLOSE_S)) as running:
        lane = lane_path(running.unix_target.removeprefix("unix:"))
        with Client(running.unix_target, control_plane="lane") as kv:  # a lane failure raises
            assert kv.lookup(layout, tokens).num_blocks == 0
            assert _lane_connections(lane) >= 1  # the client's, pooled
            wait_until(lambda: _lane_connections(lane) == 0, "the daemon closed the idle lane connections")
            assert kv.put(layout, tokens, blocks).stored == 2
            assert kv.control_plane_in_use == "lane" and kv.data_plane_in_use == "local"
            assert kv.fetch(layout, tokens) == blocks


async def test_async_clients_carry_on_when_the_daemon_closes_their_idle_connections(tmp_path: Path, layout):
    tokens = list(range(layout.block_size_tokens * 2))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(2)]
    daemon = Daemon(make_config(tmp_path, connection_idle_s=IDLE_CLOSE_S))
    await daemon.start()
    try:
        lane = lane_path(daemon.bound[0].removeprefix("unix:"))
        async with AsyncClient(daemon.bound[0], control_plane="lane") as kv:
            assert (await kv.lookup(layout, tokens)).num_blocks == 0
            assert _lane_connections(lane) >= 1

            async def closed() -> bool:
                return _lane_connections(lane) == 0

            await eventually(closed, "the daemon closed the idle lane connections")
            assert (await kv.put(layout, tokens, blocks)).stored == 2
            assert await kv.control_plane_in_use() == "lane" and await kv.data_plane_in_use() == "local"
            assert await kv.fetch(layout, tokens) == blocks
    finally:
        await daemon.stop(grace_s=0)
