"""A cluster member in a process of its own, for tests that kill it or run it in a namespace.

Runs an `EtcdMembership` until SIGTERM (then leaves the pool cleanly) and writes its view
and status as JSON to `--status-file` (replaced atomically) whenever the view changes.
Not a test module: tests/cluster/cluster_fixtures.py starts it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from dataclasses import asdict

from kvstore.cluster.membership import EtcdMembership, EtcdSettings, Member


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--status-file", required=True)
    parser.add_argument("--address", default="")
    parser.add_argument("--lease-ttl-s", type=int, default=2)
    args = parser.parse_args()
    asyncio.run(run(args))


async def run(args: argparse.Namespace) -> None:
    me = Member(node_id=args.node_id, addresses=(args.address,) if args.address else (), started_at=time.time())
    settings = EtcdSettings(endpoints=(args.endpoint,), prefix=args.prefix, lease_ttl_s=args.lease_ttl_s,
                            call_timeout_s=1.0, backoff_initial_s=0.1, backoff_max_s=0.5, join_timeout_s=5.0)
    membership = EtcdMembership(me, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    last = ""

    def write() -> None:
        nonlocal last
        view, st = membership.view, membership.status()
        text = json.dumps({"members": sorted(view.members), "etcd_reachable": view.etcd_reachable,
                           "revision": view.revision, "state": st.state.value, "registered": st.registered,
                           "sessions_total": st.sessions_total,
                           "addresses": {n: list(m.addresses) for n, m in view.members.items()},
                           "status": {k: v for k, v in asdict(st).items()
                                      if k not in ("state", "last_confirmed_age_s")}})
        if text == last:
            return
        last = text
        tmp = f"{args.status_file}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.status_file)

    await membership.start()
    try:
        while not stop.is_set():
            write()
            # Changes show up through the view; a short poll also catches status-only ones.
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except TimeoutError:
                pass
    finally:
        await membership.aclose()


if __name__ == "__main__":
    main()
