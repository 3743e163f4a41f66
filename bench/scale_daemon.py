"""A real kvstore daemon for the scale benchmark (bench/scale.py), with two instruments.

BENCHMARK INSTRUMENTS, not production components (nothing in the `kvstore` package or
its config can select them):

* `MetadataOnlyTier`: a memory tier whose capacity is accounted exactly (fixed-size
  slots, a free list) but whose bytes are NOT stored. Writes are discarded and reads
  fail with DataLoss, so such a block can be looked up but never served. It lets the
  index, the policies and the accounting hold as many blocks as a 2 TB tier would,
  on a machine that could not hold the bytes.
* an in-process filler driven by commands on stdin. It fills the index through the
  production put path: `Store.begin_put` -> `PutTxn.reserve` (slot allocation, inline
  eviction when the tier is full) -> `mark_written` -> `commit(checksums)` (index
  insert, policy insert, namespace accounting), which is the path of a co-located
  client's put, without the gRPC round trip per call.

Everything else is the production daemon: `kvstore.server.daemon.Daemon` serving gRPC on a Unix
socket, with its host tier, policies, lease sweeper and event bus.

Protocol (one JSON object per line on stdout):
  start:  {"ready": true, "pid": ..., "socket": ...}
  `fill FIRST COUNT CHAIN` -> fills blocks FIRST..FIRST+COUNT-1 in chains of CHAIN blocks
        (each chain one put) and answers {"filled", "seconds", "put_cpu_us_per_block"
        (each put's CPU time per block), "fill_cpu_us_per_block", "evictions",
        "evict_seconds", "evict_cpu_seconds"}
  `lookups NBLOCKS CHAIN COUNT` -> times COUNT `Store.lookup` calls of existing chains
        in the daemon process (the server's share of a Lookup, without gRPC), then as
        many of chains of blocks drawn at random (see `time_lookups`)
  `gc` -> times one full collection of the cyclic GC in the daemon
  `quit` -> stops the daemon gracefully.
Block i's hash is `block_hash(i)`, so the driver can look up chains that exist.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import sys
import time
from typing import Any

from kvstore.core.policies import make_policy
from kvstore.core.store import StoreTier
from kvstore.core.tier import Slot, Tier
from kvstore.errors import DataLoss
from kvstore.layout import KVLayout
from kvstore.server.config import load_config
from kvstore.server.daemon import Daemon

TIER_NAME = "memory"  # reported as TIER_MEMORY over the wire


def bench_layout(block_bytes: int) -> KVLayout:
    return KVLayout(model="kvstore-scale-bench", dtype="float16", num_layers=1, num_kv_heads=1,
                    head_dim=8, block_size_tokens=16, block_bytes=block_bytes)


def block_hash(i: int) -> bytes:
    """Synthetic 16-byte block hash of block number `i` (uniform, like real chained hashes)."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


class MetadataOnlyTier(Tier):
    """BENCHMARK INSTRUMENT: exact capacity accounting in fixed-size slots, no bytes stored."""

    has_host_view = False

    def __init__(self, capacity_blocks: int, block_bytes: int) -> None:
        super().__init__(capacity_blocks * block_bytes)
        self.name = TIER_NAME
        self.block_bytes = block_bytes
        self._next = 0  # slots below this index have been handed out at least once
        self._free_slots: list[int] = []

    def accounted_size(self, nbytes: int) -> int:
        return self.block_bytes

    def has_room(self, nbytes: int) -> bool:
        return nbytes <= self.block_bytes and (bool(self._free_slots) or
                                               (self._next + 1) * self.block_bytes <= self.capacity_bytes)

    def _allocate(self, nbytes: int) -> Slot | None:
        if nbytes > self.block_bytes:
            return None
        if self._free_slots:
            index = self._free_slots.pop()
        elif (self._next + 1) * self.block_bytes <= self.capacity_bytes:
            index = self._next
            self._next += 1
        else:
            return None
        return Slot(self.name, index * self.block_bytes, self.block_bytes)

    def allocate_many(self, nbytes: int, count: int, space: int = 0) -> list[Slot]:
        """As `allocate` gives them one by one, in one step (as the production slab tier
        does): freed slots first, newest first, then fresh ones."""
        if nbytes > self.block_bytes or count <= 0:
            return []
        free = self._free_slots
        k = min(count, len(free))
        picked = free[len(free) - k:][::-1]
        del free[len(free) - k:]
        fresh = min(count - k, self.capacity_bytes // self.block_bytes - self._next)
        picked += range(self._next, self._next + fresh)
        self._next += fresh
        size, name = self.block_bytes, self.name
        slots = [Slot(name, i * size, size) for i in picked]
        self._account_many(size, len(slots))
        return slots

    def _free(self, slot: Slot) -> None:
        self._free_slots.append(slot.offset // self.block_bytes)

    async def write(self, slot: Slot, offset: int, data: memoryview | bytes) -> None:
        if offset < 0 or offset + len(data) > slot.size:
            raise ValueError(f"write of {len(data)} bytes at {offset} overflows a {slot.size}-byte slot")

    async def read(self, slot: Slot, nbytes: int) -> bytes:
        raise DataLoss("the metadata-only benchmark tier stores no bytes")

    def describe(self) -> dict[str, str]:
        return {"backing": "none: benchmark instrument (capacity accounted, bytes not stored)"}


class BenchDaemon(Daemon):
    """The production daemon plus a MetadataOnlyTier below the host tier."""

    def __init__(self, config: Any, capacity_blocks: int, block_bytes: int, policy: str) -> None:
        super().__init__(config)
        self._meta = (capacity_blocks, block_bytes, policy)

    def _build_tiers(self, host_capacity: int, shm_dir: str) -> Any:
        tiers, absent = super()._build_tiers(host_capacity, shm_dir)
        capacity_blocks, block_bytes, policy = self._meta
        meta = StoreTier(MetadataOnlyTier(capacity_blocks, block_bytes), make_policy(policy))
        host_at = next(i for i, t in enumerate(tiers) if t.name == "host")
        tiers.insert(host_at + 1, meta)
        return tiers, absent


def emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


async def fill(daemon: BenchDaemon, ns: bytes, first: int, count: int, chain: int, timer: dict[str, float]) -> dict[str, Any]:
    """Put blocks first..first+count-1, one put per `chain` blocks. Each put is timed (CPU)
    from `begin_put` through `commit` and the policy inserts it defers, so the driver's
    own work (making the hashes) is not counted."""
    store = daemon.store
    assert store is not None
    t0 = time.perf_counter()
    evict0, evict_s0, evict_c0 = timer["n"], timer["s"], timer["cpu"]
    per_put: list[float] = []  # CPU us per block of each put
    cpu_total = 0.0
    i = first
    end = first + count
    while i < end:
        n = min(chain, end - i)
        hashes = [block_hash(j) for j in range(i, i + n)]
        # Distinct 64-bit checksums, as real blocks have (their ints cost memory too).
        sums = [int.from_bytes(h[:8], "little") for h in hashes]
        c = time.process_time()
        txn = store.begin_put(ns, hashes, None, tier=TIER_NAME)
        await txn.reserve()
        txn.mark_written()
        await txn.commit(sums)
        for st in store.tiers:
            st.apply_deferred()  # the policy inserts the put left for after its answer
        spent = time.process_time() - c
        cpu_total += spent
        per_put.append(spent / n * 1e6)
        i += n
        await asyncio.sleep(0)  # let the loop run its other work between puts, as it would
    return {
        "filled": count,
        "seconds": time.perf_counter() - t0,
        "put_cpu_us_per_block": per_put,
        "fill_cpu_us_per_block": cpu_total / count * 1e6,
        "evictions": int(timer["n"] - evict0),
        "evict_seconds": timer["s"] - evict_s0,
        "evict_cpu_seconds": timer["cpu"] - evict_c0,
    }


def time_lookups(daemon: BenchDaemon, ns: bytes, n_blocks: int, chain: int, count: int) -> dict[str, Any]:
    """`Store.lookup` of existing chains in the daemon process: the server's own share of a
    Lookup, without gRPC (wall and CPU time, per call). The policy touches a lookup leaves
    for after its reply (`StoreTier.defer_touch`) are applied inside each timing: this
    is all the work a Lookup costs the daemon.

    Two kinds of chains: the chains as they were put (each in one call, so in consecutive
    rows, which the probe reads in order), and "scattered" ones of as many blocks drawn
    at random from the whole table (the layout of blocks put one by one, interleaved with
    other chains: each key then costs a probe of the key table)."""
    import random

    store = daemon.store
    assert store is not None
    rng = random.Random(11)
    out: dict[str, Any] = {}
    for name in ("store_lookup", "store_lookup_scattered"):
        wall, cpu = [], []
        for _ in range(count):
            if name == "store_lookup":
                c = rng.randrange(n_blocks // chain)
                blocks = range(c * chain, (c + 1) * chain)
            else:
                blocks = [rng.randrange(n_blocks) for _ in range(chain)]
            # Packed, as the servicer hands a Lookup's chain to the store.
            packed = b"".join([block_hash(j) for j in blocks])
            t, p = time.perf_counter(), time.process_time()
            r = store.lookup(ns, packed)
            for st in store.tiers:
                st.apply_deferred()
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - p)
            assert r.num_blocks == chain
        wall.sort()
        cpu.sort()
        out.update({f"{name}_p50_us": wall[len(wall) // 2] * 1e6, f"{name}_p99_us": wall[int(len(wall) * 0.99)] * 1e6,
                    f"{name}_cpu_p50_us": cpu[len(cpu) // 2] * 1e6})
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--capacity-blocks", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, default=1 << 20)
    ap.add_argument("--policy", default="hint-arc")
    args = ap.parse_args()
    config = load_config({"listen": f"unix:{args.socket}", "host_capacity": "64MiB", "grace_s": "1",
                          "metrics_listen": "off", "policy": args.policy}, env={})
    daemon = BenchDaemon(config, args.capacity_blocks, args.block_bytes, args.policy)
    await daemon.start()
    store = daemon.store
    assert store is not None
    ns = store.register(bench_layout(args.block_bytes))
    # Time every eviction made to find room (the production `Placement.evict_some`,
    # unchanged: a batch of victims where it can, else one `evict_one` step), counting the
    # evictions.
    timer = {"n": 0.0, "s": 0.0, "cpu": 0.0}
    evict_some = store.moves.evict_some
    meta_tier = next(st for st in store.tiers if st.name == TIER_NAME)

    async def timed_evict_some(st: Any, nbytes: int, count: int) -> None:
        t, c = time.perf_counter(), time.process_time()
        before = meta_tier.counters.evictions
        await evict_some(st, nbytes, count)
        timer["s"] += time.perf_counter() - t
        timer["cpu"] += time.process_time() - c
        timer["n"] += meta_tier.counters.evictions - before

    store.moves.evict_some = timed_evict_some  # type: ignore[method-assign]
    emit({"ready": True, "pid": os.getpid(), "socket": args.socket})
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "fill":
            first, count, chain = map(int, words[1:4])
            emit(await fill(daemon, ns, first, count, chain, timer))
        elif words[0] == "gc":
            # What a full collection of the cyclic GC costs now: the stall the event loop
            # would see (after the daemon's periodic sweep has had a chance to run).
            await asyncio.sleep(1.5)
            t, c = time.perf_counter(), time.process_time()
            gc.collect()
            emit({"gc_full_ms": (time.perf_counter() - t) * 1e3, "gc_full_cpu_ms": (time.process_time() - c) * 1e3,
                  "gc_frozen_objects": gc.get_freeze_count(), "gc_tracked_objects": len(gc.get_objects())})
        elif words[0] == "lookups":
            n_blocks, chain, count = map(int, words[1:4])
            emit(time_lookups(daemon, ns, n_blocks, chain, count))
        else:
            emit({"error": f"unknown command {words[0]!r}"})
    await daemon.stop()
    emit({"stopped": True})


if __name__ == "__main__":
    asyncio.run(main())
