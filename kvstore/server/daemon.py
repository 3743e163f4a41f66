"""The daemon: builds the store from a `Config`, serves it over gRPC, shuts down cleanly.

Start-up is a stack torn down in reverse: tiers and executor, store, gRPC server
(KVStore, Admin, grpc.health.v1.Health, reflection), listeners, background tasks.
It refuses to start, with a message naming the setting to change, on a bad address, an
address in use (SO_REUSEPORT is turned off so a second daemon cannot silently share a
port), a non-loopback TCP address without a token file (or without TLS unless
`insecure_remote`), a token file other users can read, or a capacity larger than the
machine can give.

On SIGTERM/SIGINT: health turns NOT_SERVING, event streams end, new calls are refused
(except commits of local puts whose bytes clients are copying), calls in flight and
those puts get `grace_s` to finish, then the server stops, the metrics endpoint closes,
tiers are closed and the Unix socket file is removed. On SIGHUP the config sources are
read again and runtime-modifiable fields are applied (see `kvstore.server.runtime`), and the
token file is read again (a broken one keeps the old table and logs an error).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import gc
import ipaddress
import logging
import os
import secrets
import signal
import socket
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvstore.core.policies import DEFAULT_POLICY, EvictionPolicy, make_policy, parse_tier_policies
from kvstore.core.store import MigrationConfig, Store, StoreLimits, StoreTier, WritePolicy
from kvstore.core.tier import Tier
from kvstore.errors import ConfigError, KVStoreError
from kvstore.laneproto import lane_path
from kvstore.server.admin import OpsAdminServicer
from kvstore.server.auth import AuthInterceptor, TokenTable, parse_token_file
from kvstore.server.config import AUTO, Config
from kvstore.server.events import EventBus
from kvstore.server.interceptors import ErrorInterceptor
from kvstore.server.lane import LaneServer
from kvstore.server.lifecycle import DrainGate
from kvstore.server.local_puts import LocalPuts
from kvstore.server.metrics import Metrics, MetricsServer
from kvstore.server.runtime import RuntimeConfig
from kvstore.server.servicer import KVStoreServicer
from kvstore.tiers import make_copier
from kvstore.tiers.host import HostTier
from kvstore.tiers.segment import default_shm_dir, free_bytes, remove_stale_segments
from kvstore.units import human_bytes
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2
from kvstore.wire import add_kvstore_servicer

logger = logging.getLogger(__name__)

LEASE_SWEEP_S = 1.0
# See GcFreezer.
GC_FREEZE_MIN_BLOCKS = 100_000
GC_FREEZE_GROWTH = 0.25
AUTO_HOST_CAPACITY = 4 << 30
# See tune_malloc. glibc's mallopt parameters.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD = 4 << 20
MALLOC_TRIM_THRESHOLD = 256 << 20


def tune_malloc() -> bool:
    """Keep block-sized buffers (a gRPC message of a 1 MiB chunk, its joined payload) in
    the C heap once freed, instead of returning them to the kernel and faulting fresh
    pages in for the next message.

    glibc hands allocations over its mmap threshold to mmap and trims the heap top
    whenever more than the trim threshold is free; both move with the allocation pattern,
    and under a stream of ~1 MiB messages the daemon kept giving memory back and taking
    it again. Fixed thresholds (4 MiB, 256 MiB) measured 15-25% more gRPC put throughput
    (docs/operations.md). Allocations over 4 MiB (the block table's columns at scale) are
    still mmapped, so their untouched pages stay free. Skipped when the operator set
    glibc's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, and off glibc.
    Returns whether the thresholds were set.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return False
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


class GcFreezer:
    """Keeps the cyclic garbage collector off the block index.

    Index entries are long-lived and hold no reference cycles, yet every full collection
    walks all of them: 0.5 to 1.2 s of CPU per million blocks on a 2-core machine,
    a stall of the event loop that grows with the index (at ten million blocks, seconds).
    Once at least `GC_FREEZE_MIN_BLOCKS` blocks were stored since the last time, and at
    least a `GC_FREEZE_GROWTH` share of the index, the young generations are collected
    and everything alive is frozen (`gc.freeze`): later collections skip it. A frozen
    object is still freed by reference counting when its block leaves; only cyclic
    garbage already in the oldest generation at that moment is kept.
    """

    def __init__(self, min_blocks: int = GC_FREEZE_MIN_BLOCKS, growth: float = GC_FREEZE_GROWTH) -> None:
        self.min_blocks = min_blocks
        self.growth = growth
        self.freezes = 0
        self._stored_at_freeze = 0

    def frozen_at(self, stored_total: int) -> None:
        """Count from here: everything up to `stored_total` blocks is frozen already."""
        self._stored_at_freeze = stored_total

    def maybe_freeze(self, stored_total: int, indexed: int) -> bool:
        """`stored_total`: blocks ever stored or recovered; `indexed`: blocks in the index now."""
        fresh = stored_total - self._stored_at_freeze
        if fresh < self.min_blocks or fresh < self.growth * indexed:
            return False
        gc.collect(1)
        gc.freeze()
        self._stored_at_freeze = stored_total
        self.freezes += 1
        logger.debug("gc: %d objects frozen after %d new blocks", gc.get_freeze_count(), fresh)
        return True


@dataclass(frozen=True, slots=True)
class ListenAddress:
    kind: str  # "unix" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    @property
    def grpc_target(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_listen(addr: str) -> ListenAddress:
    """`unix:PATH`, `unix:///PATH`, `HOST:PORT` or `[V6]:PORT` -> `ListenAddress`."""
    if addr.startswith("unix:"):
        path = addr[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ConfigError(f"listen address {addr!r} has no socket path; write unix:/path/to/kvstore.sock")
        return ListenAddress("unix", path=os.path.abspath(path))
    host, sep, port_text = addr.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"listen address {addr!r} is neither unix:PATH nor HOST:PORT")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"listen address {addr!r} has a port that is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"listen address {addr!r}: port must be in [0, 65535]")
    return ListenAddress("tcp", host=host, port=port)


def check_exposure(config: Config) -> tuple[list[ListenAddress], ListenAddress | None]:
    """The listen and metrics addresses, refused when they expose the daemon beyond this
    host without what that needs: a token file for gRPC, and TLS unless `insecure_remote`;
    `metrics_remote` for the (unauthenticated) metrics endpoint."""
    addresses = [parse_listen(a) for a in config.listen]
    for addr in addresses:
        if addr.kind != "tcp" or _is_loopback(addr.host):
            continue
        if not config.auth_token_file:
            raise ConfigError(
                f"listen address {addr.grpc_target} is not loopback, and serving other hosts needs "
                "authentication: set --auth-token-file (tokens from `kvstore token new`; see SECURITY.md)"
            )
        if not config.tls_cert and not config.insecure_remote:
            raise ConfigError(
                f"listen address {addr.grpc_target} is not loopback and TLS is off, so tokens would cross the "
                "network in clear text: set --tls-cert and --tls-key, or --insecure-remote on a trusted network"
            )
    metrics_addr = None
    if config.metrics_listen.strip().lower() != "off":
        metrics_addr = parse_listen(config.metrics_listen)
        if metrics_addr.kind != "tcp":
            raise ConfigError(f"metrics_listen {config.metrics_listen!r} must be HOST:PORT or 'off'")
        if not _is_loopback(metrics_addr.host) and not config.metrics_remote:
            raise ConfigError(
                f"metrics_listen {config.metrics_listen!r} is not loopback and the metrics endpoint has no "
                "authentication: set --metrics-remote to serve it to other hosts, or use a loopback address"
            )
    return addresses, metrics_addr


def _check_unix_tenant(table: TokenTable, tenant: str, path: str) -> None:
    if tenant not in table.identities:
        raise ConfigError(
            f"unix_socket_tenant {tenant!r} is not a tenant of {path}; known: {', '.join(sorted(table.identities))}"
        )


def _read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_host_capacity(value: int | str, shm_dir: str) -> int:
    """The host tier's size: `auto` picks min(4GiB, half of available memory, 90% of the
    shared-memory directory's free space); an explicit size must fit both."""
    available = available_memory_bytes()
    try:
        shm_free = free_bytes(shm_dir)
    except OSError as exc:
        raise ConfigError(f"cannot use shm_dir {shm_dir}: {exc.strerror}; point --shm-dir at a tmpfs directory") from None
    if value == AUTO:
        return min(AUTO_HOST_CAPACITY, available // 2, shm_free * 9 // 10)
    assert isinstance(value, int)
    if value > available:
        raise ConfigError(
            f"host_capacity {human_bytes(value)} is more than this machine's available memory "
            f"({human_bytes(available)}); lower --host-capacity"
        )
    if value > shm_free:
        # A tmpfs that fills up kills the daemon with SIGBUS on the next write: refuse now.
        raise ConfigError(
            f"host_capacity {human_bytes(value)} does not fit in {shm_dir} ({human_bytes(shm_free)} free); "
            "lower --host-capacity, enlarge the tmpfs, or point --shm-dir at a bigger one"
        )
    return value


def check_disk_capacity(path: str, capacity: int) -> None:
    """Refuse an SSD capacity the filesystem cannot hold (existing region files count as held)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.statvfs(path)
        names = os.listdir(path)
    except OSError as exc:
        raise ConfigError(f"cannot use ssd_path {path}: {exc.strerror}; choose a writable directory") from None
    free = st.f_bavail * st.f_frsize
    held = 0
    for name in names:
        if name.startswith("region-"):
            try:
                held += os.stat(os.path.join(path, name)).st_blocks * 512
            except OSError:
                pass
    if capacity > free + held:
        raise ConfigError(
            f"ssd_capacity {human_bytes(capacity)} is more than the filesystem of {path} can hold "
            f"({human_bytes(free + held)} free or already ours); lower --ssd-capacity or choose another --ssd-path"
        )


def _prepare_unix_path(path: str) -> None:
    """Create the socket's directory (0700) and clear a stale socket, refusing a live one."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create socket directory {directory}: {exc.strerror}") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path} exists and is not a socket; choose another --listen path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            os.unlink(path)  # left behind by a daemon that did not shut down cleanly
            return
        raise ConfigError(f"cannot check socket {path}: {exc.strerror}") from None
    else:
        raise ConfigError(f"{path} is in use by another running daemon; stop it or choose another --listen path")
    finally:
        probe.close()


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.addresses, metrics_addr = check_exposure(config)
        # Read now, so a bad token file stops the daemon before it binds anything.
        self.tokens: TokenTable | None = parse_token_file(config.auth_token_file) if config.auth_token_file else None
        self._tls: grpc.ServerCredentials | None = None
        if config.tls_cert:
            client_ca = _read_pem(config.tls_client_ca, "tls_client_ca") if config.tls_client_ca else None
            self._tls = grpc.ssl_server_credentials(
                [(_read_pem(config.tls_key, "tls_key"), _read_pem(config.tls_cert, "tls_cert"))],
                root_certificates=client_ca,
                require_client_auth=client_ca is not None,
            )
        if self.tokens is not None and config.unix_socket_tenant:
            _check_unix_tenant(self.tokens, config.unix_socket_tenant, config.auth_token_file)
        self.auth = AuthInterceptor(self.tokens, config.max_calls_per_tenant, config.unix_socket_tenant)
        self.bound: list[str] = []
        self.bound_lanes: list[str] = []  # socket paths of the local control lanes
        self.store: Store | None = None
        self._server: grpc.aio.Server | None = None
        self._health: HealthServicer | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped = asyncio.Event()
        self._unix_paths: list[str] = []
        self.lanes: list[LaneServer] = []
        self._local_puts: LocalPuts | None = None
        self._prefault: asyncio.Task[bool] | None = None
        self._prefault_stop = threading.Event()
        self.events = EventBus(config.events_queue)
        self._gate = DrainGate()
        self.runtime: RuntimeConfig | None = None
        self.metrics = Metrics(lambda: self.store, self.events)
        self._metrics_server: MetricsServer | None = None
        self.metrics_address = ""  # HOST:PORT once the endpoint is up; empty when off
        self._metrics_addr = metrics_addr
        self.gc_freezer = GcFreezer()
        self._recovered_blocks = 0

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
        """The tiers, top first, and the absent ones with the reason (shown in stats)."""
        cfg = self.config
        built: list[Tier] = []
        tiers: list[StoreTier] = []
        absent: list[tuple[str, str]] = []
        try:
            if cfg.hbm_capacity <= 0:
                absent.append(("hbm", "not configured (--hbm-capacity 0)"))
            else:
                from kvstore.tiers.cuda import cuda_unavailable_reason

                reason = cuda_unavailable_reason(cfg.gpu)
                if reason:
                    absent.append(("hbm", reason))
                    logger.warning("hbm tier absent: %s", reason)
                else:
                    from kvstore.tiers.hbm import HbmTier

                    hbm = HbmTier(cfg.hbm_capacity, device=cfg.gpu)
                    built.append(hbm)
                    tiers.append(StoreTier(hbm, self._policy("hbm"), cfg.hbm_high_watermark,
                                           cfg.hbm_low_watermark))
            host = HostTier(host_capacity, shm_dir=shm_dir)
            built.append(host)
            tiers.append(StoreTier(host, self._policy("host"), cfg.host_high_watermark, cfg.host_low_watermark))
            if cfg.ssd_path:
                from kvstore.tiers.ssd import SsdTier

                check_disk_capacity(cfg.ssd_path, cfg.ssd_capacity)
                ssd = SsdTier(cfg.ssd_path, cfg.ssd_capacity, region_size=cfg.ssd_region_size, io_mode=cfg.ssd_io,
                              io_threads=cfg.ssd_io_threads, compress=cfg.ssd_compress)
                built.append(ssd)
                tiers.append(StoreTier(ssd, self._policy("ssd")))
            else:
                absent.append(("ssd", "not configured (--ssd-path)"))
        except BaseException:
            for tier in built:
                tier.close()
            raise
        return tiers, absent

    async def start(self) -> None:
        cfg = self.config
        shm_dir = cfg.shm_dir or default_shm_dir()
        remove_stale_segments(shm_dir)
        host_capacity = resolve_host_capacity(cfg.host_capacity, shm_dir)
        if cfg.put_tier == "hbm" and cfg.hbm_capacity <= 0:
            raise ConfigError("put_tier is hbm but there is no HBM tier; set --hbm-capacity or --put-tier auto")
        self._executor = ThreadPoolExecutor(cfg.checksum_threads, thread_name_prefix="kvstore-checksum")
        try:
            tiers, absent = self._build_tiers(host_capacity, shm_dir)
        except BaseException:
            self._close_resources()
            raise
        put_tier = cfg.put_tier if cfg.put_tier == "auto" or any(t.name == cfg.put_tier for t in tiers) else "auto"
        self.store = Store(
            tiers,
            migration=MigrationConfig(
                write_policy=WritePolicy(cfg.ssd_write_policy),
                put_tier=put_tier,
                promote_on_hit=cfg.promote_on_hit,
                batch_blocks=cfg.migration_batch_blocks,
            ),
            limits=StoreLimits(
                max_blocks_per_call=cfg.max_blocks_per_call,
                max_namespaces=cfg.max_namespaces,
                max_leases=cfg.max_leases,
                # Without a token file every caller is the one default tenant: max_leases is the cap.
                max_leases_per_tenant=cfg.max_leases_per_tenant if self.tokens is not None else None,
                max_lease_ms=cfg.max_lease_ms,
                default_pin_ms=cfg.default_pin_ms,
            ),
            executor=self._executor,
            make_copier=make_copier,
        )
        try:
            await self.store.start()
        except BaseException:
            self._close_resources()
            raise
        self._recovered_blocks = self.store.indexed_blocks
        self.gc_freezer.frozen_at(self._recovered_blocks)  # the rebuild froze what it indexed
        self.store.observer = self.events
        if self.tokens is not None:
            self.store.tenancy.quotas = self.tokens.quotas()
        self.runtime = RuntimeConfig(cfg, self.store, self.events)
        server = grpc.aio.server(
            # Metrics outermost, so it sees the status the error interceptor set.
            # The drain gate next, so refused calls are counted too. Auth innermost, so
            # the identity it sets is in the servicer's context.
            interceptors=[self.metrics.interceptor(), self._gate, ErrorInterceptor(), self.auth],
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
            ],
        )
        # The host tier is not the first one when an HBM tier sits above it.
        host_tier = next(st.tier for st in self.store.tiers if st.name == "host")
        assert isinstance(host_tier, HostTier)
        self._local_puts = LocalPuts()
        auth_on = self.tokens is not None
        servicer = KVStoreServicer(self.store, cfg.chunk_bytes, host_tier.segment, self._local_puts,
                                   max_tokens_per_call=cfg.max_tokens_per_call, max_block_bytes=cfg.max_block_bytes,
                                   lease_key=secrets.token_bytes(32) if auth_on else None,
                                   max_namespaces_per_tenant=cfg.max_namespaces_per_tenant if auth_on else None)
        self.runtime.register("max_tokens_per_call", lambda value: setattr(servicer, "max_tokens_per_call", value))
        add_kvstore_servicer(servicer, server)
        admin_pb2_grpc.add_AdminServicer_to_server(
            OpsAdminServicer(self.store, self.runtime, self.events, absent, lambda: self.auth.in_flight), server
        )
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (
                kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name,
                admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        try:
            for addr in self.addresses:
                self.bound.append(self._bind(server, addr))
        except BaseException:
            self._close_resources()
            raise
        if self._metrics_addr is not None:
            metrics_server = MetricsServer(self.metrics, self._metrics_addr.host, self._metrics_addr.port)
            try:
                await metrics_server.start()
            except OSError as exc:
                await server.stop(0)  # releases the gRPC ports bound above
                self._close_resources()
                raise ConfigError(
                    f"cannot serve metrics on {self._metrics_addr.grpc_target}: {exc.strerror}; "
                    "choose another --metrics-listen or 'off'"
                ) from None
            self._metrics_server = metrics_server
            self.metrics_address = metrics_server.address
        await server.start()
        self._server = server
        if cfg.local_lane:
            try:
                await self._start_lanes(servicer)
            except BaseException:
                for lane in self.lanes:
                    await lane.close()
                await server.stop(0)
                if self._metrics_server is not None:
                    await self._metrics_server.close()
                self._close_resources()
                raise
        for name in ("", "kvstore.v1.KVStore", "kvstore.v1.Admin"):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._sweeper = asyncio.create_task(self._sweep_leases(), name="kvstore-lease-sweeper")
        if cfg.host_prefault:
            # In the background: the daemon serves at once, and puts get faster as the
            # segment's pages are mapped in.
            self._prefault = asyncio.create_task(
                asyncio.to_thread(host_tier.segment.populate, self._prefault_stop), name="kvstore-prefault"
            )
        logger.info(
            "kvstore serving on %s; tiers %s, policy %s", ", ".join(self.bound + self.bound_lanes),
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
            if len(os.fsencode(path)) >= 108:  # sockaddr_un.sun_path
                logger.warning("no local control lane for %s: the path %s is too long for a Unix socket",
                               addr.path, path)
                continue
            _prepare_unix_path(path)
            lane = LaneServer(servicer, self.auth, self._gate, self.metrics, self.config.max_message_bytes,
                              deferral=servicer.store.deferral)
            try:
                await lane.start(path)
            except OSError as exc:
                logger.warning("no local control lane at %s: %s", path, exc.strerror or exc)
                continue
            self.lanes.append(lane)
            self.bound_lanes.append(path)

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
                _check_unix_tenant(table, self.config.unix_socket_tenant, self.config.auth_token_file)
        except KVStoreError as exc:
            logger.error("token file reload failed, the previous %d tenants stay in force: %s", len(self.tokens), exc)
            return False
        self.tokens = table
        self.auth.table = table
        self.store.tenancy.quotas = table.quotas()
        logger.info("token file reloaded: %d tenants", len(table))
        return True

    def _bind(self, server: grpc.aio.Server, addr: ListenAddress) -> str:
        if addr.kind == "unix":
            _prepare_unix_path(addr.path)
        try:
            if addr.kind == "tcp" and self._tls is not None:
                port = server.add_secure_port(addr.grpc_target, self._tls)
            else:
                port = server.add_insecure_port(addr.grpc_target)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {addr.grpc_target}: {exc}; is it in use? choose another --listen") from None
        if addr.kind == "unix":
            os.chmod(addr.path, 0o600)
            self._unix_paths.append(addr.path)
            return addr.grpc_target
        if port == 0:
            raise ConfigError(f"cannot listen on {addr.grpc_target}: address in use or not available")
        return ListenAddress("tcp", host=addr.host, port=port).grpc_target

    async def _sweep_leases(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(LEASE_SWEEP_S)
            try:
                self.store.expire_leases()
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
        # Event streams never end by themselves; end them so the drain is not held open.
        self.events.close()
        self._prefault_stop.set()
        if self._prefault is not None:
            await self._prefault
        deadline = asyncio.get_running_loop().time() + grace
        await self._drain(deadline)
        for lane in self.lanes:
            await lane.close()
        self.lanes.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
        if self._server is not None:
            # Normally nothing is left and this returns at once; the rest of the grace
            # covers calls accepted just before the gate closed (they are refused) and
            # streams the gate does not wait for (health Watch).
            await self._server.stop(max(0.0, deadline - asyncio.get_running_loop().time()))
        if self._metrics_server is not None:
            await self._metrics_server.close()
            self._metrics_server = None
        if self.store is not None:
            # Pending SSD writes are flushed before the tiers close (and the SSD tier
            # writes its snapshot for a fast next start).
            await self.store.aclose()
        self._close_resources()
        self._stopped.set()
        logger.info("kvstore stopped")

    async def _drain(self, deadline: float) -> None:
        """Refuse new calls, then wait for calls in flight and for local puts whose bytes
        co-located clients are copying (their commit is still accepted; see `DrainGate`)."""
        local = self._local_puts

        def no_local_puts() -> bool:
            return local is None or not len(local)

        self._gate.close()
        if self._gate.in_flight or not no_local_puts():
            logger.info("draining %d calls and %d local puts", self._gate.in_flight, 0 if local is None else len(local))
        if not await self._gate.wait_idle(deadline, also=no_local_puts):
            logger.warning("the grace time is spent and %d calls and %d local puts are still open; they are "
                           "cancelled and rolled back", self._gate.in_flight, 0 if local is None else len(local))

    def _close_resources(self) -> None:
        if self._local_puts is not None:
            self._local_puts.abort_all()
        if self.store is not None:
            self.store.close()
            self.store = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for path in self._unix_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._unix_paths.clear()

    async def wait_stopped(self) -> None:
        """Returns once `stop` has finished."""
        await self._stopped.wait()


async def serve(config: Config, reload: Callable[[], Config] | None = None) -> None:
    """Run a daemon until SIGTERM or SIGINT, then shut it down gracefully.

    `reload` re-reads the config sources; with it, SIGHUP applies runtime fields.
    """
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
