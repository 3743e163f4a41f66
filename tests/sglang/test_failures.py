"""A daemon that is gone, stopped or refusing is a miss, never an exception into SGLang's
prefetch and backup threads (which die silently on one), and never a wrong byte; the
backend comes back by itself once the daemon does."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fill_random, make_backend, mha_pool, page_keys, pages, start_daemon, storage_config
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

from tests.polling import wait_until
from tests.procs import DaemonProc, remove_segments

PS = 16


def check_loaded(b_pool: Any, b_idx: torch.Tensor, a_pool: Any, a_idx: torch.Tensor, got: list[bool]) -> int:
    """The pages reported loaded hold engine A's bytes; how many there were."""
    n = got.index(False) if False in got else len(got)
    assert pages(b_pool, b_idx, n) == pages(a_pool, a_idx, n)
    return n


def test_sglang_failure_injector(daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own injector (random delays and failed calls) wraps the backend: every call
    answers, and what it says it loaded is right."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    a_pool, b_pool = mha_pool(), mha_pool()
    fill_random(a_pool, 1)
    cfg = storage_config(target=daemon.target, model="test/injector")
    a, b = make_backend(cfg, a_pool), make_backend(cfg, b_pool)
    assert isinstance(a, HiCacheStorageFailureInjector)
    loaded = stored = 0
    for round_ in range(20):
        keys = page_keys(4, seed=100 + round_)
        a_idx, b_idx = a_pool.alloc(4 * PS), b_pool.alloc(4 * PS)
        stored += all(a.batch_set_v1(keys, a_idx))
        b.batch_exists(keys)
        loaded += check_loaded(b_pool, b_idx, a_pool, a_idx, b.batch_get_v1(keys, b_idx))
        a_pool.free(a_idx)
        b_pool.free(b_idx)
    assert 0 < stored < 20 and loaded > 0  # some calls failed, some went through


def test_daemon_killed_mid_batch_then_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """kill -9 of the daemon while engine B loads and engine A stores: every call returns,
    the pages B says it loaded are A's, one warning per engine; a daemon started again on the
    same socket is used again (a new client, a new segment) once the retry interval passed."""
    daemon = start_daemon(tmp_path / "d")
    a_pool, b_pool = mha_pool(capacity=1024), mha_pool(capacity=1024)
    fill_random(a_pool, 2)
    cfg = storage_config(target=daemon.target, model="test/killed", retry_interval_s=0.2, timeout_s=5)
    a, b = make_backend(cfg, a_pool), make_backend(cfg, b_pool)
    keys = page_keys(32, seed=2)
    a_idx = a_pool.alloc(32 * PS)
    assert a.batch_set_v1(keys, a_idx) == [True] * 32
    results: list[Any] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def engine_b() -> None:
        try:
            for _ in range(40):
                b_idx = b_pool.alloc(32 * PS)
                results.append((b_idx, b.batch_get_v1(keys, b_idx)))
                started.set()
                more = page_keys(8, seed=len(results) + 1000)
                results.append((None, a.batch_set_v1(more, a_idx[: 8 * PS])))
                b_pool.free(b_idx)
        except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)
            started.set()

    caplog.set_level(logging.INFO, logger="kvstore.client.sglang")
    worker = threading.Thread(target=engine_b)
    worker.start()
    try:
        started.wait(30)
        daemon.kill9()
        worker.join(120)
    finally:
        remove_segments(daemon.pid)
    assert not worker.is_alive() and not errors
    for b_idx, got in results:
        if b_idx is not None:
            check_loaded(b_pool, b_idx, a_pool, a_idx, got)
    assert any(not all(got) for _, got in results)  # the calls after the kill missed
    # One warning per engine (A only stores, B only loads), not one per call.
    warnings = [r.getMessage() for r in caplog.records if "failed during" in r.getMessage()]
    assert 1 <= len(warnings) <= 2
    assert sum("during batch_get_v1" in w for w in warnings) <= 1
    assert sum("during batch_set_v1" in w for w in warnings) <= 1
    assert b.get_stats().errors >= 1

    again = start_daemon(tmp_path / "d")
    try:
        wait_until(lambda: a.batch_set_v1(keys, a_idx) == [True] * 32, "engine A stores on the new daemon")
        b_idx = b_pool.alloc(32 * PS)
        wait_until(lambda: b.batch_get_v1(keys, b_idx) == [True] * 32, "engine B loads from the new daemon")
        assert pages(b_pool, b_idx, 32) == pages(a_pool, a_idx, 32)
        assert any("is back" in r.getMessage() for r in caplog.records)
    finally:
        again.stop()
        remove_segments(again.pid)


def test_a_stopped_daemon_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    """SIGSTOP: the daemon accepts but never answers. Each call gives up at its deadline and
    answers miss; calls within the retry interval do not wait at all."""
    daemon = start_daemon(tmp_path / "d")
    pool = mha_pool()
    cfg = storage_config(target=daemon.target, model="test/stopped", timeout_s=0.5, lookup_timeout_s=0.5,
                         retry_interval_s=60)
    b = make_backend(cfg, pool)
    keys = page_keys(2, seed=3)
    assert b.batch_exists(keys) == 0  # connected, nothing held
    daemon.signal(signal.SIGSTOP)
    try:
        assert b.batch_exists(keys) == 0
        assert b.batch_set_v1(keys, pool.alloc(2 * PS)) == [False, False]
        assert b.get_stats().calls_skipped >= 1
    finally:
        daemon.signal(signal.SIGCONT)
        daemon.stop()
        remove_segments(daemon.pid)


def test_indices_that_do_not_fit_are_a_miss(daemon: DaemonProc) -> None:
    pool = mha_pool()
    b = make_backend(storage_config(target=daemon.target, model="test/bad-indices"), pool)
    keys = page_keys(2, seed=4)
    assert b.batch_set_v1(keys, pool.alloc(PS)) == [False, False]  # one page of slots for two keys
    assert b.batch_get_v1(keys, pool.alloc(3 * PS)) == [False, False]
    assert b.get_stats().errors == 2
    assert b.batch_set_v1(keys, pool.alloc(2 * PS)) == [True, True]  # the daemon was never blamed


def test_stats_and_clear(daemon: DaemonProc) -> None:
    a_pool, b_pool = mha_pool(), mha_pool()
    fill_random(a_pool, 5)
    cfg = storage_config(target=daemon.target, model="test/stats")
    a, b = make_backend(cfg, a_pool), make_backend(cfg, b_pool)
    keys = page_keys(3, seed=5)
    assert a.batch_set_v1(keys, a_pool.alloc(3 * PS)) == [True] * 3
    assert b.batch_get_v1(keys + page_keys(1, seed=6), b_pool.alloc(4 * PS)) == [True] * 3 + [False]
    sa, sb = a.get_stats(), b.get_stats()
    page = a_pool.get_size_per_token() * PS
    assert (sa.pages_stored, sa.bytes_written, sa.backup_pgs) == (3, 3 * page, [3])
    assert (sb.pages_hit, sb.pages_missed, sb.bytes_read, sb.prefetch_pgs) == (3, 1, 3 * page, [3])
    assert len(sb.prefetch_bandwidth) == 1 and sb.data_plane == "local"
    assert b.get_stats().prefetch_pgs == []  # SGLang's samples are handed over once
    assert a.clear() is True
    assert b.batch_exists(keys) == 0
