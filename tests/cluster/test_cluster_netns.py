"""Membership across hosts: three network namespaces on one bridge, etcd on the switch.

Each member is a process inside its own namespace and registers its namespace's address.
A host whose link is cut keeps its last view and says etcd is unreachable, while the
others drop it once its lease runs out; with the link back it registers again and every
view converges. A member killed with SIGKILL leaves the others' views within its lease
TTL plus a second. Skips where namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.cluster_fixtures import (  # noqa: F401
    SWITCH_ADDRESS,
    EtcdServer,
    MemberProcess,
    NetworkHosts,
    member_args,
    member_process,
    netns_hosts,
)

pytest.importorskip("aetcd")

TTL_S = 2


def sees(*ids: str, reachable: bool = True) -> Any:
    return lambda st: st["members"] == sorted(ids) and st["etcd_reachable"] is reachable


def test_members_in_namespaces_ride_out_a_cut_link_and_a_kill(netns_hosts: NetworkHosts, tmp_path: Path) -> None:
    hosts = netns_hosts
    server = EtcdServer(tmp_path / "etcd", host=SWITCH_ADDRESS, client_port=2379, peer_port=2380, netns=hosts.switch)
    server.start()
    prefix = f"/kvtest/netns-{random.getrandbits(32):08x}"
    ids = [f"h{i}" for i in range(3)]
    try:
        with contextlib.ExitStack() as stack:
            ms: list[MemberProcess] = []
            for i, node in enumerate(ids):
                status = tmp_path / f"{node}.json"
                args = member_args(node, server.endpoint, prefix, status, address=f"{hosts.address(i)}:50052",
                                   ttl_s=TTL_S)
                ms.append(stack.enter_context(member_process(args, status, node, functools.partial(hosts.popen, i))))
            for m in ms:
                st = m.wait_for(sees(*ids), 20)
            assert st["addresses"] == {n: [f"{hosts.address(i)}:50052"] for i, n in enumerate(ids)}

            hosts.link_down(2)
            cut = time.monotonic()
            ms[0].wait_for(sees("h0", "h1"), TTL_S + 1.0)
            ms[1].wait_for(sees("h0", "h1"), max(0.1, cut + TTL_S + 1.0 - time.monotonic()))
            # The cut-off host serves from its last view and says etcd is gone.
            st = ms[2].wait_for(sees(*ids, reachable=False), 10)
            assert st["state"] == "unreachable" and not st["registered"]

            hosts.link_up(2)
            for m in ms:
                st = m.wait_for(sees(*ids), 20)
            assert ms[2].state()["sessions_total"] >= 2  # type: ignore[index]

            ms[1].kill9()
            killed = time.monotonic()
            ms[0].wait_for(sees("h0", "h2"), TTL_S + 1.0)
            ms[2].wait_for(sees("h0", "h2"), max(0.1, killed + TTL_S + 1.0 - time.monotonic()))
    finally:
        server.cleanup()
