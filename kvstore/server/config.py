"""The daemon's configuration: one declarative table, one spelling per setting.

Precedence: embedded defaults < TOML file (`--config`) < `KVSTORE_*` environment <
command-line flags. Each field appears in the TOML file as `name`, in the environment as
`KVSTORE_NAME`, and on the command line as `--name` (underscores become dashes).
Sizes accept "4GiB"-style text and are stored as int bytes. Bounds are checked here, so
a bad value stops the daemon before it binds anything, with a message naming the field,
the source and the allowed range; numbers must be finite (NaN passes any `<`/`>`
bound, and TOML and Python's float() both accept `nan` and `inf`). `kvstore config set`
goes through the same conversion (`parse_field`).
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvstore.addresses import DEFAULT_TCP_LISTEN, default_unix_socket
from kvstore.core.policies import DEFAULT_POLICY
from kvstore.core.policies.hints import DEFAULT_HINT_BUDGET_FRACTION
from kvstore.core.types import MigrationConfig, StoreLimits, WritePolicy
from kvstore.errors import ConfigError
from kvstore.tiers import HBM, HOST
from kvstore.units import human_bytes, parse_size

AUTO = "auto"


def default_listen() -> list[str]:
    return [f"unix:{default_unix_socket()}", DEFAULT_TCP_LISTEN]


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    kind: str  # size | int | float | str | bool | list
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    runtime: bool = False  # may change while the daemon runs
    metavar: str | None = None


FIELDS: tuple[Field, ...] = (
    Field("listen", "list", None, "addresses to serve on: unix:PATH and/or HOST:PORT (comma-separated); "
          f"default: a Unix socket under the runtime dir and {DEFAULT_TCP_LISTEN}", metavar="ADDR[,ADDR]"),
    Field("host_capacity", "size", AUTO, "bytes of host memory for blocks, e.g. 4GiB; 'auto' = min(4GiB, half of "
          "available memory)", lo=1 << 20, hi=1 << 50, metavar="SIZE"),
    Field("shm_dir", "str", "", "tmpfs directory for the host tier's shared-memory segment (default /dev/shm)",
          metavar="DIR"),
    Field("local_lane", "bool", True, "serve the local control lane (SOCKET.lane, mode 0600) next to each Unix "
          "socket: co-located clients' unary calls without gRPC's per-call cost (see docs/local-data-plane.md)"),
    Field("host_prefault", "bool", True, "map the host tier's pages in at start (in the background) so puts "
          "never pay page faults; commits the memory up front"),
    Field("policy", "str", DEFAULT_POLICY, "eviction policy: one name for every tier, or per tier as "
          "host=arc,ssd=lru (lru, arc, s3fifo, prefix-*, hint-*; see docs/policies.md)", metavar="SPEC"),
    Field("hint_budget", "float", DEFAULT_HINT_BUDGET_FRACTION, "most of a tier (fraction of its blocks) that "
          "client reuse hints may protect", lo=0.0, hi=1.0, runtime=True),
    Field("hbm_capacity", "size", 0, "bytes of GPU memory for blocks (0: no HBM tier); needs CUDA",
          lo=0, hi=1 << 50, metavar="SIZE"),
    Field("gpu", "int", 0, "CUDA device index of the HBM tier", lo=0, hi=1023),
    Field("ssd_path", "str", "", "directory of the SSD tier's region log (empty: no SSD tier)", metavar="DIR"),
    Field("ssd_capacity", "size", 16 << 30, "bytes of SSD for blocks (whole regions, at least 2 of them)", lo=1 << 20, hi=1 << 56,
          metavar="SIZE"),
    Field("ssd_region_size", "size", 64 << 20, "size of one SSD log region (the unit of reclaim)",
          lo=64 << 10, hi=1 << 34, metavar="SIZE"),
    Field("ssd_write_policy", "str", "through", "through: every put is also written to SSD in the background; "
          "back: blocks reach SSD only when demoted", choices=("through", "back")),
    Field("ssd_io", "str", "auto", "SSD file I/O: auto (O_DIRECT where supported), direct, buffered",
          choices=("auto", "direct", "buffered")),
    Field("ssd_io_threads", "int", 4, "threads doing SSD file I/O and codec work", lo=1, hi=64),
    Field("ssd_compress", "bool", True, "lossless codec on SSD records (byte-plane shuffle + lz4 or zstd), chosen per "
          "namespace by measured write and codec speed, kept only when it saves >= 5% (docs/codecs.md)"),
    Field("put_tier", "str", "auto", "where puts land: auto (the highest memory tier with room), hbm, host",
          choices=(AUTO, HBM, HOST)),
    Field("promote_on_hit", "bool", True, "copy a block served from SSD into the top memory tier if it has headroom"),
    Field("hbm_high_watermark", "float", 0.95, "HBM use fraction that starts demotion to host", lo=0.01, hi=1.0),
    Field("hbm_low_watermark", "float", 0.85, "HBM use fraction where demotion stops", lo=0.01, hi=1.0),
    Field("host_high_watermark", "float", 0.95, "host use fraction that starts demotion to SSD (or drops)",
          lo=0.01, hi=1.0),
    Field("host_low_watermark", "float", 0.85, "host use fraction where demotion stops", lo=0.01, hi=1.0),
    Field("migration_batch_blocks", "int", 64, "most blocks one migration step moves", lo=1, hi=1 << 20),
    Field("max_blocks_per_call", "int", 4096, "most blocks one request may name", lo=1, hi=1 << 20, runtime=True),
    Field("max_put_reserve_bytes", "size", 64 << 20, "most bytes of slots one Put stream or data lane put holds "
          "ahead of the bytes it has sent (at least one block); the rest is reserved as they arrive", lo=1 << 16, hi=1 << 40,
          metavar="SIZE"),
    Field("put_idle_timeout_s", "float", 30.0, "a Put stream or data lane put that sends nothing for this long is "
          "rolled back, and so is a local put (LocalPut, DevicePut) or slot reservation not committed within it", lo=0.1, hi=3600),
    Field("max_message_bytes", "size", 16 << 20, "largest gRPC message accepted or sent", lo=1 << 20, hi=1 << 30,
          metavar="SIZE"),
    Field("chunk_bytes", "size", 1 << 20, "payload bytes per streamed message", lo=4096, hi=1 << 30, metavar="SIZE"),
    Field("max_lease_ms", "int", 600_000, "longest lease or pin a client may take", lo=1, hi=86_400_000, runtime=True),
    Field("default_pin_ms", "int", 30_000, "pin duration when a Pin request names none", lo=1, hi=86_400_000,
          runtime=True),
    Field("max_leases", "int", 65_536, "most leases active at once", lo=1, hi=1 << 24),
    Field("max_leases_per_tenant", "int", 16_384, "with a token file: most leases (lookup leases, pins, fetch "
          "leases) one tenant may hold at once", lo=1, hi=1 << 24),
    Field("max_namespaces", "int", 4096, "most namespaces (distinct layouts) held at once", lo=1, hi=1 << 20),
    Field("namespace_grace_s", "float", 300.0, "a namespace that holds no block (all evicted, deleted or flushed) "
          "is forgotten after this long; a request naming it by id then gets NOT_FOUND, one sending its layout "
          "registers it again with its next put", lo=0, hi=7 * 86_400),
    Field("max_namespaces_per_tenant", "int", 1024, "with a token file: most namespaces one tenant may hold",
          lo=1, hi=1 << 20),
    Field("checksum_threads", "int", 2, "threads hashing large batches off the event loop", lo=1, hi=64),
    Field("grace_s", "float", 10.0, "seconds in-flight calls get to finish on SIGTERM", lo=0, hi=3600),
    Field("log_level", "str", "info", "log level", choices=("debug", "info", "warning", "error"), runtime=True),
    Field("log_format", "str", "text", "log line format: text for people, json for log collectors (one object a "
          "line)", choices=("text", "json")),
    Field("metrics_listen", "str", "127.0.0.1:9464", "HOST:PORT of the Prometheus /metrics endpoint, or 'off'; "
          "non-loopback needs metrics_remote", metavar="HOST:PORT|off"),
    Field("events_queue", "int", 4096, "events buffered per WatchEvents subscriber before it is marked for "
          "resync (a slow consumer never blocks the store)", lo=1, hi=1 << 20, runtime=True),
    Field("auth_token_file", "str", "", "token file (TOML, mode 0600) mapping bearer tokens to tenants and roles; "
          "required to listen on a non-loopback address; reloaded on SIGHUP (see SECURITY.md)", metavar="FILE"),
    Field("unix_socket_tenant", "str", "", "with a token file: the tenant that calls arriving on the Unix socket "
          "without a token act as (the socket is 0600: only the daemon's uid can connect); empty: they need a token",
          metavar="TENANT"),
    Field("tls_cert", "str", "", "PEM certificate chain for TCP listeners (with tls_key: TCP is served over TLS)",
          metavar="FILE"),
    Field("tls_key", "str", "", "PEM private key for tls_cert", metavar="FILE"),
    Field("tls_client_ca", "str", "", "PEM CA bundle: TCP clients must present a certificate it signed (mTLS)",
          metavar="FILE"),
    Field("insecure_remote", "bool", False, "allow a non-loopback TCP listener without TLS (tokens then cross the "
          "network in clear text; only on a trusted network)"),
    Field("metrics_remote", "bool", False, "allow metrics_listen on a non-loopback address (the endpoint has no "
          "authentication; it shows counters and tier usage, no keys, tenants or data)"),
    Field("max_calls_per_tenant", "int", 1024, "most calls (streams included) one tenant may have in flight",
          lo=1, hi=1 << 20),
    Field("max_streams_per_connection", "int", 256, "most concurrent HTTP/2 streams one client connection may "
          "open (further calls wait in the client)", lo=1, hi=1 << 20),
    Field("max_tokens_per_call", "int", 1 << 20, "most token ids one request may carry", lo=1, hi=1 << 28,
          runtime=True),
    Field("max_block_bytes", "size", 256 << 20, "largest block payload a layout may describe", lo=1 << 10,
          hi=1 << 31, metavar="SIZE"),
    Field("unix_socket_shared_dir", "bool", False, "accept a Unix socket directory that its group or other users "
          "may write (a Kubernetes emptyDir, shared by containers that all run as one uid); every user who may "
          "write it could then replace the socket (see SECURITY.md)"),
    Field("max_connections", "int", 4096, "most client connections each listener (each gRPC address, each "
          "control lane) holds at once; lowered at start to fit the open-file limit; more are closed at once",
          lo=1, hi=1 << 20),
    Field("handshake_timeout_s", "float", 10.0, "a new connection that has not finished its handshake (HTTP/2 "
          "preface, TLS, the control lane's hello) within this many seconds is closed", lo=0.1, hi=600),
    Field("connection_idle_s", "float", 300.0, "a client connection that carried no call for this many seconds "
          "is closed (clients reconnect on their next call)", lo=1, hi=86_400),
    Field("keepalive_s", "float", 60.0, "a gRPC connection with calls open that sent nothing for this many "
          "seconds is pinged, and closed when the ping goes unanswered (a client that vanished)", lo=1, hi=86_400),
    # KV events in vLLM's format for KV-aware routers (kvstore.server.kv_events, docs/operations.md).
    Field("kv_events_endpoint", "list", ("off",), "where the KV event stream in vLLM's format (ZMQ PUB, msgpack) "
          "is published: off, tcp://HOST:PORT or ipc:///PATH; with a token file one TENANT=ENDPOINT per tenant "
          "whose blocks are published (a stream shows its tenant's blocks only); non-loopback needs "
          "kv_events_remote", metavar="off|[TENANT=]ENDPOINT[,...]"),
    Field("kv_events_replay_endpoint", "list", ("off",), "ZMQ ROUTER endpoint where a subscriber that missed "
          "batches asks for them again (same form as kv_events_endpoint, one per stream, always bound)",
          metavar="off|[TENANT=]ENDPOINT[,...]"),
    Field("kv_events_connect", "bool", False, "connect the stream's PUB socket to kv_events_endpoint (a "
          "collector that binds, as llm-d's KV indexer in its centralized mode) instead of binding it"),
    Field("kv_events_topic", "str", "", "the topic frame of every KV event message (llm-d reads "
          "kv@POD@MODEL)", metavar="TOPIC"),
    Field("kv_events_buffer_steps", "int", 10_000, "KV event batches kept for the replay endpoint", lo=1,
          hi=1 << 20),
    Field("kv_events_hwm", "int", 100_000, "ZMQ high-water mark of each KV event socket: messages queued for "
          "one subscriber before it misses some (and asks the replay endpoint)", lo=1, hi=1 << 24),
    Field("kv_events_max_queue_size", "int", 100_000, "KV event batches waiting for the publisher thread; "
          "more are dropped, counted, and the stream resyncs", lo=1, hi=1 << 24),
    Field("kv_events_remote", "bool", False, "allow a KV event endpoint beyond this host (the stream has no "
          "authentication and carries block names and token ids)"),
    # The pool of daemons (docs/cluster.md). Off by default: a single daemon needs none of these.
    Field("cluster", "bool", False, "join a pool of daemons, so a prefix computed on one node is a hit on every "
          "node; needs cluster_etcd or cluster_peers (see docs/cluster.md)"),
    Field("cluster_etcd", "list", (), "etcd v3 endpoints for the pool's membership, host:port (comma-separated)",
          metavar="HOST:PORT[,...]"),
    Field("cluster_peers", "list", (), "a static pool instead of etcd: node_id=host:port entries (comma-separated), "
          "the same list on every node, this one included", metavar="ID=HOST:PORT[,...]"),
    Field("cluster_prefix", "str", "/kvstore", "etcd key prefix of the pool (one prefix per pool)", metavar="PREFIX"),
    Field("cluster_lease_ttl_s", "int", 10, "seconds this member's etcd lease outlives its last keep-alive: a "
          "daemon that dies leaves every view within it", lo=1, hi=300),
    Field("node_id", "str", "", "this daemon's id in the pool (placement hashes it); empty: the id kept in "
          "<ssd_path>/node-id, made on the first start", metavar="ID"),
    Field("cluster_replace_node_id", "bool", False, "with etcd: take this node's id over even while another live "
          "process holds it (default: serve alone until that registration ends, and say so)"),
    Field("cluster_advertise", "list", (), "host:port where the pool's other daemons reach this one; empty: its "
          "TCP listen addresses that are not a wildcard", metavar="HOST:PORT[,...]"),
    Field("cluster_zone", "str", "", "zone or rack label this member publishes", metavar="ZONE"),
    Field("cluster_unit_blocks", "int", 2, "placement unit: consecutive blocks of a chain placed together (the "
          "same on every node)", lo=1, hi=4096),
    Field("cluster_replicas", "int", 1, "owners per placement unit (the same on every node)", lo=1, hi=16),
    Field("cluster_hot_extra_owners", "int", 2, "most owners a hot unit gets beyond cluster_replicas (0: none)",
          lo=0, hi=16),
    Field("cluster_grace_s", "float", 30.0, "seconds the previous owners of a unit are still asked after the "
          "membership changed", lo=0, hi=3600),
    Field("cluster_lookup_timeout_ms", "float", 5.0, "deadline of a lookup's one round of calls to other nodes: "
          "a slower or dead node is a miss", lo=0.1, hi=60_000, runtime=True),
    Field("cluster_fetch_timeout_s", "float", 5.0, "how long a fetch waits for blocks its lookup is copying from "
          "other nodes before it answers the shorter prefix", lo=0.01, hi=600, runtime=True),
    Field("cluster_forward_queue", "int", 4096, "blocks waiting to be forwarded to their owners; past it new "
          "forwards are dropped and counted (puts never wait for it)", lo=1, hi=1 << 24),
    Field("cluster_forward_timeout_s", "float", 10.0, "deadline of one forward to an owner, and of a put that "
          "waits for its owners", lo=0.01, hi=600),
    Field("cluster_pulls", "int", 16, "copies of remote blocks into this node running at once", lo=1, hi=1024),
    Field("cluster_suspect_s", "float", 2.0, "seconds a node whose calls failed is skipped before it is tried "
          "again (doubling while it keeps failing, up to 30 s)", lo=0.01, hi=3600),
    Field("cluster_token_file", "str", "", "file holding this node's credential, which it presents to the others "
          "(`kvstore token new --node ID`: role peer, node ID, in every node's token file; see SECURITY.md)",
          metavar="FILE"),
    Field("cluster_tls_ca", "str", "", "PEM roots that sign the other daemons' certificates: node-to-node calls "
          "use TLS (tls_cert/tls_key, when set, are this node's client certificate)", metavar="FILE"),
    Field("cluster_data_lane", "bool", True, "move the pool's block bytes (pulls of remote blocks, forwards to "
          "owners) on the peers' data lanes; false: in gRPC Fetch and Put streams (peers without a lane are "
          "used through gRPC either way)"),
    Field("cluster_lane_codec", "str", "auto", "lossless codec of the pool's pulls and forwards on the data lane: "
          "auto (chosen per transfer from the measured link and codec speeds, per peer and namespace), raw, or "
          "one codec always (docs/codecs.md)", choices=("auto", "raw", "shuffle-lz4", "shuffle-zstd")),
    Field("lane_codecs", "bool", True, "this daemon's data lane sends and takes blocks in the lossless codec a "
          "client or peer asks for (false: raw frames only)"),
    Field("peer_lane_listen", "list", ("auto",), "where the pool's other daemons make their lookups and the "
          "data lane's control calls on this one, on the control lane's framing over TCP rather than gRPC (a "
          "pool only; see docs/cluster.md): auto (next to each TCP listener, same host, a port of the system's "
          "choosing), off (gRPC), or HOST:PORT; non-loopback needs auth and TLS like listen",
          metavar="auto|off|HOST:PORT[,...]"),
    Field("data_lane_listen", "list", ("auto",), "where the data lane (block bytes for remote clients and peers "
          "on sockets of their own, not in gRPC messages; see docs/net.md) listens: auto (next to each TCP "
          "listener, same host, a port of the system's choosing), off, or HOST:PORT and/or unix:PATH; "
          "non-loopback needs auth and TLS like listen", metavar="auto|off|ADDR[,ADDR]"),
    Field("data_lane_advertise", "list", (), "addresses the DataLane call offers clients instead of the bound "
          "ones (behind NAT or port mapping), in the same form", metavar="ADDR[,ADDR]"),
    Field("data_lane_connections", "int", 4, "most data lane connections one transfer may use", lo=1, hi=64),
    Field("data_lane_window", "size", 32 << 20, "most credit the daemon grants each data lane connection of a "
          "put: the most block bytes a client may have in flight on it (a put's connections together never get "
          "more than its reserved slots, max_put_reserve_bytes)", lo=1 << 20, hi=1 << 32, metavar="SIZE"),
    Field("data_lane_io_timeout_s", "float", 30.0, "seconds a data lane peer may make no progress on a frame "
          "before its connection is dropped", lo=0.1, hi=3600),
    Field("data_lane_max_connections", "int", 256, "most data lane connections past their hello open at once", lo=1, hi=1 << 16),
)

# Settings that were replaced, with what to use instead.
RETIRED = {
    "allow_remote": "allow_remote was replaced: a non-loopback listener needs auth_token_file (and TLS via "
                    "tls_cert/tls_key, or insecure_remote = true); a non-loopback metrics_listen needs "
                    "metrics_remote = true. See SECURITY.md",
}

FIELD_BY_NAME = {f.name: f for f in FIELDS}

# `KVSTORE_*` environment variables that are not settings, and so are not refused as
# typos (every other `KVSTORE_` name must be `KVSTORE_` + a setting's name, upper case):
# the config file's path (read here), the CLI's and SDK's connection settings, the
# benchmarks' knobs, and the variables Kubernetes makes for a Service named `kvstore`.
OTHER_ENV = frozenset({
    "KVSTORE_CONFIG",  # the TOML file (as --config)
    "KVSTORE_TARGET",  # the CLI's and SDK's default daemon address
    "KVSTORE_TOKEN", "KVSTORE_TOKEN_FILE",  # the client's bearer token, or a file holding it
    "KVSTORE_TLS_CA", "KVSTORE_TLS_CERT", "KVSTORE_TLS_KEY",  # the client's TLS roots and certificate
})
OTHER_ENV_PATTERN = re.compile(
    r"KVSTORE_BENCH_\w+"  # bench/ settings
    r"|KVSTORE_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)"  # Kubernetes
)


@dataclass(frozen=True, slots=True)
class Config:
    listen: tuple[str, ...]
    host_capacity: int | str  # int bytes, or "auto" until the daemon resolves it
    shm_dir: str
    local_lane: bool
    host_prefault: bool
    policy: str
    hint_budget: float
    hbm_capacity: int
    gpu: int
    ssd_path: str
    ssd_capacity: int
    ssd_region_size: int
    ssd_write_policy: str
    ssd_io: str
    ssd_io_threads: int
    ssd_compress: bool
    put_tier: str
    promote_on_hit: bool
    hbm_high_watermark: float
    hbm_low_watermark: float
    host_high_watermark: float
    host_low_watermark: float
    migration_batch_blocks: int
    max_blocks_per_call: int
    max_put_reserve_bytes: int
    put_idle_timeout_s: float
    max_message_bytes: int
    chunk_bytes: int
    max_lease_ms: int
    default_pin_ms: int
    max_leases: int
    max_leases_per_tenant: int
    max_namespaces: int
    namespace_grace_s: float
    max_namespaces_per_tenant: int
    checksum_threads: int
    grace_s: float
    log_level: str
    log_format: str
    metrics_listen: str
    events_queue: int
    auth_token_file: str
    unix_socket_tenant: str
    tls_cert: str
    tls_key: str
    tls_client_ca: str
    insecure_remote: bool
    metrics_remote: bool
    max_calls_per_tenant: int
    max_streams_per_connection: int
    max_tokens_per_call: int
    max_block_bytes: int
    unix_socket_shared_dir: bool
    max_connections: int
    handshake_timeout_s: float
    connection_idle_s: float
    keepalive_s: float
    kv_events_endpoint: tuple[str, ...]
    kv_events_replay_endpoint: tuple[str, ...]
    kv_events_connect: bool
    kv_events_topic: str
    kv_events_buffer_steps: int
    kv_events_hwm: int
    kv_events_max_queue_size: int
    kv_events_remote: bool
    cluster: bool
    cluster_etcd: tuple[str, ...]
    cluster_peers: tuple[str, ...]
    cluster_prefix: str
    cluster_lease_ttl_s: int
    node_id: str
    cluster_replace_node_id: bool
    cluster_advertise: tuple[str, ...]
    cluster_zone: str
    cluster_unit_blocks: int
    cluster_replicas: int
    cluster_hot_extra_owners: int
    cluster_grace_s: float
    cluster_lookup_timeout_ms: float
    cluster_fetch_timeout_s: float
    cluster_forward_queue: int
    cluster_forward_timeout_s: float
    cluster_pulls: int
    cluster_suspect_s: float
    cluster_token_file: str
    cluster_tls_ca: str
    cluster_data_lane: bool
    cluster_lane_codec: str
    lane_codecs: bool
    peer_lane_listen: tuple[str, ...]
    data_lane_listen: tuple[str, ...]
    data_lane_advertise: tuple[str, ...]
    data_lane_connections: int
    data_lane_window: int
    data_lane_io_timeout_s: float
    data_lane_max_connections: int

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def store_limits(self) -> StoreLimits:
        """The store's limits. Without a token file every caller is the one default
        tenant, so `max_leases` is the only lease cap."""
        return StoreLimits(
            max_blocks_per_call=self.max_blocks_per_call,
            max_namespaces=self.max_namespaces,
            namespace_grace_s=self.namespace_grace_s,
            max_leases=self.max_leases,
            max_leases_per_tenant=self.max_leases_per_tenant if self.auth_token_file else None,
            max_lease_ms=self.max_lease_ms,
            default_pin_ms=self.default_pin_ms,
        )

    def migration(self, tiers: Collection[str]) -> MigrationConfig:
        """How the store moves blocks between `tiers` (the names of those built): a
        `put_tier` that is not among them falls back to auto."""
        put_tier = self.put_tier if self.put_tier == AUTO or self.put_tier in tiers else AUTO
        return MigrationConfig(
            write_policy=WritePolicy(self.ssd_write_policy),
            put_tier=put_tier,
            promote_on_hit=self.promote_on_hit,
            batch_blocks=self.migration_batch_blocks,
        )


def _convert(field: Field, raw: Any, source: str) -> Any:
    where = f"{field.name} (from {source})"
    try:
        if field.kind == "list":
            items = [s.strip() for s in raw.split(",")] if isinstance(raw, str) else list(raw)
            items = [s for s in items if s]
            if not items or not all(isinstance(s, str) for s in items):
                raise ValueError("expected one or more addresses")
            return tuple(items)
        if field.kind == "size":
            if isinstance(raw, str) and raw.strip().lower() == AUTO and field.default == AUTO:
                return AUTO
            try:
                value: Any = parse_size(raw)
            except OverflowError:  # digits enough to make the float infinite
                raise ValueError(f"{raw!r} is too large to be a size") from None
        elif field.kind == "int":
            if isinstance(raw, bool) or not isinstance(raw, (int, str)):
                raise ValueError(f"expected an integer, got {raw!r}")
            value = int(raw)
        elif field.kind == "float":
            if isinstance(raw, bool):
                raise ValueError(f"expected a number, got {raw!r}")
            value = float(raw)
            if not math.isfinite(value):
                # NaN compares false with every bound; inf is refused here too, for one message.
                bounds = format_bounds(field)
                raise ValueError(f"expected a finite number{' in ' + bounds if bounds else ''}, got {raw!r}")
        elif field.kind == "bool":
            if isinstance(raw, bool):
                value = raw
            elif str(raw).strip().lower() in ("1", "true", "yes", "on"):
                value = True
            elif str(raw).strip().lower() in ("0", "false", "no", "off"):
                value = False
            else:
                raise ValueError(f"expected true or false, got {raw!r}")
        else:
            value = str(raw).strip()
            if field.choices and value.lower() not in field.choices:
                raise ValueError(f"expected one of {', '.join(field.choices)}, got {raw!r}")
            if field.choices:
                value = value.lower()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad value for {where}: {exc}") from None
    if field.lo is not None and not value >= field.lo or field.hi is not None and not value <= field.hi:
        raise ConfigError(f"{where} = {raw!r} is out of bounds {format_bounds(field)}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per field; unset flags stay None so lower layers show through."""
    parser.add_argument("--config", metavar="FILE", help="TOML file with settings (flags and env override it)")
    for f in FIELDS:
        flag = "--" + f.name.replace("_", "-")
        text = f.help.replace("%", "%%")  # argparse %-formats help text
        if f.kind == "bool":
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.metavar, help=text)
    for name in RETIRED:  # accepted only to say what replaced them
        parser.add_argument("--" + name.replace("_", "-"), dest="retired_" + name, action="store_true",
                            help=argparse.SUPPRESS)


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
    defaults: Callable[[], list[str]] = default_listen,
) -> Config:
    """Merge defaults < TOML < env < flags into a validated `Config`."""
    flags = flags or {}
    env = os.environ if env is None else env
    values: dict[str, Any] = {f.name: f.default for f in FIELDS}
    values["listen"] = tuple(defaults())
    path = flags.get("config") or env.get("KVSTORE_CONFIG") or config_file
    if path:
        for key, raw in read_toml(path).items():
            values[key] = _convert(FIELD_BY_NAME[key], raw, f"file {path}")
    for key, message in RETIRED.items():
        if flags.get("retired_" + key):
            raise ConfigError(f"--{key.replace('_', '-')}: {message}")
        if env.get("KVSTORE_" + key.upper()):
            raise ConfigError(f"env KVSTORE_{key.upper()}: {message}")
    check_env_names(env)
    for f in FIELDS:
        raw = env.get("KVSTORE_" + f.name.upper())
        if raw is not None and raw != "":
            values[f.name] = _convert(f, raw, f"env KVSTORE_{f.name.upper()}")
    for f in FIELDS:
        raw = flags.get(f.name)
        if raw is not None:
            values[f.name] = _convert(f, raw, "--" + f.name.replace("_", "-"))
    if values["chunk_bytes"] > values["max_message_bytes"] - 4096:
        raise ConfigError(
            f"chunk_bytes ({values['chunk_bytes']}) must leave room under max_message_bytes "
            f"({values['max_message_bytes']}) for the message envelope"
        )
    for tier in (HBM, HOST):  # the tiers with watermarks of their own
        lo, hi = values[f"{tier}_low_watermark"], values[f"{tier}_high_watermark"]
        if lo > hi:
            raise ConfigError(f"{tier}_low_watermark ({lo}) must not exceed {tier}_high_watermark ({hi})")
    if values["unix_socket_tenant"] and not values["auth_token_file"]:
        raise ConfigError("unix_socket_tenant names a tenant of the token file: set auth_token_file too")
    if bool(values["tls_cert"]) != bool(values["tls_key"]):
        raise ConfigError("tls_cert and tls_key go together: set both (TLS) or neither")
    if values["tls_client_ca"] and not values["tls_cert"]:
        raise ConfigError("tls_client_ca (mTLS) needs tls_cert and tls_key too")
    check_cluster(values)
    return Config(**values)


def check_cluster(values: Mapping[str, Any]) -> None:
    """The cluster settings that only make sense together."""
    etcd, peers = values["cluster_etcd"], values["cluster_peers"]
    if not values["cluster"]:
        if etcd or peers:
            raise ConfigError("cluster_etcd or cluster_peers is set but cluster is off: set cluster = true "
                              "(--cluster) to join the pool, or remove them")
        return
    if not etcd and not peers:
        raise ConfigError("cluster is on but names no members: set cluster_etcd (etcd endpoints) or "
                          "cluster_peers (a static node_id=host:port list)")
    if etcd and peers:
        raise ConfigError("set either cluster_etcd or cluster_peers, not both")
    if not values["cluster_prefix"].startswith("/"):
        raise ConfigError(f"cluster_prefix must start with '/', got {values['cluster_prefix']!r}")


def check_env_names(env: Mapping[str, str]) -> None:
    """Refuse a set `KVSTORE_*` variable that names no setting (a typo would otherwise be
    silently ignored, where the same typo in the TOML file is refused)."""
    settings = {"KVSTORE_" + name.upper() for name in FIELD_BY_NAME}
    for name, value in env.items():
        if (not name.startswith("KVSTORE_") or not value or name in settings or name in OTHER_ENV
                or OTHER_ENV_PATTERN.fullmatch(name)):
            continue
        close = difflib.get_close_matches(name, sorted(settings | OTHER_ENV), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(
            f"env {name} is not a kvstore setting; {hint}settings are KVSTORE_ + a name from `kvstore config "
            f"get` in upper case; other KVSTORE_ variables: {', '.join(sorted(OTHER_ENV))}"
        )


def read_toml(path: str) -> dict[str, Any]:
    """The settings in a TOML file, checked for unknown keys."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {not_utf8(exc)}") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    section = data.get("kvstore", data)
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: [kvstore] must be a table")
    unknown = sorted(set(section) - set(FIELD_BY_NAME))
    for key in unknown:
        if key in RETIRED:
            raise ConfigError(f"config file {path}: {RETIRED[key]}")
    if unknown:
        known = ", ".join(sorted(FIELD_BY_NAME))
        raise ConfigError(f"config file {path}: unknown setting(s) {', '.join(unknown)}; known: {known}")
    return dict(section)


def not_utf8(exc: UnicodeDecodeError) -> str:
    """Where a file that should be UTF-8 (TOML is) is not, for a message."""
    return f"byte {exc.object[exc.start]:#04x} at offset {exc.start}; TOML files are UTF-8"


def describe_fields() -> Sequence[Field]:
    return FIELDS


def parse_field(name: str, raw: Any, source: str) -> Any:
    """One field's value from text, converted and bounds-checked like the other sources."""
    field = FIELD_BY_NAME.get(name)
    if field is None:
        raise ConfigError(f"unknown setting {name!r}; known: {', '.join(sorted(FIELD_BY_NAME))}")
    return _convert(field, raw, source)


def format_value(value: Any) -> str:
    """A field's value as a person writes it (lists comma-joined, bools lower-case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def format_bounds(field: Field) -> str:
    if field.choices:
        return "|".join(field.choices)
    if field.lo is None and field.hi is None:
        return ""

    def show(v: float | None) -> str:
        if v is None:
            return ""
        if field.kind == "size":
            return human_bytes(int(v))
        return str(int(v)) if field.kind == "int" or float(v).is_integer() else f"{v:g}"

    return f"[{show(field.lo)}, {show(field.hi)}]"
