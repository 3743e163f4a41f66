"""Shared by the peer drivers and bench/net.py: the timing loop and the result rows of bench/dataplane.py
(same fields, same definitions), and the loopback-only network namespace.

The drivers run in the peers' venv (bench/install-peers.sh), which has neither kvstore
nor grpc, so this file imports only the standard library and numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

GB = 1e9
NETNS_ENV = "KVSTORE_BENCH_NETNS"


def measure(fn: Callable[[int], None], seconds: float, min_calls: int = 5,
            after: Callable[[int], None] | None = None) -> list[float]:
    """Call fn(i) repeatedly for about `seconds` after one warm-up; per-call seconds.
    `after(i)` runs after each call, untimed (clean-up a peer needs to keep going)."""
    fn(-1)
    if after is not None:
        after(-1)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    i = 0
    while i < min_calls or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        if after is not None:
            after(i)
        i += 1
    return times


def timed(fn: Callable[[int], None], seconds: float, after: Callable[[int], None] | None = None,
          min_calls: int = 3) -> tuple[float, int]:
    """`measure`, summed: (timed seconds, calls)."""
    times = measure(fn, seconds, min_calls, after)
    return sum(times), len(times)


def row(system: str, op: str, block_bytes: int, batch: int, times: list[float], note: str = "") -> dict[str, Any]:
    """One result row; the fields and formulas of `Result` in bench/dataplane.py."""
    total = sum(times)
    blocks = batch * len(times)
    arr = np.asarray(times)
    return {"system": system, "op": op, "block_bytes": block_bytes, "batch": batch,
            "gbps": blocks * block_bytes / total / GB if block_bytes else None, "ops_per_s": blocks / total,
            "p50_us": float(np.percentile(arr, 50)) * 1e6, "p99_us": float(np.percentile(arr, 99)) * 1e6,
            "calls": len(times), "note": note}


def parse_args(doc: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--sizes", default=str(1 << 20), help="block sizes in bytes, comma-separated")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=2.0, help="time per cell")
    parser.add_argument("--out", required=True, help="JSON file the result rows are written to")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    return args


def write_rows(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as fh:
        json.dump({"results": rows}, fh, indent=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, what: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port}") from None
            time.sleep(0.1)


def reexec_in_loopback_netns() -> None:
    """Run this script again inside a private network namespace that has only loopback
    (`unshare -n`, which needs root or user namespaces): a peer whose listeners bind all
    interfaces then still binds nothing reachable from outside. Returns in the child."""
    if os.environ.get(NETNS_ENV) == "1":
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        return
    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("ip") is None:
        sys.exit("this peer needs `unshare` and `ip` (util-linux, iproute2) to run in a loopback-only namespace")
    env = dict(os.environ, **{NETNS_ENV: "1"})
    rc = subprocess.call([unshare, "-n", sys.executable, *sys.argv], env=env)
    sys.exit(rc)
