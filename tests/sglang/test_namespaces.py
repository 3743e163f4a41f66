"""Keys name content, not layout: the backend's namespace carries everything that changes a
page's bytes, so deployments that differ in any of it never share a page (SGLang #33268:
keys without the KV dtype), while those that compute the same bytes do."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import fill_random, make_backend, mha_pool, mla_pool, page_keys, pages, storage_config

from kvstore.errors import InvalidArgument
from tests.procs import DaemonProc


def store(daemon: DaemonProc, pool: Any, keys: list[str], **cfg: Any) -> None:
    fill_random(pool, 1)
    a = make_backend(storage_config(target=daemon.target, **cfg), pool)
    assert a.batch_set_v1(keys, pool.alloc(len(keys) * pool.page_size)) == [True] * len(keys)


@pytest.mark.parametrize("other", [
    {"dtype": torch.float8_e5m2},  # same bytes, another fp8
    {"page_size": 32},
    {"heads": 4, "head_dim": 16},  # same bytes per token, other geometry
    {"layout": "layer_first"},  # same bytes, another order
    {"layers": 3},
])
def test_another_pool_geometry_never_hits(daemon: DaemonProc, other: dict[str, Any]) -> None:
    base: dict[str, Any] = {"dtype": torch.float8_e4m3fn, "page_size": 16, "heads": 2, "head_dim": 32,
                            "layout": "page_first", "layers": 2}
    keys = page_keys(4, seed=len(str(other)))
    model = f"test/iso-{sorted(other)[0]}"

    def pool(**geometry: Any) -> Any:
        return mha_pool(geometry.pop("layout"), **geometry)

    store(daemon, pool(**base), keys, model=model)
    b = make_backend(storage_config(target=daemon.target, model=model), pool(**{**base, **other}))
    assert b.batch_exists(keys) == 0
    # The same geometry does hit: the miss above is the difference's doing.
    assert make_backend(storage_config(target=daemon.target, model=model), pool(**base)).batch_exists(keys) == 4


@pytest.mark.parametrize("other", [
    {"model": "test/other-model"},
    {"tp_rank": 1, "tp_size": 2},
    {"revision": "v2"},
    {"kv_cache_dtype": "fp8_e5m2"},
    {"interface_v1": False},  # SGLang's flat pages: another byte order than the zero-copy pieces
])
def test_another_deployment_never_hits(daemon: DaemonProc, other: dict[str, Any]) -> None:
    keys = page_keys(4, seed=len(str(other)))
    base: dict[str, Any] = {"model": "test/deploy", "tp_rank": 0, "tp_size": 2}
    store(daemon, mha_pool(), keys, **base)
    b = make_backend(storage_config(target=daemon.target, **{**base, **other}), mha_pool())
    assert b.batch_exists(keys) == 0
    assert make_backend(storage_config(target=daemon.target, **base), mha_pool()).batch_exists(keys) == 4


def test_dp_replicas_share_pages(daemon: DaemonProc) -> None:
    """Another DP rank of the same deployment computes the same bytes: it hits."""
    a_pool, b_pool = mha_pool(), mha_pool()
    fill_random(a_pool, 3)
    keys = page_keys(3, seed=31)
    a_cfg = storage_config(target=daemon.target, model="test/dp")
    b_cfg = storage_config(target=daemon.target, model="test/dp")
    b_cfg.dp_rank = 1
    a, b = make_backend(a_cfg, a_pool), make_backend(b_cfg, b_pool)
    idx = a_pool.alloc(3 * 16)
    assert a.batch_set_v1(keys, idx) == [True] * 3
    b_idx = b_pool.alloc(3 * 16)
    assert b.batch_get_v1(keys, b_idx) == [True] * 3
    assert pages(b_pool, b_idx, 3) == pages(a_pool, idx, 3)


def test_mla_pages_are_written_by_one_rank_and_read_by_all(daemon: DaemonProc) -> None:
    """MLA KV is the same on every TP rank: rank 1's writes are skipped (SGLang's writer
    rule), rank 0's pages serve rank 1."""
    r0_pool, r1_pool = mla_pool(), mla_pool()
    fill_random(r0_pool, 4)
    fill_random(r1_pool, 5)
    keys = page_keys(3, seed=32)
    r0 = make_backend(storage_config(target=daemon.target, model="test/mla-tp", mla=True, tp_rank=0, tp_size=2),
                      r0_pool)
    r1 = make_backend(storage_config(target=daemon.target, model="test/mla-tp", mla=True, tp_rank=1, tp_size=2),
                      r1_pool)
    r1_idx = r1_pool.alloc(3 * 16)
    assert r1.batch_set_v1(keys, r1_idx) == [True] * 3  # not its to write
    assert r0.batch_exists(keys) == 0
    r0_idx = r0_pool.alloc(3 * 16)
    assert r0.batch_set_v1(keys, r0_idx) == [True] * 3
    assert r1.batch_get_v1(keys, r1_idx) == [True] * 3
    assert pages(r1_pool, r1_idx, 3) == pages(r0_pool, r0_idx, 3)


def test_bad_extra_config_stops_the_engine_with_a_message(daemon: DaemonProc) -> None:
    with pytest.raises(InvalidArgument, match="unknown keys \\['tagret'\\]"):
        make_backend(storage_config(target=daemon.target, tagret="unix:/x"), mha_pool())
    with pytest.raises(InvalidArgument, match="timeout_s"):
        make_backend(storage_config(target=daemon.target, timeout_s="fast"), mha_pool())
    with pytest.raises(InvalidArgument, match="model_id"):
        make_backend(storage_config(target=daemon.target, model=""), mha_pool())
    # model_id names the model when SGLang's name is a local path.
    b = make_backend(storage_config(target=daemon.target, model="/models/llama", model_id="meta-llama/x"), mha_pool())
    assert b.namespaces()["kv"].model == "meta-llama/x"
