"""The daemon's side of the pool (docs/cluster.md): a `ClusterNode` built from the config,
and what the servicers, INFO, metrics, health and the Admin service need of it.

Primitives: `resolve_cluster_node_id(config)`, `build_cluster(...)` (the node, not yet
started, which the daemon hands to its services) and `join_cluster(...)` (once the
listeners are bound), `put_position` / `put_tokens` / `forward_put` (a committed put's
forwards, for the servicers), `ClusterCollector` (metrics), `info_section`,
`status_proto`, `where_proto`, `drain_proto`, `watch_health` (the `kvstore.v1.Cluster`
health status). What the services call (`forward_put`, `info_section`, `status_proto`,
`where_proto`, `drain_proto`) takes a `PoolNode` (kvstore.server.pool_node), so a single
daemon's `SoloNode` answers too, as a node alone (INFO's `cluster_enabled:0`).

A single daemon (`cluster = false`, the default) never imports `kvstore.cluster` nor the
etcd client: this module imports it only inside the functions that a pool's daemon alone
reaches, and names its types for the type checker alone.

Health: the daemon's own services stay SERVING while etcd is away (it keeps serving on
its last view); the `kvstore.v1.Cluster` service says NOT_SERVING while the view is not
confirmed by a live etcd session (`MembershipStatus.degraded`), so `kvstore health
--service kvstore.v1.Cluster` and probes that ask for it see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from grpc_health.v1 import health_pb2
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore import __version__
from kvstore.addresses import dial_problem
from kvstore.codec_chooser import CodecChooser
from kvstore.errors import ConfigError
from kvstore.hashing import token_bytes
from kvstore.server.auth import TokenTable, current_identity
from kvstore.server.config import Config
from kvstore.server.listen import parse_listen
from kvstore.server.pool_node import PoolNode
from kvstore.server.requests import RequestResolver
from kvstore.v1 import admin_pb2, kvstore_pb2

if TYPE_CHECKING:
    from grpc_health.v1._async import HealthServicer

    from kvstore.cluster.pool import ClusterNode, ForwardTicket
    from kvstore.core.store import Store

logger = logging.getLogger(__name__)

HEALTH_SERVICE = "kvstore.v1.Cluster"
HEALTH_POLL_S = 0.5
WILDCARDS = ("0.0.0.0", "::", "")


def resolve_cluster_node_id(config: Config) -> str:
    """This daemon's node id: configured, else kept under the SSD path (ConfigError otherwise)."""
    from kvstore.cluster.node_id import resolve_node_id

    if not config.node_id and not config.ssd_path:
        raise ConfigError("a cluster member needs a stable node id: set node_id (--node-id), or ssd_path so the "
                          "id is kept in <ssd_path>/node-id")
    return resolve_node_id(config.node_id, ssd_path=config.ssd_path).value


def advertised(config: Config, bound: Sequence[str]) -> tuple[str, ...]:
    """Where peers reach this daemon: `cluster_advertise`, else its bound TCP addresses
    that are not wildcards."""
    if config.cluster_advertise:
        for address in config.cluster_advertise:
            problem = dial_problem(address)
            if problem is not None:
                raise ConfigError(f"cluster_advertise {address!r}: {problem}")
        return tuple(config.cluster_advertise)
    out = []
    for target in bound:
        if target.startswith("unix:"):
            continue
        addr = parse_listen(target)
        if addr.host not in WILDCARDS:
            out.append(addr.grpc_target)
    if not out:
        raise ConfigError("a cluster member needs an address its peers can reach: listen on a TCP address that is "
                          "not a wildcard, or set cluster_advertise (host:port)")
    return tuple(out)


def _read_secret(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None


def check_node_credential(path: str, token: str, node_id: str, tokens: TokenTable | None) -> None:
    """Stop the daemon at start when its cluster credential cannot work: an empty file,
    and with a token file, a token that file does not list (every node's token file lists
    every node's credential), one that is not a peer credential, or another node's."""
    if not token:
        raise ConfigError(f"cluster_token_file {path} is empty; put this node's credential in it "
                          f"(`kvstore token new --node {node_id}` prints one)")
    if tokens is None:
        return  # no token file here: nothing to check it against (and no other node checks it)
    identity = tokens.authenticate(token)
    if identity is None:
        raise ConfigError(f"cluster_token_file {path} holds a token this daemon's token file does not list; every "
                          "node's token file lists every node's credential (the same entries on each node)")
    if identity.role != "peer":
        raise ConfigError(f"cluster_token_file {path} holds a token of tenant {identity.tenant!r} (role "
                          f"{identity.role}), not a node's credential (role peer); make one with `kvstore token new "
                          f"--node {node_id}`")
    if identity.node and identity.node != node_id:
        raise ConfigError(f"cluster_token_file {path} holds the credential of node {identity.node!r}, and this "
                          f"daemon is node {node_id!r}; give each node its own credential")
    if not identity.node:
        logger.warning("cluster: cluster_token_file %s holds a credential the pool shares (tenant %r names no node): "
                       "whoever holds it may call as any member; give each node its own (`kvstore token new --node "
                       "%s`, see SECURITY.md)", path, identity.tenant, node_id)


def credential_check(tokens: Callable[[], TokenTable | None]) -> Callable[[str], bool]:
    """Whether this daemon's current token file holds a credential for a node id (any
    node, for a file with a credential the pool shares, or without a token file): for
    `ClusterNode.admits`, so that a node whose entry was removed owns no units here."""
    def admits(node_id: str) -> bool:
        table = tokens()
        if table is None:
            return True
        peers = [i for i in table.identities.values() if i.role == "peer"]
        return any(not i.node or i.node == node_id for i in peers)

    return admits


def member_check(node: ClusterNode) -> Callable[[str], bool]:
    """Whether a node id is a member of `node`'s current view of the pool (the etcd view,
    or the static list), for `Authenticator.members`."""
    membership = node.membership
    return lambda node_id: node_id in membership.view


def build_cluster(config: Config, store: Store, node_id: str, *, executor: Any = None,
                  auth_on: bool = False, tokens: TokenTable | None = None,
                  chooser: CodecChooser | None = None) -> ClusterNode:
    """This daemon's `ClusterNode`, not started: the services get it before the listeners
    are bound; `join_cluster` starts it after. Its settings are checked now, so a bad one
    stops the daemon before it binds anything."""
    from kvstore.cluster.data_lane_transport import DataLaneTransport
    from kvstore.cluster.membership import EtcdSettings, Member, make_membership, parse_static_peers
    from kvstore.cluster.pool import ClusterNode, ClusterSettings
    from kvstore.cluster.transport import GrpcPeerTransport, PeerTransport

    token = ""
    if config.cluster_token_file:
        token = _read_secret(config.cluster_token_file, "cluster_token_file").decode("utf-8", "replace").strip()
        if os.stat(config.cluster_token_file).st_mode & 0o077:
            raise ConfigError(f"cluster_token_file {config.cluster_token_file} is accessible to other users; "
                              f"run `chmod 600 {config.cluster_token_file}`")
        check_node_credential(config.cluster_token_file, token, node_id, tokens)
    elif auth_on or tokens is not None:
        raise ConfigError("with auth_token_file the pool's daemons authenticate each other: set cluster_token_file "
                          f"to a file holding this node's credential (`kvstore token new --node {node_id} --file "
                          "tokens.toml`, its entry in every node's token file)")
    tls_ca = _read_secret(config.cluster_tls_ca, "cluster_tls_ca") if config.cluster_tls_ca else None
    cert = key = None
    if tls_ca is not None and config.tls_cert:
        cert = _read_secret(config.tls_cert, "tls_cert")
        key = _read_secret(config.tls_key, "tls_key")
    settings = ClusterSettings(
        unit_blocks=config.cluster_unit_blocks, replicas=config.cluster_replicas,
        hot_extra_owners=config.cluster_hot_extra_owners, grace_s=config.cluster_grace_s,
        lookup_timeout_s=config.cluster_lookup_timeout_ms / 1000.0, fetch_timeout_s=config.cluster_fetch_timeout_s,
        forward_queue_blocks=config.cluster_forward_queue, forward_timeout_s=config.cluster_forward_timeout_s,
        pulls=config.cluster_pulls, suspect_s=config.cluster_suspect_s)
    capacity = sum(st.tier.capacity_bytes for st in store.tiers)
    # Where peers reach this node: its entry in a static list, else (etcd) the addresses it
    # advertises, which `join_cluster` fills in once the listeners are bound.
    addresses: tuple[str, ...] = ()
    if config.cluster_peers:
        mine = [m for m in parse_static_peers(config.cluster_peers) if m.node_id == node_id]
        addresses = mine[0].addresses if mine else ()
        if config.cluster_advertise and mine and tuple(config.cluster_advertise) != addresses:
            logger.warning("cluster: cluster_advertise (%s) is not used with a static peer list: the other nodes "
                           "reach this one at its entry in the list (%s)", ",".join(config.cluster_advertise),
                           ",".join(addresses))
    me = Member(node_id=node_id, addresses=addresses,
                zone=config.cluster_zone, capacity_bytes=capacity, version=__version__, placement=settings.rule)
    etcd = None
    if config.cluster_etcd:
        etcd = EtcdSettings(endpoints=tuple(config.cluster_etcd), prefix=config.cluster_prefix,
                            lease_ttl_s=config.cluster_lease_ttl_s, replace_node_id=config.cluster_replace_node_id)
    membership = make_membership(me, etcd=etcd, static_peers=config.cluster_peers)
    assert membership is not None
    transport: PeerTransport
    if config.cluster_data_lane:
        transport = DataLaneTransport(node_id, token=token, tls_ca=tls_ca, tls_cert=cert, tls_key=key,
                                      chunk_bytes=config.chunk_bytes, connections=config.data_lane_connections,
                                      io_timeout_s=config.data_lane_io_timeout_s,
                                      codec=config.cluster_lane_codec, chooser=chooser)
    else:
        transport = GrpcPeerTransport(node_id, token=token, tls_ca=tls_ca, tls_cert=cert, tls_key=key,
                                      chunk_bytes=config.chunk_bytes)
    return ClusterNode(store, membership, transport, settings, executor=executor)


async def join_cluster(node: ClusterNode, config: Config, bound: Sequence[str]) -> None:
    """Join the pool: this node's record gets where peers reach it (the bound listeners,
    with etcd) and when it started, then the node starts."""
    membership = node.membership
    me = membership.me
    addresses = me.addresses if config.cluster_peers else advertised(config, bound)
    await membership.update_me(replace(me, addresses=addresses, started_at=time.time()))
    await node.start()
    view = membership.view
    logger.info("cluster: node %s joined through %s; %d members in view (%s)", node.node_id,
                "etcd " + ",".join(config.cluster_etcd) if config.cluster_etcd else "a static list", len(view),
                ", ".join(sorted(view.members)))


# ------------------------------------------------------------------ puts


def put_position(header: kvstore_pb2.PutHeader) -> int | None:
    """The chain position of a put's first block, when the put names it."""
    if header.HasField("position"):
        return int(header.position)
    if header.keys.WhichOneof("keys") == "tokens":
        return int(header.keys.tokens.first_block)
    return None


def put_tokens(header: kvstore_pb2.PutHeader) -> bytes:
    """A put's token ids, packed, when it names its blocks by tokens (else empty)."""
    if header.keys.WhichOneof("keys") != "tokens":
        return b""
    tokens = header.keys.tokens
    return tokens.packed_u32le or token_bytes(tokens.token_ids)


def forward_put(node: PoolNode, resolver: RequestResolver, namespace_id: bytes, header: kvstore_pb2.PutHeader,
                resp: kvstore_pb2.PutResponse, hashes: Sequence[bytes] | None = None,
                parent: bytes | None = None) -> Awaitable[None] | None:
    """After a put committed here: its forwards to the owners of its units
    (`resp.forwarded_blocks`), and with `wait_for_owners` what to await for their commits
    (`resp.owner_committed_blocks`); None when there is nothing to await, so a put that
    waits for no owner awaits nothing. `hashes` and `parent`: the put's keys, when the
    caller has them (else they are worked out from the header). A node in no pool's view
    (a daemon alone, or a node that left) forwards nothing: it costs a put one call."""
    if node.left:
        return None
    if hashes is None:
        hashes, parent = resolver.put_keys(resolver.store.namespace(namespace_id), header)
    ticket = node.after_put(namespace_id, hashes, parent, put_position(header), tokens=put_tokens(header),
                            wait=header.wait_for_owners, from_peer=current_identity().peer)
    if ticket is None:
        return None
    resp.forwarded_blocks = ticket.blocks
    if header.wait_for_owners and ticket.blocks:
        return _owners_committed(ticket, node.settings.forward_timeout_s, resp)
    return None


async def _owners_committed(ticket: ForwardTicket, timeout_s: float, resp: kvstore_pb2.PutResponse) -> None:
    resp.owner_committed_blocks = await ticket.committed(timeout_s)


# ------------------------------------------------------------------ health


async def watch_health(node: ClusterNode, health: HealthServicer) -> None:
    """Keep the `kvstore.v1.Cluster` health status in step with the membership."""
    last = None
    while True:
        degraded = node.membership.status().degraded or node.left
        if degraded is not last:
            last = degraded
            await health.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING if degraded
                             else health_pb2.HealthCheckResponse.SERVING)
        await asyncio.sleep(HEALTH_POLL_S)


# ------------------------------------------------------------------ metrics


class ClusterCollector(Collector):
    """`kvstore_cluster_*`, read from the node's counters at scrape time."""

    def __init__(self, node_getter: Callable[[], ClusterNode | None]) -> None:
        self._node = node_getter

    def collect(self) -> Iterator[Any]:
        node = self._node()
        if node is None:
            return
        st = node.status()
        ms = st.membership

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("kvstore_cluster_members", "members in this node's view of the pool", len(st.members))
        yield gauge("kvstore_cluster_placed_members", "members that own placement units", sum(m.placed for m in st.members))
        yield gauge("kvstore_cluster_etcd_reachable", "1 while a live etcd session backs the view", int(ms.etcd_reachable))
        yield gauge("kvstore_cluster_degraded", "1 while serving from a view etcd does not confirm", int(ms.degraded))
        yield gauge("kvstore_cluster_in_grace", "1 while previous owners are still asked after a change",
                    int(st.in_grace))
        yield counter("kvstore_cluster_etcd_sessions", "etcd sessions that registered this node", ms.sessions_total)
        yield counter("kvstore_cluster_etcd_session_failures", "etcd sessions lost to an error",
                      ms.session_failures_total)
        suspects = GaugeMetricFamily("kvstore_cluster_peer_suspect", "1 while calls to the peer are skipped",
                                     labels=["peer"])
        lookups = CounterMetricFamily("kvstore_cluster_remote_lookups", "lookup calls to the peer", labels=["peer"])
        errors = CounterMetricFamily("kvstore_cluster_remote_lookup_errors",
                                     "lookup calls to the peer that failed or missed their deadline (misses)",
                                     labels=["peer", "kind"])
        hits = CounterMetricFamily("kvstore_cluster_remote_hit_blocks", "blocks lookups found on the peer",
                                   labels=["peer"])
        forwarded = CounterMetricFamily("kvstore_cluster_forwarded_blocks", "blocks forwarded to the peer and "
                                        "committed there", labels=["peer"])
        n_suspect = 0
        for m in st.members:
            if not m.is_self:
                suspects.add_metric([m.member.node_id], int(m.suspect))
                n_suspect += m.suspect
        for peer, ps in sorted(node.peers.items()):
            lookups.add_metric([peer], ps.lookups)
            errors.add_metric([peer, "error"], ps.lookup_errors)
            errors.add_metric([peer, "timeout"], ps.lookup_timeouts)
            hits.add_metric([peer], ps.hit_blocks)
        for peer, fs in sorted(node.forwarder.counters.by_node.items()):
            forwarded.add_metric([peer], fs.blocks)
        yield gauge("kvstore_cluster_suspect_peers", "peers whose calls are skipped now (circuit open)", n_suspect)
        yield from (suspects, lookups, errors, hits, forwarded)
        c, pc, fc = node.counters, node.puller.counters, node.forwarder.counters
        yield counter("kvstore_cluster_lookup_rounds", "lookups that asked other nodes", c.remote_lookups)
        yield counter("kvstore_cluster_peer_lookups", "other nodes' lookups answered here (not in kvstore_lookups)",
                      c.peer_lookups)
        yield counter("kvstore_cluster_peer_lookup_blocks", "blocks other nodes' lookups asked for here",
                      c.peer_lookup_blocks)
        yield counter("kvstore_cluster_peer_hit_blocks", "blocks other nodes' lookups found here", c.peer_hit_blocks)
        yield counter("kvstore_cluster_pulls", "copies of remote blocks into this node started", pc.pulls)
        yield counter("kvstore_cluster_pulled_blocks", "remote blocks copied here and verified", pc.pulled_blocks)
        yield counter("kvstore_cluster_pull_failures", "pulls that failed (their blocks are misses)", pc.failures)
        yield counter("kvstore_cluster_pull_checksum_failures", "pulled blocks whose bytes did not match their "
                      "checksum (never kept)", pc.checksum_failures)
        yield gauge("kvstore_cluster_pending_pull_blocks", "blocks being copied here now", node.puller.pending_blocks)
        yield gauge("kvstore_cluster_forward_queue_blocks", "blocks waiting to be forwarded", node.forwarder.queued_blocks)
        yield gauge("kvstore_cluster_forward_queue_capacity_blocks", "cluster_forward_queue",
                    node.forwarder.queue_blocks)
        yield counter("kvstore_cluster_forward_dropped_blocks", "forwards dropped: queue full or owner suspect",
                      fc.dropped_blocks)
        yield counter("kvstore_cluster_forward_failed_blocks", "forwards the owner refused or that failed",
                      fc.failed_blocks)
        yield counter("kvstore_cluster_replica_blocks", "blocks held as replicas of units owned elsewhere (put "
                      "here or pulled)", c.replica_blocks + pc.replica_blocks)
        yield counter("kvstore_cluster_unplaced_blocks", "put blocks not forwarded: their chain position was unknown",
                      c.unplaced_blocks)
        tc = node.transport.counters
        moved = CounterMetricFamily("kvstore_cluster_lane_bytes", "block bytes moved to (out) and from (in) other "
                                    "nodes on their data lanes", labels=["direction"])
        moved_blocks = CounterMetricFamily("kvstore_cluster_lane_blocks", "blocks moved to (out) and from (in) "
                                           "other nodes on their data lanes", labels=["direction"])
        grpc_moved = CounterMetricFamily("kvstore_cluster_grpc_bytes", "block bytes moved to (out) and from (in) "
                                         "other nodes in gRPC Put and Fetch streams", labels=["direction"])
        grpc_blocks = CounterMetricFamily("kvstore_cluster_grpc_blocks", "blocks moved to (out) and from (in) "
                                          "other nodes in gRPC Put and Fetch streams", labels=["direction"])
        for family, into, out in ((moved, tc.lane_bytes_in, tc.lane_bytes_out),
                                  (moved_blocks, tc.lane_blocks_in, tc.lane_blocks_out),
                                  (grpc_moved, tc.grpc_bytes_in, tc.grpc_bytes_out),
                                  (grpc_blocks, tc.grpc_blocks_in, tc.grpc_blocks_out)):
            family.add_metric(["in"], into)
            family.add_metric(["out"], out)
            yield family
        yield counter("kvstore_cluster_lane_fallbacks", "pulls and forwards sent through gRPC because the peer's "
                      "data lane was not to be had (none offered, or unreachable)", tc.fallbacks)
        calls = CounterMetricFamily("kvstore_cluster_peer_calls", "unary calls to other nodes (lookups, the data "
                                    "lane's control calls) by path: their peer lane, or gRPC", labels=["path"])
        calls.add_metric(["peer_lane"], tc.peer_lane_calls)
        calls.add_metric(["grpc"], tc.grpc_calls)
        yield calls


# ------------------------------------------------------------------ INFO and Admin


def info_section(node: PoolNode) -> str:
    st = node.status()
    if st is None:  # a daemon alone
        return "# Cluster\ncluster_enabled:0\n"
    from kvstore.cluster.data_lane_transport import DataLaneTransport
    from kvstore.cluster.pool import ClusterNode

    assert isinstance(node, ClusterNode)  # only a pool's node has a status
    ms = st.membership
    age = "" if ms.last_confirmed_age_s is None else f"{ms.last_confirmed_age_s:.1f}"
    lines = [
        "# Cluster", "cluster_enabled:1", f"cluster_node_id:{st.node_id}", f"cluster_backend:{ms.backend}",
        f"cluster_state:{ms.state.value}", f"cluster_degraded:{int(ms.degraded)}",
        f"cluster_etcd_reachable:{int(ms.etcd_reachable)}", f"cluster_etcd_endpoint:{ms.endpoint}",
        f"cluster_registered:{int(ms.registered)}", f"cluster_revision:{ms.revision}",
        f"cluster_last_confirmed_age_s:{age}", f"cluster_members:{len(st.members)}",
        f"cluster_placed_members:{sum(m.placed for m in st.members)}",
    ]
    for m in st.members:
        mm = m.member
        lines.append(f"cluster_member_{mm.node_id}:addresses={'|'.join(mm.addresses)},zone={mm.zone},"
                     f"self={int(m.is_self)},placed={int(m.placed)},suspect={int(m.suspect)},"
                     f"draining={int(mm.draining)}")
    c, pc, fc = node.counters, node.puller.counters, node.forwarder.counters
    lines += [
        f"cluster_unit_blocks:{st.unit_blocks}", f"cluster_replicas:{st.replicas}", f"cluster_in_grace:{int(st.in_grace)}",
        f"cluster_draining:{int(st.draining)}", f"cluster_left:{int(st.left)}",
        f"cluster_lookup_timeout_ms:{node.lookup_timeout_s * 1000:g}",
        f"cluster_remote_lookups:{c.remote_lookups}", f"cluster_remote_hit_blocks:{c.remote_hit_blocks}",
        f"cluster_local_past_prefix_blocks:{c.local_past_prefix_blocks}",
        f"cluster_peer_lookups:{c.peer_lookups}", f"cluster_peer_lookup_blocks:{c.peer_lookup_blocks}",
        f"cluster_peer_hit_blocks:{c.peer_hit_blocks}",
        f"cluster_pulls:{pc.pulls}", f"cluster_pulled_blocks:{pc.pulled_blocks}", f"cluster_pull_failures:{pc.failures}",
        f"cluster_pull_checksum_failures:{pc.checksum_failures}", f"cluster_pending_pull_blocks:{node.puller.pending_blocks}",
        f"cluster_forward_queue_blocks:{node.forwarder.queued_blocks}",
        f"cluster_forward_queue_capacity_blocks:{node.forwarder.queue_blocks}",
        f"cluster_forwarded_blocks:{fc.forwarded_blocks}", f"cluster_forward_dropped_blocks:{fc.dropped_blocks}",
        f"cluster_forward_failed_blocks:{fc.failed_blocks}",
        f"cluster_replica_blocks:{c.replica_blocks + pc.replica_blocks}",
        f"cluster_unplaced_blocks:{c.unplaced_blocks}", f"cluster_hot_pushes:{c.hot_pushes}",
        f"cluster_handoff_pushes:{c.handoff_pushes}",
        f"cluster_suspect_peers:{sum(m.suspect for m in st.members)}",
        f"cluster_data_lane:{int(isinstance(node.transport, DataLaneTransport))}",
    ]
    tc = node.transport.counters
    lines += [
        f"cluster_lane_bytes_in:{tc.lane_bytes_in}", f"cluster_lane_bytes_out:{tc.lane_bytes_out}",
        f"cluster_lane_blocks_in:{tc.lane_blocks_in}", f"cluster_lane_blocks_out:{tc.lane_blocks_out}",
        f"cluster_grpc_bytes_in:{tc.grpc_bytes_in}", f"cluster_grpc_bytes_out:{tc.grpc_bytes_out}",
        f"cluster_grpc_blocks_in:{tc.grpc_blocks_in}", f"cluster_grpc_blocks_out:{tc.grpc_blocks_out}",
        f"cluster_lane_fallbacks:{tc.fallbacks}",
        f"cluster_peer_lane_calls:{tc.peer_lane_calls}", f"cluster_grpc_calls:{tc.grpc_calls}",
        f"cluster_unroutable_records:{ms.unroutable_records_total}",
        f"cluster_node_id_conflict:{ms.node_id_conflict}", f"cluster_node_id_claims:{ms.node_id_claims_total}",
        f"cluster_last_error:{ms.last_error}", "",
    ]
    return "\n".join(lines)


def status_proto(node: PoolNode) -> admin_pb2.ClusterStatusResponse:
    st = node.status()
    if st is None:  # a daemon alone
        return admin_pb2.ClusterStatusResponse(enabled=False)
    ms = st.membership
    return admin_pb2.ClusterStatusResponse(
        enabled=True, node_id=st.node_id, backend=ms.backend, state=ms.state.value, etcd_reachable=ms.etcd_reachable,
        registered=ms.registered, revision=ms.revision,
        last_confirmed_age_s=-1.0 if ms.last_confirmed_age_s is None else ms.last_confirmed_age_s,
        last_error=ms.last_error, unit_blocks=st.unit_blocks, replicas=st.replicas, in_grace=st.in_grace,
        endpoint=ms.endpoint, degraded=ms.degraded, draining=st.draining,
        members=[admin_pb2.ClusterMember(
            node_id=m.member.node_id, addresses=list(m.member.addresses), zone=m.member.zone,
            capacity_bytes=m.member.capacity_bytes, version=m.member.version, started_at=m.member.started_at,
            self=m.is_self, suspect=m.suspect, suspect_for_s=m.suspect_for_s, draining=m.member.draining,
            placed=m.placed) for m in st.members],
    )


def where_proto(node: PoolNode, namespace_id: bytes, chain: bytes | list[bytes]) -> admin_pb2.ClusterWhereResponse:
    units = node.where(namespace_id, chain)
    return admin_pb2.ClusterWhereResponse(node_id=node.node_id, namespace_id=namespace_id, units=[
        admin_pb2.ClusterUnit(start=u.start, stop=u.stop, key=u.key, owners=list(u.owners),
                              lookup_targets=list(u.lookup_targets), held_here=u.held_here) for u in units])


async def drain_proto(node: PoolNode, timeout_s: float) -> admin_pb2.ClusterDrainResponse:
    """A drain within `timeout_s` (0: the node's default)."""
    result = await (node.drain(timeout_s) if timeout_s else node.drain())
    return admin_pb2.ClusterDrainResponse(units_pushed=result.units_pushed, blocks_pushed=result.blocks_pushed,
                                          units_failed=result.units_failed, left=result.left,
                                          units_gone=result.units_gone)


@contextlib.asynccontextmanager
async def health_watcher(node: ClusterNode, health: HealthServicer) -> Any:
    """`watch_health` as a task owned by the daemon's start-up stack."""
    task = asyncio.get_running_loop().create_task(watch_health(node, health), name="kvstore-cluster-health")
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
