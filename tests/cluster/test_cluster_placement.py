"""Placement: unit boundaries, rendezvous owners, replicas, hot units and the grace period.

Pure code with a manual clock; the same placement over a live etcd view is tested in
test_cluster_membership.py.
"""

from __future__ import annotations

import random

import pytest

from kvstore.cluster.placement import (
    MAX_PREVIOUS_SETS,
    HotUnits,
    Placement,
    UnitSpan,
    rank,
    score,
    unit_spans,
    unit_start,
)
from kvstore.errors import ConfigError
from tests.fakes import ManualClock


def keys(n: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def test_score_is_xxh3_64_of_id_nul_key() -> None:
    # Pinned vectors: another implementation of the rule must give these numbers.
    assert score("node-a", bytes(16)) == 3193153994170080440
    assert score("node-b", bytes(range(16))) == 13219550479431594645
    assert score("n\u00e9", b"\x01" * 16) == 14833631536336925873  # the id is hashed as UTF-8


def test_rank_is_by_score_and_ignores_input_order() -> None:
    members = [f"n{i}" for i in range(6)]
    for key in keys(50):
        expect = tuple(sorted(members, key=lambda m: -score(m, key))[:3])
        assert rank(members, key, 3) == expect
        assert rank(reversed(members), key, 3) == expect
        assert rank(members, key, 10) == tuple(sorted(members, key=lambda m: -score(m, key)))
    assert rank([], b"k", 2) == ()


def test_units_spread_evenly_over_members() -> None:
    p = Placement(["a", "b", "c"])
    counts = {"a": 0, "b": 0, "c": 0}
    sample = keys(30000)
    for key in sample:
        (owner,) = p.owners(key)
        counts[owner] += 1
    for owned in counts.values():
        assert abs(owned / len(sample) - 1 / 3) < 0.02


def test_a_joining_member_takes_about_one_nth_and_only_from_others() -> None:
    p = Placement(["a", "b", "c"], grace_s=0)
    sample = keys(20000)
    before = {k: p.owners(k)[0] for k in sample}
    assert p.update(["a", "b", "c", "d"])
    after = {k: p.owners(k)[0] for k in sample}
    moved = [k for k in sample if before[k] != after[k]]
    assert abs(len(moved) / len(sample) - 1 / 4) < 0.02
    assert all(after[k] == "d" for k in moved)


def test_a_leaving_member_moves_only_its_own_units() -> None:
    p = Placement(["a", "b", "c", "d"], grace_s=0)
    sample = keys(5000)
    before = {k: p.owners(k)[0] for k in sample}
    p.update(["a", "b", "c"])
    for k in sample:
        if before[k] != "d":
            assert p.owners(k)[0] == before[k]
        else:
            assert p.owners(k)[0] != "d"


def test_replicas_are_distinct_and_extend_the_single_owner() -> None:
    one = Placement(["a", "b", "c", "d"])
    two = Placement(["a", "b", "c", "d"], replicas=2)
    for key in keys(200):
        owners = two.owners(key)
        assert len(owners) == 2 and owners[0] != owners[1]
        assert owners[0] == one.owners(key)[0]
    assert Placement(["a"], replicas=3).owners(b"k" * 16) == ("a",)  # never more owners than members
    assert Placement([]).owners(b"k" * 16) == ()


def test_lead_in_unit_boundaries() -> None:
    # S = 16 with the lead-in: 0 | 1 | 2-3 | 4-7 | 8-15 | 16-31 | 32-47 ...
    starts = [unit_start(p, 16) for p in range(50)]
    assert starts[:16] == [0, 1, 2, 2, 4, 4, 4, 4] + [8] * 8
    assert starts[16:32] == [16] * 16
    assert starts[32:48] == [32] * 16
    # Without the lead-in every unit is S blocks from position 0.
    assert [unit_start(p, 16, lead_in=False) for p in (0, 15, 16, 31, 32)] == [0, 0, 16, 16, 32]
    assert [unit_start(p, 1) for p in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ConfigError):
        unit_start(0, 0)


def test_spans_are_keyed_by_their_first_block() -> None:
    chain = [bytes([i]) * 16 for i in range(20)]
    spans = unit_spans(chain, 4)
    # lead-in for S = 4: 0 | 1 | 2-3 | 4-7 | 8-11 | 12-15 | 16-19
    assert [(s.start, s.stop) for s in spans] == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
    assert all(s.key == chain[s.start] for s in spans)
    assert unit_spans(chain, 8, lead_in=False) == [
        UnitSpan(chain[0], 0, 8), UnitSpan(chain[8], 8, 16), UnitSpan(chain[16], 16, 20)
    ]
    # From a position inside a unit: the span still carries that unit's key.
    assert unit_spans(chain, 8, lead_in=False, first=10)[0] == UnitSpan(chain[8], 10, 16)
    # A short chain ends its last unit early; a longer one with the same prefix keeps the
    # same key for that unit, so its blocks are found where the short one put them.
    assert unit_spans(chain[:6], 4)[-1] == UnitSpan(chain[4], 4, 6)
    assert unit_spans(chain[:10], 4)[3] == UnitSpan(chain[4], 4, 8)


def test_chains_sharing_a_first_block_spread_their_tails() -> None:
    """Chains that share only block 0 (a system prompt): with the lead-in, blocks past it
    are placed by keys that differ per chain; without it, the whole first unit of every
    chain lands on the owner of block 0."""
    members = [f"n{i}" for i in range(8)]
    rng = random.Random(3)
    system = b"\x00" * 16
    chains = [[system] + [rng.randbytes(16) for _ in range(15)] for _ in range(2000)]

    def load(p: Placement) -> dict[str, int]:
        out = dict.fromkeys(members, 0)
        for chain in chains:
            for span in p.spans(chain, first=1):
                out[p.owners(span.key)[0]] += span.stop - span.start
        return out

    flat = load(Placement(members, unit_blocks=16, lead_in=False))
    assert max(flat.values()) == 15 * len(chains)  # one node holds every tail
    spread = load(Placement(members, unit_blocks=16))
    assert max(spread.values()) < 1.3 * sum(spread.values()) / len(members)


def test_grace_period_adds_previous_owners_for_lookups_only() -> None:
    clock = ManualClock(100.0)
    p = Placement(["a", "b", "c"], grace_s=30.0, clock=clock)
    sample = keys(3000)
    before = {k: p.owners(k)[0] for k in sample}
    assert not p.in_grace()
    p.update(["a", "b", "c", "d"])
    assert p.in_grace()
    moved = [k for k in sample if p.owners(k)[0] == "d"]
    assert moved
    for k in moved:
        assert p.owners(k) == ("d",)  # writes go to the new owner only
        assert p.lookup_targets(k) == ("d", before[k])  # lookups also ask the old one
    unmoved = next(k for k in sample if k not in set(moved))
    assert p.lookup_targets(unmoved) == (before[unmoved],)
    clock.now += 29.9
    assert p.lookup_targets(moved[0]) == ("d", before[moved[0]])
    clock.now += 0.2
    assert not p.in_grace()
    assert p.lookup_targets(moved[0]) == ("d",)


def test_an_unchanged_member_set_starts_no_grace_period() -> None:
    clock = ManualClock()
    p = Placement(["a", "b"], clock=clock)
    assert not p.update(["b", "a"])
    assert not p.in_grace()


def test_a_flapping_member_keeps_the_fan_out_bounded() -> None:
    clock = ManualClock()
    members = [f"n{i}" for i in range(12)]
    p = Placement(members[:2], grace_s=60.0, clock=clock)
    for i in range(3, 13):
        clock.now += 1
        p.update(members[:i])
    for key in keys(100):
        assert len(p.lookup_targets(key)) <= 1 + MAX_PREVIOUS_SETS


def test_hot_units_count_decays_and_caps_extra_owners() -> None:
    clock = ManualClock()
    hot = HotUnits(threshold=10, half_life_s=5.0, max_extra=2, clock=clock)
    unit = b"u" * 16
    assert hot.extra_owners(unit) == 0
    for _ in range(10):
        hot.record(unit)
    assert hot.extra_owners(unit) == 1
    hot.record(unit, weight=10)
    assert hot.extra_owners(unit) == 2  # 20 = twice the threshold
    hot.record(unit, weight=1000)
    assert hot.extra_owners(unit) == 2  # capped
    clock.now += 5 * 7  # seven half-lives: 1020 / 128 < 10
    assert hot.count(unit) == pytest.approx(1020 / 128)
    assert hot.extra_owners(unit) == 0


def test_hot_units_stay_bounded_and_keep_the_hottest() -> None:
    clock = ManualClock()
    hot = HotUnits(threshold=5, max_units=100, clock=clock)
    hottest = b"h" * 16
    hot.record(hottest, weight=50)
    for key in keys(1000):
        hot.record(key)
        assert len(hot) <= 100
    assert hot.extra_owners(hottest) >= 1


def test_hot_units_get_the_next_members_in_the_same_ranking() -> None:
    clock = ManualClock()
    hot = HotUnits(threshold=3, clock=clock)
    members = [f"n{i}" for i in range(6)]
    p = Placement(members, hotness=hot, max_extra_owners=2, clock=clock)
    unit = keys(1)[0]
    base = p.owners(unit)
    assert len(base) == 1
    hot.record(unit, weight=3)
    assert p.owners(unit) == rank(members, unit, 2)
    assert p.owners(unit)[0] == base[0]
    hot.record(unit, weight=100)
    assert p.owners(unit) == rank(members, unit, 3)  # capped at R + max_extra_owners
    assert Placement(members, hotness=hot, max_extra_owners=0).owners(unit) == base


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        Placement(["a"], replicas=0)
    with pytest.raises(ConfigError):
        Placement(["a"], unit_blocks=0)
    with pytest.raises(ConfigError):
        HotUnits(threshold=0)


def test_routing_many_units_at_once_answers_as_one_at_a_time() -> None:
    """`route_many` (a lookup's units, scored per member in one native pass) gives each
    unit the owners and lookup targets `owners` / `lookup_targets` give it alone, in and
    out of a grace period, and the owners are those `rank` names."""
    clock = ManualClock(100.0)
    members = ["n0", "n1", "n2"]
    p = Placement(members, grace_s=30.0, clock=clock)
    sample = keys(700, seed=11)
    owners, targets = p.route_many(sample)
    assert [o[0] for o in owners] == [rank(members, k, 1)[0] for k in sample]
    assert owners == [p.owners(k) for k in sample] and targets == [p.lookup_targets(k) for k in sample]
    p.update([*members, "n3"])
    owners, targets = p.route_many(sample)
    assert owners == [p.owners(k) for k in sample] and targets == [p.lookup_targets(k) for k in sample]
    assert any(len(t) == 2 for t in targets)  # previous owners asked in the grace period
    # Keys of another length (none the read path makes) take the per-key path, same answers.
    odd = [k + b"x" for k in sample[:50]]
    assert p.route_many(odd)[0] == [p.owners(k) for k in odd]


def test_only_units_at_the_threshold_are_hot_candidates_and_they_cool() -> None:
    clock = ManualClock()
    hot = HotUnits(threshold=4, half_life_s=1.0, clock=clock)
    cold, warm = keys(2)
    hot.record(cold, weight=3)
    assert not hot.any_hot() and hot.candidates([cold, warm]) == []  # tracked, not hot
    hot.record(warm, weight=4)
    assert hot.any_hot() and hot.candidates([cold, warm, cold]) == [1]
    clock.now += 1.5  # 4 / 2**1.5 < 4: cooled, and forgotten as a candidate
    assert not hot.any_hot() and hot.candidates([warm]) == []
    assert hot.count(warm) == pytest.approx(4 / 2**1.5)  # still counted
    hot.record(warm, weight=3)  # 1.41 + 3 >= 4: hot again
    assert hot.candidates([warm]) == [0] and hot.extra_owners(warm) == 1
    hot.record(cold)  # 3 / 2**1.5 + 1 < 4
    assert hot.candidates([cold, warm]) == [1]


def test_a_hot_unit_among_many_takes_the_ranked_path_with_its_extra_owners() -> None:
    clock = ManualClock()
    hot = HotUnits(threshold=3, clock=clock)
    members = [f"n{i}" for i in range(5)]
    p = Placement(members, hotness=hot, max_extra_owners=2, clock=clock)
    units = keys(40)
    joined = b"".join(units)
    assert p.owner_indices(joined, 16) is not None  # none hot: the array path
    hot.record(units[7], weight=3)
    assert p.owner_indices(joined, 16) is None  # one hot: the ranked path, which gives it two owners
    owners, _ = p.route_many(units)
    assert owners[7] == rank(members, units[7], 2)
    assert all(len(o) == 1 for j, o in enumerate(owners) if j != 7)



def test_owners_of_units_at_positions_of_a_chain_are_those_of_the_units_alone() -> None:
    """`owner_indices` given a packed chain and its units' key positions (the lookup
    round's routing, one native pass) names the owners it names for the keys gathered,
    and those `rank` names; with a previous member set as well."""
    import numpy as np

    clock = ManualClock(100.0)
    members = ["n0", "n1", "n2", "n10"]
    p = Placement(members, grace_s=30.0, clock=clock)
    chain = keys(900, seed=5)
    packed = b"".join(chain)
    positions = np.array(sorted(random.Random(3).sample(range(900), 300)), np.int64)
    gathered = b"".join(chain[i] for i in positions.tolist())
    for _ in range(2):
        at = p.owner_indices(packed, 16, positions)
        alone = p.owner_indices(gathered, 16)
        assert at is not None and alone is not None
        assert at[0] == alone[0] and all((a == b).all() for a, b in zip(at[1], alone[1]))
        assert [at[0][i] for i in at[1][0].tolist()] == [rank(p.members, chain[i], 1)[0] for i in positions.tolist()]
        p.update([*members, "n3"])  # the second pass: in the grace of a change, two sets
    assert len(p.owner_indices(packed, 16, positions)[1]) == 2  # type: ignore[index]


def test_the_native_rendezvous_owner_is_the_first_best_score_and_refuses_bad_arrays() -> None:
    import numpy as np

    from kvstore.native import XXH3, native

    if native is None or not XXH3:
        pytest.skip("the native module is not built here")
    prefixes = [n.encode() + b"\x00" for n in ("a", "b", "c")]
    sample = b"".join(keys(64, seed=9))
    out = np.empty(64, np.int64)
    assert native.rendezvous_best(prefixes, sample, 16, None, out) == 64
    scores = np.empty((3, 64), np.uint64)
    for row, pre in zip(scores, prefixes):
        native.rendezvous_scores(pre, sample, 16, row)
    assert (out == scores.argmax(axis=0)).all()
    # The same prefix twice: equal scores, the earlier wins.
    native.rendezvous_best([prefixes[0], prefixes[0]], sample, 16, None, out)
    assert (out == 0).all()
    one = np.empty(1, np.int64)
    with pytest.raises(IndexError):
        native.rendezvous_best(prefixes, sample, 16, np.array([64], np.int64), one)
    with pytest.raises(TypeError):
        native.rendezvous_best(prefixes, sample, 16, np.array([1, 2], np.int32), one)
    with pytest.raises(ValueError):
        native.rendezvous_best(prefixes, sample, 16, np.array([1, 2], np.int64), one)
