"""The SGLang HiCache backend (kvstore.client.sglang) moving 128-page batches between SGLang's
real host pool and a kvstore daemon, next to the limit and SGLang's own `file` backend,
all in one run.

Each round makes one call of every row below, back to back, in an order turned by one
each round; a row's GB/s is the median over the rounds, a ratio the median of the
rounds' ratios (so rows compared ran seconds apart, whatever else loads the machine):

- `copy limit`: the same pages copied between two host pools with plain memcpy
  (`np.copyto` of each page's pieces), with one thread and with two (kvstore's shared-memory
  client copies with two); the better of the two is the limit the ratios use;
- `kvstore shm`: `batch_set_v1` / `batch_get_v1` through the backend, co-located (a Unix
  socket target: the shared-memory plane);
- `kvstore lane`: the same over the data lane (a TCP target on loopback);
- `kvstore grpc`: the same with the block bytes in gRPC messages;
- `sglang file`: SGLang's built-in `file` backend (`HiCacheFile`) on the same disk
  (`--dir`), driven as SGLang drives it (no zero-copy interface: `get_data_page` then
  `batch_set`; `batch_get` into flat pages, then `set_from_flat_data_page`). Its files
  were just written, so reads come from the page cache: a ceiling for it, not its disk.

Every set stores pages under new keys (a key already held is not copied again by either
store); every get loads pages that are held. The host pool is SGLang's
`MHATokenToKVPoolHost` in page_first layout, bf16, `--layers` layers, 8 KV heads of 128,
64-token pages: one page is two pieces (K and V) of `layers` x 128 KiB each.

Run it with the SGLang venv: `make bench-sglang` (QUICK=1: 5 rounds instead of 25).
Writes bench/results/sglang_backend.json and bench/results/sglang_backend.md.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # SGLang's layers warn about GPU-only quantizations on import
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from peers.common import free_port  # noqa: E402

from kvstore.client import Client  # noqa: E402
from kvstore.errors import KVStoreError  # noqa: E402

GB = 1e9
PAGE_TOKENS = 64
HEADS, HEAD_DIM = 8, 128
BATCH = STORAGE_BATCH_SIZE


def host_pool(layers: int, pages: int) -> Any:
    """SGLang's MHA host pool, page_first, bf16, with room for `pages` pages."""
    capacity = pages * PAGE_TOKENS // 2  # the host pool is twice the "device" capacity
    k = tuple(torch.zeros(PAGE_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(PAGE_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v]), layout=KVBufferLayout.NHD),
        page_size=PAGE_TOKENS, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 2.0, 0, PAGE_TOKENS, "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=capacity, start_layer=0, end_layer=layers)
    # Random bytes (a 64 MiB draw, repeated: drawing a GiB takes longer than the benchmark).
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    chunk = torch.randint(0, 256, (min(flat.numel(), 64 << 20),), dtype=torch.uint8)
    for start in range(0, flat.numel(), chunk.numel()):
        part = flat[start : start + chunk.numel()]
        part.copy_(chunk[: part.numel()])
    return pool


class Keys:
    """Fresh SGLang-shaped page keys (64 hex characters), a batch at a time."""

    def __init__(self, tag: str) -> None:
        self._tag = tag.encode()
        self._count = itertools.count()

    def batch(self, n: int = BATCH) -> list[str]:
        return [hashlib.sha256(self._tag + next(self._count).to_bytes(8, "little")).hexdigest() for _ in range(n)]


def storage_config(model: str, extra: dict[str, Any] | None) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model, extra_config=extra)


def kvstore_backend(target: str, plane: str, pool: Any) -> Any:
    cfg = storage_config("bench/sglang", {"backend_name": "kvstore", "module_path": "kvstore.client.sglang",
                                          "class_name": "HiCacheKVStore", "interface_v1": 1, "target": target,
                                          "data_plane": plane, "timeout_s": 60})
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def file_backend(directory: Path, pool: Any) -> Any:
    backend = StorageBackendFactory.create_backend("file", storage_config("bench/sglang", {
        "file_storage_path": str(directory)}), pool)
    backend.register_mem_pool_host(pool)
    return backend


def gbps(page_bytes: int, times: list[float]) -> float:
    return BATCH * page_bytes * len(times) / sum(times) / GB


# ----------------------------------------------------------------------- cells


class Cell:
    """One row of the table: `call()` does one timed batch (128 pages) and returns its
    seconds; whatever must happen between calls (clean-up) is done inside, untimed."""

    def __init__(self, system: str, op: str, call: Callable[[], float]) -> None:
        self.system, self.op, self.call = system, op, call


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def copy_cell(src: Any, dst: Any, threads: int) -> Cell:
    """Plain memcpy of 128 pages' pieces from one host pool into another."""
    s_idx, d_idx = src.alloc(BATCH * PAGE_TOKENS), dst.alloc(BATCH * PAGE_TOKENS)
    s_ptr, sizes = src.get_page_buffer_meta(s_idx)
    d_ptr, _ = dst.get_page_buffer_meta(d_idx)
    s_base, d_base = src.kv_buffer.data_ptr(), dst.kv_buffer.data_ptr()
    s_arr = src.kv_buffer.view(-1).view(torch.uint8).numpy()
    d_arr = dst.kv_buffer.view(-1).view(torch.uint8).numpy()
    pairs = [(d_arr[d - d_base : d - d_base + n], s_arr[s - s_base : s - s_base + n])
             for s, d, n in zip(s_ptr, d_ptr, sizes)]
    pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def run(part: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for d, s in part:
            np.copyto(d, s)

    def call() -> float:
        if pool is None:
            return timed(lambda: run(pairs))[0]
        return timed(lambda: list(pool.map(run, [pairs[i::threads] for i in range(threads)])))[0]

    return Cell(f"copy limit ({threads} thread{'s' if threads > 1 else ''})", "copy", call)


def kvstore_cells(plane: str, writer: Any, reader: Any, w_pool: Any, r_pool: Any, keys: Keys) -> list[Cell]:
    """batch_set_v1 of pages under fresh keys; batch_get_v1 of pages the daemon holds."""
    w_idx, r_idx = w_pool.alloc(BATCH * PAGE_TOKENS), r_pool.alloc(BATCH * PAGE_TOKENS)
    held = keys.batch()
    if not all(writer.batch_set_v1(held, w_idx)):
        raise RuntimeError("the first batch_set_v1 failed; is the daemon's host tier big enough?")

    def put() -> float:
        seconds, ok = timed(lambda: writer.batch_set_v1(keys.batch(), w_idx))
        if not all(ok):
            raise RuntimeError(f"kvstore {plane}: a batch_set_v1 failed; the figures would not be real")
        return seconds

    def get() -> float:
        seconds, ok = timed(lambda: reader.batch_get_v1(held, r_idx))
        if not all(ok):
            raise RuntimeError(f"kvstore {plane}: a batch_get_v1 missed pages it holds (evicted?)")
        return seconds

    return [Cell(f"kvstore {plane}", "set", put), Cell(f"kvstore {plane}", "get", get)]


def file_cells(writer: Any, reader: Any, w_pool: Any, r_pool: Any, keys: Keys) -> list[Cell]:
    """SGLang's `file` backend as its cache controller drives one without the zero-copy
    interface (`CacheController._generic_page_set` / `_generic_page_get`). Sets go to one
    directory, emptied after each call (untimed); gets read a batch held in another."""
    w_idx, r_idx = w_pool.alloc(BATCH * PAGE_TOKENS), r_pool.alloc(BATCH * PAGE_TOKENS)
    starts = [int(i) for i in w_idx[::PAGE_TOKENS]]
    r_starts = [int(i) for i in r_idx[::PAGE_TOKENS]]
    held = keys.batch()
    if not reader.batch_set(held, [w_pool.get_data_page(s) for s in starts]):
        raise RuntimeError("HiCacheFile.batch_set failed")

    def put() -> float:
        seconds, ok = timed(lambda: writer.batch_set(keys.batch(), [w_pool.get_data_page(s) for s in starts]))
        writer.clear()  # the files of this call, so the disk does not fill up
        if not ok:
            raise RuntimeError("HiCacheFile.batch_set failed")
        return seconds

    def get() -> float:
        def load() -> None:
            got = reader.batch_get(held, [r_pool.get_dummy_flat_data_page() for _ in held])
            for s, data in zip(r_starts, got):
                if data is None:
                    raise RuntimeError("HiCacheFile.batch_get missed a page it holds")
                r_pool.set_from_flat_data_page(s, data)

        return timed(load)[0]

    return [Cell("sglang file", "set", put), Cell("sglang file", "get", get)]


# ----------------------------------------------------------------------- the run


def start_daemon(workdir: Path, host_capacity: str) -> tuple[subprocess.Popen[bytes], str, str]:
    sock = workdir / "kv.sock"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "server.py"), "--listen", f"unix:{sock},127.0.0.1:{port}", "--host-capacity",
         host_capacity, "--log-level", "warning", "--metrics-listen", "off"], cwd=ROOT)
    deadline = time.monotonic() + 60
    while True:
        try:
            with Client(f"unix:{sock}", timeout_s=2) as kv:
                kv.stats()
            return proc, f"unix:{sock}", f"127.0.0.1:{port}"
        except KVStoreError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the daemon did not start") from None
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--rounds", type=int, default=25, help="rounds of one call of every cell")
    parser.add_argument("--layers", type=int, default=8, help="layers of the model's KV (a page is 2 x layers x 128 KiB)")
    parser.add_argument("--dir", default="", help="directory for SGLang's file backend (default: under bench/results)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "sglang_backend.json"))
    args = parser.parse_args()
    if args.quick:
        args.rounds = 5
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    file_parent = Path(args.dir) if args.dir else out.parent
    file_parent.mkdir(parents=True, exist_ok=True)

    page_bytes = 2 * args.layers * PAGE_TOKENS * HEADS * HEAD_DIM * 2
    batch_bytes = BATCH * page_bytes
    samples: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-sglang-") as tmp, \
            tempfile.TemporaryDirectory(prefix="kvstore-bench-sglang-file-", dir=file_parent) as file_dir, \
            host_memory_budget_scope(64 << 30):
        proc, unix_target, tcp_target = start_daemon(Path(tmp), f"{10 * batch_bytes}B")
        try:
            w_pool, r_pool = host_pool(args.layers, 6 * BATCH), host_pool(args.layers, 6 * BATCH)
            backends = {name: (kvstore_backend(target, plane, w_pool), kvstore_backend(target, plane, r_pool))
                        for name, plane, target in (("shm", "local", unix_target), ("lane", "lane", tcp_target),
                                                    ("grpc", "grpc", unix_target))}
            (Path(file_dir) / "sets").mkdir()
            (Path(file_dir) / "gets").mkdir()
            keys = Keys(f"{os.getpid()}-{time.time()}")
            cells = [copy_cell(w_pool, r_pool, 1), copy_cell(w_pool, r_pool, 2)]
            for name, (writer, reader) in backends.items():
                cells += kvstore_cells(name, writer, reader, w_pool, r_pool, keys)
            cells += file_cells(file_backend(Path(file_dir) / "sets", w_pool),
                                file_backend(Path(file_dir) / "gets", r_pool), w_pool, r_pool, keys)
            for cell in cells:  # warm-up: first calls map segments and fault pages in
                cell.call()
            # One call of every cell a round, the order turned by one each round: cells
            # compared in one round ran within seconds of each other, whatever the load.
            for r in range(args.rounds):
                shift = r % len(cells)
                for cell in cells[shift:] + cells[:shift]:
                    seconds = cell.call()
                    samples.setdefault((cell.system, cell.op), []).append(batch_bytes / seconds / GB)
                if (r + 1) % 5 == 0 or r + 1 == args.rounds:
                    print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
            planes = {name: w.get_stats().data_plane for name, (w, _) in backends.items()}
            for w, rd in backends.values():
                w.close()
                rd.close()
        finally:
            proc.terminate()
            proc.wait(30)

    # Ratios are taken round by round, each cell against the copy limit and the file
    # backend of its own round (measured minutes apart, on a shared machine the load of one
    # round is not the load of the next), then their median is reported.
    copies = [max(a, b) for a, b in zip(samples[("copy limit (1 thread)", "copy")],
                                        samples[("copy limit (2 threads)", "copy")])]
    med = {k: statistics.median(v) for k, v in samples.items()}
    limit = statistics.median(copies)
    rows = []
    for (system, op), values in samples.items():
        x_copy = [v / c for v, c in zip(values, copies)]
        file_same = samples.get(("sglang file", op))
        x_file = [v / f for v, f in zip(values, file_same)] if file_same and op != "copy" else None
        rows.append({"system": system, "op": op, "gbps": round(med[(system, op)], 3),
                     "gbps_range": f"{min(values):.2f}-{max(values):.2f}",
                     "x_copy_limit": round(statistics.median(x_copy), 3),
                     "x_copy_limit_range": f"{min(x_copy):.2f}-{max(x_copy):.2f}",
                     "x_sglang_file": round(statistics.median(x_file), 2) if x_file else None,
                     "samples_gbps": [round(v, 3) for v in values]})
    target = next(r["x_copy_limit"] for r in rows if (r["system"], r["op"]) == ("kvstore shm", "get"))
    # The same ratio against each copy alone (the limit above is the better one, round by round).
    shm_get = samples[("kvstore shm", "get")]
    per_copy = {name: round(statistics.median(v / c for v, c in zip(shm_get, samples[(name, "copy")])), 3)
                for name in ("copy limit (1 thread)", "copy limit (2 threads)")}
    report = {
        "benchmark": "sglang_backend", "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "setup": {"pages_per_batch": BATCH, "page_bytes": page_bytes, "batch_bytes": batch_bytes,
                  "layers": args.layers, "page_tokens": PAGE_TOKENS, "heads": HEADS, "head_dim": HEAD_DIM,
                  "dtype": "bfloat16", "layout": "page_first", "rounds": args.rounds,
                  "planes_seen": planes, "file_dir": str(file_parent)},
        "copy_limit_gbps": round(limit, 3),
        "target": {"what": "co-located get >= 0.7x the copy limit", "ratio": round(target, 3), "met": target >= 0.7,
                   "ratio_to_each_copy": per_copy},
        "results": rows,
    }
    out.write_text(json.dumps(report, indent=2))
    lines = [f"# SGLang HiCache backend: {BATCH}-page batches of {page_bytes / (1 << 20):.0f} MiB pages "
             f"({batch_bytes / (1 << 20):.0f} MiB a batch)", "",
             f"{report['when']}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; medians "
             f"of {args.rounds} rounds (one call of every cell a round); planes seen: {planes}.", "",
             "| path | op | GB/s | (min-max) | x copy limit (min-max) | x SGLang file |", "|---|---|---|---|---|---|"]
    for row in rows:
        xf = f"{row['x_sglang_file']:.2f}" if row["x_sglang_file"] is not None else ""
        lines.append(f"| {row['system']} | {row['op']} | {row['gbps']:.2f} | {row['gbps_range']} | "
                     f"{row['x_copy_limit']:.2f} ({row['x_copy_limit_range']}) | {xf} |")
    lines += ["", f"Copy limit: the better of the two copies of each round, median {limit:.2f} GB/s; ratios are "
              f"medians of each round's ratio. Co-located get: {target:.2f}x the copy limit "
              f"(target 0.7x: {'met' if target >= 0.7 else 'NOT met'}); against each copy alone: "
              + ", ".join(f"{v:.2f}x the {k.removeprefix('copy limit ')[1:-1]} copy" for k, v in per_copy.items())
              + "."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
