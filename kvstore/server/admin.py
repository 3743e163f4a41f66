"""The `kvstore.v1.Admin` servicer: stats, INFO, namespaces, blocks, evict, flush,
config, events, and the pool's status, placement and drain (kvstore.server.cluster).

Primitives: `AdminServicer`, `stats_to_proto(status, uptime_s, absent)`.

Each RPC maps to one store, runtime-config or event-bus call; what it adds is the
rendering (the StatsResponse, the INFO text with its events and tenants sections, block
events with their tiers both as the `Tier` enum and, for older readers, by name).
Nothing here runs code supplied by a caller or reveals the process environment; config
reads return the daemon's own settings only. Only admins reach these methods (the
per-call pipeline's auth step).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import grpc

from kvstore import __version__
from kvstore.convert import TIER_BY_NAME, layout_to_proto
from kvstore.core.store import RemovalResult, Store, StoreStatus
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.hashing import HASH_BYTES
from kvstore.server.cluster import drain_proto, info_section, status_proto, where_proto
from kvstore.server.codecs import CodecView, codecs_to_proto, render_codecs_info
from kvstore.server.events import EventBus, EventKind
from kvstore.server.info import SECTIONS, render_info
from kvstore.server.kv_events import KvEventStreams
from kvstore.server.pool_node import NOT_IN_A_POOL, PoolNode
from kvstore.server.requests import RequestResolver
from kvstore.server.runtime import ConfigValue, RuntimeConfig
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2

if TYPE_CHECKING:
    from kvstore.server.host_resources import GcPauses

INFO_SECTIONS = (*SECTIONS, "events", "tenants", "cluster", "codecs")

# Block references per ListBlocks message: 32 bytes each, far under the message cap.
LIST_BLOCKS_BATCH = 8192

EVENT_KIND = {
    EventKind.STORED: admin_pb2.EVENT_STORED,
    EventKind.REMOVED: admin_pb2.EVENT_REMOVED,
    EventKind.MOVED: admin_pb2.EVENT_MOVED,
    EventKind.RESYNC: admin_pb2.EVENT_RESYNC,
}


def _field(v: ConfigValue, live: bool) -> admin_pb2.ConfigField:
    return admin_pb2.ConfigField(
        name=v.field.name, value=v.text, kind=v.field.kind, bounds=v.bounds, runtime=live, help=v.field.help
    )


def _removal(r: RemovalResult) -> admin_pb2.RemovalResponse:
    return admin_pb2.RemovalResponse(blocks=r.blocks, removed_bytes=r.removed_bytes)


def stats_to_proto(status: StoreStatus, uptime_s: float, absent: Sequence[tuple[str, str]] = ()) -> admin_pb2.StatsResponse:
    c = status.counters
    tiers = [
        admin_pb2.TierStats(
            name=t.name,
            present=True,
            capacity_bytes=t.capacity_bytes,
            used_bytes=t.used_bytes,
            blocks=t.blocks,
            hits=t.counters.hits,
            misses=t.counters.misses,
            evictions=t.counters.evictions,
            checksum_failures=t.counters.checksum_failures,
            policy=t.policy,
            promotions=t.counters.promotions,
            demotions=t.counters.demotions,
            drops=t.counters.drops,
            pending_writes=t.pending_writes,
            io_mode=t.facts.get("io_mode", ""),
            pinned=t.facts.get("pinned") == "yes",
            facts=t.facts,
        )
        for t in status.tiers
    ]
    tiers += [admin_pb2.TierStats(name=name, present=False, reason=reason) for name, reason in absent]
    return admin_pb2.StatsResponse(
        tiers=tiers,
        counters=admin_pb2.StoreCounters(
            lookups=c.lookups,
            lookup_blocks=c.lookup_blocks,
            hit_blocks=c.hit_blocks,
            miss_blocks=c.miss_blocks,
            puts=c.puts,
            blocks_stored=c.blocks_stored,
            blocks_existing=c.blocks_existing,
            bytes_in=c.bytes_in,
            fetches=c.fetches,
            blocks_fetched=c.blocks_fetched,
            bytes_out=c.bytes_out,
            deletes=c.deletes,
            evictions=c.evictions,
            checksum_failures=c.checksum_failures,
            leases_active=status.leases_active,
            put_failures=c.put_failures,
            prefetches=c.prefetches,
            ssd_write_failures=c.ssd_write_failures,
            group_parts_stored=c.group_parts_stored,
            group_bytes_skipped=c.group_bytes_skipped,
            group_parts_dropped=c.group_parts_dropped,
            hinted_lookups=c.hinted_lookups,
            hinted_puts=c.hinted_puts,
            sessions_ended=c.sessions_ended,
        ),
        namespaces=status.namespaces,
        uptime_s=uptime_s,
        version=__version__,
    )


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """`node`: this daemon's node of the pool (kvstore.server.pool_node), whose id tags
    block events; `resolver`: the requests' resolver (ClusterWhere names a chain as a
    request does); `absent_tiers`: (name, reason) of the tiers the daemon could not or
    was not told to build; `calls_in_flight`: the calls each tenant has in flight now;
    `gc_pauses`: the garbage collector's pauses, for INFO's server section."""

    def __init__(
        self,
        store: Store,
        runtime: RuntimeConfig,
        bus: EventBus,
        node: PoolNode,
        resolver: RequestResolver,
        absent_tiers: Sequence[tuple[str, str]] = (),
        calls_in_flight: Callable[[], Mapping[str, int]] | None = None,
        gc_pauses: Callable[[], GcPauses] | None = None,
        kv_events: KvEventStreams | None = None,
        codecs: CodecView | None = None,
    ) -> None:
        self.store = store
        self.runtime = runtime
        self.bus = bus
        self.node = node
        self.resolver = resolver
        self.absent_tiers = list(absent_tiers)
        self._calls_in_flight = calls_in_flight
        self.gc_pauses = gc_pauses
        self.kv_events = kv_events
        self.codecs = codecs if codecs is not None else CodecView(store)
        self.started = time.monotonic()

    async def Stats(self, request: admin_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> admin_pb2.StatsResponse:
        resp = stats_to_proto(self.store.stats(), time.monotonic() - self.started, self.absent_tiers)
        resp.codecs.extend(codecs_to_proto(self.codecs.choices()))
        return resp

    async def Info(self, request: admin_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> admin_pb2.InfoResponse:
        section = request.section.strip().lower()
        if section and section not in INFO_SECTIONS:
            raise InvalidArgument(f"unknown info section {section!r}; choose one of: {', '.join(INFO_SECTIONS)}")
        if section == "events":
            return admin_pb2.InfoResponse(text=self._events_section())
        if section == "tenants":
            return admin_pb2.InfoResponse(text=self._tenants_section())
        if section == "cluster":
            return admin_pb2.InfoResponse(text=info_section(self.node))
        if section == "codecs":
            return admin_pb2.InfoResponse(text=render_codecs_info(self.codecs.choices()))
        # The config section shows the settings as they are now, after SetConfig or SIGHUP.
        text = render_info(
            self.store, time.monotonic() - self.started, self.runtime.as_dict(), self.absent_tiers, section,
            self.gc_pauses() if self.gc_pauses is not None else None)
        if not section:
            text = (text.rstrip("\n") + "\n\n" + self._events_section() + "\n" + self._tenants_section() + "\n"
                    + info_section(self.node) + "\n" + render_codecs_info(self.codecs.choices()))
        return admin_pb2.InfoResponse(text=text)

    def _events_section(self) -> str:
        bus = self.bus
        lines = ["# Events", f"event_subscribers:{bus.subscribers}", f"events_published:{bus.published}",
                 f"events_dropped:{bus.dropped}", f"events_queue:{bus.queue_size}"]
        kv = self.kv_events
        lines.append(f"kv_events:{'on' if kv is not None else 'off'}")
        if kv is not None:  # the streams in vLLM's format (kvstore.server.kv_events), by tenant
            for st in kv.stats():
                c = st.counters
                lines += [f"kv_events_{st.tenant}_endpoint:{st.endpoint}",
                          f"kv_events_{st.tenant}_replay_endpoint:{st.replay_endpoint or '-'}",
                          f"kv_events_{st.tenant}_batches:{c.batches}", f"kv_events_{st.tenant}_published:{c.events}",
                          f"kv_events_{st.tenant}_dropped:{c.dropped_events}", f"kv_events_{st.tenant}_replays:{c.replays}"]
            lines += [f"kv_events_resyncs:{kv.resyncs}", f"kv_events_named_blocks:{len(kv.names)}"]
        return "\n".join([*lines, ""])

    def _tenants_section(self) -> str:
        """One line per tenant: bytes held and quota per tier, namespaces, calls in flight."""
        calls = self._calls_in_flight() if self._calls_in_flight is not None else {}
        per_tenant: dict[str, int] = {}
        for ns in self.store.namespaces():
            per_tenant[ns.tenant] = per_tenant.get(ns.tenant, 0) + 1
        lines = ["# Tenants"]
        ledger = self.store.tenancy
        for tenant in sorted(set(per_tenant) | ledger.tenants() | set(calls)):
            usage = ledger.usage(tenant)
            quota = ledger.quotas.get(tenant, {})
            parts = [f"namespaces={per_tenant.get(tenant, 0)}", f"calls_in_flight={calls.get(tenant, 0)}"]
            parts += [f"{tier}_bytes={usage.get(tier, 0)}" for tier in sorted(set(usage) | set(quota))]
            parts += [f"{tier}_quota={q}" for tier, q in sorted(quota.items())]
            lines.append(f"tenant_{tenant}:" + ",".join(parts))
        return "\n".join(lines) + "\n"

    async def ListNamespaces(
        self, request: admin_pb2.ListNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListNamespacesResponse:
        out = [
            admin_pb2.NamespaceStats(
                namespace_id=ns.namespace_id, layout=layout_to_proto(ns.layout),
                block_bytes=ns.layout.bytes_per_block, blocks=ns.blocks, used_bytes=ns.bytes,
                lookup_blocks=ns.lookup_blocks, hit_blocks=ns.hit_blocks, tenant=ns.tenant,
                groups=[admin_pb2.NamespaceGroupStats(
                    name=g.name, kind=g.kind.value, block_bytes=g.bytes_per_block, blocks=rec.blocks,
                    used_bytes=rec.bytes, group_id=rec.namespace_id) for g, rec in zip(ns.layout.groups, ns.groups)],
            )
            for ns in self.store.namespaces()
        ]
        return admin_pb2.ListNamespacesResponse(namespaces=out)

    async def ListBlocks(
        self, request: admin_pb2.ListBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.ListBlocksResponse]:
        refs = self.store.namespace_blocks(request.namespace_id)
        grouped = bool(self.store.namespace(request.namespace_id).groups)
        for start in range(0, len(refs), LIST_BLOCKS_BATCH):
            batch = refs[start : start + LIST_BLOCKS_BATCH]
            masks = (self.store.part_masks(request.namespace_id, [r.block_hash for r in batch]) if grouped
                     else [0] * len(batch))
            yield admin_pb2.ListBlocksResponse(
                blocks=[admin_pb2.BlockRef(hash=r.block_hash, parent_hash=r.parent_hash, parts=mask)
                        for r, mask in zip(batch, masks)]
            )

    async def Evict(self, request: admin_pb2.EvictRequest, context: grpc.aio.ServicerContext) -> admin_pb2.RemovalResponse:
        if not request.tier:
            raise InvalidArgument("name the tier to evict from (see `kvstore stats` for tier names)")
        return _removal(await self.store.evict_bytes(request.tier, request.target_bytes))

    async def Flush(self, request: admin_pb2.FlushRequest, context: grpc.aio.ServicerContext) -> admin_pb2.RemovalResponse:
        return _removal(self.store.purge(request.namespace_id or None))

    async def GetConfig(
        self, request: admin_pb2.GetConfigRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetConfigResponse:
        values = self.runtime.get(request.name)
        return admin_pb2.GetConfigResponse(fields=[_field(v, self.runtime.is_live(v.field)) for v in values])

    async def SetConfig(
        self, request: admin_pb2.SetConfigRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SetConfigResponse:
        previous = self.runtime.set(request.name, request.value)
        (now,) = self.runtime.get(request.name)
        return admin_pb2.SetConfigResponse(field=_field(now, True), previous=previous.text)

    async def WatchEvents(
        self, request: admin_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.Event]:
        ns = request.namespace_id
        if ns and len(ns) != HASH_BYTES:
            raise InvalidArgument(f"namespace_id must be {HASH_BYTES} bytes (or empty for all), got {len(ns)}")
        # Snapshot and subscription in one synchronous step: no event falls between them.
        snapshot = self.store.block_groups() if request.snapshot else ()
        sub = self.bus.subscribe(ns, request.queue_size, snapshot)
        try:
            async for e in sub:
                yield admin_pb2.Event(
                    seq=e.seq, kind=EVENT_KIND[e.kind], namespace_id=e.namespace_id, block_hashes=e.block_hashes,
                    tier=e.tier, from_tier=e.from_tier, dropped=e.dropped, node_id=self.node.node_id,
                    tier_enum=TIER_BY_NAME.get(e.tier, kvstore_pb2.TIER_UNSPECIFIED),
                    from_tier_enum=TIER_BY_NAME.get(e.from_tier, kvstore_pb2.TIER_UNSPECIFIED),
                )
        finally:
            sub.close()

    # ---- the pool (docs/cluster.md)

    async def ClusterStatus(self, request: admin_pb2.ClusterStatusRequest,
                            context: grpc.aio.ServicerContext) -> admin_pb2.ClusterStatusResponse:
        return status_proto(self.node)

    async def ClusterWhere(self, request: admin_pb2.ClusterWhereRequest,
                           context: grpc.aio.ServicerContext) -> admin_pb2.ClusterWhereResponse:
        if self.node.status() is None:
            # Said before the chain is resolved: a daemon alone answers this, whatever it names.
            raise FailedPrecondition(NOT_IN_A_POOL)
        ns_id = self.resolver.namespace(request.namespace)
        chain = self.resolver.chain(ns_id, request.keys)
        return where_proto(self.node, ns_id, chain)

    async def ClusterDrain(self, request: admin_pb2.ClusterDrainRequest,
                           context: grpc.aio.ServicerContext) -> admin_pb2.ClusterDrainResponse:
        if not math.isfinite(request.timeout_s) or request.timeout_s < 0:
            raise InvalidArgument(f"timeout_s must be a finite number >= 0, got {request.timeout_s}")
        return await drain_proto(self.node, request.timeout_s)
