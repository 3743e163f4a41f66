"""Mooncake Store, measured the way it is fastest on one host: a client co-located with
its own memory segment, batched zero-copy puts and gets (`batch_put_from` /
`batch_get_into` of 32 keys per call between registered buffers). A fresh
`mooncake_master` per run, on 127.0.0.1, inside a loopback-only network namespace
(Mooncake's transfer listeners bind all interfaces whatever they are told).

Puts write new keys each call (a put of an existing key is a no-op in Mooncake); the
keys of the call before are removed after each timed call, untimed, so the segment never
fills (Mooncake's eviction is not part of what is measured; kvstore's is). Fetches read
the same 32 keys each call, and their bytes are compared with what was put.

Run by `make bench-peers` with the peers' venv: writes result rows (the schema of
bench/dataplane.py) to --out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, measure, parse_args, reexec_in_loopback_netns, row, wait_port, write_rows  # noqa: E402

MIB = 1 << 20
NOTE = "co-located client, batched zero-copy (batch_put_from/batch_get_into), TCP protocol, loopback netns"


def start_master(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    master = shutil.which("mooncake_master", path=os.path.dirname(sys.executable)) or shutil.which("mooncake_master")
    if master is None:
        sys.exit("mooncake_master not found; run bench/install-peers.sh")
    port, metrics = free_port(), free_port()
    log = open(workdir / "mooncake_master.log", "wb")
    proc = subprocess.Popen(
        [master, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--metrics_host=127.0.0.1",
         f"--metrics_port={metrics}", "--enable_http_metadata_server=false"],
        stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    wait_port(port, "mooncake_master", proc)
    return proc, port


def bench_size(store, block_bytes: int, batch: int, seconds: float) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    span = block_bytes * batch
    src = np.random.randint(0, 255, span, dtype=np.uint8)
    dst = np.zeros(span, dtype=np.uint8)
    for buf in (src, dst):
        if store.register_buffer(buf.ctypes.data, span) != 0:
            raise RuntimeError("mooncake register_buffer failed")
    ptrs = [src.ctypes.data + i * block_bytes for i in range(batch)]
    out_ptrs = [dst.ctypes.data + i * block_bytes for i in range(batch)]
    sizes = [block_bytes] * batch
    tag = f"b{block_bytes}-{os.getpid()}"

    def keys_of(i: int) -> list[str]:
        return [f"{tag}-put{i}-{j}" for j in range(batch)]

    def put(i: int) -> None:
        codes = store.batch_put_from(keys_of(i), ptrs, sizes)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"mooncake batch_put_from failed: {sorted(set(codes))}")

    def forget(i: int) -> None:
        for key in keys_of(i):
            store.remove(key, True)

    puts = measure(put, seconds, after=forget)
    fixed = [f"{tag}-fixed-{j}" for j in range(batch)]
    codes = store.batch_put_from(fixed, ptrs, sizes)
    if any(c != 0 for c in codes):
        raise RuntimeError(f"mooncake batch_put_from failed: {sorted(set(codes))}")

    def fetch(_: int) -> None:
        got = store.batch_get_into(fixed, out_ptrs, sizes)
        if any(g != block_bytes for g in got):
            raise RuntimeError(f"mooncake batch_get_into returned {sorted(set(got))}")

    fetches = measure(fetch, seconds)
    if not np.array_equal(src, dst):
        raise RuntimeError("mooncake returned different bytes")
    for key in fixed:
        store.remove(key, True)
    for buf in (src, dst):
        store.unregister_buffer(buf.ctypes.data)
    return [row("mooncake", "put", block_bytes, batch, puts, NOTE), row("mooncake", "fetch", block_bytes, batch, fetches, NOTE)]


def main() -> int:
    args = parse_args(__doc__)
    reexec_in_loopback_netns()
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every call setup at INFO
    from mooncake.store import MooncakeDistributedStore

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-mooncake-") as tmp:
        master, port = start_master(Path(tmp))
        try:
            store = MooncakeDistributedStore()
            # The segment holds one batch being put and one being fetched at the largest size.
            segment = max(512 * MIB, 4 * max(args.sizes) * args.batch)
            rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 64 * MIB, "tcp", "", f"127.0.0.1:{port}")
            if rc != 0:
                raise RuntimeError(f"mooncake setup failed with {rc}")
            time.sleep(0.5)  # the segment mounts asynchronously on some versions
            for size in args.sizes:
                print(f"mooncake: block {size // 1024} KiB ...", flush=True)
                rows += bench_size(store, size, args.batch, args.seconds)
            store.close()
        finally:
            master.terminate()
            try:
                master.wait(timeout=10)
            except subprocess.TimeoutExpired:
                master.kill()
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
