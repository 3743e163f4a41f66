"""Prometheus metrics: `kvstore_*` names, served at `/metrics` on a loopback HTTP port.

Primitives: `Metrics` (a prometheus-client registry: a collector that reads the store's
counters at scrape time, plus the RPC latency histogram and in-flight gauge that the
per-call pipeline feeds), `MetricsServer` (a minimal HTTP/1.1 endpoint on the daemon's
event loop).

Why a collector and not counters incremented in the store: the store already keeps
exact counters for `stats` and `info`; reading them at scrape time keeps one source of
truth and adds nothing to the hot path. Why an asyncio HTTP server and not
prometheus-client's thread: the store's state belongs to the event loop (no locks), so
the scrape runs there too. It answers only GET /metrics; nothing else is exposed.

Counters that a store version does not have (e.g. promotions before tiering lands) are
simply absent from the exposition.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from kvstore import __version__
from kvstore.deadlines import within

if TYPE_CHECKING:
    from kvstore.core.store import Store
    from kvstore.server.events import EventBus
    from kvstore.server.host_resources import GcPauses

logger = logging.getLogger(__name__)

# Data plane labels: block bytes in gRPC messages, copied through the shared segment, or
# on the data lane (kvstore.server.data_lane.server).
GRPC_PLANE, SHM_PLANE, LANE_PLANE = "grpc", "shm", "lane"

RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Optional per-tier counters, by (tier counter attribute, direction label).
MIGRATION_COUNTERS = (("promotions", "promote"), ("demotions", "demote"))
OPTIONAL_TIER_COUNTERS = (("drops", "kvstore_tier_drops", "blocks whose last copy left the store from the tier"),)
OPTIONAL_STORE_COUNTERS = (
    ("prefetches", "kvstore_prefetches", "Prefetch calls"),
    ("ssd_write_failures", "kvstore_ssd_write_failures", "SSD writes that failed (the block stayed in memory only)"),
    ("group_parts_stored", "kvstore_group_parts_stored", "parts of grouped layouts' blocks stored"),
    ("group_bytes_skipped", "kvstore_group_skipped_bytes", "bytes of grouped layouts' puts the hit rules did not store"),
    ("group_parts_dropped", "kvstore_group_parts_dropped", "parts dropped with a sibling part of their block"),
    ("hinted_lookups", "kvstore_hinted_lookups", "lookups that carried a session reuse hint"),
    ("hinted_puts", "kvstore_hinted_puts", "puts that carried a session reuse hint"),
    ("sessions_ended", "kvstore_sessions_ended", "EndSession calls"),
)


class StoreCollector(Collector):
    def __init__(self, store_getter: Callable[[], Store | None], bus: EventBus | None, started: float) -> None:
        self._store = store_getter
        self._bus = bus
        self._started = started
        # The data lane's byte counts by name (its puts commit with checksums, as the
        # shared-memory plane's do, so the store counts their bytes as local).
        self.lane: Callable[[str], int] | None = None
        # The garbage collector's pauses (kvstore.server.host_resources.GcFreezer).
        self.gc: Callable[[], GcPauses] | None = None

    def collect(self) -> Iterator[Any]:
        info = InfoMetricFamily("kvstore_build", "kvstore version")
        info.add_metric([], {"version": __version__})
        yield info
        yield GaugeMetricFamily("kvstore_uptime_seconds", "seconds since the daemon started",
                                value=time.monotonic() - self._started)
        if self.gc is not None:
            pauses = self.gc()
            runs = CounterMetricFamily("kvstore_gc_collections", "garbage collections, by generation",
                                       labels=["generation"])
            took = CounterMetricFamily("kvstore_gc_pause_seconds", "time the garbage collector stopped the daemon, "
                                       "by generation", labels=["generation"])
            for g, (n, s) in enumerate(zip(pauses.collections, pauses.pause_s)):
                runs.add_metric([str(g)], n)
                took.add_metric([str(g)], s)
            yield runs
            yield took
            yield GaugeMetricFamily("kvstore_gc_frozen_at_blocks", "blocks stored or recovered when what "
                                    "survived was last frozen out of the collector's reach", value=pauses.frozen_at_blocks)
        store = self._store()
        if store is None:
            return
        status = store.stats()
        c = status.counters

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield counter("kvstore_lookups", "Lookup calls", c.lookups)
        blocks = CounterMetricFamily("kvstore_lookup_blocks", "blocks asked for by lookups, by result", labels=["result"])
        blocks.add_metric(["hit"], c.hit_blocks)
        blocks.add_metric(["miss"], c.miss_blocks)
        yield blocks
        yield counter("kvstore_puts", "Put calls that committed", c.puts)
        yield counter("kvstore_put_failures", "Put calls that failed or were cancelled (nothing published)",
                      c.put_failures)
        yield counter("kvstore_blocks_stored", "blocks newly stored by puts", c.blocks_stored)
        yield counter("kvstore_blocks_fetched", "blocks sent by fetches", c.blocks_fetched)
        yield counter("kvstore_fetches", "Fetch calls", c.fetches)
        yield counter("kvstore_deletes", "blocks removed by Delete and Flush", c.deletes)
        for attr, name, doc in OPTIONAL_STORE_COUNTERS:
            value = getattr(c, attr, None)
            if value is not None:
                yield counter(name, doc, value)
        local_in, local_out = getattr(c, "local_bytes_in", 0), getattr(c, "local_bytes_out", 0)
        lane_in = self.lane("committed_bytes_in") if self.lane is not None else 0
        lane_out = self.lane("served_bytes_out") if self.lane is not None else 0
        data_in = CounterMetricFamily("kvstore_data_in_bytes", "block bytes received, by data plane", labels=["plane"])
        data_in.add_metric([GRPC_PLANE], c.bytes_in - local_in)
        data_in.add_metric([SHM_PLANE], local_in - lane_in)
        data_in.add_metric([LANE_PLANE], lane_in)
        yield data_in
        data_out = CounterMetricFamily("kvstore_data_out_bytes", "block bytes sent, by data plane", labels=["plane"])
        data_out.add_metric([GRPC_PLANE], c.bytes_out - local_out - lane_out)
        data_out.add_metric([SHM_PLANE], local_out)
        data_out.add_metric([LANE_PLANE], lane_out)
        yield data_out

        hits = CounterMetricFamily("kvstore_tier_hits", "looked-up blocks found in the tier", labels=["tier"])
        misses = CounterMetricFamily("kvstore_tier_misses", "looked-up blocks not found in the tier", labels=["tier"])
        evictions = CounterMetricFamily("kvstore_evictions", "blocks evicted from the tier", labels=["tier"])
        bad = CounterMetricFamily("kvstore_checksum_failures", "blocks that failed verification and were dropped",
                                  labels=["tier"])
        migrations = CounterMetricFamily("kvstore_migrations", "blocks moved between tiers, by direction",
                                         labels=["tier", "direction"])
        used = GaugeMetricFamily("kvstore_tier_used_bytes", "bytes in use in the tier", labels=["tier"])
        capacity = GaugeMetricFamily("kvstore_tier_capacity_bytes", "capacity of the tier", labels=["tier"])
        tier_blocks = GaugeMetricFamily("kvstore_tier_blocks", "blocks held in the tier", labels=["tier"])
        optional = {attr: CounterMetricFamily(name, doc, labels=["tier"]) for attr, name, doc in OPTIONAL_TIER_COUNTERS}
        any_migration = False
        for t in status.tiers:
            hits.add_metric([t.name], t.counters.hits)
            misses.add_metric([t.name], t.counters.misses)
            evictions.add_metric([t.name], t.counters.evictions)
            bad.add_metric([t.name], t.counters.checksum_failures)
            used.add_metric([t.name], t.used_bytes)
            capacity.add_metric([t.name], t.capacity_bytes)
            tier_blocks.add_metric([t.name], t.blocks)
            for attr, direction in MIGRATION_COUNTERS:
                value = getattr(t.counters, attr, None)
                if value is not None:
                    migrations.add_metric([t.name, direction], value)
                    any_migration = True
            for attr, family in optional.items():
                value = getattr(t.counters, attr, None)
                if value is not None:
                    family.add_metric([t.name], value)
        yield from (hits, misses, evictions, bad, used, capacity, tier_blocks)
        if any_migration:
            yield migrations
        yield from (f for f in optional.values() if f.samples)
        yield GaugeMetricFamily("kvstore_leases_active", "leases (lookup pins and explicit pins) active",
                                value=status.leases_active)
        yield GaugeMetricFamily("kvstore_namespaces", "namespaces (distinct KV layouts) known", value=status.namespaces)
        if self._bus is not None:
            yield counter("kvstore_events_published", "block events published", self._bus.published)
            yield counter("kvstore_events_dropped",
                          "block events dropped because a subscriber fell behind (it got a resync marker)",
                          self._bus.dropped)
            yield GaugeMetricFamily("kvstore_event_subscribers", "WatchEvents streams open", value=self._bus.subscribers)


class CallsInFlight:
    """Calls of one method being handled now. A plain count, changed only on the event
    loop's thread and read when the gauge is scraped: a call pays no lock for it."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def value(self) -> float:
        return float(self.n)


class Metrics:
    """The daemon's registry. `store_getter` returns None once the store is closed."""

    def __init__(self, store_getter: Callable[[], Store | None], bus: EventBus | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._store_collector = StoreCollector(store_getter, bus, time.monotonic())
        self.registry.register(self._store_collector)
        self.rpc_seconds = Histogram(
            "kvstore_rpc_duration_seconds",
            "RPC handling time, by method and status code",
            ["method", "code"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        # What a SIGTERM drain is waiting for; long-lived streams (WatchEvents) count too.
        self.rpcs_in_flight = Gauge(
            "kvstore_rpcs_in_flight", "RPCs being handled now, by method", ["method"], registry=self.registry
        )
        self._calls: dict[str, CallsInFlight] = {}

    def in_flight(self, method: str) -> CallsInFlight:
        """The count of `method`'s calls being handled now, shared by gRPC and the control
        lane, and read by `kvstore_rpcs_in_flight` when scraped."""
        calls = self._calls.get(method)
        if calls is None:
            calls = self._calls[method] = CallsInFlight()
            self.rpcs_in_flight.labels(method).set_function(calls.value)
        return calls

    def count_lane(self, counts: Callable[[str], int]) -> None:
        """Split the data lane's bytes out of the plane labels (`counts(name)`, by the
        names of `kvstore.server.data_lane.transfer.DataLaneCounters`)."""
        self._store_collector.lane = counts

    def count_gc(self, pauses: Callable[[], GcPauses]) -> None:
        self._store_collector.gc = pauses

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# A scrape request is one short line plus a few headers; anything larger is not a scraper.
MAX_REQUEST_BYTES = 16 * 1024
READ_TIMEOUT_S = 5.0


class MetricsServer:
    """GET /metrics over HTTP/1.1 on the event loop; one response per connection."""

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        self._metrics = metrics
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        # Connection handlers, owned here: asyncio.Server does not wait for them on close
        # (before Python 3.12), so close() cancels and awaits what is still running.
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            try:
                head = await within(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                return
            if len(head) > MAX_REQUEST_BYTES:
                return
            parts = head.split(b"\r\n", 1)[0].split()
            method, path = (parts[0], parts[1]) if len(parts) >= 2 else (b"", b"")
            path = path.split(b"?", 1)[0]
            if method not in (b"GET", b"HEAD"):
                await self._respond(writer, 405, b"text/plain", b"only GET /metrics\n", method == b"HEAD")
            elif path != b"/metrics":
                await self._respond(writer, 404, b"text/plain", b"kvstore serves only /metrics here\n", False)
            else:
                body = self._metrics.exposition()
                await self._respond(writer, 200, CONTENT_TYPE_LATEST.encode(), body, method == b"HEAD")
        except (ConnectionError, OSError):
            pass  # the scraper went away; nothing to answer
        except Exception:  # task boundary: one bad scrape must not stop the endpoint
            logger.exception("metrics scrape failed")
        finally:
            self._connections.discard(task)
            writer.close()

    @staticmethod
    async def _respond(writer: asyncio.StreamWriter, status: int, ctype: bytes, body: bytes, head_only: bool) -> None:
        reason = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed"}[status]
        writer.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (status, reason, ctype, len(body))
        )
        if not head_only:
            writer.write(body)
        await writer.drain()
