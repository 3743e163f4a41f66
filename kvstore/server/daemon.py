"""The daemon, the composition root: builds the tiers and the store from a `Config`,
serves them over gRPC and the control lane, and shuts down cleanly.

Start-up is one `contextlib.AsyncExitStack`: the checksum executor, the tiers and the
store (which owns the tiers once built), the open local puts, the metrics endpoint, the
gRPC server (KVStore, Admin, grpc.health.v1.Health, reflection) and its listeners, the
data lane's listeners (`kvstore.server.data_lane.server`), the control lanes, the cluster node
when the daemon is one of a pool (`cluster = true`: kvstore.server.cluster; it joins once
the listeners are bound, and leaves first on SIGTERM), and the background tasks.
Whatever fails, what was built is torn down in
reverse, and `stop` unwinds the same stack. It refuses to start, with a message naming
the setting to change, on a bad address, an address in use (SO_REUSEPORT is turned off
so a second daemon cannot silently share a port), a non-loopback TCP address without a
token file (or without TLS unless `insecure_remote`), a socket directory another user
owns or may write, a token file other users can read, or a capacity larger than the
machine can give (`kvstore.server.listen`, `kvstore.server.host_resources`).

Each service gets its parts when it is built, and nothing is written into it after: the
pool's node is built (not started) before the services and handed to them, and a daemon
alone hands them a `SoloNode` (kvstore.server.pool_node), which gives a node alone's
answers.

On SIGTERM/SIGINT: health turns NOT_SERVING, event streams end, new calls are refused
(except commits of local puts whose bytes clients are copying), calls in flight and
those puts get `grace_s` to finish, then the stack unwinds: background tasks, lanes, the
gRPC server (with what is left of the grace), the Unix socket files, the metrics
endpoint, local puts still open (rolled back), the store (pending SSD writes flushed,
tiers closed), the executor. On SIGHUP
the config sources are read again and runtime-modifiable fields are applied (see
`kvstore.server.runtime`), and the token file is read again (a broken one keeps the old
table and logs an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import secrets
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from kvstore.codec_chooser import CodecChooser
from kvstore.control_lane_wire import lane_path
from kvstore.core.policies import DEFAULT_POLICY, EvictionPolicy, make_policy, parse_tier_policies
from kvstore.core.store import Store, StoreTier
from kvstore.core.tier import SharedWindow
from kvstore.errors import ConfigError, KVStoreError
from kvstore.logs import rate_limited
from kvstore.server.admin import AdminServicer
from kvstore.server.auth import Authenticator, TokenTable, check_unix_tenant, parse_token_file
from kvstore.server.cluster import (
    ClusterCollector,
    build_cluster,
    credential_check,
    health_watcher,
    join_cluster,
    member_check,
    resolve_cluster_node_id,
)
from kvstore.server.codecs import CodecCollector, CodecView
from kvstore.server.config import Config
from kvstore.server.connections import (
    ConnectionLimits,
    fit_connection_limits,
    grpc_server_options,
    raise_open_file_limit,
)
from kvstore.server.control_lane import ControlLaneServer
from kvstore.server.data_lane.server import (
    DataLaneCollector,
    DataLaneServer,
    check_lane_exposure,
    lane_addresses,
    server_tls,
)
from kvstore.server.data_lane.transfer import DataLaneSettings
from kvstore.server.data_lane.transfers import DataLaneTransfers
from kvstore.server.device_plane import DevicePlane
from kvstore.server.events import EventBus
from kvstore.server.generation import Generation
from kvstore.server.host_resources import GcFreezer, check_disk_capacity, resolve_host_capacity
from kvstore.server.interceptors import PipelineInterceptor
from kvstore.server.kv_events import KvEventsCollector, KvEventStreams, ObserverFanout, parse_streams
from kvstore.server.lease_tags import LeaseTags
from kvstore.server.lifecycle import DrainGate
from kvstore.server.listen import bind, check_exposure, prepare_unix_path, tls_credentials
from kvstore.server.local_plane import LocalPlaneService
from kvstore.server.local_puts import LocalPuts
from kvstore.server.metrics import Metrics, MetricsServer
from kvstore.server.pipeline import Pipeline
from kvstore.server.pool_node import PoolNode, SoloNode
from kvstore.server.reflection import enable_reflection
from kvstore.server.requests import RequestResolver
from kvstore.server.runtime import RuntimeConfig
from kvstore.server.servicer import KVStoreServicer
from kvstore.tiers import (
    HBM,
    HOST,
    Tier,
    TierSettings,
    build_tiers,
    default_shm_dir,
    make_copier,
    remove_stale_segments,
)
from kvstore.units import human_bytes
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2
from kvstore.wire import add_kvstore_servicer

if TYPE_CHECKING:
    from kvstore.cluster.pool import ClusterNode

logger = logging.getLogger(__name__)

# After a finished drain, how long the gRPC server waits for what the drain does not count.
AFTER_DRAIN_GRACE_S = 0.5

LEASE_SWEEP_S = 1.0
PR_SET_DUMPABLE = 4
# Loggers whose records a flood of connections repeats (a refused peer, an accept out of
# descriptors, a peer lane that cannot be reached every few seconds): one line per interval,
# with a count of the rest.
REPEATING_LOGGERS = ("asyncio", "grpc._cython.cygrpc", "kvstore.server.control_lane", "kvstore.cluster.peer_lane", "kvstore.cluster.data_lane_transport")
LOG_REPEAT_INTERVAL_S = 10.0
# sockaddr_un.sun_path: the longest Unix socket path, with its terminating NUL.
UNIX_PATH_BYTES = 108


_grpc_aio_held = False


def hold_grpc_aio() -> None:
    """Keep gRPC's asyncio runtime up for the rest of the process. gRPC shuts it down when
    its last server or channel is freed, joining its poller thread, and that join can wait
    forever (grpc/grpc#22365, #40989): a daemon's stop then never returns (seen with
    daemons started and stopped in one process). One reference of our own means it is
    never shut down before the process ends."""
    global _grpc_aio_held
    if not _grpc_aio_held:
        from grpc.experimental.aio import init_grpc_aio

        init_grpc_aio()
        _grpc_aio_held = True


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.addresses, self._metrics_addr = check_exposure(config)
        self.lane_addresses = lane_addresses(config, self.addresses)
        check_lane_exposure(config, self.lane_addresses)
        # The peer lane serves a pool's node-to-node calls: a single daemon has none.
        self.peer_lane_addresses = lane_addresses(config, self.addresses, "peer_lane_listen") if config.cluster else []
        check_lane_exposure(config, self.peer_lane_addresses, "peer_lane_listen")
        for addr in self.peer_lane_addresses:
            if addr.kind != "tcp":
                raise ConfigError(f"peer_lane_listen {addr.grpc_target}: the peer lane listens on TCP only")
        # Read now, so a bad token file stops the daemon before it binds anything.
        self.tokens: TokenTable | None = parse_token_file(config.auth_token_file) if config.auth_token_file else None
        self._tls = tls_credentials(config)
        if self.tokens is not None and config.unix_socket_tenant:
            check_unix_tenant(self.tokens, config.unix_socket_tenant, config.auth_token_file)
        self.auth = Authenticator(self.tokens, config.max_calls_per_tenant, config.unix_socket_tenant)
        self.events = EventBus(config.events_queue)
        # The KV event streams in vLLM's format (off by default), checked before anything binds.
        self.kv_event_specs = parse_streams(config, self.tokens.identities if self.tokens is not None else None)
        self.kv_events: KvEventStreams | None = None
        self._gate = DrainGate()
        self.store: Store | None = None
        self.metrics = Metrics(lambda: self.store, self.events)
        self.pipeline = Pipeline(self._gate, self.auth, self.metrics)
        self.runtime: RuntimeConfig | None = None
        self.bound: list[str] = []
        self.bound_lanes: list[str] = []  # socket paths of the local control lanes
        self.lanes: list[ControlLaneServer] = []
        self.peer_lanes: list[ControlLaneServer] = []  # the pool's node-to-node calls (docs/cluster.md)
        self.data_lane: DataLaneServer | None = None  # block bytes for remote clients (docs/net.md)
        self.metrics_address = ""  # HOST:PORT once the endpoint is up; empty when off
        self.connection_limits: ConnectionLimits | None = None  # fitted to the open-file limit at start
        self.gc_freezer = GcFreezer()
        # This start of the daemon (kvstore.server.generation): every plane hands it out,
        # and calls naming what an earlier start handed out are refused.
        self.generation = Generation()
        # The pool (cluster = true): its node id is resolved now, so a bad one stops the
        # daemon before it binds anything; the node joins once the listeners are up.
        self.node_id = resolve_cluster_node_id(config) if config.cluster else ""
        # What the services are handed: the pool's node, built before them, or a daemon
        # alone's (kvstore.server.pool_node); `cluster` is the pool's once it has joined.
        self.node: PoolNode = SoloNode()
        # The pool's lossless codec chooser (pulls and forwards; docs/codecs.md).
        self.codecs = CodecChooser()
        self.cluster: ClusterNode | None = None
        self._recovered_blocks = 0
        self._executor: ThreadPoolExecutor | None = None
        self._health: HealthServicer | None = None
        self._local_puts: LocalPuts | None = None
        self._transfers: DataLaneTransfers | None = None
        self._unix_paths: list[str] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._prefault: asyncio.Task[bool] | None = None
        self._prefault_stop = threading.Event()
        # What `start` built, to unwind in reverse; None before start and after stop.
        self._resources: contextlib.AsyncExitStack | None = None
        # Loop time until which the gRPC server's stop may wait for calls (set by `stop`).
        self._deadline = 0.0
        self._stopping = False
        self._stopped = asyncio.Event()

    @property
    def health(self) -> HealthServicer:
        assert self._health is not None
        return self._health

    def _policy(self, tier: str) -> EvictionPolicy:
        """The policy for `tier` from `--policy` (a name for every tier, or host=arc,ssd=lru)."""
        specs = parse_tier_policies(self.config.policy)
        name = specs.get(tier, specs.get("*", DEFAULT_POLICY))
        return make_policy(name, hint_budget_fraction=self.config.hint_budget)

    def _build_tiers(self, host_capacity: int, shm_dir: str) -> tuple[list[StoreTier], list[tuple[str, str]]]:
        """The tiers, top first, each with its policy and watermarks, and the absent ones
        with the reason (shown in stats). What was built is closed if this fails."""
        cfg = self.config
        if cfg.ssd_path:
            check_disk_capacity(cfg.ssd_path, cfg.ssd_capacity)
        built, absent = build_tiers(TierSettings(
            host_capacity_bytes=host_capacity, shm_dir=shm_dir, host_spaces=self.tokens is not None,
            hbm_capacity_bytes=cfg.hbm_capacity, gpu=cfg.gpu,
            ssd_path=cfg.ssd_path, ssd_capacity_bytes=cfg.ssd_capacity, ssd_region_size_bytes=cfg.ssd_region_size,
            ssd_io=cfg.ssd_io, ssd_io_threads=cfg.ssd_io_threads, ssd_compress=cfg.ssd_compress,
        ))
        try:
            return [self._store_tier(tier) for tier in built], absent
        except BaseException:
            for tier in reversed(built):
                tier.close()
            raise

    def _store_tier(self, tier: Tier) -> StoreTier:
        """`tier` with its policy and the watermarks configured for its kind (the last
        tier drops its victims and keeps the defaults)."""
        cfg = self.config
        watermarks = {HBM: (cfg.hbm_high_watermark, cfg.hbm_low_watermark),
                      HOST: (cfg.host_high_watermark, cfg.host_low_watermark)}.get(tier.name, ())
        return StoreTier(tier, self._policy(tier.name), *watermarks)

    async def start(self) -> None:
        """Build and serve everything; on any failure, tear down what was built, in reverse."""
        hold_grpc_aio()
        async with contextlib.AsyncExitStack() as stack:
            await self._start(stack)
            self._resources = stack.pop_all()

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        cfg = self.config
        stack.enter_context(rate_limited(REPEATING_LOGGERS, LOG_REPEAT_INTERVAL_S))
        raise_open_file_limit()
        shm_dir = cfg.shm_dir or default_shm_dir()
        remove_stale_segments(shm_dir)
        host_capacity = resolve_host_capacity(cfg.host_capacity, shm_dir)
        if cfg.put_tier == HBM and cfg.hbm_capacity <= 0:
            raise ConfigError("put_tier is hbm but there is no HBM tier; set --hbm-capacity or --put-tier auto")
        # The executor outlives the store: the store's last SSD writes hash on it.
        self._executor = ThreadPoolExecutor(cfg.checksum_threads, thread_name_prefix="kvstore-checksum")
        stack.callback(self._executor.shutdown, wait=True)
        tiers, absent = self._build_tiers(host_capacity, shm_dir)
        unowned = stack.enter_context(contextlib.ExitStack())
        for st in tiers:
            unowned.callback(st.tier.close)
        self.store = Store(
            tiers,
            migration=cfg.migration([st.name for st in tiers]),
            limits=cfg.store_limits(),
            executor=self._executor,
            make_copier=make_copier,
        )
        unowned.pop_all()  # the store owns its tiers now: closing it closes them
        stack.push_async_callback(self._close_store)
        store = self.store
        await store.start()
        self._recovered_blocks = store.indexed_blocks
        self.gc_freezer.frozen_at(self._recovered_blocks)  # the rebuild froze what it indexed
        self.gc_freezer.watch()
        self.metrics.count_gc(self.gc_freezer.pauses)
        stack.callback(self.gc_freezer.unwatch)
        store.observer = self.events
        if self.kv_event_specs:
            self._start_kv_events(stack, store)
        if self.tokens is not None:
            store.tenancy.quotas = self.tokens.quotas()
        self.runtime = RuntimeConfig(cfg, store, self.events)
        self._local_puts = LocalPuts(ttl_ms=round(cfg.put_idle_timeout_s * 1000))
        stack.callback(self._local_puts.abort_all)  # a put left open rolls back before the store closes
        # The pool's node is built (not started) before the services that call it, and
        # before anything listens: a bad cluster setting stops the daemon here.
        cluster = build_cluster(cfg, store, self.node_id, executor=self._executor,
                                tokens=self.tokens, chooser=self.codecs) if cfg.cluster else None
        if cluster is not None:
            self.node = cluster
            self.auth.members = member_check(cluster)  # node-to-node calls: current members only
            cluster.admits = credential_check(lambda: self.tokens)  # units: nodes with a credential only
            if self.kv_events is not None:  # forwards carry the names, so owners publish the same ones
                cluster.forwarder.names = self.kv_events.forward_names
        await self._start_metrics(stack)
        # The host tier is not the first one when an HBM tier sits above it.
        host_tier = next(st.tier for st in store.tiers if st.name == HOST)
        assert isinstance(host_tier, SharedWindow)
        server, servicer = self._services(store, host_tier, absent)
        await self._start_data_lane(stack)
        await self._start_grpc(stack, server)
        if cfg.local_lane:
            stack.push_async_callback(self._close_lanes)
            await self._start_lanes(servicer)
        if cluster is not None:
            stack.push_async_callback(self._close_peer_lanes)
            await self._start_peer_lanes(servicer)
            await self._start_cluster(stack, cluster)
        for name in ("", "kvstore.v1.KVStore", "kvstore.v1.Admin"):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._sweeper = asyncio.create_task(self._sweep_leases(), name="kvstore-lease-sweeper")
        stack.push_async_callback(_cancel, self._sweeper)
        if cfg.host_prefault:
            # In the background: the daemon serves at once, and puts get faster as the
            # segment's pages are mapped in.
            self._prefault = asyncio.create_task(
                asyncio.to_thread(host_tier.prefault, self._prefault_stop), name="kvstore-prefault"
            )
            stack.push_async_callback(self._stop_prefault)
        self._log_started(tiers, host_capacity)

    def _start_kv_events(self, stack: contextlib.AsyncExitStack, store: Store) -> None:
        """Bind the KV event streams, then install them as an observer next to the event
        bus and announce what recovery found, in one step (kvstore.server.kv_events)."""
        cfg = self.config
        for spec in self.kv_event_specs:
            for endpoint in (spec.endpoint, spec.replay_endpoint):
                if endpoint.startswith("ipc://") and not (cfg.kv_events_connect and endpoint == spec.endpoint):
                    prepare_unix_path(endpoint[len("ipc://"):], cfg.unix_socket_shared_dir)
        kv = KvEventStreams(store, self.kv_event_specs, topic=cfg.kv_events_topic,
                            buffer_steps=cfg.kv_events_buffer_steps, hwm=cfg.kv_events_hwm,
                            max_queue_size=cfg.kv_events_max_queue_size, connect=cfg.kv_events_connect,
                            ownership=self.node_id or cfg.node_id, auth=self.tokens is not None)
        kv.start()
        stack.push_async_callback(kv.close)
        self.kv_events = kv
        store.observer = ObserverFanout([self.events, kv])
        kv.announce_recovered()
        self.metrics.registry.register(KvEventsCollector(kv))
        for tenant, (endpoint, replay) in kv.bound.items():
            logger.info("KV events (vLLM's format) of tenant %s on %s%s", tenant, endpoint,
                        f", replay on {replay}" if replay else "")

    async def _start_cluster(self, stack: contextlib.AsyncExitStack, node: ClusterNode) -> None:
        """Join the pool (see kvstore.server.cluster): the services hold the node already."""
        assert self.runtime is not None
        await join_cluster(node, self.config, self.bound)
        self.cluster = node
        stack.push_async_callback(self._close_cluster, node)
        self.metrics.registry.register(ClusterCollector(lambda: self.cluster))
        self.runtime.register("cluster_lookup_timeout_ms", lambda ms: setattr(node, "lookup_timeout_s", ms / 1000.0))
        self.runtime.register("cluster_fetch_timeout_s", lambda s: setattr(node, "fetch_timeout_s", s))
        await stack.enter_async_context(health_watcher(node, self.health))

    async def _close_cluster(self, node: ClusterNode) -> None:
        self.cluster = None
        await node.aclose()

    def _services(self, store: Store, host_tier: SharedWindow,
                  absent: list[tuple[str, str]]) -> tuple[grpc.aio.Server, KVStoreServicer]:
        """The gRPC server with every service on it (not bound yet), and the KVStore
        servicer, which the lanes serve too."""
        cfg = self.config
        assert self.runtime is not None and self._local_puts is not None
        # Fitted now that the tiers hold their files: what is left is for connections.
        lanes = sum(a.kind == "unix" for a in self.addresses) if cfg.local_lane else 0
        limits = self.connection_limits = fit_connection_limits(cfg, len(self.addresses) + lanes)
        server = grpc.aio.server(
            interceptors=[PipelineInterceptor(self.pipeline)],
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                *grpc_server_options(limits),
            ],
        )
        auth_on = self.tokens is not None
        resolver = RequestResolver(
            store, LeaseTags(secrets.token_bytes(32) if auth_on else None),
            max_tokens_per_call=cfg.max_tokens_per_call, max_block_bytes=cfg.max_block_bytes,
            max_namespaces_per_tenant=cfg.max_namespaces_per_tenant if auth_on else None)
        self.runtime.register("max_tokens_per_call", lambda value: setattr(resolver, "max_tokens_per_call", value))
        if self.kv_events is not None:
            resolver.put_names = self.kv_events.offer_put
        node = self.node
        local = LocalPlaneService(store, resolver, host_tier, self._local_puts, node)
        transfers = DataLaneTransfers(store, resolver, DataLaneSettings(
            window_bytes=cfg.data_lane_window, max_connections_per_transfer=cfg.data_lane_connections,
            io_timeout_s=cfg.data_lane_io_timeout_s, max_block_bytes=cfg.max_block_bytes,
            put_window_bytes=cfg.max_put_reserve_bytes, put_idle_timeout_s=cfg.put_idle_timeout_s,
            codecs=cfg.lane_codecs,
            boot_id=self.generation.boot_id,
        ), lambda: self.data_lane.endpoints() if self.data_lane is not None else [], node)
        self._transfers = transfers
        servicer = KVStoreServicer(store, resolver, local, DevicePlane(store, local, self._local_plane_tenants), node,
                                   cfg.chunk_bytes, cfg.max_put_reserve_bytes, cfg.put_idle_timeout_s, transfers,
                                   self.generation)
        add_kvstore_servicer(servicer, server)
        codecs = CodecView(store, self.codecs if self.config.cluster else None)
        self.metrics.registry.register(CodecCollector(codecs.choices))
        admin = AdminServicer(store, self.runtime, self.events, node, resolver, absent, lambda: self.auth.in_flight,
                              self.gc_freezer.pauses, self.kv_events, codecs)
        admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        enable_reflection(
            (
                kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name,
                admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            ),
            server,
        )
        return server, servicer

    def _local_plane_tenants(self) -> int:
        """How many tenants may use the shared-memory and device planes now."""
        table = self.auth.table
        return 1 if table is None else sum(i.local_plane for i in table.identities.values())

    async def _start_grpc(self, stack: contextlib.AsyncExitStack, server: grpc.aio.Server) -> None:
        """Bind every listen address and start serving; stopping the server releases them."""
        stack.callback(self._remove_unix_sockets)  # once the server has stopped
        stack.push_async_callback(self._stop_grpc, server)
        for addr in self.addresses:
            self.bound.append(bind(server, addr, self._tls, self.config.unix_socket_shared_dir))
            if addr.kind == "unix":
                self._unix_paths.append(addr.path)
        await server.start()

    async def _start_data_lane(self, stack: contextlib.AsyncExitStack) -> None:
        """The data lane's listeners, closed (transfers released) before the store."""
        assert self._transfers is not None
        if not self.lane_addresses:
            return
        lane = DataLaneServer(self._transfers, self.auth, server_tls(self.config),
                              self.config.data_lane_max_connections, self.config.data_lane_advertise)
        stack.push_async_callback(lane.close)
        self.data_lane = lane
        await lane.start(self.lane_addresses)
        self.metrics.registry.register(DataLaneCollector(lane.counters))
        self.metrics.count_lane(lane.counters.get)

    async def _start_metrics(self, stack: contextlib.AsyncExitStack) -> None:
        if self._metrics_addr is None:
            return
        metrics_server = MetricsServer(self.metrics, self._metrics_addr.host, self._metrics_addr.port)
        try:
            await metrics_server.start()
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {self._metrics_addr.grpc_target}: {exc.strerror}; "
                "choose another --metrics-listen or 'off'"
            ) from None
        stack.push_async_callback(metrics_server.close)
        self.metrics_address = metrics_server.address

    def _log_started(self, tiers: list[StoreTier], host_capacity: int) -> None:
        cfg = self.config
        data_lanes = [f"data lane {a.grpc_target}" for a in self.data_lane.bound] if self.data_lane else []
        logger.info(
            "kvstore serving on %s; tiers %s, policy %s", ", ".join(self.bound + self.bound_lanes + data_lanes),
            ", ".join(f"{t.name} {human_bytes(t.tier.capacity_bytes)}" for t in tiers), cfg.policy
        )
        if self.metrics_address:
            logger.info("metrics at http://%s/metrics", self.metrics_address)
        if self.tokens is not None:
            logger.info("auth on: %d tenants from %s; TCP %s", len(self.tokens), cfg.auth_token_file,
                        "with TLS" + (" and client certificates" if cfg.tls_client_ca else "") if self._tls else
                        "without TLS")
        else:
            logger.info("auth off: one tenant (default, admin role); listening on this host only")
        effective = {**cfg.as_dict(), "host_capacity": host_capacity}
        logger.info("effective config: %s", effective, extra={"config": effective})

    async def _start_lanes(self, servicer: KVStoreServicer) -> None:
        """The local control lane next to each Unix socket. It only saves time, so a lane
        that cannot be made is logged and skipped (clients then use gRPC)."""
        for addr in self.addresses:
            if addr.kind != "unix":
                continue
            path = lane_path(addr.path)
            if len(os.fsencode(path)) >= UNIX_PATH_BYTES:
                logger.warning("no local control lane for %s: the path %s is too long for a Unix socket",
                               addr.path, path)
                continue
            prepare_unix_path(path, self.config.unix_socket_shared_dir)
            lane = self._lane_server(servicer)
            try:
                await lane.start(path)
            except OSError as exc:
                logger.warning("no local control lane at %s: %s", path, exc.strerror or exc)
                continue
            self.lanes.append(lane)
            self.bound_lanes.append(path)

    def _lane_server(self, servicer: KVStoreServicer) -> ControlLaneServer:
        """A control lane server for the servicer, within the daemon's connection limits."""
        limits = self.connection_limits
        assert limits is not None
        return ControlLaneServer(servicer, self.pipeline, self.config.max_message_bytes, limits.max_connections,
                          deferral=servicer.store.deferral, hello_timeout_s=limits.handshake_timeout_s,
                          idle_s=limits.idle_s, boot_id=self.generation.boot_id)

    async def _start_peer_lanes(self, servicer: KVStoreServicer) -> None:
        """The peer lane (kvstore.server.control_lane, docs/cluster.md) on each of its addresses,
        offered to the pool's other daemons by the DataLane call. It only saves time: one
        that cannot be bound is logged and skipped (the peers then use gRPC)."""
        tls = server_tls(self.config) if self.peer_lane_addresses else None
        bound: list[kvstore_pb2.DataLaneEndpoint] = []
        for addr in self.peer_lane_addresses:
            lane = self._lane_server(servicer)
            try:
                where = await lane.start_tcp(addr.host, addr.port, tls)
            except OSError as exc:
                logger.warning("no peer lane at %s: %s", addr.grpc_target, exc.strerror or exc)
                continue
            self.peer_lanes.append(lane)
            bound.append(kvstore_pb2.DataLaneEndpoint(address=where, tls=tls is not None))
        if self._transfers is not None:
            self._transfers.peer_lane_endpoints = bound

    async def _close_peer_lanes(self) -> None:
        if self._transfers is not None:
            self._transfers.peer_lane_endpoints = []
        for lane in self.peer_lanes:
            await lane.close()
        self.peer_lanes.clear()

    # -------------------------------------------------------------- teardown steps

    async def _stop_prefault(self) -> None:
        assert self._prefault is not None
        self._prefault_stop.set()
        try:
            await self._prefault
        except Exception:  # task boundary: shutdown goes on
            logger.exception("prefaulting the host segment failed")

    async def _close_lanes(self) -> None:
        for lane in self.lanes:
            await lane.close()
        self.lanes.clear()

    async def _stop_grpc(self, server: grpc.aio.Server) -> None:
        # What is left after a drain: calls accepted just before the gate closed (they are
        # being refused) and streams the gate does not wait for (a health Watch, which has
        # already been told NOT_SERVING and never ends by itself). Once the drain is done
        # they get a moment for their last message, not the rest of the grace.
        remaining = max(0.0, self._deadline - asyncio.get_running_loop().time())
        await server.stop(remaining if self._gate.in_flight else min(remaining, AFTER_DRAIN_GRACE_S))

    def _remove_unix_sockets(self) -> None:
        for path in self._unix_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._unix_paths.clear()

    async def _close_store(self) -> None:
        """Pending SSD writes are flushed before the tiers close (and the SSD tier writes
        its snapshot for a fast next start)."""
        if self.store is not None:
            store, self.store = self.store, None
            # Calls cancelled by the stop leave exceptions whose frames, in reference
            # cycles, hold views of tier memory (a slot being filled, a block being sent):
            # a segment with views left cannot be unmapped.
            gc.collect()
            await store.aclose()

    def reload(self, load: Callable[[], Config]) -> None:
        """SIGHUP: re-read the config sources and apply what may change live."""
        if self.runtime is None or self._stopping:
            return
        try:
            self.runtime.reload(load)
        except KVStoreError as exc:
            logger.error("reload failed, settings unchanged: %s", exc)
        self.reload_tokens()

    def reload_tokens(self) -> bool:
        """Read the token file again; a file that does not parse keeps the old table."""
        if self.tokens is None or self.store is None:
            return False
        try:
            table = parse_token_file(self.config.auth_token_file)
            if self.config.unix_socket_tenant:
                check_unix_tenant(table, self.config.unix_socket_tenant, self.config.auth_token_file)
        except KVStoreError as exc:
            logger.error("token file reload failed, the previous %d tenants stay in force: %s", len(self.tokens), exc)
            return False
        self.tokens = table
        self.auth.table = table
        self.store.tenancy.quotas = table.quotas()
        if self.cluster is not None:
            self.cluster.refresh()  # a node whose credential went owns no units any more
        logger.info("token file reloaded: %d tenants", len(table))
        return True

    async def _sweep_leases(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(LEASE_SWEEP_S)
            try:
                self.store.expire_leases()
                self.store.expire_namespaces()
                if self._local_puts is not None:
                    self._local_puts.expire()
                self.gc_freezer.maybe_freeze(self.store.counters.blocks_stored + self._recovered_blocks,
                                             self.store.indexed_blocks)
            except Exception:  # task boundary: keep sweeping
                logger.exception("lease sweep failed")

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown; safe to call more than once."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        grace = self.config.grace_s if grace_s is None else grace_s
        logger.info("shutting down: draining in-flight calls for up to %.1fs", grace)
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        # Leave every view first: peers stop forwarding here while calls drain.
        await self.node.leave()
        # Event streams never end by themselves; end them so the drain is not held open.
        self.events.close()
        self._prefault_stop.set()
        self._deadline = asyncio.get_running_loop().time() + grace
        await self._drain(self._deadline)
        resources, self._resources = self._resources, None
        if resources is not None:
            await resources.aclose()
        self._stopped.set()
        logger.info("kvstore stopped")

    async def _drain(self, deadline: float) -> None:
        """Refuse new calls, then wait for calls in flight and for local puts whose bytes
        co-located clients are copying (their commit is still accepted; see `DrainGate`)."""
        local = self._local_puts
        transfers = self._transfers

        def no_local_puts() -> bool:
            # Data lane transfers count too: their bytes are on the way after the call that opened them.
            return (local is None or not len(local)) and (transfers is None or not len(transfers))

        self._gate.close()
        if self._gate.in_flight or not no_local_puts():
            logger.info("draining %d calls and %d local puts", self._gate.in_flight, 0 if local is None else len(local))
        if not await self._gate.wait_idle(deadline, also=no_local_puts):
            logger.warning("the grace time is spent and %d calls and %d local puts are still open; they are "
                           "cancelled and rolled back", self._gate.in_flight, 0 if local is None else len(local))

    async def wait_stopped(self) -> None:
        """Returns once `stop` has finished."""
        await self._stopped.wait()


def make_undumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0): this process's /proc entries (open files, memory, maps)
    become root's, and other processes of its uid can neither ptrace it nor open them.
    With auth on, the daemon holds every tenant's segment open; without this, any process
    of its uid could open them through /proc/<pid>/fd."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


async def serve(config: Config, reload: Callable[[], Config] | None = None) -> None:
    """Run a daemon until SIGTERM or SIGINT, then shut it down gracefully.

    `reload` re-reads the config sources; with it, SIGHUP applies runtime fields. With a
    token file, the process first becomes non-dumpable (`make_undumpable`): tenants'
    segments are then reachable only through the control lane.
    """
    if config.auth_token_file:
        make_undumpable()
    daemon = Daemon(config)
    await daemon.start()
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, daemon.reload, reload)
    try:
        await stop_requested.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    await daemon.stop()
