"""Eviction policies, each behind the `EvictionPolicy` interface.

`make_policy(name, clock)` builds one by its configured name. New policies register in
`POLICIES` below (an explicit table, not a decorator registry).
"""

from __future__ import annotations

import time

from kvstore.errors import ConfigError
from kvstore.policies.base import BlockKey, Clock, EvictionPolicy
from kvstore.policies.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
}

DEFAULT_POLICY = "lru"


def make_policy(name: str, clock: Clock = time.monotonic) -> EvictionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of: {known}") from None
    return cls(clock)


__all__ = ["BlockKey", "Clock", "EvictionPolicy", "LRUPolicy", "POLICIES", "DEFAULT_POLICY", "make_policy"]
