"""v1 (zero-copy) round trips through SGLang's real host pools, the real storage factory
and a real daemon: engine A stores pages from its host pool, engine B loads them into its
own, byte for byte; `batch_exists` counts the leading run."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from conftest import fill_random, make_backend, mha_pool, mla_pool, page_keys, pages, storage_config

from kvstore.client.sglang import HiCacheKVStore
from tests.procs import DaemonProc, daemon_args, remove_segments, start


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("data_plane", ["auto", "grpc"])
def test_mha_round_trip_between_two_engines(daemon: DaemonProc, layout: str, data_plane: str) -> None:
    a_pool, b_pool = mha_pool(layout), mha_pool(layout)
    fill_random(a_pool, seed=1)
    cfg = storage_config(target=daemon.target, model=f"test/mha-{layout}-{data_plane}", data_plane=data_plane)
    a, b = make_backend(cfg, a_pool), make_backend(cfg, b_pool)
    assert isinstance(a, HiCacheKVStore)
    keys = page_keys(6, seed=hash(layout) & 0xFFFF)
    a_idx = a_pool.alloc(6 * a_pool.page_size)
    assert b.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, a_idx) == [True] * 6
    assert b.batch_exists(keys) == 6
    assert b.batch_exists(keys + page_keys(2, seed=99)) == 6

    b_idx = b_pool.alloc(6 * b_pool.page_size)
    assert b.batch_get_v1(keys, b_idx) == [True] * 6
    assert pages(b_pool, b_idx, 6) == pages(a_pool, a_idx, 6)
    if data_plane == "auto":
        assert b.get_stats().data_plane == "local"  # a Unix socket: the shared-memory plane


def test_mla_round_trip(daemon: DaemonProc) -> None:
    for layout in ("page_first", "layer_first"):
        a_pool, b_pool = mla_pool(layout), mla_pool(layout)
        fill_random(a_pool, seed=2)
        cfg = storage_config(target=daemon.target, model=f"test/mla-{layout}", mla=True)
        a, b = make_backend(cfg, a_pool), make_backend(cfg, b_pool)
        keys = page_keys(5, seed=7)
        a_idx, b_idx = a_pool.alloc(5 * 16), b_pool.alloc(5 * 16)
        assert a.batch_set_v1(keys, a_idx) == [True] * 5
        assert b.batch_exists(keys) == 5
        assert b.batch_get_v1(keys, b_idx) == [True] * 5
        assert pages(b_pool, b_idx, 5) == pages(a_pool, a_idx, 5)


def test_a_missing_page_ends_the_hit(daemon: DaemonProc) -> None:
    """Pages 0-1 and 3 stored, page 2 not: exists counts 2, a get loads 2 and says so."""
    a_pool, b_pool = mha_pool(), mha_pool()
    fill_random(a_pool, seed=3)
    cfg = storage_config(target=daemon.target, model="test/gap")
    a, b = make_backend(cfg, a_pool), make_backend(cfg, b_pool)
    keys = page_keys(4, seed=3)
    idx = a_pool.alloc(4 * 16)
    assert a.batch_set_v1(keys[:2], idx[: 2 * 16]) == [True, True]
    assert a.batch_set_v1(keys[3:], idx[3 * 16 :]) == [True]
    assert b.batch_exists(keys) == 2
    b_idx = b_pool.alloc(4 * 16)
    assert b.batch_get_v1(keys, b_idx) == [True, True, False, False]
    assert pages(b_pool, b_idx, 2) == pages(a_pool, idx, 2)
    stats = b.get_stats()
    assert (stats.pages_hit, stats.pages_missed) == (2, 2)


def test_deprecated_page_calls_round_trip(daemon: DaemonProc) -> None:
    """Without interface_v1 SGLang copies pages out (`get_data_page`) and back in
    (`set_from_flat_data_page`) around `batch_set` / `batch_get`: those work too."""
    a_pool, b_pool = mha_pool("layer_first"), mha_pool("layer_first")
    fill_random(a_pool, seed=4)
    cfg = storage_config(target=daemon.target, model="test/deprecated", interface_v1=False)
    a, b = make_backend(cfg, a_pool), make_backend(cfg, b_pool)
    keys = page_keys(3, seed=4)
    a_idx = a_pool.alloc(3 * 16)
    assert a.batch_set(keys, [a_pool.get_data_page(a_idx[i * 16], flat=True) for i in range(3)]) is True
    assert b.batch_exists(keys) == 3 and b.exists(keys[0])
    got = b.batch_get(keys, [b_pool.get_dummy_flat_data_page() for _ in keys])
    b_idx = b_pool.alloc(3 * 16)
    for i, data in enumerate(got):
        assert data is not None
        b_pool.set_from_flat_data_page(b_idx[i * 16], data)
    assert pages(b_pool, b_idx, 3) == pages(a_pool, a_idx, 3)
    single = b.get(keys[1], b_pool.get_dummy_flat_data_page())
    assert single is not None  # random bits include NaNs: compare bytes, not values
    assert bytes(single.view(torch.uint8).numpy()) == pages(a_pool, a_idx, 2)[1]
    assert b.set(page_keys(1, seed=40)[0], a_pool.get_data_page(a_idx[0], flat=True)) is True


def test_round_trip_over_the_data_lane(tmp_path: Path) -> None:
    """A TCP target (another host, as far as the client knows): the pages travel on the
    daemon's data lane, straight from and into the host pools' pages."""
    sock = tmp_path / "kv.sock"
    port = free_port()
    args = daemon_args(sock, "--host-capacity", "64MiB")
    args[args.index("--listen") + 1] = f"unix:{sock},127.0.0.1:{port}"
    daemon = start(args, sock, tmp_path / "daemon.log")
    try:
        a_pool, b_pool = mha_pool(), mha_pool()
        fill_random(a_pool, seed=5)
        cfg = storage_config(target=f"127.0.0.1:{port}", model="test/lane", data_plane="lane")
        a, b = make_backend(cfg, a_pool), make_backend(cfg, b_pool)
        keys = page_keys(8, seed=5)
        a_idx, b_idx = a_pool.alloc(8 * 16), b_pool.alloc(8 * 16)
        assert a.batch_set_v1(keys, a_idx) == [True] * 8
        assert b.batch_get_v1(keys, b_idx) == [True] * 8
        assert pages(b_pool, b_idx, 8) == pages(a_pool, a_idx, 8)
        assert a.get_stats().data_plane == "lane" and b.get_stats().data_plane == "lane"
        a.close()
        b.close()
    finally:
        daemon.stop()
        remove_segments(daemon.pid)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
