"""Puts made of several runs of one chain (what a cluster pull stores in one step): each
run's first block gets the parent named for it, blocks already held are held and not
stored again, a put cut short keeps its first blocks only and frees the rest, and the
rows a put stored can be marked replicas without a lookup per block."""

from __future__ import annotations

import os

import pytest

from kvstore.core.index import make_key
from kvstore.core.policies import LRUPolicy
from kvstore.core.store import Store, StoreTier
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout
from kvstore.tiers.memory import MemoryTier
from tests.fakes import ManualClock

LAYOUT = KVLayout(model="unit", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)
BLOCK = LAYOUT.bytes_per_block
NS = LAYOUT.namespace_id


def store_of(blocks: int) -> Store:
    return Store([StoreTier(MemoryTier(blocks * BLOCK), LRUPolicy())], clock=ManualClock(1.0))


def chain(n: int, start: int = 0) -> list[bytes]:
    return block_hashes(NS, list(range(start, start + n * 4)), 4)


async def put(store: Store, hashes: list[bytes], parent: bytes | None = None) -> None:
    store.register(LAYOUT)
    async with store.begin_put(NS, hashes, parent) as txn:
        for i in range(len(hashes)):
            await txn.write(i, os.urandom(BLOCK))
        await txn.commit()


def parent_of(store: Store, h: bytes) -> bytes | None:
    entry = store.index.get(make_key(NS, h))
    assert entry is not None
    return entry.parent


async def test_runs_of_a_chain_are_one_put_with_each_run_parented_in_the_chain() -> None:
    store = store_of(32)
    hashes = chain(12)
    await put(store, hashes[3:5], hashes[2])  # the gaps, held already
    await put(store, hashes[8:10], hashes[7])
    runs = [hashes[0:3], hashes[5:8], hashes[10:12]]
    laid = [h for run in runs for h in run]
    async with store.begin_put(NS, laid, None, runs=[(3, hashes[4]), (6, hashes[9])]) as txn:
        for i in range(len(laid)):
            await txn.write(i, os.urandom(BLOCK))
        result = await txn.commit()
    assert result.stored == 8 and result.existing == 0
    assert store.lookup(NS, hashes).num_blocks == 12
    assert parent_of(store, hashes[0]) is None
    for i in range(1, 12):
        assert parent_of(store, hashes[i]) == make_key(NS, hashes[i - 1]), i


async def test_a_run_may_start_a_chain_and_held_blocks_are_not_stored_again() -> None:
    store = store_of(32)
    first, other = chain(3), chain(3, 1000)
    await put(store, first[:1])
    laid = first + other
    async with store.begin_put(NS, laid, None, runs=[(3, None)]) as txn:
        assert txn.slots()[0] is None  # held already
        for i in range(len(laid)):
            await txn.write(i, os.urandom(BLOCK))
        result = await txn.commit()
    assert (result.stored, result.existing) == (5, 1)
    assert parent_of(store, other[0]) is None and parent_of(store, first[1]) == make_key(NS, first[0])
    assert store.lookup(NS, other).num_blocks == 3


async def test_a_put_shortened_before_its_commit_keeps_its_first_blocks_and_frees_the_rest() -> None:
    store = store_of(16)
    hashes = chain(10)
    tier = store.tiers[0].tier
    store.register(LAYOUT)
    txn = store.begin_put(NS, hashes[:4] + hashes[6:10], None, runs=[(4, hashes[5])])
    await txn.reserve()
    assert tier.blocks == 8
    txn.shorten(5)  # the first run and one block of the second landed
    assert tier.blocks == 5
    txn.mark_written()
    result = await txn.commit([0] * 5)
    assert (result.stored, result.existing) == (5, 0) and result.block_hashes == hashes[:4] + hashes[6:7]
    assert store.block(NS, hashes[6]) is not None and store.block(NS, hashes[7]) is None
    assert tier.blocks == 5
    with pytest.raises(FailedPrecondition):
        txn.shorten(2)  # committed


async def test_bad_runs_and_bad_shortening_are_refused() -> None:
    store = store_of(16)
    store.register(LAYOUT)
    hashes = chain(6)
    for runs in ([(0, None)], [(3, None), (2, None)], [(6, None)], [(2, b"short")]):
        with pytest.raises(InvalidArgument):
            store.begin_put(NS, hashes, None, runs=runs)
    txn = store.begin_put(NS, hashes)
    await txn.reserve()
    for n in (0, 7):
        with pytest.raises(InvalidArgument):
            txn.shorten(n)
    txn.abort()
    assert store.tiers[0].tier.blocks == 0


async def test_stored_rows_marked_replicas_are_the_first_victims() -> None:
    store = store_of(8)
    owned, copies = chain(3), chain(3, 1000)
    await put(store, owned)
    store.register(LAYOUT)
    async with store.begin_put(NS, copies) as txn:
        for i in range(3):
            await txn.write(i, os.urandom(BLOCK))
        await txn.commit()
        positions, rows = txn.stored_rows()
    assert positions == [0, 1, 2]
    assert store.mark_replica_rows(rows) == 3
    store.lookup(NS, copies)  # the owned blocks are the least recently used, yet the replicas go first
    await put(store, chain(4, 2000))
    assert sum(store.block(NS, h) is not None for h in owned) == 3
    assert sum(store.block(NS, h) is not None for h in copies) == 1
