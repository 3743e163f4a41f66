"""The device data plane (CUDA IPC) next to a plain device-to-device `copy_` baseline.

A daemon subprocess with an HBM tier (puts land in HBM); this process is the engine.
Puts and fetches of 32 CUDA tensors of 1 MiB per call go device-to-device through the
opened slab, each copy verified on the host (a device->host copy and XXH3 per block,
see docs/local-data-plane.md); the baseline is the same 32 copies by `copy_` alone.
Prints GB/s; writes JSON to bench/results/. Needs CUDA; says so and exits 0 without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.client import Client, KVLayout  # noqa: E402
from kvstore.tiers.cuda import cuda_available  # noqa: E402

BLOCK = 1 << 20
BATCH = 32
SECONDS = float(os.environ.get("KVSTORE_BENCH_SECONDS", "1.5"))
LAYOUT = KVLayout(model="bench-device", dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=BLOCK // 32,
                  block_size_tokens=16)


def timed(fn, seconds: float) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call of fn, after one warm-up."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> int:
    if not cuda_available():
        print("no CUDA device: nothing to measure")
        return 0
    import torch

    gbps = lambda per_call: BATCH * BLOCK / per_call / 1e9  # noqa: E731
    src = [torch.randint(0, 255, (BLOCK,), dtype=torch.uint8, device="cuda:0") for _ in range(BATCH)]
    dst = [torch.empty(BLOCK, dtype=torch.uint8, device="cuda:0") for _ in range(BATCH)]

    def baseline() -> None:
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()

    base = gbps(timed(baseline, SECONDS))
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-device-") as tmp:
        sock = Path(tmp) / "kv.sock"
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "server.py"), "--listen", f"unix:{sock}", "--host-capacity", "256MiB",
             "--hbm-capacity", "1GiB", "--put-tier", "hbm", "--shm-dir", tmp, "--log-level", "warning",
             "--metrics-listen", "off"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not sock.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the daemon did not start")
                time.sleep(0.1)
            with Client(f"unix:{sock}", timeout_s=30, reserve_ahead=BATCH) as kv:
                kv.warm_up()

                def put() -> None:
                    kv.put(LAYOUT, None, src, block_hashes=[os.urandom(16) for _ in range(BATCH)])

                put_gbps = gbps(timed(put, SECONDS))
                if not kv.device_plane_in_use:
                    raise RuntimeError("the device plane was not used; see the client's log")
                hashes = [os.urandom(16) for _ in range(BATCH)]
                kv.put(LAYOUT, None, src, block_hashes=hashes)

                def fetch() -> None:
                    if len(kv.fetch(LAYOUT, block_hashes=hashes, out=dst)) != BATCH:
                        raise RuntimeError("a fetch came back short")

                fetch_gbps = gbps(timed(fetch, SECONDS))
                if not all(torch.equal(d, s) for d, s in zip(dst, src)):
                    raise RuntimeError("the device plane returned different bytes")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    result = {"device": torch.cuda.get_device_name(0), "block_bytes": BLOCK, "batch": BATCH,
              "baseline_d2d_copy_gbps": round(base, 2), "device_plane_put_gbps": round(put_gbps, 2),
              "device_plane_fetch_gbps": round(fetch_gbps, 2)}
    print(f"{result['device']}: {BATCH} x 1 MiB per call")
    print(f"  D2D copy_ {base:7.2f} GB/s   device plane put {put_gbps:6.2f} GB/s   fetch {fetch_gbps:6.2f} GB/s "
          "(each verified on the host)")
    os.makedirs(ROOT / "bench" / "results", exist_ok=True)
    (ROOT / "bench" / "results" / f"device-plane-{int(time.time())}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
