"""Membership: the live set of daemons in the pool, on etcd v3 or from a static peer list.

Each daemon writes ``<prefix>/members/<node_id>`` (a JSON `Member`: addresses, zone,
capacity, version, start time) under an etcd lease that it keeps alive, reads the member
prefix once and then watches it from the revision it read, so no change between the read
and the watch is lost. The result is a `View`: an immutable snapshot of the members, the
etcd revision it reflects, whether etcd is reachable, and when etcd last confirmed it.
Readers take `membership.view` (one attribute read; nothing ever waits on etcd).

Failure behaviour:

* A member that dies stops renewing its lease; etcd deletes its key when the lease runs out
  (`lease_ttl_s`) and every watcher drops it from its view. A member that stops cleanly
  revokes its lease, so it leaves at once.
* etcd unreachable (the watch stream breaks, a keep-alive or a call fails or times out):
  the last view is kept, marked unreachable, and the node keeps serving from it. A
  background task reconnects with jittered exponential backoff (bounded by
  `backoff_max_s`), trying the configured endpoints in turn. Each new session grants a
  new lease and writes the member key again before reading the prefix, so a member
  re-registers whether etcd came back with its data or empty.
* The view always holds this node itself: it knows it is alive even while etcd cannot
  confirm it (`MembershipStatus.registered` says whether etcd holds its key).
* Nothing here is consistent across nodes beyond what etcd gives: two views agree once
  both have seen the same revision. Placement only needs them to agree eventually; a
  lookup that asks the wrong node is a miss, never a wrong block.

`StaticMembership` serves small set-ups without etcd: a fixed list of ``node_id=address``
entries, the same on every node, with no liveness (a dead peer is a failed call).

The etcd client is `aetcd` (PyPI ``aetcd``, the `cluster` extra), imported only when an
`EtcdMembership` starts. It was chosen because it is asyncio-native (grpc.aio underneath,
so it runs on the daemon's loop without threads), maintained (1.0, 2026), speaks the plain
etcd v3 gRPC API that Debian's etcd 3.4 serves (leases, puts, prefix reads, prefix
watches from a revision, keep-alives), and accepts the grpcio and protobuf ranges the
project pins (grpcio > 1.66, protobuf 5 to 7). The alternatives were older or heavier:
``etcd3`` (sync, last release 2020, protobuf 3 era), ``etcd3-async-client`` (needs
grpcio-tools at run time), clients through the JSON gateway (no streaming keep-alive).
Keep-alives go over one bidirectional stream per session through aetcd's lease stub,
since its `refresh_lease` opens a new stream per renewal and leaves it to the collector.

Primitives: `Member`, `View`, `MembershipState`, `MembershipStatus`, `Membership`,
`StaticMembership`, `parse_static_peers`, `EtcdSettings`, `EtcdMembership`,
`make_membership`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import ipaddress
import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import grpc

from kvstore.addresses import dial_problem
from kvstore.cluster.node_id import validate_node_id
from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "/kvstore"
DEFAULT_LEASE_TTL_S = 10
DEFAULT_CALL_TIMEOUT_S = 2.0
DEFAULT_BACKOFF_INITIAL_S = 0.2
DEFAULT_BACKOFF_MAX_S = 5.0
DEFAULT_JOIN_TIMEOUT_S = 2.0
# A member record is a few hundred bytes; anything much larger is not ours.
MAX_MEMBER_RECORD_BYTES = 64 << 10

_EMPTY: Mapping[str, Member] = MappingProxyType({})


# -- values --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Member:
    """One daemon of the pool, as it registers itself."""

    node_id: str
    addresses: tuple[str, ...] = ()  # where peers reach it, e.g. ("10.0.0.5:50052",)
    zone: str = ""
    capacity_bytes: int = 0
    version: str = ""
    started_at: float = 0.0  # Unix time, for people reading it
    # The placement rule the member places units by (`kvstore.cluster.pool.placement_rule`):
    # members with another rule would disagree on owners, so they are never owners here.
    placement: str = ""
    draining: bool = False  # handing its units off before it leaves: no longer an owner

    def to_json(self) -> bytes:
        record: dict[str, object] = {
            "node_id": self.node_id, "addresses": list(self.addresses), "zone": self.zone,
            "capacity_bytes": self.capacity_bytes, "version": self.version, "started_at": self.started_at}
        if self.placement:
            record["placement"] = self.placement
        if self.draining:
            record["draining"] = True
        return json.dumps(record, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, node_id: str, data: bytes) -> Member:
        """The record stored under `node_id`'s key; ValueError when it is not one."""
        if len(data) > MAX_MEMBER_RECORD_BYTES:
            raise ValueError(f"member record of {len(data)} bytes")
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("member record is not a JSON object")
        addresses = obj.get("addresses", [])
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ValueError("member addresses are not a list of strings")
        if obj.get("node_id", node_id) != node_id:
            raise ValueError(f"member record names {obj.get('node_id')!r}, stored under {node_id!r}")
        capacity = obj.get("capacity_bytes", 0)
        started = obj.get("started_at", 0.0)
        if not isinstance(capacity, int) or not isinstance(started, (int, float)):
            raise ValueError("member capacity_bytes or started_at is not a number")
        draining = obj.get("draining", False)
        if not isinstance(draining, bool):
            raise ValueError("member draining is not true or false")
        return cls(node_id=node_id, addresses=tuple(addresses), zone=str(obj.get("zone", "")),
                   capacity_bytes=capacity, version=str(obj.get("version", "")), started_at=float(started),
                   placement=str(obj.get("placement", "")), draining=draining)


@dataclass(frozen=True, slots=True)
class View:
    """An immutable snapshot of the pool as one node sees it."""

    members: Mapping[str, Member] = field(default_factory=lambda: _EMPTY)  # node id -> member (read-only)
    revision: int = 0  # the etcd revision it reflects (0: static, or not yet read)
    etcd_reachable: bool = False
    confirmed_at: float | None = None  # clock time etcd last confirmed it; None: never

    @classmethod
    def of(cls, members: Iterable[Member], revision: int = 0, etcd_reachable: bool = False,
           confirmed_at: float | None = None) -> View:
        table = {m.node_id: m for m in sorted(members, key=lambda m: m.node_id)}
        return cls(MappingProxyType(table), revision, etcd_reachable, confirmed_at)

    @property
    def node_ids(self) -> frozenset[str]:
        return frozenset(self.members)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.members

    def __len__(self) -> int:
        return len(self.members)


class MembershipState(enum.Enum):
    STARTING = "starting"  # no answer from etcd yet: the view is this node alone
    JOINED = "joined"  # registered under a live lease and watching
    UNREACHABLE = "unreachable"  # etcd lost: serving from the last view, reconnecting
    STATIC = "static"  # a fixed peer list
    STOPPED = "stopped"
    CONFLICT = "conflict"  # another live process holds this node's id: serving alone, waiting for it


@dataclass(frozen=True, slots=True)
class MembershipStatus:
    """What health details, INFO and metrics report about membership."""

    backend: str  # "etcd" | "static"
    state: MembershipState
    node_id: str
    members: int
    revision: int
    etcd_reachable: bool
    registered: bool  # etcd holds this node's key under its live lease
    last_confirmed_age_s: float | None  # since etcd last confirmed the view; None: never
    endpoint: str = ""  # the etcd endpoint of the current or last session
    sessions_total: int = 0  # sessions that registered
    session_failures_total: int = 0  # sessions lost to an error
    bad_records_total: int = 0  # member records that did not parse (skipped)
    last_error: str = ""
    # Member records with no address a peer can dial (wildcards, multicast...): skipped.
    unroutable_records_total: int = 0
    # Another live process holds this node's id (see `EtcdMembership`): not joined.
    node_id_conflict: str = ""
    node_id_claims_total: int = 0  # other processes that tried to join as this node's id

    @property
    def degraded(self) -> bool:
        """True while the view is not backed by a live etcd session."""
        return self.state in (MembershipState.STARTING, MembershipState.UNREACHABLE, MembershipState.CONFLICT)


# -- the interface -------------------------------------------------------------------


class Membership(abc.ABC):
    """The live member set. `view` is current; `subscribe` hears of member-set and
    reachability changes; `wait_for` lets set-up code and tests wait on a condition."""

    def __init__(self, me: Member, clock: Callable[[], float] = time.monotonic) -> None:
        validate_node_id(me.node_id)
        self.me = me
        self._clock = clock
        self._view = View.of([me])
        self._listeners: list[Callable[[View], None]] = []
        self._changed = asyncio.Event()

    @property
    def node_id(self) -> str:
        return self.me.node_id

    @property
    def view(self) -> View:
        return self._view

    @abc.abstractmethod
    def status(self) -> MembershipStatus: ...

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Membership:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def update_me(self, me: Member) -> None:
        """Publish a new record for this node (e.g. `draining`): in its own view now, and
        to the others where the backend carries records (etcd)."""
        if me.node_id != self.node_id:
            raise ValueError(f"a member cannot change its node id ({self.node_id!r} -> {me.node_id!r})")
        self.me = me
        members = dict(self._view.members)
        members[me.node_id] = me
        self._publish(replace(self._view, members=View.of(members.values()).members))

    def subscribe(self, listener: Callable[[View], None]) -> Callable[[], None]:
        """Call `listener(view)` on the loop after each change of the member set or of
        etcd's reachability (not on mere confirmations); returns the unsubscribe call."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return unsubscribe

    async def wait_for(self, predicate: Callable[[View], bool], timeout_s: float) -> View:
        """The first view (the current one included) that satisfies `predicate`;
        TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while not predicate(self._view):
                await self._changed.wait()
        return self._view

    def _publish(self, view: View) -> None:
        old = self._view
        self._view = view
        changed = old.members != view.members or old.etcd_reachable != view.etcd_reachable
        # Wake waiters on every new view (confirmations included), listeners on changes.
        self._changed.set()
        self._changed = asyncio.Event()
        if not changed:
            return
        for listener in list(self._listeners):
            try:
                listener(view)
            except Exception:
                logger.exception("membership listener %r failed", listener)


# -- static --------------------------------------------------------------------------


def unroutable(address: str) -> str | None:
    """Why a member's `address` cannot be dialed by a peer, in words; None if it can. A
    wildcard, an unspecified, multicast or broadcast host is where nobody is reached."""
    problem = dial_problem(address)
    if problem is not None:
        return problem
    if address.startswith("unix:"):
        return "a unix: address is reached only on its own host"
    host = address.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None  # a host name: resolved by whoever dials it
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        return f"{host} is not the address of one host"
    return None


def parse_static_peers(entries: Iterable[str]) -> tuple[Member, ...]:
    """``node_id=address[,address...]`` entries as members; ConfigError on a bad one."""
    out: dict[str, Member] = {}
    for entry in entries:
        text = entry.strip()
        if not text:
            continue
        node_id, sep, addrs = text.partition("=")
        node_id = node_id.strip()
        addresses = tuple(a.strip() for a in addrs.split(",") if a.strip())
        if not sep or not addresses:
            raise ConfigError(f"static peer {entry!r} must read node_id=host:port (e.g. node-a=10.0.0.5:50052)")
        validate_node_id(node_id, f"static peer {entry!r}:")
        for address in addresses:
            problem = dial_problem(address)
            if problem is not None:
                raise ConfigError(f"static peer {entry!r}: address {address!r}: {problem} (e.g. "
                                  "node-a=10.0.0.5:50052)")
        if node_id in out:
            raise ConfigError(f"static peer {node_id!r} is listed twice; give each node one entry")
        out[node_id] = Member(node_id=node_id, addresses=addresses)
    return tuple(out.values())


class StaticMembership(Membership):
    """A fixed member set from configuration. Every node must list the same peers,
    itself included, or their placements disagree."""

    def __init__(self, me: Member, peers: Sequence[Member], clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(me, clock)
        ids = {m.node_id for m in peers}
        if me.node_id not in ids:
            raise ConfigError(
                f"this node ({me.node_id!r}) is not in the static peer list {sorted(ids)}; list every "
                "node, this one included, in the same list on each node"
            )
        # This node's own record (zone, capacity, ...) over the list's bare entry.
        self._view = View.of(me if m.node_id == me.node_id else m for m in peers)
        self._stopped = False

    @classmethod
    def from_entries(cls, me: Member, entries: Iterable[str], clock: Callable[[], float] = time.monotonic
                     ) -> StaticMembership:
        """From ``node_id=address[,address...]`` entries (see `parse_static_peers`)."""
        return cls(me, parse_static_peers(entries), clock)

    def status(self) -> MembershipStatus:
        return MembershipStatus(
            backend="static", state=MembershipState.STOPPED if self._stopped else MembershipState.STATIC,
            node_id=self.node_id, members=len(self._view), revision=0, etcd_reachable=False,
            registered=False, last_confirmed_age_s=None,
        )

    async def start(self) -> None:
        self._stopped = False

    async def aclose(self) -> None:
        self._stopped = True


# -- etcd ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EtcdSettings:
    endpoints: tuple[str, ...]  # "host:port" or "http://host:port"
    prefix: str = DEFAULT_PREFIX
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    backoff_initial_s: float = DEFAULT_BACKOFF_INITIAL_S
    backoff_max_s: float = DEFAULT_BACKOFF_MAX_S
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S  # how long `start` waits for a first view
    # Take this node's id even from another live process that holds it (see EtcdMembership).
    replace_node_id: bool = False

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("etcd membership needs at least one endpoint (host:port)")
        for e in self.endpoints:
            parse_endpoint(e)
        if self.lease_ttl_s < 1:
            raise ConfigError(f"the etcd lease TTL is a whole number of seconds >= 1, got {self.lease_ttl_s}")
        if not (self.call_timeout_s > 0 and 0 < self.backoff_initial_s <= self.backoff_max_s):
            raise ConfigError("etcd call timeout and backoff must be > 0, with initial <= max backoff")
        if not self.prefix.startswith("/"):
            raise ConfigError(f"the etcd key prefix must start with '/', got {self.prefix!r}")

    @property
    def members_prefix(self) -> bytes:
        return (self.prefix.rstrip("/") + "/members/").encode()

    @property
    def claims_prefix(self) -> bytes:
        """Where a daemon that found its node id taken says so, for the holder to hear."""
        return (self.prefix.rstrip("/") + "/claims/").encode()

    @property
    def pool_prefix(self) -> bytes:
        return (self.prefix.rstrip("/") + "/").encode()


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` or ``http://host:port`` as (host, port); ConfigError otherwise."""
    rest = text.strip()
    if rest.startswith("https://"):
        raise ConfigError(f"etcd endpoint {text!r}: TLS to etcd is not supported yet; use http:// on a private network")
    rest = rest.removeprefix("http://").rstrip("/")
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint {text!r} must read host:port, e.g. 10.0.0.2:2379")
    return host, int(port)


class _LeaseLost(Exception):
    """etcd no longer knows this session's lease."""


class _WatchEnded(Exception):
    """The watch stream ended without an error (cancelled on the server's side)."""


class _Stopping(Exception):
    """aclose was called: end the session."""


class _NodeIdTaken(Exception):
    """Another live process holds this node's id; `holder` is its record."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def _load_aetcd() -> Any:
    try:
        import aetcd
    except ImportError:
        raise ConfigError(
            "cluster membership on etcd needs the aetcd package: pip install 'kvstore[cluster]'"
        ) from None
    return aetcd


@dataclass(slots=True)
class _Counters:
    sessions: int = 0
    failures: int = 0
    bad_records: int = 0
    unroutable: int = 0
    claims: int = 0
    last_error: str = ""
    endpoint: str = ""


@dataclass(slots=True)
class _Session:
    """What one connection to etcd holds while it lives."""

    client: Any
    lease_id: int = 0
    keepalive: Any = None
    peers: dict[str, Member] = field(default_factory=dict)
    revision: int = 0


class EtcdMembership(Membership):
    """Membership on etcd v3: register under a kept-alive lease, watch the member prefix.

    `start` launches one background task (owned here, ended by `aclose`) and waits at
    most `join_timeout_s` for a first view from etcd; with etcd down it returns anyway,
    with this node alone in the view, and the task keeps trying.

    Stopping is a state the task watches, not only a cancellation: on Python 3.11 a
    cancellation can be lost inside a client library (`asyncio.wait_for` racing a result)
    or turned into a child's error by a TaskGroup, and a lost one would leave the task
    running and `aclose` waiting. So `aclose` sets the stop event, which every session and
    backoff wait races against, and cancels until the task is done."""

    def __init__(self, me: Member, settings: EtcdSettings, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        super().__init__(me, clock)
        self.settings = settings
        self._key = settings.members_prefix + me.node_id.encode()
        self._state = MembershipState.STARTING
        self._registered = False
        self._counters = _Counters()
        self._task: asyncio.Task[None] | None = None
        self._rng = rng or random.Random()
        self._aetcd: Any = None
        self._stopping = asyncio.Event()
        self._session: _Session | None = None  # the live one, while registered
        self._conflict = ""  # who holds this node's id, while another live process does
        self._own_leases: set[int] = set()  # leases this process registered under (its earlier sessions)
        self._claims_heard: set[int] = set()  # leases of other processes' claims on this id, logged once each

    @property
    def key(self) -> bytes:
        return self._key

    def status(self) -> MembershipStatus:
        v = self._view
        age = None if v.confirmed_at is None else max(0.0, self._clock() - v.confirmed_at)
        c = self._counters
        return MembershipStatus(
            backend="etcd", state=self._state, node_id=self.node_id, members=len(v), revision=v.revision,
            etcd_reachable=v.etcd_reachable, registered=self._registered, last_confirmed_age_s=age,
            endpoint=c.endpoint, sessions_total=c.sessions, session_failures_total=c.failures,
            bad_records_total=c.bad_records, last_error=c.last_error, unroutable_records_total=c.unroutable,
            node_id_conflict=self._conflict, node_id_claims_total=c.claims,
        )

    async def update_me(self, me: Member) -> None:
        await super().update_me(me)
        session = self._session
        if session is not None and self._registered:
            try:
                async with asyncio.timeout(self.settings.call_timeout_s):
                    await session.client.put(self._key, self._record(), lease=session.lease_id)
            except Exception as exc:  # the next session writes the record anyway
                logger.warning("etcd membership: could not update this node's record now: %r", exc)

    async def start(self) -> None:
        if self._task is not None:
            return
        self._aetcd = _load_aetcd()
        self._stopping = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(
            self._run(self._aetcd), name=f"kvstore-membership-{self.node_id}")
        with contextlib.suppress(TimeoutError):
            await self.wait_for(lambda v: v.etcd_reachable, self.settings.join_timeout_s)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        self._stopping.set()
        if task is not None:
            # Each round gives the task a session's worth of clean-up (a lease revoke and a
            # close, each bounded) before cancelling it again.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=2 * self.settings.call_timeout_s + 0.5)
            if not task.cancelled() and task.exception() is not None:
                logger.error("etcd membership task failed: %r", task.exception())
        self._state = MembershipState.STOPPED
        self._registered = False

    # The background task: sessions one after another, backoff between them.

    async def _run(self, aetcd: Any) -> None:
        s = self.settings
        delay = s.backoff_initial_s
        attempt = 0
        while not self._stopping.is_set():
            host, port = parse_endpoint(s.endpoints[attempt % len(s.endpoints)])
            attempt += 1
            self._counters.endpoint = f"{host}:{port}"
            registered_before = self._counters.sessions
            try:
                await self._session_on(aetcd, host, port)
            except Exception as exc:  # an ExceptionGroup from the session's tasks, or a call's error
                if self._stopping.is_set():
                    return
                self._session_failed(exc)
            if self._counters.sessions > registered_before:
                delay = s.backoff_initial_s  # the session worked for a while: retry soon
            # Full jitter, so a fleet that lost etcd together does not come back in step.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._rng.uniform(0.5, 1.0) * delay):
                    await self._stopping.wait()
            delay = min(delay * 2, s.backoff_max_s)

    def _session_failed(self, exc: BaseException) -> None:
        leaf = exc
        while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
            leaf = leaf.exceptions[0]
        text = f"{type(leaf).__name__}: {leaf}".strip()
        c = self._counters
        c.failures += 1
        c.last_error = text[:300]
        was = self._state
        self._state = MembershipState.UNREACHABLE
        self._registered = False
        if was is not MembershipState.UNREACHABLE:
            logger.warning("etcd membership: lost etcd at %s (%s); serving from the last view of %d members",
                           c.endpoint, c.last_error, len(self._view))
        else:
            logger.debug("etcd membership: retry failed: %s", c.last_error)
        self._publish(replace(self._view, etcd_reachable=False))

    async def _session_on(self, aetcd: Any, host: str, port: int) -> None:
        s = self.settings
        timeout = s.call_timeout_s
        client = aetcd.Client(host=host, port=port, timeout=timeout, connect_wait_timeout=max(1, int(timeout)))
        session = _Session(client)
        try:
            async with asyncio.timeout(timeout * 3):
                lease = await client.lease(s.lease_ttl_s)
                session.lease_id = lease.id
                self._own_leases.add(lease.id)
            await self._register(client, session)
            async with asyncio.timeout(timeout * 3):
                snap = await client.get_prefix(s.members_prefix)
            session.revision = snap.header.revision
            session.peers = {}
            for kv in snap:
                self._apply_put(session, kv)
            self._registered = True
            self._session = session
            self._state = MembershipState.JOINED
            self._counters.sessions += 1
            self._counters.last_error = ""
            self._publish_session(session)
            logger.info("etcd membership: %s registered at %s:%d (lease %x, ttl %ds), %d members at revision %d",
                        self.node_id, host, port, session.lease_id, s.lease_ttl_s, len(self._view), session.revision)
            async with asyncio.timeout(timeout):
                # The pool's whole prefix: the member records, and the claims of processes
                # that found this node's id taken (`_register`).
                watch = await client.watch_prefix(s.pool_prefix, start_revision=session.revision + 1)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._keep_alive(session))
                tg.create_task(self._follow(session, watch))
                tg.create_task(self._until_stopped())
        finally:
            self._session = None
            await self._end_session(session)

    async def _register(self, client: Any, session: _Session) -> None:
        """Write this node's record under the session's lease, unless another live process
        holds the id: a copied SSD directory, a pasted --node-id. Placement and the pool's
        credentials know a node by its id, so two processes under one would each get half
        of the other's traffic. The key is taken when it is free or held under a lease of
        this process (an earlier session's), or with `replace_node_id`; otherwise this
        daemon says so (log, status, INFO, health), writes a claim the holder hears of and
        logs too, serves as a node alone, and tries again every third of the lease TTL: the
        holder's registration ends when it stops, or when its lease runs out (a previous
        run of this daemon that crashed leaves one for up to the TTL)."""
        s = self.settings
        timeout = s.call_timeout_s
        tx = client.transactions
        claimed = False
        keepalive = None
        try:
            while True:
                async with asyncio.timeout(timeout * 3):
                    held = await client.get(self._key)
                    if held is None:
                        ok, _ = await client.transaction(compare=[tx.create(self._key) == 0], success=[
                            tx.put(self._key, self._record(), lease=session.lease_id)], failure=[])
                    elif held.lease in self._own_leases or s.replace_node_id or held.lease == 0:
                        ok, _ = await client.transaction(compare=[tx.mod(self._key) == held.mod_revision], success=[
                            tx.put(self._key, self._record(), lease=session.lease_id)], failure=[])
                    else:
                        ok = False
                if ok:
                    if self._conflict:
                        logger.warning("etcd membership: node id %s is free again; this daemon joins the pool",
                                       self.node_id)
                    self._conflict = ""
                    if claimed:
                        with contextlib.suppress(Exception):
                            async with asyncio.timeout(timeout):
                                await client.delete(s.claims_prefix + self.node_id.encode())
                    return
                if held is None:
                    continue  # taken and gone again between the read and the write
                holder = self._describe(held)
                if not self._conflict:
                    logger.error(
                        "etcd membership: node id %s is registered by another live process (%s); this daemon does "
                        "not take it and serves as a node alone until that registration ends (a previous run of "
                        "this daemon that crashed keeps it up to cluster_lease_ttl_s = %d s). Give each daemon its "
                        "own node id, or set cluster_replace_node_id to take it over", self.node_id, holder,
                        s.lease_ttl_s)
                self._conflict = f"node id {self.node_id} is held by another process ({holder})"
                self._counters.last_error = self._conflict
                self._state = MembershipState.CONFLICT
                self._publish(View.of([self.me], 0, True, self._clock()))
                if not claimed:
                    async with asyncio.timeout(timeout):
                        await client.put(s.claims_prefix + self.node_id.encode(), self._record(),
                                         lease=session.lease_id)
                    claimed = True
                    keepalive = client.leasestub.LeaseKeepAlive(metadata=client.metadata)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.2, s.lease_ttl_s / 3)):
                        await self._stopping.wait()
                if self._stopping.is_set():
                    raise _Stopping
                assert keepalive is not None
                async with asyncio.timeout(timeout):  # the claim lives as long as this wait
                    await keepalive.write(self._aetcd.rpc.LeaseKeepAliveRequest(ID=session.lease_id))
                    await keepalive.read()
        finally:
            if keepalive is not None:
                keepalive.cancel()

    @staticmethod
    def _describe(held: Any) -> str:
        """Who holds a member key, for a log line: its record's addresses and start time."""
        try:
            record = json.loads(bytes(held.value))
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("started_at", 0.0))))
            return f"addresses {','.join(record.get('addresses', [])) or '-'}, started {started}, lease {held.lease:x}"
        except (ValueError, TypeError, AttributeError):
            return f"lease {held.lease:x}"

    def _heard_claim(self, session: _Session, kv: Any) -> None:
        """Another process wrote a claim on this node's id: it found the id held by this
        one. Logged once per claimant (its lease), counted, and said in the status."""
        if kv.lease == session.lease_id or kv.lease in self._claims_heard:
            return
        self._claims_heard.add(kv.lease)
        self._counters.claims += 1
        who = self._describe(kv)
        self._counters.last_error = f"another process tried to join as node id {self.node_id} ({who})"
        logger.error("etcd membership: %s; it serves alone until this daemon leaves. Give each daemon its own node "
                     "id", self._counters.last_error)

    async def _until_stopped(self) -> None:
        await self._stopping.wait()
        raise _Stopping

    async def _end_session(self, session: _Session) -> None:
        """Close the session's streams and client, each step bounded. A cancellation that
        arrives meanwhile (aclose) is re-raised after the client is closed, never lost:
        swallowing it would leave the task running and aclose waiting on it."""
        closing = self._stopping.is_set()  # aclose: leave the pool now
        cancelled = False

        async def revoke() -> None:
            if closing and session.lease_id and self._registered:
                # Revoking deletes the key at once: peers need not wait out the TTL.
                await session.client.revoke_lease(session.lease_id)

        if session.keepalive is not None:
            session.keepalive.cancel()
        for step in (revoke, session.client.close):
            try:
                async with asyncio.timeout(self.settings.call_timeout_s):
                    await step()
            except asyncio.CancelledError:
                cancelled = True
            except Exception as exc:
                logger.debug("etcd membership: session clean-up: %r", exc)
        if cancelled:
            raise asyncio.CancelledError

    def _record(self) -> bytes:
        return self.me.to_json()

    def _apply_put(self, session: _Session, kv: Any) -> None:
        node_id = bytes(kv.key)[len(self.settings.members_prefix):].decode(errors="replace")
        try:
            validate_node_id(node_id)
            member = Member.from_json(node_id, bytes(kv.value))
        except (ValueError, ConfigError) as exc:
            self._counters.bad_records += 1
            logger.warning("etcd membership: skipped the record under %r: %s", bytes(kv.key), exc)
            return
        if node_id == self.node_id and kv.lease != session.lease_id:
            self._counters.last_error = f"another process registered node id {node_id!r} (lease {kv.lease:x})"
            logger.error("etcd membership: %s; give each daemon its own node id", self._counters.last_error)
        if node_id != self.node_id:
            dialable = tuple(a for a in member.addresses if unroutable(a) is None)
            if not dialable:
                self._counters.unroutable += 1
                session.peers.pop(node_id, None)
                logger.warning("etcd membership: skipped member %s: none of its addresses (%s) can be dialed by a "
                               "peer (%s); it must advertise where it is reached (cluster_advertise)", node_id,
                               ",".join(member.addresses) or "none",
                               "; ".join(unroutable(a) or "" for a in member.addresses) or "no address")
                return
            member = replace(member, addresses=dialable)
        session.peers[node_id] = member

    def _publish_session(self, session: _Session) -> None:
        peers = dict(session.peers)
        peers[self.node_id] = self.me  # this node is alive whatever etcd says
        self._publish(View.of(peers.values(), session.revision, True, self._clock()))

    async def _keep_alive(self, session: _Session) -> None:
        s = self.settings
        call = session.client.leasestub.LeaseKeepAlive(metadata=session.client.metadata)
        session.keepalive = call
        interval_s = s.lease_ttl_s / 3
        while True:
            async with asyncio.timeout(s.call_timeout_s):
                await call.write(self._aetcd.rpc.LeaseKeepAliveRequest(ID=session.lease_id))
                reply = await call.read()
            if reply is None or reply is grpc.aio.EOF or reply.TTL <= 0:
                raise _LeaseLost(f"etcd dropped lease {session.lease_id:x}")
            self._publish(replace(self._view, etcd_reachable=True, confirmed_at=self._clock()))
            await asyncio.sleep(interval_s)

    async def _follow(self, session: _Session, watch: Any) -> None:
        prefix = self.settings.members_prefix
        my_claim = self.settings.claims_prefix + self.node_id.encode()
        async for event in watch:
            kv = event.kv
            key = bytes(kv.key)
            if not key.startswith(prefix):
                if key == my_claim and event.kind == "PUT":
                    self._heard_claim(session, kv)
                continue
            session.revision = max(session.revision, kv.mod_revision)
            if event.kind == "PUT":
                self._apply_put(session, kv)
            else:
                node_id = bytes(kv.key)[len(prefix):].decode(errors="replace")
                session.peers.pop(node_id, None)
                if node_id == self.node_id:
                    # Deleted by hand, or the lease ran out: register again (fails, and so
                    # restarts the session, if the lease is gone).
                    async with asyncio.timeout(self.settings.call_timeout_s):
                        await session.client.put(self._key, self._record(), lease=session.lease_id)
            self._publish_session(session)
        raise _WatchEnded("etcd ended the member watch")


# -- construction --------------------------------------------------------------------


def make_membership(
    me: Member,
    *,
    etcd: EtcdSettings | None = None,
    static_peers: Sequence[str] = (),
    clock: Callable[[], float] = time.monotonic,
) -> Membership | None:
    """The membership a configuration asks for: etcd, a static list, or None (one node)."""
    if etcd is not None and static_peers:
        raise ConfigError("configure either etcd endpoints or a static peer list for the cluster, not both")
    if etcd is not None:
        return EtcdMembership(me, etcd, clock)
    if static_peers:
        return StaticMembership.from_entries(me, static_peers, clock)
    return None
