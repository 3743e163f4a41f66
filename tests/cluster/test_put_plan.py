"""Where a put's blocks go (kvstore.cluster.put_plan's `plan_put_arrays`, the whole-array
plan a long put takes): the same plan as `plan_put_by_piece`, the unit-by-unit one, on
random chains, positions, unit rules and member sets; and left to it where the
placement needs it (R > 1, a hot unit). A forward of several runs from another node
(`plan_runs_arrays`) is planned as its runs one by one."""

from __future__ import annotations

import random

import pytest

from kvstore.cluster import put_plan
from kvstore.cluster.placement import HotUnits, Placement, unit_start
from kvstore.cluster.put_plan import PutPlan, plan_put_arrays, plan_put_by_piece, plan_runs_arrays, put_pieces


def _hashes(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(16) for _ in range(n)]


def _plans(placement: Placement, me: str, hashes: list[bytes], pos: int, key0: bytes,
           from_peer: bool) -> tuple[PutPlan | None, PutPlan]:
    parent = b"p" * 16 if pos else None
    by_piece = plan_put_by_piece(placement, me, put_pieces(placement, hashes, parent, pos, key0), pos, from_peer)
    return plan_put_arrays(placement, me, hashes, pos, key0, from_peer), by_piece


def _same(arrays: PutPlan | None, by_piece: PutPlan) -> None:
    assert arrays is not None
    assert arrays.owned == by_piece.owned
    assert arrays.replicas == by_piece.replicas
    assert arrays.jobs == by_piece.jobs
    assert arrays.forwarded == by_piece.forwarded
    assert sorted(arrays.parts) == sorted(by_piece.parts)


@pytest.mark.parametrize("seed", range(300))
def test_the_array_plan_of_a_put_is_the_unit_by_unit_plan(seed: int) -> None:
    rng = random.Random(seed)
    members = [f"n{i}" for i in rng.sample(range(8), rng.randint(1, 5))]
    me = rng.choice(members + ["outsider"])  # a node may be outside the placed members (draining)
    placement = Placement(members, unit_blocks=rng.choice([1, 2, 3, 4, 16]), lead_in=rng.random() < 0.7)
    if rng.random() < 0.3:
        placement.update(members + ["n9"])  # in the grace of a change: owners are the current set's
    n = rng.choice([16, 17, 40, 333, 1000, 3000])  # 3000: more than a job for some owner
    pos = rng.choice([0, 1, 3, 5, 16, 17, 64, 1000])
    hashes = _hashes(rng, n)
    starts_inside = unit_start(pos, placement.unit_blocks, placement.lead_in) < pos
    # The first unit's key: known (the hash of its first block, before the put) or not.
    key0 = hashes[0] if not starts_inside else rng.choice([rng.randbytes(16), b""])
    _same(*_plans(placement, me, hashes, pos, key0, from_peer=rng.random() < 0.3))


def test_a_put_longer_than_a_job_is_cut_into_full_jobs() -> None:
    rng = random.Random(2)
    placement = Placement(["a", "b"], unit_blocks=1)
    hashes = _hashes(rng, 3 * put_plan.FORWARD_JOB_BLOCKS)
    arrays, by_piece = _plans(placement, "a", hashes, 0, hashes[0], from_peer=False)
    _same(arrays, by_piece)
    assert arrays is not None
    sizes = [sum(b - a for a, b in runs) for runs in arrays.jobs["b"]]
    assert sizes[0] == put_plan.FORWARD_JOB_BLOCKS and sum(sizes) == arrays.forwarded


def test_a_put_longer_than_a_job_is_cut_into_jobs_at_unit_boundaries() -> None:
    rng = random.Random(7)
    placement = Placement(["a", "b"], unit_blocks=3)
    hashes = _hashes(rng, 3 * put_plan.FORWARD_JOB_BLOCKS + 5)
    arrays, by_piece = _plans(placement, "a", hashes, 0, hashes[0], from_peer=False)
    _same(arrays, by_piece)
    assert arrays is not None
    jobs = arrays.jobs["b"]
    assert len(jobs) > 1
    for runs in jobs:
        assert sum(b - a for a, b in runs) <= put_plan.FORWARD_JOB_BLOCKS
        # Every run starts and ends on a unit boundary (or the put's end).
        assert all(a == 0 or a % 3 == 0 for a, _ in runs)
        assert all(b == len(hashes) or b % 3 == 0 for _, b in runs)
    forwarded = sorted(r for runs in jobs for r in runs)
    held = sorted(arrays.replicas)
    assert forwarded == held  # what goes to b is what a holds as replicas
    assert arrays.forwarded == sum(b - a for a, b in forwarded)


def test_one_owner_for_every_block_of_the_put() -> None:
    rng = random.Random(11)
    placement = Placement(["a", "b", "c"], unit_blocks=2)
    hashes = _hashes(rng, 500)
    arrays, _ = _plans(placement, "a", hashes, 0, hashes[0], from_peer=False)
    assert arrays is not None
    covered = [r for _, a, b in arrays.owned for r in range(a, b)]
    covered += [r for runs in arrays.jobs.values() for job in runs for a, b in job for r in range(a, b)]
    assert sorted(covered) == list(range(len(hashes)))
    assert {a for a, _ in arrays.replicas} <= {a for runs in arrays.jobs.values() for job in runs for a, _ in job}


def test_a_put_from_a_peer_forwards_nothing() -> None:
    rng = random.Random(5)
    placement = Placement(["a", "b"], unit_blocks=2)
    hashes = _hashes(rng, 100)
    arrays, by_piece = _plans(placement, "a", hashes, 0, hashes[0], from_peer=True)
    _same(arrays, by_piece)
    assert arrays is not None and not arrays.jobs and arrays.forwarded == 0 and arrays.owned


def test_a_placement_with_more_owners_or_a_hot_unit_takes_the_unit_by_unit_plan() -> None:
    rng = random.Random(3)
    hashes = _hashes(rng, 64)
    two = Placement(["a", "b", "c"], unit_blocks=2, replicas=2)
    assert plan_put_arrays(two, "a", hashes, 0, hashes[0], False) is None
    by_piece = plan_put_by_piece(two, "a", put_pieces(two, hashes, None, 0, hashes[0]), 0, False)
    # Each unit a does not own goes to both its owners: one part with two owners each.
    assert any(len(part) == 2 for part in by_piece.parts)
    hot = HotUnits(threshold=1.0)
    placement = Placement(["a", "b", "c"], unit_blocks=2, hotness=hot, max_extra_owners=1)
    for _ in range(4):
        hot.record(hashes[10])  # the unit at 10 is hot
    assert plan_put_arrays(placement, "a", hashes, 0, hashes[0], False) is None


@pytest.mark.parametrize("seed", range(100))
def test_the_plan_of_a_forward_of_several_runs_is_that_of_its_runs_one_by_one(seed: int) -> None:
    rng = random.Random(1000 + seed)
    members = [f"n{i}" for i in rng.sample(range(8), rng.randint(1, 5))]
    me = rng.choice(members)
    placement = Placement(members, unit_blocks=rng.choice([1, 2, 3, 4, 16]), lead_in=rng.random() < 0.7)
    hashes: list[bytes] = []
    runs: list[tuple[int, int, bytes]] = []
    expected = PutPlan([], [], {}, 0, [])
    pos = rng.choice([0, 1, 5])
    for _ in range(rng.randint(1, 40)):
        pos += rng.randint(0, 9)  # a gap before the run (0: none)
        n = rng.randint(1, 12)
        run = _hashes(rng, n)
        starts_inside = unit_start(pos, placement.unit_blocks, placement.lead_in) < pos
        key0 = run[0] if not starts_inside else rng.choice([rng.randbytes(16), b""])
        one = plan_put_by_piece(placement, me, put_pieces(placement, run, b"p" * 16, pos, key0), pos, True)
        o = len(hashes)
        expected.owned += [(key, a + o, b + o) for key, a, b in one.owned]
        for a, b in one.replicas:
            put_plan.add_range(expected.replicas, a + o, b + o)
        runs.append((o, pos, key0))
        hashes += run
        pos += n
    plan = plan_runs_arrays(placement, me, hashes, runs)
    assert plan is not None
    assert plan.owned == expected.owned
    assert plan.replicas == expected.replicas
    assert not plan.jobs and plan.forwarded == 0
