"""Soak: many clients doing mixed put / lookup / fetch / delete / pin against one real
daemon for a bounded time, over both data planes, under eviction pressure, verifying
every fetched byte.

The daemon runs as a subprocess with a small host tier and a small SSD tier in a temp
directory, so blocks are demoted, dropped from SSD and promoted again all through the
run. Clients share one key space: a block's bytes are a pure function of its key, so any
client can check any block it fetches (a miss is fine under eviction; a wrong byte is
not). Half the clients move bytes through the shared-memory plane (Unix socket), the
other half as gRPC bytes over loopback TCP.

Clients are threads in a few worker processes (the sync SDK holds the GIL while it
frames messages, so one process cannot drive 32 clients on a small machine).

Pass conditions (exit status 1 otherwise):
- zero mismatches (a fetched block differs from what its key was put with);
- no unexpected errors. Expected: RESOURCE_EXHAUSTED (everything pinned or moving under
  load), NOT_FOUND / FAILED_PRECONDITION (a delete racing a lease or a local fetch);
- bounded growth: the daemon's RSS at the end is at most RSS_GROWTH_BYTES above its RSS
  after warm-up (the host tier is prefaulted at start, so its memory is in both);
- the daemon exits 0 on SIGTERM and counted no checksum failures.

Writes bench/results/soak.json and prints a summary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.client import Client  # noqa: E402
from kvstore.errors import KVStoreError  # noqa: E402
from kvstore.hashing import block_hashes  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402

LAYOUT = KVLayout(model="bench/soak", dtype="bfloat16", num_layers=4, num_kv_heads=4, head_dim=64,
                  block_size_tokens=16)  # 2 * 4 * 16 * 4 * 64 * 2 = 64 KiB blocks
BLOCK = LAYOUT.bytes_per_block
CHAIN_BLOCKS = 8
EXPECTED = {"RESOURCE_EXHAUSTED", "NOT_FOUND", "FAILED_PRECONDITION"}
RSS_GROWTH_BYTES = 64 << 20
WARM_UP_FRACTION = 0.2
OP_TIMEOUT_S = 60.0


def block_bytes(chain: int, index: int) -> bytes:
    """The one right content of block `index` of `chain`: every byte depends on the key."""
    seed = int.from_bytes(hashlib.blake2b(f"{chain}:{index}".encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).bytes(BLOCK)


def tokens_of(chain: int) -> list[int]:
    return [chain * 1_000_003 + i for i in range(CHAIN_BLOCKS * LAYOUT.block_size_tokens)]


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# ----------------------------------------------------------------------------- client side


class ClientStats:
    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.latency_us: list[float] = []
        self.errors: Counter[str] = Counter()
        self.error_examples: dict[str, str] = {}
        self.mismatches = 0
        self.blocks_verified = 0
        self.misses = 0


def run_client(target: str, plane: str, chains: int, deadline: float, seed: int, st: ClientStats) -> None:
    rng = random.Random(seed)
    content = block_bytes  # regenerated on each use (cheaper than the RPC): no per-process cache to grow

    with Client(target, timeout_s=OP_TIMEOUT_S, data_plane=plane) as kv:
        if kv.data_plane_in_use != plane:
            raise RuntimeError(f"client asked for the {plane} plane and got {kv.data_plane_in_use}")
        while time.monotonic() < deadline:
            # Skewed popularity: a hot set gets hits, the long tail keeps eviction busy.
            c = int(rng.paretovariate(1.2)) % chains if rng.random() < 0.7 else rng.randrange(chains)
            tokens = tokens_of(c)
            r = rng.random()
            op = ("put" if r < 0.35 else "fetch" if r < 0.70 else "lookup" if r < 0.85 else
                  "lease_fetch" if r < 0.92 else "pin" if r < 0.96 else "delete")
            t0 = time.perf_counter()
            try:
                if op == "put":
                    n = rng.randrange(1, CHAIN_BLOCKS + 1)
                    kv.put(LAYOUT, tokens[: n * LAYOUT.block_size_tokens], [content(c, i) for i in range(n)])
                elif op in ("fetch", "lease_fetch"):
                    lease = ""
                    if op == "lease_fetch":
                        lease = kv.lookup(LAYOUT, tokens, lease_ms=5_000).lease_id
                    got = kv.fetch(LAYOUT, tokens, lease_id=lease)
                    bad = sum(1 for i, b in enumerate(got) if bytes(b) != content(c, i))
                    if not got:
                        st.misses += 1
                    st.mismatches += bad
                    st.blocks_verified += len(got)
                elif op == "lookup":
                    kv.lookup(LAYOUT, tokens)
                elif op == "pin":
                    p = kv.pin(LAYOUT, tokens, ttl_ms=2_000)
                    if p.lease_id and rng.random() < 0.5:
                        kv.unpin(p.lease_id)
                else:
                    hashes = block_hashes(LAYOUT.namespace_id, tokens, LAYOUT.block_size_tokens)
                    kv.delete(LAYOUT, block_hashes=hashes[rng.randrange(CHAIN_BLOCKS):])
            except KVStoreError as exc:
                name = exc.code.name  # the gRPC status, e.g. RESOURCE_EXHAUSTED
                st.errors[name] += 1
                st.error_examples.setdefault(name, str(exc)[:300])
                continue
            st.latency_us.append((time.perf_counter() - t0) * 1e6)
            st.ops[op] += 1


def worker(args: tuple[list[tuple[str, str]], int, float, int]) -> dict[str, Any]:
    """One process: a thread per client; returns the merged statistics."""
    clients, chains, deadline_in_s, seed = args
    deadline = time.monotonic() + deadline_in_s
    stats = [ClientStats() for _ in clients]
    crashed: list[str] = []

    def guarded(i: int, target: str, plane: str) -> None:
        try:
            run_client(target, plane, chains, deadline, seed * 1000 + i, stats[i])
        except Exception as exc:  # a client that dies is a failure of the run, reported as such
            crashed.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=guarded, args=(i, t, p)) for i, (t, p) in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out: dict[str, Any] = {"ops": Counter(), "latency_us": [], "errors": Counter(), "examples": {}, "mismatches": 0,
                           "blocks_verified": 0, "misses": 0, "crashed": crashed}
    for s in stats:
        out["ops"].update(s.ops)
        out["latency_us"].extend(s.latency_us)
        out["errors"].update(s.errors)
        for k, v in s.error_examples.items():
            out["examples"].setdefault(k, v)
        out["mismatches"] += s.mismatches
        out["blocks_verified"] += s.blocks_verified
        out["misses"] += s.misses
    out["ops"] = dict(out["ops"])
    out["errors"] = dict(out["errors"])
    return out


# ----------------------------------------------------------------------------- daemon side


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssShmem"):
                out[name] = int(value.split()[0]) * 1024
    return out


def start_daemon(workdir: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, str]:
    sock = workdir / "kv.sock"
    port = free_port()
    ssd = (["--ssd-path", str(workdir / "ssd"), "--ssd-capacity", args.ssd_capacity, "--ssd-region-size", "4MiB"]
           if args.ssd_capacity not in ("0", "none") else [])
    cmd = [sys.executable, str(ROOT / "server.py"), "--listen", f"unix:{sock},127.0.0.1:{port}",
           "--host-capacity", args.host_capacity, *ssd, "--max-lease-ms", "5000", "--grace-s", "5",
           "--metrics-listen", "off", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    log = open(workdir / "daemon.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    log.close()
    unix, tcp = f"unix:{sock}", f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited: {(workdir / 'daemon.log').read_text()[-2000:]}")
        try:
            with Client(tcp, timeout_s=2, data_plane="grpc") as kv:
                kv.stats()
            with Client(unix, timeout_s=2, data_plane="local") as kv:
                kv.warm_up(60)
            return proc, unix, tcp
        except KVStoreError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("daemon did not start in 60 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_S", 120)))
    p.add_argument("--clients", type=int, default=int(os.environ.get("SOAK_CLIENTS", 32)))
    p.add_argument("--processes", type=int, default=4, help="worker processes the clients are spread over")
    p.add_argument("--chains", type=int, default=600, help="distinct 8-block chains in the key space")
    p.add_argument("--host-capacity", default="32MiB")
    p.add_argument("--ssd-capacity", default="96MiB",
                   help="0: no SSD tier (host memory only: evictions drop blocks, in batches)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = p.parse_args()
    if args.clients < 1 or args.seconds <= 0:
        p.error("--clients and --seconds must be positive")

    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as tmp:
        workdir = Path(tmp)
        proc, unix, tcp = start_daemon(workdir, args)
        try:
            clients = [(unix, "local") if i % 2 == 0 else (tcp, "grpc") for i in range(args.clients)]
            nproc = max(1, min(args.processes, args.clients))
            parts = [clients[i::nproc] for i in range(nproc)]
            rss: dict[str, Any] = {}

            def sample_rss() -> None:
                time.sleep(args.seconds * WARM_UP_FRACTION)
                rss["start"] = rss_bytes(proc.pid)

            sampler = threading.Thread(target=sample_rss, daemon=True)
            started = time.monotonic()
            sampler.start()
            ctx = mp.get_context("spawn")
            with ctx.Pool(nproc) as pool:
                results = pool.map(worker, [(part, args.chains, args.seconds, i) for i, part in enumerate(parts)])
            elapsed = time.monotonic() - started
            sampler.join()
            rss["end"] = rss_bytes(proc.pid)
            with Client(tcp, data_plane="grpc") as kv:
                stats = kv.stats()
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                exit_code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_code = proc.wait()
        log_tail = (workdir / "daemon.log").read_text(errors="replace")[-3000:]

    ops: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    examples: dict[str, str] = {}
    latencies: list[float] = []
    mismatches = verified = misses = 0
    crashed: list[str] = []
    for r in results:
        ops.update(r["ops"])
        errors.update(r["errors"])
        for k, v in r["examples"].items():
            examples.setdefault(k, v)
        latencies.extend(r["latency_us"])
        mismatches += r["mismatches"]
        verified += r["blocks_verified"]
        misses += r["misses"]
        crashed.extend(r["crashed"])
    latencies.sort()
    total = sum(ops.values())
    unexpected = {k: v for k, v in errors.items() if k not in EXPECTED}
    growth = rss["end"]["VmRSS"] - rss["start"]["VmRSS"]
    tiers = {t.name: t for t in stats.tiers}

    if total == 0:
        failures.append("no operation completed")
    if mismatches:
        failures.append(f"{mismatches} fetched blocks differ from what was put")
    if unexpected:
        failures.append(f"unexpected errors: {unexpected}")
    if crashed:
        failures.append(f"{len(crashed)} clients crashed: {crashed[:3]}")
    if growth > RSS_GROWTH_BYTES:
        failures.append(f"daemon RSS grew {growth / 2**20:.1f} MiB after warm-up (limit {RSS_GROWTH_BYTES >> 20} MiB)")
    if stats.counters.checksum_failures:
        failures.append(f"{stats.counters.checksum_failures} checksum failures in the daemon")
    if exit_code != 0:
        failures.append(f"daemon exited {exit_code} on SIGTERM: {log_tail}")

    doc = {
        "seconds": round(elapsed, 2),
        "clients": args.clients,
        "processes": nproc,
        "planes": {"local": sum(1 for _, pl in clients if pl == "local"),
                   "grpc": sum(1 for _, pl in clients if pl == "grpc")},
        "block_bytes": BLOCK,
        "chains": args.chains,
        "host_capacity": args.host_capacity,
        "ssd_capacity": args.ssd_capacity,
        "ops": total,
        "ops_by_kind": dict(ops),
        "ops_per_s": round(total / elapsed, 1),
        "p50_us": round(percentile(latencies, 0.50), 1),
        "p99_us": round(percentile(latencies, 0.99), 1),
        "max_us": round(latencies[-1], 1) if latencies else 0.0,
        "mismatches": mismatches,
        "blocks_verified": verified,
        "fetch_misses": misses,
        "errors_by_status": dict(errors),
        "unexpected_errors": unexpected,
        "error_examples": examples,
        "rss_start_bytes": rss["start"]["VmRSS"],
        "rss_end_bytes": rss["end"]["VmRSS"],
        "rss_anon_start_bytes": rss["start"].get("RssAnon", 0),
        "rss_anon_end_bytes": rss["end"].get("RssAnon", 0),
        "rss_growth_limit_bytes": RSS_GROWTH_BYTES,
        "daemon": {
            "evictions": stats.counters.evictions,
            "checksum_failures": stats.counters.checksum_failures,
            "ssd_write_failures": stats.counters.ssd_write_failures,
            "host_demotions": tiers["host"].demotions if "host" in tiers else 0,
            "ssd_promotions_to_host": tiers["host"].promotions if "host" in tiers else 0,
            "ssd_drops": tiers["ssd"].drops if "ssd" in tiers else 0,
            "exit_code": exit_code,
        },
        "failures": failures,
        "passed": not failures,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")

    print(f"soak: {args.clients} clients ({doc['planes']['local']} shared-memory, {doc['planes']['grpc']} gRPC) "
          f"in {nproc} processes for {elapsed:.1f} s, {BLOCK >> 10} KiB blocks, host {args.host_capacity}, "
          f"ssd {args.ssd_capacity}")
    print(f"  ops {total}  ({doc['ops_per_s']} ops/s)  p50 {doc['p50_us'] / 1000:.2f} ms  "
          f"p99 {doc['p99_us'] / 1000:.2f} ms  max {doc['max_us'] / 1000:.2f} ms")
    print(f"  by kind: {dict(sorted(ops.items()))}")
    print(f"  blocks verified {verified}, mismatches {mismatches}, fetches that missed {misses}")
    print(f"  errors by status: {dict(errors) or 'none'} (unexpected: {unexpected or 'none'})")
    print(f"  daemon: evictions {stats.counters.evictions}, host->ssd demotions {doc['daemon']['host_demotions']}, "
          f"ssd->host promotions {doc['daemon']['ssd_promotions_to_host']}, ssd drops {doc['daemon']['ssd_drops']}")
    print(f"  daemon RSS {rss['start']['VmRSS'] / 2**20:.1f} MiB after warm-up -> {rss['end']['VmRSS'] / 2**20:.1f} "
          f"MiB at the end (growth {growth / 2**20:+.1f} MiB, limit {RSS_GROWTH_BYTES >> 20} MiB)")
    print(f"  {'PASS' if not failures else 'FAIL: ' + '; '.join(failures)}  -> {out}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
