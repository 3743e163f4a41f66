"""KV events in vLLM's format: what the daemon holds, for KV-aware routers that read vLLM's
KV event stream (llm-d's KV indexer, Dynamo's router, Mooncake's conductor).

The events are vLLM 0.32's (`vllm/distributed/kv_events.py`), byte for byte as vLLM's
own encoder writes them: a batch is the msgpack array `[ts, events, data_parallel_rank]`
(rank 0, as vLLM without data parallelism sends it), each event a map tagged `"type"`:

- `BlockStored`: blocks became visible in a tier: `block_hashes` (a chain: each block's
  parent is the one before it), `parent_block_hash` (of the first), `token_ids` (the
  blocks' tokens, when known, else empty), `block_size`, `medium`, `lora_name`,
  `group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, `locality`,
  `ownership`;
- `BlockRemoved`: blocks left a tier: `block_hashes`, `medium`, `group_idx`, `locality`,
  `ownership`;
- `AllBlocksCleared`: forget everything this stream said before.

What the fields say here:

- Block names. Routers key blocks by the engine's own hashes; kvstore keys them by its
  own chain. A put may carry the engine's names (`PutHeader.engine_names`: the vLLM
  connector sends vLLM's block hashes, as vLLM publishes them), which `RequestResolver.put_keys`
  hands to `offer_put`; they are kept for as long as the block is held (`BlockNames`), so
  its moves and removal say the same name. A block without one is named by its kvstore
  hash (16 bytes). `token_ids` are the put's when it named its blocks by tokens (or sent
  them with the names); a block put by hashes alone has none.
- `medium`: the tier (`host`, `memory` -> CPU, `ssd` -> STORAGE, `hbm` -> GPU).
  `locality` is LOCAL; `ownership` is the node id (in a pool, the node's; alone, the
  `node_id` setting, else the host name), so a router reading several daemons' streams
  knows which one holds a block.
- A move between tiers is a `BlockRemoved` from one medium followed by a `BlockStored`
  in the other, with the same names, parent and tokens as the first store. Evictions,
  deletes and flushes are `BlockRemoved` with the medium the last copy left.
- A restart: each stream starts with `AllBlocksCleared`, then `BlockStored` for what
  recovery found, named by kvstore hashes (engine names live in memory only).
- Grouped layouts (kvstore.groups): each group's parts are events of their own, with the
  group's index, kind and window.
- A pool: each node publishes its own blocks; a forward to a unit's owner carries the
  names this node keeps (`forward_names`, the forwarder's hook), so the owner publishes
  the block under the engine's name too. Copies pulled after a remote lookup arrive
  without names and are published under their kvstore hashes.

Tenants. Each stream is one tenant's (`kv_events_endpoint = TENANT=ENDPOINT,...` with a
token file; without one the only tenant is `default`): a block is published only on its
tenant's stream, so a subscriber never learns another tenant's blocks. Blocks of a
namespace no request has named since a restart (recovered from SSD) have no known tenant
with a token file; they are published once a request of their tenant names the layout.

Bounded. The observer hooks run on the event loop: they build small tuples and append
them to the stream's batch; the batch is handed to the publisher thread
(`kvstore.server.zmq_publisher`) 5 ms after its first event (`FLUSH_AFTER_S`: one hand-off
for many puts under load), where it is packed and sent.
When the publisher's queue is full, the batch is dropped and counted, and the stream
resyncs as soon as there is room: `AllBlocksCleared`, then `BlockStored` for every block
of the tenant (a snapshot taken in one step, so nothing falls between it and the events
after it); until then its events are dropped (and counted), since the resync covers them.

Primitives: `StreamSpec`, `parse_streams`, `check_kv_events_exposure`, `BlockNames`,
`KvEventStreams` (the store observer: `start`, `offer_put`, `forward_names`,
`announce_recovered`, `close`, `stats`), `KvEventsCollector` (`kvstore_kv_events_*`), `ObserverFanout`, `encode_events`,
`MEDIUM`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.addresses import is_loopback
from kvstore.core.types import NamespaceInfo, StoreObserver
from kvstore.errors import ConfigError
from kvstore.layout import GroupKind
from kvstore.server.zmq_publisher import PublisherCounters, StreamEndpoints, ZmqPublisher
from kvstore.v1 import kvstore_pb2

if TYPE_CHECKING:
    from kvstore.core.store import Store
    from kvstore.server.config import Config

logger = logging.getLogger(__name__)

MEDIUM = {"hbm": "GPU", "host": "CPU", "memory": "CPU", "ssd": "STORAGE"}
KIND = {GroupKind.FULL: "full_attention", GroupKind.SLIDING_WINDOW: "sliding_window",
        GroupKind.MLA: "mla_attention", GroupKind.STATE: "mamba", GroupKind.AUXILIARY: "unknown"}
DEFAULT_TENANT = "default"
OFF = "off"
# Names offered by puts that have not published (yet): a put that fails, or finds its
# blocks stored already, leaves its offer here until newer ones push it out.
PENDING_NAMES = 1 << 18
# Most blocks one BlockStored or BlockRemoved names, and most events one batch holds in a
# snapshot (a resync or a restart).
EVENT_BLOCKS = 1024
SNAPSHOT_BATCH_EVENTS = 64
RESYNC_RETRY_S = 0.05
# Events are gathered this long before they go to the publishing thread as one batch: each
# hand-off wakes the thread (and takes the interpreter lock from the loop), so under load
# many puts share one; a router hears of a block this much later at most.
FLUSH_AFTER_S = 0.005
ADOPTION_CHECK_S = 1.0

# One block's names: (engine name or None for its kvstore hash, the parent's name or None,
# its packed token ids or None, the LoRA name or None).
Name = tuple["int | bytes | None", "int | bytes | None", "bytes | None", "str | None"]


# ------------------------------------------------------------------ configuration


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One tenant's stream: where it is published and replayed ("" when not)."""

    tenant: str
    endpoint: str
    replay_endpoint: str = ""


def _split_entry(entry: str, key: str, auth: bool) -> tuple[str, str]:
    tenant, sep, endpoint = entry.partition("=")
    if not sep or "://" in tenant:
        tenant, endpoint = "", entry
    tenant = tenant.strip()
    endpoint = endpoint.strip()
    if auth and not tenant:
        raise ConfigError(f"{key} {entry!r} names no tenant: with a token file each stream is one tenant's, "
                          f"written TENANT={endpoint} (a stream never shows another tenant's blocks)")
    if not auth and tenant not in ("", DEFAULT_TENANT):
        raise ConfigError(f"{key} {entry!r} names tenant {tenant!r}, but without a token file the only tenant "
                          f"is {DEFAULT_TENANT!r}; write {endpoint}")
    _check_endpoint(endpoint, key)
    return tenant or DEFAULT_TENANT, endpoint


def _check_endpoint(endpoint: str, key: str) -> None:
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path.startswith("/"):
            raise ConfigError(f"{key} {endpoint!r}: an ipc endpoint needs an absolute path, e.g. "
                              "ipc:///run/kvstore/kv-events.sock")
        return
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"{key} {endpoint!r} is neither tcp://HOST:PORT nor ipc:///PATH (or 'off')")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{key} {endpoint!r} is not tcp://HOST:PORT with a port in [0, 65535]")


def _host(endpoint: str) -> str:
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host.strip("[]")


def _entries(values: Sequence[str]) -> list[str]:
    return [] if [v.strip().lower() for v in values] == [OFF] else [v for v in values if v.strip()]


def parse_streams(config: Config, tenants: Collection[str] | None = None) -> list[StreamSpec]:
    """The configured streams, checked: endpoints, tenants (those of the token file when
    `tenants` is given), one stream and at most one replay endpoint per tenant, and the
    exposure rule (`check_kv_events_exposure`). Empty when the streams are off."""
    auth = bool(config.auth_token_file)
    streams: dict[str, str] = {}
    for entry in _entries(config.kv_events_endpoint):
        tenant, endpoint = _split_entry(entry, "kv_events_endpoint", auth)
        if tenant in streams:
            raise ConfigError(f"kv_events_endpoint names tenant {tenant!r} twice; one stream per tenant")
        if tenants is not None and tenant not in tenants:
            raise ConfigError(f"kv_events_endpoint names tenant {tenant!r}, which the token file "
                              f"{config.auth_token_file} does not have")
        streams[tenant] = endpoint
    replays: dict[str, str] = {}
    for entry in _entries(config.kv_events_replay_endpoint):
        tenant, endpoint = _split_entry(entry, "kv_events_replay_endpoint", auth)
        if tenant not in streams:
            raise ConfigError(f"kv_events_replay_endpoint {entry!r} is for tenant {tenant!r}, which has no "
                              "kv_events_endpoint")
        if tenant in replays:
            raise ConfigError(f"kv_events_replay_endpoint names tenant {tenant!r} twice")
        replays[tenant] = endpoint
    specs = [StreamSpec(t, e, replays.get(t, "")) for t, e in streams.items()]
    check_kv_events_exposure(config, specs)
    return specs


def check_kv_events_exposure(config: Config, specs: Sequence[StreamSpec]) -> None:
    """The streams have no authentication and carry block names and token ids (which can
    reveal prompts): an endpoint beyond this host, bound or connected to, needs
    `kv_events_remote`, as the metrics endpoint needs `metrics_remote`."""
    if config.kv_events_remote:
        return
    for spec in specs:
        for key, endpoint in (("kv_events_endpoint", spec.endpoint), ("kv_events_replay_endpoint",
                                                                       spec.replay_endpoint)):
            if not endpoint.startswith("tcp://"):
                continue
            host = _host(endpoint)
            if not is_loopback(host):
                raise ConfigError(
                    f"{key} {endpoint} is not loopback, and the KV event stream has no authentication and "
                    "carries block names and token ids: set --kv-events-remote to publish it beyond this host, "
                    "or use a loopback or ipc:// endpoint")


# ------------------------------------------------------------------ names


class BlockNames:
    """The engine's names (and tokens) of blocks, by (namespace id, kvstore hash): offered
    by puts (`offer`), kept while a block is held (`stored` -> `forget`)."""

    def __init__(self, pending_cap: int = PENDING_NAMES) -> None:
        self._pending: dict[bytes, Name] = {}
        self._live: dict[bytes, Name] = {}
        self._cap = pending_cap

    def __len__(self) -> int:
        return len(self._live)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def offer(self, namespace_id: bytes, hashes: Sequence[bytes], names: Sequence[Name]) -> None:
        pending = self._pending
        for h, name in zip(hashes, names):
            key = namespace_id + h
            pending.pop(key, None)  # re-inserted last: the newest offers are kept longest
            pending[key] = name
        while len(pending) > self._cap:
            del pending[next(iter(pending))]

    def stored(self, offered_as: bytes, namespace_id: bytes, hashes: Sequence[bytes], keep_offer: bool) -> list[Name | None]:
        """The names of blocks just stored in `namespace_id` (offered under `offered_as`:
        a grouped layout's parts are offered once, under the layout); from now on kept
        until `forget`. `keep_offer`: leave the offer for the layout's other groups."""
        pending, live = self._pending, self._live
        out: list[Name | None] = []
        for h in hashes:
            key = offered_as + h
            name = pending.get(key) if keep_offer else pending.pop(key, None)
            if name is None:
                name = live.get(namespace_id + h)
            elif name is not None:
                live[namespace_id + h] = name
            out.append(name)
        return out

    def of(self, namespace_id: bytes, hashes: Sequence[bytes]) -> list[Name | None]:
        live = self._live
        return [live.get(namespace_id + h) for h in hashes]

    def name_of(self, namespace_id: bytes, block_hash: bytes) -> int | bytes | None:
        name = self._live.get(namespace_id + block_hash) or self._pending.get(namespace_id + block_hash)
        return name[0] if name is not None else None

    def forget(self, namespace_id: bytes, hashes: Sequence[bytes]) -> list[Name | None]:
        live = self._live
        return [live.pop(namespace_id + h, None) for h in hashes]

    def clear(self, namespace_ids: Collection[bytes] | None = None) -> None:
        if namespace_ids is None:
            self._live.clear()
            return
        for key in [k for k in self._live if k[:16] in namespace_ids]:
            del self._live[key]


def _engine_value(raw: bytes, integers: bool) -> int | bytes:
    return int.from_bytes(raw, "big") if integers else raw


# ------------------------------------------------------------------ encoding (the thread)


def encode_events(events: Sequence[tuple[Any, ...]], locality: str, ownership: str | None) -> list[dict[str, Any]]:
    """The batch's event maps, as vLLM's msgspec structs encode them: the `type` tag
    first, then the fields in declaration order, optional ones left out when unset."""
    out: list[dict[str, Any]] = []
    for ev in events:
        kind = ev[0]
        if kind == "S":
            _, hashes, parent, tokens, block_size, medium, lora, group, spec_kind, window = ev
            m: dict[str, Any] = {
                "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": np.frombuffer(tokens, "<u4").tolist() if tokens else [],
                "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": lora,
                "group_idx": group, "kv_cache_spec_kind": spec_kind,
            }
            if window is not None:
                m["kv_cache_spec_sliding_window"] = window
            m["locality"] = locality
            if ownership:
                m["ownership"] = ownership
            out.append(m)
        elif kind == "R":
            _, hashes, medium, group = ev
            m = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": group,
                 "locality": locality}
            if ownership:
                m["ownership"] = ownership
            out.append(m)
        else:
            out.append({"type": "AllBlocksCleared"})
    return out


# ------------------------------------------------------------------ the observer


class ObserverFanout:
    """Tells several store observers of every event, in order."""

    def __init__(self, observers: Sequence[StoreObserver]) -> None:
        self.observers = list(observers)

    def blocks_stored(self, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str) -> None:
        for o in self.observers:
            o.blocks_stored(namespace_id, block_hashes, tier)

    def blocks_removed(self, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str) -> None:
        for o in self.observers:
            o.blocks_removed(namespace_id, block_hashes, tier)

    def blocks_moved(self, namespace_id: bytes, block_hashes: Sequence[bytes], from_tier: str, to_tier: str) -> None:
        for o in self.observers:
            o.blocks_moved(namespace_id, block_hashes, from_tier, to_tier)


@dataclass(slots=True)
class _Tenant:
    index: int  # the publisher's stream
    spec: StreamSpec
    batch: list[tuple[Any, ...]]
    resync: bool = False  # a batch was dropped: events wait for the snapshot
    dropped_blocks: int = 0  # blocks of events not queued while a resync waited


@dataclass(frozen=True, slots=True)
class StreamStats:
    tenant: str
    endpoint: str
    replay_endpoint: str
    counters: PublisherCounters
    resyncs: int
    waiting_blocks: int  # blocks of events dropped while a resync waited for room


class KvEventStreams:
    """The store observer that publishes each tenant's blocks on its stream (see the
    module docstring). `auth`: a token file is in force (recovered namespaces then have
    no tenant until a request names them)."""

    def __init__(self, store: Store, specs: Sequence[StreamSpec], *, topic: str, buffer_steps: int, hwm: int,
                 max_queue_size: int, connect: bool, ownership: str, auth: bool) -> None:
        self.store = store
        self.specs = list(specs)
        self.ownership = ownership or socket.gethostname()
        self.auth = auth
        self.names = BlockNames()
        self._tenants = {s.tenant: _Tenant(i, s, []) for i, s in enumerate(self.specs)}
        self.publisher = ZmqPublisher(
            [StreamEndpoints(s.endpoint, s.replay_endpoint, connect) for s in self.specs], topic,
            buffer_steps=buffer_steps, hwm=hwm, max_queue_size=max_queue_size,
            encode=lambda events: encode_events(events, "LOCAL", self.ownership))
        self._flush_handle: asyncio.TimerHandle | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._unannounced: set[bytes] = set()
        self._adoption_task: asyncio.Task[None] | None = None
        self.resyncs = 0
        self._closed = False

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.publisher.start()

    def announce_recovered(self) -> None:
        """Every stream starts with AllBlocksCleared (a router drops what it heard before
        this start), then BlockStored for the blocks recovery found whose tenant is known;
        the rest wait for their namespace to be named (checked every second). Call it in
        the step that installs the observer, so no event falls between."""
        for t in self._tenants.values():
            t.batch.append(("C",))
        groups = self.store.block_groups()
        waiting = set()
        for g in groups:
            if self._tenant_of(g.namespace_id) is None:
                waiting.add(g.namespace_id)
        self._snapshot_into([g for g in groups if g.namespace_id not in waiting])
        self._unannounced = waiting
        self._schedule_flush()
        if waiting and self.auth:
            self._adoption_task = asyncio.get_running_loop().create_task(self._watch_adoptions())

    async def close(self) -> None:
        self._closed = True
        if self._adoption_task is not None:
            self._adoption_task.cancel()
            try:
                await self._adoption_task
            except asyncio.CancelledError:
                pass
        for handle in (self._flush_handle, self._retry):
            if handle is not None:
                handle.cancel()
        self._flush()
        await asyncio.get_running_loop().run_in_executor(None, self.publisher.close)

    @property
    def bound(self) -> dict[str, tuple[str, str]]:
        """Each tenant's stream and replay endpoint as bound."""
        return {spec.tenant: b for spec, b in zip(self.specs, self.publisher.bound)}

    def stats(self) -> list[StreamStats]:
        bound = self.publisher.bound
        return [StreamStats(t.spec.tenant, bound[t.index][0], bound[t.index][1], self.publisher.counters(t.index),
                            self.resyncs, t.dropped_blocks) for t in self._tenants.values()]

    # ---------------------------------------------------------------- puts

    def offer_put(self, info: NamespaceInfo, hashes: list[bytes], parent: bytes | None, tokens: bytes,
                  engine: kvstore_pb2.EngineNames | None) -> None:
        """A put's keys: remember the names its blocks will be published under (`put_keys`
        calls this before the put publishes; see `BlockNames`)."""
        if info.tenant not in self._tenants or not hashes:
            return
        ns = info.namespace_id
        bst = info.layout.block_size_tokens
        stride = bst * 4
        if engine is not None and engine.token_ids_packed:
            tokens = engine.token_ids_packed
        lora = engine.lora_name or None if engine is not None else None
        if engine is not None:
            integers = engine.integers
            names: list[int | bytes | None] = [_engine_value(n, integers) for n in engine.names]
            if engine.parent:
                first_parent: int | bytes | None = _engine_value(engine.parent, integers)
            else:
                first_parent = self.names.name_of(ns, parent) if parent is not None else None
        else:
            names = [None] * len(hashes)
            # Blocks named by kvstore hashes: the parent by its engine name if it has one.
            first_parent = None if parent is None else (self.names.name_of(ns, parent) or parent)
        parents: list[int | bytes | None] | None = None
        if engine is not None and engine.parents:
            parents = [_engine_value(p, engine.integers) if p else None for p in engine.parents]
        recs: list[Name] = []
        prev = first_parent
        for i, h in enumerate(hashes):
            name = names[i]
            recs.append((name, prev if parents is None else parents[i],
                         tokens[i * stride:(i + 1) * stride] if tokens else None, lora))
            prev = name if name is not None else h
        self.names.offer(ns, hashes, recs)

    def forward_names(self, namespace_id: bytes, hashes: Sequence[bytes]) -> kvstore_pb2.EngineNames | None:
        """The names of blocks held here, for a forward of them to another daemon of the
        pool (`kvstore.cluster.forward.Forwarder.names`): that node then publishes them
        under the same names. A block without a name goes under its kvstore hash; None
        when the names cannot go in one message (integers and bytes mixed) or there are
        none to give."""
        recs = self.names.of(namespace_id, hashes)
        if all(r is None for r in recs):
            return None
        names = [r[0] if r is not None and r[0] is not None else h for h, r in zip(hashes, recs)]
        integers = all(isinstance(n, int) for n in names)
        if not integers and any(isinstance(n, int) for n in names):
            return None

        def raw(value: int | bytes | None) -> bytes:
            """A name as the message carries it; b"" for none, or for a parent of the
            other form (a block named by the engine after one named by kvstore)."""
            if value is None or isinstance(value, int) != integers:
                return b""
            return value.to_bytes(8, "big") if isinstance(value, int) else value

        # Each block's parent spelled out: a forward may carry several runs of a chain.
        msg = kvstore_pb2.EngineNames(names=[raw(n) for n in names], integers=integers,
                                      parents=[raw(r[1] if r is not None else None) for r in recs])
        if all(r is not None and r[2] for r in recs):
            msg.token_ids_packed = b"".join(r[2] for r in recs if r is not None and r[2] is not None)
        loras = {r[3] for r in recs if r is not None}
        if len(loras) == 1 and None not in loras:
            msg.lora_name = loras.pop() or ""
        return msg

    # ---------------------------------------------------------------- the observer

    def _tenant_of(self, namespace_id: bytes) -> str | None:
        info = self.store.registry.get(namespace_id)
        if info is not None:
            return info.tenant
        return None if self.auth else DEFAULT_TENANT

    def _where(self, namespace_id: bytes) -> tuple[_Tenant, bytes, int, str | None, int | None, int] | None:
        """The stream of a namespace's events, and the group facts: the namespace the
        put offered names under, group index, kind, window, block size."""
        info = self.store.registry.get(namespace_id)
        if info is None:
            if self.auth or namespace_id in self._unannounced:
                return None
            t = self._tenants.get(DEFAULT_TENANT)
            return None if t is None else (t, namespace_id, 0, None, None, 0)
        t = self._tenants.get(info.tenant)
        if t is None:
            return None
        owner = info.group_of
        if owner is None:
            return t, namespace_id, 0, KIND[GroupKind.FULL], None, info.layout.block_size_tokens
        g = owner.groups.index(info)
        group = owner.layout.groups[g]
        return (t, owner.namespace_id, g, KIND[group.kind], group.window_tokens or None,
                owner.layout.block_size_tokens)

    def blocks_stored(self, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str) -> None:
        where = self._where(namespace_id)
        if where is None:
            return
        t, offered_as, group, kind, window, bst = where
        names = self.names.stored(offered_as, namespace_id, block_hashes, offered_as != namespace_id)
        self._append_stored(t, block_hashes, names, MEDIUM.get(tier, "CPU"), group, kind, window, bst)

    def blocks_removed(self, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str) -> None:
        names = self.names.forget(namespace_id, block_hashes)
        where = self._where(namespace_id)
        if where is None:
            return
        t, _, group, _, _, _ = where
        self._append_removed(t, block_hashes, names, MEDIUM.get(tier, "CPU"), group)

    def blocks_moved(self, namespace_id: bytes, block_hashes: Sequence[bytes], from_tier: str, to_tier: str) -> None:
        src, dst = MEDIUM.get(from_tier, "CPU"), MEDIUM.get(to_tier, "CPU")
        if src == dst:
            return  # host and memory are both CPU: nothing a router can tell apart
        where = self._where(namespace_id)
        if where is None:
            return
        t, _, group, kind, window, bst = where
        names = self.names.of(namespace_id, block_hashes)
        self._append_removed(t, block_hashes, names, src, group)
        self._append_stored(t, block_hashes, names, dst, group, kind, window, bst)

    # ---------------------------------------------------------------- building events

    def _append_stored(self, t: _Tenant, hashes: Sequence[bytes], names: Sequence[Name | None], medium: str,
                       group: int, kind: str | None, window: int | None, bst: int) -> None:
        if t.resync:
            t.dropped_blocks += len(hashes)
            return
        batch = t.batch
        run: list[Any] = []
        run_tokens: list[bytes] = []
        run_parent: Any = None
        run_lora: str | None = None
        prev: Any = None
        for h, rec in zip(hashes, names):
            name: int | bytes
            if rec is None:
                name, parent, tokens, lora = h, None, None, None
            else:
                name = rec[0] if rec[0] is not None else h
                parent, tokens, lora = rec[1], rec[2], rec[3]
            # A run is a chain with one kind of token list: the next block continues it
            # when its parent is the block before it (or neither knows one).
            joins = run and len(run) < EVENT_BLOCKS and bool(tokens) == bool(run_tokens) and lora == run_lora and (
                parent == prev or (parent is None and not run_tokens))
            if not joins:
                if run:
                    batch.append(("S", run, run_parent, b"".join(run_tokens) or None, bst, medium, run_lora, group,
                                  kind, window))
                run, run_tokens, run_parent, run_lora = [], [], parent, lora
            run.append(name)
            if tokens:
                run_tokens.append(tokens)
            prev = name
        if run:
            batch.append(("S", run, run_parent, b"".join(run_tokens) or None, bst, medium, run_lora, group, kind,
                          window))
        self._schedule_flush()

    def _append_removed(self, t: _Tenant, hashes: Sequence[bytes], names: Sequence[Name | None], medium: str,
                        group: int) -> None:
        if t.resync:
            t.dropped_blocks += len(hashes)
            return
        named = [rec[0] if rec is not None and rec[0] is not None else h for h, rec in zip(hashes, names)]
        batch = t.batch
        last = batch[-1] if batch else None
        # Removals come one block at a time (evictions, flushes): one event for a run of them.
        if last is not None and last[0] == "R" and last[2] == medium and last[3] == group and len(last[1]) < EVENT_BLOCKS:
            last[1].extend(named)
        else:
            batch.append(("R", named, medium, group))
        self._schedule_flush()

    def _snapshot_into(self, groups: Sequence[Any], only: _Tenant | None = None) -> None:
        """BlockStored for the blocks of `groups` (BlockGroup: a namespace's blocks in one
        tier), on their tenants' streams (`only`'s alone, when given)."""
        for g in groups:
            where = self._where(g.namespace_id)
            if where is None or only is not None and where[0] is not only:
                continue
            t, _, group, kind, window, bst = where
            hashes = list(g.block_hashes)
            names = self.names.of(g.namespace_id, hashes)
            self._append_stored(t, hashes, names, MEDIUM.get(g.tier, "CPU"), group, kind, window, bst)

    # ---------------------------------------------------------------- flushing

    def _schedule_flush(self) -> None:
        if self._flush_handle is None and not self._closed:
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_AFTER_S, self._flush)

    def _flush(self) -> None:
        """Hand each stream's batch to the publisher (a long one, a snapshot's, in parts)."""
        self._flush_handle = None
        for t in self._tenants.values():
            if t.resync:
                continue
            batch, t.batch = t.batch, []
            for i in range(0, len(batch), SNAPSHOT_BATCH_EVENTS):
                part = batch[i:i + SNAPSHOT_BATCH_EVENTS]
                if not self.publisher.submit(t.index, part, len(part)):
                    t.dropped_blocks += sum(len(ev[1]) for ev in batch[i + len(part):] if ev[0] != "C")
                    self._lost(t)
                    break

    def _lost(self, t: _Tenant) -> None:
        if not t.resync:
            logger.warning("KV event stream of tenant %s: the publisher's queue is full; events are dropped until "
                           "it resyncs", t.spec.tenant)
        t.resync = True
        if self._retry is None and not self._closed:
            self._retry = asyncio.get_running_loop().call_later(RESYNC_RETRY_S, self._try_resync)

    def _try_resync(self) -> None:
        """AllBlocksCleared and a snapshot of the tenant's blocks, once the queue has room
        for them all; they replace the events dropped meanwhile."""
        self._retry = None
        waiting = [t for t in self._tenants.values() if t.resync]
        if not waiting:
            return
        groups = self.store.block_groups()
        for t in waiting:
            t.resync = False
            t.batch = [("C",)]
            self._snapshot_into(groups, only=t)
            need = -(-len(t.batch) // SNAPSHOT_BATCH_EVENTS)
            if self.publisher.room() < need:
                t.batch = []
                t.resync = True
                continue
            self.resyncs += 1
            logger.info("KV event stream of tenant %s resynced (events of %d blocks dropped so far)", t.spec.tenant,
                        t.dropped_blocks)
        if any(t.resync for t in self._tenants.values()):
            self._retry = asyncio.get_running_loop().call_later(RESYNC_RETRY_S, self._try_resync)
        else:
            self._flush()

    # ---------------------------------------------------------------- adoption

    async def _watch_adoptions(self) -> None:
        while self._unannounced:
            await asyncio.sleep(ADOPTION_CHECK_S)
            named = {ns for ns in self._unannounced if self.store.registry.get(ns) is not None}
            if not named:
                continue
            self._unannounced -= named
            self._snapshot_into([g for g in self.store.block_groups() if g.namespace_id in named])


class KvEventsCollector(Collector):
    """`kvstore_kv_events_*`: each stream's counters, by tenant, read at scrape time."""

    def __init__(self, streams: KvEventStreams) -> None:
        self._streams = streams

    def collect(self) -> Iterator[Any]:
        families = {
            "batches": CounterMetricFamily("kvstore_kv_events_batches", "KV event batches published (vLLM's format)",
                                           labels=["tenant"]),
            "events": CounterMetricFamily("kvstore_kv_events_published", "KV events published (vLLM's format)",
                                          labels=["tenant"]),
            "dropped": CounterMetricFamily("kvstore_kv_events_dropped", "KV events dropped because the publisher's "
                                           "queue was full (the stream resyncs)", labels=["tenant"]),
            "replays": CounterMetricFamily("kvstore_kv_events_replays", "replay requests answered",
                                           labels=["tenant"]),
        }
        for st in self._streams.stats():
            c = st.counters
            families["batches"].add_metric([st.tenant], c.batches)
            families["events"].add_metric([st.tenant], c.events)
            families["dropped"].add_metric([st.tenant], c.dropped_events)
            families["replays"].add_metric([st.tenant], c.replays)
        yield from families.values()
        yield CounterMetricFamily("kvstore_kv_events_resyncs", "KV event streams resynced after drops",
                                  value=self._streams.resyncs)
        yield GaugeMetricFamily("kvstore_kv_events_named_blocks", "blocks whose engine names the daemon keeps for "
                                "its KV events", value=len(self._streams.names))
