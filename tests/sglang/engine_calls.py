"""The storage calls SGLang 0.5.23's hybrid cache controller makes for one backup and one
prefetch, in its order, so a test drives the backend as the engine would.

Backup (`HybridCacheController._page_backup_with_stable_layout`, then
`CacheController._page_backup`): one `batch_set_v2` per tail length of the pool transfers
(SGLang's own `_trailing_chain_groups`; one call when prefix keys are not passed, the
default), then `batch_set_v1` of the KV pages in batches of STORAGE_BATCH_SIZE.

Prefetch (`_storage_hit_query`, `CacheController._page_transfer_kv_batch`,
`HybridCacheController._page_transfer_sidecar`): `batch_exists_v2` of the whole chain;
per batch, `batch_get_v1` of the KV pages and `batch_get_v2` of the KV-derived pools at
the same indices, the batch's hit being the smallest of them; then one `batch_get_v2`
of the trailing pools with the last pages of the hit.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        STORAGE_BATCH_SIZE,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        count_pool_hits,
    )
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import _trailing_chain_groups


@dataclass
class Trailing:
    """A pool SGLang keeps only at the end of a prefix (SWA, Mamba state): its last `pages`."""

    name: PoolName
    pool: Any
    pages: int
    indices_from: PoolName | None = None  # reuses that pool's slots (DeepSeek-V4's states use SWA's)


@dataclass
class Loaded:
    kv_hit_pages: int
    restorable: list[int]
    loaded_pages: int
    kv_indices: torch.Tensor
    trailing: dict[str, tuple[list[bool], torch.Tensor]] = field(default_factory=dict)


@dataclass
class Stored:
    v2: dict[Any, list[bool]]  # batch_set_v2's answers, by pool
    v1_ok: bool  # every batch_set_v1 batch succeeded
    trailing: dict[str, torch.Tensor]  # where each trailing pool's stored pages were


def backup(backend: Any, keys: Sequence[str], kv_indices: torch.Tensor, page_size: int,
           kv_derived: Sequence[PoolName] = (), trailing: Sequence[Trailing] = ()) -> Stored:
    """Store one radix-tree node's pages (its trailing pools' last pages from fresh slots)."""
    keys = list(keys)
    transfers = [PoolTransfer(name=n, indices_from_pool=PoolName.KV, host_indices=kv_indices, keys=keys)
                 for n in kv_derived]
    slots: dict[Any, torch.Tensor] = {}
    for t in trailing:
        n = min(t.pages, len(keys))
        slots[t.name] = slots[t.indices_from] if t.indices_from else t.pool.alloc(n * t.pool.page_size)
        transfers.append(PoolTransfer(name=t.name, host_indices=slots[t.name], keys=keys[-n:],
                                      hit_policy=PoolHitPolicy.TRAILING_PAGES, indices_from_pool=t.indices_from))
    results: dict[Any, list[bool]] = {}
    if transfers:
        for extra_info, group in _trailing_chain_groups(None, keys, transfers):
            results.update(backend.batch_set_v2(group, extra_info=extra_info))
    ok = True
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i : i + STORAGE_BATCH_SIZE]
        ok = all(backend.batch_set_v1(batch, kv_indices[i * page_size : (i + len(batch)) * page_size],
                                      HiCacheStorageExtraInfo())) and ok
    where = {t.name.value: tr.host_indices for t, tr in zip(trailing, transfers[len(kv_derived):])}
    return Stored(results, ok, where)




def prefetch(backend: Any, keys: Sequence[str], kv_pool: Any, page_size: int, kv_derived: Sequence[PoolName] = (),
             trailing: Sequence[Trailing] = ()) -> Loaded:
    """Look the chain up and load its usable prefix into `kv_pool` (and the other pools)."""
    keys = list(keys)
    query = [PoolTransfer(name=n, indices_from_pool=PoolName.KV) for n in kv_derived]
    query += [PoolTransfer(name=t.name, keys=["__placeholder__"] * t.pages, hit_policy=PoolHitPolicy.TRAILING_PAGES)
              for t in trailing]
    found = backend.batch_exists_v2(keys, query, HiCacheStorageExtraInfo()) if query else None
    hit = found.kv_hit_pages if found is not None else backend.batch_exists(keys)
    restorable = list(found.restorable_prefix_pages or []) if found is not None else list(range(1, hit + 1))
    kv_indices = kv_pool.alloc(max(hit, 1) * page_size)[: hit * page_size]
    loaded = 0
    for i in range(0, hit, STORAGE_BATCH_SIZE):
        batch = keys[i : min(hit, i + STORAGE_BATCH_SIZE)]
        idx = kv_indices[i * page_size : (i + len(batch)) * page_size]
        got = backend.batch_get_v1(batch, idx, HiCacheStorageExtraInfo())
        kv = got.index(False) if False in got else len(got)
        side = backend.batch_get_v2([PoolTransfer(name=n, host_indices=idx, keys=batch) for n in kv_derived])
        loaded += min([kv, *count_pool_hits(side).values()])
        if loaded < i + len(batch):
            break
    out = Loaded(hit, restorable, loaded, kv_indices)
    if trailing and loaded == hit and hit:
        transfers = []
        slots: dict[Any, torch.Tensor] = {}
        for t in trailing:
            tail = keys[max(0, hit - t.pages) : hit]
            slots[t.name] = slots[t.indices_from] if t.indices_from else t.pool.alloc(len(tail) * t.pool.page_size)
            transfers.append(PoolTransfer(name=t.name, host_indices=slots[t.name], keys=tail,
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES, indices_from_pool=t.indices_from))
        got = backend.batch_get_v2(transfers)
        for t, tr in zip(trailing, transfers):
            out.trailing[t.name.value] = (got[t.name], tr.host_indices)
    return out
