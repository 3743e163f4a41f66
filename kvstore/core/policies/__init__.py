"""Eviction policies, each behind the `EvictionPolicy` interface.

`make_policy(name, clock)` builds one by its configured name; `parse_tier_policies`
reads a per-tier choice such as ``host=arc,ssd=lru``. New policies register in
`POLICIES` below (an explicit table, not a decorator registry).

Names compose left to right: ``hint-`` protects hinted blocks, ``prefix-`` keeps
ancestors while a descendant stays, and the last word is the base order.
"""

from __future__ import annotations

import time

from kvstore.core.policies.arc import ARCPolicy
from kvstore.core.policies.base import BlockKey, Clock, EvictionPolicy
from kvstore.core.policies.hints import (
    DEFAULT_HINT_BUDGET_FRACTION,
    HintedARCPolicy,
    HintedLRUPolicy,
    HintedPolicy,
    HintedPrefixARCPolicy,
    HintedPrefixLRUPolicy,
    HintedPrefixS3FIFOPolicy,
    HintedS3FIFOPolicy,
    HintStats,
)
from kvstore.core.policies.lru import LRUPolicy
from kvstore.core.policies.prefix import PrefixARCPolicy, PrefixAwarePolicy, PrefixLRUPolicy, PrefixS3FIFOPolicy
from kvstore.core.policies.s3fifo import S3FIFOPolicy
from kvstore.errors import ConfigError

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (
        LRUPolicy,
        ARCPolicy,
        S3FIFOPolicy,
        PrefixLRUPolicy,
        PrefixARCPolicy,
        PrefixS3FIFOPolicy,
        HintedLRUPolicy,
        HintedARCPolicy,
        HintedS3FIFOPolicy,
        HintedPrefixLRUPolicy,
        HintedPrefixARCPolicy,
        HintedPrefixS3FIFOPolicy,
    )
}

# Measured on the conversation trace (docs/policies.md): ARC is the best order without
# hints at 5-10% of the distinct blocks and on average over 1-50%, and the hint wrapper
# is inert until a client sends hints, so clients that never do pay nothing for it.
DEFAULT_POLICY = "hint-arc"

TIERS = ("hbm", "host", "ssd")


def make_policy(
    name: str,
    clock: Clock = time.monotonic,
    *,
    hint_budget_fraction: float = DEFAULT_HINT_BUDGET_FRACTION,
) -> EvictionPolicy:
    """The policy registered as `name`; `hint_budget_fraction` applies to ``hint-*`` ones."""
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of: {known}") from None
    if issubclass(cls, HintedPolicy):
        if not 0.0 <= hint_budget_fraction <= 1.0:
            raise ConfigError(
                f"hint budget fraction must be within [0, 1], got {hint_budget_fraction!r}"
            )
        return cls(clock, budget_fraction=hint_budget_fraction)
    return cls(clock)


def parse_tier_policies(spec: str) -> dict[str, str]:
    """``"host=arc,ssd=lru"`` -> ``{"host": "arc", "ssd": "lru"}``, validated.

    A bare name (``"arc"``) applies to every tier. Tiers not named keep the default.
    """
    out: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        tier, sep, name = part.partition("=")
        if not sep:
            tier, name = "*", tier
        tier, name = tier.strip(), name.strip()
        if tier != "*" and tier not in TIERS:
            raise ConfigError(f"unknown tier {tier!r} in policy spec {spec!r}; tiers are: {', '.join(TIERS)}")
        if name not in POLICIES:
            known = ", ".join(sorted(POLICIES))
            raise ConfigError(f"unknown eviction policy {name!r} in {spec!r}; choose one of: {known}")
        if tier == "*":
            out.update({t: name for t in TIERS})
        else:
            out[tier] = name
    return out


__all__ = [
    "ARCPolicy",
    "BlockKey",
    "Clock",
    "DEFAULT_HINT_BUDGET_FRACTION",
    "DEFAULT_POLICY",
    "EvictionPolicy",
    "HintStats",
    "HintedPolicy",
    "LRUPolicy",
    "POLICIES",
    "PrefixAwarePolicy",
    "S3FIFOPolicy",
    "TIERS",
    "make_policy",
    "parse_tier_policies",
]
