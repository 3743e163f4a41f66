"""LMCache's multiprocess server (`lmcache server`, ZMQ transport, CPU L1 memory),
driven by the client LMCache ships for benchmarking it (`lmcache bench server`'s
ServerBenchClient: a simulated vLLM worker that registers its paged KV cache and
stores / retrieves chunks through the server's shared-memory transfer path).

Mapping to our schema: one LMCache chunk (256 tokens) is one block; the KV shape is
chosen so a chunk is `block_bytes` (1 layer, K and V, 16-token pages, fp16, 128-dim
heads, block_bytes / 8 KiB heads). A put is one STORE of a request of 32 chunks with new
tokens; a fetch is what an engine does to load them: LOOKUP (which locks and prefetches),
RETRIEVE of the same 32 chunks into the KV pages, end of session. The retrieved KV is
compared with what was stored. The server runs on 127.0.0.1 inside a loopback-only
network namespace (its exporters bind all interfaces), with usage telemetry off.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, measure, parse_args, reexec_in_loopback_netns, row, wait_port, write_rows  # noqa: E402

CHUNK_TOKENS = 256
PAGE_TOKENS = 16
HEAD_DIM = 128
TRANSFER_MODE = os.environ.get("KVSTORE_BENCH_LMCACHE_MODE", "lmcache_driven")
NOTE = f"multiprocess server, ZMQ, shared-memory store/retrieve ({TRANSFER_MODE}), 1 chunk = 1 block"


def start_server(workdir: Path, l1_gb: float) -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("lmcache", path=os.path.dirname(sys.executable)) or shutil.which("lmcache")
    if exe is None:
        sys.exit("lmcache not found; run bench/install-peers.sh")
    port, http, prom = free_port(), free_port(), free_port()
    log = open(workdir / "lmcache_server.log", "wb")
    proc = subprocess.Popen(
        [exe, "server", "--host", "127.0.0.1", "--port", str(port), "--http-host", "127.0.0.1",
         "--http-port", str(http), "--prometheus-port", str(prom), "--chunk-size", str(CHUNK_TOKENS),
         "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU", "--max-workers", "2"],
        stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        wait_port(port, "lmcache server", proc, timeout=120)
    except RuntimeError:
        log.flush()
        sys.stderr.write((workdir / "lmcache_server.log").read_text()[-4000:])
        raise
    return proc, port


def bench_size(port: int, block_bytes: int, batch: int, seconds: float) -> list[dict[str, object]]:
    import torch
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    per_token = block_bytes // CHUNK_TOKENS  # bytes of one token's K and V in the one layer
    heads = per_token // (2 * HEAD_DIM * 2)
    if heads * 2 * HEAD_DIM * 2 * CHUNK_TOKENS != block_bytes:
        raise ValueError(f"{block_bytes}-byte blocks do not map onto whole heads of a 256-token chunk")
    pages = 2 * batch * CHUNK_TOKENS // PAGE_TOKENS
    config = BenchConfig(
        rpc_url=f"tcp://127.0.0.1:{port}", http_url="", mode="cpu", transfer_mode=TRANSFER_MODE, tp_size=1,
        use_mla=False, num_tokens=batch * CHUNK_TOKENS - 1,  # the client prepends one token
        kvcache_shape_spec=f"(2,{pages},{PAGE_TOKENS},{heads},{HEAD_DIM}):float16:1", num_blocks=pages,
        block_size=PAGE_TOKENS)
    client = ServerBenchClient(config, log=lambda _msg: None)
    client.start()
    # LMCache's keys do not include the KV layout: each block size gets token ids of its
    # own, or a lookup of this size would hit chunks stored at another size.
    base = (block_bytes >> 10) * 100_000
    try:
        seq = [base + 1000]

        def put(_: int) -> None:
            seq[0] += 1
            req = client.create_request(seq[0], f"put-{seq[0]}", "store")
            assert req is not None and req.total_chunks == batch
            res = client.store(req, 0, req.num_full_tokens)
            if res is None or not res.succeeded:
                raise RuntimeError(f"lmcache store failed: {res}")

        puts = measure(put, seconds)
        fixed = client.create_request(base + 1, "fixed", "fetch")
        assert fixed is not None
        kv = next(iter(client._workers[0].kv_caches.values()))  # noqa: SLF001 (the simulated engine's KV)
        kv.copy_(torch.randint(-1000, 1000, kv.shape, dtype=torch.int16).view(kv.dtype))
        res = client.store(fixed, 0, fixed.num_full_tokens)
        if res is None or not res.succeeded:
            raise RuntimeError(f"lmcache store failed: {res}")
        expected = kv.clone()
        client.end_session(fixed)
        # A store is not visible to lookups at once: wait (untimed) until it is.
        deadline = time.monotonic() + 30
        while True:
            probe = client.create_request(base + 1, f"probe-{time.monotonic_ns()}", "fetch")
            assert probe is not None
            hit = client.lookup(probe)
            client.end_session(probe)
            if hit.is_full_hit:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"lmcache lookup still misses 30 s after the store: {hit}")
            time.sleep(0.05)

        def fetch(i: int) -> None:
            # What an engine does to load a prefix: LOOKUP (locks and prefetches the
            # chunks), RETRIEVE into its KV pages, end the session (unlocks).
            req = client.create_request(base + 1, f"fetch-{i}", "fetch")
            assert req is not None
            hit = client.lookup(req)
            if not hit.is_full_hit:
                raise RuntimeError(f"lmcache lookup missed: {hit}")
            got = client.retrieve(req, 0, req.num_full_tokens)
            client.end_session(req)
            if got is None or not got.succeeded:
                raise RuntimeError(f"lmcache retrieve failed: {got}")

        client.zero_destination(fixed, 0, fixed.num_full_tokens)
        fetches = measure(fetch, seconds)
        if not torch.equal(kv.view(torch.int16), expected.view(torch.int16)):
            raise RuntimeError("lmcache returned different bytes")
    finally:
        client.close()
    return [row("lmcache", "put", block_bytes, batch, puts, NOTE), row("lmcache", "fetch", block_bytes, batch, fetches, NOTE)]


def main() -> int:
    args = parse_args(__doc__)
    reexec_in_loopback_netns()
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-lmcache-") as tmp:
        # Room for a few seconds of puts; LRU eviction makes room beyond. Small enough that
        # the kvstore daemon's segment, this and the client's KV stay well under 8 GiB.
        server, port = start_server(Path(tmp), l1_gb=2)
        try:
            for size in args.sizes:
                print(f"lmcache: block {size // 1024} KiB ...", flush=True)
                rows += bench_size(port, size, args.batch, args.seconds)
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
