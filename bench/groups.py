"""KV groups benchmark: put and fetch GB/s of grouped layouts on each data plane, next to
a plain layout of the same bytes per block, measured in the same run.

Layouts (each put is one batch of consecutive blocks of one chain, fresh hashes per put;
each fetch reads one stored batch back):

| layout | what it models |
|---|---|
| gemma3-like | Gemma 3 12B's cache at 4 KV heads: 8 full-attention layers and 40 sliding-window layers (window 1024 tokens), bf16, 16-token blocks |
| v4-like | a DeepSeek-V4-like family: compressed latents at ratios 4 and 128 (MLA), the indexer's fp8 keys and fp32 scales, a sliding window of 128 tokens and a state, 64-token blocks |
| plain-N | one full-attention tensor of N bytes per block, N the grouped layout's bytes per block |

A grouped put stores only the parts its hit rules keep (`kvstore.groups.needed`: the
window's last blocks, the state at the end); its GB/s counts the bytes that moved, as a
plain layout's does. Fetches return new buffers for both (no `out`), so both pay the
same allocation. Planes: `grpc` (the SDK's Put and Fetch streams), `local` (the
shared-memory plane, one round trip per put), `lane` (the data lane over loopback TCP).
`moved_on` says which plane carried the bytes, read from the daemon's per-plane byte
counters (its /metrics) around each cell: the SDK falls back to gRPC bytes where a plane
does not take a layout, and the report marks those rows.

Each cell runs `--rounds` times, the order of layouts turned each round; a row is the
median round, and each ratio (grouped / plain, same plane, same op) is the median of the
per-round ratios, so a ratio compares figures taken seconds apart on a shared machine.

Results: bench/results/groups.json and bench/results/groups.md (`--out` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peers.common import free_port, measure  # noqa: E402

from kvstore.client import Client, KVGroup, KVLayout  # noqa: E402
from kvstore.groups import part_order, stored_bytes  # noqa: E402

GB = 1e9
TARGET = 0.9


def gemma3_like() -> KVLayout:
    return KVLayout(model="bench/gemma-3-like", dtype="bfloat16", num_layers=48, num_kv_heads=4, head_dim=256,
                    block_size_tokens=16, groups=(
                        KVGroup("full", "full", "bfloat16", (2, 8, 16, 4, 256)),
                        KVGroup("sliding", "sliding_window", "bfloat16", (2, 40, 16, 4, 256), window_tokens=1024),
                    ))


def v4_like() -> KVLayout:
    return KVLayout(model="bench/deepseek-v4-like", dtype="bfloat16", num_layers=61, num_kv_heads=1, head_dim=576,
                    block_size_tokens=64, groups=(
                        KVGroup("c4_kv", "mla", "bfloat16", (30, 16, 576)),
                        KVGroup("c4_indexer", "auxiliary", "float8_e4m3fn", (30, 16, 128)),
                        KVGroup("c4_indexer_scale", "auxiliary", "float32", (30, 16, 1)),
                        KVGroup("c128_kv", "mla", "bfloat16", (30, 1, 576)),
                        KVGroup("swa_kv", "sliding_window", "bfloat16", (61, 64, 128), window_tokens=128),
                        KVGroup("state", "state", "float32", (61, 1024)),
                    ))


def plain_like(grouped: KVLayout) -> KVLayout:
    return KVLayout(model=f"bench/plain-{grouped.bytes_per_block}", dtype="uint8", num_layers=1, num_kv_heads=1,
                    head_dim=1, block_size_tokens=grouped.block_size_tokens, block_bytes=grouped.bytes_per_block)


class Daemon:
    """One daemon: a Unix socket (shared memory, gRPC) and loopback TCP (the data lane)."""

    def __init__(self, workdir: Path, host_capacity: str) -> None:
        self.sock = workdir / "kv.sock"
        self.port = free_port()
        self.metrics_port = free_port()
        self.log = open(workdir / "daemon.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "server.py"), "--listen", f"unix:{self.sock},127.0.0.1:{self.port}",
             "--host-capacity", host_capacity, "--log-level", "warning", "--metrics-listen", f"127.0.0.1:{self.metrics_port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            try:
                with Client(f"unix:{self.sock}", timeout_s=2) as kv:
                    text = kv.info("tiers")
                if "tier_host_prefaulted:no" not in text and "tier_host_prefaulted:running" not in text:
                    break
            except Exception:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("the daemon did not come up")
            time.sleep(0.2)

    def plane_bytes(self) -> dict[str, int]:
        """Block bytes the daemon moved so far, by plane (its /metrics: kvstore_data_in_bytes
        and kvstore_data_out_bytes), both ways together."""
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        out: dict[str, int] = {}
        for m in re.finditer(r'^kvstore_data_(?:in|out)_bytes_total\{plane="(\w+)"\} (\S+)$', text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0) + int(float(m.group(2)))
        return out

    def target(self, plane: str) -> str:
        return f"127.0.0.1:{self.port}" if plane == "lane" else f"unix:{self.sock}"

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def blocks_for(layout: KVLayout, n: int, rng: np.random.Generator) -> list[Any]:
    if not layout.groups:
        return [rng.integers(0, 255, layout.bytes_per_block, dtype=np.uint8) for _ in range(n)]
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for g, j in part_order(layout, n):
        group = layout.groups[g]
        out[j][group.name] = rng.integers(0, 255, group.bytes_per_block, dtype=np.uint8)
    return out


def same(got: list[Any], want: list[Any], layout: KVLayout) -> bool:
    if len(got) != len(want):
        return False
    if not layout.groups:
        return all(bytes(g) == w.tobytes() for g, w in zip(got, want))
    return all(g.keys() == w.keys() and all(bytes(g[k]) == w[k].tobytes() for k in w) for g, w in zip(got, want))


def moved_on(before: dict[str, int], after: dict[str, int]) -> str:
    """Which plane carried most of the bytes moved between two readings of the daemon's
    per-plane counters (`shm` is the shared-memory plane)."""
    moved = {plane: after.get(plane, 0) - before.get(plane, 0) for plane in after}
    best = max(moved, key=lambda p: moved[p])
    return {"shm": "local"}.get(best, best)


def cell(daemon: Daemon, layout: KVLayout, plane: str, batch: int, seconds: float,
         rng: np.random.Generator) -> list[dict[str, Any]]:
    moved = stored_bytes(layout, batch) if layout.groups else batch * layout.bytes_per_block
    src = blocks_for(layout, batch, rng)
    rows = []
    with Client(daemon.target(plane), data_plane=plane, reserve_ahead=batch if plane == "local" else 0,
                timeout_s=60) as kv:
        assert kv.warm_up() == plane
        before = daemon.plane_bytes()

        def put(_: int) -> None:
            kv.put(layout, None, src, block_hashes=[os.urandom(16) for _ in range(batch)])

        times = measure(put, seconds)
        on = moved_on(before, daemon.plane_bytes())
        rows.append(_row(layout, plane, on, "put", batch, moved, times))
        hashes = [os.urandom(16) for _ in range(batch)]
        kv.put(layout, None, src, block_hashes=hashes)
        before = daemon.plane_bytes()
        got: list[Any] = []

        def fetch(_: int) -> None:
            got[:] = kv.fetch(layout, block_hashes=hashes)
            if len(got) != batch:
                raise RuntimeError(f"{layout.model} on {plane}: fetched {len(got)} of {batch} blocks")

        times = measure(fetch, seconds)
        if not same(got, src, layout):
            raise RuntimeError(f"{layout.model} on {plane}: fetched bytes differ from those put")
        on = moved_on(before, daemon.plane_bytes())
        rows.append(_row(layout, plane, on, "fetch", batch, moved, times))
    return rows


def _row(layout: KVLayout, plane: str, on: str, op: str, batch: int, moved: int, times: list[float]) -> dict[str, Any]:
    total = sum(times)
    return {"layout": layout.model.split("/", 1)[1], "grouped": bool(layout.groups), "plane": plane, "moved_on": on,
            "op": op, "batch": batch, "block_bytes": layout.bytes_per_block, "bytes_per_call": moved,
            "gbps": moved * len(times) / total / GB, "p50_ms": float(np.percentile(times, 50)) * 1e3,
            "calls": len(times)}


def median_rows(rounds: list[list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The median round of each cell, and each grouped/plain ratio as the median of the
    per-round ratios."""
    by_key: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rows in rounds:
        for r in rows:
            by_key.setdefault((r["layout"], r["plane"], r["op"]), []).append(r)
    out = []
    for rows in by_key.values():
        rows = sorted(rows, key=lambda r: r["gbps"])
        mid = dict(rows[len(rows) // 2])
        mid["gbps_range"] = f"{rows[0]['gbps']:.2f}-{rows[-1]['gbps']:.2f}"
        out.append(mid)
    ratios = []
    for (name, plane, op), rows in by_key.items():
        if not rows[0]["grouped"]:
            continue
        plain = f"plain-{rows[0]['block_bytes']}"
        per_round = []
        for k, r in enumerate(rows):
            base = by_key.get((plain, plane, op), [])
            if k < len(base):
                per_round.append(r["gbps"] / base[k]["gbps"])
        if per_round:
            ratios.append({"layout": name, "plane": plane, "op": op, "vs": plain, "moved_on": rows[0]["moved_on"],
                           "ratio": statistics.median(per_round), "rounds": [round(x, 3) for x in per_round],
                           "target": TARGET})
    return out, ratios


def write_report(rows: list[dict[str, Any]], ratios: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "groups.json").write_text(json.dumps({"meta": meta, "results": rows, "ratios": ratios}, indent=2))
    lines = ["# KV groups on each plane", "",
             f"{meta['machine']}; {meta['rounds']} rounds of {meta['seconds']} s a cell; GB/s counts the bytes a "
             "call moved (a grouped put: the parts its hit rules keep).", "",
             "| layout | plane | moved on | op | bytes/call | GB/s (median) | range | p50 ms |",
             "|---|---|---|---|---:|---:|---|---:|"]
    for r in sorted(rows, key=lambda r: (r["plane"], r["op"], r["layout"])):
        lines.append(f"| {r['layout']} | {r['plane']} | {r['moved_on']} | {r['op']} | {r['bytes_per_call']:,} | "
                     f"{r['gbps']:.2f} | {r['gbps_range']} | {r['p50_ms']:.1f} |")
    lines += ["", f"Grouped / plain, same plane and op (target: at least {TARGET}x):", "",
              "| layout | plane | op | vs | ratio | per round | meets |", "|---|---|---|---|---:|---|---|"]
    for q in sorted(ratios, key=lambda q: (q["plane"], q["op"], q["layout"])):
        meets = "yes" if q["ratio"] >= TARGET else "no"
        if q["moved_on"] != q["plane"]:
            meets += f" (moved on {q['moved_on']})"
        lines.append(f"| {q['layout']} | {q['plane']} | {q['op']} | {q['vs']} | {q['ratio']:.2f} | "
                     f"{', '.join(map(str, q['rounds']))} | {meets} |")
    (out / "groups.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--seconds", type=float, default=1.5, help="time per cell")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--planes", default="grpc,local,lane")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    planes = [p for p in args.planes.split(",") if p]
    layouts = [gemma3_like(), v4_like()]
    layouts += [plain_like(g) for g in layouts]
    rng = np.random.default_rng(46)
    started = time.perf_counter()
    rounds: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-groups-") as tmp:
        daemon = Daemon(Path(tmp), "6GiB")
        try:
            for rnd in range(args.rounds):
                rows: list[dict[str, Any]] = []
                order = layouts[rnd % len(layouts):] + layouts[: rnd % len(layouts)]
                for plane in planes:
                    for layout in order:
                        print(f"round {rnd + 1}: {layout.model} on {plane} ...", flush=True)
                        rows += cell(daemon, layout, plane, args.batch, args.seconds, rng)
                rounds.append(rows)
        finally:
            daemon.close()
    rows, ratios = median_rows(rounds)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "rounds": args.rounds, "seconds": args.seconds, "batch": args.batch,
            "elapsed_s": round(time.perf_counter() - started, 1)}
    write_report(rows, ratios, Path(args.out), meta)
    print((Path(args.out) / "groups.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
