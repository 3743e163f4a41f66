"""Network benchmark: block bytes between two machines, kvstore's data lane next to the
limit of the link, kvstore's gRPC streams, a raw gRPC echo and Mooncake Store's TCP
transport, all in one run.

Two network namespaces joined by a veth pair stand in for two machines: every server
runs in one (a kvstore daemon, a raw-socket server, the gRPC echo server, a Mooncake
master and store), each client in the other (link `veth`); the same clients run inside
the server's namespace against 127.0.0.1 (link `loopback`); and once more across the
pair with both ends shaped to 10 Gbit/s by `tc ... tbf` (link `veth-10gbit`; netem is
not available here). For 1 MiB and 4 MiB blocks, batches of 32, over one and four client
connections (a batch split over the connections, moved at once), each system puts and
fetches the same payloads into and out of caller-owned buffers, and every byte fetched
is compared with what was put:

| system | what moves the bytes |
|---|---|
| socket-limit | plain Python sockets: `sendall` of each block, `recv_into` the destination (no framing, no checksum): the limit |
| kvstore-lane | the SDK's data lane (`data_plane="lane"`, `data_lane_connections=N`), each block verified as it lands |
| kvstore-lane-tls | the same over TLS (Python's ssl; loopback and veth only): what TLS costs |
| kvstore-grpc | the SDK's gRPC Put and Fetch streams (`data_plane="grpc"`), N clients |
| grpc-echo | raw grpc-python streams of the same messages, N channels (bench/echo_server.py): the gRPC ceiling |
| mooncake-tcp | Mooncake Store, client and store process on either side, TCP transport (bench/peers/mooncake_net.py) |

Results: bench/results/net.json (rows `system`, `op`, `block_bytes`, `connections`,
`link`, `gbps`) and bench/results/net.md (tables and the ratios against the targets).
Needs root (namespaces, veth, tc); everything made is removed at the end, on failure
too. Mooncake needs the peers' venv (--peer-python, `bench/install-peers.sh`); without
it its rows are left out and the report says so.

`--role small-fetch` runs none of that (no root, no namespaces): it prints, as JSON, the
median time of a lane fetch of 500 blocks of 256 bytes with the client and a daemon in
one process, the lane's work per block where the bytes cost nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from peers.common import timed  # noqa: E402

GB = 1e9
MIB = 1 << 20
BATCH = 32
SIZES = (MIB, 4 * MIB)
CONNECTIONS = (1, 4)
LINKS = ("loopback", "veth", "veth-10gbit")
SYSTEMS = ("socket-limit", "kvstore-lane", "kvstore-lane-tls", "kvstore-grpc", "grpc-echo", "mooncake-tcp")
SHAPED_RATE = "10gbit"
SHAPED_GBPS = 10e9 / 8 / GB
CLIENT_ADDR, SERVER_ADDR = "10.233.0.1", "10.233.0.2"
KVSTORE_PORT, KVSTORE_TLS_PORT, SOCKETS_PORT, MOONCAKE_PORT = 50051, 50052, 50061, 50151
REQUEST = struct.Struct("<cIQ")  # op (b"P" put / b"F" fetch), blocks, bytes per block


# ---------------------------------------------------------------------- timing


def cell(system: str, op: str, size: int, conns: int, link: str, seconds: float, calls: int,
         note: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"system": system, "op": op, "block_bytes": size, "connections": conns, "link": link,
                           "gbps": calls * BATCH * size / seconds / GB}
    if note:
        row["note"] = note
    return row


def split(conns: int) -> list[range]:
    """The blocks of a batch each connection moves."""
    share = BATCH // conns
    return [range(k * share, (k + 1) * share) for k in range(conns)]


def on_all(pool: ThreadPoolExecutor, conns: int, fn: Callable[[int], None]) -> None:
    """fn(k) for every connection k at once; the first error is raised."""
    for f in [pool.submit(fn, k) for k in range(conns)]:
        f.result()


# ---------------------------------------------------------------------- the limit


def sockets_server(port: int) -> int:
    """The raw-socket server: per request, receive (put) or send (fetch) the blocks."""
    listener = socket.create_server(("0.0.0.0", port), backlog=64)
    buffers: dict[int, bytearray] = {}
    print("ready", flush=True)

    def serve(conn: socket.socket) -> None:
        with conn:
            head = bytearray(REQUEST.size)
            while True:
                view = memoryview(head)
                got = 0
                while got < len(head):
                    k = conn.recv_into(view[got:])
                    if not k:
                        return
                    got += k
                op, blocks, size = REQUEST.unpack(head)
                buf = buffers.setdefault(size, bytearray(os.urandom(size)))
                block = memoryview(buf)
                for _ in range(blocks):
                    if op == b"P":
                        _recv_exact(conn, block)
                    else:
                        conn.sendall(block)
                if op == b"P":
                    conn.sendall(b"k")

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if not k:
            raise ConnectionError("closed")
        got += k


def client_socket_limit(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for size in args.sizes:
        src = [memoryview(np.random.randint(0, 255, size, dtype=np.uint8)) for _ in range(BATCH)]
        dst = [memoryview(np.empty(size, dtype=np.uint8)) for _ in range(BATCH)]
        for conns in args.connections:
            socks = [socket.create_connection((args.host, SOCKETS_PORT)) for _ in range(conns)]
            for s in socks:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            parts = split(conns)
            ack = bytearray(1)
            with ThreadPoolExecutor(conns) as pool:
                def put(_: int) -> None:
                    def one(k: int) -> None:
                        s = socks[k]
                        s.sendall(REQUEST.pack(b"P", len(parts[k]), size))
                        for i in parts[k]:
                            s.sendall(src[i])
                        _recv_exact(s, memoryview(ack))
                    on_all(pool, conns, one)

                def fetch(_: int) -> None:
                    def one(k: int) -> None:
                        s = socks[k]
                        s.sendall(REQUEST.pack(b"F", len(parts[k]), size))
                        for i in parts[k]:
                            _recv_exact(s, dst[i])
                    on_all(pool, conns, one)

                for op, fn in (("put", put), ("fetch", fetch)):
                    rows.append(cell("socket-limit", op, size, conns, args.link, *timed(fn, args.seconds),
                                     note="sendall / recv_into of each block, no framing or checksum"))
            for s in socks:
                s.close()
    return rows


# ---------------------------------------------------------------------- kvstore


def layout_for(size: int) -> Any:
    from kvstore.layout import KVLayout

    layout = KVLayout(model="bench/net", dtype="float16", num_layers=size // (2 * 16 * 8 * 128 * 2),
                      num_kv_heads=8, head_dim=128, block_size_tokens=16)
    assert layout.bytes_per_block == size, (layout.bytes_per_block, size)
    return layout


def client_kvstore(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvstore.client import Client

    tls = args.system == "kvstore-lane-tls"
    lane = args.system != "kvstore-grpc"
    port = KVSTORE_TLS_PORT if tls else KVSTORE_PORT
    target = f"{args.host}:{port}"
    rows = []
    for size in args.sizes:
        layout = layout_for(size)
        src = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(BATCH)]
        out = [np.empty(size, dtype=np.uint8) for _ in range(BATCH)]
        fixed = [os.urandom(16) for _ in range(BATCH)]
        for conns in args.connections:
            # The lane: one client whose transfers use `conns` connections. gRPC: `conns`
            # clients (channels), each moving its share of the batch.
            clients = [Client(target, token=args.token, data_plane="lane" if lane else "grpc",
                              data_lane_connections=conns, tls_ca=args.tls_ca if tls else None)
                       for _ in range(1 if lane else conns)]
            parts = [range(BATCH)] if lane else split(conns)
            fresh: list[list[bytes]] = []
            with ThreadPoolExecutor(len(clients)) as pool:
                def put(_: int) -> None:
                    hashes = [os.urandom(16) for _ in range(BATCH)]
                    fresh.append(hashes)

                    def one(k: int) -> None:
                        clients[k].put(layout, None, [src[i] for i in parts[k]],
                                       block_hashes=[hashes[i] for i in parts[k]])
                    on_all(pool, len(clients), one)

                def forget(_: int) -> None:
                    clients[0].delete(layout, block_hashes=fresh.pop())

                def fetch(_: int) -> None:
                    def one(k: int) -> None:
                        got = clients[k].fetch(layout, block_hashes=[fixed[i] for i in parts[k]],
                                               out=[out[i] for i in parts[k]])
                        if len(got) != len(parts[k]):
                            raise RuntimeError(f"{args.system} fetched {len(got)} of {len(parts[k])} blocks")
                    on_all(pool, len(clients), one)

                rows.append(cell(args.system, "put", size, conns, args.link, *timed(put, args.seconds, forget)))
                clients[0].put(layout, None, src, block_hashes=fixed)
                rows.append(cell(args.system, "fetch", size, conns, args.link, *timed(fetch, args.seconds)))
                for o, s in zip(out, src):
                    if not np.array_equal(o, s):
                        raise RuntimeError(f"{args.system} returned different bytes")
                clients[0].delete(layout, block_hashes=fixed)
                plane = clients[0].data_plane_in_use
                if plane != ("lane" if lane else "grpc"):
                    raise RuntimeError(f"{args.system} ran on the {plane} plane")
            for c in clients:
                c.close()
    return rows


def client_echo(args: argparse.Namespace) -> list[dict[str, Any]]:
    import grpc

    from kvstore.client._options import CHANNEL_OPTIONS, DEFAULT_CHUNK_BYTES

    ident = lambda b: b  # noqa: E731 - raw bytes on the wire
    chunk = DEFAULT_CHUNK_BYTES
    rows = []
    for size in args.sizes:
        src = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(BATCH)]
        out = [np.empty(size, dtype=np.uint8) for _ in range(BATCH)]
        header = bytes(32 + 19 * BATCH)
        for conns in args.connections:
            channels = [grpc.insecure_channel(f"{args.host}:{args.port}", options=CHANNEL_OPTIONS)
                        for _ in range(conns)]
            puts = [ch.stream_unary("/bench.Echo/Put", request_serializer=ident, response_deserializer=ident)
                    for ch in channels]
            fetches = [ch.unary_stream("/bench.Echo/Fetch", request_serializer=ident, response_deserializer=ident)
                       for ch in channels]
            parts = split(conns)
            with ThreadPoolExecutor(conns) as pool:
                def chunks(k: int) -> Iterator[bytes]:
                    yield header
                    for i in parts[k]:
                        v = memoryview(src[i])
                        for start in range(0, size, chunk):
                            yield bytes(v[start : start + chunk])  # one copy, as kvstore.wire's encoder

                def put(_: int) -> None:
                    on_all(pool, conns, lambda k: puts[k](chunks(k)))

                def fetch(_: int) -> None:
                    def one(k: int) -> None:
                        pieces = iter(fetches[k](header))
                        next(pieces)
                        for n, piece in enumerate(pieces):
                            block, off = divmod(n * min(chunk, size), size)
                            memoryview(out[parts[k][block]])[off : off + len(piece)] = piece
                    on_all(pool, conns, one)

                rows.append(cell("grpc-echo", "put", size, conns, args.link, *timed(put, args.seconds)))
                # The server returns the last put it got: the same share on every channel.
                puts[0](chunks(0))
                if conns > 1:
                    parts = [parts[0]] * conns
                rows.append(cell("grpc-echo", "fetch", size, conns, args.link, *timed(fetch, args.seconds)))
                for i in parts[0]:
                    if not np.array_equal(out[i], src[i]):
                        raise RuntimeError("grpc-echo returned different bytes")
            for ch in channels:
                ch.close()
    return rows


CLIENTS: dict[str, Callable[[argparse.Namespace], list[dict[str, Any]]]] = {
    "socket-limit": client_socket_limit, "kvstore-lane": client_kvstore, "kvstore-lane-tls": client_kvstore,
    "kvstore-grpc": client_kvstore, "grpc-echo": client_echo,
}


# ---------------------------------------------------------------------- the lane's cost per block

SMALL_FETCH_BLOCKS = 500
SMALL_FETCH_BYTES = 256


def small_fetch(rounds: int) -> dict[str, Any]:
    """`--role small-fetch`: a lane fetch of 500 blocks of 256 bytes, the SDK's client and a
    daemon in this one process, over loopback TCP. The bytes cost nothing here, so the time
    is the lane's per-block work on both ends (the daemon's checks and sends, the client's
    landing of each block): the figure docs/net.md and docs/cluster.md quote. The median of
    `rounds` fetches after one that opens the connections."""
    import asyncio

    from kvstore.client import Client
    from kvstore.layout import KVLayout
    from kvstore.server.config import load_config
    from kvstore.server.daemon import Daemon

    layout = KVLayout(model="bench/net-small", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=16,
                      block_size_tokens=4)
    assert layout.bytes_per_block == SMALL_FETCH_BYTES, layout.bytes_per_block
    tokens = list(range(SMALL_FETCH_BLOCKS * layout.block_size_tokens))
    blocks = [os.urandom(SMALL_FETCH_BYTES) for _ in range(SMALL_FETCH_BLOCKS)]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="daemon", daemon=True)
    thread.start()
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config({"listen": f"unix:{tmp}/kv.sock,127.0.0.1:0", "host_capacity": "64MiB",
                              "metrics_listen": "off", "grace_s": "1"}, env={})
        daemon = Daemon(config)
        asyncio.run_coroutine_threadsafe(daemon.start(), loop).result(60)
        try:
            with Client(daemon.bound[1], data_plane="lane") as kv:
                assert kv.put(layout, tokens, blocks).stored == SMALL_FETCH_BLOCKS
                times_ms = []
                for _ in range(rounds + 1):
                    began = time.perf_counter()
                    got = kv.fetch(layout, tokens)
                    times_ms.append((time.perf_counter() - began) * 1e3)
                    assert [bytes(b) for b in got] == blocks
                assert kv.data_plane_in_use == "lane"
        finally:
            asyncio.run_coroutine_threadsafe(daemon.stop(), loop).result(60)
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
    timed_ms = sorted(times_ms[1:])
    return {"measure": "lane fetch, client and daemon in one process", "blocks": SMALL_FETCH_BLOCKS,
            "block_bytes": SMALL_FETCH_BYTES, "rounds": rounds, "median_ms": round(float(np.median(timed_ms)), 2),
            "min_ms": round(timed_ms[0], 2), "max_ms": round(timed_ms[-1], 2), "cpus": os.cpu_count()}


# ---------------------------------------------------------------------- the two hosts


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=60)


class Hosts:
    """Two network namespaces joined by a veth pair; `close` removes them (and with them
    the pair and any shaping)."""

    def __init__(self) -> None:
        tag = f"kvb{os.getpid() % 100000}"
        self.client_ns, self.server_ns = f"{tag}c", f"{tag}s"
        self.client_dev, self.server_dev = f"{tag}x", f"{tag}y"
        self.made: list[str] = []

    def open(self) -> None:
        for ns in (self.client_ns, self.server_ns):
            run("ip", "netns", "add", ns)
            self.made.append(ns)
        run("ip", "link", "add", self.client_dev, "netns", self.client_ns, "type", "veth", "peer", "name",
            self.server_dev, "netns", self.server_ns)
        for ns, dev, addr in ((self.client_ns, self.client_dev, CLIENT_ADDR), (self.server_ns, self.server_dev,
                                                                               SERVER_ADDR)):
            run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")

    def shape(self, on: bool) -> None:
        """Both ends' egress limited to SHAPED_RATE (a token bucket), or not."""
        for ns, dev in ((self.client_ns, self.client_dev), (self.server_ns, self.server_dev)):
            if on:
                run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                    SHAPED_RATE, "burst", "8mb", "latency", "50ms")
            else:
                run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def close(self) -> None:
        for ns in self.made:
            # Anything of ours still running in it (a server that outlived its stop) goes too.
            for pid in run("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run("ip", "netns", "del", ns, check=False)
        self.made.clear()


class Servers:
    """The server processes, all in the server namespace; `close` ends every one."""

    def __init__(self, hosts: Hosts, workdir: Path) -> None:
        self.hosts = hosts
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.echo_port = 0
        self.token = ""
        self.tls_ca = ""
        self.mooncake = False

    def spawn(self, *cmd: str, log: str, stdout: int | None = None) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        with open(self.workdir / log, "wb") as fh:
            proc = subprocess.Popen(["ip", "netns", "exec", self.hosts.server_ns, *cmd], stdout=stdout or fh,
                                    stderr=fh, env=env, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def start(self, systems: set[str], peer_python: str) -> None:
        py = sys.executable
        if "socket-limit" in systems:
            proc = self.spawn(py, str(Path(__file__)), "--role", "sockets-server", log="sockets.log",
                              stdout=subprocess.PIPE)
            _expect_line(proc, "ready", "the socket server")
        if "grpc-echo" in systems:
            proc = self.spawn(py, str(ROOT / "bench" / "echo_server.py"), "0.0.0.0", log="echo.log",
                              stdout=subprocess.PIPE)
            self.echo_port = int(_expect_line(proc, "", "the gRPC echo server"))
        if systems & {"kvstore-lane", "kvstore-grpc", "kvstore-lane-tls"}:
            self._start_kvstore(py, "kvstore-lane-tls" in systems)
        if "mooncake-tcp" in systems and peer_python:
            driver = str(ROOT / "bench" / "peers" / "mooncake_net.py")
            master = run(peer_python, driver, "--role", "master-path").stdout.strip()
            # Started here, not by the store process, so that closing stops it whatever
            # becomes of the store.
            self.spawn(master, f"--rpc_address={SERVER_ADDR}", f"--rpc_port={MOONCAKE_PORT}",
                       f"--metrics_host={SERVER_ADDR}", "--metrics_port=0", "--enable_http_metadata_server=false",
                       log="mooncake-master.log")
            proc = self.spawn(peer_python, driver, "--role", "store", "--host", SERVER_ADDR, "--master-port",
                              str(MOONCAKE_PORT), log="mooncake.log", stdout=subprocess.PIPE)
            _expect_line(proc, "ready", "the Mooncake store", timeout_s=60)
            self.mooncake = True

    def _start_kvstore(self, py: str, tls: bool) -> None:
        from kvstore.server.auth import new_token

        self.token, client_hash = new_token()
        _, ops_hash = new_token()
        tokens = self.workdir / "tokens.toml"
        tokens.write_text(f'[[tenant]]\nname = "bench"\nrole = "client"\ntokens = ["{client_hash}"]\n'
                          f'local_plane = false\n\n[[tenant]]\nname = "ops"\nrole = "admin"\n'
                          f'tokens = ["{ops_hash}"]\n')
        os.chmod(tokens, 0o600)
        daemons = [(KVSTORE_PORT, [])]
        if tls and shutil.which("openssl"):
            daemons.append((KVSTORE_TLS_PORT, self._certificates()))
        for port, extra in daemons:
            sock = self.workdir / f"kv{port}.sock"
            self.spawn(py, "-m", "kvstore.cli", "serve", "--listen", f"unix:{sock},0.0.0.0:{port}",
                       "--data-lane-listen", "0.0.0.0:0", "--auth-token-file", str(tokens),
                       "--unix-socket-tenant", "ops", "--insecure-remote", "--host-capacity", "1GiB",
                       "--metrics-listen", "off", "--log-level", "warning", *extra, log=f"kvstore{port}.log")
            _wait_for_daemon(f"unix:{sock}")

    def _certificates(self) -> list[str]:
        d = self.workdir
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        run("openssl", "req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "1",
            "-subj", "/CN=kvstore bench CA")
        (d / "server.ext").write_text(f"subjectAltName=IP:127.0.0.1,IP:{SERVER_ADDR}\n")
        run("openssl", "req", *ec, "-keyout", str(d / "server.key"), "-out", str(d / "server.csr"), "-subj",
            "/CN=server")
        run("openssl", "x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.pem"), "-CAkey",
            str(d / "ca.key"), "-CAcreateserial", "-out", str(d / "server.pem"), "-days", "1", "-extfile",
            str(d / "server.ext"))
        os.chmod(d / "server.key", 0o600)
        self.tls_ca = str(d / "ca.pem")
        return ["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key")]

    def close(self) -> None:
        for proc in reversed(self.procs):  # clients of a server before it (Mooncake's store before its master)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def _expect_line(proc: subprocess.Popen[bytes], want: str, what: str, timeout_s: float = 30) -> str:
    """The first line `proc` prints (which must start with `want`)."""
    assert proc.stdout is not None
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline().decode().strip()),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not box or not box[0].startswith(want) or (not want and not box[0]):
        raise RuntimeError(f"{what} did not start (exit {proc.poll()}); see its log")
    return box[0]


def _wait_for_daemon(target: str, timeout_s: float = 60) -> None:
    from kvstore.client import Client

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with Client(target, timeout_s=2) as kv:
                text = kv.info("tiers")
            if "tier_host_prefaulted:no" not in text and "tier_host_prefaulted:running" not in text:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the kvstore daemon at {target} did not start")
        time.sleep(0.2)


# ---------------------------------------------------------------------- orchestration


def run_client(hosts: Hosts, servers: Servers, system: str, link: str, args: argparse.Namespace,
               workdir: Path) -> list[dict[str, Any]]:
    """One system's cells on one link, from a client process in the right namespace."""
    ns = hosts.server_ns if link == "loopback" else hosts.client_ns
    server = "127.0.0.1" if link == "loopback" else SERVER_ADDR
    out = workdir / f"{system}-{link}.json"
    sizes = ",".join(str(s) for s in args.sizes)
    conns = ",".join(str(c) for c in args.connections)
    if system == "mooncake-tcp":
        local = "127.0.0.1" if link == "loopback" else CLIENT_ADDR
        cmd = [args.peer_python, str(ROOT / "bench" / "peers" / "mooncake_net.py"), "--role", "client", "--host",
               local, "--master", f"{SERVER_ADDR}:{MOONCAKE_PORT}"]
    else:
        cmd = [sys.executable, str(Path(__file__)), "--role", "client", "--system", system, "--host", server,
               "--token", servers.token, "--tls-ca", servers.tls_ca, "--port", str(servers.echo_port)]
    cmd += ["--sizes", sizes, "--connections", conns, "--seconds", str(args.seconds), "--link", link,
            "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    print(f"  {link:12s} {system} ...", flush=True)
    done = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{system} on {link} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return list(json.loads(out.read_text())["results"])


def find(rows: list[dict[str, Any]], system: str, op: str, size: int, conns: int, link: str) -> float | None:
    for r in rows:
        if (r["system"], r["op"], r["block_bytes"], r["connections"], r["link"]) == (system, op, size, conns, link):
            return float(r["gbps"])
    return None


def checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets, cell by cell: the lane against the limit, gRPC's Fetch, Mooncake and
    the shaped link's rate."""
    out = []
    keys = sorted({(r["op"], r["block_bytes"], r["connections"], r["link"]) for r in rows if r["system"] ==
                   "kvstore-lane"}, key=lambda k: (LINKS.index(k[3]) if k[3] in LINKS else 9, k[1], k[2], k[0]))
    for op, size, conns, link in keys:
        lane = find(rows, "kvstore-lane", op, size, conns, link)
        assert lane is not None
        tests: list[tuple[str, float, float]] = []
        limit = find(rows, "socket-limit", op, size, conns, link)
        if limit:
            tests.append(("lane / socket-limit >= 0.8", lane / limit, 0.8))
        grpc_fetch = find(rows, "kvstore-grpc", "fetch", size, conns, link)
        if grpc_fetch and op == "fetch":
            tests.append(("lane / kvstore-grpc fetch >= 3", lane / grpc_fetch, 3.0))
        mooncake = find(rows, "mooncake-tcp", op, size, conns, link)
        if mooncake:
            tests.append(("lane / mooncake-tcp > 1", lane / mooncake, 1.0 + 1e-9))
        if link == "veth-10gbit":
            tests.append(("lane / 10 Gbit/s >= 0.9", lane / SHAPED_GBPS, 0.9))
        for name, ratio, want in tests:
            out.append({"op": op, "block_bytes": size, "connections": conns, "link": link, "check": name,
                        "ratio": round(ratio, 3), "met": ratio >= want})
    return out


def write_report(rows: list[dict[str, Any]], found: list[dict[str, Any]], notes: list[str], out_dir: Path,
                 elapsed_s: float, args: argparse.Namespace) -> Path:
    lines = ["# Bytes between two hosts: kvstore's data lane, its gRPC streams, a gRPC echo, Mooncake TCP",
             "", f"{platform.node()} ({os.cpu_count()} CPUs, {platform.platform()}), {time.strftime('%Y-%m-%d %H:%M')}"
             f"; batches of {BATCH}, {args.seconds:g} s per cell; run took {elapsed_s:.0f} s. "
             "GB/s = 10^9 bytes/s.", ""]
    lines += [f"- {n}" for n in notes]
    for link in LINKS:
        here = [r for r in rows if r["link"] == link]
        if not here:
            continue
        lines += ["", f"## {link}", "", "| system | op | block | conns | GB/s |", "|---|---|---|---|---|"]
        for r in sorted(here, key=lambda r: (r["block_bytes"], r["connections"], r["op"],
                                             SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else 9)):
            lines.append(f"| {r['system']} | {r['op']} | {r['block_bytes'] // MIB} MiB | {r['connections']} | "
                         f"{r['gbps']:.2f} |")
    if found:
        lines += ["", "## Targets", "", "| link | op | block | conns | check | ratio | met |",
                  "|---|---|---|---|---|---|---|"]
        for c in found:
            lines.append(f"| {c['link']} | {c['op']} | {c['block_bytes'] // MIB} MiB | {c['connections']} | "
                         f"{c['check']} | {c['ratio']:.2f} | {'yes' if c['met'] else 'NO'} |")
    tls = [(r, find(rows, "kvstore-lane", r["op"], r["block_bytes"], r["connections"], r["link"]))
           for r in rows if r["system"] == "kvstore-lane-tls"]
    if tls:
        lines += ["", "## What TLS costs the lane", "", "| link | op | block | conns | plain GB/s | TLS GB/s | TLS/plain |",
                  "|---|---|---|---|---|---|---|"]
        for r, plain in tls:
            if plain:
                lines.append(f"| {r['link']} | {r['op']} | {r['block_bytes'] // MIB} MiB | {r['connections']} | "
                             f"{plain:.2f} | {r['gbps']:.2f} | {r['gbps'] / plain:.2f} |")
    path = out_dir / "net.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def orchestrate(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bench/net.py needs root: it makes network namespaces, a veth pair and tc shaping", file=sys.stderr)
        return 2
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            print(f"bench/net.py needs `{tool}` (iproute2)", file=sys.stderr)
            return 2
    systems = set(args.systems)
    notes = []
    if "mooncake-tcp" in systems and not _has_mooncake(args.peer_python):
        notes.append("mooncake-tcp left out: no Mooncake in --peer-python (run bench/install-peers.sh)")
        systems.discard("mooncake-tcp")
        args.peer_python = ""
    if "kvstore-lane-tls" in systems and shutil.which("openssl") is None:
        notes.append("kvstore-lane-tls left out: no openssl CLI to make certificates")
        systems.discard("kvstore-lane-tls")
    notes.append("one and four client connections move a batch split between them, at once; kvstore-lane is "
                 "one client whose transfers use that many connections")
    notes.append(f"veth-10gbit: both ends of the pair shaped by `tc qdisc ... tbf rate {SHAPED_RATE}` "
                 f"({SHAPED_GBPS:.2f} GB/s)")
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    hosts = Hosts()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-net-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        stack.callback(hosts.close)  # last: the namespaces, with the pair and the shaping
        _interruptible(stack)
        hosts.open()
        servers = Servers(hosts, workdir)
        stack.callback(servers.close)
        servers.start(systems, args.peer_python)
        for link in args.links:
            print(f"link {link}", flush=True)
            hosts.shape(link == "veth-10gbit")
            for system in SYSTEMS:
                if system not in systems or (system == "kvstore-lane-tls" and (link == "veth-10gbit" or
                                                                              not servers.tls_ca)):
                    continue
                rows += run_client(hosts, servers, system, link, args, workdir)
            hosts.shape(False)
    elapsed = time.monotonic() - started
    found = checks(rows)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "net.json").write_text(json.dumps({
        "results": rows, "checks": found, "notes": notes, "elapsed_s": round(elapsed, 1),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
    }, indent=2))
    report = write_report(rows, found, notes, out_dir, elapsed, args)
    print(report.read_text())
    return 0


def _interruptible(stack: ExitStack) -> None:
    """SIGTERM unwinds like Ctrl-C, so the namespaces and processes go either way."""
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    stack.callback(signal.signal, signal.SIGTERM, previous)


def _has_mooncake(python: str) -> bool:
    if not python or not Path(python).exists():
        return False
    return subprocess.run([python, "-c", "import mooncake.store"], capture_output=True, timeout=60).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("run", "client", "sockets-server", "small-fetch"), default="run",
                        help="small-fetch: only the lane fetch of 500 blocks of 256 B in one process, as JSON")
    parser.add_argument("--rounds", type=int, default=30, help="small-fetch: fetches timed (default 30)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 MiB blocks, 0.3 s per cell")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per cell")
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="block sizes in bytes")
    parser.add_argument("--connections", default=",".join(str(c) for c in CONNECTIONS))
    parser.add_argument("--links", default=",".join(LINKS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--peer-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    # The client role's own arguments.
    parser.add_argument("--system", default="")
    parser.add_argument("--host", default="")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default="")
    parser.add_argument("--tls-ca", default="")
    parser.add_argument("--link", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s]
    args.connections = [int(c) for c in str(args.connections).split(",") if c]
    args.links = [s for s in str(args.links).split(",") if s]
    args.systems = [s for s in str(args.systems).split(",") if s]
    if args.quick:
        args.sizes, args.seconds = [MIB], min(args.seconds, 0.3)
    if args.role == "small-fetch":
        print(json.dumps(small_fetch(args.rounds)))
        return 0
    if args.role == "sockets-server":
        return sockets_server(SOCKETS_PORT)
    if args.role == "client":
        rows = CLIENTS[args.system](args)
        Path(args.out).write_text(json.dumps({"results": rows}))
        return 0
    unknown = set(args.links) - set(LINKS) or set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown: {', '.join(sorted(unknown))}")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
