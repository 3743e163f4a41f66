"""The daemon's allocator thresholds (kvstore.server.host_resources.tune_malloc, docs/operations.md)."""

from __future__ import annotations

import platform

import pytest

from kvstore.server.host_resources import tune_malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_thresholds_are_set_on_glibc(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert tune_malloc() is True


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_an_operators_own_setting_is_left_alone(monkeypatch, name):
    monkeypatch.setenv(name, str(1 << 20))
    assert tune_malloc() is False
