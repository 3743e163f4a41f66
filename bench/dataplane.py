"""Data-plane benchmark: kvstore's shared-memory and gRPC paths next to their ceilings
(memcpy, a raw grpc-python echo) and peers (Redis; with --peer-python, Mooncake Store
and LMCache too), all measured in one run.

For each block size (256 KiB, 1 MiB, 4 MiB; 1 MiB only with --quick) and batch 32:
put and fetch throughput (GB/s, blocks/s, per-call p50/p99); and the latency of a
lookup of a 1,000-block chain. `kvstore-shm-auth2` is the shared-memory plane of a
second daemon with auth on and two tenants, each with its own segment, taking turns
(the other tenant's call runs, untimed, between the timed ones), so their puts and
evictions share one host tier. Every system moves the same payloads into and out of
caller-owned buffers. Writes results as JSON (the schema in README "Benchmarks") and a
readable report with ratios, plus a bar chart.

The Mooncake and LMCache drivers (bench/peers/*_peer.py) run in a venv of their own
(bench/install-peers.sh, `make bench-peers`): each is started with that interpreter
right after kvstore's cells of each block size, with the same batch and time per cell,
and its rows are merged into the same results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.client import Client, EngineNames, KVLayout  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from peers.common import free_port, measure, row  # noqa: E402

GB = 1e9
MIB = 1 << 20


@dataclass
class Result:
    system: str
    op: str
    block_bytes: int
    batch: int
    gbps: float | None
    ops_per_s: float
    p50_us: float
    p99_us: float
    calls: int
    note: str = ""
    gbps_range: str = ""  # with --rounds: "min-max" GB/s over the rounds (the row is the median)


def result(system: str, op: str, block_bytes: int, batch: int, times: list[float], note: str = "") -> Result:
    return Result(**row(system, op, block_bytes, batch, times, note))


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up")
        time.sleep(0.1)


# ----------------------------------------------------------------------- servers


class Services:
    """The daemon, the echo server and Redis, each a subprocess on loopback only; with
    `auth`, also a daemon with a token file of two tenants that may use the shared-memory
    plane (and an admin, to see it is up), on a Unix socket only."""

    def __init__(self, workdir: Path, host_capacity: str, redis: bool = True, auth: bool = False,
                 daemon_args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tokens: dict[str, str] = {}
        self.daemon_args = daemon_args  # more `kvstore serve` flags for the main daemon
        try:
            self._start(host_capacity, redis)
            if auth:
                self._start_auth(host_capacity)
        except BaseException:
            self.close()  # never leave a daemon (and its host segment) behind
            raise

    def _start_auth(self, host_capacity: str) -> None:
        from kvstore.server.auth import new_token

        entries = []
        for name, role, extra in (("ops", "admin", ""), ("alpha", "client", "local_plane = true\n"),
                                  ("beta", "client", "local_plane = true\n")):
            token, token_hash = new_token()
            self.tokens[name] = token
            entries.append(f'[[tenant]]\nname = "{name}"\nrole = "{role}"\ntokens = ["{token_hash}"]\n{extra}')
        token_file = self.workdir / "tokens.toml"
        token_file.write_text("\n".join(entries))
        token_file.chmod(0o600)
        self.auth_sock = self.workdir / "kv-auth.sock"
        log = open(self.workdir / "daemon-auth.log", "wb")
        self.procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "server.py"), "--listen", f"unix:{self.auth_sock}", "--host-capacity",
             host_capacity, "--auth-token-file", str(token_file), "--log-level", "warning", "--metrics-listen",
             "off"], stdout=log, stderr=subprocess.STDOUT))
        wait_for(self.auth_sock.exists, "kvstore daemon with auth")
        wait_for(lambda: _health(f"unix:{self.auth_sock}", self.tokens["ops"]), "kvstore daemon with auth health")

    def _start(self, host_capacity: str, redis: bool) -> None:
        workdir = self.workdir
        self.sock = workdir / "kv.sock"
        self.kv_port = free_port()
        log = open(workdir / "daemon.log", "wb")
        self.procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "server.py"), "--listen", f"unix:{self.sock},127.0.0.1:{self.kv_port}",
             "--host-capacity", host_capacity, "--log-level", "warning", "--metrics-listen", "off",
             *self.daemon_args], stdout=log, stderr=subprocess.STDOUT))
        echo = subprocess.Popen([sys.executable, str(ROOT / "bench" / "echo_server.py")], stdout=subprocess.PIPE)
        self.procs.append(echo)
        assert echo.stdout is not None
        self.echo_port = int(echo.stdout.readline())
        self.redis_port: int | None = None
        redis_server = shutil.which("redis-server") if redis else None
        if redis_server:
            self.redis_port = free_port()
            self.procs.append(subprocess.Popen(
                [redis_server, "--bind", "127.0.0.1", "--port", str(self.redis_port), "--save", "", "--appendonly",
                 "no", "--protected-mode", "yes", "--dir", str(workdir)], stdout=subprocess.DEVNULL))
        wait_for(self.sock.exists, "kvstore daemon")
        wait_for(lambda: _health(f"unix:{self.sock}"), "kvstore daemon health")
        # Measure the steady state: the host segment's pages mapped in (the daemon does
        # this in the background after it starts serving).
        wait_for(lambda: _prefaulted(f"unix:{self.sock}"), "host tier prefault", timeout=300)
        if self.redis_port is not None:
            import redis

            wait_for(lambda: _redis_ping(redis, self.redis_port), "redis-server")

    def close(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _health(target: str, token: str | None = None) -> bool:
    try:
        with Client(target, timeout_s=1, token=token) as kv:
            kv.stats()
        return True
    except Exception:
        return False


def _prefaulted(target: str) -> bool:
    with Client(target, timeout_s=5) as kv:
        text = kv.info("tiers")
    return "tier_host_prefaulted:no" not in text and "tier_host_prefaulted:running" not in text


def _redis_ping(redis_mod, port: int) -> bool:  # type: ignore[no-untyped-def]
    try:
        return bool(redis_mod.Redis(host="127.0.0.1", port=port).ping())
    except Exception:
        return False


# ----------------------------------------------------------------------- systems


def layout_for(block_bytes: int) -> KVLayout:
    return KVLayout(model=f"bench-{block_bytes}", dtype="uint8", num_layers=1, num_kv_heads=1,
                    head_dim=block_bytes // 32, block_size_tokens=16)  # 2*1*16*1*D = block_bytes


def bench_memcpy(block_bytes: int, batch: int, seconds: float, pool: ThreadPoolExecutor) -> list[Result]:
    src = [np.random.randint(0, 255, block_bytes, dtype=np.uint8) for _ in range(batch)]
    dst = [np.empty(block_bytes, dtype=np.uint8) for _ in range(batch)]

    def copy_parallel(_: int) -> None:
        list(pool.map(np.copyto, dst, src))

    def copy_serial(_: int) -> None:
        for d, s in zip(dst, src):
            np.copyto(d, s)

    par = measure(copy_parallel, seconds)
    ser = measure(copy_serial, seconds)
    note = f"{pool._max_workers} threads, as the shm client"  # noqa: SLF001
    return [result("memcpy", op, block_bytes, batch, par, note) for op in ("put", "fetch")] + [
        result("memcpy-1thread", op, block_bytes, batch, ser, "numpy copyto, one thread") for op in ("put", "fetch")]


def bench_kvstore(system: str, target: str, plane: str, block_bytes: int, batch: int, seconds: float,
                  reserve_ahead: int = 0, put_only: bool = False, engine_names: bool = False) -> list[Result]:
    """`engine_names`: each put also names its blocks as an engine would (vLLM's 64-bit
    block hashes, EngineNames), for the daemon's KV events."""
    layout = layout_for(block_bytes)
    assert layout.bytes_per_block == block_bytes
    src = [np.random.randint(0, 255, block_bytes, dtype=np.uint8) for _ in range(batch)]
    out = [np.empty(block_bytes, dtype=np.uint8) for _ in range(batch)]
    note = f"reserve_ahead={reserve_ahead}: one round trip per put" if reserve_ahead else ""
    with Client(target, data_plane=plane, reserve_ahead=reserve_ahead) as kv:
        assert kv.warm_up() == plane, f"{system} wanted the {plane} plane"

        def put(_: int) -> None:
            names = EngineNames([int.from_bytes(os.urandom(8), "big") for _ in range(batch)]) if engine_names else None
            kv.put(layout, None, src, block_hashes=[os.urandom(16) for _ in range(batch)], engine_names=names)

        puts = measure(put, seconds)
        if put_only:
            two_trips = "two round trips per put (LocalPut, LocalCommit)" if plane == "local" else ""
            return [result(system, "put", block_bytes, batch, puts, note or two_trips)]
        hashes = [os.urandom(16) for _ in range(batch)]
        kv.put(layout, None, src, block_hashes=hashes)

        def fetch(_: int) -> None:
            got = kv.fetch(layout, block_hashes=hashes, out=out)
            if len(got) != batch:
                raise RuntimeError(f"{system} fetched {len(got)} of {batch} blocks")

        fetches = measure(fetch, seconds)
        for o, s in zip(out, src):
            if not np.array_equal(o, s):
                raise RuntimeError(f"{system} returned different bytes")
    return [result(system, "put", block_bytes, batch, puts, note), result(system, "fetch", block_bytes, batch, fetches)]


def bench_two_tenants(system: str, target: str, tokens: tuple[str, str], admin_token: str, block_bytes: int,
                      batch: int, seconds: float) -> list[Result]:
    """`bench_kvstore` of the shared-memory plane (one round trip per put) for the first
    tenant, while the second does the same call between each two of its timed ones: the
    tenants' blocks share the host tier and its eviction, each in its own segment.

    Measured in the steady state, as the auth-off row is once its segment is prefaulted:
    the tenants' segments are sparse (each gets pages as its blocks land), so the two
    first fill the host tier, untimed."""
    layout = layout_for(block_bytes)
    srcs = [[np.random.randint(0, 255, block_bytes, dtype=np.uint8) for _ in range(batch)] for _ in tokens]
    outs = [[np.empty(block_bytes, dtype=np.uint8) for _ in range(batch)] for _ in tokens]
    with Client(target, token=admin_token) as admin:
        host = next(t for t in admin.stats().tiers if t.name == "host")
    with Client(target, token=tokens[0], reserve_ahead=batch) as a, \
            Client(target, token=tokens[1], reserve_ahead=batch) as b:
        clients = (a, b)
        for kv in clients:
            assert kv.warm_up() == "local", f"{system} wanted the shared-memory plane"

        def putter(i: int) -> Callable[[int], None]:
            def put(_: int) -> None:
                clients[i].put(layout, None, srcs[i], block_hashes=[os.urandom(16) for _ in range(batch)])
            return put

        for r in range(host.capacity_bytes // (block_bytes * batch) + 4):
            putter(r % 2)(r)
        puts = measure(putter(0), seconds, after=putter(1))
        hashes = [[os.urandom(16) for _ in range(batch)] for _ in tokens]
        for kv, src, h in zip(clients, srcs, hashes):
            kv.put(layout, None, src, block_hashes=h)

        def fetcher(i: int) -> Callable[[int], None]:
            def fetch(_: int) -> None:
                got = clients[i].fetch(layout, block_hashes=hashes[i], out=outs[i])
                if len(got) != batch:
                    raise RuntimeError(f"{system} fetched {len(got)} of {batch} blocks")
            return fetch

        fetches = measure(fetcher(0), seconds, after=fetcher(1))
        for out, src in zip(outs, srcs):
            if not all(np.array_equal(o, s) for o, s in zip(out, src)):
                raise RuntimeError(f"{system} returned different bytes")
    note = (f"auth on, two tenants taking turns, each in its own segment; reserve_ahead={batch}")
    return [result(system, "put", block_bytes, batch, puts, note), result(system, "fetch", block_bytes, batch, fetches)]


def bench_echo(port: int, block_bytes: int, batch: int, seconds: float, chunk: int = MIB) -> list[Result]:
    """The ceiling of the gRPC bytes path: the same payloads in the same message shape
    (a small header, then one message per chunk of `chunk` bytes, the SDK's default), over
    a channel with the SDK's options, to a server that only keeps and returns them."""
    import grpc

    from kvstore.client._options import CHANNEL_OPTIONS, DEFAULT_CHUNK_BYTES

    assert chunk == DEFAULT_CHUNK_BYTES, "the echo must move chunks the size the SDK's are"
    ident = lambda b: b  # noqa: E731
    src = [np.random.randint(0, 255, block_bytes, dtype=np.uint8) for _ in range(batch)]
    out = [np.empty(block_bytes, dtype=np.uint8) for _ in range(batch)]
    # Stand-ins the size of kvstore's Put header and Fetch request for a batch of 32
    # (names and layout: about 20 bytes per block).
    header = bytes(32 + 19 * batch)
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
        put_call = ch.stream_unary("/bench.Echo/Put", request_serializer=ident, response_deserializer=ident)
        fetch_call = ch.unary_stream("/bench.Echo/Fetch", request_serializer=ident, response_deserializer=ident)

        def chunks():  # type: ignore[no-untyped-def]
            yield header
            for s in src:
                v = memoryview(s)
                for start in range(0, block_bytes, chunk):
                    yield bytes(v[start : start + chunk])  # one copy, as kvstore.wire's encoder

        def put(_: int) -> None:
            put_call(chunks())

        step = min(chunk, block_bytes)

        def fetch(_: int) -> None:
            pieces = iter(fetch_call(header))
            next(pieces)  # the header message
            for i, piece in enumerate(pieces):
                block, off = divmod(i * step, block_bytes)
                memoryview(out[block])[off : off + len(piece)] = piece

        puts = measure(put, seconds)
        put(-1)  # the payloads the fetches return
        fetches = measure(fetch, seconds)
        for o, s in zip(out, src):
            if not np.array_equal(o, s):
                raise RuntimeError("grpc-echo returned different bytes")
    note = "raw bytes, same payloads and message shape as kvstore-grpc, the SDK's channel options"
    return [result("grpc-echo", "put", block_bytes, batch, puts, note),
            result("grpc-echo", "fetch", block_bytes, batch, fetches, note)]


def bench_redis(port: int, block_bytes: int, batch: int, seconds: float) -> list[Result]:
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    r.flushall()
    payloads = [np.random.randint(0, 255, block_bytes, dtype=np.uint8).tobytes() for _ in range(batch)]
    out = [np.empty(block_bytes, dtype=np.uint8) for _ in range(batch)]
    counter = [0]

    def put(_: int) -> None:
        pipe = r.pipeline(transaction=False)
        base = counter[0]
        counter[0] += batch
        for j, p in enumerate(payloads):
            pipe.set(f"k{base + j}", p)
        pipe.execute()
        if counter[0] > 4 * batch:  # keep memory bounded, like the daemon's eviction
            r.flushall()
            counter[0] = 0

    puts = measure(put, seconds)
    keys = [f"fixed{j}" for j in range(batch)]
    r.mset(dict(zip(keys, payloads)))

    def fetch(_: int) -> None:
        for o, v in zip(out, r.mget(keys)):
            memoryview(o)[:] = v

    fetches = measure(fetch, seconds)
    r.flushall()
    return [result("redis", "put", block_bytes, batch, puts, "redis-py pipeline of SET"),
            result("redis", "fetch", block_bytes, batch, fetches, "MGET")]


def bench_lookup(services: Services, redis_port: int | None, chain: int, seconds: float) -> list[Result]:
    """Lookup latency of a `chain`-block chain (and of one block) by token ids, over the
    Unix socket: the SDK's default path (the daemon's local control lane) as
    `kvstore-shm`, and gRPC on the same socket as `kvstore-grpc`. The two alternate in
    short slices so that both see the same load on a shared machine."""
    layout = KVLayout(model="bench-lookup", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=8,
                      block_size_tokens=16)
    tokens = list(range(chain * layout.block_size_tokens))
    blocks = [bytes(layout.bytes_per_block)] * 256
    out: list[Result] = []
    target = f"unix:{services.sock}"
    with Client(target) as lane, Client(target, control_plane="grpc", data_plane="grpc") as rpc:
        if lane.control_plane_in_use != "lane":
            raise RuntimeError("the SDK did not pick the daemon's control lane")
        for first in range(0, chain, 256):
            lane.put(layout, tokens, blocks[: min(256, chain - first)], first_block=first)
        for n_blocks in (chain, 1):
            prefix = tokens[: n_blocks * layout.block_size_tokens]
            times: dict[str, list[float]] = {"kvstore-shm": [], "kvstore-grpc": []}
            for _ in range(5):
                for system, kv in (("kvstore-shm", lane), ("kvstore-grpc", rpc)):
                    def lookup(_: int, kv: Client = kv) -> None:
                        if kv.lookup(layout, prefix).num_blocks != n_blocks:
                            raise RuntimeError("lookup missed blocks of the chain")

                    times[system] += measure(lookup, seconds / 5, min_calls=20)
            for system, how in (("kvstore-shm", "SDK default: the local control lane"),
                                ("kvstore-grpc", "gRPC (control_plane='grpc')")):
                out.append(result(system, "lookup", 0, n_blocks, times[system],
                                  f"token ids hashed by the daemon; Unix socket, {how}"))
    if redis_port is not None:
        import redis

        r = redis.Redis(host="127.0.0.1", port=redis_port)
        keys = [f"chain{i}" for i in range(chain)]
        r.mset({k: b"1" for k in keys})

        def exists(_: int) -> None:
            if r.exists(*keys) != chain:
                raise RuntimeError("redis lost keys")

        out.append(result("redis", "lookup", 0, chain, measure(exists, seconds, min_calls=50), "EXISTS of 1000 keys"))
        r.flushall()
    return out


# ----------------------------------------------------------------------- report


def machine_info() -> dict[str, object]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    import grpc

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "grpcio": grpc.__version__, "numpy": np.__version__,
            "mem_bytes": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def find(results: list[Result], system: str, op: str, size: int) -> Result | None:
    return next((r for r in results if r.system == system and r.op == op and r.block_bytes == size), None)


def ratio_rows(results: list[Result]) -> list[tuple[str, str, float]]:
    rows = []
    sizes = sorted({r.block_bytes for r in results if r.block_bytes})
    pairs = [("kvstore-shm", "memcpy", "of memcpy (target >= 0.5)"),
             ("kvstore-shm", "redis", "x Redis (target >= 4)"),
             ("kvstore-shm", "mooncake", "x Mooncake co-located batched zero-copy (target >= 1.0)"),
             ("kvstore-shm", "lmcache", "x LMCache multiprocess server"),
             ("kvstore-shm", "kvstore-shm-2trip", "one-trip put x two-trip put"),
             ("kvstore-shm-auth2", "kvstore-shm", "auth on, two tenants x auth off"),
             ("kvstore-shm-auth2", "mooncake", "x Mooncake co-located batched zero-copy"),
             ("kvstore-grpc", "grpc-echo", "of the raw gRPC echo (target >= 0.9)"),
             ("kvstore-grpc", "redis", "x Redis")]
    for size in sizes:
        for op in ("put", "fetch"):
            for ours, theirs, label in pairs:
                a, b = find(results, ours, op, size), find(results, theirs, op, size)
                if a and b and a.gbps and b.gbps:
                    rows.append((f"{size // 1024} KiB {op}", f"{ours} {label}", a.gbps / b.gbps))
    return rows


def write_report(results: list[Result], machine: dict[str, object], out_dir: Path, elapsed: float,
                 rounds: int = 1) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine, "elapsed_s": round(elapsed, 1), "rounds": rounds,
            "results": [asdict(r) for r in results]}
    (out_dir / "latest.json").write_text(json.dumps(data, indent=2))
    lines = ["# kvstore data-plane benchmark", "",
             f"{machine['cpu']}, {machine['cores']} cores, Python {machine['python']}, {machine['time']}; "
             f"run took {elapsed:.0f} s. Same run, same machine, loopback only."
             + (f" Each cell ran {rounds} times, every system once per round; the medians are shown, "
                "with the range over the rounds." if rounds > 1 else ""), "",
             "## Throughput (batch of 32 blocks per call)", "",
             "| block | op | system | GB/s | blocks/s | p50 us | p99 us |" + (" GB/s range |" if rounds > 1 else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if rounds > 1 else "")]
    for r in sorted((r for r in results if r.op != "lookup"), key=lambda r: (r.block_bytes, r.op, -(r.gbps or 0))):
        lines.append(f"| {r.block_bytes // 1024} KiB | {r.op} | {r.system} | {r.gbps:.2f} | {r.ops_per_s:,.0f} | "
                     f"{r.p50_us:,.0f} | {r.p99_us:,.0f} |" + (f" {r.gbps_range} |" if rounds > 1 else ""))
    notes = {r.system: r.note for r in results if r.op != "lookup" and r.note}
    if notes:
        lines += ["", "How each system was driven:", ""] + [f"- {system}: {note}" for system, note in notes.items()]
    lines += ["", "## Lookup of a 1,000-block chain (and of one block)", "",
              "| system | blocks | p50 us | p99 us | note |", "|---|---|---|---|---|"]
    for r in (r for r in results if r.op == "lookup"):
        lines.append(f"| {r.system} | {r.batch:,} | {r.p50_us:,.0f} | {r.p99_us:,.0f} | {r.note} |")
    lines += ["", "## Ratios", "", "| case | comparison | ratio |", "|---|---|---|"]
    lines += [f"| {case} | {label} | {value:.2f} |" for case, label, value in ratio_rows(results)]
    (out_dir / "latest.md").write_text("\n".join(lines) + "\n")
    try:
        plot(results, out_dir / "latest.png")
    except ImportError:
        print("matplotlib is not installed; skipped the chart", file=sys.stderr)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.block_bytes for r in results if r.block_bytes})
    systems = [s for s in ("memcpy", "kvstore-shm", "mooncake", "lmcache", "redis", "grpc-echo", "kvstore-grpc")
               if any(r.system == s for r in results)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    width = 0.8 / len(systems)
    for ax, op in zip(axes, ("put", "fetch")):
        for i, system in enumerate(systems):
            vals = [(find(results, system, op, s) or Result(system, op, s, 0, 0.0, 0, 0, 0, 0)).gbps or 0 for s in sizes]
            ax.bar([x + i * width for x in range(len(sizes))], vals, width, label=system)
        ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(sizes))])
        ax.set_xticklabels([f"{s // 1024} KiB" for s in sizes])
        ax.set_title(f"{op}, batch 32")
        ax.set_ylabel("GB/s")
        ax.grid(axis="y", alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def median_of_rounds(results: list[Result]) -> list[Result]:
    """One row per (system, op, block size): the round with the median GB/s, and the
    range over the rounds. On a shared machine the load drifts between cells; several
    rounds, each running every system once, make a ratio less a matter of timing."""
    groups: dict[tuple[str, str, int], list[Result]] = {}
    for r in results:
        groups.setdefault((r.system, r.op, r.block_bytes), []).append(r)
    out: list[Result] = []
    for rows in groups.values():
        if len(rows) == 1 or rows[0].gbps is None:
            out.extend(rows)
            continue
        ranked = sorted(rows, key=lambda r: r.gbps or 0.0)
        mid = ranked[len(ranked) // 2]
        out.append(Result(mid.system, mid.op, mid.block_bytes, mid.batch, mid.gbps, mid.ops_per_s, mid.p50_us,
                          mid.p99_us, sum(r.calls for r in rows), mid.note,
                          f"{ranked[0].gbps:.2f}-{ranked[-1].gbps:.2f}"))
    return out


PEERS_DIR = ROOT / "bench" / "peers"
# What --systems may name: the throughput rows of each block size, and the lookup cells.
SYSTEMS = ("memcpy", "kvstore-shm", "kvstore-shm-2trip", "kvstore-shm-auth2", "kvstore-grpc", "grpc-echo", "redis",
           "lookup")


def run_peers(python: str, sizes: list[int], batch: int, seconds: float, workdir: Path) -> tuple[list[Result], list[str]]:
    """Run every peer driver with the peers' interpreter; their rows, and what failed."""
    results: list[Result] = []
    failed: list[str] = []
    # Mooncake first: its figure is the one the shared-memory plane is held against, so it
    # runs closest in time to kvstore's cells (this machine's load drifts).
    for driver in sorted(PEERS_DIR.glob("*_peer.py"), key=lambda p: (p.stem != "mooncake_peer", p.stem)):
        name = driver.stem.removesuffix("_peer")
        out = workdir / f"{name}.json"
        out.unlink(missing_ok=True)  # never read a previous size's rows
        print(f"peer {name} ...", flush=True)
        proc = subprocess.run([python, str(driver), "--sizes", ",".join(map(str, sizes)), "--batch", str(batch),
                               "--seconds", str(seconds), "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
        if proc.returncode != 0 or not out.exists():
            print(proc.stdout[-4000:], file=sys.stderr)
            failed.append(f"{name} (exit status {proc.returncode})")
            continue
        results += [Result(**r) for r in json.loads(out.read_text())["results"]]
    return results, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 MiB blocks only, shorter cells")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--seconds", type=float, default=None, help="time per cell")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the throughput cells (peers included) this many times; report each cell's median")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated subset of the matrix to run (default: all): " + ", ".join(SYSTEMS)
                        + "; e.g. kvstore-grpc,grpc-echo to compare the gRPC path with its ceiling")
    parser.add_argument("--peers", default="", help="JSON file of peer results (same schema) to merge in")
    parser.add_argument("--peer-python", default="",
                        help="interpreter of the peers' venv (bench/install-peers.sh): also measure Mooncake and LMCache")
    args = parser.parse_args(argv)
    systems = {s.strip() for s in args.systems.split(",") if s.strip()}
    if not systems or systems - set(SYSTEMS):
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)} (got {args.systems!r})")
    sizes = [MIB] if args.quick else [256 * 1024, MIB, 4 * MIB]
    seconds = args.seconds or (1.0 if args.quick else 2.0)
    started = time.perf_counter()
    results: list[Result] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        services = Services(Path(tmp), "2GiB", redis=bool(systems & {"redis", "lookup"}),
                            auth="kvstore-shm-auth2" in systems)
        pool = ThreadPoolExecutor(2)
        try:
            for rnd, size in ((r, size) for r in range(args.rounds) for size in sizes):
                print(f"block {size // 1024} KiB{f' (round {rnd + 1} of {args.rounds})' if args.rounds > 1 else ''} ...",
                      flush=True)
                if "memcpy" in systems:
                    results += bench_memcpy(size, args.batch, seconds, pool)
                if "kvstore-shm" in systems:
                    # As an engine saving its KV each step would run it: one round trip per put.
                    results += bench_kvstore("kvstore-shm", f"unix:{services.sock}", "local", size, args.batch,
                                             seconds, reserve_ahead=args.batch)
                if "kvstore-shm-2trip" in systems:
                    results += bench_kvstore("kvstore-shm-2trip", f"unix:{services.sock}", "local", size, args.batch,
                                             seconds, put_only=True)
                if "kvstore-shm-auth2" in systems:
                    results += bench_two_tenants("kvstore-shm-auth2", f"unix:{services.auth_sock}",
                                                 (services.tokens["alpha"], services.tokens["beta"]),
                                                 services.tokens["ops"], size, args.batch, seconds)
                if "kvstore-grpc" in systems:
                    results += bench_kvstore("kvstore-grpc", f"127.0.0.1:{services.kv_port}", "grpc", size,
                                             args.batch, seconds)
                if "grpc-echo" in systems:
                    results += bench_echo(services.echo_port, size, args.batch, seconds)
                if "redis" in systems and services.redis_port is not None:
                    results += bench_redis(services.redis_port, size, args.batch, seconds)
                if args.peer_python:
                    # Right after kvstore's cells of the same size, so a ratio compares
                    # figures taken minutes apart at most.
                    peer_results, peer_failed = run_peers(args.peer_python, [size], args.batch, seconds, Path(tmp))
                    results += peer_results
                    failed += peer_failed
            if "lookup" in systems:
                print("lookup ...", flush=True)
                results += bench_lookup(services, services.redis_port, 1000, seconds)
        finally:
            pool.shutdown()
            services.close()
    results = median_of_rounds(results)
    if args.peers and Path(args.peers).exists():
        results += [Result(**r) for r in json.loads(Path(args.peers).read_text())["results"]]
    elapsed = time.perf_counter() - started
    write_report(results, machine_info(), Path(args.out), elapsed, args.rounds)
    print((Path(args.out) / "latest.md").read_text())
    if failed:
        print(f"peers that failed (not in the report): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
