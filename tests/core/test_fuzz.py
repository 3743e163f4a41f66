"""Property tests: random sequences of put / lookup / fetch / delete / pin / unpin, valid
and invalid, against a reference model, first on an in-process Store (fast, many
examples), then on a real daemon through the SDK over both data planes (fewer).

The model is what the API promises: a block's bytes never change while it is held; a
lookup finds the longest present prefix; a fetch returns exactly the bytes put; a put
reports which blocks were new; a pinned block is never evicted (only deleted); a lease
ends when released, when its fetch ends, or once its deadline has passed; an invalid
request fails with its error and changes nothing. The tier is small so puts evict: the
model learns of evictions by asking after each put, and checks they hit no pinned block.

Budget: `make test` runs a small number of examples; `make fuzz` runs FUZZ_EXAMPLES
(default 1000) for the store and a tenth of that for the daemon, and prints the counts.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import daemon_in_thread, make_config
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.core.policies import LRUPolicy
from kvstore.core.store import Store, StoreLimits, StoreTier
from kvstore.errors import InvalidArgument, NotFound, ResourceExhausted
from kvstore.hashing import HASH_BYTES, block_hashes
from kvstore.layout import KVLayout
from kvstore.tiers.host import HostTier
from tests.fakes import ManualClock

LAYOUT = KVLayout(model="fuzz", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)
BLOCK = LAYOUT.bytes_per_block  # 1 KiB
NS = LAYOUT.namespace_id
CHAINS, PER = 3, 6
CAPACITY_BLOCKS = 5  # well under the 18 blocks of the key space: puts evict
MAX_PER_CALL = 12

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))  # 0: the small budget of `make test`
STORE_EXAMPLES = FUZZ_EXAMPLES or 60
DAEMON_EXAMPLES = max(FUZZ_EXAMPLES // 10, 8)
# No deadline: a slow step on a shared machine is not a failure.
FUZZ_SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                         print_blob=True)


def chain_hashes(layout: KVLayout, c: int) -> list[bytes]:
    return block_hashes(layout.namespace_id, chain_tokens(layout, c), layout.block_size_tokens)


def chain_tokens(layout: KVLayout, c: int) -> list[int]:
    return [c * 1000 + i for i in range(PER * layout.block_size_tokens)]


def payload(c: int, i: int, variant: int) -> bytes:
    """Distinct bytes per block and per variant: a re-put of a held block sends other bytes."""
    head = bytes([c, i, variant % 256]) * 8
    return (head * (BLOCK // len(head) + 1))[:BLOCK]


chain_ids = st.integers(0, CHAINS - 1)
starts = st.integers(0, PER - 1)
variants = st.integers(0, 3)
bad_hash = st.binary(min_size=0, max_size=40).filter(lambda b: len(b) != HASH_BYTES)


class Model:
    """What the API promises, with the evictions the store reports after each put."""

    def __init__(self, hashes: list[list[bytes]]) -> None:
        self.hashes = hashes
        self.content: dict[bytes, bytes] = {}  # block hash -> bytes, for held blocks
        self.generation: dict[bytes, int] = {}  # bumped each time a block is (re)created
        self.leases: dict[str, tuple[float, list[tuple[bytes, int]]]] = {}  # id -> (deadline s, blocks)

    def prefix(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.content:
                break
            n += 1
        return n

    def store(self, h: bytes, data: bytes) -> None:
        self.content[h] = data
        self.generation[h] = self.generation.get(h, 0) + 1

    def take_lease(self, lease_id: str, deadline: float, hashes: list[bytes]) -> None:
        assert lease_id and lease_id not in self.leases
        self.leases[lease_id] = (deadline, [(h, self.generation[h]) for h in hashes])

    def expire(self, now: float) -> None:
        for lease_id in [k for k, (d, _) in self.leases.items() if d <= now]:
            del self.leases[lease_id]

    def pinned(self) -> set[bytes]:
        return {h for _, blocks in self.leases.values() for h, g in blocks
                if h in self.content and self.generation[h] == g}


# ----------------------------------------------------------------------------- in-process store


class StoreMachine(RuleBasedStateMachine):
    examples = 0
    steps = 0
    evicted = 0  # blocks puts evicted (the model followed)
    exhausted = 0  # puts refused with RESOURCE_EXHAUSTED (all the tier pinned or held)

    def __init__(self) -> None:
        super().__init__()
        StoreMachine.examples += 1
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock(1000.0)
        self.store = Store([StoreTier(HostTier(CAPACITY_BLOCKS * BLOCK), LRUPolicy())],
                           limits=StoreLimits(max_blocks_per_call=MAX_PER_CALL), clock=self.clock)
        assert self.store.register(LAYOUT) == NS
        self.model = Model([chain_hashes(LAYOUT, c) for c in range(CHAINS)])

    def teardown(self) -> None:
        # A failing step's traceback may still hold views of the segment: drop them first.
        gc.collect()
        self.store.close()
        self.loop.close()

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def held(self, h: bytes) -> bool:
        return self.store.block(NS, h) is not None

    def step(self) -> None:
        StoreMachine.steps += 1
        self.model.expire(self.clock.now)  # every verb but unpin sweeps expired leases first

    async def _put(self, hashes: list[bytes], datas: list[bytes], parent: bytes | None, ns: bytes = NS):
        async with self.store.begin_put(ns, hashes, parent) as txn:
            for i, d in enumerate(datas):
                half = len(d) // 2
                await txn.write(i, d[:half])
                await txn.write(i, d[half:])
            return await txn.commit()

    async def _fetch(self, hashes: list[bytes], lease_id: str = "", ns: bytes = NS) -> list[bytes]:
        async with self.store.open_fetch(ns, hashes, lease_id) as stream:
            return [b async for b in stream]

    def sync_evictions(self, protected: set[bytes]) -> None:
        """Blocks the last put evicted: never a pinned one, never one the put itself named."""
        gone = [h for h in self.model.content if not self.held(h)]
        assert not set(gone) & protected, "a pinned block, or one held by a put, was evicted"
        StoreMachine.evicted += len(gone)
        for h in gone:
            del self.model.content[h]

    # ------------------------------------------------------------------ valid verbs

    @rule(c=chain_ids, start=starts, n=st.integers(1, PER), variant=variants)
    def put(self, c: int, start: int, n: int, variant: int) -> None:
        self.step()
        hashes = self.model.hashes[c][start : start + n]
        datas = [payload(c, start + i, variant) for i in range(len(hashes))]
        parent = self.model.hashes[c][start - 1] if start else None
        present = [h for h in hashes if h in self.model.content]
        pinned = self.model.pinned()
        try:
            result = self.run(self._put(hashes, datas, parent))
        except ResourceExhausted:
            StoreMachine.exhausted += 1
            # Only when the blocks that may not move plus the new ones exceed the tier.
            assert len(pinned | set(present)) + len(hashes) - len(present) > CAPACITY_BLOCKS
            assert not any(self.held(h) for h in hashes if h not in self.model.content)
            self.sync_evictions(pinned | set(present))
            return
        assert (result.stored, result.existing) == (len(hashes) - len(present), len(present))
        for h, d in zip(hashes, datas):
            if h not in self.model.content:
                self.model.store(h, d)
        self.sync_evictions(pinned | set(hashes))

    @rule(c=chain_ids, variant=variants)
    def put_whole_chain(self, c: int, variant: int) -> None:
        self.put(c, 0, PER, variant)

    @rule(c=chain_ids, start=starts, lease_ms=st.sampled_from([0, 0, 50, 5000]))
    def lookup(self, c: int, start: int, lease_ms: int) -> None:
        self.step()
        hashes = self.model.hashes[c][start:]
        r = self.store.lookup(NS, hashes, lease_ms)
        n = self.model.prefix(hashes)
        assert r.num_blocks == n and r.tiers == ["host"] * n and r.block_hashes == hashes[:n]
        assert bool(r.lease_id) == (n > 0 and lease_ms > 0)
        if r.lease_id:
            self.model.take_lease(r.lease_id, self.clock.now + lease_ms / 1000, hashes[:n])

    @rule(c=chain_ids, start=starts, with_lease=st.booleans())
    def fetch(self, c: int, start: int, with_lease: bool) -> None:
        self.step()
        hashes = self.model.hashes[c][start:]
        lease_id = ""
        if with_lease:
            lease_id = self.store.lookup(NS, hashes, 5000).lease_id
        got = self.run(self._fetch(hashes, lease_id))
        assert got == [self.model.content[h] for h in hashes[: self.model.prefix(hashes)]]
        # The lease of a lookup ends with its fetch: nothing to add to the model.

    @rule(c=chain_ids, picks=st.lists(st.integers(0, PER - 1), min_size=1, max_size=PER))
    def delete(self, c: int, picks: list[int]) -> None:
        self.step()
        hashes = [self.model.hashes[c][i] for i in picks]
        want = len({h for h in hashes if h in self.model.content})
        assert self.store.delete(NS, hashes) == want
        for h in hashes:
            self.model.content.pop(h, None)

    @rule(c=chain_ids, picks=st.lists(st.integers(0, PER - 1), min_size=1, max_size=PER, unique=True),
          ttl_ms=st.integers(1, 4000))
    def pin(self, c: int, picks: list[int], ttl_ms: int) -> None:
        self.step()
        hashes = [self.model.hashes[c][i] for i in picks]
        held = [h for h in hashes if h in self.model.content]
        r = self.store.pin(NS, hashes, ttl_ms)
        assert r.pinned == len(held) and bool(r.lease_id) == bool(held)
        if r.lease_id:
            assert r.expires_in_ms == ttl_ms
            self.model.take_lease(r.lease_id, self.clock.now + ttl_ms / 1000, held)

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        StoreMachine.steps += 1  # unpin does not sweep: a lease past its deadline is still there to release
        known = list(self.model.leases)  # in the order taken: lease ids are random, so never sort by them
        use_known: bool = bool(known) and data.draw(st.booleans())
        lease_id: str = data.draw(st.sampled_from(known)) if use_known else data.draw(st.text(max_size=8))
        assert self.store.unpin(lease_id) == (lease_id in self.model.leases)
        self.model.leases.pop(lease_id, None)

    @rule(ms=st.integers(1, 3000))
    def advance_clock(self, ms: int) -> None:
        self.clock.now += ms / 1000

    # ------------------------------------------------------------------ invalid requests

    @rule(c=chain_ids, i=starts, size=st.sampled_from([0, 1, BLOCK - 1, BLOCK + 1, 2 * BLOCK]))
    def put_wrong_size(self, c: int, i: int, size: int) -> None:
        self.step()
        h = self.model.hashes[c][i]
        pinned = self.model.pinned()
        was_held = h in self.model.content
        with pytest.raises((InvalidArgument, ResourceExhausted)) as err:
            self.run(self._put([h], [payload(c, i, 9)[:size] if size <= BLOCK else b"\x01" * size], None))
        if err.type is ResourceExhausted:
            assert len(pinned) + (0 if was_held else 1) > CAPACITY_BLOCKS
        if was_held:
            assert self.run(self._fetch([h])) == [self.model.content[h]]
        self.sync_evictions(pinned | ({h} if was_held else set()))

    @rule(c=chain_ids, i=starts, verb=st.sampled_from(["lookup", "fetch", "delete", "pin", "put"]), bad=bad_hash,
          where=st.integers(0, 2))
    def bad_hash_length(self, c: int, i: int, verb: str, bad: bytes, where: int) -> None:
        self.step()
        hashes = self.model.hashes[c][i : i + 2]
        hashes.insert(min(where, len(hashes)), bad)
        with pytest.raises(InvalidArgument, match=f"{HASH_BYTES} bytes"):
            self.call(verb, NS, hashes)

    @rule(c=chain_ids, verb=st.sampled_from(["lookup", "fetch", "delete", "pin", "put"]),
          ns=st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES))
    def unknown_namespace(self, c: int, verb: str, ns: bytes) -> None:
        self.step()
        if ns == NS:
            return
        with pytest.raises(NotFound):
            self.call(verb, ns, self.model.hashes[c][:2])

    @rule(verb=st.sampled_from(["fetch", "delete", "pin", "lookup"]), c=chain_ids)
    def too_many_blocks(self, verb: str, c: int) -> None:
        self.step()
        with pytest.raises(InvalidArgument, match="limit"):
            self.call(verb, NS, (self.model.hashes[c] * 3)[: MAX_PER_CALL + 1])

    @rule(c=chain_ids, i=starts, variant=variants)
    def put_duplicate_hashes(self, c: int, i: int, variant: int) -> None:
        self.step()
        h = self.model.hashes[c][i]
        with pytest.raises(InvalidArgument, match="only once"):
            self.run(self._put([h, h], [payload(c, i, variant)] * 2, None))
        self.sync_evictions(self.model.pinned())

    @rule()
    def empty_requests(self) -> None:
        self.step()
        with pytest.raises(InvalidArgument, match="at least one block"):
            self.run(self._put([], [], None))
        assert self.store.lookup(NS, []).num_blocks == 0
        assert self.run(self._fetch([])) == []
        assert self.store.delete(NS, []) == 0
        assert self.store.pin(NS, []).pinned == 0

    def call(self, verb: str, ns: bytes, hashes: list[bytes]) -> object:
        if verb == "lookup":
            return self.store.lookup(ns, hashes)
        if verb == "fetch":
            return self.run(self._fetch(hashes, ns=ns))
        if verb == "delete":
            return self.store.delete(ns, hashes)
        if verb == "pin":
            return self.store.pin(ns, hashes, 1000)
        return self.run(self._put(hashes, [b"\0" * BLOCK] * len(hashes), None, ns=ns))

    # ------------------------------------------------------------------ always

    @invariant()
    def matches_the_model(self) -> None:
        held = [h for hs in self.model.hashes for h in hs if self.held(h)]
        assert set(held) == set(self.model.content)
        # Sweep as the daemon does every second: then exactly the model's leases are left.
        self.store.expire_leases()
        self.model.expire(self.clock.now)
        status = self.store.stats()
        assert status.leases_active == len(self.model.leases)
        (tier,) = status.tiers
        assert tier.blocks == len(held) and tier.used_bytes == len(held) * BLOCK <= tier.capacity_bytes
        assert self.store.namespace(NS).blocks == len(held)
        assert status.counters.checksum_failures == 0


def test_store_against_the_model() -> None:
    StoreMachine.examples = StoreMachine.steps = StoreMachine.evicted = StoreMachine.exhausted = 0
    run_state_machine_as_test(StoreMachine, settings=settings(FUZZ_SETTINGS, max_examples=STORE_EXAMPLES,
                                                              stateful_step_count=40))
    print(f"\nfuzz: store model: {StoreMachine.examples} examples, {StoreMachine.steps} steps, "
          f"{StoreMachine.evicted} evictions followed, {StoreMachine.exhausted} puts refused as exhausted")
    assert StoreMachine.examples >= STORE_EXAMPLES


# ----------------------------------------------------------------------------- the daemon, through the SDK


class DaemonMachine(RuleBasedStateMachine):
    """The SDK against a running daemon: each example gets a namespace of its own (the
    model name differs), and the host tier is big enough that nothing is evicted."""

    target = ""
    examples = 0
    steps = 0

    def __init__(self) -> None:
        super().__init__()
        DaemonMachine.examples += 1
        self.layout = replace(LAYOUT, model=f"fuzz-{DaemonMachine.examples}")
        self.clients = {plane: Client(self.target, data_plane=plane) for plane in ("grpc", "local")}
        self.model = Model([chain_hashes(self.layout, c) for c in range(CHAINS)])
        self.tokens = [chain_tokens(self.layout, c) for c in range(CHAINS)]

    def teardown(self) -> None:
        for kv in self.clients.values():
            kv.close()

    def kv(self, plane: str) -> Client:
        DaemonMachine.steps += 1
        return self.clients[plane]

    planes = st.sampled_from(["grpc", "local"])

    @rule(plane=planes, c=chain_ids, start=starts, n=st.integers(1, PER), variant=variants)
    def put(self, plane: str, c: int, start: int, n: int, variant: int) -> None:
        n = min(n, PER - start)
        datas = [payload(c, start + i, variant) for i in range(n)]
        present = sum(1 for h in self.model.hashes[c][start : start + n] if h in self.model.content)
        r = self.kv(plane).put(self.layout, self.tokens[c][: (start + n) * 4], datas, first_block=start)
        assert (r.stored, r.existing) == (n - present, present)
        for i, d in enumerate(datas):
            h = self.model.hashes[c][start + i]
            if h not in self.model.content:
                self.model.store(h, d)

    @rule(plane=planes, c=chain_ids, cut=st.integers(0, PER))
    def lookup_and_fetch(self, plane: str, c: int, cut: int) -> None:
        tokens = self.tokens[c][: cut * 4]
        n = self.model.prefix(self.model.hashes[c][:cut])
        kv = self.kv(plane)
        hit = kv.lookup(self.layout, tokens, lease_ms=2000)
        assert hit.num_blocks == n
        got = kv.fetch(self.layout, tokens, lease_id=hit.lease_id)
        assert [bytes(b) for b in got] == [self.model.content[h] for h in self.model.hashes[c][:n]]

    @rule(plane=planes, c=chain_ids, picks=st.lists(st.integers(0, PER - 1), min_size=1, max_size=3, unique=True))
    def delete(self, plane: str, c: int, picks: list[int]) -> None:
        hashes = [self.model.hashes[c][i] for i in picks]
        assert self.kv(plane).delete(self.layout, block_hashes=hashes) == sum(h in self.model.content for h in hashes)
        for h in hashes:
            self.model.content.pop(h, None)

    @rule(plane=planes, c=chain_ids)
    def pin_unpin(self, plane: str, c: int) -> None:
        kv = self.kv(plane)
        p = kv.pin(self.layout, block_hashes=self.model.hashes[c], ttl_ms=5000)
        assert p.pinned == sum(h in self.model.content for h in self.model.hashes[c])
        if p.lease_id:
            assert kv.unpin(p.lease_id) is True
            assert kv.unpin(p.lease_id) is False

    @rule(plane=planes, c=chain_ids, i=starts, size=st.sampled_from([1, BLOCK - 1, BLOCK + 1]))
    def wrong_block_size(self, plane: str, c: int, i: int, size: int) -> None:
        with pytest.raises(InvalidArgument):
            self.kv(plane).put(self.layout, self.tokens[c][: (i + 1) * 4], [b"\x07" * size], first_block=i)

    @rule(plane=planes, bad=bad_hash, verb=st.sampled_from(["lookup", "fetch", "delete", "pin"]))
    def bad_hash_length(self, plane: str, bad: bytes, verb: str) -> None:
        kv = self.kv(plane)
        hashes = [self.model.hashes[0][0], bad]
        with pytest.raises(InvalidArgument):
            getattr(kv, verb)(self.layout, block_hashes=hashes)

    @rule(plane=planes, c=chain_ids)
    def duplicate_hashes_in_a_put(self, plane: str, c: int) -> None:
        h = self.model.hashes[c][0]
        with pytest.raises(InvalidArgument):
            self.kv(plane).put(self.layout, None, [payload(c, 0, 5)] * 2, block_hashes=[h, h])

    @rule(plane=planes)
    def empty_batches(self, plane: str) -> None:
        kv = self.kv(plane)
        with pytest.raises(InvalidArgument):
            kv.put(self.layout, [], [])
        assert kv.lookup(self.layout, []).num_blocks == 0
        assert kv.fetch(self.layout, []) == []
        assert kv.delete(self.layout, []) == 0
        assert kv.pin(self.layout, []).pinned == 0

    @rule(ns=st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES))
    def unknown_namespace(self, ns: bytes) -> None:
        DaemonMachine.steps += 1
        if ns == self.layout.namespace_id:
            return
        with AdminClient(self.target) as admin, pytest.raises(NotFound):
            admin.fetch_blocks(ns, [self.model.hashes[0][0]])

    @invariant()
    def matches_the_model(self) -> None:
        kv = self.clients["grpc"]
        for c in range(CHAINS):
            assert kv.lookup(self.layout, self.tokens[c]).num_blocks == self.model.prefix(self.model.hashes[c])


@pytest.fixture
def fuzz_daemon(tmp_path: Path) -> Iterator[str]:
    with daemon_in_thread(make_config(tmp_path, host_capacity=64 << 20)) as running:
        yield running.unix_target


def test_daemon_through_the_sdk_against_the_model(fuzz_daemon: str) -> None:
    DaemonMachine.target = fuzz_daemon
    DaemonMachine.examples = DaemonMachine.steps = 0
    run_state_machine_as_test(DaemonMachine, settings=settings(FUZZ_SETTINGS, max_examples=DAEMON_EXAMPLES,
                                                               stateful_step_count=20))
    print(f"\nfuzz: daemon through the SDK: {DaemonMachine.examples} examples, {DaemonMachine.steps} calls")
    assert DaemonMachine.examples >= DAEMON_EXAMPLES
    with Client(fuzz_daemon) as kv:
        assert kv.stats().counters.checksum_failures == 0
