"""Reuse hints through the API: they protect blocks inside the budget, are validated,
and `end_session` releases them."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from kvstore.client import Client
from kvstore.errors import InvalidArgument


@pytest.fixture
def config(tmp_path):
    from conftest import make_config

    # Room for 8 blocks of the small layout (1 KiB each). The budget is a fraction of the
    # blocks the tier holds when the hint arrives (2 here), so allow all of them.
    return replace(make_config(tmp_path), host_capacity=8 * 1024, policy="hint-lru", hint_budget=1.0)


def test_hinted_blocks_survive_pressure_and_end_session_releases_them(daemon_thread, layout):
    hinted = list(range(8))  # 2 blocks
    with Client(daemon_thread.unix_target) as kv:
        kv.put(layout, hinted, [os.urandom(1024) for _ in range(2)], session_id="conv-1",
               expect_reuse_within_s=600)
        for i in range(6):  # 12 other blocks through an 8-block tier
            kv.put(layout, list(range(1000 * (i + 1), 1000 * (i + 1) + 8)), [os.urandom(1024) for _ in range(2)])
        assert kv.lookup(layout, hinted).num_blocks == 2  # LRU alone would have evicted them
        kv.end_session("conv-1")
        for i in range(6):
            kv.put(layout, list(range(50_000 * (i + 1), 50_000 * (i + 1) + 8)), [os.urandom(1024) for _ in range(2)])
        assert kv.lookup(layout, hinted).num_blocks == 0


def test_hint_call_and_lookup_hint(daemon_thread, layout):
    tokens = list(range(12))
    with Client(daemon_thread.tcp_target) as kv:
        kv.put(layout, tokens, [os.urandom(1024) for _ in range(3)])
        assert kv.hint(layout, tokens, session_id="s", expect_reuse_within_s=30) == 3
        assert kv.hint(layout, list(range(500, 512)), session_id="s", expect_reuse_within_s=30) == 0
        hit = kv.lookup(layout, tokens, session_id="s", expect_reuse_within_s=30)
        assert hit.num_blocks == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"session_id": "", "expect_reuse_within_s": 5}, "both"),
        ({"session_id": "s"}, "both"),
        ({"session_id": "s", "expect_reuse_within_s": 0}, "expect_reuse_within_s"),
        ({"session_id": "s", "expect_reuse_within_s": float("nan")}, "expect_reuse_within_s"),
        ({"session_id": "x" * 129, "expect_reuse_within_s": 5}, "session_id"),
    ],
)
def test_bad_hints_are_invalid_and_store_nothing(daemon_thread, layout, kwargs, match):
    tokens = list(range(4))
    with Client(daemon_thread.tcp_target) as kv:
        with pytest.raises(InvalidArgument, match=match):
            kv.put(layout, tokens, [os.urandom(1024)], **kwargs)
        assert kv.lookup(layout, tokens).num_blocks == 0


@pytest.mark.parametrize("target", ["unix_target", "tcp_target"])
def test_stats_count_hinted_lookups_puts_and_ended_sessions(daemon_thread, layout, target):
    """Over shared memory (unix) and gRPC bytes (tcp): each request that carried a hint
    counts once, whether or not it found blocks; unhinted ones do not count."""
    with Client(getattr(daemon_thread, target)) as kv:
        before = kv.stats().counters
        kv.lookup(layout, list(range(40, 48)), session_id="s", expect_reuse_within_s=30)  # a miss
        kv.put(layout, list(range(8)), [os.urandom(1024) for _ in range(2)], session_id="s",
               expect_reuse_within_s=30)
        kv.put(layout, list(range(100, 108)), [os.urandom(1024) for _ in range(2)])
        kv.lookup(layout, list(range(8)), session_id="s", expect_reuse_within_s=30)  # a hit
        kv.lookup(layout, list(range(8)))
        kv.end_session("s")
        after = kv.stats().counters
    assert after.hinted_lookups - before.hinted_lookups == 2
    assert after.hinted_puts - before.hinted_puts == 1
    assert after.sessions_ended - before.sessions_ended == 1
