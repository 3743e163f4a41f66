"""H2D / D2H bandwidth of the HBM tier's copier next to a plain `tensor.copy_` baseline.

Both are measured in the same run on the same pinned buffers: the baseline is one large
synchronous `copy_` per direction; the copier path moves 1 MiB blocks through the HBM
tier (staging, FIFO streams, events polled from asyncio), as the daemon does.
Prints GB/s; writes JSON to bench/results/. Needs CUDA.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import torch

from kvstore.tiers.hbm import HbmTier

BLOCK = 1 << 20
BLOCKS = int(os.environ.get("KVSTORE_BENCH_BLOCKS", "512"))


def baseline(total: int) -> tuple[float, float]:
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    dev.copy_(host)
    torch.cuda.synchronize()
    t = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = total / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    d2h = total / (time.perf_counter() - t) / 1e9
    return h2d, d2h


async def tier_path(total: int) -> tuple[float, float]:
    tier = HbmTier(total + (64 << 20))
    data = os.urandom(BLOCK)
    slots = [tier.allocate(BLOCK) for _ in range(total // BLOCK)]
    await asyncio.gather(*(tier.write(s, 0, data) for s in slots[:8] if s))  # warm the staging pool
    t = time.perf_counter()
    await asyncio.gather(*(tier.write(s, 0, data) for s in slots if s))
    h2d = total / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    got = await asyncio.gather(*(tier.read(s, BLOCK) for s in slots if s))
    d2h = total / (time.perf_counter() - t) / 1e9
    assert all(g == data for g in got)
    tier.close()
    return h2d, d2h


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    total = BLOCKS * BLOCK
    b_h2d, b_d2h = baseline(total)
    t_h2d, t_d2h = asyncio.run(tier_path(total))
    result = {
        "device": torch.cuda.get_device_name(0), "bytes": total, "block_bytes": BLOCK,
        "baseline_copy_h2d_gbps": round(b_h2d, 2), "baseline_copy_d2h_gbps": round(b_d2h, 2),
        "hbm_tier_h2d_gbps": round(t_h2d, 2), "hbm_tier_d2h_gbps": round(t_d2h, 2),
    }
    print(f"{result['device']}: {total >> 20} MiB in 1 MiB blocks")
    print(f"  H2D  tensor.copy_ {b_h2d:6.2f} GB/s   hbm tier {t_h2d:6.2f} GB/s   ratio {t_h2d / b_h2d:.2f}")
    print(f"  D2H  tensor.copy_ {b_d2h:6.2f} GB/s   hbm tier {t_d2h:6.2f} GB/s   ratio {t_d2h / b_d2h:.2f}")
    os.makedirs("bench/results", exist_ok=True)
    with open(f"bench/results/gpu-bandwidth-{int(time.time())}.json", "w") as fh:
        json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
