"""Membership against a real etcd (Debian's etcd-server, started per module on free ports).

Members run in-process on the test's loop, or as processes of their own where a test
kills one with SIGKILL. Leases are short (2 s) so expiry is quick; each test has its own
key prefix on the shared etcd. Placement over the live view is checked here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from conftest import make_config

from kvstore.cluster.membership import (
    EtcdMembership,
    EtcdSettings,
    Member,
    MembershipState,
    StaticMembership,
    View,
    make_membership,
    parse_static_peers,
)
from kvstore.cluster.placement import Placement
from kvstore.errors import ConfigError
from kvstore.server.cluster import advertised
from tests.cluster.cluster_fixtures import EtcdServer, etcd, free_port, member_args, member_process  # noqa: F401

aetcd = pytest.importorskip("aetcd")

TTL_S = 2


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"/kvtest/{request.node.name}-{random.getrandbits(32):08x}"


def settings(endpoint: str, prefix: str, **kw: float) -> EtcdSettings:
    base: dict[str, float] = {"lease_ttl_s": TTL_S, "call_timeout_s": 1.0, "backoff_initial_s": 0.1,
                              "backoff_max_s": 0.5, "join_timeout_s": 5.0}
    base.update(kw)
    return EtcdSettings(endpoints=(endpoint,), prefix=prefix, **base)  # type: ignore[arg-type]


def member(node_id: str, **kw: object) -> Member:
    return Member(node_id=node_id, addresses=(f"10.0.0.1:{5000 + len(node_id)}",), zone="z1",
                  capacity_bytes=1 << 30, version="test", started_at=time.time(), **kw)  # type: ignore[arg-type]


def has(*ids: str) -> Callable[[View], bool]:
    return lambda v: v.etcd_reachable and v.node_ids == frozenset(ids)


@contextlib.asynccontextmanager
async def members(endpoint: str, prefix: str, *ids: str, **kw: float) -> AsyncIterator[list[EtcdMembership]]:
    ms = [EtcdMembership(member(i), settings(endpoint, prefix, **kw)) for i in ids]
    try:
        for m in ms:
            await m.start()
        yield ms
    finally:
        for m in ms:
            await m.aclose()


async def test_members_register_and_see_each_other(etcd: EtcdServer, prefix: str) -> None:
    async with members(etcd.endpoint, prefix, "a", "b", "c") as ms:
        for m in ms:
            view = await m.wait_for(has("a", "b", "c"), 5)
            assert view.members["b"] == ms[1].me  # the record round-trips: addresses, zone, capacity
            st = m.status()
            assert (st.backend, st.state) == ("etcd", MembershipState.JOINED)
            assert st.registered and st.etcd_reachable
            assert not st.degraded and st.members == 3 and st.revision == view.revision
            assert st.last_confirmed_age_s is not None and st.last_confirmed_age_s < 5
        # The key is where the docs say, under a lease.
        async with aetcd.Client(host="127.0.0.1", port=etcd.client_port) as c:
            got = await c.get(f"{prefix}/members/a".encode())
            assert got is not None and got.lease != 0
            assert Member.from_json("a", got.value) == ms[0].me


async def test_a_clean_stop_leaves_every_view_at_once(etcd: EtcdServer, prefix: str) -> None:
    # A long lease: leaving within a second shows the lease was revoked, not left to expire.
    async with members(etcd.endpoint, prefix, "a", "b", lease_ttl_s=30) as (a, b):
        await a.wait_for(has("a", "b"), 5)
        await b.aclose()
        await a.wait_for(has("a"), 1.0)
        assert b.status().state is MembershipState.STOPPED


async def test_a_killed_member_leaves_every_view_within_the_lease_ttl(etcd: EtcdServer, prefix: str,
                                                                      tmp_path: Path) -> None:
    status = tmp_path / "c.json"
    async with members(etcd.endpoint, prefix, "a", "b") as (a, b):
        with member_process(member_args("c", etcd.endpoint, prefix, status, ttl_s=TTL_S), status, "c") as c:
            c.wait_for(lambda st: st["members"] == ["a", "b", "c"] and st["etcd_reachable"], 15)
            await a.wait_for(has("a", "b", "c"), 5)
            await b.wait_for(has("a", "b", "c"), 5)
            c.kill9()
            killed = time.monotonic()
            await a.wait_for(has("a", "b"), TTL_S + 1.0)
            await b.wait_for(has("a", "b"), max(0.1, killed + TTL_S + 1.0 - time.monotonic()))


async def test_etcd_down_keeps_the_view_and_says_so_then_members_rejoin(etcd: EtcdServer, prefix: str) -> None:
    events: list[View] = []
    try:
        async with members(etcd.endpoint, prefix, "a", "b") as (a, b):
            await a.wait_for(has("a", "b"), 5)
            await b.wait_for(has("a", "b"), 5)
            a.subscribe(events.append)
            etcd.kill9()
            for m in (a, b):
                view = await m.wait_for(lambda v: not v.etcd_reachable, 5)
                assert view.node_ids == {"a", "b"}  # the last view, kept
                st = m.status()
                assert st.state is MembershipState.UNREACHABLE and st.degraded and not st.registered
                assert st.session_failures_total >= 1 and st.last_error
            assert events and not events[-1].etcd_reachable
            # The view is served while etcd is gone: a read is an attribute, never a wait.
            assert a.view.node_ids == {"a", "b"}
            # etcd comes back empty (its data lost): both register again, views converge.
            etcd.start(wipe=True)
            for m in (a, b):
                await m.wait_for(has("a", "b"), 10)
                st = m.status()
                assert st.state is MembershipState.JOINED and st.registered and st.sessions_total >= 2
            assert events[-1].etcd_reachable
    finally:
        if not etcd.running():
            etcd.start()


async def test_etcd_restarted_with_its_data_converges_too(etcd: EtcdServer, prefix: str) -> None:
    try:
        async with members(etcd.endpoint, prefix, "a", "b") as (a, b):
            await a.wait_for(has("a", "b"), 5)
            etcd.stop()
            await a.wait_for(lambda v: not v.etcd_reachable, 5)
            etcd.start()
            for m in (a, b):
                await m.wait_for(has("a", "b"), 10)
    finally:
        if not etcd.running():
            etcd.start()


async def test_start_does_not_wait_for_an_absent_etcd_and_joins_once_it_appears(tmp_path: Path, prefix: str) -> None:
    port = free_port()
    m = EtcdMembership(member("a"), settings(f"127.0.0.1:{port}", prefix, join_timeout_s=0.5))
    began = time.monotonic()
    await m.start()
    try:
        assert time.monotonic() - began < 3.0
        assert m.view.node_ids == {"a"} and not m.view.etcd_reachable  # this node alone
        assert m.status().degraded
        server = EtcdServer(tmp_path / "late", client_port=port)
        server.start()
        try:
            await m.wait_for(has("a"), 10)
            assert m.status().state is MembershipState.JOINED
        finally:
            await m.aclose()
            server.cleanup()
    finally:
        await m.aclose()


async def test_records_that_are_not_members_are_skipped_and_counted(etcd: EtcdServer, prefix: str) -> None:
    async with aetcd.Client(host="127.0.0.1", port=etcd.client_port) as c:
        await c.put(f"{prefix}/members/junk".encode(), b"not json")
        await c.put(f"{prefix}/members/bad id".encode(), b"{}")
        async with members(etcd.endpoint, prefix, "a") as (a,):
            await a.wait_for(has("a"), 5)
            assert a.status().bad_records_total == 2
            await c.put(f"{prefix}/members/other".encode(), b'{"node_id": "someone-else"}')
            await c.put(f"{prefix}/members/ok".encode(), Member("ok", addresses=("10.0.0.9:5000",)).to_json())
            await a.wait_for(has("a", "ok"), 5)
            assert a.status().bad_records_total == 3


async def test_a_member_deleted_by_hand_registers_again(etcd: EtcdServer, prefix: str) -> None:
    async with members(etcd.endpoint, prefix, "a", "b") as (a, b):
        await a.wait_for(has("a", "b"), 5)
        gone: list[View] = []
        a.subscribe(lambda v: gone.append(v) if "b" not in v else None)
        async with aetcd.Client(host="127.0.0.1", port=etcd.client_port) as c:
            await c.delete(f"{prefix}/members/b".encode())
            await a.wait_for(lambda v: bool(gone) and has("a", "b")(v), 5)
            got = await c.get(f"{prefix}/members/b".encode())
            assert got is not None and Member.from_json("b", got.value) == b.me


async def test_a_fourth_member_moves_about_a_quarter_of_the_units(etcd: EtcdServer, prefix: str) -> None:
    rng = random.Random(11)
    units = [rng.randbytes(16) for _ in range(8000)]
    async with members(etcd.endpoint, prefix, "a", "b", "c") as (a, b, c):
        view = await a.wait_for(has("a", "b", "c"), 5)
        placement = Placement(view.node_ids, grace_s=60)
        a.subscribe(lambda v: placement.update(v.node_ids))
        before = {u: placement.owners(u)[0] for u in units}
        async with members(etcd.endpoint, prefix, "d") as (d,):
            await a.wait_for(has("a", "b", "c", "d"), 5)
            assert placement.members == {"a", "b", "c", "d"}
            moved = [u for u in units if placement.owners(u)[0] != before[u]]
            assert abs(len(moved) / len(units) - 0.25) < 0.03
            assert {placement.owners(u)[0] for u in moved} == {"d"}
            # For the grace period a lookup also asks where the unit was.
            assert all(placement.lookup_targets(u) == ("d", before[u]) for u in moved)
            # Every node computes the same owners from its own view.
            other = Placement((await d.wait_for(has("a", "b", "c", "d"), 5)).node_ids)
            assert all(other.owners(u) == placement.owners(u) for u in units)


def test_static_membership_from_entries() -> None:
    me = member("b")
    m = StaticMembership.from_entries(me, ["a=10.0.0.1:50052", "b=10.0.0.2:50052", "c=10.0.0.3:50052,[fd00::3]:50052"])
    assert m.view.node_ids == {"a", "b", "c"}
    assert m.view.members["b"] == me  # this node's own record
    assert m.view.members["c"].addresses == ("10.0.0.3:50052", "[fd00::3]:50052")
    st = m.status()
    assert (st.backend, st.state, st.members, st.degraded) == ("static", MembershipState.STATIC, 3, False)
    with pytest.raises(ConfigError, match="not in the static peer list"):
        StaticMembership.from_entries(member("z"), ["a=10.0.0.1:1"])
    for bad in (["a"], ["a="], ["a=x:1", "a=y:1"], ["bad id=x:1"]):
        with pytest.raises(ConfigError):
            parse_static_peers(bad)
    # Addresses no peer could be dialed at are refused at start, with what is wrong.
    for address, why in (("10.0.0.1", "not HOST:PORT"), ("h:port", "not HOST:PORT"), ("h:0", "not in"),
                         ("h:99999", "not in"), ("0.0.0.0:50052", "wildcard"), ("[::]:50052", "wildcard"),
                         ("fd00::3:50052", "brackets"), ("unix:", "socket path")):
        with pytest.raises(ConfigError, match=why):
            parse_static_peers([f"a={address}"])
    assert parse_static_peers(["a=unix:/run/kv.sock,h.example:1"])[0].addresses == ("unix:/run/kv.sock",
                                                                                    "h.example:1")


def test_an_advertised_address_is_one_a_peer_can_dial(tmp_path: Path) -> None:
    def advertise(*addresses: str) -> tuple[str, ...]:
        config = make_config(tmp_path, listen=("127.0.0.1:50051",), cluster=True, cluster_advertise=addresses)
        return advertised(config, ["127.0.0.1:50051"])

    assert advertise("10.0.0.2:50052", "[fd00::2]:50052") == ("10.0.0.2:50052", "[fd00::2]:50052")
    for address, why in (("10.0.0.2", "not HOST:PORT"), ("0.0.0.0:50052", "wildcard"), ("h:70000", "not in")):
        with pytest.raises(ConfigError, match=f"cluster_advertise '{re.escape(address)}': .*{why}"):
            advertise(address)


def test_membership_construction_from_configuration() -> None:
    me = member("a")
    assert make_membership(me) is None  # one node: no membership at all
    assert isinstance(make_membership(me, static_peers=["a=h:1"]), StaticMembership)
    etcd_settings = EtcdSettings(endpoints=("127.0.0.1:2379",))
    assert isinstance(make_membership(me, etcd=etcd_settings), EtcdMembership)
    with pytest.raises(ConfigError, match="not both"):
        make_membership(me, etcd=etcd_settings, static_peers=["a=h:1"])
    for bad in ((), ("nohost",), ("h:0",), ("https://h:2379",)):
        with pytest.raises(ConfigError):
            EtcdSettings(endpoints=bad)
    with pytest.raises(ConfigError):
        EtcdSettings(endpoints=("h:1",), prefix="no-slash")


def test_single_node_and_static_set_ups_never_import_the_etcd_client() -> None:
    code = ("import sys, asyncio\n"
            "from kvstore.cluster import membership, node_id, placement\n"
            "m = membership.make_membership(membership.Member('a'), static_peers=['a=h:1'])\n"
            "asyncio.run(m.start())\n"
            "print('aetcd' in sys.modules, 'kvstore.cluster' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "True"]
    # Nor does a daemon that is not in a cluster import the cluster package at all.
    code = ("import sys, kvstore.server.daemon; "
            "print(any(m.startswith('kvstore.cluster') or m == 'aetcd' for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


async def test_wait_for_times_out() -> None:
    m = StaticMembership(member("a"), [member("a")])
    with pytest.raises(TimeoutError):
        await m.wait_for(lambda v: len(v) == 2, 0.05)
    await asyncio.sleep(0)


async def test_aclose_always_returns_even_mid_retry(prefix: str) -> None:
    """Closing while a session is failing or being cleaned up must end the task."""
    port = free_port()
    rng = random.Random(5)
    for _ in range(15):
        m = EtcdMembership(member("a"), settings(f"127.0.0.1:{port}", prefix, join_timeout_s=0.01,
                                                 backoff_initial_s=0.001, backoff_max_s=0.002))
        await m.start()
        await asyncio.sleep(rng.uniform(0, 0.05))
        async with asyncio.timeout(5):
            await m.aclose()
        assert m.status().state is MembershipState.STOPPED
