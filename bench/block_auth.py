"""What end-to-end block authentication costs (kvstore.client.block_auth; SECURITY.md).

One daemon (auth off, loopback), the same payloads put and fetched through the SDK with
and without authentication, on the shared-memory plane (Unix socket) and on the data
lane (TCP), for 256 KiB, 1 MiB and 4 MiB blocks in batches of 32. The two variants take
turns round by round (plain, authenticated, plain, ...) so that load from elsewhere on
the machine falls on both; each cell reports the median round's throughput, and the
ratio authenticated / plain of the same run, and the CPU seconds per GB moved (the SDK's
process and the daemon's together) with their ratio plain / authenticated: on a busy
machine the throughput of each round spreads widely, the CPU it takes much less. Each put stores new blocks (fresh token
ids); fetches read the same batch again (held in the host tier). Only the SDK's calls
are timed. `put` hands the SDK the payloads in the caller's buffers (the authenticated
put copies each next to its tag); `put_inplace` writes them into the buffers the
authenticated client hands out (`batch`), where they are tagged in place.

For scale, the same run times the MACs alone on one block (GMAC through AES-GCM, the one
used; keyed BLAKE3, HMAC-SHA256 and keyed BLAKE2b), and memcpy.

Writes JSON to bench/results/block_auth.json and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.client import Client, KVLayout  # noqa: E402
from kvstore.client.block_auth import AuthenticatedClient, BlockKey  # noqa: E402

BATCH = 32
GB = 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def layout_of(block_bytes: int) -> KVLayout:
    # 2 (K/V) x 4 layers x 16 tokens x 8 heads x D dims x 2 bytes
    return KVLayout(model="bench/block-auth", dtype="float16", num_layers=4, num_kv_heads=8,
                    head_dim=block_bytes // (2 * 4 * 16 * 8 * 2), block_size_tokens=16)


def start_daemon(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    sock = tmp / "kv.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix:{sock},127.0.0.1:{port}",
                             "--host-capacity", "3GiB", "--metrics-listen", "off", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "daemon.log", "wb"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with Client(f"unix:{sock}", timeout_s=2) as kv:
                kv.stats()
            return proc
        except Exception:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the daemon did not start; see {tmp / 'daemon.log'}")


def mac_rates(block_bytes: int) -> dict[str, float]:
    """GB/s of each MAC (and memcpy) over one block, on one thread (BLAKE3: as used)."""
    import blake3
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    data = os.urandom(block_bytes)
    key = os.urandom(32)
    gcm, nonce = AESGCM(key), os.urandom(12)
    buf = bytearray(block_bytes)
    threads = blake3.blake3.AUTO if block_bytes >= (1 << 20) else 1
    fns = {
        "blake3_keyed": lambda: blake3.blake3(data, key=key, max_threads=threads).digest(),
        "hmac_sha256": lambda: hmac.digest(key, data, "sha256"),
        "blake2b_keyed": lambda: hashlib.blake2b(data, key=key, digest_size=32).digest(),
        "gmac_aes_gcm": lambda: gcm.encrypt(nonce, b"", data),
        "memcpy": lambda: buf.__setitem__(slice(None), data),
    }
    out = {}
    for name, fn in fns.items():
        n = max(5, (512 << 20) // block_bytes)
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = n * block_bytes / (time.perf_counter() - t0) / GB
    return out


def daemon_cpu_s(pid: int) -> float:
    """CPU seconds the daemon process has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cell(plain: Client, auth: AuthenticatedClient, layout: KVLayout, rounds: int, round_s: float,
         seed: int, daemon_pid: int) -> dict[str, dict[str, float]]:
    """Put and fetch GB/s, plain and authenticated, rounds taken in turn."""
    bst = layout.block_size_tokens
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 256, layout.bytes_per_block, dtype=np.uint8).tobytes() for _ in range(BATCH)]
    counter = [seed * 100_000_000]

    def fresh() -> list[int]:
        counter[0] += BATCH * bst
        return list(range(counter[0], counter[0] + BATCH * bst))

    fetch_tokens = fresh()
    plain.put(layout, fetch_tokens, payloads)
    auth.put(layout, fetch_tokens, payloads)
    assert [bytes(b) for b in plain.fetch(layout, fetch_tokens)] == payloads
    assert [bytes(b) for b in auth.fetch(layout, fetch_tokens)] == payloads
    variants = {"put": ("plain", "auth"), "put_inplace": ("plain", "auth"), "fetch": ("plain", "auth")}
    rates: dict[str, dict[str, list[float]]] = {op: {v: [] for v in vs} for op, vs in variants.items()}
    # CPU seconds (this process and the daemon's) per GB moved: on a busy machine the
    # wall-clock rates spread widely, the CPU the work takes much less.
    cpu: dict[str, dict[str, list[float]]] = {op: {v: [] for v in vs} for op, vs in variants.items()}
    for _ in range(rounds):
        for op, vs in variants.items():
            for variant in vs:
                moved, busy, spent = 0, 0.0, 0.0
                while busy < round_s:
                    # Only the SDK's call is timed: the payloads are the engine's, written
                    # before it (into its own buffers, or for `put_inplace` into the
                    # sealing buffers `batch` hands out).
                    if op == "fetch":
                        t0, c0, d0 = time.perf_counter(), time.process_time(), daemon_cpu_s(daemon_pid)
                        got = (plain if variant == "plain" else auth).fetch(layout, fetch_tokens)
                        busy += time.perf_counter() - t0
                        spent += time.process_time() - c0 + daemon_cpu_s(daemon_pid) - d0
                        assert len(got) == BATCH
                    else:
                        toks = fresh()
                        blocks: object = payloads
                        if variant == "auth" and op == "put_inplace":
                            batch = auth.batch(layout, BATCH)
                            for dst, src in zip(batch.payloads, payloads):
                                dst[:] = src
                            blocks = batch
                        t0, c0, d0 = time.perf_counter(), time.process_time(), daemon_cpu_s(daemon_pid)
                        r = (plain if variant == "plain" else auth).put(layout, toks, blocks)  # type: ignore[arg-type]
                        busy += time.perf_counter() - t0
                        spent += time.process_time() - c0 + daemon_cpu_s(daemon_pid) - d0
                        assert r.stored == BATCH
                    moved += BATCH * layout.bytes_per_block
                rates[op][variant].append(moved / busy / GB)
                cpu[op][variant].append(spent / (moved / GB))
    out: dict[str, dict[str, float]] = {}
    for op, by in rates.items():
        p, a = statistics.median(by["plain"]), statistics.median(by["auth"])
        pc, ac = statistics.median(cpu[op]["plain"]), statistics.median(cpu[op]["auth"])
        out[op] = {"plain_gbps": p, "auth_gbps": a, "ratio": a / p, "plain_cpu_s_per_gb": pc,
                   "auth_cpu_s_per_gb": ac, "cpu_ratio": pc / ac}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-s", type=float, default=0.4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "block_auth.json"))
    args = ap.parse_args()
    sizes = [int(s[:-3]) << (10 if s.endswith("KiB") else 20) for s in args.sizes.split(",")]
    key = BlockKey.generate()
    results: list[dict[str, object]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-auth-") as tmp:
        port = free_port()
        proc = start_daemon(Path(tmp), port)
        try:
            for size in sizes:
                layout = layout_of(size)
                macs = mac_rates(size)
                for plane, target in (("shm", f"unix:{Path(tmp) / 'kv.sock'}"), ("lane", f"127.0.0.1:{port}")):
                    mode = "local" if plane == "shm" else "lane"
                    with Client(target, data_plane=mode, timeout_s=60) as kv:
                        got = cell(kv, AuthenticatedClient(kv, key), layout, args.rounds, args.round_s,
                                   seed=2 * sizes.index(size) + (2 if plane == "lane" else 1), daemon_pid=proc.pid)
                        assert kv.data_plane_in_use == mode
                    for op, r in got.items():
                        results.append({"plane": plane, "op": op, "block_bytes": size, "batch": BATCH, **r})
                results.append({"macs_gbps": macs, "block_bytes": size})
        finally:
            proc.terminate()
            proc.wait(30)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # Load from elsewhere on the machine falls on both variants (they take turns), but a
    # busy machine spreads the rounds: the load average says how busy it was.
    info = {"machine": os.uname().machine, "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "loadavg_before": load_before[0], "loadavg_after": os.getloadavg()[0]}
    Path(args.out).write_text(json.dumps({"info": info, "results": results}, indent=2))
    print(f"end-to-end block authentication (AES-256-GMAC under a key per block, 28-byte trailer), batch {BATCH}, median of "
          f"{args.rounds} rounds taken in turn; {info['cpus']} CPUs, load average {load_before[0]:.1f} before, "
          f"{info['loadavg_after']:.1f} after")
    print(f"{'plane':5} {'op':11} {'block':>7} {'plain GB/s':>10} {'auth GB/s':>9} {'auth/plain':>10}  "
          f"{'plain CPU s/GB':>14} {'auth CPU s/GB':>13} {'plain/auth CPU':>14}")
    for r in results:
        if "plane" in r:
            print(f"{r['plane']:5} {r['op']:11} {int(r['block_bytes']) >> 10:>5}Ki {r['plain_gbps']:>10.2f} "
                  f"{r['auth_gbps']:>9.2f} {r['ratio']:>9.2f}x  {r['plain_cpu_s_per_gb']:>14.3f} "
                  f"{r['auth_cpu_s_per_gb']:>13.3f} {r['cpu_ratio']:>13.2f}x")
    print("one block, one thread (BLAKE3: its own threads from 1 MiB), GB/s:")
    for r in results:
        if "macs_gbps" in r:
            macs = r["macs_gbps"]
            assert isinstance(macs, dict)
            print(f"  {int(r['block_bytes']) >> 10:>5}Ki  " + "  ".join(f"{k} {v:.2f}" for k, v in macs.items()))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
