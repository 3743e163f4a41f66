"""KV events in vLLM's format under load: the data plane benchmark's kvstore put cells with
the stream off, next to the same cells with the stream on and a subscriber attached, in
alternating rounds, and the event rate the daemon sustained (what the subscriber got).

Cells (bench/dataplane.py's `bench_kvstore`, puts only: fetches publish nothing; batch
32, each put naming its blocks with 64-bit engine names as vLLM's connector does):
kvstore-shm (one round trip per put) and kvstore-grpc at 1 MiB blocks, and kvstore-shm at
16 KiB blocks (many small blocks: the most events per byte moved). Every put is one
BlockStored event of 32 block names; what the puts evict from the host tier adds
BlockRemoved events.

The subscriber is a process of its own (`--subscribe`): a ZMQ SUB socket on the stream,
every batch decoded (msgpack), sequence gaps filled from the replay endpoint and counted.
Around each cell the benchmark reads its counts and the daemon's
(`kvstore_kv_events_batches_total`); the event rate is the events the subscriber received
over the seconds the cell's puts took, and every batch the daemon published must have
reached it. Next to the wall-clock figures, which a loaded machine moves, the daemon's CPU
time per put (user + system, every thread, from /proc) says what the stream costs it.

    python bench/kv_events.py [--rounds 4] [--seconds 2] [--quick]

Results: bench/results/kv_events.json and kv_events.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from dataplane import MIB, Services, bench_kvstore, machine_info  # noqa: E402
from peers.common import free_port  # noqa: E402

KIB = 1 << 10
BATCH = 32
BATCHES = 'kvstore_kv_events_batches_total{tenant="default"}'
CELLS = (("kvstore-shm", "local", MIB), ("kvstore-grpc", "grpc", MIB), ("kvstore-shm", "local", 16 * KIB))


# ------------------------------------------------------------------ the subscriber process


def subscribe(endpoint: str, replay: str) -> int:
    """Read the stream until stdin closes; on each line of stdin, print the counts so far."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    counts = {"batches": 0, "events": 0, "blocks": 0, "gaps": 0, "replayed": 0, "errors": 0, "last_seq": -1}

    def take(payload: bytes) -> None:
        try:
            batch = msgpack.unpackb(payload, raw=False)
        except Exception:  # noqa: BLE001 - counted: the report shows it
            counts["errors"] += 1
            return
        counts["batches"] += 1
        counts["events"] += len(batch[1])
        counts["blocks"] += sum(len(e.get("block_hashes", ())) for e in batch[1])

    def fill(first: int, upto: int | None = None) -> None:
        """Take the batches from `first` (up to `upto`) from the replay endpoint."""
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", first.to_bytes(8, "big")))
        while dealer.poll(10_000):
            _, _, seq, payload = dealer.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n < 0:  # the end marker
                break
            if n > counts["last_seq"] and (upto is None or n < upto):
                take(payload)
                counts["replayed"] += 1
                counts["last_seq"] = n
        dealer.close(linger=0)

    # A SUB socket misses what was published before its subscription took hold (ZMQ's
    # late joiner): the start's AllBlocksCleared among it. A router catches up from the
    # replay endpoint, and so does this one; what the live stream repeats is skipped.
    fill(0)

    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            if sock is sub:
                _, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq <= counts["last_seq"]:  # taken from the replay endpoint already
                    continue
                if seq > counts["last_seq"] + 1:
                    counts["gaps"] += seq - counts["last_seq"] - 1
                    fill(counts["last_seq"] + 1, seq)
                counts["last_seq"] = seq
                take(payload)
            else:
                if not sys.stdin.readline():
                    return 0
                print(json.dumps(counts), flush=True)


class Subscriber:
    def __init__(self, endpoint: str, replay: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--subscribe", endpoint, replay],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def counts(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def settled(self, batches: int, timeout_s: float = 30) -> dict[str, int]:
        """Counts once `batches` batches arrived (or the timeout passed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            c = self.counts()
            if c["batches"] >= batches or time.monotonic() > deadline:
                return c
            time.sleep(0.05)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


# ------------------------------------------------------------------ the benchmark


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used (user + system, all its threads): what a cell cost the
    daemon, which the machine's other load slows but does not add to."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvstore_kv_events_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def run_mode(on: bool, seconds: float, sizes: set[int]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvstore-kv-events-") as tmp:
        metrics = free_port()
        args: tuple[str, ...] = ("--metrics-listen", f"127.0.0.1:{metrics}")
        if on:
            args += ("--kv-events-endpoint", f"ipc://{tmp}/events.sock",
                     "--kv-events-replay-endpoint", f"ipc://{tmp}/replay.sock")
        try:
            services = Services(Path(tmp), "2GiB", redis=False, daemon_args=args)
        except RuntimeError as exc:
            log = Path(tmp) / "daemon.log"
            raise RuntimeError(f"{exc}; the daemon's log ends:\n{log.read_text()[-3000:] if log.exists() else ''}") \
                from None
        sub = Subscriber(f"ipc://{tmp}/events.sock", f"ipc://{tmp}/replay.sock") if on else None
        cells = []
        try:
            if sub is not None:
                sub.settled(1)  # the start's AllBlocksCleared, live or from the replay endpoint
            for system, plane, size in CELLS:
                if size not in sizes:
                    continue
                target = f"unix:{services.sock}" if plane == "local" else f"127.0.0.1:{services.kv_port}"
                before = sub.counts() if sub is not None else None
                published_before = scrape(metrics).get(BATCHES, 0.0)
                daemon_pid = services.procs[0].pid
                cpu_before = cpu_seconds(daemon_pid)
                rows = bench_kvstore(system, target, plane, size, BATCH, seconds,
                                     reserve_ahead=BATCH if plane == "local" else 0, engine_names=True,
                                     put_only=True)
                cpu = cpu_seconds(daemon_pid) - cpu_before
                put = next(r for r in rows if r.op == "put")
                put_seconds = put.calls * BATCH / put.ops_per_s
                cell: dict[str, Any] = {"system": system, "block_bytes": size,
                                        "rows": [r.__dict__ for r in rows], "put_seconds": put_seconds,
                                        # the timed puts and the warm-up one
                                        "daemon_cpu_us_per_put": cpu / (put.calls + 1) * 1e6}
                if sub is not None and before is not None:
                    # Stores of the puts, and the removals of what they evicted from the host tier.
                    published = int(scrape(metrics).get(BATCHES, 0.0) - published_before)
                    after = sub.settled(before["batches"] + published)
                    got = {k: after[k] - before[k] for k in ("batches", "events", "blocks", "gaps", "replayed",
                                                             "errors")}
                    cell["subscriber"] = got
                    # Over the seconds the timed puts took (the fetches publish nothing).
                    cell["events_per_s"] = got["events"] / put_seconds
                    cell["blocks_per_s"] = got["blocks"] / put_seconds
                    cell["published_batches"] = published
                cells.append(cell)
            daemon = scrape(metrics)
            totals: dict[str, int] = {}
            if sub is not None:
                # Every batch the daemon published, the start's included, must have arrived
                # (a cell's own figures are off by the batch or two that straddle its end).
                published_total = int(daemon.get(BATCHES, 0.0))
                totals = {"published": published_total, "received": sub.settled(published_total)["batches"]}
        finally:
            if sub is not None:
                sub.close()
            services.close()
    return {"on": on, "cells": cells, "daemon_metrics": daemon, "batches": totals}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4,
                        help="an even count: each mode runs first in half of them")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per cell")
    parser.add_argument("--quick", action="store_true", help="1 MiB cells only, one round, 1 s")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--subscribe", nargs=2, metavar=("ENDPOINT", "REPLAY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.subscribe:
        return subscribe(*args.subscribe)
    rounds, seconds = (1, 1.0) if args.quick else (args.rounds, args.seconds)
    sizes = {MIB} if args.quick else {MIB, 16 * KIB}
    runs = []
    for r in range(rounds):
        # Alternating, and the order swapped every round: the machine's load drifts, and the
        # first daemon of a round may pay for what the last one left (a 2 GiB segment freed).
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            print(f"round {r + 1} of {rounds}: stream {'on, subscriber attached' if on else 'off'} ...", flush=True)
            runs.append(run_mode(on, seconds, sizes))
    report = summarize(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_events.json").write_text(json.dumps({"machine": machine_info(), "runs": runs, "summary": report},
                                                   indent=2))
    text = render(report, rounds)
    (out / "kv_events.md").write_text(text)
    print(text)
    lost = [run["batches"] for run in runs if run["on"] and run["batches"]["received"] < run["batches"]["published"]]
    if lost:
        print(f"batches lost on the way to the subscriber: {lost}", file=sys.stderr)
    return 1 if lost else 0


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell and op: the median GB/s with the stream off and on, and the event rates."""
    out = []
    for system, _, size in CELLS:
        for op in ("put",):
            def gbps(on: bool) -> list[float]:
                return [row["gbps"] for run in runs if run["on"] == on for c in run["cells"]
                        if c["system"] == system and c["block_bytes"] == size for row in c["rows"] if row["op"] == op]

            off_v, on_v = gbps(False), gbps(True)
            if not off_v or not on_v:
                continue
            entry: dict[str, Any] = {"system": system, "block_bytes": size, "op": op,
                                     "gbps_off": statistics.median(off_v), "gbps_on": statistics.median(on_v),
                                     "gbps_off_all": off_v, "gbps_on_all": on_v}
            entry["ratio"] = entry["gbps_on"] / entry["gbps_off"]

            def cpu(on: bool) -> list[float]:
                return [c["daemon_cpu_us_per_put"] for run in runs if run["on"] == on for c in run["cells"]
                        if c["system"] == system and c["block_bytes"] == size]

            entry["cpu_us_off_all"], entry["cpu_us_on_all"] = cpu(False), cpu(True)
            entry["cpu_us_off"], entry["cpu_us_on"] = statistics.median(cpu(False)), statistics.median(cpu(True))
            if op == "put":
                cells = [c for run in runs if run["on"] for c in run["cells"]
                         if c["system"] == system and c["block_bytes"] == size]
                entry["events_per_s"] = statistics.median(c["events_per_s"] for c in cells)
                entry["blocks_per_s"] = statistics.median(c["blocks_per_s"] for c in cells)
                entry["received_of_published"] = (sum(run["batches"]["received"] for run in runs if run["on"]),
                                                  sum(run["batches"]["published"] for run in runs if run["on"]))
                entry["gaps_filled"] = sum(c["subscriber"]["gaps"] for c in cells)
            out.append(entry)
    return out


def render(report: list[dict[str, Any]], rounds: int) -> str:
    lines = [f"# KV events (vLLM's format) under the data plane benchmark, {rounds} alternating rounds, medians",
             "", f"machine: {os.uname().nodename} {os.cpu_count()} cores; batch {BATCH}; every put names its blocks",
             "", "| put cell | GB/s, stream off | GB/s, stream on + subscriber | on/off | daemon CPU us/put, off "
             "| on | on/off | events/s | block names/s | batches received / published (all cells) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in report:
        size = f"{e['block_bytes'] // KIB} KiB" if e["block_bytes"] < MIB else f"{e['block_bytes'] // MIB} MiB"
        lines.append(f"| {e['system']} {size} | {e['gbps_off']:.2f} | {e['gbps_on']:.2f} | {e['ratio']:.2f} | "
                     f"{e['cpu_us_off']:,.0f} | {e['cpu_us_on']:,.0f} | {e['cpu_us_on'] / e['cpu_us_off']:.2f} | "
                     f"{e['events_per_s']:,.0f} | {e['blocks_per_s']:,.0f} | {e['received_of_published'][0]} / "
                     f"{e['received_of_published'][1]} |")
    lines += ["", "GB/s and events/s are wall-clock figures (the machine's other load moves them); the daemon's CPU "
              "time per put is what each put cost it, the stream's work included. Each put is one BlockStored of "
              f"{BATCH} names; evictions from the host tier add BlockRemoved events."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
