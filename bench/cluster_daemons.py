"""Cluster benchmark, parts 2 and 3: real daemons (processes of their own) on this host.

Part 2, remote lookup latency (`remote_lookup`): two daemons A and B in a static pool, each
in a network namespace of its own joined to the other's by a veth pair (as two machines
would be; on loopback TCP where namespaces cannot be made, and the result says so), and
two more, S and S2, alone (cluster off), all with the default settings (the
lookup deadline is 5 ms) but one: the pool is timed in its steady state, so A and B get a
grace of `STEADY_GRACE_S` after they join, waited out before the timed part (in the grace
after a member change a node also asks each unit's previous owners, and plans its round
from what it holds before sending it). Chains of 1,000 blocks in 4 namespaces (layouts) are put on B,
which forwards the units A owns (about half: rendezvous over two members) and keeps the
rest. Then, chain by chain, in the same run and over each daemon's Unix socket (the
local control lane, the path a co-located engine takes):

* `remote`: the first lookup of the chain on A, which holds about half of it and asks B
  for the rest in one call (the answer says which blocks are remote);
* `local`: the same chain looked up on A again once the fetch that followed copied B's
  part (the chain is all local: no peer is asked), with the cluster on;
* `single`: the same chain on S, a daemon with the cluster off;
* `single_2`: the same chain on S2, a second daemon with the cluster off, given the same
  puts and lookups as S: how far two identical single nodes differ in the same run (the
  noise a "within noise" comparison is judged against);
* the three local rows time the same work: S and S2 are also asked to fetch the chain
  first (a fetch's slots are let go by the client's next call on that daemon, so each
  row's first lookup carries that), and the rows take turns at going first in each of
  the three rounds of timed lookups per chain;
* `owner_put`: the chain's put on B with `wait_for_owners` (answered once A committed
  the units it owns), next to `single_put`, the same put on S;
* `round_trip`: a bare request of a peer lookup's size (8 KiB) to a process that answers
  with 16 bytes (`EchoFloor`: an asyncio server, as the daemons are), from A's namespace
  to B's over the same veth pair (or on loopback): what one process-to-process round
  trip costs on A's link to B. A remote lookup takes two
  of them where a local one takes one;
* `steal_pct`: the share of this machine's CPU time the hypervisor took while the
  chains ran (/proc/stat "steal"; 0 on bare metal): a virtual CPU taken away for a
  while stops whichever daemon it ran, so the p99s are only as steady as this.

Part 3, failover (`failover`): three daemons on a real etcd (lease TTL 2 s), eight client
threads on A and C putting, looking up and fetching chains (each fetched block compared
with what was put), one of them computing and putting the tail of a chain the pool
missed, as an engine would. B is killed with SIGKILL part-way; the run reports the hit
ratio, lookups and client errors per second, wrong bytes, and how long until B had left
A's and C's views.

Primitives: `DaemonProcess`, `LinkedHosts`, `EtcdProcess`, `remote_lookup`, `failover`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.errors import KVStoreError
from kvstore.hashing import block_hashes, namespace_id
from kvstore.layout import KVLayout

START_TIMEOUT_S = 30.0
CHAIN_BLOCKS = 1000
STEADY_GRACE_S = 2.0  # part 2: A's and B's grace after they join (see the module docstring)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Run first in each child: SIGTERM when the bench process dies, however it dies (a killed
# bench must not leave daemons or etcd running; Linux only, elsewhere nothing), then exec
# the command. Not a `preexec_fn`: that makes Popen fork() rather than vfork(), and fork()
# runs the gRPC library's fork handlers, which can wait forever for its own threads (the
# admin clients' timer thread): the bench once hung there starting its third daemon.
_DIE_WITH_PARENT = (
    "import os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def _dying_with_parent(args: Sequence[str]) -> list[str]:
    """`args` (a command, its path first) run so that it dies with this process."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return env


class DaemonProcess:
    """`kvstore serve` in a process of its own, on a Unix socket and a loopback port."""

    def __init__(self, workdir: Path, name: str, *flags: str, host: tuple[LinkedHosts, int] | None = None) -> None:
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = free_port()
        self.sock = self.dir / "kv.sock"
        self.flags = flags
        # In a network namespace of its own (`LinkedHosts`), on its address there; else on
        # loopback. The bench reaches it on its Unix socket either way.
        self.host = host
        self.address = host[0].addresses[host[1]] if host is not None else "127.0.0.1"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"unix:{self.sock}"

    @property
    def tcp(self) -> str:
        return f"{self.address}:{self.port}"

    def wait_out_grace(self, timeout_s: float = 30.0) -> None:
        """Until its pool's grace after a member change (its own join) is over."""
        deadline = time.monotonic() + timeout_s
        with AdminClient(self.target, timeout_s=2) as admin:
            while admin.cluster_status().in_grace:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon {self.name} still in its grace after {timeout_s:g} s")
                time.sleep(0.1)

    def start(self, *more: str) -> DaemonProcess:
        args = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix:{self.sock},{self.tcp}",
                "--metrics-listen", "off", "--log-level", "warning", "--grace-s", "1", *self.flags, *more]
        if self.host is not None:
            hosts, i = self.host
            # Off loopback a daemon needs a token file: the bench is the Unix socket's admin
            # tenant, the pool's daemons present the peer credential to each other.
            args = hosts.command(i, [*args, "--auth-token-file", str(hosts.tokens), "--unix-socket-tenant", "bench",
                                     "--insecure-remote", "--cluster-token-file", str(hosts.peer_token)])
        with open(self.dir / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(_dying_with_parent(args), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=_env())
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited: {(self.dir / 'daemon.log').read_text()[-2000:]}")
            if self.sock.exists():
                try:
                    with AdminClient(self.target, timeout_s=2) as admin:
                        admin.stats()
                    return self
                except KVStoreError:
                    pass
            time.sleep(0.05)
        self.kill9()
        raise RuntimeError(f"daemon {self.name} did not start in {START_TIMEOUT_S:g}s")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._remove_segments()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._remove_segments()

    def _remove_segments(self) -> None:
        if self.proc is not None:
            for seg in Path("/dev/shm").glob(f"kvstore-{self.proc.pid}-*"):
                with contextlib.suppress(OSError):
                    seg.unlink()


CLONE_NEWNET = 0x40000000


class LinkedHosts:
    """Two network namespaces joined by a veth pair, standing in for two machines (part 2's
    A and B: the pair bench/net.py makes), with a token file for daemons listening there.
    Needs root and `ip` (`unavailable` says why not); `close` removes everything made, on
    failure too."""

    def __init__(self, workdir: Path) -> None:
        from net import CLIENT_ADDR, SERVER_ADDR, Hosts

        from kvstore.server.auth import entry_text, new_token

        self._pair = Hosts()
        try:
            self._pair.open()
        except BaseException:
            self._pair.close()
            raise
        self.names = [self._pair.client_ns, self._pair.server_ns]
        self.addresses = [CLIENT_ADDR, SERVER_ADDR]
        self._ip = shutil.which("ip") or "ip"  # a path: `_dying_with_parent` execs it
        peer, peer_hash = new_token()
        _, bench_hash = new_token()
        self.tokens = workdir / "tokens.toml"
        self.tokens.write_text(entry_text("bench", "admin", bench_hash) + "local_plane = true\n\n"
                               + entry_text("pool", "peer", peer_hash))
        self.peer_token = workdir / "peer.token"
        self.peer_token.write_text(peer + "\n")
        for path in (self.tokens, self.peer_token):
            os.chmod(path, 0o600)

    @staticmethod
    def unavailable() -> str | None:
        """Why two namespaces cannot be made here (None: they can)."""
        if not sys.platform.startswith("linux"):
            return "network namespaces are Linux's"
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2)"
        return None

    def command(self, i: int, args: Sequence[str]) -> list[str]:
        return [self._ip, "netns", "exec", self.names[i], *args]

    @contextlib.contextmanager
    def entered(self, i: int) -> Iterator[None]:
        """This thread in host `i`'s network namespace (a socket made here stays in it)."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/run/netns/{self.names[i]}", os.O_RDONLY)
            try:
                if libc.setns(target, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {self.names[i]}")
            finally:
                os.close(target)
            try:
                yield
            finally:
                if libc.setns(own, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back")
        finally:
            os.close(own)

    def close(self) -> None:
        self._pair.close()


class EtcdProcess:
    """Debian's etcd on loopback free ports, its data in a temporary directory."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed: run scripts/install-etcd.sh (make bench-cluster runs it)")
        self.client_port, peer_port = free_port(), free_port()
        data = workdir / "etcd"
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{peer_port}"
        env = dict(os.environ)
        if os.uname().machine in ("aarch64", "arm64"):
            env["ETCD_UNSUPPORTED_ARCH"] = "arm64"
        with open(workdir / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(_dying_with_parent(
                [binary, "--name", "bench", "--data-dir", str(data), "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"bench={peer}", "--logger", "zap", "--log-level", "warn"]),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except (OSError, ValueError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("etcd did not become healthy")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvstore-bench-cluster-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _layouts(count: int) -> list[KVLayout]:
    return [KVLayout(model=f"bench/cluster-{i}", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=16,
                     block_size_tokens=4) for i in range(count)]


def _payloads(layout: KVLayout, n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, layout.bytes_per_block * n, dtype=np.uint8).tobytes()
    b = layout.bytes_per_block
    return [data[i * b : (i + 1) * b] for i in range(n)]


def _tokens(seed: int, n_blocks: int, bst: int) -> list[int]:
    base = seed * 7_919_999
    return [(base + i) % 4_000_000_000 for i in range(n_blocks * bst)]


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


ECHO_REQUEST_BYTES = 8 << 10
_ECHO_SERVER = """
import asyncio, struct, sys
class P(asyncio.Protocol):
    def connection_made(self, t):
        self.t, self.buf = t, bytearray()
    def data_received(self, d):
        self.buf += d
        while len(self.buf) >= 4:
            (n,) = struct.unpack_from("<I", self.buf)
            if len(self.buf) < 4 + n:
                return
            del self.buf[: 4 + n]
            self.t.write(struct.pack("<I", 16) + bytes(16))
async def main():
    server = await asyncio.get_running_loop().create_server(P, sys.argv[1], 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


class EchoFloor:
    """A bare asyncio process answering each framed request with 16 bytes over TCP
    (TCP_NODELAY): the round-trip floor of two processes, on the path A and B use (on
    loopback, or from A's namespace to an echo process in B's)."""

    def __init__(self, hosts: LinkedHosts | None = None) -> None:
        command = [sys.executable, "-c", _ECHO_SERVER, hosts.addresses[1] if hosts is not None else "127.0.0.1"]
        if hosts is not None:
            command = hosts.command(1, command)
        self.proc = subprocess.Popen(_dying_with_parent(command), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        if hosts is not None:
            with hosts.entered(0):
                self.sock = socket.create_connection((hosts.addresses[1], port), timeout=5)
        else:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.request = ECHO_REQUEST_BYTES.to_bytes(4, "little") + bytes(ECHO_REQUEST_BYTES)

    def round_trip_us(self) -> float:
        t = time.perf_counter()
        self.sock.sendall(self.request)
        got = 0
        while got < 20:
            chunk = self.sock.recv(20 - got)
            if not chunk:
                raise RuntimeError("the echo process closed the connection")
            got += len(chunk)
        return (time.perf_counter() - t) * 1e6

    def stop(self) -> None:
        self.sock.close()
        self.proc.terminate()
        self.proc.wait(10)


@dataclass
class _Row:
    """One of part 2's local rows: the daemon it looks up on, and its timings."""
    client: Client
    times: list[float]


def remote_lookup(chains: int, namespaces: int = 4, unit_blocks: int = 0, link: str = "auto") -> dict[str, Any]:
    """Part 2 (see the module docstring). `unit_blocks`: the pool's placement unit (0: the
    default). `link`: "veth" (A and B in two network namespaces), "loopback", or "auto"
    (veth where namespaces can be made, else loopback, and the result says why)."""
    units = ("--cluster-unit-blocks", str(unit_blocks)) if unit_blocks else ()
    why_not = LinkedHosts.unavailable() if link != "loopback" else "asked for loopback"
    if link == "veth" and why_not:
        raise RuntimeError(f"part 2 across namespaces: {why_not}")
    from scale import cpu_ticks, steal_pct  # (bench/scale.py: the same reading of /proc/stat)

    with _workdir() as work:
        hosts = LinkedHosts(work) if why_not is None else None
        a = DaemonProcess(work, "a", "--host-capacity", "1GiB", *units, host=(hosts, 0) if hosts else None)
        b = DaemonProcess(work, "b", "--host-capacity", "1GiB", *units, host=(hosts, 1) if hosts else None)
        s = DaemonProcess(work, "s", "--host-capacity", "1GiB")
        s2 = DaemonProcess(work, "s2", "--host-capacity", "1GiB")
        peers = f"a={a.tcp},b={b.tcp}"
        echo = None
        try:
            grace = ("--cluster-grace-s", str(STEADY_GRACE_S))
            a.start("--cluster", "--cluster-peers", peers, "--node-id", "a", *grace)
            b.start("--cluster", "--cluster-peers", peers, "--node-id", "b", *grace)
            s.start()
            s2.start()
            echo = EchoFloor(hosts)
            layouts = _layouts(namespaces)
            remote_us: list[float] = []
            local_us: list[float] = []
            single_us: list[float] = []
            single2_us: list[float] = []
            trip_us: list[float] = []
            owner_put_us: list[float] = []
            single_put_us: list[float] = []
            remote_share: list[float] = []
            remote_fetch_us: list[float] = []  # A's fetch right after the remote lookup (it joins the pull)
            single_fetch_us: list[float] = []  # S's fetch of the same chain, all of it there
            complete = wrong = 0
            with Client(a.target) as ka, Client(b.target) as kb, Client(s.target) as ks, \
                    Client(s2.target) as ks2:
                # Warm-up: A's channel to B, and a first lookup on each daemon (not measured).
                warm = layouts[0]
                tok = _tokens(0, 64, warm.block_size_tokens)
                kb.put(warm, tok, _payloads(warm, 64, 0), wait_for_owners=True)
                for _ in range(3):
                    ka.lookup(warm, tok)
                    ka.fetch(warm, tok)
                    ks.lookup(warm, tok)
                    ks2.lookup(warm, tok)
                    echo.round_trip_us()
                for d in (a, b):
                    d.wait_out_grace()
                rows = [_Row(ka, local_us), _Row(ks, single_us), _Row(ks2, single2_us)]
                gc_before = {d.name: _gc_of(d) for d in (a, b, s, s2)}
                ticks = cpu_ticks()
                # This process's own collector stays out of the timings: paused while they
                # run, and run between chains, outside them (the same for all three rows).
                with _collector_paused():
                    for i in range(chains):
                        gc.collect()
                        layout = layouts[i % len(layouts)]
                        tok = _tokens(i + 1, CHAIN_BLOCKS, layout.block_size_tokens)
                        hashes = block_hashes(namespace_id(layout), tok, layout.block_size_tokens)
                        blocks = _payloads(layout, CHAIN_BLOCKS, i + 1)
                        t = time.perf_counter()
                        kb.put(layout, tok, blocks, wait_for_owners=True)
                        owner_put_us.append((time.perf_counter() - t) * 1e6)
                        t = time.perf_counter()
                        ks.put(layout, tok, blocks)
                        single_put_us.append((time.perf_counter() - t) * 1e6)
                        ks2.put(layout, tok, blocks)
                        t = time.perf_counter()
                        hit = ka.lookup(layout, block_hashes=hashes)
                        remote_us.append((time.perf_counter() - t) * 1e6)
                        complete += hit.num_blocks == CHAIN_BLOCKS
                        remote_share.append(hit.remote_blocks / CHAIN_BLOCKS)
                        t = time.perf_counter()
                        got = ka.fetch(layout, block_hashes=hashes)  # joins the copy of B's part
                        remote_fetch_us.append((time.perf_counter() - t) * 1e6)
                        wrong += sum(bytes(g) != blocks[k] for k, g in enumerate(got))
                        for _ in range(20):  # a lookup that missed its deadline copied less: again
                            if len(got) == CHAIN_BLOCKS:
                                break
                            ka.lookup(layout, block_hashes=hashes)
                            got = ka.fetch(layout, block_hashes=hashes)
                            wrong += sum(bytes(g) != blocks[k] for k, g in enumerate(got))
                        # S and S2 serve the calls A served: a fetch of the chain (whose
                        # slots' lease the client's next call on each daemon ends), so the
                        # three local rows time the same work.
                        t = time.perf_counter()
                        ks.fetch(layout, block_hashes=hashes)
                        single_fetch_us.append((time.perf_counter() - t) * 1e6)
                        ks2.fetch(layout, block_hashes=hashes)
                        for r in range(3):
                            # The rows take turns at going first (the one that follows the
                            # bench's own work after the fetches).
                            first = (i + r) % len(rows)
                            for row in rows[first:] + rows[:first]:
                                t = time.perf_counter()
                                again = row.client.lookup(layout, block_hashes=hashes)
                                if row.times is not local_us or (again.num_blocks == CHAIN_BLOCKS
                                                                 and again.remote_blocks == 0):
                                    row.times.append((time.perf_counter() - t) * 1e6)
                            trip_us.append(echo.round_trip_us())
                steal = steal_pct(ticks, cpu_ticks())
                gc_during = {d.name: _gc_delta(gc_before[d.name], _gc_of(d)) for d in (a, b, s, s2)}
                with AdminClient(a.target) as admin:
                    text = admin.info("cluster")
            asked = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        finally:
            if echo is not None:
                echo.stop()
            for d in (a, b, s, s2):
                d.stop()
            if hosts is not None:
                hosts.close()
    single_p99, single2_p99 = _pct(single_us, 0.99), _pct(single2_us, 0.99)
    return {
        # What joins A and B (and the round trip's two ends): a veth pair between two
        # network namespaces, or loopback (`link_note`: why).
        "link": "veth" if why_not is None else "loopback", "link_note": why_not or "",
        "chains": chains, "chain_blocks": CHAIN_BLOCKS, "namespaces": namespaces, "unit_blocks": unit_blocks or None,
        "lookup_deadline_ms": 5.0, "block_bytes": layouts[0].bytes_per_block,
        "complete_answers": complete, "wrong_blocks": wrong,
        "remote_share_mean": round(statistics.fmean(remote_share), 3) if remote_share else 0.0,
        "remote_lookup_p50_us": round(_pct(remote_us, 0.50), 1), "remote_lookup_p99_us": round(_pct(remote_us, 0.99), 1),
        "local_lookup_p50_us": round(_pct(local_us, 0.50), 1), "local_lookup_p99_us": round(_pct(local_us, 0.99), 1),
        "single_node_lookup_p50_us": round(_pct(single_us, 0.50), 1),
        "single_node_lookup_p99_us": round(single_p99, 1),
        "single_node_2_lookup_p50_us": round(_pct(single2_us, 0.50), 1),
        "single_node_2_lookup_p99_us": round(single2_p99, 1),
        # Noise: how far apart two identical single nodes' p99 are in this run, as a ratio.
        "single_nodes_p99_ratio": round(max(single_p99, single2_p99) / max(1e-9, min(single_p99, single2_p99)), 2),
        "local_vs_single_p99_ratio": round(_pct(local_us, 0.99) / max(1e-9, single_p99), 2),
        "round_trip_request_bytes": ECHO_REQUEST_BYTES,
        "round_trip_p50_us": round(_pct(trip_us, 0.50), 1), "round_trip_p99_us": round(_pct(trip_us, 0.99), 1),
        "steal_pct": round(steal, 1),
        "peer_rounds_on_a": int(asked.get("cluster_remote_lookups", "0")),
        # The chain's put on B, answered once A committed its units (wait_for_owners),
        # next to the same put on S (cluster off).
        # The fetch that follows the remote lookup (it waits for the copy of B's half),
        # next to the same fetch on S (cluster off, the whole chain there).
        "remote_fetch_p50_us": round(_pct(remote_fetch_us, 0.50), 1),
        "remote_fetch_p99_us": round(_pct(remote_fetch_us, 0.99), 1),
        "single_fetch_p50_us": round(_pct(single_fetch_us, 0.50), 1),
        "single_fetch_p99_us": round(_pct(single_fetch_us, 0.99), 1),
        "owner_put_p50_us": round(_pct(owner_put_us, 0.50), 1), "owner_put_p99_us": round(_pct(owner_put_us, 0.99), 1),
        "single_put_p50_us": round(_pct(single_put_us, 0.50), 1),
        "single_put_p99_us": round(_pct(single_put_us, 0.99), 1),
        # Each daemon's garbage collections while the chains ran (INFO's server section):
        # a, b the pool's two nodes; s, s2 the single daemons.
        "gc_during": gc_during,
    }


def _gc_of(d: DaemonProcess) -> dict[str, float]:
    with AdminClient(d.target) as admin:
        text = admin.info("server")
    return {k: float(v) for k, v in (line.split(":", 1) for line in text.splitlines() if line.startswith("gc_gen"))
            if not k.endswith("_longest_pause_ms")}


def _gc_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Collections and pause time by generation between two readings, and their total."""
    out: dict[str, float] = {}
    for g in range(3):
        out[f"gen{g}_collections"] = after.get(f"gc_gen{g}_collections", 0) - before.get(f"gc_gen{g}_collections", 0)
        out[f"gen{g}_pause_ms"] = round(after.get(f"gc_gen{g}_pause_ms", 0) - before.get(f"gc_gen{g}_pause_ms", 0), 1)
    out["pause_ms"] = round(sum(out[f"gen{g}_pause_ms"] for g in range(3)), 1)
    return out


@dataclass
class _Second:
    asked: int = 0
    hit: int = 0
    lookups: int = 0
    errors: int = 0


@dataclass
class _Load:
    seconds: dict[int, _Second] = field(default_factory=dict)
    wrong_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def second(self, t: float) -> _Second:
        k = int(t)
        sec = self.seconds.get(k)
        if sec is None:
            sec = self.seconds[k] = _Second()
        return sec


def _client(target: str, layout: KVLayout, chains: list[tuple[list[int], list[bytes]]], seed: int, began: float,
            stop: threading.Event, load: _Load) -> None:
    rng = random.Random(seed)
    with Client(target) as kv:
        while not stop.is_set():
            tok, blocks = rng.choice(chains)
            try:
                hit = kv.lookup(layout, tok)
                got = kv.fetch(layout, tok)
                wrong = sum(len(bytes(g)) for k, g in enumerate(got) if bytes(g) != blocks[k])
                if len(got) < len(blocks):
                    # The engine computes what the pool missed and puts it.
                    kv.put(layout, tok, blocks[len(got):], first_block=len(got))
                error = 0
            except KVStoreError as exc:
                error, wrong = 1, 0
                with load.lock:
                    load.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            with load.lock:
                sec = load.second(time.monotonic() - began)
                sec.lookups += 1
                sec.errors += error
                if not error:
                    sec.asked += len(blocks)
                    sec.hit += hit.num_blocks
                load.wrong_bytes += wrong


def _members(target: str) -> set[str]:
    with AdminClient(target, timeout_s=2) as admin:
        return {m.node_id for m in admin.cluster_status().members}


def failover(duration_s: float, kill_at_s: float, clients: int = 8, chains: int = 60, blocks: int = 32,
             ttl_s: int = 2, unit_blocks: int = 0) -> dict[str, Any]:
    """Part 3 (see the module docstring)."""
    with _workdir() as work:
        etcd = EtcdProcess(work)
        prefix = f"/bench/{random.getrandbits(32):08x}"
        common = ("--host-capacity", "256MiB", "--cluster", "--cluster-etcd", etcd.endpoint, "--cluster-prefix",
                  prefix, "--cluster-lease-ttl-s", str(ttl_s),
                  *(("--cluster-unit-blocks", str(unit_blocks)) if unit_blocks else ()))
        nodes = [DaemonProcess(work, n, *common, "--node-id", n) for n in ("a", "b", "c")]
        try:
            for node in nodes:
                node.start()
            a, b, c = nodes
            deadline = time.monotonic() + 20
            while any(_members(n.target) != {"a", "b", "c"} for n in nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the three daemons did not see each other")
                time.sleep(0.1)
            layout = _layouts(1)[0]
            work_chains = [(_tokens(10_000 + i, blocks, layout.block_size_tokens),
                            _payloads(layout, blocks, 10_000 + i)) for i in range(chains)]
            with Client(a.target) as kv:
                for tok, payloads in work_chains:
                    kv.put(layout, tok, payloads, wait_for_owners=True)
            load = _Load()
            stop = threading.Event()
            began = time.monotonic()
            threads = [threading.Thread(target=_client, args=((a, c)[k % 2].target, layout, work_chains, k, began,
                                                             stop, load), daemon=True) for k in range(clients)]
            for t in threads:
                t.start()
            time.sleep(kill_at_s)
            b.kill9()
            killed = time.monotonic()
            view_update_s = None
            while time.monotonic() - killed < ttl_s + 10:
                if all(_members(n.target) == {"a", "c"} for n in (a, c)):
                    view_update_s = time.monotonic() - killed
                    break
                time.sleep(0.05)
            time.sleep(max(0.0, duration_s - (time.monotonic() - began)))
            stop.set()
            for t in threads:
                t.join(30)
        finally:
            for node in nodes:
                node.stop()
            etcd.stop()
    per_second = [{"t": k, "lookups": s.lookups, "hit_ratio": round(s.hit / s.asked, 4) if s.asked else 0.0,
                   "errors": s.errors} for k, s in sorted(load.seconds.items())]
    return {
        "wrong_bytes": load.wrong_bytes, "client_errors": len(load.errors),
        "view_update_s": round(view_update_s, 2) if view_update_s is not None else None,
        "lease_ttl_s": ttl_s, "killed_at_s": kill_at_s, "duration_s": duration_s, "clients": clients,
        "chains": chains, "chain_blocks": blocks, "first_errors": load.errors[:5], "per_second": per_second,
    }
