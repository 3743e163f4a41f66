"""The tiers' acceptance run, end to end, against the real daemon as a subprocess.

1. `--host-capacity 64MiB --ssd-capacity 2GiB`: put 512 MiB of 1 MiB blocks (chains of
   16), sampling `kvstore stats` while putting; host use must never exceed its capacity.
2. Every block fetches byte-exact (most from SSD); per-tier stats are printed as JSON.
3. After the SSD write queue drains: `kill -9`, restart on the same `--ssd-path`, every
   block is still a hit and fetches verify.
4. Graceful stop, flip one byte in a region file, restart: that block is a counted miss.

Block bytes are derived from (chain, index) so nothing is kept in memory to compare.
Usage: python bench/tiers_acceptance.py [DIR]. Prints a summary; JSON to bench/results/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvstore.cli.common import message_to_dict
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.layout import KVLayout
from kvstore.tiers.ssd import RECORD

LAYOUT = KVLayout(model="acceptance/llama-like", dtype="bfloat16", num_layers=8, num_kv_heads=8, head_dim=128,
                  block_size_tokens=32)  # 2 * 8 * 32 * 8 * 128 * 2 = 1 MiB per block
CHAINS, PER_CHAIN = 32, 16  # 512 blocks = 512 MiB


def block(chain: int, i: int) -> bytes:
    seed = int.from_bytes(hashlib.blake2b(f"{chain}/{i}".encode(), digest_size=8).digest(), "big")
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8).tobytes()


def tokens(chain: int) -> list[int]:
    return [chain * 1_000_000 + t for t in range(PER_CHAIN * LAYOUT.block_size_tokens)]


def start(base: str) -> tuple[subprocess.Popen[bytes], str]:
    sock = os.path.join(base, "kv.sock")
    args = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix:{sock}", "--host-capacity", "64MiB",
            "--ssd-path", os.path.join(base, "ssd"), "--ssd-capacity", "2GiB", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    proc = subprocess.Popen(args, env=env)
    target = f"unix:{sock}"
    for _ in range(600):
        if os.path.exists(sock):
            try:
                with Client(target, timeout_s=2) as kv:
                    kv.stats()
                return proc, target
            except KVStoreError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("daemon did not start")


def tiers(kv: Client) -> dict[str, dict]:
    return {t["name"]: t for t in message_to_dict(kv.stats())["tiers"]}


def verify_all(kv: Client) -> tuple[int, int, dict[str, int]]:
    hits = exact = 0
    where: dict[str, int] = {}
    for c in range(CHAINS):
        hit = kv.lookup(LAYOUT, tokens(c))
        hits += hit.num_blocks
        for t in hit.tiers:
            where[t] = where.get(t, 0) + 1
        got = kv.fetch(LAYOUT, tokens(c))
        exact += sum(1 for i, b in enumerate(got) if b == block(c, i))
    return hits, exact, where


def main() -> int:
    base = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="kvstore-accept-", dir=".")
    report: dict[str, object] = {}
    proc, target = start(base)
    try:
        max_host = 0
        t = time.perf_counter()
        with Client(target) as kv:
            for c in range(CHAINS):
                kv.put(LAYOUT, tokens(c), [block(c, i) for i in range(PER_CHAIN)])
                max_host = max(max_host, tiers(kv)["host"]["used_bytes"])
            report["put_seconds"] = round(time.perf_counter() - t, 2)
            report["host_capacity"] = tiers(kv)["host"]["capacity_bytes"]
            report["host_used_max_sampled"] = max_host
            hits, exact, where = verify_all(kv)
            report["phase1"] = {"blocks": CHAINS * PER_CHAIN, "hits": hits, "byte_exact": exact, "served_from": where}
            t = time.perf_counter()
            while tiers(kv)["ssd"]["pending_writes"]:
                time.sleep(0.05)
            report["drain_seconds"] = round(time.perf_counter() - t, 2)
            report["stats_before_kill"] = {n: {k: v[k] for k in ("used_bytes", "blocks", "promotions", "demotions",
                                                                  "drops", "checksum_failures", "pending_writes",
                                                                  "io_mode")}
                                           for n, v in tiers(kv).items() if v["present"]}
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t = time.perf_counter()
        proc, target = start(base)
        report["restart_seconds_after_kill"] = round(time.perf_counter() - t, 2)
        with Client(target) as kv:
            hits, exact, where = verify_all(kv)
            report["after_kill9"] = {"hits": hits, "byte_exact": exact, "served_from": where}
        proc.terminate()
        proc.wait(60)
        # Flip one payload byte of the first record in the first region.
        region = os.path.join(base, "ssd", "region-00000.kvr")
        with open(region, "r+b") as fh:
            fh.seek(RECORD.size + 1000)
            byte = fh.read(1)
            fh.seek(RECORD.size + 1000)
            fh.write(bytes([byte[0] ^ 0xFF]))
        t = time.perf_counter()
        proc, target = start(base)
        report["restart_seconds_after_clean_stop"] = round(time.perf_counter() - t, 2)
        with Client(target) as kv:
            hits, exact, where = verify_all(kv)
            ssd = tiers(kv)["ssd"]
            report["after_flip"] = {"hits_before_fetch_verification": hits, "byte_exact_served": exact,
                                    "ssd_checksum_failures": ssd["checksum_failures"],
                                    "store_checksum_failures": message_to_dict(kv.stats())["counters"]["checksum_failures"]}
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        if len(sys.argv) <= 1:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(report, indent=2))
    os.makedirs("bench/results", exist_ok=True)
    with open(f"bench/results/acceptance-{int(time.time())}.json", "w") as fh:
        json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
