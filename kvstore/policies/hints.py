"""Hint-aware protection: a client's "this session comes back within T seconds".

A hint names blocks, a session and a time to live. Until the deadline, a hinted block
that comes up as the base policy's victim is touched instead (a second chance) and the
next candidate is taken, so the base policy evicts around protected blocks. Three limits keep
wrong hints cheap:

* a budget: at most `budget_fraction` of the tracked blocks are protected at once; keys
  of a hint that does not fit are simply not protected (the head of the chain first,
  since a prefix is only worth anything from its first block);
* the deadline: a hint that expires unused leaves its blocks where the base order has
  them (at most one second chance old), and they age out like any other block;
* `end_session`: the client says the session is over and its protection goes at once.

A session holds one grant; a new hint from it replaces the previous one, so a chat that
extends its prefix every turn re-protects the longer chain without piling up grants.
If every evictable block is protected, the base order wins: protection never makes the
store refuse to make room.

Time comes from the injected clock (the trace's clock in a replay).

Primitives: per-session grants (keys, deadline), a per-key protection count, an expiry
heap, and a second chance (a touch in the base order) for a protected victim.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

from kvstore.errors import InvalidArgument
from kvstore.policies.arc import ARCPolicy
from kvstore.policies.base import BlockKey, Clock, EvictionPolicy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.prefix import PrefixARCPolicy, PrefixLRUPolicy, PrefixS3FIFOPolicy
from kvstore.policies.s3fifo import S3FIFOPolicy

DEFAULT_HINT_BUDGET_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class HintStats:
    """Counters of what hints asked for and what they got."""

    hints: int
    keys_hinted: int
    keys_over_budget: int
    sessions_ended: int
    grants_expired: int
    # Times a protected block came up as the victim and was kept.
    second_chances: int
    protected_now: int


@dataclass(frozen=True, slots=True)
class _Grant:
    keys: tuple[BlockKey, ...]
    deadline: float
    seq: int


class HintedPolicy(EvictionPolicy):
    """Protects hinted blocks until their deadline, inside a budget; base order otherwise."""

    name = "hint"
    base_policy: ClassVar[type[EvictionPolicy]] = LRUPolicy

    def __init__(
        self,
        clock: Clock = time.monotonic,
        base: EvictionPolicy | None = None,
        budget_fraction: float = DEFAULT_HINT_BUDGET_FRACTION,
    ) -> None:
        super().__init__(clock)
        if not 0.0 <= budget_fraction <= 1.0:
            raise InvalidArgument(
                f"hint budget fraction must be within [0, 1], got {budget_fraction!r}"
            )
        self._base = base if base is not None else self.base_policy(clock)
        self.budget_fraction = budget_fraction
        self._grants: dict[str, _Grant] = {}
        self._protected: dict[BlockKey, int] = {}
        # (deadline, seq, session): stale entries are skipped by comparing seq.
        self._expiry: list[tuple[float, int, str]] = []
        self._seq = 0
        self._hints = 0
        self._keys_hinted = 0
        self._keys_over_budget = 0
        self._sessions_ended = 0
        self._grants_expired = 0
        self._second_chances = 0

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
        room = int(self.budget_fraction * len(self._base)) - len(self._protected)
        granted: list[BlockKey] = []
        for key in wanted:
            if key in self._protected:
                self._protected[key] += 1
                granted.append(key)
            elif room > 0:
                self._protected[key] = 1
                granted.append(key)
                room -= 1
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
            second_chances=self._second_chances,
            protected_now=len(self._protected),
        )

    def _release(self, session_id: str) -> bool:
        grant = self._grants.pop(session_id, None)
        if grant is None:
            return False
        protected = self._protected
        for key in grant.keys:
            left = protected[key] - 1
            if left:
                protected[key] = left
            else:
                del protected[key]
        return True

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, seq, session_id = heapq.heappop(expiry)
            grant = self._grants.get(session_id)
            if grant is not None and grant.seq == seq:
                self._release(session_id)
                self._grants_expired += 1

    # -- ordering ------------------------------------------------------------------

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        self._base.insert(key, parent)

    def touch(self, key: BlockKey) -> None:
        self._base.touch(key)

    def remove(self, key: BlockKey) -> None:
        self._base.remove(key)

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        self._expire(self.clock())
        protected = self._protected
        # A protected block that comes up as the victim gets a second chance (a touch)
        # instead of being skipped in place: skipping would rescan every protected block
        # at the cold end on every eviction. Each pass moves one protected block away,
        # so the loop is bounded; if all that is evictable is protected, base order wins.
        for _ in range(2 * len(protected) + 1):
            key = self._base.victim(evictable)
            if key is None or key not in protected:
                return key
            self._base.touch(key)
            self._second_chances += 1
        return self._base.victim(evictable)

    def __len__(self) -> int:
        return len(self._base)

    def __contains__(self, key: object) -> bool:
        return key in self._base


class HintedLRUPolicy(HintedPolicy):
    name = "hint-lru"
    base_policy = LRUPolicy


class HintedARCPolicy(HintedPolicy):
    name = "hint-arc"
    base_policy = ARCPolicy


class HintedS3FIFOPolicy(HintedPolicy):
    name = "hint-s3fifo"
    base_policy = S3FIFOPolicy


class HintedPrefixLRUPolicy(HintedPolicy):
    name = "hint-prefix-lru"
    base_policy = PrefixLRUPolicy


class HintedPrefixARCPolicy(HintedPolicy):
    name = "hint-prefix-arc"
    base_policy = PrefixARCPolicy


class HintedPrefixS3FIFOPolicy(HintedPolicy):
    name = "hint-prefix-s3fifo"
    base_policy = PrefixS3FIFOPolicy
