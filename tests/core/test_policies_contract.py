"""One contract suite, run unchanged against every policy in `POLICIES`.

Scenarios read as `# insert [1,2,3], touch 1 -> victim 2`. Keys are small bytes here;
the store uses 32-byte keys, but a policy must treat keys as opaque.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.core.policies import (
    DEFAULT_POLICY,
    POLICIES,
    ARCPolicy,
    EvictionPolicy,
    HintedPolicy,
    PrefixAwarePolicy,
    make_policy,
    parse_tier_policies,
)
from kvstore.errors import ConfigError
from tests.fakes import ManualClock, always
from tests.fakes import key as k


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return make_policy(request.param, ManualClock())


def drain(policy: EvictionPolicy) -> list[bytes]:
    """Evict everything, in the policy's order, the way the store's eviction loop does."""
    order = []
    while len(policy):
        key = policy.victim(always)
        assert key is not None
        policy.remove(key)
        order.append(key)
    return order


def test_registry_names_match_the_policies_built() -> None:
    for name, recipe in POLICIES.items():
        assert recipe.name == name == make_policy(name, ManualClock()).name
    assert DEFAULT_POLICY in POLICIES
    # Every base order, bare and under each wrapping; names compose left to right.
    assert set(POLICIES) == {f"{w}{base}" for w in ("", "prefix-", "hint-", "hint-prefix-")
                             for base in ("lru", "arc", "s3fifo")}


def test_a_composed_name_is_its_wrappers_around_its_base() -> None:
    # hint-prefix-arc -> HintedPolicy over PrefixAwarePolicy over ARCPolicy
    policy = make_policy("hint-prefix-arc", ManualClock())
    assert isinstance(policy, HintedPolicy)
    assert isinstance(policy.base, PrefixAwarePolicy) and isinstance(policy.base.base, ARCPolicy)
    assert policy.clock is policy.base.clock is policy.base.base.clock
    assert isinstance(make_policy("prefix-s3fifo", ManualClock()), PrefixAwarePolicy)
    assert not isinstance(make_policy("arc", ManualClock()), (HintedPolicy, PrefixAwarePolicy))


def test_empty_policy_has_no_victim(policy: EvictionPolicy) -> None:
    assert len(policy) == 0
    assert k(1) not in policy
    assert policy.victim(always) is None


def test_insert_tracks_and_reinsert_does_not_duplicate(policy: EvictionPolicy) -> None:
    # insert [1,2], insert 1 again -> two blocks tracked
    policy.insert(k(1))
    policy.insert(k(2))
    policy.insert(k(1))
    assert len(policy) == 2
    assert k(1) in policy and k(2) in policy and k(3) not in policy


def test_oldest_goes_first(policy: EvictionPolicy) -> None:
    # insert [1,2,3] -> victim 1
    for i in (1, 2, 3):
        policy.insert(k(i))
    assert policy.victim(always) == k(1)


def test_touch_protects_a_block(policy: EvictionPolicy) -> None:
    # insert [1,2,3], touch 1 -> victim 2
    for i in (1, 2, 3):
        policy.insert(k(i))
    policy.touch(k(1))
    assert policy.victim(always) == k(2)


def test_victim_does_not_remove(policy: EvictionPolicy) -> None:
    for i in (1, 2, 3):
        policy.insert(k(i))
    first = policy.victim(always)
    assert first is not None
    assert len(policy) == 3 and first in policy


def test_remove_forgets_a_block(policy: EvictionPolicy) -> None:
    # insert [1,2,3], remove 1 -> victim 2
    for i in (1, 2, 3):
        policy.insert(k(i))
    policy.remove(k(1))
    assert k(1) not in policy and len(policy) == 2
    assert policy.victim(always) == k(2)


def test_unknown_keys_are_ignored(policy: EvictionPolicy) -> None:
    # touch 9 and remove 9 on an empty policy -> still empty
    policy.touch(k(9))
    policy.remove(k(9))
    assert len(policy) == 0 and k(9) not in policy
    policy.insert(k(1))
    policy.touch(k(9))
    policy.remove(k(9))
    assert len(policy) == 1 and policy.victim(always) == k(1)


def test_evictable_predicate_is_respected(policy: EvictionPolicy) -> None:
    # insert [1,2,3], only 3 evictable -> victim 3; nothing evictable -> None
    for i in (1, 2, 3):
        policy.insert(k(i))
    assert policy.victim(lambda key: key == k(3)) == k(3)
    assert policy.victim(lambda key: False) is None
    assert len(policy) == 3


def test_pinned_oldest_is_skipped(policy: EvictionPolicy) -> None:
    # insert [1,2,3], 1 pinned -> victim 2
    for i in (1, 2, 3):
        policy.insert(k(i))
    assert policy.victim(lambda key: key != k(1)) == k(2)


def test_drain_evicts_every_block_once(policy: EvictionPolicy) -> None:
    for i in range(20):
        policy.insert(k(i))
    for i in range(0, 20, 3):
        policy.touch(k(i))
    order = drain(policy)
    assert sorted(order) == [k(i) for i in range(20)]
    assert policy.victim(always) is None


def test_chain_inserted_tail_first_loses_its_tail_first(policy: EvictionPolicy) -> None:
    # chain 1 <- 2 <- 3 inserted tail first (3, 2, 1) -> victim 3
    policy.insert(k(3), k(2))
    policy.insert(k(2), k(1))
    policy.insert(k(1), None)
    assert policy.victim(always) == k(3)


def test_hints_and_session_end_are_accepted_by_every_policy(policy: EvictionPolicy) -> None:
    for i in (1, 2, 3):
        policy.insert(k(i))
    policy.hint([k(1), k(2)], "s1", 30.0)
    policy.end_session("s1")
    policy.end_session("never-seen")
    assert len(policy) == 3
    assert sorted(drain(policy)) == [k(1), k(2), k(3)]


ops = st.lists(
    st.tuples(st.sampled_from(["insert", "touch", "remove", "evict"]), st.integers(0, 15)),
    max_size=80,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=40, deadline=None)
@given(script=ops)
def test_random_operations_keep_the_contract(name: str, script: list[tuple[str, int]]) -> None:
    """Against a plain set: same membership, and every victim is tracked and evictable."""
    policy = make_policy(name, ManualClock())
    model: set[bytes] = set()
    for op, i in script:
        key = k(i)
        if op == "insert":
            policy.insert(key, k(i - 1) if i % 4 else None)
            model.add(key)
        elif op == "touch":
            policy.touch(key)
        elif op == "remove":
            policy.remove(key)
            model.discard(key)
        else:
            # Odd keys are pinned: the victim must be an even, tracked key.
            out = policy.victim(lambda b: b[-1] % 2 == 0)
            evictable = {b for b in model if b[-1] % 2 == 0}
            if out is None:
                assert not evictable
            else:
                assert out in evictable
                policy.remove(out)
                model.discard(out)
        assert len(policy) == len(model)
        assert all(b in policy for b in model)


# -- prefix-aware ordering ---------------------------------------------------------------

PREFIX_POLICIES = sorted(n for n in POLICIES if POLICIES[n].prefix)


@pytest.mark.parametrize("name", PREFIX_POLICIES)
def test_prefix_policy_never_evicts_an_ancestor_first(name: str) -> None:
    # chain 1 <- 2 <- 3 inserted head first, touched head first -> victims 3, 2, 1
    policy = make_policy(name, ManualClock())
    policy.insert(k(1), None)
    policy.insert(k(2), k(1))
    policy.insert(k(3), k(2))
    assert drain(policy) == [k(3), k(2), k(1)]


@pytest.mark.parametrize("name", PREFIX_POLICIES)
def test_prefix_policy_evicts_an_inner_block_if_its_descendants_are_pinned(name: str) -> None:
    # chain 1 <- 2, 2 pinned -> victim 1 rather than nothing
    policy = make_policy(name, ManualClock())
    policy.insert(k(1), None)
    policy.insert(k(2), k(1))
    assert policy.victim(lambda key: key != k(2)) == k(1)


# -- configuration -----------------------------------------------------------------------


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        make_policy("mru")


def test_tier_policy_spec() -> None:
    assert parse_tier_policies("host=arc,ssd=lru") == {"host": "arc", "ssd": "lru"}
    assert parse_tier_policies("arc") == {"hbm": "arc", "host": "arc", "ssd": "arc"}
    with pytest.raises(ConfigError, match="unknown tier"):
        parse_tier_policies("disk=lru")
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        parse_tier_policies("host=nope")


def test_touch_many_is_touch_in_order(policy: EvictionPolicy) -> None:
    # insert [1,2,3,4], touch_many [2,1,9] -> the same order as touch 2 then touch 1
    for i in (1, 2, 3, 4):
        policy.insert(k(i))
    policy.touch_many([k(2), k(1), k(9)])
    assert len(policy) == 4
    reference = make_policy(policy.name, ManualClock())
    for i in (1, 2, 3, 4):
        reference.insert(k(i))
    reference.touch(k(2))
    reference.touch(k(1))
    assert drain(policy) == drain(reference)
