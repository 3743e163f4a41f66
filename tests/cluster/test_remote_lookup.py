"""The lookup round's steps over a chain's units (kvstore.cluster.remote_lookup's
`gather_ranges`, `spread_prefix`, `units_reach`): the native passes (kvstore/_native/units.c)
answer as their numpy references do, on random units, and refuse arrays they cannot read."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.cluster import remote_lookup
from kvstore.native import native

needs_native = pytest.mark.skipif(remote_lookup.NATIVE_UNITS is None, reason="the native module is not built here")


@pytest.fixture
def numpy_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(remote_lookup, "NATIVE_UNITS", None)
    yield


def _units(rng: random.Random, n: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A packed chain of `n` hashes and units over it: [starts, stops), the first one
    starting inside its unit as a lookup's first unit past the prefix does."""
    packed = rng.randbytes(16 * n)
    bounds = sorted(set(rng.sample(range(1, n), min(n - 1, n // 3))) | {0, n})
    starts = np.array(bounds[:-1], np.int64)
    stops = np.array(bounds[1:], np.int64)
    starts[0] = rng.randrange(0, int(stops[0]))
    return packed, starts, stops


def _cases(count: int) -> Iterator[tuple[random.Random, bytes, np.ndarray, np.ndarray]]:
    for seed in range(count):
        rng = random.Random(seed)
        yield (rng, *_units(rng, rng.choice([2, 3, 17, 1000])))


def _both(fn, *args):  # type: ignore[no-untyped-def]
    """`fn(*args)` with the native pass and with numpy's."""
    native_answer = fn(*args)
    saved, remote_lookup.NATIVE_UNITS = remote_lookup.NATIVE_UNITS, None
    try:
        return native_answer, fn(*args)
    finally:
        remote_lookup.NATIVE_UNITS = saved


@needs_native
def test_gathered_ranges_are_the_hashes_of_the_units_asked_in_order() -> None:
    for rng, packed, starts, stops in _cases(40):
        idx = np.array(rng.sample(range(len(starts)), rng.randrange(len(starts) + 1)), np.int64)
        got, want = _both(remote_lookup.gather_ranges, packed, starts, stops, idx)
        assert got == want
        assert got == b"".join(packed[16 * int(starts[j]) : 16 * int(stops[j])] for j in idx.tolist())
        every, every_numpy = _both(remote_lookup.gather_ranges, packed, starts, stops)
        assert every == every_numpy == packed[16 * int(starts[0]) :]


@needs_native
def test_an_answer_is_spread_over_the_units_asked_in_their_order() -> None:
    for rng, _, starts, stops in _cases(40):
        sizes = stops - starts
        idx = np.array(rng.sample(range(len(sizes)), rng.randrange(1, len(sizes) + 1)), np.int64)
        total = int(sizes[idx].sum())
        for count in (0, -3, rng.randrange(total + 1), total, total + 5):
            got, want = _both(remote_lookup.spread_prefix, count, sizes, idx)
            assert (got == want).all() and got.dtype == np.int64
            assert int(got.sum()) == min(max(count, 0), total)
            assert (got[np.setdiff1d(np.arange(len(sizes)), idx)] == 0).all()


@needs_native
def test_the_reach_is_where_the_first_unit_falls_short() -> None:
    for rng, _, starts, stops in _cases(60):
        sizes = stops - starts
        locs = np.array([rng.choice([0, int(s), rng.randrange(int(s) + 1)]) for s in sizes], np.int64)
        found = np.array([rng.choice([0, int(s), rng.randrange(int(s) + 1)]) for s in sizes], np.int64)
        (best, short, copied), (best_np, short_np, copied_np) = _both(remote_lookup.units_reach, locs, found, sizes)
        assert (best == best_np).all() and (short, copied) == (short_np, copied_np)
        assert short == next((j for j in range(len(sizes)) if best[j] < sizes[j]), len(sizes))
        assert copied == any(found[j] > locs[j] for j in range(min(short + 1, len(sizes))))


@needs_native
def test_the_native_passes_refuse_arrays_they_cannot_read() -> None:
    packed = bytes(64)
    starts, stops = np.array([0, 2], np.int64), np.array([2, 4], np.int64)
    with pytest.raises(TypeError):
        native.gather_ranges(packed, 16, starts.astype(np.int32), stops, None)
    with pytest.raises(IndexError):
        native.gather_ranges(packed, 16, starts, np.array([2, 5], np.int64), None)  # past the chain
    with pytest.raises(IndexError):
        native.gather_ranges(packed, 16, np.array([3, 2], np.int64), stops, None)  # start after stop
    with pytest.raises(IndexError):
        native.gather_ranges(packed, 16, starts, stops, np.array([2], np.int64))
    with pytest.raises(ValueError):
        native.gather_ranges(packed[:-1], 16, starts, stops, None)
    out = np.zeros(2, np.int64)
    with pytest.raises(IndexError):
        native.spread_prefix(3, stops - starts, np.array([-1], np.int64), out)
    with pytest.raises(ValueError):
        native.spread_prefix(3, stops - starts, np.array([0], np.int64), np.zeros(3, np.int64))
    with pytest.raises(ValueError):
        native.units_reach(starts, stops, stops, np.zeros(4, np.int64)[::2])  # not contiguous
    with pytest.raises(ValueError):
        native.units_reach(starts, stops, stops, np.zeros(3, np.int64))


def test_the_numpy_steps_answer_on_their_own(numpy_only: None) -> None:
    """Where the module is not built, the same answers come from numpy alone."""
    packed = bytes(range(16)) * 6
    starts, stops = np.array([1, 3], np.int64), np.array([3, 6], np.int64)
    assert remote_lookup.gather_ranges(packed, starts, stops, np.array([1], np.int64)) == packed[48:96]
    assert remote_lookup.spread_prefix(4, stops - starts, np.array([1, 0], np.int64)).tolist() == [1, 3]
    locs, found = np.array([2, 0], np.int64), np.array([0, 2], np.int64)
    best, short, copied = remote_lookup.units_reach(locs, found, stops - starts)
    assert best.tolist() == [2, 2] and short == 1 and copied
