"""Placement without a directory: which nodes own a run of blocks, by rendezvous hashing.

Every node computes the same owners from the same member set, so no metadata server holds
"where is block X" (ARCHITECTURE.md section 8). The pieces:

* **Placement unit.** A chain is cut into units and each unit is placed as a whole, so a
  long prompt touches few nodes. A unit is keyed by the hash of its first block, which
  already encodes the whole prefix before it. Unit boundaries depend only on a block's
  position in the chain: with `lead_in` (the default) the first units grow 1, 1, 2, 4, ...
  blocks up to `unit_blocks` (S, default 2), then every unit is S blocks; without it
  every unit is S blocks from position 0. The lead-in exists because many chains share their first
  blocks (a system prompt): a unit that begins inside the shared part has the same key in
  every chain, so all its non-shared blocks would land on one node. Short units at the
  head bound that pile-up to the unit's length.
* **Rendezvous (highest-random-weight) hashing.** A member's score for a unit is
  ``xxh3_64(utf8(node_id) || 0x00 || unit_key)`` read as an unsigned 64-bit integer (seed
  0); the owners are the members with the highest scores, ties broken by node id in byte
  order. Deterministic across processes and languages (never Python's ``hash()``). When a
  member comes or goes, only the units it wins or held move: about 1/N of them.
* **Replication.** `replicas` (R) owners per unit, plus up to `max_extra_owners` more for
  units a `Hotness` signal calls hot. The extra owners are the next members in the same
  ranking, so nodes that disagree on a unit's hotness still agree on the order: one
  that thinks a unit is hot asks a superset of the owners another one writes to.
* **Grace after a change.** `update` keeps the member sets of the last changes for
  `grace_s`. `owners(unit)` answers from the current set (where writes go);
  `lookup_targets(unit)` adds the owners under each previous set still in its grace
  period, since a node that just joined does not hold its units yet while the node that
  held them still does.

Pure and synchronous; time only through the `clock` passed in. Primitives: `UnitSpan`,
`unit_start`, `unit_stop`, `unit_spans`, `score`, `rank`, `Hotness`, `HotUnits`, `Placement`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import xxhash

from kvstore.errors import ConfigError
from kvstore.hashing import split_hashes
from kvstore.native import XXH3, native

# Smaller units keep a pool's hit ratio closer to one shared cache, larger ones touch
# fewer nodes per prompt and cost a lookup less work per block; docs/cluster.md has the
# measurements behind 2 (the smallest S at or above 0.95x one shared cache at 3 and 8 nodes).
DEFAULT_UNIT_BLOCKS = 2
DEFAULT_REPLICAS = 1
DEFAULT_MAX_EXTRA_OWNERS = 2
DEFAULT_GRACE_S = 30.0
# How many member sets from past changes a placement remembers (within the grace period):
# a flapping node must not grow the fan-out of every lookup without bound.
MAX_PREVIOUS_SETS = 4

_SEPARATOR = b"\x00"
_score64 = xxhash.xxh3_64_intdigest
_RENDEZVOUS_BEST = getattr(native, "rendezvous_best", None) if XXH3 else None


# -- units ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UnitSpan:
    """One placement unit of a chain: its key and the positions [start, stop) it covers
    in the chain that was cut (stop is short of a full unit at the chain's end)."""

    key: bytes
    start: int
    stop: int


def _check_unit_blocks(unit_blocks: int) -> None:
    if unit_blocks < 1:
        raise ConfigError(f"a placement unit needs at least one block, got unit_blocks={unit_blocks}")


def unit_start(position: int, unit_blocks: int = DEFAULT_UNIT_BLOCKS, lead_in: bool = True) -> int:
    """The position of the first block of the unit that holds block `position`."""
    _check_unit_blocks(unit_blocks)
    if position < 0:
        raise ValueError(f"a block position is >= 0, got {position}")
    if lead_in and position < unit_blocks:
        # Lead-in boundaries: 0, 1, 2, 4, 8, ... below S.
        return 0 if position == 0 else 1 << (position.bit_length() - 1)
    if lead_in:
        return unit_blocks + (position - unit_blocks) // unit_blocks * unit_blocks
    return position // unit_blocks * unit_blocks


def unit_stop(start: int, unit_blocks: int = DEFAULT_UNIT_BLOCKS, lead_in: bool = True) -> int:
    """The position just past the unit that starts at position `start` (a unit boundary)."""
    if lead_in and start < unit_blocks:
        return min(max(1, start * 2), unit_blocks)
    return start + unit_blocks


_unit_stop = unit_stop


def unit_spans(
    hashes: Sequence[bytes], unit_blocks: int = DEFAULT_UNIT_BLOCKS, lead_in: bool = True, first: int = 0
) -> list[UnitSpan]:
    """The units covering positions [first, len(hashes)) of a chain, in chain order.

    The first span starts at `first`, possibly inside a unit: its key is still the hash of
    that unit's first block (the caller holds the whole chain)."""
    _check_unit_blocks(unit_blocks)
    n = len(hashes)
    out: list[UnitSpan] = []
    pos = first
    while pos < n:
        start = unit_start(pos, unit_blocks, lead_in)
        stop = min(_unit_stop(start, unit_blocks, lead_in), n)
        out.append(UnitSpan(hashes[start], pos, stop))
        pos = stop
    return out


# -- rendezvous ----------------------------------------------------------------------


def score(node_id: str, unit_key: bytes) -> int:
    """A member's rendezvous score for a unit: xxh3-64 of ``utf8(node_id) || 0x00 || unit_key``."""
    return _score64(node_id.encode() + _SEPARATOR + unit_key)


def rank(node_ids: Iterable[str], unit_key: bytes, count: int) -> tuple[str, ...]:
    """The `count` members with the highest scores for `unit_key`, best first."""
    return _Ranker(frozenset(node_ids)).top(unit_key, count)


class _Ranker:
    """`rank` over one fixed member set, with each member's bytes encoded once."""

    __slots__ = ("members", "_encoded", "_prefixes", "_names")

    def __init__(self, members: frozenset[str]) -> None:
        self.members = members
        self._encoded = [(n.encode(), n) for n in sorted(members)]
        self._prefixes = [raw + _SEPARATOR for raw, _ in self._encoded]
        self._names = [n for _, n in self._encoded]

    def best_many(self, unit_keys: Sequence[bytes]) -> list[str]:
        """`top(key, 1)[0]` of each key (empty names without members): the scores of every
        member for every key in one pass each, the best found by one vectorized step.
        Members are in byte order and argmax keeps the first of equal scores, which is the
        tie rule of `top`."""
        names = self._names
        if len(names) <= 1:
            return [names[0] if names else ""] * len(unit_keys)
        n = len(unit_keys)
        size = len(unit_keys[0]) if n else 0
        if n and all(len(k) == size for k in unit_keys):
            best = self.best_index_many(b"".join(unit_keys), size)
            if best is not None:
                return [names[i] for i in best.tolist()]
        scores = np.array([[_score64(pre + k) for k in unit_keys] for pre in self._prefixes], dtype=np.uint64)
        return [names[i] for i in scores.argmax(axis=0).tolist()]

    def best_index_many(self, joined: bytes, size: int,
                        positions: np.ndarray[Any, Any] | None = None) -> np.ndarray[Any, Any] | None:
        """`best_many` of the `size`-byte keys laid end to end in `joined` (those at
        `positions`, int64, where given), as indices into `names` (-1 without members);
        None where the native hash is not built."""
        names = self._names
        n = len(positions) if positions is not None else len(joined) // size if size else 0
        if len(names) <= 1:
            return np.full(n, 0 if names else -1, np.int64)
        if not XXH3:
            return None
        best = np.empty(n, np.int64)
        if _RENDEZVOUS_BEST is not None:
            # Every member's score of every key and the best of them in one native pass
            # (a chain has hundreds of units; each whole-array step costs microseconds).
            _RENDEZVOUS_BEST(self._prefixes, joined, size, positions, best)
            return best
        if positions is not None:  # pragma: no cover - a module built before rendezvous_best
            joined = np.frombuffer(joined, np.uint8).reshape(-1, size)[positions].tobytes()
        scores = np.empty((len(names), n), np.uint64)
        for row, pre in zip(scores, self._prefixes):
            native.rendezvous_scores(pre, joined, size, row)
        return scores.argmax(axis=0)  # type: ignore[no-any-return]

    @property
    def names(self) -> list[str]:
        """The members in byte order (what `best_index_many`'s indices name)."""
        return self._names

    def top(self, unit_key: bytes, count: int) -> tuple[str, ...]:
        encoded = self._encoded
        if count <= 0 or not encoded:
            return ()
        suffix = _SEPARATOR + unit_key
        if count == 1:
            # The common case (one owner): the best score in one pass, no sort. Members
            # are in byte order, so a tie keeps the earlier one, as the sort below does.
            best_score, best = -1, ""
            for raw, name in encoded:
                s = _score64(raw + suffix)
                if s > best_score:
                    best_score, best = s, name
            return (best,)
        scored = sorted(encoded, key=lambda e: (-_score64(e[0] + suffix), e[0]))
        return tuple(n for _, n in scored[:count])


# -- hotness -------------------------------------------------------------------------


class Hotness(Protocol):
    """A signal of which units are hot: how many owners beyond R a unit should get, and
    (cheaply) which units may be hot at all: the others get none."""

    def extra_owners(self, unit_key: bytes) -> int: ...

    def candidates(self, unit_keys: Sequence[bytes]) -> list[int]:
        """The positions in `unit_keys` of the units that may be hot now (the others get
        no extra owner)."""
        ...

    def any_hot(self) -> bool:
        """Whether any unit may be hot now (none: no unit gets an extra owner). Called on
        every lookup that looks past its local prefix: it must be cheap."""
        ...


class HotUnits:
    """Access counts per unit with exponential decay, bounded in the units it tracks.

    A unit's count halves every `half_life_s` without accesses. A unit at or above
    `threshold` gets one extra owner, and one more each time its count doubles, up to
    `max_extra`. At most `max_units` units are tracked: past that, the colder half is
    forgotten in one pass (amortized O(log n) per record), so a scan of cold units cannot
    grow it, and a unit forgotten that way was far below any threshold that matters.

    The units at or above the threshold when last recorded are kept apart (`_hot`): a
    count only decays until the unit's next record, so no other unit can be hot, and a
    lookup of hundreds of units asks "any of these hot?" of that set, most often empty,
    rather than of every unit tracked.
    """

    _COOL_EVERY_S = 1.0

    def __init__(
        self,
        *,
        threshold: float = 64.0,
        half_life_s: float = 10.0,
        max_extra: int = DEFAULT_MAX_EXTRA_OWNERS,
        max_units: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold <= 0 or half_life_s <= 0:
            raise ConfigError(f"hot units need threshold > 0 and half_life_s > 0, got {threshold}, {half_life_s}")
        if max_extra < 0 or max_units < 2:
            raise ConfigError(f"hot units need max_extra >= 0 and max_units >= 2, got {max_extra}, {max_units}")
        self.threshold = threshold
        self.half_life_s = half_life_s
        self.max_extra = max_extra
        self.max_units = max_units
        self._clock = clock
        # unit key -> (count at `at`, at)
        self._counts: dict[bytes, tuple[float, float]] = {}
        # Units at or above `threshold` at their last record (some may have cooled since:
        # `_cool` drops those at most once per `_COOL_EVERY_S`).
        self._hot: set[bytes] = set()
        self._cooled_at = clock()

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, unit_key: object) -> bool:
        return unit_key in self._counts

    def candidates(self, unit_keys: Sequence[bytes]) -> list[int]:
        if not self.any_hot():
            return []
        hot = self._hot
        return [j for j, k in enumerate(unit_keys) if k in hot]

    def any_hot(self) -> bool:
        if not self._hot:
            return False
        now = self._clock()
        if now - self._cooled_at >= self._COOL_EVERY_S:
            self._cool(now)
        return bool(self._hot)

    def _cool(self, now: float) -> None:
        """Forget the hot units that fell below the threshold since their last record."""
        self._cooled_at = now
        counts = self._counts
        self._hot = {k for k in self._hot if k in counts and self._decayed(counts[k], now) >= self.threshold}

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        count, at = entry
        return count * math.pow(0.5, max(0.0, now - at) / self.half_life_s)

    def count(self, unit_key: bytes) -> float:
        entry = self._counts.get(unit_key)
        return 0.0 if entry is None else self._decayed(entry, self._clock())

    def record(self, unit_key: bytes, weight: float = 1.0) -> None:
        """One access (or `weight` of them) to a unit, now."""
        now = self._clock()
        entry = self._counts.get(unit_key)
        base = 0.0 if entry is None else self._decayed(entry, now)
        count = base + weight
        self._counts[unit_key] = (count, now)
        if count >= self.threshold:
            self._hot.add(unit_key)
        else:
            self._hot.discard(unit_key)
        if len(self._counts) > self.max_units:
            self._prune(now)

    def _prune(self, now: float) -> None:
        ranked = sorted(self._counts.items(), key=lambda kv: self._decayed(kv[1], now), reverse=True)
        self._counts = dict(ranked[: self.max_units // 2])
        self._hot &= self._counts.keys()

    def extra_owners(self, unit_key: bytes) -> int:
        c = self.count(unit_key)
        if c < self.threshold:
            return 0
        return min(self.max_extra, 1 + int(math.log2(c / self.threshold)))


# -- placement -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Previous:
    ranker: _Ranker
    until: float  # clock time its grace period ends


class Placement:
    """Owners of placement units over the current member set, and the previous sets for a
    grace period after each change. Feed it every new member set with `update`."""

    def __init__(
        self,
        members: Iterable[str] = (),
        *,
        unit_blocks: int = DEFAULT_UNIT_BLOCKS,
        lead_in: bool = True,
        replicas: int = DEFAULT_REPLICAS,
        max_extra_owners: int = DEFAULT_MAX_EXTRA_OWNERS,
        grace_s: float = DEFAULT_GRACE_S,
        hotness: Hotness | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_unit_blocks(unit_blocks)
        if replicas < 1:
            raise ConfigError(f"placement needs at least one owner per unit, got replicas={replicas}")
        if max_extra_owners < 0 or grace_s < 0:
            raise ConfigError(f"max_extra_owners and grace_s are >= 0, got {max_extra_owners}, {grace_s}")
        self.unit_blocks = unit_blocks
        self.lead_in = lead_in
        self.replicas = replicas
        self.max_extra_owners = max_extra_owners
        self.grace_s = grace_s
        self._hotness = hotness
        self._clock = clock
        self._current = _Ranker(frozenset(members))
        self._previous: list[_Previous] = []

    @property
    def members(self) -> frozenset[str]:
        return self._current.members

    def update(self, members: Iterable[str]) -> bool:
        """Take a new member set; True when it differs from the current one."""
        new = frozenset(members)
        if new == self._current.members:
            return False
        now = self._clock()
        self._previous.insert(0, _Previous(self._current, now + self.grace_s))
        del self._previous[MAX_PREVIOUS_SETS:]
        self._current = _Ranker(new)
        self._expire(now)
        return True

    def _expire(self, now: float) -> None:
        if self._previous and self._previous[-1].until <= now:
            self._previous = [p for p in self._previous if p.until > now]

    def in_grace(self) -> bool:
        """Whether a previous member set still counts for lookups."""
        self._expire(self._clock())
        return bool(self._previous)

    def _count(self, unit_key: bytes) -> int:
        extra = 0
        if self._hotness is not None and self.max_extra_owners:
            extra = min(self.max_extra_owners, max(0, self._hotness.extra_owners(unit_key)))
        return self.replicas + extra

    def spans(self, hashes: Sequence[bytes], first: int = 0) -> list[UnitSpan]:
        """The units of a chain from position `first`, cut by this placement's rule."""
        return unit_spans(hashes, self.unit_blocks, self.lead_in, first)

    def owners(self, unit_key: bytes) -> tuple[str, ...]:
        """Where a unit's blocks are written: its current owners, best first."""
        return self._current.top(unit_key, self._count(unit_key))

    def lookup_targets(self, unit_key: bytes) -> tuple[str, ...]:
        """Where a unit's blocks are looked for: the current owners, then the owners under
        each previous member set still within its grace period (no duplicates)."""
        return self.route(unit_key)[1]

    def route(self, unit_key: bytes) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """`owners` and `lookup_targets` of a unit together, from one ranking of the
        current members (the read path wants both)."""
        count = self._count(unit_key)
        out = self._current.top(unit_key, count)
        if not self._previous:
            return out, out
        return out, self._with_previous(unit_key, count, out)

    def route_many(self, unit_keys: Sequence[bytes]) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
        """`route` of many units at once (a lookup's units past its local prefix): the
        same answers, with each member set ranked over all keys in one pass."""
        hot = self._hotness
        if self.replicas != 1 or not self._current.members:
            routes = [self.route(k) for k in unit_keys]
            return [r[0] for r in routes], [r[1] for r in routes]
        owners: list[tuple[str, ...]] = [(n,) for n in self._current.best_many(unit_keys)]
        self._expire(self._clock())
        if self._previous:
            targets = list(owners)
            for prev in self._previous:
                for j, name in enumerate(prev.ranker.best_many(unit_keys)):
                    if name and name not in targets[j]:
                        targets[j] += (name,)
        else:
            targets = owners
        if hot is not None and self.max_extra_owners:
            for j in hot.candidates(unit_keys):
                if self._count(unit_keys[j]) > 1:  # a hot unit: its extra owners too
                    owners[j], targets[j] = self.route(unit_keys[j])
        return owners, targets

    def owner_indices(self, joined: bytes, size: int, positions: np.ndarray[Any, Any] | None = None
                      ) -> tuple[list[str], list[np.ndarray[Any, Any]]] | None:
        """`route_many` in arrays, for the common case of one owner per unit (R = 1, no hot
        unit among these): the names of the members of every set still counted (the
        current one first), and per set, current then previous ones in order, the index
        into those names of each unit's owner (-1: none). `joined`: the keys laid end to
        end, `size` bytes each, or a packed chain whose keys are those at `positions`
        (int64). None otherwise (use `route_many`)."""
        if self.replicas != 1 or not self._current.members:
            return None
        hot = self._hotness
        if hot is not None and self.max_extra_owners and hot.any_hot():
            keys = joined if positions is None else \
                np.frombuffer(joined, np.uint8).reshape(-1, size)[positions].tobytes()
            if hot.candidates(split_hashes(keys)):
                return None
        self._expire(self._clock())
        names = list(self._current.names)
        where = {n: i for i, n in enumerate(names)}
        out: list[np.ndarray[Any, Any]] = []
        for ranker in [self._current] + [p.ranker for p in self._previous]:
            best = ranker.best_index_many(joined, size, positions)
            if best is None:
                return None
            if ranker is not self._current:
                for name in ranker.names:
                    if name not in where:
                        where[name] = len(names)
                        names.append(name)
                remap = np.array([where[name] for name in ranker.names] + [-1], np.int64)
                best = remap[best]  # -1 (no members) picks the last entry, -1
            out.append(best)
        return names, out

    def _with_previous(self, unit_key: bytes, count: int, out: tuple[str, ...]) -> tuple[str, ...]:
        self._expire(self._clock())
        seen = set(out)
        extra: list[str] = []
        for prev in self._previous:
            for n in prev.ranker.top(unit_key, count):
                if n not in seen:
                    seen.add(n)
                    extra.append(n)
        return out + tuple(extra)

    def owns(self, node_id: str, unit_key: bytes) -> bool:
        return node_id in self.owners(unit_key)
