"""Per-tenant byte accounting and quotas: the ledger the store keeps for tenants.

Primitives: `add` (a copy landed in or left a tier), `hold`/`release` (bytes on their way
into a tier: a put between reserve and commit, a copy in flight), `exceeded` (why more
bytes would break a quota), `usage`. The store calls these at the points where copies
appear and disappear (kvstore.core.store); the daemon sets `quotas` from its token file
(kvstore.server.auth). Usage is exact payload bytes; held bytes count against quotas only, so
concurrent puts and moves cannot together overshoot one.
"""

from __future__ import annotations

from collections import Counter


class TenantLedger:
    def __init__(self) -> None:
        # tenant -> tier -> bytes; set by the daemon, replaced whole on reload.
        self.quotas: dict[str, dict[str, int]] = {}
        self._used: dict[str, Counter[str]] = {}
        self._incoming: Counter[tuple[str, str]] = Counter()

    def add(self, tenant: str, tier: str, nbytes: int) -> None:
        """A copy of `nbytes` landed in `tier` (negative: one left it)."""
        counts = self._used.get(tenant)
        if counts is None:
            counts = self._used[tenant] = Counter()
        counts[tier] += nbytes

    def used(self, tenant: str, tier: str) -> int:
        counts = self._used.get(tenant)
        return counts[tier] if counts is not None else 0

    def usage(self, tenant: str) -> dict[str, int]:
        """Payload bytes `tenant` holds in each tier (zero tiers left out)."""
        return {tier: n for tier, n in self._used.get(tenant, Counter()).items() if n}

    def tenants(self) -> set[str]:
        return {t for t, counts in self._used.items() if any(counts.values())} | set(self.quotas)

    def quota(self, tenant: str, tier: str) -> int | None:
        return self.quotas.get(tenant, {}).get(tier)

    def incoming(self, tenant: str, tier: str) -> int:
        return self._incoming[tenant, tier]

    def hold(self, tenant: str, tier: str, nbytes: int) -> None:
        """Count `nbytes` on their way into `tier` against the tenant's quota there."""
        self._incoming[tenant, tier] += nbytes

    def release(self, tenant: str, tier: str, nbytes: int) -> None:
        key = (tenant, tier)
        self._incoming[key] -= nbytes
        if self._incoming[key] <= 0:
            del self._incoming[key]

    def exceeded(self, tenant: str, tier: str, nbytes: int) -> str:
        """Why `nbytes` more in `tier` would take `tenant` over its quota; empty if not."""
        quota = self.quota(tenant, tier)
        if quota is None:
            return ""
        used, incoming = self.used(tenant, tier), self.incoming(tenant, tier)
        if used + incoming + nbytes <= quota:
            return ""
        return (f"tenant {tenant!r} is at its {tier} quota: {used} of {quota} bytes used"
                + (f" and {incoming} on their way in" if incoming else "") + f", {nbytes} more needed")
