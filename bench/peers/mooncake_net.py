"""Mooncake Store over its TCP transport between two network namespaces, for bench/net.py.

`--role store` (in the server namespace, next to a fresh `mooncake_master` that
bench/net.py starts itself, so it can stop it whatever happens here): a store process
that contributes the only global segment, on `--host`; prints "ready", serves until
SIGTERM. `--role client` (in the client namespace, or the server's for loopback): a client
that contributes no memory, so every put and get crosses the link to the store's
segment over Mooncake's TCP transport; batched zero-copy calls (`batch_put_from` /
`batch_get_into` between registered buffers), a batch split over `--connections`
threads. Puts write new keys each call and remove them after, untimed (as
mooncake_peer.py). Writes rows in bench/net.py's schema to --out.

Runs in the peers' venv (bench/install-peers.sh): standard library and numpy only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import timed  # noqa: E402

MIB = 1 << 20
GB = 1e9


def master_binary() -> str:
    """The mooncake_master executable itself (not the console script that starts it)."""
    import mooncake

    return os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")


def store_role(args: argparse.Namespace) -> int:
    from mooncake.store import MooncakeDistributedStore

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    store = MooncakeDistributedStore()
    for _ in range(50):  # the master is starting next to us
        rc = store.setup(args.host, "P2PHANDSHAKE", args.segment_bytes, 64 * MIB, "tcp", "",
                         f"{args.host}:{args.master_port}")
        if rc == 0:
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"mooncake store setup failed with {rc}")
    print("ready", flush=True)
    while True:
        time.sleep(1.0)


def parallel(n: int, fn) -> None:  # type: ignore[no-untyped-def]
    """fn(k) for k in range(n) on n threads at once (the calling thread runs k = 0)."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            fn(k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(1, n)]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def client_role(args: argparse.Namespace) -> int:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    span = max(args.sizes) * args.batch
    rc = store.setup(args.host, "P2PHANDSHAKE", 0, 2 * span + 64 * MIB, "tcp", "", args.master)
    if rc != 0:
        raise RuntimeError(f"mooncake client setup failed with {rc}")
    time.sleep(0.5)
    rows = []
    for size in args.sizes:
        src = np.random.randint(0, 255, size * args.batch, dtype=np.uint8)
        dst = np.zeros(size * args.batch, dtype=np.uint8)
        for buf in (src, dst):
            if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise RuntimeError("mooncake register_buffer failed")
        tag = f"n{size}-{os.getpid()}"
        for conns in args.connections:
            share = args.batch // conns

            def keys(i: int, k: int, what: str) -> list[str]:
                return [f"{tag}-{conns}-{what}{i}-{k}-{j}" for j in range(share)]

            def ptrs(buf: np.ndarray, k: int) -> list[int]:
                return [buf.ctypes.data + (k * share + j) * size for j in range(share)]

            def put(i: int) -> None:
                def one(k: int) -> None:
                    codes = store.batch_put_from(keys(i, k, "p"), ptrs(src, k), [size] * share)
                    if any(c != 0 for c in codes):
                        raise RuntimeError(f"mooncake batch_put_from failed: {sorted(set(codes))}")
                parallel(conns, one)

            def forget(i: int) -> None:
                for k in range(conns):
                    for key in keys(i, k, "p"):
                        store.remove(key, True)

            seconds, calls = timed(put, args.seconds, after=forget)
            rows.append(row("put", size, conns, args, calls * args.batch * size / seconds))
            for k in range(conns):
                codes = store.batch_put_from(keys(0, k, "f"), ptrs(src, k), [size] * share)
                if any(c != 0 for c in codes):
                    raise RuntimeError(f"mooncake batch_put_from failed: {sorted(set(codes))}")

            def fetch(_: int) -> None:
                def one(k: int) -> None:
                    got = store.batch_get_into(keys(0, k, "f"), ptrs(dst, k), [size] * share)
                    if any(g != size for g in got):
                        raise RuntimeError(f"mooncake batch_get_into returned {sorted(set(got))}")
                parallel(conns, one)

            seconds, calls = timed(fetch, args.seconds)
            rows.append(row("fetch", size, conns, args, calls * args.batch * size / seconds))
            if not np.array_equal(src, dst):
                raise RuntimeError("mooncake returned different bytes")
            for k in range(conns):
                for key in keys(0, k, "f"):
                    store.remove(key, True)
        for buf in (src, dst):
            store.unregister_buffer(buf.ctypes.data)
    store.close()
    with open(args.out, "w") as fh:
        json.dump({"results": rows}, fh, indent=2)
    return 0


def row(op: str, size: int, conns: int, args: argparse.Namespace, bytes_per_s: float) -> dict[str, object]:
    return {"system": "mooncake-tcp", "op": op, "block_bytes": size, "connections": conns, "link": args.link,
            "gbps": bytes_per_s / GB, "note": "TCP transport, batched zero-copy, client contributes no segment"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", choices=("store", "client", "master-path"), required=True)
    parser.add_argument("--host", default="", help="this process's address")
    parser.add_argument("--master-port", type=int, default=50151)
    parser.add_argument("--segment-bytes", type=int, default=2 << 30)
    parser.add_argument("--master", default="", help="HOST:PORT of the master (client)")
    parser.add_argument("--sizes", default=str(MIB))
    parser.add_argument("--connections", default="1,4")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--link", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.connections = [int(s) for s in args.connections.split(",") if s]
    os.environ.setdefault("GLOG_minloglevel", "2")
    if args.role == "master-path":
        print(master_binary())
        return 0
    return store_role(args) if args.role == "store" else client_role(args)


if __name__ == "__main__":
    sys.exit(main())
