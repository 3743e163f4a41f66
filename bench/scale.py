"""Scale benchmark: how kvstore's memory, lookup latency, put/evict cost and restart time
grow with the number of blocks it indexes.

Per N (default 1M and 10M blocks), on a real daemon process (bench/scale_daemon.py):
* fill: N blocks enter the index through the production put path (Store.begin_put ->
  reserve -> commit), driven by an in-process filler, into a METADATA-ONLY tier
  (a benchmark instrument: capacity accounted exactly, bytes not stored);
* rss_bytes_per_block: (VmRSS after the fill - VmRSS before) / N, from /proc/PID/status;
* lookup_p50_us / lookup_p99_us: `Client.lookup` of an existing 1,000-block chain over
  the Unix socket with the real SDK's default path (the daemon's local control lane),
  closed loop: one client sends each call as soon as the previous answer is in;
  lookup_steal_pct: the share of CPU time the hypervisor took meanwhile (/proc/stat);
  lookup_grpc_p50_us / lookup_grpc_p99_us: the same calls over gRPC on the same socket
  (`control_plane="grpc"`);
* echo_p50_us / echo_p99_us: the floor those lookups stand on, measured the same way:
  the same request bytes through a Unix socket to a process that answers as many bytes
  as a Lookup answer and does nothing else; lookup_p50_vs_echo / lookup_p99_vs_echo are
  the ratios;
* lookup_paced_* / lookup_grpc_paced_* / echo_paced_*: the same three, paced: they take
  turns call by call, so each call finds the other end idle since its previous call (on
  a virtual machine an idle core's wake-up is then most of the time, floor included);
  lookup_grpc_1block_p50_us: the paced gRPC call naming one block;
* lookup_1block_p50_us: the same RPC naming one block (the fixed cost of a call), and
  store_lookup_*: `Store.lookup` of the chains inside the daemon (the server's share);
  store_lookup_scattered_*: the same for chains of as many blocks drawn at random from
  the table (blocks put one by one among other chains' do not sit in consecutive rows,
  so the probe cannot read them in row order: each key costs a probe of the key table);
* gc_full_ms: one full collection of Python's cyclic GC in the daemon after the fill
  (the stall an automatic one would cause; the daemon freezes the index out of it);
* put_us_per_block: daemon CPU time per block of a put (begin_put through commit and the
  policy inserts it defers), the median of the last puts of the fill (the last 10%, at
  most 200,000 blocks), which the daemons of all N put in ten rounds taking turns, so
  every N is sampled across the same phases of the machine; put_mean_us_per_block is their mean,
  and put_fill_us_per_block the mean over the whole fill (key table growth included);
* evict_us_per_block: with the tier full, more blocks are put; each needs one eviction
  (policy victim, demote/drop, index removal), timed (CPU, and wall) around the store's
  eviction step.

Then, in this process, the SSD tier's index rebuild at restart for `--ssd-records`
records (default 1M, tiny payloads, buffered I/O in a temporary directory): the time of
`Store.start()` (tier recovery + index insert + policy insert) from the clean-shutdown
snapshot and from a scan of the region log.

Results: bench/results/scale.json and bench/results/scale.png (each figure against N).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from scale_daemon import bench_layout, block_hash  # noqa: E402

RESULTS = os.path.join(HERE, "results")
CHAIN = 1000
# Blocks at the end of each fill whose puts are timed, in rounds taking turns across N.
TAIL_BLOCKS = 200_000
FILL_PATH = ("in-process filler inside the daemon process: Store.begin_put -> PutTxn.reserve -> "
             "mark_written -> commit(checksums), chains of 1000 blocks, into MetadataOnlyTier "
             "(benchmark instrument: capacity accounted, bytes not stored)")


def parse_n(text: str) -> int:
    text = text.strip().lower()
    mult = 1
    if text.endswith("k"):
        mult, text = 1000, text[:-1]
    elif text.endswith("m"):
        mult, text = 1_000_000, text[:-1]
    return int(float(text) * mult)


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs from /proc/stat, (0, 0) where it is not there:
    the time the hypervisor ran something else while this machine wanted a CPU."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return 100.0 * (after[0] - before[0]) / total if total > 0 else 0.0


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class DaemonProc:
    def __init__(self, capacity_blocks: int, block_bytes: int, policy: str, workdir: str) -> None:
        self.socket = os.path.join(workdir, "kv.sock")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "scale_daemon.py"), "--socket", self.socket,
             "--capacity-blocks", str(capacity_blocks), "--block-bytes", str(block_bytes), "--policy", policy],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self.read()
        if not ready.get("ready"):
            raise RuntimeError(f"bench daemon did not start: {ready}")
        self.pid = self.proc.pid

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench daemon exited with {self.proc.wait()}")
        return json.loads(line)

    def command(self, text: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.command("quit")
        except (RuntimeError, BrokenPipeError, ValueError):
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def time_lookups(clients: list[Any], layout: Any, n: int, lookups: int) -> list[tuple[list[float], list[float]]]:
    """Paced: for each client, seconds per `lookup` naming one block, and naming a random
    existing 1,000-block chain (warm-up calls excluded). The clients take turns call by
    call, on the same chains, so that each sees the same load and the same cache state;
    each call therefore finds the other end idle since its previous one."""
    chains = n // CHAIN
    rng = random.Random(7)
    floors: list[list[float]] = [[] for _ in clients]
    times: list[list[float]] = [[] for _ in clients]
    one = [block_hash(0)]
    for k in range(lookups // 4 + 50):  # the fixed cost of one Lookup call (1 block)
        for client, floor in zip(clients, floors):
            t = time.perf_counter()
            client.lookup(layout, block_hashes=one)
            if k >= 50:
                floor.append(time.perf_counter() - t)
    for k in range(lookups + 100):
        c = rng.randrange(chains)
        hashes = [block_hash(j) for j in range(c * CHAIN, (c + 1) * CHAIN)]
        for client, spent in zip(clients, times):
            t = time.perf_counter()
            r = client.lookup(layout, block_hashes=hashes)
            dt = time.perf_counter() - t
            check_found(r, c)
            if k >= 100:  # warm-up excluded
                spent.append(dt)
    return list(zip(floors, times))


def time_closed_loop(clients: list[Any], layout: Any, n: int, lookups: int, run: int = 200) -> list[list[float]]:
    """Closed loop: for each client, seconds per `lookup` of a random existing 1,000-block
    chain, each call sent as soon as the previous answer is in (chains built in advance).
    The clients take turns run by run (`run` calls back to back each), so each sees the
    same phases of a shared machine; the first run of each is warm-up."""
    rng = random.Random(11)
    run = min(run, max(1, lookups // 5))  # a short run (a smoke test) still has runs past the warm-up
    picks = [rng.randrange(n // CHAIN) for _ in range(min(lookups, 500))]
    chains = [(c, [block_hash(j) for j in range(c * CHAIN, (c + 1) * CHAIN)]) for c in picks]
    times: list[list[float]] = [[] for _ in clients]
    k = 0
    for r in range(lookups // run + 1):
        for client, spent in zip(clients, times):
            for i in range(run):
                c, hashes = chains[(k + i) % len(chains)]
                t = time.perf_counter()
                res = client.lookup(layout, block_hashes=hashes)
                dt = time.perf_counter() - t
                check_found(res, c)
                if r:
                    spent.append(dt)
        k += run
    return times


def p50_p99(name: str, seconds: list[float]) -> dict[str, float]:
    """`{name}_p50_us` and `{name}_p99_us` of call times in seconds."""
    return {f"{name}_p50_us": percentile(seconds, 0.50) * 1e6, f"{name}_p99_us": percentile(seconds, 0.99) * 1e6}


def check_found(result: Any, chain: int) -> None:
    if result.num_blocks != CHAIN:
        raise RuntimeError(f"chain {chain}: lookup found {result.num_blocks} of {CHAIN} blocks")


ECHO_SERVER = """
import asyncio, struct, sys
HEAD = struct.Struct("<I")
class Echo(asyncio.BufferedProtocol):
    # Read into a buffer of its own, as the daemon's control lane does (kvstore.server.control_lane).
    def connection_made(self, transport):
        self.transport, self.buf, self.end = transport, bytearray(1 << 16), 0
    def get_buffer(self, sizehint):
        if self.end >= 4:
            need = 4 + HEAD.unpack_from(self.buf)[0]
            if need > len(self.buf):
                grown = bytearray(need)
                grown[:self.end] = self.buf[:self.end]
                self.buf = grown
        return memoryview(self.buf)[self.end:]
    def buffer_updated(self, nbytes):
        self.end += nbytes
        while self.end >= 4:
            n = HEAD.unpack_from(self.buf)[0]
            if self.end < 4 + n:
                return
            # One byte per block: a Lookup answer's size (its tiers; the caller keeps its
            # hashes, LookupRequest.omit_hashes).
            body = bytes(n // 16)
            rest = self.end - 4 - n
            self.buf[:rest] = self.buf[4 + n:self.end]
            self.end = rest
            self.transport.write(HEAD.pack(len(body)) + body)
async def main():
    server = await asyncio.get_running_loop().create_unix_server(Echo, sys.argv[1])
    print("ready", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


class EchoClient:
    """The floor of a Lookup on this machine: the same request bytes (the chain packed)
    through a Unix socket to a process that answers as many bytes as a Lookup answer
    holds, doing nothing else (an asyncio buffered protocol reading into a buffer of its
    own, as the daemon's control lane does). It takes turns with the real clients, so it
    sees the same pacing and idle gaps."""

    def __init__(self, workdir: str) -> None:
        import socket
        import struct

        path = os.path.join(workdir, "echo.sock")
        self._proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, path], stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None and self._proc.stdout.readline().strip() == "ready"
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.connect(path)
        self._head = struct.Struct("<I")
        self._buf = bytearray(1 << 16)

    def lookup(self, layout: Any, block_hashes: list[bytes]) -> Any:
        packed = b"".join(block_hashes)
        self._sock.sendall(self._head.pack(len(packed)) + packed)
        view = memoryview(self._buf)
        got = 0
        while got < 4 or got < 4 + self._head.unpack_from(self._buf)[0]:
            k = self._sock.recv_into(view[got:])
            if not k:
                raise RuntimeError("the echo server closed the connection")
            got += k
        return argparse.Namespace(num_blocks=len(packed) // 16)

    def close(self) -> None:
        self._sock.close()
        self._proc.kill()
        self._proc.wait()


class Filling:
    """One N's daemon, filled short of N by the last `tail` blocks, which `timed_tails`
    puts in rounds that take turns with the other N's daemons."""

    def __init__(self, n: int, block_bytes: int, policy: str, tail: int) -> None:
        self.n = n
        self.workdir = tempfile.mkdtemp(prefix="kvstore-scale-")
        self.daemon = DaemonProc(n, block_bytes, policy, self.workdir)
        time.sleep(0.5)
        self.base_rss = vm_rss(self.daemon.pid)
        self.tail = max(CHAIN, min(tail, n // 10) // CHAIN * CHAIN)  # at least one put (N >= 2 chains)
        self.filled = self.daemon.command(f"fill 0 {n - self.tail} {CHAIN}")
        self.put_samples: list[float] = []  # CPU us per block of each timed put

    def close(self) -> None:
        self.daemon.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def timed_tails(fillings: list[Filling], rounds: int = 10) -> None:
    """The last blocks of every N, put in `rounds` rounds in which the daemons take turns,
    so that each N's put cost is sampled across the same phases of a shared machine: on
    a 2-core virtual machine one put's CPU time moves by +-30% from one second to the
    next, more than the cost moves from 1M to 10M blocks."""
    done = {f.n: 0 for f in fillings}
    for r in range(rounds):
        for f in fillings:
            upto = f.tail * (r + 1) // rounds // CHAIN * CHAIN
            count = upto - done[f.n]
            if count <= 0:
                continue
            got = f.daemon.command(f"fill {f.n - f.tail + done[f.n]} {count} {CHAIN}")
            f.put_samples += got["put_cpu_us_per_block"]
            done[f.n] = upto


def measure_n(f: Filling, block_bytes: int, lookups: int, evict_blocks: int) -> dict[str, Any]:
    from kvstore.client import Client

    n, daemon, workdir, filled, base = f.n, f.daemon, f.workdir, f.filled, f.base_rss
    try:
        time.sleep(0.5)
        rss = vm_rss(daemon.pid)
        print(f"  N={n:,}: filled in {filled['seconds']:.1f}s (the last {f.tail:,} blocks in rounds), "
              f"RSS {base / 2**20:.0f} -> {rss / 2**20:.0f} MiB", flush=True)
        layout = bench_layout(block_bytes)
        # The SDK's default path (the daemon's local control lane) and gRPC on the same
        # socket, taking turns over the same chains.
        # And the floor: the same bytes through a Unix socket to a process that does nothing.
        clients = [Client(f"unix:{daemon.socket}", data_plane="grpc"),
                   Client(f"unix:{daemon.socket}", data_plane="grpc", control_plane="grpc"),
                   EchoClient(workdir)]
        try:
            ticks = cpu_ticks()
            times, times_grpc, times_echo = time_closed_loop(clients, layout, n, lookups)
            steal = steal_pct(ticks, cpu_ticks())
            (floor, paced), (floor_grpc, paced_grpc), (_, paced_echo) = time_lookups(clients, layout, n, lookups)
        finally:
            for client in clients:
                client.close()
        server = daemon.command(f"lookups {n} {CHAIN} {lookups // 4}")
        collector = daemon.command("gc")
        evicted = daemon.command(f"fill {n} {evict_blocks} {CHAIN}")
        if evicted["evictions"] < evict_blocks:
            raise RuntimeError(f"expected {evict_blocks} evictions under pressure, saw {evicted['evictions']}")
        return {
            "n_blocks": n,
            "rss_bytes_per_block": (rss - base) / n,
            "rss_baseline_bytes": base,
            "rss_filled_bytes": rss,
            **p50_p99("lookup", times),
            "lookup_mean_us": statistics.fmean(times) * 1e6,
            # CPU time the hypervisor took from this machine while the closed-loop
            # lookups ran (/proc/stat "steal"): their latencies are only as steady as this.
            "lookup_steal_pct": steal,
            "lookups": len(times),
            "lookup_1block_p50_us": percentile(floor, 0.50) * 1e6,
            **p50_p99("lookup_grpc", times_grpc),
            "lookup_grpc_1block_p50_us": percentile(floor_grpc, 0.50) * 1e6,
            **p50_p99("echo", times_echo),
            "lookup_p50_vs_echo": percentile(times, 0.50) / percentile(times_echo, 0.50),
            "lookup_p99_vs_echo": percentile(times, 0.99) / percentile(times_echo, 0.99),
            **p50_p99("lookup_paced", paced),
            **p50_p99("lookup_grpc_paced", paced_grpc),
            **p50_p99("echo_paced", paced_echo),
            **server,
            **collector,
            # CPU time of the daemon process: what the metadata costs, undisturbed by other
            # processes on a shared machine. The wall-clock figures are kept next to them.
            "put_us_per_block": statistics.median(f.put_samples),
            "put_mean_us_per_block": statistics.fmean(f.put_samples),
            "puts_timed": len(f.put_samples),
            "put_fill_us_per_block": filled["fill_cpu_us_per_block"],
            "fill_seconds": filled["seconds"],
            "evict_us_per_block": evicted["evict_cpu_seconds"] / evicted["evictions"] * 1e6,
            "evict_wall_us_per_block": evicted["evict_seconds"] / evicted["evictions"] * 1e6,
            "evictions": evicted["evictions"],
            "put_under_pressure_us_per_block": evicted["fill_cpu_us_per_block"],
        }
    finally:
        f.close()


class InlineExecutor(Executor):
    """Runs each submitted call at once in the caller's thread. Used only to WRITE the
    benchmark's SSD log fast (the production `put_block` path, minus the thread
    hand-off per record); the rebuild being measured runs with the tier's own pool."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting caller
            fut.set_exception(exc)
        return fut


async def _ssd_rebuild(records: int, directory: str) -> dict[str, Any]:
    from kvstore.core.policies import make_policy
    from kvstore.core.store import Store, StoreTier
    from kvstore.core.tier import BlockMeta
    from kvstore.tiers.memory import MemoryTier
    from kvstore.tiers.ssd import SsdTier

    ns = bench_layout(64).namespace_id
    payload = bytes(range(64))
    from kvstore.checksum import checksum
    csum = checksum(payload)
    region = 64 << 20

    def open_store() -> tuple[Store, SsdTier]:
        ssd = SsdTier(directory, records * 512 + 2 * region, region_size=region, io_mode="buffered", compress=False)
        store = Store([StoreTier(MemoryTier(1 << 20), make_policy("hint-arc")),
                       StoreTier(ssd, make_policy("hint-arc"))])
        return store, ssd

    ssd = SsdTier(directory, records * 512 + 2 * region, region_size=region, io_mode="buffered", compress=False)
    pool = ssd._executor
    ssd._executor = InlineExecutor()  # type: ignore[assignment]
    t = time.perf_counter()
    batch = 512
    prev: bytes | None = None
    for start in range(0, records, batch):
        metas = []
        for i in range(start, min(records, start + batch)):
            key = ns + block_hash(i)
            metas.append(BlockMeta(key, prev if i % CHAIN else None, csum, 2))
            prev = key
        slots = await asyncio.gather(*(ssd.put_block(m, payload) for m in metas))
        assert all(s is not None for s in slots)
    write_s = time.perf_counter() - t
    ssd._executor = pool
    ssd.close()  # clean shutdown: writes the snapshot
    out: dict[str, Any] = {"ssd_records": records, "ssd_write_seconds": write_s}
    for source in ("snapshot", "log"):
        if source == "log":
            os.unlink(os.path.join(directory, "index.snapshot"))
        store, ssd = open_store()
        t = time.perf_counter()
        await store.start()
        out[f"rebuild_s_{source}"] = time.perf_counter() - t
        got = store.indexed_blocks
        if got != records:
            raise RuntimeError(f"rebuild from {source} found {got} of {records} records")
        await store.aclose()  # writes the snapshot again
        del store, ssd
    return out


def ssd_rebuild(records: int, parent: str | None) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="kvstore-scale-ssd-", dir=parent)
    try:
        return asyncio.run(_ssd_rebuild(records, directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def plot(rows: list[dict[str, Any]], ssd: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib missing (make bench-deps)")
        return
    figures = [
        ("rss_bytes_per_block", "daemon RSS per block (bytes)", 160),
        ("lookup_p50_us", "Lookup p50, 1000-block chain (us)", None),
        ("lookup_p99_us", "Lookup p99, 1000-block chain (us)", 1000),
        ("put_us_per_block", "Put metadata cost (us/block)", None),
        ("evict_us_per_block", "eviction cost (us/block)", None),
    ]
    ns = [r["n_blocks"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    # With no N measured (an SSD-rebuild-only run) only the rebuild panel has data.
    for ax, (key, title, target) in zip(axes.flat, figures if rows else []):
        ax.plot(ns, [r[key] for r in rows], "o-",
                label="SDK over the socket, closed loop" if key.startswith("lookup") else None)
        if key.startswith("lookup_p"):
            q = key.removeprefix("lookup_")
            ax.plot(ns, [r["store_" + key] for r in rows], "s--", label="Store.lookup in the daemon")
            scattered = "store_lookup_scattered_" + q
            if all(scattered in r for r in rows):
                ax.plot(ns, [r[scattered] for r in rows], "d--", label="Store.lookup, blocks drawn at random")
            for name, style, label in (("echo_" + q, "^:", "floor: the same bytes, echoed"),
                                       ("lookup_paced_" + q, "o-", "SDK, paced (idle between calls)"),
                                       ("echo_paced_" + q, "v:", "floor, paced")):
                if all(name in r for r in rows):
                    ax.plot(ns, [r[name] for r in rows], style, label=label)
            ax.legend(fontsize=8)
        if target is not None:
            ax.axhline(target, color="r", ls="--", lw=1, label=f"target {target}")
            ax.legend()
        ax.set_xscale("log")
        ax.set_xlabel("blocks indexed (N)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
    ax = axes.flat[5]
    if ssd:
        ax.bar(["log scan", "snapshot"], [ssd["rebuild_s_log"], ssd["rebuild_s_snapshot"]])
        ax.set_title(f"SSD index rebuild, {ssd['ssd_records']:,} records (s)", fontsize=10)
    fig.suptitle("kvstore scale (fill: production put path into a metadata-only benchmark tier)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description="kvstore scale benchmark")
    ap.add_argument("--n", default="1M,10M", help="comma-separated block counts, e.g. 100k,1M,10M")
    ap.add_argument("--block-bytes", type=int, default=1 << 20, help="accounted size of a block (no bytes stored)")
    ap.add_argument("--policy", default="hint-arc")
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--evict-blocks", type=int, default=100_000)
    ap.add_argument("--ssd-records", default="1M", help="records for the SSD rebuild (0 skips it)")
    ap.add_argument("--ssd-dir", default=None, help="parent directory for the SSD rebuild files (default: temp)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "scale.json"))
    args = ap.parse_args()
    ns = [parse_n(x) for x in args.n.split(",") if x.strip()]
    if any(n < 2 * CHAIN for n in ns):
        raise SystemExit(f"N must be at least {2 * CHAIN}")
    fillings: list[Filling] = []
    rows = []
    try:
        for n in ns:
            print(f"scale: N={n:,} blocks: filling ...", flush=True)
            fillings.append(Filling(n, args.block_bytes, args.policy, TAIL_BLOCKS))
        print("scale: the last puts of each N, taking turns ...", flush=True)
        timed_tails(fillings)
        while fillings:
            f = fillings.pop(0)
            print(f"scale: N={f.n:,} blocks ...", flush=True)
            rows.append(measure_n(f, args.block_bytes, args.lookups, min(args.evict_blocks, f.n)))
    finally:
        for f in fillings:
            f.close()
    ssd: dict[str, Any] = {}
    records = parse_n(args.ssd_records)
    if records:
        print(f"scale: SSD rebuild of {records:,} records ...", flush=True)
        ssd = ssd_rebuild(records, args.ssd_dir)
    for r in rows:
        r["rebuild_s_log"] = ssd.get("rebuild_s_log")
        r["rebuild_s_snapshot"] = ssd.get("rebuild_s_snapshot")
    doc = {
        "fill_path": FILL_PATH,
        "lookup_path": ("kvstore.client.Client.lookup over the Unix socket (the local control lane; lookup_grpc_*: "
                        "gRPC on the same socket), chains of 1000 existing blocks; closed loop (each call sent "
                        "when the previous answer is in), and *_paced_*: clients taking turns call by call"),
        "policy": args.policy,
        "block_bytes_accounted": args.block_bytes,
        "python": platform.python_version(),
        "ssd": ssd,
        "results": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=2)
    plot(rows, ssd, os.path.splitext(args.out)[0] + ".png")
    header = (f"{'N':>11} {'RSS B/blk':>10} {'Lookup p50':>11} {'p99 us':>8} {'echo p50':>9} {'p99 us':>7} "
              f"{'paced p50':>10} {'p99 us':>8} {'echo p50':>9} {'p99 us':>7} "
              f"{'gRPC p50':>9} {'p99 us':>8} {'store p50':>10} {'p99 us':>8} {'put us/blk':>11} {'evict us/blk':>13}")
    print(header)
    for r in rows:
        print(f"{r['n_blocks']:>11,} {r['rss_bytes_per_block']:>10.0f} {r['lookup_p50_us']:>11.0f} "
              f"{r['lookup_p99_us']:>8.0f} {r['echo_p50_us']:>9.0f} {r['echo_p99_us']:>7.0f} "
              f"{r['lookup_paced_p50_us']:>10.0f} {r['lookup_paced_p99_us']:>8.0f} "
              f"{r['echo_paced_p50_us']:>9.0f} {r['echo_paced_p99_us']:>7.0f} {r['lookup_grpc_p50_us']:>9.0f} "
              f"{r['lookup_grpc_p99_us']:>8.0f} {r['store_lookup_p50_us']:>10.0f} "
              f"{r['store_lookup_p99_us']:>8.0f} {r['put_us_per_block']:>11.2f} {r['evict_us_per_block']:>13.2f}")
    for r in rows:
        print(f"N={r['n_blocks']:,}: CPU stolen by the hypervisor during the closed-loop lookups: "
              f"{r['lookup_steal_pct']:.1f}%")
    for r in rows:
        print(f"N={r['n_blocks']:,}: put CPU us/block: median {r['put_us_per_block']:.2f}, mean "
              f"{r['put_mean_us_per_block']:.2f} (the last {r['puts_timed']} puts, in rounds across N), {r['put_fill_us_per_block']:.2f} "
              f"over the whole fill; under pressure (one eviction each) {r['put_under_pressure_us_per_block']:.2f}")
    for r in rows:
        print(f"N={r['n_blocks']:,}: Store.lookup of a chain of {CHAIN} blocks drawn at random (not in row order): "
              f"p50 {r['store_lookup_scattered_p50_us']:.0f} us, p99 {r['store_lookup_scattered_p99_us']:.0f} us "
              f"(a chain as it was put: p50 {r['store_lookup_p50_us']:.0f} us)")
    for r in rows:
        print(f"N={r['n_blocks']:,}: full GC {r['gc_full_ms']:.0f} ms wall, {r['gc_full_cpu_ms']:.0f} ms CPU, "
              f"{r['gc_tracked_objects']:,} objects tracked, {r['gc_frozen_objects']:,} frozen")
    print("Lookup: SDK over the Unix socket (control lane), 1000-block chain, closed loop; echo: the same bytes "
          "through a Unix socket to a process that answers as many bytes as a Lookup and does nothing else "
          "(the floor, measured the same way); "
          "paced: the same calls taking turns call by call (each finds the other end idle); "
          "gRPC: the same 1000-block lookups over gRPC on that socket, closed loop; "
          "store: Store.lookup in the daemon. put: daemon CPU time per block of a put (median); evict: per eviction.")
    if ssd:
        print(f"SSD rebuild of {ssd['ssd_records']:,} records: {ssd['rebuild_s_log']:.2f}s from the log, "
              f"{ssd['rebuild_s_snapshot']:.2f}s from the snapshot")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
