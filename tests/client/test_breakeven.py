"""The break-even rule on given measurements (no clocks): a hit is loaded when loading it
beats computing it, never when it would make a request of the step wait longer than its
own recompute, and everything is loaded until both sides have been measured."""

from __future__ import annotations

import pytest

from kvstore.client._breakeven import MIN_DEADLINE_S, BreakEven

BLOCK_TOKENS = 32
BLOCK_BYTES = 1 << 20  # 1 MiB per block


def measured(fetch_bytes_per_s: float, tokens_per_s: float, latency_s: float = 0.001) -> BreakEven:
    be = BreakEven(BLOCK_TOKENS)
    be.transfer.round_trip(latency_s)
    be.transfer.fetched(64 * BLOCK_BYTES, latency_s + 64 * BLOCK_BYTES / fetch_bytes_per_s)
    be.prefill.step(1024, 1024 / tokens_per_s)
    return be


def test_everything_loads_until_both_sides_are_measured():
    be = BreakEven(BLOCK_TOKENS)
    assert be.plan(10, BLOCK_BYTES).blocks == 10
    be.prefill.step(1024, 1.0)
    assert be.plan(10, BLOCK_BYTES).reason == "unmeasured"  # no transfer sample yet


def test_a_fast_plane_loads_and_a_slow_one_computes():
    # 32 tokens per block at 1,000 tokens/s: 32 ms per block to compute.
    fast = measured(fetch_bytes_per_s=1e9, tokens_per_s=1000)  # ~1 ms per block to load
    assert fast.plan(10, BLOCK_BYTES).blocks == 10
    slow = measured(fetch_bytes_per_s=10e6, tokens_per_s=1000)  # ~105 ms per block to load
    plan = slow.plan(10, BLOCK_BYTES)
    assert (plan.blocks, plan.reason) == (0, "slower")
    assert plan.load_s == pytest.approx(0.001 + 10 * BLOCK_BYTES / 10e6, rel=1e-3)
    assert plan.compute_s == pytest.approx(0.32)


def test_the_latency_decides_a_short_hit():
    be = measured(fetch_bytes_per_s=1e9, tokens_per_s=1000, latency_s=0.05)
    assert be.plan(1, BLOCK_BYTES).blocks == 0  # 51 ms to load, 32 ms to compute
    assert be.plan(4, BLOCK_BYTES).blocks == 4  # 54 ms to load, 128 ms to compute


def test_a_put_measures_the_plane_until_a_fetch_does():
    be = BreakEven(BLOCK_TOKENS)
    be.prefill.step(1024, 1.024)
    be.transfer.put(10 * BLOCK_BYTES, 1.0)  # 10 MiB/s
    assert be.plan(10, BLOCK_BYTES).reason == "slower"
    be.transfer.fetched(10 * BLOCK_BYTES, 0.01)  # a fetch is the better witness
    assert be.plan(10, BLOCK_BYTES).blocks == 10


def test_the_step_never_loads_longer_than_a_loading_request_would_compute():
    # 20 ms per block to load, 32 ms per block to compute: each load wins on its own.
    be = measured(fetch_bytes_per_s=BLOCK_BYTES / 0.02, tokens_per_s=1000, latency_s=1e-6)
    assert be.plan(10, BLOCK_BYTES).blocks == 10  # 200 ms of loads; this request computes 320 ms
    # A 4-block hit computes in 128 ms: behind the 200 ms already planned it would wait longer.
    assert be.plan(4, BLOCK_BYTES).reason == "convoy"
    # A second large hit would make the first request wait 400 ms for its 320 ms recompute.
    assert be.plan(10, BLOCK_BYTES).reason == "convoy"
    be.end_step()
    assert be.plan(4, BLOCK_BYTES).blocks == 4


def test_a_load_runs_to_about_its_recompute_time_at_most():
    be = measured(fetch_bytes_per_s=1e9, tokens_per_s=1000)
    plan = be.plan(10, BLOCK_BYTES)
    assert BreakEven.deadline_s(plan, ceiling_s=30) == pytest.approx(2 * 0.32)
    assert BreakEven.deadline_s(plan, ceiling_s=0.1) == 0.1
    assert BreakEven.deadline_s(be.plan(0, BLOCK_BYTES), ceiling_s=30) == 30
    tiny = measured(fetch_bytes_per_s=1e12, tokens_per_s=1e7)
    assert BreakEven.deadline_s(tiny.plan(1, BLOCK_BYTES), ceiling_s=30) == MIN_DEADLINE_S


def test_decode_steps_do_not_teach_the_prefill_rate():
    be = BreakEven(BLOCK_TOKENS)
    be.prefill.step(4, 0.5)  # four decode tokens, mostly fixed cost
    assert be.prefill.tokens_per_s == 0
    be.prefill.step(512, 0.5)
    assert be.prefill.tokens_per_s == 1024
