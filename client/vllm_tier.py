"""kvstore as a secondary tier of vLLM's own KV offloading (`TieringOffloadingSpec`).

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.client.vllm_tier",
                             "target": "unix:/run/kvstore/kv.sock"}]}}'

vLLM keeps a primary CPU tier (a shared memory region of fixed-size chunks) that its
workers copy the device's KV into and out of; secondary tiers move chunks between that
memory and somewhere else, and run in the scheduler process. `KVStoreTier` is one: its
chunks go to a kvstore daemon, so every engine on the host (and, with a pool, on every
host) finds what one of them offloaded, and the daemon's SSD tier keeps them across
restarts.

Primitives, as vLLM's `SecondaryTierManager` names them (none blocks the scheduler):

- `lookup(key)`: HIT / MISS, or RETRY while the answer is not known yet (a lookup is
  batched per step and asked on a thread of its own, with a short lease so the load that
  follows finds the blocks) or while a store of the key is on its way;
- `submit_load(job)` / `submit_store(job)`: queued to two threads, loads never behind
  stores; a load fetches straight into the primary tier's chunk rows (the one copy the
  plane makes: out of the daemon's shared segment, or off the socket), a store puts from
  them; both finish through `get_finished_jobs()`, a load that got only a prefix reports
  the keys that landed;
- `drain_jobs()`: waits until every submitted job finished; a running copy is never
  cut short (each call has its deadline, so the wait is bounded);
- `on_new_request` / `on_request_finished`: per-request hints (`kvstore_session_id`,
  `kvstore_expect_reuse_within_s`, `kvstore_end_session` in `kv_transfer_params`, see
  `kvstore.client._request_hints`) ride on the request's lookups and stores; an ended
  session is ended after the request's last store;
- `take_events()`: with `enable_kv_events`, a stored event per successful store.

Keys. vLLM names a chunk by its `OffloadKey` (the block hash and the KV group index);
kvstore keys it by a 16-byte BLAKE2b digest of that key inside a namespace built from
the `OffloadingSpec`: the model, the KV dtype, the KV groups and their layers, tokens per
hash, blocks per chunk, the parallel layout, the canonical or device layout and the
chunk's bytes. Engines whose chunks could differ in any of these never share a block.

A daemon that stops answering makes every lookup a MISS and every job fail at once
(one warning, then nothing until `retry_interval_s` has passed); vLLM recomputes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstore.client._request_hints import NO_HINTS, RequestHints, parse_request_hints
from kvstore.client._requests import EngineNames
from kvstore.client.sync import Client
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.hashing import HASH_BYTES
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

DEFAULT_LOOKUP_TIMEOUT_S = 2.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
DEFAULT_RETRY_INTERVAL_S = 5.0
# Covers the steps between a lookup's HIT and the load vLLM submits at the step's end.
DEFAULT_LEASE_MS = 30_000
KV_LAYOUT_PREFIX = "vllm-offload-chunk/v1"


def offload_spec_layout(offloading_spec: OffloadingSpec, chunk_bytes: int, *, model_id: str | None = None) -> KVLayout:
    """The kvstore namespace of one engine's offloaded chunks: everything in the
    `OffloadingSpec` that changes a chunk's bytes, digested into the layout's name
    (readable parts in front), and the chunk's size as its block size."""
    from vllm.platforms import current_platform

    config = offloading_spec.config
    parallel = config.parallel
    groups = [{"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names), "group": g.group_id}
              for g in config.groups]
    facts = {
        "groups": groups,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "parallel": [parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size],
        "parallelism_agnostic": parallel.is_parallelism_agnostic,
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
        # The device's own layout when the chunk is not canonical: two platforms' workers
        # may lay out the same block differently.
        "platform": None if config.canonical_layout else current_platform.device_name,
        "chunk_bytes": chunk_bytes,
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
    layers = len({name for g in config.groups for name in g.layer_names}) or 1
    return KVLayout(
        model=model_id or config.model.name,
        dtype=str(config.model.dtype).removeprefix("torch."),
        num_layers=layers,
        num_kv_heads=1,
        head_dim=1,
        block_size_tokens=max(1, config.cache.tokens_per_hash * config.cache.blocks_per_chunk),
        kv_layout=f"{KV_LAYOUT_PREFIX};groups={len(groups)};tp={parallel.tp_size};{digest}",
        tp_size=1,
        block_bytes=chunk_bytes,
    )


def block_key(offload_key: bytes) -> bytes:
    """kvstore's 16-byte key for a vLLM `OffloadKey` (block hash + group index)."""
    return hashlib.blake2b(offload_key, digest_size=HASH_BYTES).digest()


def engine_names(offload_keys: Iterable[OffloadKey]) -> EngineNames:
    """vLLM's names for the blocks of a store: each key's block hash, in the form vLLM's own
    offloading events publish it (`maybe_convert_block_hash`), so the daemon's KV events
    name the blocks as the engine's would and a router keyed by vLLM's hashes matches them."""
    return EngineNames([maybe_convert_block_hash(BlockHash(get_offload_block_hash(k))) for k in offload_keys])


@dataclass(frozen=True, slots=True)
class TierConfig:
    """The tier's own keys in its `secondary_tiers` entry, checked."""

    target: str | None = None
    model_id: str | None = None
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    lease_ms: int = DEFAULT_LEASE_MS
    retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S
    enable_kv_events: bool = False
    locality: str | None = None

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> TierConfig:
        known = {"target", "model_id", "lookup_timeout_s", "timeout_s", "lease_ms", "retry_interval_s",
                 "enable_kv_events", "locality"}
        unknown = sorted(set(entry) - known)
        if unknown:
            raise InvalidArgument(f"the KVStoreTier entry of secondary_tiers has unknown keys {unknown}; it takes "
                                  f"{sorted(known)} (and vLLM's type, module_path, backpressure)")
        values: dict[str, Any] = {}
        for name, value in entry.items():
            if name in ("target", "model_id", "locality"):
                if value is not None and not isinstance(value, str):
                    raise InvalidArgument(f"KVStoreTier {name} must be a string, got {value!r}")
                values[name] = value or None
            elif name == "enable_kv_events":
                if not isinstance(value, bool):
                    raise InvalidArgument(f"KVStoreTier {name} must be true or false, got {value!r}")
                values[name] = value
            else:
                try:
                    number = int(value) if name == "lease_ms" else float(value)
                except (TypeError, ValueError):
                    raise InvalidArgument(f"KVStoreTier {name} must be a number, got {value!r}") from None
                if isinstance(value, bool) or number <= 0:
                    raise InvalidArgument(f"KVStoreTier {name} must be positive, got {value!r}")
                values[name] = number
        locality = values.get("locality")
        if locality is not None and locality not in (m.value for m in Locality):
            raise InvalidArgument(f"KVStoreTier locality must be one of {[m.value for m in Locality]}, "
                                  f"got {locality!r}")
        return cls(**values)


class _Health:
    """Whether the daemon answers: one warning when it stops, one line when it is back,
    and no calls in between for `retry_interval_s`. Shared by the tier's threads."""

    def __init__(self, target: str, retry_interval_s: float) -> None:
        self.target = target
        self.retry_interval_s = retry_interval_s
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._next_try = 0.0

    def usable(self) -> bool:
        return self._down_since is None or time.monotonic() >= self._next_try

    def failed(self, what: str, exc: Exception) -> None:
        with self._lock:
            now = time.monotonic()
            self._next_try = now + self.retry_interval_s
            if self._down_since is None:
                self._down_since = now
                logger.warning("kvstore daemon at %s failed during %s (%s); the kvstore tier answers MISS and fails "
                               "its jobs, retrying every %.0f s", self.target, what, exc, self.retry_interval_s)

    def ok(self) -> None:
        with self._lock:
            if self._down_since is not None:
                logger.info("kvstore daemon at %s is back after %.1f s", self.target,
                            time.monotonic() - self._down_since)
                self._down_since = None


@dataclass
class _Verdict:
    """A key's lookup answer: None while asked, then whether the daemon holds it."""

    present: bool | None
    requests: set[str]


_STOP = object()


class KVStoreTier(SecondaryTierManager):
    """A `SecondaryTierManager` over a kvstore daemon; see the module docstring."""

    medium: ClassVar[Medium | None] = Medium.CPU  # the daemon keeps blocks in host memory first

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, **entry: Any) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        self._config = TierConfig.from_entry(entry)
        chunk_bytes = self.block_size_bytes
        # Rows as flat byte ranges: the view is (chunks, row bytes) and C-contiguous.
        self._rows = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view
        self.layout = offload_spec_layout(offloading_spec, chunk_bytes, model_id=self._config.model_id)
        # One client per thread: a client's local-plane reservations are its own.
        self._lookup_client = Client(self._config.target, timeout_s=self._config.timeout_s)
        self._load_client = Client(self._config.target, timeout_s=self._config.timeout_s)
        self._store_client = Client(self._config.target, timeout_s=self._config.timeout_s)
        target = self._lookup_client.target
        self._health = _Health(target, self._config.retry_interval_s)
        if self._config.locality is not None:
            self.locality = Locality(self._config.locality)
        else:
            local = target.startswith("unix:") or target.split(":")[0] in ("127.0.0.1", "localhost", "[::1]")
            self.locality = Locality.LOCAL if local else Locality.REMOTE
        self._events: list[OffloadingEvent] | None = None
        if self._config.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                logger.warning("enable_kv_events is set on the kvstore tier but vLLM's KV cache events are off; "
                               "the tier emits none")
        # Scheduler-thread state.
        self._verdicts: dict[OffloadKey, _Verdict] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}  # the keys each request asked about
        self._asking: dict[str, tuple[ReqContext, list[OffloadKey]]] = {}  # this step's lookups, by request
        self._storing: dict[OffloadKey, int] = {}  # keys on their way to the daemon: stores in flight
        self._store_keys: dict[int, list[OffloadKey]] = {}
        self._load_keys: dict[int, list[OffloadKey]] = {}
        # Thread hand-offs.
        self._answers: queue.SimpleQueue[list[tuple[OffloadKey, bool | None]]] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._pending = 0  # jobs submitted and not yet finished
        self._lookups_in_flight = 0
        self._idle = threading.Condition()
        self._lookup_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._load_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._store_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, args=(self._lookup_q, self._run_lookups),
                             name="kvstore-tier-lookup", daemon=True),
            threading.Thread(target=self._serve, args=(self._load_q, self._run_load),
                             name="kvstore-tier-load", daemon=True),
            threading.Thread(target=self._serve, args=(self._store_q, self._run_store),
                             name="kvstore-tier-store", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        logger.info("kvstore tier %s for %s: %d-byte chunks, namespace %s", tier_type, target, chunk_bytes,
                    self.layout.namespace_id.hex())

    # ------------------------------------------------------------------ requests

    @staticmethod
    def _hints(req_context: ReqContext) -> RequestHints:
        hints = req_context.get_state(RequestHints)
        return hints if hints is not None else NO_HINTS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        hints = parse_request_hints(req_context.kv_transfer_params, getattr(req_context, "kv_hints", None))
        if hints.error:
            logger.warning("request %s: %s", req_context.req_id, hints.error)
        req_context.set_state(hints)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        req_id = req_context.req_id
        for key in self._req_keys.pop(req_id, ()):
            verdict = self._verdicts.get(key)
            if verdict is None:
                continue
            verdict.requests.discard(req_id)
            if not verdict.requests and verdict.present is not None:
                del self._verdicts[key]  # one still asked is dropped when its answer comes
        self._asking.pop(req_id, None)
        hints = self._hints(req_context)
        if hints.end_session:
            # Behind the request's stores on the same thread: its blocks are hinted, then released.
            self._store_q.put(("end_session", hints.session_id))

    # ------------------------------------------------------------------ lookups

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._take_answers()
        if key in self._storing:
            return LookupResult.RETRY  # its bytes are on their way to the daemon
        if not self._health.usable():
            return LookupResult.MISS
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self._verdicts[key] = _Verdict(None, set())
            entry = self._asking.setdefault(req_context.req_id, (req_context, []))
            entry[1].append(key)
        verdict.requests.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        if verdict.present is None:
            return LookupResult.RETRY
        return LookupResult.HIT if verdict.present else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._take_answers()
        if self._asking:
            batches = list(self._asking.values())
            self._asking = {}
            with self._idle:
                self._lookups_in_flight += 1
            self._lookup_q.put(batches)

    def _take_answers(self) -> None:
        while True:
            try:
                answers = self._answers.get_nowait()
            except queue.Empty:
                return
            for key, present in answers:
                verdict = self._verdicts.get(key)
                if verdict is None:
                    continue
                if present is None or not verdict.requests:
                    del self._verdicts[key]  # unanswered (past a miss) or nobody waits: ask again if asked
                else:
                    verdict.present = present

    def _run_lookups(self, batches: list[tuple[ReqContext, list[OffloadKey]]]) -> None:
        """(lookup thread) One Lookup per request, its keys in the order vLLM asked them:
        the daemon answers the longest held prefix; the key after it is a miss."""
        try:
            for req_context, keys in batches:
                answers: list[tuple[OffloadKey, bool | None]]
                if not self._health.usable():
                    answers = [(k, False) for k in keys]
                else:
                    try:
                        hit = self._lookup_client.lookup(
                            self.layout, block_hashes=[block_key(k) for k in keys], lease_ms=self._config.lease_ms,
                            timeout_s=self._config.lookup_timeout_s, **self._hints(req_context).hint_args())
                        self._health.ok()
                        n = hit.num_blocks
                        answers = [(k, True) for k in keys[:n]]
                        if n < len(keys):
                            answers.append((keys[n], False))
                            answers += [(k, None) for k in keys[n + 1:]]
                    except KVStoreError as exc:
                        self._health.failed("lookup", exc)
                        answers = [(k, False) for k in keys]
                    except Exception:  # every key asked must get an answer, or it waits forever
                        logger.exception("kvstore tier: a lookup failed")
                        answers = [(k, False) for k in keys]
                self._answers.put(answers)
        finally:
            with self._idle:
                self._lookups_in_flight -= 1
                self._idle.notify_all()

    # ------------------------------------------------------------------ jobs

    def _row(self, chunk: int) -> memoryview:
        start = int(chunk) * self.block_size_bytes
        return self._rows[start:start + self.block_size_bytes]

    def _submitted(self) -> None:
        with self._idle:
            self._pending += 1

    def _done(self, result: JobResult) -> None:
        self._finished.put(result)
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        # Keys this tier saw the daemon hold need no bytes sent; vLLM counts them stored.
        todo = [i for i, k in enumerate(keys) if not (v := self._verdicts.get(k)) or not v.present]
        sending = [keys[i] for i in todo]
        for key in sending:
            self._storing[key] = self._storing.get(key, 0) + 1
        self._store_keys[job_metadata.job_id] = sending
        self._submitted()
        self._store_q.put(("store", job_metadata, todo))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._load_keys[job_metadata.job_id] = list(job_metadata.keys)
        self._submitted()
        self._load_q.put(job_metadata)

    def _run_store(self, item: tuple[Any, ...]) -> None:
        """(store thread) A store job (all or nothing: one Put), or a session's end."""
        if item[0] == "end_session":
            if self._health.usable():
                try:
                    self._store_client.end_session(item[1], timeout_s=self._config.lookup_timeout_s)
                    self._health.ok()
                except KVStoreError as exc:
                    self._health.failed("end_session", exc)
            return
        _, job, todo = item
        started = time.perf_counter()
        keys = list(job.keys)
        success = True
        if todo:
            if not self._health.usable():
                success = False
            else:
                try:
                    self._store_client.put(
                        self.layout, None, [self._row(job.chunk_ids[i]) for i in todo],
                        block_hashes=[block_key(keys[i]) for i in todo],
                        engine_names=engine_names(keys[i] for i in todo), **self._hints(job.req_context).hint_args())
                    self._health.ok()
                except KVStoreError as exc:
                    self._health.failed("put", exc)
                    success = False
        self._done(JobResult(job_id=job.job_id, success=success, transfer_time=time.perf_counter() - started,
                             transfer_bytes=len(todo) * self.block_size_bytes))

    def _run_load(self, job: TransferJob) -> None:
        """(load thread) Fetch the job's blocks straight into their primary chunk rows;
        the verified prefix that landed is what succeeded."""
        started = time.perf_counter()
        keys = list(job.keys)
        landed = 0
        if self._health.usable():
            try:
                fetched = self._load_client.fetch(self.layout, block_hashes=[block_key(k) for k in keys],
                                                  out=[self._row(c) for c in job.chunk_ids])
                landed = len(fetched)
                self._health.ok()
            except KVStoreError as exc:
                self._health.failed("fetch", exc)
        result = JobResult(job_id=job.job_id, success=landed == len(keys),
                           successful_keys=tuple(keys[:landed]) if 0 < landed < len(keys) else None,
                           transfer_time=time.perf_counter() - started,
                           transfer_bytes=landed * self.block_size_bytes)
        self._done(result)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._take_answers()
        results = []
        while True:
            try:
                result = self._finished.get_nowait()
            except queue.Empty:
                break
            stored = self._store_keys.pop(result.job_id, None)
            if stored is not None:
                for key in stored:
                    left = self._storing.pop(key, 1) - 1
                    if left:
                        self._storing[key] = left
                if result.success and stored and self._events is not None:
                    self._events.append(OffloadingEvent(keys=stored, medium=Medium.CPU, removed=False,
                                                        locality=self.locality))
            loaded = self._load_keys.pop(result.job_id, None)
            if loaded is not None and not result.success:
                # What did not land is not in the daemon (evicted, or failed to verify):
                # later lookups must not promise it again.
                ok = set(result.successful_keys or ())
                for key in loaded:
                    if key not in ok and (verdict := self._verdicts.get(key)) is not None:
                        verdict.present = False
            results.append(result)
        return results

    def has_pending_work(self) -> bool:
        with self._idle:
            return self._pending > 0 or self._lookups_in_flight > 0 or bool(self._asking)

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # The daemon's policy sees every lookup and fetch; a touch of blocks vLLM found in
        # its own caches does not reach it (one call per step per request would cost more
        # than it tells).
        return

    # ------------------------------------------------------------------ threads

    def _serve(self, q: queue.SimpleQueue[Any], run: Any) -> None:
        while True:
            item = q.get()
            if item is _STOP:
                return
            try:
                run(item)
            except Exception:  # a thread that dies would leave its jobs unfinished forever
                logger.exception("kvstore tier: a %s task failed", threading.current_thread().name)
                if isinstance(item, TransferJob):
                    self._done(JobResult(job_id=item.job_id, success=False))
                elif isinstance(item, tuple) and item[0] == "store":
                    self._done(JobResult(job_id=item[1].job_id, success=False))

    def shutdown(self) -> None:
        self.drain_jobs()
        for q in (self._lookup_q, self._load_q, self._store_q):
            q.put(_STOP)
        for thread in self._threads:
            thread.join(timeout=self._config.timeout_s)
        for client in (self._lookup_client, self._load_client, self._store_client):
            client.close()

