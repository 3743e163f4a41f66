"""v2 (hybrid pools) through SGLang's real host pools: the KV pool with the pools that ride
on its pages (DSA's indexer, DeepSeek-V4's compressed KV, indexers and rope), trailing
pools (sliding-window KV, Mamba state), BLOCK_GROUPS, and the hit rules that combine them,
driven in the order SGLang's hybrid cache controller calls the backend (engine_calls.py)."""

from __future__ import annotations

import types

import torch
from conftest import (
    fill_random,
    logical_pool,
    make_backend,
    mamba_pool,
    mha_pool,
    mla_pool,
    page_keys,
    pages,
    storage_config,
    v4_pool,
    v4_state_pool,
)
from engine_calls import Trailing, backup, prefetch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.host_pool_decl import HostPoolDecl, HostPoolStorageInfo

from kvstore.client import Client
from tests.procs import DaemonProc

PS = 16


def dsa_indexer(anchor: object, layers: int = 2, bytes_per_token: int = 33) -> DSAIndexerPoolHost:
    """SGLang's DSA indexer host pool (DeepSeek-V3.2), next to an MLA anchor. The device
    pool it mirrors is described by the attributes the host pool reads."""
    device = types.SimpleNamespace(
        device="cpu", store_dtype=torch.uint8, start_layer=0, end_layer=layers, layer_num=layers,
        layer_shard_enabled=False,
        index_k_with_scale_buffer=[torch.zeros(40, PS * bytes_per_token, dtype=torch.uint8) for _ in range(layers)])
    decl = HostPoolDecl(pool_name=PoolName.INDEXER, device_pool=device, indices_from_pool=PoolName.KV,
                        layout_source=PoolName.KV,
                        storage_info=HostPoolStorageInfo(bytes_per_token_per_layer=bytes_per_token, dtype=torch.uint8),
                        host_pool_builder=None)
    return DSAIndexerPoolHost(decl, anchor, pin_memory=False, device="cpu")


def test_dsa_kv_and_indexer_are_one_namespace(daemon: DaemonProc) -> None:
    """DeepSeek-V3.2: MLA KV and the indexer pool travel as two groups of one namespace;
    engine B gets both byte for byte; deleting one page drops both of its parts."""
    a_kv, b_kv = mla_pool(), mla_pool()
    a_ix, b_ix = dsa_indexer(a_kv), dsa_indexer(b_kv)
    fill_random(a_kv, 1)
    fill_random(a_ix, 2)
    cfg = storage_config(target=daemon.target, model="test/dsa", mla=True)
    a = make_backend(cfg, a_kv, [("kv", a_kv), ("indexer", a_ix)])
    b = make_backend(cfg, b_kv, [("kv", b_kv), ("indexer", b_ix)])
    layout = a.namespaces()["kv"]
    assert [g.name for g in layout.groups] == ["kv", "indexer"] and "indexer" not in a.namespaces()

    keys = page_keys(5, seed=11)
    a_idx = a_kv.alloc(5 * PS)
    stored = backup(a, keys, a_idx, PS, kv_derived=[PoolName.INDEXER])
    assert stored.v2[PoolName.INDEXER] == [True] * 5 and stored.v1_ok
    got = prefetch(b, keys, b_kv, PS, kv_derived=[PoolName.INDEXER])
    assert (got.kv_hit_pages, got.loaded_pages, got.restorable) == (5, 5, [1, 2, 3, 4, 5])
    assert pages(b_kv, got.kv_indices, 5) == pages(a_kv, a_idx, 5)
    assert pages(b_ix, got.kv_indices, 5) == pages(a_ix, a_idx, 5)
    assert b.get_stats().pages_hit == 5  # one fetch served both pools

    # A page is its parts: deleting it (by its kvstore hash) takes both groups.
    with Client(daemon.target) as kv:
        assert kv.delete(layout, block_hashes=b._kv.hashes(keys[2:3])) == 1
    again = prefetch(b, keys, b_kv, PS, kv_derived=[PoolName.INDEXER])
    assert (again.kv_hit_pages, again.loaded_pages) == (2, 2)


def test_swa_needs_only_its_trailing_pages(daemon: DaemonProc) -> None:
    """Sliding-window hybrids (gpt-oss, Gemma): the SWA pool keeps the last pages of each
    node only; a prefix is usable where its window is whole, and only the window loads."""
    a_kv, b_kv = mha_pool(), mha_pool()
    a_swa, b_swa = mha_pool(label="swa"), mha_pool(label="swa")
    fill_random(a_kv, 3)
    fill_random(a_swa, 4)
    cfg = storage_config(target=daemon.target, model="test/swa")
    a = make_backend(cfg, a_kv, [("kv", a_kv), ("swa", a_swa)])
    b = make_backend(cfg, b_kv, [("kv", b_kv), ("swa", b_swa)])
    keys = page_keys(8, seed=12)
    a_idx = a_kv.alloc(8 * PS)
    window = [Trailing(PoolName.SWA, a_swa, 3)]
    # Two nodes: pages 0-4 (window 2-4), then pages 5-7 (window 5-7).
    first = backup(a, keys[:5], a_idx[: 5 * PS], PS, trailing=window)
    second = backup(a, keys[5:], a_idx[5 * PS :], PS, trailing=window)
    assert first.v2[PoolName.SWA] == [True] * 3 and second.v2[PoolName.SWA] == [True] * 3

    got = prefetch(b, keys, b_kv, PS, trailing=[Trailing(PoolName.SWA, b_swa, 3)])
    # The window of prefix p is pages [p-3, p): whole for p = 5 (2-4), 8 (5-7), and 6, 7 (3-6, 4-7).
    assert got.restorable == [5, 6, 7, 8] and got.kv_hit_pages == 8
    ok, swa_idx = got.trailing["swa"]
    assert ok == [True] * 3
    assert pages(b_swa, swa_idx, 3) == pages(a_swa, second.trailing["swa"], 3)
    assert pages(b_kv, got.kv_indices, 8) == pages(a_kv, a_idx, 8)

    # A prefix that ends inside a node whose window was never stored is not usable.
    other = page_keys(4, seed=13)
    c_idx = a_kv.alloc(4 * PS)
    backup(a, other, c_idx, PS)  # the KV pages only
    assert prefetch(b, other, b_kv, PS, trailing=[Trailing(PoolName.SWA, b_swa, 3)]).kv_hit_pages == 0


def test_mamba_state_at_the_prefix_end(daemon: DaemonProc) -> None:
    """Mamba hybrids: one state per node end; a prefix is usable only where a state is."""
    a_kv, b_kv = mha_pool(), mha_pool()
    a_m, b_m = mamba_pool(), mamba_pool()
    fill_random(a_kv, 5)
    fill_random(a_m, 6)
    cfg = storage_config(target=daemon.target, model="test/mamba")
    a = make_backend(cfg, a_kv, [("kv", a_kv), ("mamba", a_m)])
    b = make_backend(cfg, b_kv, [("kv", b_kv), ("mamba", b_m)])
    keys = page_keys(6, seed=14)
    a_idx = a_kv.alloc(6 * PS)
    state = [Trailing(PoolName.MAMBA, a_m, 1)]
    first = backup(a, keys[:3], a_idx[: 3 * PS], PS, trailing=state)
    second = backup(a, keys[3:], a_idx[3 * PS :], PS, trailing=state)
    got = prefetch(b, keys, b_kv, PS, trailing=[Trailing(PoolName.MAMBA, b_m, 1)])
    assert got.restorable == [3, 6] and got.kv_hit_pages == 6
    ok, m_idx = got.trailing["mamba"]
    assert ok == [True] and pages(b_m, m_idx, 1) == pages(a_m, second.trailing["mamba"], 1)

    # The state at page 6 gone: the usable prefix falls back to the other node end.
    with Client(daemon.target) as kv:
        fam = b._own_family("mamba")
        assert kv.delete(fam.layout, block_hashes=fam.hashes(keys[5:6])) >= 1
    again = prefetch(b, keys, b_kv, PS, trailing=[Trailing(PoolName.MAMBA, b_m, 1)])
    assert again.restorable == [3] and again.kv_hit_pages == 3
    ok, m_idx = again.trailing["mamba"]
    assert ok == [True] and pages(b_m, m_idx, 1) == pages(a_m, first.trailing["mamba"], 1)


def test_deepseek_v4_pools(daemon: DaemonProc) -> None:
    """DeepSeek-V4: the KV anchor holds no bytes; compressed KV (ratios 4 and 128), the C4
    indexer and its scales ride on the KV pages as groups of one namespace; the SWA rows
    (on V4 a row of `swa_page_size` tokens) and the C4 compression state are trailing
    pools, each with a namespace of its own."""
    def engine() -> tuple[object, dict[str, object]]:
        return logical_pool(), {
            "deepseek_v4_c4": v4_pool("deepseek_v4_c4", item_bytes=96),
            "deepseek_v4_c4_indexer": v4_pool("deepseek_v4_c4_indexer", item_bytes=40, layout="layer_first"),
            "deepseek_v4_c4_indexer_scale": v4_pool("deepseek_v4_c4_indexer_scale", item_bytes=8),
            "deepseek_v4_c128": v4_pool("deepseek_v4_c128", item_bytes=72),
            "swa": v4_pool("swa", item_bytes=128, page_size=8),
            "deepseek_v4_c4_state": v4_state_pool("deepseek_v4_c4_state"),
        }

    (a_anchor, a_pools), (b_anchor, b_pools) = engine(), engine()
    for i, p in enumerate(a_pools.values()):
        fill_random(p, 20 + i)
    cfg = storage_config(target=daemon.target, model="test/dsv4", mla=True)
    a = make_backend(cfg, a_anchor, [("kv", a_anchor), *a_pools.items()])
    b = make_backend(cfg, b_anchor, [("kv", b_anchor), *b_pools.items()])
    groups = [g.name for g in a.namespaces()["kv"].groups]
    assert groups == sorted(["deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c4_indexer_scale",
                             "deepseek_v4_c128"])
    derived = [PoolName.DEEPSEEK_V4_C4, PoolName.DEEPSEEK_V4_C4_INDEXER, PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE,
               PoolName.DEEPSEEK_V4_C128]
    keys = page_keys(4, seed=15)
    a_idx = a_anchor.alloc(4 * PS)
    def tails(pools: dict[str, object]) -> list[Trailing]:
        return [Trailing(PoolName.SWA, pools["swa"], 2),
                Trailing(PoolName.DEEPSEEK_V4_C4_STATE, pools["deepseek_v4_c4_state"], 2, indices_from=PoolName.SWA)]

    stored = backup(a, keys, a_idx, PS, kv_derived=derived, trailing=tails(a_pools))
    assert all(stored.v2[n] == [True] * 4 for n in derived)
    assert stored.v2[PoolName.SWA] == stored.v2[PoolName.DEEPSEEK_V4_C4_STATE] == [True, True]
    got = prefetch(b, keys, b_anchor, PS, kv_derived=derived, trailing=tails(b_pools))
    assert (got.kv_hit_pages, got.loaded_pages) == (4, 4)
    for name in ("deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c4_indexer_scale", "deepseek_v4_c128"):
        assert pages(b_pools[name], got.kv_indices, 4) == pages(a_pools[name], a_idx, 4), name
    for name in ("swa", "deepseek_v4_c4_state"):
        ok, idx = got.trailing[name]
        assert ok == [True, True] and pages(b_pools[name], idx, 2) == pages(a_pools[name], stored.trailing[name], 2)


def test_a_pool_transfer_that_disagrees_with_the_kv_namespace_is_a_miss(daemon: DaemonProc) -> None:
    """An indexer transfer naming other pages than the KV pool's (or another hit policy)
    cannot be stored with them: False for it, and nothing partial is stored."""
    a_kv = mla_pool()
    a_ix = dsa_indexer(a_kv)
    cfg = storage_config(target=daemon.target, model="test/dsa-mismatch", mla=True)
    a = make_backend(cfg, a_kv, [("kv", a_kv), ("indexer", a_ix)])
    keys = page_keys(2, seed=16)
    idx = a_kv.alloc(2 * PS)
    bad = PoolTransfer(name=PoolName.INDEXER, host_indices=idx, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert a.batch_set_v2([bad]) == {PoolName.INDEXER: [False, False]}
    assert a.batch_exists(keys) == 0


def test_block_groups_report_their_own_verdict(daemon: DaemonProc) -> None:
    """BLOCK_GROUPS (SGLang 0.5.23 defines it; no pool of its own uses it yet): a pool's keys
    come in groups of `group_pages`, each covering `block_pages` FULL pages from the span
    start; the pool reports the pages its leading whole groups cover and never gates the
    KV hit."""
    a_kv, a_aux = mha_pool(), v4_pool("auxiliary_swa", item_bytes=32)
    fill_random(a_aux, 7)
    cfg = storage_config(target=daemon.target, model="test/block-groups")
    a = make_backend(cfg, a_kv, [("kv", a_kv), ("auxiliary_swa", a_aux)])
    keys = page_keys(8, seed=17)
    kv_idx = a_kv.alloc(8 * PS)
    assert a.batch_set_v1(keys, kv_idx) == [True] * 8
    own = page_keys(6, seed=18)
    aux_idx = a_aux.alloc(6 * PS)
    # Groups of two: 0-1 whole, 2-3 broken (page 3 never stored), 4-5 whole.
    for first, last in ((0, 3), (4, 6)):
        sent = PoolTransfer(name=PoolName.AUXILIARY_SWA, host_indices=aux_idx[first * PS : last * PS],
                            keys=own[first:last])
        assert a.batch_set_v2([sent])[PoolName.AUXILIARY_SWA] == [True] * (last - first)
    query = PoolTransfer(name=PoolName.AUXILIARY_SWA, keys=own, hit_policy=PoolHitPolicy.BLOCK_GROUPS, block_pages=4,
                         group_pages=2)
    found = a.batch_exists_v2(keys, [query])
    assert found.kv_hit_pages == 8  # not gated
    assert found.extra_pool_hit_pages[PoolName.AUXILIARY_SWA] == 4  # one whole group, four FULL pages


def test_unregistered_pool_is_a_miss(daemon: DaemonProc) -> None:
    a_kv = mha_pool()
    a = make_backend(storage_config(target=daemon.target, model="test/unregistered"), a_kv)
    keys = page_keys(2, seed=19)
    assert a.batch_set_v1(keys, a_kv.alloc(2 * PS)) == [True, True]
    trailing = PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert a.batch_exists_v2(keys, [trailing]).kv_hit_pages == 0
    assert a.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=keys[:1])]) == {
        PoolName.MAMBA: [False]}
