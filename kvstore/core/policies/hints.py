"""Hint-aware protection: a client's "this session comes back within T seconds".

A hint names blocks, a session and a time to live. Until the deadline those blocks are
taken out of the base policy's order ("parked"), so the base policy evicts around them
at its usual cost; when protection ends they go back into the base order as if just
inserted. Three limits keep wrong hints cheap:

* a budget: at most `budget_fraction` of the tracked blocks are protected at once; keys
  of a hint that does not fit are simply not protected (the head of the chain first,
  since a prefix is only worth anything from its first block);
* the deadline: a hint that expires unused hands its blocks back to the base order,
  where they age out like any block inserted at that moment;
* `end_session`: the client says the session is over and its protection goes at once;
* trust: the policy keeps a running score of how often a grant was used (its deepest
  block hit before the grant ended). Below TRUST_FOR_FULL_BUDGET the budget shrinks
  with it, down to a floor that
  keeps a few grants flowing so that the score can recover. A client whose hints are
  mostly wrong thus loses most of its protection instead of halving the tier.

A session holds one grant; a new hint from it replaces the previous one, so a chat that
extends its prefix every turn re-protects the longer chain without piling up grants.
If every evictable block is protected, the parked blocks are evicted oldest grant first:
protection never makes the store refuse to make room.

Time comes from the injected clock (the trace's clock in a replay).

Primitives: per-session grants (keys, deadline), a per-key protection count, an expiry
heap, and the parked blocks (protected and tracked), kept out of the base order.

Parking rather than skipping: a filter in `victim` would rescan every protected block at
the cold end on every eviction, and a touch-on-sight second chance can cycle forever
inside one ARC list while unprotected blocks wait in the other.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvstore.core.policies.base import BlockKey, EvictionPolicy, Rows
from kvstore.core.table import BlockTable
from kvstore.errors import InvalidArgument

DEFAULT_HINT_BUDGET_FRACTION = 0.8
# Trust is an exponential moving average over grant outcomes (1 used, 0 not): about the
# last 1/ALPHA grants count. The floor keeps some grants, hence evidence, coming.
TRUST_ALPHA = 0.05
TRUST_FLOOR = 0.1
# Hints used at least this often keep the whole budget: a protected block that comes
# back half the time is worth more than the average block the base order would keep.
TRUST_FOR_FULL_BUDGET = 0.5
_MISSING = object()


@dataclass(frozen=True, slots=True)
class HintStats:
    """Counters of what hints asked for and what they got."""

    hints: int
    keys_hinted: int
    keys_over_budget: int
    sessions_ended: int
    grants_expired: int
    # Grants that ended (expired, ended, replaced) with or without a hit on their blocks.
    grants_used: int
    grants_unused: int
    # Running share of grants used; scales the budget.
    trust: float
    protected_now: int
    # Protected blocks that are tracked in this tier now.
    parked_now: int


@dataclass(frozen=True, slots=True)
class _Grant:
    keys: tuple[BlockKey, ...]
    deadline: float
    seq: int


class HintedPolicy(EvictionPolicy):
    """Protects hinted blocks until their deadline, inside a budget; `base`'s order
    otherwise. Named ``hint-`` and its base's name; reads time from its base's clock."""

    # What this wrapper puts before its base's name.
    word: ClassVar[str] = "hint"

    def __init__(self, base: EvictionPolicy, budget_fraction: float = DEFAULT_HINT_BUDGET_FRACTION) -> None:
        super().__init__(base.clock)
        if not 0.0 <= budget_fraction <= 1.0:
            raise InvalidArgument(
                f"hint budget fraction must be within [0, 1], got {budget_fraction!r}"
            )
        self.name = f"{self.word}-{base.name}"
        self._base = base
        self.budget_fraction = budget_fraction
        self._grants: dict[str, _Grant] = {}
        self._protected: dict[BlockKey, int] = {}
        # Tracked blocks out of the base order while protected, with their parents (as
        # the base policy kept them), to hand a parked block back with its chain. The
        # other tracked blocks are the base policy's: no per-block table of our own.
        self._parked: dict[BlockKey, BlockKey | None] = {}
        # (deadline, seq, session): stale entries are skipped by comparing seq.
        self._expiry: list[tuple[float, int, str]] = []
        self._seq = 0
        self._hints = 0
        self._keys_hinted = 0
        self._keys_over_budget = 0
        self._sessions_ended = 0
        self._grants_expired = 0
        self._grants_used = 0
        self._grants_unused = 0
        self._trust = 1.0
        # Protected blocks hit while protected: their grants were worth it.
        self._hit_protected: set[BlockKey] = set()

    @property
    def base(self) -> EvictionPolicy:
        """The policy this one wraps."""
        return self._base

    # -- hints ---------------------------------------------------------------------

    def hint(
        self,
        keys: Iterable[BlockKey],
        session_id: str,
        expect_reuse_within_s: float,
    ) -> None:
        if not session_id:
            raise InvalidArgument("a hint needs a non-empty session_id; send one per conversation")
        if not (math.isfinite(expect_reuse_within_s) and expect_reuse_within_s > 0):
            raise InvalidArgument(
                "expect_reuse_within_s must be a positive number of seconds, "
                f"got {expect_reuse_within_s!r}"
            )
        now = self.clock()
        self._expire(now)
        self._release(session_id)
        self._hints += 1
        wanted = list(dict.fromkeys(keys))
        self._keys_hinted += len(wanted)
        scale = min(1.0, max(self._trust / TRUST_FOR_FULL_BUDGET, TRUST_FLOOR))
        budget = self.budget_fraction * scale * len(self)
        room = int(budget) - len(self._protected)
        granted: list[BlockKey] = []
        for key in wanted:
            if key in self._protected:
                self._protected[key] += 1
                granted.append(key)
            elif room > 0:
                self._protected[key] = 1
                granted.append(key)
                room -= 1
                if key in self._base:
                    self._parked[key] = self._base.parent_of(key)
                    self._base.remove(key)
            else:
                self._keys_over_budget += 1
        if not granted:
            return
        self._seq += 1
        grant = _Grant(keys=tuple(granted), deadline=now + expect_reuse_within_s, seq=self._seq)
        self._grants[session_id] = grant
        heapq.heappush(self._expiry, (grant.deadline, grant.seq, session_id))

    def end_session(self, session_id: str) -> None:
        if self._release(session_id):
            self._sessions_ended += 1

    def is_protected(self, key: BlockKey) -> bool:
        """Whether a live hint protects `key` now."""
        self._expire(self.clock())
        return key in self._protected

    def hint_stats(self) -> HintStats:
        self._expire(self.clock())
        return HintStats(
            hints=self._hints,
            keys_hinted=self._keys_hinted,
            keys_over_budget=self._keys_over_budget,
            sessions_ended=self._sessions_ended,
            grants_expired=self._grants_expired,
            grants_used=self._grants_used,
            grants_unused=self._grants_unused,
            trust=self._trust,
            protected_now=len(self._protected),
            parked_now=len(self._parked),
        )

    def _release(self, session_id: str) -> bool:
        grant = self._grants.pop(session_id, None)
        if grant is None:
            return False
        protected = self._protected
        hit = self._hit_protected
        # Used means the deepest protected block was hit: a session coming back to
        # where it left off. Its head blocks are often shared (a system prompt) and hit
        # by everyone, which says nothing about the hint.
        used = grant.keys[-1] in hit
        for key in grant.keys:
            left = protected[key] - 1
            if left:
                protected[key] = left
            else:
                del protected[key]
                hit.discard(key)
                if key in self._parked:
                    self._base.insert(key, self._parked.pop(key))
        if used:
            self._grants_used += 1
        else:
            self._grants_unused += 1
        self._trust += TRUST_ALPHA * ((1.0 if used else 0.0) - self._trust)
        return True

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, seq, session_id = heapq.heappop(expiry)
            grant = self._grants.get(session_id)
            if grant is not None and grant.seq == seq:
                self._release(session_id)
                self._grants_expired += 1

    # -- rows (the store's fast paths): straight to the base while no hint is live

    def bind(self, table: BlockTable) -> None:
        super().bind(table)
        self._base.bind(table)

    def insert_rows(self, rows: Rows) -> None:
        if not self._protected and not self._parked:
            self._base.insert_rows(rows)
        else:
            super().insert_rows(rows)

    def touch_rows(self, rows: Rows) -> None:
        if not self._protected and not self._parked:
            self._base.touch_rows(rows)
        else:
            super().touch_rows(rows)

    def remove_row(self, row: int) -> None:
        if not self._parked:
            self._base.remove_row(row)
        else:
            super().remove_row(row)

    def victim_row(self, evictable: Callable[[int], bool]) -> int | None:
        self._expire(self.clock())
        row = self._base.victim_row(evictable)
        if row is not None:
            return row
        t = self._bound()
        for key in self._parked:  # only protected blocks are evictable: the oldest parked one
            row = t.find_key(key)
            if evictable(row):
                return row
        return None

    # -- ordering ------------------------------------------------------------------

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        if key in self._parked or key in self._base:
            self.touch(key)
            return
        if key in self._protected:
            # Hinted before it became READY: protected from the start.
            self._parked[key] = parent
        else:
            self._base.insert(key, parent)

    def insert_many(self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> None:
        if not self._protected and not self._parked:  # no live hints: straight to the base
            self._base.insert_many(keys, parents)
            return
        super().insert_many(keys, parents)

    def touch(self, key: BlockKey) -> None:
        if key in self._protected:
            self._hit_protected.add(key)
        if key not in self._parked:
            self._base.touch(key)

    def touch_many(self, keys: Iterable[BlockKey]) -> None:
        if not self._protected and not self._parked:  # no live hints: straight to the base
            self._base.touch_many(keys)
            return
        passthrough = []
        for key in keys:
            if key in self._protected:
                self._hit_protected.add(key)
            if key not in self._parked:
                passthrough.append(key)
        self._base.touch_many(passthrough)

    def remove(self, key: BlockKey) -> None:
        if self._parked.pop(key, _MISSING) is _MISSING:
            self._base.remove(key)

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        self._expire(self.clock())
        key = self._base.victim(evictable)
        if key is not None:
            return key
        # Only protected blocks are evictable: the oldest parked one goes.
        for key in self._parked:
            if evictable(key):
                return key
        return None

    def parent_of(self, key: BlockKey) -> BlockKey | None:
        if key in self._parked:
            return self._parked[key]
        return self._base.parent_of(key)

    def __len__(self) -> int:
        return len(self._base) + len(self._parked)

    def __contains__(self, key: object) -> bool:
        return key in self._parked or key in self._base

