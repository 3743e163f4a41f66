"""Hint-aware protection: deadlines on a fake clock, the budget, expiry, end_session."""

from __future__ import annotations

import math

import pytest

from kvstore.core.policies import POLICIES, HintedPolicy, make_policy
from kvstore.errors import ConfigError, InvalidArgument
from tests.fakes import ManualClock, always
from tests.fakes import key as k

HINTED = sorted(n for n in POLICIES if POLICIES[n].hint)




def filled(name: str, clock: ManualClock, n: int = 4, budget: float = 0.5) -> HintedPolicy:
    policy = make_policy(name, clock, hint_budget_fraction=budget)
    assert isinstance(policy, HintedPolicy)
    for i in range(1, n + 1):
        policy.insert(k(i))
    return policy


def test_every_base_has_a_hinted_variant() -> None:
    assert {"hint-lru", "hint-arc", "hint-s3fifo"} <= set(HINTED)


@pytest.mark.parametrize("name", HINTED)
def test_hinted_block_is_protected_until_its_deadline(name: str) -> None:
    # insert [1,2,3,4], hint 1 for 10 s -> victim 2; 10 s later -> victim 1 again
    clock = ManualClock(100.0)
    policy = filled(name, clock)
    policy.hint([k(1)], "s", 10.0)
    assert policy.is_protected(k(1))
    assert policy.victim(always) == k(2)
    clock.now += 9.0
    assert policy.is_protected(k(1))
    assert policy.victim(always) == k(2)
    clock.now += 1.0
    assert not policy.is_protected(k(1))
    assert policy.hint_stats().grants_expired == 1


@pytest.mark.parametrize("name", HINTED)
def test_end_session_releases_protection(name: str) -> None:
    # insert [1,2,3,4], hint 1, end the session -> 1 is no longer protected
    clock = ManualClock(100.0)
    policy = filled(name, clock)
    policy.hint([k(1)], "s", 60.0)
    policy.end_session("s")
    assert not policy.is_protected(k(1))
    assert policy.hint_stats().sessions_ended == 1
    assert policy.hint_stats().protected_now == 0


def test_expired_hint_falls_back_to_base_order() -> None:
    # LRU base: insert [1,2,3,4], hint 1 for 5 s, 5 s pass -> 1 is back in the LRU order,
    # as if inserted at expiry: victims 2, 3, 4, 1
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock)
    policy.hint([k(1)], "s", 5.0)
    clock.now += 5.0
    order = []
    while len(policy):
        v = policy.victim(always)
        assert v is not None
        policy.remove(v)
        order.append(v)
    assert order == [k(2), k(3), k(4), k(1)]


def test_protected_blocks_go_last_when_nothing_else_is_evictable() -> None:
    # hint 1 and 2, pin 3 and 4 -> victim 1 (oldest grant), not None
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock, budget=1.0)
    policy.hint([k(1), k(2)], "s", 60.0)
    assert policy.victim(lambda key: key in (k(1), k(2))) == k(1)
    assert policy.victim(lambda key: False) is None


def test_hint_before_insert_protects_the_block_when_it_arrives() -> None:
    # hint 9 (not yet tracked), insert 9 -> 9 is protected, victim 1
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock, budget=1.0)
    policy.hint([k(9)], "s", 60.0)
    policy.insert(k(9))
    assert k(9) in policy and len(policy) == 5
    assert policy.victim(always) == k(1)
    assert policy.hint_stats().parked_now == 1


def test_without_hints_the_order_is_the_base_order() -> None:
    clock = ManualClock(100.0)
    hinted = filled("hint-arc", clock, n=6)
    plain = make_policy("arc", clock)
    for i in range(1, 7):
        plain.insert(k(i))
    for policy in (hinted, plain):
        policy.touch(k(2))
        policy.touch(k(5))
    order = []
    for policy in (hinted, plain):
        seq = []
        while len(policy):
            v = policy.victim(always)
            assert v is not None
            policy.remove(v)
            seq.append(v)
        order.append(seq)
    assert order[0] == order[1]


def test_budget_caps_protection_head_of_chain_first() -> None:
    # 4 blocks, budget 50% -> a hint on [1,2,3,4] protects 1 and 2 only
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock, n=4, budget=0.5)
    policy.hint([k(1), k(2), k(3), k(4)], "s", 60.0)
    assert [policy.is_protected(k(i)) for i in (1, 2, 3, 4)] == [True, True, False, False]
    stats = policy.hint_stats()
    assert stats.keys_hinted == 4 and stats.keys_over_budget == 2 and stats.protected_now == 2
    assert policy.victim(always) == k(3)


def test_budget_is_shared_between_sessions() -> None:
    # 4 blocks, budget 50%: session a takes 1 and 2, session b gets nothing for 3
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock, n=4, budget=0.5)
    policy.hint([k(1), k(2)], "a", 60.0)
    policy.hint([k(3)], "b", 60.0)
    assert not policy.is_protected(k(3))
    # a's session ends -> the budget is free again for b
    policy.end_session("a")
    policy.hint([k(3)], "b", 60.0)
    assert policy.is_protected(k(3))


def test_zero_budget_disables_protection() -> None:
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock, budget=0.0)
    policy.hint([k(1)], "s", 60.0)
    assert policy.victim(always) == k(1)


def test_a_new_hint_replaces_the_sessions_previous_one() -> None:
    # hint 1 then hint 2 from the same session -> only 2 is protected; 1 went back into
    # the LRU order as newest on release -> victim 3
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock)
    policy.hint([k(1)], "s", 60.0)
    policy.hint([k(2)], "s", 60.0)
    assert not policy.is_protected(k(1)) and policy.is_protected(k(2))
    assert policy.victim(always) == k(3)


def test_shared_block_stays_protected_while_any_session_holds_it() -> None:
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock, budget=1.0)
    policy.hint([k(1), k(2)], "a", 60.0)
    policy.hint([k(1), k(3)], "b", 60.0)
    policy.end_session("a")
    assert policy.is_protected(k(1)) and not policy.is_protected(k(2))
    policy.end_session("b")
    assert not policy.is_protected(k(1))


def test_when_everything_is_protected_the_base_order_still_evicts() -> None:
    # budget 100%, all four hinted -> the store can still make room: victim 1
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock, budget=1.0)
    policy.hint([k(i) for i in (1, 2, 3, 4)], "s", 60.0)
    assert policy.victim(always) is not None


def test_protection_respects_the_evictable_predicate() -> None:
    # 1 hinted, 2 pinned -> victim 3
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock)
    policy.hint([k(1)], "s", 60.0)
    assert policy.victim(lambda key: key != k(2)) == k(3)


def test_expired_grant_does_not_release_a_newer_one() -> None:
    # hint 1 for 5 s, then re-hint 1 for 60 s -> still protected after 10 s
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock)
    policy.hint([k(1)], "s", 5.0)
    policy.hint([k(1)], "s", 60.0)
    clock.now += 10.0
    assert policy.is_protected(k(1))


@pytest.mark.parametrize("ttl", [0.0, -1.0, math.nan, math.inf])
def test_bad_time_to_live_is_rejected(ttl: float) -> None:
    policy = filled("hint-lru", ManualClock(100.0))
    with pytest.raises(InvalidArgument, match="expect_reuse_within_s"):
        policy.hint([k(1)], "s", ttl)


def test_empty_session_id_is_rejected() -> None:
    policy = filled("hint-lru", ManualClock(100.0))
    with pytest.raises(InvalidArgument, match="session_id"):
        policy.hint([k(1)], "", 10.0)


@pytest.mark.parametrize("budget", [-0.1, 1.5])
def test_bad_budget_is_a_config_error(budget: float) -> None:
    with pytest.raises(ConfigError, match="budget"):
        make_policy("hint-lru", ManualClock(100.0), hint_budget_fraction=budget)


def test_unused_hints_lose_trust_and_budget() -> None:
    # 20 blocks, budget 100%: twenty hints that expire unused -> trust falls, and a hint
    # on all 20 blocks then protects only a few
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock, n=20, budget=1.0)
    for i in range(20):
        policy.hint([k(1)], f"s{i}", 1.0)
        clock.now += 2.0
    stats = policy.hint_stats()
    assert stats.grants_unused == 20 and stats.grants_used == 0
    assert stats.trust < 0.4
    policy.hint([k(i) for i in range(1, 21)], "big", 60.0)
    assert policy.hint_stats().protected_now <= int(2 * stats.trust * 20)


def test_used_hints_keep_trust() -> None:
    # each hinted block is hit before its grant expires -> trust stays 1, full budget
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock, n=20, budget=1.0)
    for i in range(20):
        policy.hint([k(1)], f"s{i}", 1.0)
        policy.touch(k(1))
        clock.now += 2.0
    stats = policy.hint_stats()
    assert stats.grants_used == 20 and stats.trust == pytest.approx(1.0)
    policy.hint([k(i) for i in range(1, 21)], "big", 60.0)
    assert policy.hint_stats().protected_now == 20


def test_trust_never_drops_below_the_floor() -> None:
    clock = ManualClock(100.0)
    policy = filled("hint-lru", clock, n=100, budget=1.0)
    for i in range(200):
        policy.hint([k(1)], f"s{i}", 1.0)
        clock.now += 2.0
    policy.hint([k(i) for i in range(1, 101)], "big", 60.0)
    # the floor still grants a tenth of the budget, so evidence keeps coming
    assert policy.hint_stats().protected_now == 10
