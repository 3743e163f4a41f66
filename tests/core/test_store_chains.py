"""What a pool reads of a chain from the blocks a store holds (`Store.ancestor`,
`Store.chain_position`): walks up the parents held, ending where one is missing."""

from __future__ import annotations

import os

from kvstore.core.policies import LRUPolicy
from kvstore.core.store import Store, StoreTier
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout
from kvstore.tiers.memory import MemoryTier
from tests.fakes import ManualClock

LAYOUT = KVLayout(model="unit", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)
BLOCK = LAYOUT.bytes_per_block


async def put(store: Store, hashes: list[bytes], parent: bytes | None = None) -> None:
    ns = store.register(LAYOUT)
    async with store.begin_put(ns, hashes, parent) as txn:
        for i in range(len(hashes)):
            await txn.write(i, os.urandom(BLOCK))
        await txn.commit()


async def test_a_blocks_ancestors_and_position_come_from_the_parents_held() -> None:
    store = Store([StoreTier(MemoryTier(16 * BLOCK), LRUPolicy())], clock=ManualClock(1.0))
    hashes = block_hashes(LAYOUT.namespace_id, list(range(6 * 4)), 4)
    await put(store, hashes[:4])
    ns = LAYOUT.namespace_id
    assert [store.ancestor(ns, hashes[3], k) for k in range(4)] == [hashes[3], hashes[2], hashes[1], hashes[0]]
    assert store.ancestor(ns, hashes[3], 4) is None  # past the chain's start
    assert [store.chain_position(ns, h, 100) for h in hashes[:4]] == [0, 1, 2, 3]
    assert store.chain_position(ns, hashes[3], 3) == 3 and store.chain_position(ns, hashes[3], 2) is None
    # A run put after a gap: its parent is not held, so neither is its position.
    await put(store, hashes[5:], parent=hashes[4])
    assert store.chain_position(ns, hashes[5], 100) is None
    assert store.ancestor(ns, hashes[5], 1) == hashes[4] and store.ancestor(ns, hashes[5], 2) is None
    assert store.ancestor(ns, hashes[4], 0) == hashes[4]  # zero steps: itself, held or not
