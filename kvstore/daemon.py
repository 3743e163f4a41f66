"""The daemon: builds the store from a `Config`, serves it over gRPC, shuts down cleanly.

Start-up is a stack torn down in reverse: tiers and executor, store, gRPC server
(KVStore, Admin, grpc.health.v1.Health, reflection), listeners, background tasks.
It refuses to start, with a message naming the setting to change, on a bad address, an
address in use (SO_REUSEPORT is turned off so a second daemon cannot silently share a
port), a non-loopback TCP address without `allow_remote`, or a capacity larger than the
machine can give.

On SIGTERM/SIGINT: health turns NOT_SERVING, listeners stop accepting, in-flight calls
get `grace_s` to finish, then tiers are closed and the Unix socket file is removed.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import signal
import socket
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvstore.config import AUTO, Config
from kvstore.errors import ConfigError
from kvstore.interceptors import ErrorInterceptor
from kvstore.local import LocalPuts
from kvstore.policies import make_policy
from kvstore.servicer import AdminServicer, KVStoreServicer
from kvstore.store import Store, StoreLimits, StoreTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.segment import default_shm_dir, free_bytes, remove_stale_segments
from kvstore.units import human_bytes
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

logger = logging.getLogger(__name__)

LEASE_SWEEP_S = 1.0
AUTO_HOST_CAPACITY = 4 << 30


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


def parse_listen(addr: str, allow_remote: bool = False) -> ListenAddress:
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
    if not allow_remote and not _is_loopback(host):
        raise ConfigError(
            f"listen address {addr!r} is not loopback; kvstore serves only this host by default. "
            "Pass --allow-remote to serve other hosts on a trusted network."
        )
    return ListenAddress("tcp", host=host, port=port)


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
    shm_free = free_bytes(shm_dir)
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
        self.addresses = [parse_listen(a, config.allow_remote) for a in config.listen]
        self.bound: list[str] = []
        self.store: Store | None = None
        self._server: grpc.aio.Server | None = None
        self._health: HealthServicer | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped = asyncio.Event()
        self._unix_paths: list[str] = []
        self._local_puts: LocalPuts | None = None
        self._prefault: asyncio.Task[bool] | None = None
        self._prefault_stop = threading.Event()

    @property
    def health(self) -> HealthServicer:
        assert self._health is not None
        return self._health

    async def start(self) -> None:
        cfg = self.config
        shm_dir = cfg.shm_dir or default_shm_dir()
        remove_stale_segments(shm_dir)
        host_capacity = resolve_host_capacity(cfg.host_capacity, shm_dir)
        self._executor = ThreadPoolExecutor(cfg.checksum_threads, thread_name_prefix="kvstore-checksum")
        policy = make_policy(cfg.policy)
        self.store = Store(
            [StoreTier(HostTier(host_capacity, shm_dir=shm_dir), policy)],
            limits=StoreLimits(
                max_blocks_per_call=cfg.max_blocks_per_call,
                max_namespaces=cfg.max_namespaces,
                max_leases=cfg.max_leases,
                max_lease_ms=cfg.max_lease_ms,
                default_pin_ms=cfg.default_pin_ms,
            ),
            executor=self._executor,
        )
        absent = [("hbm", "not configured in this version")]
        server = grpc.aio.server(
            interceptors=[ErrorInterceptor()],
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
            ],
        )
        host_tier = self.store.tiers[0].tier
        assert isinstance(host_tier, HostTier)
        self._local_puts = LocalPuts()
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(
            KVStoreServicer(self.store, cfg.chunk_bytes, host_tier.segment, self._local_puts), server
        )
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self.store, cfg.as_dict(), absent), server)
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
        await server.start()
        self._server = server
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
            "kvstore serving on %s; host tier %s, policy %s", ", ".join(self.bound), human_bytes(host_capacity), cfg.policy
        )
        logger.info("effective config: %s", {**cfg.as_dict(), "host_capacity": host_capacity})

    def _bind(self, server: grpc.aio.Server, addr: ListenAddress) -> str:
        if addr.kind == "unix":
            _prepare_unix_path(addr.path)
        try:
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
        self._prefault_stop.set()
        if self._prefault is not None:
            await self._prefault
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
        if self._server is not None:
            await self._server.stop(grace)
        self._close_resources()
        self._stopped.set()
        logger.info("kvstore stopped")

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


async def serve(config: Config) -> None:
    """Run a daemon until SIGTERM or SIGINT, then shut it down gracefully."""
    daemon = Daemon(config)
    await daemon.start()
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    await stop_requested.wait()
    await daemon.stop()
