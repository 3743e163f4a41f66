"""SSD tier sequential write and read of 1 MiB blocks, with `dd` O_DIRECT as the limit.

Both run in the same invocation on the same directory, alternating for a few rounds
(medians reported, each round kept in the JSON): `dd` (write with oflag=direct, read
back with iflag=direct), then the SSD tier's `put_block` and
`get_block` with 4 blocks in flight (the daemon's default `ssd_io_threads`).
The tier's figures include its record headers, alignment and per-block checksum-free
framing; the codec is off for the raw I/O comparison (random bytes would be stored raw
anyway) and measured separately on bf16 data for its CPU cost.

Usage: python bench/ssd_bench.py [DIR] (default: a temp dir under the current one).
KVSTORE_BENCH_MIB sets the volume (default 512). Results go to bench/results/.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvstore.checksum import checksum
from kvstore.core.tier import BlockMeta
from kvstore.tiers.ssd import SsdTier

BLOCK = 1 << 20
MIB = int(os.environ.get("KVSTORE_BENCH_MIB", "512"))
ROUNDS = int(os.environ.get("KVSTORE_BENCH_ROUNDS", "3"))
IN_FLIGHT = int(os.environ.get("KVSTORE_BENCH_IN_FLIGHT", "4"))  # the daemon's default ssd_io_threads


def dd(args: list[str]) -> float:
    """GB/s that dd reports (it prints e.g. '..., 1.9 GB/s' on stderr)."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"copied, ([0-9.]+) s", out)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {out}")
    nbytes = int(re.search(r"^(\d+) bytes", out, re.M).group(1))  # type: ignore[union-attr]
    return nbytes / float(m.group(1)) / 1e9


async def tier_run(path: str, blocks: list[bytes], compress: bool) -> dict[str, float | str]:
    tier = SsdTier(path, (MIB + 64) << 20, region_size=64 << 20, compress=compress, io_threads=IN_FLIGHT)
    metas = [BlockMeta(i.to_bytes(32, "big"), None, checksum(b), 2) for i, b in enumerate(blocks)]
    sem = asyncio.Semaphore(IN_FLIGHT)

    async def put(i: int) -> object:
        async with sem:
            return await tier.put_block(metas[i], blocks[i])

    t = time.perf_counter()
    slots = await asyncio.gather(*(put(i) for i in range(len(blocks))))
    os.sync()
    write = len(blocks) * BLOCK / (time.perf_counter() - t) / 1e9

    async def get(i: int) -> bytes:
        async with sem:
            return await tier.get_block(slots[i], BLOCK)  # type: ignore[arg-type]

    t = time.perf_counter()
    got = await asyncio.gather(*(get(i) for i in range(len(blocks))))
    read = len(blocks) * BLOCK / (time.perf_counter() - t) / 1e9
    assert all(g == b for g, b in zip(got, blocks)), "the SSD tier returned different bytes"
    mode = tier.io_mode
    facts = tier.describe()
    tier.close()
    return {"write_gbps": write, "read_gbps": read, "io_mode": mode, "compressed_blocks": facts["compressed_blocks"]}


def bf16_blocks(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [((rng.normal(0, 0.5, BLOCK // 2).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)).tobytes()
            for _ in range(n)]


def main() -> int:
    base = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="kvstore-ssd-bench-", dir=".")
    os.makedirs(base, exist_ok=True)
    dd_file = os.path.join(base, "dd.bin")
    blocks = [os.urandom(BLOCK) for _ in range(MIB)]
    # A shared disk is noisy: alternate dd and the tier for ROUNDS rounds, report medians.
    dd_ws, dd_rs, raws = [], [], []
    try:
        for r in range(ROUNDS):
            dd_ws.append(dd(["if=/dev/zero", f"of={dd_file}", "bs=1M", f"count={MIB}", "oflag=direct", "conv=fsync"]))
            dd_rs.append(dd([f"if={dd_file}", "of=/dev/null", "bs=1M", "iflag=direct"]))
            os.unlink(dd_file)
            raws.append(asyncio.run(tier_run(os.path.join(base, f"raw{r}"), blocks, compress=False)))
            shutil.rmtree(os.path.join(base, f"raw{r}"), ignore_errors=True)
        codec_n = min(MIB, 128)
        codec = asyncio.run(tier_run(os.path.join(base, "codec"), bf16_blocks(codec_n), compress=True))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    dd_w, dd_r = statistics.median(dd_ws), statistics.median(dd_rs)
    raw = {"write_gbps": statistics.median(float(x["write_gbps"]) for x in raws),
           "read_gbps": statistics.median(float(x["read_gbps"]) for x in raws), "io_mode": raws[0]["io_mode"]}
    result = {
        "volume_mib": MIB, "block_bytes": BLOCK, "in_flight": IN_FLIGHT, "rounds": ROUNDS,
        "dd_direct_write_gbps_each": [round(x, 3) for x in dd_ws],
        "ssd_tier_write_gbps_each": [round(float(x["write_gbps"]), 3) for x in raws],
        "dd_direct_read_gbps_each": [round(x, 3) for x in dd_rs],
        "ssd_tier_read_gbps_each": [round(float(x["read_gbps"]), 3) for x in raws],
        "dd_direct_write_gbps": round(dd_w, 3), "dd_direct_read_gbps": round(dd_r, 3),
        "ssd_tier_write_gbps": round(float(raw["write_gbps"]), 3),
        "ssd_tier_read_gbps": round(float(raw["read_gbps"]), 3), "ssd_tier_io_mode": raw["io_mode"],
        "write_ratio_vs_dd": round(float(raw["write_gbps"]) / dd_w, 3),
        "read_ratio_vs_dd": round(float(raw["read_gbps"]) / dd_r, 3),
        "codec_bf16_write_gbps": round(float(codec["write_gbps"]), 3),
        "codec_bf16_read_gbps": round(float(codec["read_gbps"]), 3),
        "codec_bf16_compressed_blocks": f"{codec['compressed_blocks']}/{codec_n}",
    }
    print(f"SSD tier vs dd O_DIRECT, {MIB} MiB of 1 MiB blocks, same directory, same run ({raw['io_mode']} I/O), "
          f"median of {ROUNDS} alternating rounds")
    print(f"  write: dd {dd_w:.2f} GB/s   ssd tier {raw['write_gbps']:.2f} GB/s   ratio {result['write_ratio_vs_dd']}")
    print(f"  read:  dd {dd_r:.2f} GB/s   ssd tier {raw['read_gbps']:.2f} GB/s   ratio {result['read_ratio_vs_dd']}")
    print(f"  with codec on bf16 blocks: write {codec['write_gbps']:.2f} GB/s, read {codec['read_gbps']:.2f} GB/s, "
          f"{result['codec_bf16_compressed_blocks']} stored compressed")
    os.makedirs("bench/results", exist_ok=True)
    with open(f"bench/results/ssd-{int(time.time())}.json", "w") as fh:
        json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
