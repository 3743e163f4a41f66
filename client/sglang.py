"""SGLang HiCache storage backend (its L3): SGLang's host pools keep pages in kvstore.

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvstore", "module_path": "kvstore.client.sglang",
          "class_name": "HiCacheKVStore", "interface_v1": 1, "target": "unix:/run/kvstore/kv.sock"}'

SGLang's storage factory builds the backend as `HiCacheKVStore(storage_config, kwargs)`,
then registers the host pool (`register_mem_pool_host`), hybrid models' other pools
(`register_mem_host_pool_v2`), and calls `on_host_pools_registered`, where the backend
fixes its kvstore namespaces. Importing this module imports SGLang (and torch); nothing
else in the SDK imports it.

Keys. An SGLang page key is a SHA-256 chain over the page's tokens and every page before
it: it names content, not layout. The backend files it under a kvstore namespace whose
layout carries everything that decides the page's bytes: the model (`model_id`, else
SGLang's model name with its host pool's format tag), revision, each pool's class,
dtype (the logical one: float8_e4m3fn and float8_e5m2 differ), memory layout, page size,
layers and layer range, heads and head size or row widths, the piece sizes, the page's
byte form, pipeline, context and decode-context ranks, and the TP rank and size unless
the pool is replicated across TP ranks (MLA; SGLang then writes from one rank per DCP
shard only). Its block hash is XXH3-128 of `"kvstore.sglang.v1\\0" || namespace_id ||
u32le(unit) || key`, so two deployments that differ in any of these never share a
block. The DP rank is not in it: DP replicas compute the same bytes and share.

Pools and namespaces (docs/engines.md has the table):

- the KV pool, alone: a plain namespace whose blocks are the page's pieces as SGLang
  describes them (`get_page_buffer_meta`: K and V for page_first MHA, one row for MLA,
  one piece per layer and K/V in layer_first), moved in place between the pool and the
  daemon on whichever plane the SDK picks: one copy through shared memory co-located,
  one socket read or write per piece on the data lane, gRPC bytes otherwise;
- the KV pool and the pools that share its page indices and keys for every page
  (sparse-attention indexers, draft KV, DeepSeek-V4's compressed KV, indexers, scales
  and rope): one namespace with one KV group per pool, so a page's parts are stored,
  found, evicted and fetched together; each part gathered into one buffer on set and
  scattered from one on get, moved on the plane the SDK picks as for the KV pool alone;
- every other pool (sliding-window KV, Mamba state, DeepSeek-V4's compression states,
  a pool under BLOCK_GROUPS): a plain namespace of its own, whose hit policy the backend
  applies on presence (SGLang stores these pools' trailing pages in calls of their own,
  whose lengths vary with each radix-tree node, which a fixed window cannot describe).

Failures. A daemon that is gone, slow past `timeout_s`, or refusing is a miss (False,
0, an empty result), never an exception into SGLang's prefetch and backup threads: one
warning when it starts, no calls for `retry_interval_s`, then a fresh client (which maps
a restarted daemon's new segment), and one line when it is back. `get_stats()` adds
hits, misses, bytes and errors to SGLang's own storage metrics.

Primitives: `HiCacheKVStore`, `BackendConfig`, `KVStoreStorageMetrics`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvstore.client._options import resolve_target
from kvstore.client._sglang_pages import PoolPages
from kvstore.client.sync import Client
from kvstore.errors import (
    ConfigError,
    InvalidArgument,
    KVStoreError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from kvstore.layout import MAX_NAME_CHARS, GroupKind, KVGroup, KVLayout

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_LOOKUP_TIMEOUT_S = 2.0
DEFAULT_RETRY_INTERVAL_S = 5.0
# Trailing-page checks look back from the longest KV hit for windows that are whole;
# each look is one Lookup. A miss past this many is a shorter hit, never a wrong one.
MAX_TRAILING_PROBES = 4
_HASH_TAG = b"kvstore.sglang.v1\0"

# Keys SGLang itself puts in (or reads from) the extra config; accepted and ignored.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
})

# SGLang 0.5.23's pools that reuse the KV pool's page indices and keys and are needed for
# every page of a prefix: stored in one grouped namespace with the KV pool.
KV_DERIVED = frozenset(p.value for p in (
    PoolName.INDEXER, PoolName.DRAFT, PoolName.DRAFT_INDEXER,
    PoolName.DEEPSEEK_V4_C1, PoolName.DEEPSEEK_V4_C1_INDEXER, PoolName.DEEPSEEK_V4_C1_INDEXER_SCALE,
    PoolName.DEEPSEEK_V4_C2, PoolName.DEEPSEEK_V4_C2_INDEXER, PoolName.DEEPSEEK_V4_C2_INDEXER_SCALE,
    PoolName.DEEPSEEK_V4_C4, PoolName.DEEPSEEK_V4_C4_INDEXER, PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE,
    PoolName.DEEPSEEK_V4_C4_ROPE, PoolName.DEEPSEEK_V4_C128, PoolName.DEEPSEEK_V4_C128_ROPE,
))
_KV = PoolName.KV.value
# Mamba state is TP-sharded even where the model's MLA KV is replicated across TP ranks.
_SHARDED_EVEN_FOR_MLA = frozenset({PoolName.MAMBA.value})


def _name(pool_name: Any) -> str:
    return str(getattr(pool_name, "value", pool_name))


# ------------------------------------------------------------------ configuration


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """Our keys of `--hicache-storage-backend-extra-config`, checked: an unknown key or a bad
    value stops SGLang at start-up with a message naming it."""

    target: str | None = None
    model_id: str | None = None
    revision: str = ""
    # The KV cache's logical dtype as SGLang was told it (--kv-cache-dtype), for pools SGLang
    # keeps as raw bytes (DeepSeek-V4's are uint8): two fp8 kinds then never share a page.
    kv_cache_dtype: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S
    data_plane: str = "auto"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> BackendConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - SGLANG_KEYS)
        if unknown:
            raise InvalidArgument(f"--hicache-storage-backend-extra-config has unknown keys {unknown}; kvstore's "
                                  f"keys are {sorted(known)}")
        mine = {k: v for k, v in extra.items() if k in known}
        for key in ("target", "model_id"):
            if mine.get(key) is not None and (not isinstance(mine[key], str) or not mine[key]):
                raise InvalidArgument(f"extra config {key!r} must be a non-empty string, got {mine[key]!r}")
        for key in ("revision", "kv_cache_dtype"):
            if not isinstance(mine.get(key, ""), str):
                raise InvalidArgument(f"extra config {key!r} must be a string, got {mine[key]!r}")
        for key in ("timeout_s", "lookup_timeout_s", "retry_interval_s"):
            if key in mine:
                value = mine[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                    raise InvalidArgument(f"extra config {key!r} must be a number of seconds in (0, 3600], "
                                          f"got {value!r}")
                mine[key] = float(value)
        if mine.get("data_plane", "auto") not in ("auto", "local", "lane", "grpc"):
            raise InvalidArgument(f"extra config 'data_plane' must be auto, local, lane or grpc, "
                                  f"got {mine['data_plane']!r}")
        return cls(**mine)


# ------------------------------------------------------------------ statistics


@dataclass
class KVStoreStorageMetrics(StorageMetrics):
    """SGLang's storage metrics (the page counts and GB/s of each call since the last
    `get_stats`, which its Prometheus collector reads), and this backend's running totals."""

    pages_hit: int = 0  # pages loaded into a host pool
    pages_missed: int = 0  # pages asked for and not loaded
    pages_stored: int = 0
    pages_not_stored: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0  # calls that failed (daemon down, slow, refusing; bad input)
    calls_skipped: int = 0  # calls answered "miss" without asking, while the daemon was down
    data_plane: str = ""  # "local" (shared memory), "lane", "grpc", or "" before the first call


@dataclass
class _Totals:
    lock: threading.Lock = field(default_factory=threading.Lock)
    pages_hit: int = 0
    pages_missed: int = 0
    pages_stored: int = 0
    pages_not_stored: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    calls_skipped: int = 0
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)

    def add(self, **counts: int) -> None:
        with self.lock:
            for key, n in counts.items():
                setattr(self, key, getattr(self, key) + n)

    def call(self, loaded: bool, pages: int, nbytes: int, seconds: float) -> None:
        """SGLang's per-call samples (pages and GB/s of one get or set that moved bytes)."""
        if not pages:
            return
        with self.lock:
            (self.prefetch_pgs if loaded else self.backup_pgs).append(pages)
            if seconds > 0:
                (self.prefetch_bandwidth if loaded else self.backup_bandwidth).append(nbytes / seconds / 1e9)


# ------------------------------------------------------------------ daemon health


class _Health:
    """Whether the daemon answers. One warning when it stops, one line when it is back, and
    no calls in between until `retry_interval_s` passed: a daemon that is gone must cost
    SGLang neither a stack trace per page nor a timeout per request."""

    def __init__(self, target: str, retry_interval_s: float) -> None:
        self.target = target
        self.retry_interval_s = retry_interval_s
        self._down_since: float | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def usable(self) -> bool:
        return self._down_since is None or time.monotonic() >= self._next_try

    def failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            self._next_try = now + self.retry_interval_s
            first = self._down_since is None
            if first:
                self._down_since = now
        if first:
            logger.warning("kvstore daemon at %s failed during %s (%s); HiCache storage answers miss and skips "
                           "writes; retrying every %g s", self.target, what, exc, self.retry_interval_s)
        else:
            logger.debug("kvstore daemon at %s still failing during %s: %s", self.target, what, exc)

    def ok(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            logger.info("kvstore daemon at %s is back after %.1f s", self.target, time.monotonic() - since)


class _Refused(Exception):
    """A call this backend cannot serve as asked (indices that do not fit the pool, a pool it
    does not hold): a miss, counted, logged once per reason; the daemon is not at fault."""


# ------------------------------------------------------------------ namespaces


class _Family:
    """One kvstore namespace and the pools whose pages it holds (one KV group each when
    grouped). In a plain namespace a page is `units` blocks (its pieces, or the whole page);
    in a grouped one a page is one block and each pool's page one part of it."""

    def __init__(self, layout: KVLayout, pools: Sequence[PoolPages], page_tokens: Mapping[str, int]) -> None:
        self.layout = layout
        self.pools = tuple(pools)
        self.grouped = bool(layout.groups)
        self.units = 1 if self.grouped else self.pools[0].units_per_page
        self.page_tokens = dict(page_tokens)  # host slots per page, per pool
        self.names = frozenset(p.name for p in self.pools)
        self._tag = _HASH_TAG + layout.namespace_id

    def hashes(self, keys: Sequence[str]) -> list[bytes]:
        tag, digest = self._tag, xxhash.xxh3_128_digest
        units = [j.to_bytes(4, "little") for j in range(self.units)]
        return [digest(tag + u + k.encode()) for k in keys for u in units]

    def page_bytes(self) -> int:
        return sum(p.page_bytes for p in self.pools)


# ------------------------------------------------------------------ the backend


class HiCacheKVStore(HiCacheStorage):
    """SGLang's L3 on a kvstore daemon (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        self.config = BackendConfig.from_extra(extra)
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        model = self.config.model_id or storage_config.model_name
        if not model:
            raise InvalidArgument("SGLang named no model for HiCache storage; set \"model_id\" in "
                                  "--hicache-storage-backend-extra-config (the model's name, so engines share blocks)")
        self.model_id = model
        if not self.interface_v1:
            logger.info("kvstore HiCache backend: interface_v1 is not set, so SGLang uses its copying page calls; "
                        "set \"interface_v1\": 1 to move pages in place")
        if storage_config.should_split_heads:
            logger.warning("kvstore HiCache backend: tp_lcm_size head splitting is not supported; pages are keyed "
                           "by this rank's TP rank and size instead (no sharing across TP sizes)")
        self.mem_pool_host: Any = None
        self.registered_pools: dict[str, Any] = {}
        self._pools: dict[str, PoolPages] = {}
        self._kv: _Family | None = None  # the KV pool's namespace (with the KV-derived pools)
        self._flat: _Family | None = None  # the deprecated calls' namespace (SGLang's flat pages)
        self._own: dict[str, _Family] = {}  # every other pool's own namespace
        self._ready = False
        self._build_lock = threading.Lock()
        self._client: Client | None = None
        self._client_lock = threading.Lock()
        self.target = resolve_target(self.config.target)
        self._health = _Health(self.target, self.config.retry_interval_s)
        self._totals = _Totals()
        self._plane = ""
        self._memo = threading.local()
        self._told: set[str] = set()

    # ----------------------------------------------------------------- registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self._pools[_KV] = PoolPages(_KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = _name(host_pool_name)
        self.registered_pools[name] = host_pool
        if name == _KV and (host_pool is self.mem_pool_host or _KV in self._pools):
            return
        self._pools[name] = PoolPages(name, host_pool)

    def on_host_pools_registered(self) -> None:
        self._build()

    def _build(self) -> None:
        """Fix the namespaces once the pool set is known (a pool registered later gets a
        namespace of its own on first use)."""
        if self._ready:
            return
        with self._build_lock:
            if self._ready:
                return
            anchor = self._pools.get(_KV)
            members = [anchor] if anchor is not None and not anchor.logical else []
            members += [p for n, p in sorted(self._pools.items()) if n in KV_DERIVED and not p.logical]
            if members:
                self._kv = self._family(members, "kv")
            if anchor is not None and not anchor.logical:
                self._flat = self._flat_family(anchor)
            self._ready = True
            logger.info("kvstore HiCache backend at %s: model %r, KV namespace %s (%s), own namespaces for %s",
                        self.target, self.model_id, self._kv.layout.namespace_id.hex() if self._kv else "(none)",
                        ", ".join(sorted(self._kv.names)) if self._kv else "no KV bytes",
                        ", ".join(sorted(n for n in self._pools if self._kv is None or n not in self._kv.names))
                        or "no other pool")

    def _page_tokens(self, pool: PoolPages) -> int:
        if pool.name == _KV and self.storage_config.logical_page_size:
            return int(self.storage_config.logical_page_size)
        return pool.page_tokens

    def _replicated(self, pools: Sequence[PoolPages]) -> bool:
        return self.storage_config.is_mla_model and not any(p.name in _SHARDED_EVEN_FOR_MLA for p in pools)

    def _descriptor(self, role: str, pools: Sequence[PoolPages], replicated: bool) -> str:
        sc = self.storage_config
        parts = [f"sglang.v1/{role}", f"pp={sc.pp_rank}/{sc.pp_size}", f"cp={sc.attn_cp_rank}/{sc.attn_cp_size}",
                 f"dcp={sc.dcp_rank}/{sc.dcp_size}/{sc.logical_page_size}",
                 "tp-replicated" if replicated else "tp-sharded"]
        if self.config.kv_cache_dtype:
            parts.append(f"kv_cache_dtype={self.config.kv_cache_dtype}")
        parts += [p.describe() for p in pools]
        text = ";".join(parts)
        if len(text) > MAX_NAME_CHARS:
            # Too long for the layout field: its digest keeps every difference apart.
            text = f"sglang.v1/{role};sha256=" + hashlib.sha256(text.encode()).hexdigest()
        return text

    def _layout(self, role: str, pools: Sequence[PoolPages], block_bytes: int, grouped: bool) -> KVLayout:
        sc = self.storage_config
        replicated = self._replicated(pools)
        tp_rank, tp_size = (0, 1) if replicated else (sc.tp_rank, sc.tp_size)
        first = pools[0].pool
        bst = self._page_tokens(self._pools[_KV]) if _KV in self._pools else pools[0].page_tokens
        common = dict(model=self.model_id, revision=self.config.revision, block_size_tokens=max(1, bst),
                      kv_layout=self._descriptor(role, pools, replicated), tp_rank=tp_rank, tp_size=tp_size)
        if grouped:
            groups = tuple(KVGroup(name=p.name, kind=self._kind(p), dtype=p.dtype, shape=(p.page_bytes,),
                                   block_bytes=p.page_bytes) for p in pools)
            return KVLayout(dtype=pools[0].dtype, num_layers=1, num_kv_heads=1, head_dim=1, groups=groups,
                            **common)  # type: ignore[arg-type]
        return KVLayout(dtype=pools[0].dtype, num_layers=max(1, int(getattr(first, "layer_num", 1) or 1)),
                        num_kv_heads=max(1, int(getattr(first, "head_num", 1) or 1)),
                        head_dim=max(1, int(getattr(first, "head_dim", 0) or getattr(first, "kv_cache_dim", 1) or 1)),
                        block_bytes=block_bytes, **common)  # type: ignore[arg-type]

    def _kind(self, pool: PoolPages) -> GroupKind:
        if pool.name == _KV:
            return GroupKind.MLA if self.storage_config.is_mla_model else GroupKind.FULL
        return GroupKind.AUXILIARY

    def _family(self, pools: Sequence[PoolPages], role: str) -> _Family:
        grouped = len(pools) > 1
        layout = self._layout(role, pools, 0 if grouped else pools[0].unit_bytes, grouped)
        return _Family(layout, pools, {p.name: self._page_tokens(p) for p in pools})

    def _flat_family(self, anchor: PoolPages) -> _Family:
        flat = anchor.as_flat()
        return _Family(self._layout("flat", [flat], flat.unit_bytes, False), [flat], {_KV: self._page_tokens(anchor)})

    def _own_family(self, name: str) -> _Family | None:
        fam = self._own.get(name)
        if fam is None:
            pool = self._pools.get(name)
            if pool is None or pool.logical:
                return None
            with self._build_lock:
                fam = self._own.get(name)
                if fam is None:
                    fam = self._own[name] = self._family([pool], f"pool:{name}")
        return fam

    def namespaces(self) -> dict[str, KVLayout]:
        """The layouts this backend files pages under, by role (for operators and tests)."""
        self._build()
        out = {}
        if self._kv is not None:
            out["kv"] = self._kv.layout
        if self._flat is not None:
            out["flat"] = self._flat.layout
        for name in sorted(self._pools):
            fam = self._own_family(name) if self._kv is None or name not in self._kv.names else None
            if fam is not None:
                out[name] = fam.layout
        return out

    # ----------------------------------------------------------------- the daemon

    def _connect(self) -> Client:
        client = self._client
        if client is None:
            with self._client_lock:
                client = self._client
                if client is None:
                    client = self._client = Client(self.target, timeout_s=self.config.timeout_s,
                                                   data_plane=self.config.data_plane)
        return client

    def _drop(self, client: Client) -> None:
        """Forget a client after a failure; the next try makes a new one (a restarted daemon
        has a new segment to map). It is closed off this thread: closing hands leases back,
        which must not hold SGLang's thread while the daemon is gone."""
        with self._client_lock:
            if self._client is client:
                self._client = None
        threading.Thread(target=_close_quietly, args=(client,), name="kvstore-close", daemon=True).start()

    def _call(self, what: str, miss: T, fn: Callable[[Client], T]) -> T:
        """Run `fn` against the daemon; any failure is `miss` (see the module docstring)."""
        self._build()
        if not self._health.usable():
            self._totals.add(calls_skipped=1)
            return miss
        client = self._connect()
        try:
            out = fn(client)
            if not self._plane:
                self._plane = client.data_plane_in_use
        except _Refused as exc:
            self._totals.add(errors=1)
            self._tell(f"refused:{exc}", "kvstore HiCache backend: %s (%s answers miss for it)", exc, what)
            return miss
        except ResourceExhausted as exc:
            self._totals.add(errors=1)
            logger.debug("kvstore daemon full during %s: %s", what, exc)
            return miss
        except (InvalidArgument, NotFound, PermissionDenied, Unauthenticated, ConfigError) as exc:
            self._totals.add(errors=1)
            self._tell(f"{type(exc).__name__}:{what}", "kvstore daemon at %s refused %s: %s", self.target, what, exc)
            return miss
        except (KVStoreError, OSError) as exc:
            self._totals.add(errors=1)
            self._health.failed(what, exc)
            self._drop(client)
            return miss
        except Exception as exc:  # noqa: BLE001 - SGLang's storage threads die on any exception
            self._totals.add(errors=1)
            if self._tell(f"bug:{what}:{type(exc).__name__}", "kvstore HiCache backend failed in %s: %r",
                          what, exc):
                logger.debug("traceback of the failure in %s", what, exc_info=True)
            return miss
        self._health.ok()
        return out

    def _tell(self, reason: str, msg: str, *args: Any) -> bool:
        """Log `msg` once per `reason`; whether it was logged now."""
        if reason in self._told:
            return False
        self._told.add(reason)
        logger.warning(msg, *args)
        return True

    # ----------------------------------------------------------------- moving pages

    def _lookup_leading(self, client: Client, fam: _Family, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        hit = client.lookup(fam.layout, block_hashes=fam.hashes(keys), timeout_s=self.config.lookup_timeout_s)
        return min(len(keys), hit.num_blocks // fam.units)

    def _lookup_trailing(self, client: Client, fam: _Family, keys: Sequence[str]) -> int:
        """How many of the last pages of `keys` are held, without a gap."""
        if not keys:
            return 0
        hashes = fam.hashes(list(reversed(keys)))
        hit = client.lookup(fam.layout, block_hashes=hashes, timeout_s=self.config.lookup_timeout_s)
        return min(len(keys), hit.num_blocks // fam.units)

    def _get(self, client: Client, fam: _Family, keys: Sequence[str], indices: Mapping[str, Any]) -> int:
        """Load the longest held prefix of `keys` into the pools at `indices` (a pool's host
        indices, by pool name; a pool without any is not written); pages loaded."""
        n = len(keys)
        if not n:
            return 0
        if fam.grouped:
            blocks = client.fetch(fam.layout, block_hashes=fam.hashes(keys), timeout_s=self.config.timeout_s)
            m = len(blocks)
            for pool in fam.pools:
                idx = indices.get(pool.name)
                if idx is None or not m:
                    continue
                tokens = fam.page_tokens[pool.name]
                if not pool.scatter(idx[: m * tokens], [b[pool.name] for b in blocks[:m]], tokens):
                    raise _Refused(f"host indices for pool {pool.name} do not name {m} of its pages")
            return m
        pool = fam.pools[0]
        idx = indices[pool.name]
        tokens = fam.page_tokens[pool.name]
        if pool.uniform:
            pieces = pool.pieces(idx, n)
            if pieces is None:
                raise _Refused(f"host indices for pool {pool.name} do not name {n} of its pages")
            got = client.fetch(fam.layout, block_hashes=fam.hashes(keys), out=[v for p in pieces for v in p],
                               timeout_s=self.config.timeout_s)
            return len(got) // fam.units
        staged = [bytearray(pool.page_bytes) for _ in range(n)]
        got = client.fetch(fam.layout, block_hashes=fam.hashes(keys), out=staged, timeout_s=self.config.timeout_s)
        m = len(got)
        if m and not pool.scatter(idx[: m * tokens], staged[:m], tokens):
            raise _Refused(f"host indices for pool {pool.name} do not name {n} of its pages")
        return m

    def _put(self, client: Client, fam: _Family, keys: Sequence[str], indices: Mapping[str, Any]) -> bool:
        """Store the pages of `keys` from the pools at `indices`, all or nothing."""
        n = len(keys)
        if not n:
            return True
        if fam.grouped:
            parts: dict[str, list[memoryview]] = {}
            for pool in fam.pools:
                idx = indices.get(pool.name)
                got = pool.gather(idx, n, fam.page_tokens[pool.name]) if idx is not None else None
                if got is None:
                    raise _Refused(f"host indices for pool {pool.name} do not name {n} of its pages")
                parts[pool.name] = got
            blocks: list[Any] = [{name: pages[i] for name, pages in parts.items()} for i in range(n)]
        else:
            pool = fam.pools[0]
            idx = indices[pool.name]
            if pool.uniform:
                pieces = pool.pieces(idx, n)
                if pieces is None:
                    raise _Refused(f"host indices for pool {pool.name} do not name {n} of its pages")
                blocks = [v for p in pieces for v in p]
            else:
                pages = pool.gather(idx, n, fam.page_tokens[pool.name])
                if pages is None:
                    raise _Refused(f"host indices for pool {pool.name} do not name {n} of its pages")
                blocks = list(pages)
        client.put(fam.layout, None, blocks, block_hashes=fam.hashes(keys), timeout_s=self.config.timeout_s)
        return True

    def _writer(self, fam: _Family) -> bool:
        """Whether this rank writes `fam`'s pages: MLA ranks replicate them, one per DCP shard writes."""
        return self.storage_config.is_storage_writer or not self._replicated(fam.pools)

    def _load(self, what: str, fam: _Family | None, keys: Sequence[str], indices: Mapping[str, Any]) -> int:
        if fam is None:
            return 0
        start = time.perf_counter()
        m = self._call(what, 0, lambda c: self._get(c, fam, keys, indices))
        nbytes = m * fam.page_bytes()
        self._totals.add(pages_hit=m, pages_missed=len(keys) - m, bytes_read=nbytes)
        self._totals.call(True, m, nbytes, time.perf_counter() - start)
        return m

    def _store(self, what: str, fam: _Family | None, keys: Sequence[str], indices: Mapping[str, Any]) -> list[bool]:
        """Store in runs of at most STORAGE_BATCH_SIZE pages; one result per page."""
        if fam is None:
            return [False] * len(keys)
        if not self._writer(fam):
            return [True] * len(keys)  # the writer rank stores these very bytes
        out: list[bool] = []
        for s in range(0, len(keys), STORAGE_BATCH_SIZE):
            run = keys[s : s + STORAGE_BATCH_SIZE]
            sub = {name: _slice_pages(idx, s, len(run), fam.page_tokens[name]) for name, idx in indices.items()}
            start = time.perf_counter()
            ok = self._call(what, False, lambda c: self._put(c, fam, run, sub))
            nbytes = len(run) * fam.page_bytes()
            if ok:
                self._totals.add(pages_stored=len(run), bytes_written=nbytes)
                self._totals.call(False, len(run), nbytes, time.perf_counter() - start)
            else:
                self._totals.add(pages_not_stored=len(run))
            out += [ok] * len(run)
        return out

    # ----------------------------------------------------------------- v1

    def _v1_family(self) -> _Family | None:
        self._build()
        return self._kv if self.interface_v1 else self._flat

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many pages from the first are held (every pool of the KV namespace)."""
        fam = self._v1_family()
        if fam is None or not keys:
            return 0
        return self._call("batch_exists", 0, lambda c: self._lookup_leading(c, fam, keys))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load the held prefix of `keys` into the KV pool's pages at `host_indices` (and the
        KV-derived pools' pages at the same indices); one bool per key, leading run True."""
        self._build()
        n = len(keys)
        if self._anchor_is_logical():
            return [True] * n  # SGLang's rule: V4's KV anchor holds no bytes; its pools load through v2
        fam = self._kv
        indices = {name: host_indices for name in fam.names} if fam is not None else {}
        m = self._load("batch_get_v1", fam, keys, indices)
        if fam is not None and fam.grouped:  # the v2 call for the same pages that SGLang makes next
            self._memo.loaded = (tuple(keys), _index_list(host_indices), m)
        return [True] * m + [False] * (n - m)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the KV pool's pages at `host_indices` under `keys` (with the KV-derived
        pools' pages at the same indices, in one put); one bool per key."""
        self._build()
        n = len(keys)
        if self._anchor_is_logical():
            return [True] * n  # SGLang's rule: V4's pools store through v2
        fam = self._kv
        stored = getattr(self._memo, "stored", None)
        if fam is not None and fam.grouped and stored and all(k in stored for k in keys):
            # The v2 call just before, on this thread, put these pages with every group.
            stored.difference_update(keys)
            return [True] * n
        return self._store("batch_set_v1", fam, keys, {name: host_indices for name in fam.names} if fam else {})

    def _anchor_is_logical(self) -> bool:
        anchor = self._pools.get(_KV)
        return anchor is not None and anchor.logical

    # ----------------------------------------------------------------- v2

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix: the KV namespace's leading run (every KV-derived pool with it),
        cut by each other pool's hit policy; every restorable length is listed."""
        self._build()
        miss = PoolTransferResult(0, {}, [])
        return self._call("batch_exists_v2", miss, lambda c: self._exists_v2(c, keys, pool_transfers or []))

    def _exists_v2(self, client: Client, keys: list[str], transfers: list[PoolTransfer]) -> PoolTransferResult:
        if self._kv is not None:
            kv = self._lookup_leading(client, self._kv, keys)
        else:
            kv = len(keys) if self._anchor_is_logical() else 0
        # Keyed as SGLang keys them (PoolName members), which it looks up by member.
        hits: dict[Any, int] = {PoolName.KV: kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for t in transfers:
            name = _name(t.name)
            if not restorable and t.hit_policy != PoolHitPolicy.BLOCK_GROUPS:
                break
            if self._kv is not None and name in self._kv.names:
                if t.hit_policy != PoolHitPolicy.ALL_PAGES:
                    raise _Refused(f"pool {name} is stored with the KV pool but came with hit policy "
                                   f"{t.hit_policy}")
                if kv:
                    hits[t.name] = kv
                continue
            fam = self._own_family(name)
            if fam is None:
                restorable = set()
                continue
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                held = self._lookup_leading(client, fam, keys[:kv])
                restorable &= set(range(1, held + 1))
                if held:
                    hits[t.name] = held
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys) if t.keys else 1)
                ends = self._trailing_ends(client, fam, keys, max(restorable, default=0), window)
                restorable &= ends
                if ends:
                    hits[t.name] = max(ends)
            elif t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                own = list(t.keys or [])
                group = max(1, t.group_pages)
                complete = self._lookup_leading(client, fam, own) // group if own else 0
                if complete:
                    hits[t.name] = complete * max(1, t.block_pages)  # its own verdict; it never gates the KV hit
            else:
                raise _Refused(f"pool {name} came with unknown hit policy {t.hit_policy!r}")
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def _trailing_ends(self, client: Client, fam: _Family, keys: Sequence[str], limit: int, window: int) -> set[int]:
        """Prefix lengths p <= limit whose last min(window, p) pages the pool holds: each look
        finds the run of held pages ending at p; the windows inside it are whole, and the
        next look starts below the page that broke it."""
        ends: set[int] = set()
        p = limit
        for _ in range(MAX_TRAILING_PROBES):
            if p <= 0:
                break
            run = self._lookup_trailing(client, fam, keys[:p])
            gap = p - run - 1  # the missing page below the run; -1: the run reaches the start
            low = 1 if gap < 0 else gap + 1 + window
            ends.update(range(low, p + 1))
            p = gap
        return ends

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Load each transfer's pages into its pool; one bool per key, per pool."""
        self._build()
        results: dict[str, list[bool]] = {}
        mine = self._kv_transfers(transfers, results)
        if mine:
            keys, idx = mine[0].keys or [], mine[0].host_indices
            m = self._kv_loaded(keys, idx)
            if m is None:
                m = self._load("batch_get_v2", self._kv, keys, {name: idx for name in self._kv.names
                                                              if name != _KV} if self._kv else {})
            for t in mine:
                results[t.name] = [True] * m + [False] * (len(keys) - m)
        for t in transfers:
            if t.name in results:
                continue
            keys = list(t.keys or [])
            fam = self._own_family(_name(t.name))
            if fam is None:
                self._tell(f"unknown:{_name(t.name)}", "kvstore HiCache backend: pool %s was not registered; "
                           "its pages are a miss", _name(t.name))
                results[t.name] = [False] * len(keys)
                continue
            m = self._load("batch_get_v2", fam, keys, {fam.pools[0].name: t.host_indices})
            results[t.name] = [True] * m + [False] * (len(keys) - m)
        return results

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Store each transfer's pages from its pool; one bool per key, per pool. The pools
        stored with the KV pool go in one put with its pages at the same indices."""
        self._build()
        results: dict[str, list[bool]] = {}
        mine = self._kv_transfers(transfers, results)
        if mine and self._kv is not None:
            keys, idx = list(mine[0].keys or []), mine[0].host_indices
            oks = self._store("batch_set_v2", self._kv, keys, {name: idx for name in self._kv.names})
            if all(oks) and self._kv.grouped:
                stored = getattr(self._memo, "stored", None)
                if stored is None:
                    stored = self._memo.stored = set()
                stored.clear()
                stored.update(keys)
            for t in mine:
                results[t.name] = oks
        for t in transfers:
            if t.name in results:
                continue
            keys = list(t.keys or [])
            fam = self._own_family(_name(t.name))
            if fam is None:
                self._tell(f"unknown:{_name(t.name)}", "kvstore HiCache backend: pool %s was not registered; "
                           "its pages are not stored", _name(t.name))
                results[t.name] = [False] * len(keys)
                continue
            results[t.name] = self._store("batch_set_v2", fam, keys, {fam.pools[0].name: t.host_indices})
        return results

    def _kv_transfers(self, transfers: Sequence[PoolTransfer], results: dict[str, list[bool]]) -> list[PoolTransfer]:
        """The transfers of pools stored with the KV pool, when they name the same pages (the
        KV pool's indices and keys); any that cannot be served so get False in `results`."""
        if self._kv is None:
            return []
        mine = [t for t in transfers if _name(t.name) in self._kv.names and _name(t.name) != _KV]
        good: list[PoolTransfer] = []
        for t in mine:
            keys = list(t.keys or [])
            same = not good or (keys == list(good[0].keys or []) and
                                _index_list(t.host_indices) == _index_list(good[0].host_indices))
            if t.hit_policy != PoolHitPolicy.ALL_PAGES or t.host_indices is None or not same:
                self._tell(f"kvderived:{_name(t.name)}", "kvstore HiCache backend: pool %s is stored with the KV "
                           "pool, but this transfer names other pages or hit policy %s; a miss",
                           _name(t.name), t.hit_policy)
                results[t.name] = [False] * len(keys)
                continue
            good.append(t)
        return good

    def _kv_loaded(self, keys: Sequence[str], host_indices: Any) -> int | None:
        """Pages the v1 get just before (on this thread) loaded for these very keys and
        indices, with every KV-derived pool: they need no second fetch."""
        memo = getattr(self._memo, "loaded", None)
        if memo is None or self._kv is None or not self._kv.grouped:
            return None
        self._memo.loaded = None
        got_keys, got_idx, m = memo
        if got_keys != tuple(keys) or got_idx != _index_list(host_indices):
            return None
        return m

    # ----------------------------------------------------------------- deprecated calls

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0] if isinstance(got, list) and got else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Pages as SGLang's flat page tensors, into `target_locations` when given."""
        self._build()
        fam = self._flat
        if fam is None or not keys:
            return [None] * len(keys)
        size = fam.pools[0].page_bytes
        outs = list(target_locations) if target_locations is not None else [
            torch.empty(size, dtype=torch.uint8) for _ in keys]

        def get(c: Client) -> int:
            if any(_nbytes(o) != size for o in outs):
                raise _Refused(f"a target page is not {size} bytes (SGLang's flat page of this pool)")
            return len(c.fetch(fam.layout, block_hashes=fam.hashes(keys), out=outs, timeout_s=self.config.timeout_s))

        m = self._call("batch_get", 0, get)
        self._totals.add(pages_hit=m, pages_missed=len(keys) - m, bytes_read=m * size)
        return [o if i < m else None for i, o in enumerate(outs)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store SGLang's flat page tensors, all or nothing."""
        self._build()
        fam = self._flat
        if fam is None or not keys or values is None:
            return False
        if not self._writer(fam):
            return True
        vals = [v.contiguous() for v in values]

        def put(c: Client) -> bool:
            c.put(fam.layout, None, vals, block_hashes=fam.hashes(keys), timeout_s=self.config.timeout_s)
            return True

        ok = self._call("batch_set", False, put)
        self._totals.add(**({"pages_stored": len(keys), "bytes_written": len(keys) * fam.page_bytes()} if ok
                            else {"pages_not_stored": len(keys)}))
        return ok

    # ----------------------------------------------------------------- housekeeping

    def clear(self) -> bool:
        """Drop every page this backend's namespaces hold on the daemon (an admin call:
        with a token file, the engine's token needs admin rights)."""
        from kvstore.client.admin import AdminClient

        layouts = list(self.namespaces().values())

        def flush(c: Client) -> bool:
            with AdminClient(self.target, timeout_s=self.config.timeout_s) as admin:
                for layout in layouts:
                    # The id the daemon files the namespace under (the tenant's, with auth on).
                    filed = c.lookup(layout, block_hashes=[], timeout_s=self.config.lookup_timeout_s).namespace_id
                    try:
                        admin.flush(filed or layout.namespace_id)
                    except NotFound:
                        pass  # a namespace nothing was ever stored in
            return True

        return self._call("clear", False, flush)

    def get_stats(self) -> KVStoreStorageMetrics:
        t = self._totals
        with t.lock:
            out = KVStoreStorageMetrics(
                prefetch_pgs=t.prefetch_pgs, backup_pgs=t.backup_pgs, prefetch_bandwidth=t.prefetch_bandwidth,
                backup_bandwidth=t.backup_bandwidth, pages_hit=t.pages_hit, pages_missed=t.pages_missed,
                pages_stored=t.pages_stored, pages_not_stored=t.pages_not_stored, bytes_read=t.bytes_read,
                bytes_written=t.bytes_written, errors=t.errors, calls_skipped=t.calls_skipped,
                data_plane=self._plane)
            t.prefetch_pgs, t.backup_pgs, t.prefetch_bandwidth, t.backup_bandwidth = [], [], [], []
        return out

    def close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)


# ------------------------------------------------------------------ helpers


def _close_quietly(client: Client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a client of a daemon that is gone
        logger.debug("closing a kvstore client failed", exc_info=True)


def _index_list(host_indices: Any) -> tuple[int, ...]:
    if host_indices is None:
        return ()
    return tuple(int(i) for i in (host_indices.tolist() if hasattr(host_indices, "tolist") else host_indices))


def _slice_pages(host_indices: Any, first_page: int, n_pages: int, page_tokens: int) -> Any:
    if host_indices is None:
        return None
    return host_indices[first_page * page_tokens : (first_page + n_pages) * page_tokens]


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if hasattr(t, "numel") else len(memoryview(t).cast("B"))
