"""The remote lookup round: what a lookup's answer gains past its local prefix from the
other nodes of a pool (`RemoteLookup.extend`, behind `ClusterNode.extend`).

Past the local prefix the chain is cut into placement units; units this node holds (it
owns them, or holds a replica) count as they are, and blocks a pull is already copying
count as remote. For the others, one parallel round of lookups goes to their units'
lookup targets (owners, then previous owners within the grace period), one call per node
naming all the units asked of it, under the lookup deadline (`timeout_s`). A node that
does not answer in time, fails or is suspect is a miss, never an error or a wait past
the deadline.

Planning a round (`_Round`), two ways:
* ahead (`_round_ahead`): outside the grace of a member change, with one owner per unit
  and no hot unit, each other owner is asked for every unit it owns past the prefix
  before this node reads what it holds there, which it does while the answers travel.
  A unit held here whole is never short, whatever its owner answers. Where the prefix
  stops in this node's own unit, nobody is asked (its owner is the only node asked for
  it). Not ahead in a grace period (a previous owner, maybe this node, holds what the
  new one lacks), with R > 1 or a hot unit, a block at the prefix pending a pull, a
  suspect owner there, or no room for pulls;
* from what is held (`_round_from_held`): only the units this node lacks part of, by
  each unit's owner under each member set still counted in whole-array steps
  (`_round_by_owner`), or unit by unit over their target lists (R > 1, hot units). The
  chain ends at the first unit with nobody to ask.

A node is asked for its units laid end to end and answers the prefix of them it holds,
so the first unit it lacks hides those after it: its units go in the order it is
likeliest to hold them, those it owns first, then those it is asked for as an extra
owner of a hot unit or as a previous owner in a grace period (which lacks every block
put since the change).

The answer (`_combine`) extends the local prefix unit by unit while some node holds the
rest of each unit (ties go to the unit's current owner). The blocks found elsewhere are
TIER_REMOTE in it, and one pull per holder is marked (its blocks pending) and started
once the answer is written (`_start_pulls`). The lookup does not wait for the bytes
(docs/cluster.md has the measurement behind that): a fetch that follows joins the pull
(`ClusterNode.settle_fetch`) and serves what landed and verified.

The work is in whole-array steps over the chain's units, not a Python step per unit: a
1,000-block chain has hundreds of units. Three steps are one native pass each where the
module is built (kvstore/_native/units.c, `NATIVE_UNITS`), with the numpy steps here as
their reference and fallback: the hashes asked of a node (`gather_ranges`), its answer
spread over its units (`spread_prefix`), how far the units reach (`units_reach`).

Primitives: `RemoteLookup`, `Extension`, `PeerStats`, `gather_ranges`, `spread_prefix`,
`units_reach`, `NATIVE_UNITS`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from kvstore.cluster.breaker import Attempt, Breakers
from kvstore.cluster.placement import Placement
from kvstore.cluster.pull import Puller, PullSpec
from kvstore.cluster.put_plan import unit_bounds
from kvstore.cluster.transport import PeerCall, PeerError, PeerTransport
from kvstore.convert import TIER_BY_NAME
from kvstore.core.store import Store
from kvstore.eager import start
from kvstore.hashing import HASH_BYTES, split_hashes
from kvstore.native import native
from kvstore.v1 import kvstore_pb2

if TYPE_CHECKING:
    from kvstore.cluster.pool import ClusterCounters

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Extension:
    """What a lookup's answer gains past its local prefix."""

    blocks: int
    tiers: bytes  # one Tier value per added block (TIER_REMOTE for those elsewhere)
    remote: int  # of them, held by other nodes (being copied here)


@dataclass(slots=True)
class PeerStats:
    """What this node's rounds got from one other node."""

    lookups: int = 0
    lookup_errors: int = 0
    lookup_timeouts: int = 0
    hit_blocks: int = 0  # blocks it held that lookups here counted


@dataclass(slots=True)
class _Round:
    """A round's units past the prefix, in chain order, as arrays: those this node lacks
    part of, or every one in a round planned ahead (`RemoteLookup._round_ahead`)."""

    starts: np.ndarray[Any, Any]  # positions [starts, stops) of each unit past the prefix
    stops: np.ndarray[Any, Any]
    locs: np.ndarray[Any, Any]  # its leading blocks held or pending here
    key_pos: np.ndarray[Any, Any]  # the position of its key (its first block)
    first_owner: np.ndarray[Any, Any]  # its first current owner, an index into `names` (-1: none)
    names: list[str]
    replica: np.ndarray[Any, Any]  # whether a copy here is a replica
    asks: dict[str, np.ndarray[Any, Any]]  # per node, the units asked of it, in the order asked
    end: int  # where the chain ends for sure


class _Ranges(NamedTuple):
    """What one pull of a lookup copies from `holder`, its blocks already pending."""

    holder: str
    pull: Any  # kvstore.cluster.pull's handle of the pull, made by `Puller.mark`
    starts: np.ndarray[Any, Any]  # runs of consecutive positions [starts, stops) of one kind
    stops: np.ndarray[Any, Any]
    replica: np.ndarray[Any, Any]  # each run's kind: replica or owned
    hashes: list[bytes]  # the runs' blocks' hashes
    key_pos: np.ndarray[Any, Any]  # per unit in the runs, the position of its key
    firsts: np.ndarray[Any, Any]  # each run's first and last unit (into key_pos)
    lasts: np.ndarray[Any, Any]


_EMPTY = np.zeros(0, np.int64)
_HASH_ITEM = np.dtype(f"V{HASH_BYTES}")  # one hash as one array item
_EMPTY_BOOL = np.zeros(0, bool)

# `RemoteLookup._round_ahead`: nothing past the local prefix is to be found elsewhere.
_ENDS_HERE = object()

T = TypeVar("T")


def _keys_at(packed: bytes, positions: np.ndarray[Any, Any]) -> bytes:
    """The hashes at these positions of a packed chain, laid end to end."""
    return np.frombuffer(packed, np.uint8).reshape(-1, HASH_BYTES)[positions].tobytes()  # type: ignore[no-any-return]


# The round's steps in one native pass each where the module is built (kvstore/_native/
# units.c); the numpy steps below are their reference and fallback (None: numpy alone).
NATIVE_UNITS = native if native is not None and hasattr(native, "units_reach") else None


def gather_ranges(packed: bytes, starts: np.ndarray[Any, Any], stops: np.ndarray[Any, Any],
                  idx: np.ndarray[Any, Any] | None = None) -> bytes:
    """The hashes of positions [starts[j], stops[j]) of a packed chain for each j of
    `idx` in its order (every j where None), laid end to end (int64 arrays)."""
    if NATIVE_UNITS is not None:
        return NATIVE_UNITS.gather_ranges(packed, HASH_BYTES, starts, stops, idx)
    if idx is not None:
        starts, stops = starts[idx], stops[idx]
    return _concat(packed, starts, stops)


def spread_prefix(count: int, sizes: np.ndarray[Any, Any], idx: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A node's answer, that it holds the first `count` blocks of units `idx` laid end
    to end in that order, as blocks per unit (0 for units not asked of it)."""
    got = np.zeros(len(sizes), np.int64)
    if NATIVE_UNITS is not None:
        NATIVE_UNITS.spread_prefix(count, sizes, idx, got)
        return got
    asked = sizes[idx]
    got[idx] = np.clip(count - (np.cumsum(asked) - asked), 0, asked)
    return got


def units_reach(locs: np.ndarray[Any, Any], found: np.ndarray[Any, Any],
                sizes: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int, bool]:
    """Per unit, the more of its leading blocks held here (`locs`) or found elsewhere
    (`found`); the first unit short of its size (`len(sizes)` if none), where the chain
    ends; whether a unit up to it was found beyond what is held here."""
    if NATIVE_UNITS is not None:
        best = np.empty(len(sizes), np.int64)
        short, copied = NATIVE_UNITS.units_reach(locs, found, sizes, best)
        return best, short, copied
    best = np.maximum(locs, found)
    shorts = np.flatnonzero(best < sizes)
    short = int(shorts[0]) if len(shorts) else len(sizes)
    return best, short, bool((found[: short + 1] > locs[: short + 1]).any())


def _concat(packed: bytes, starts: np.ndarray[Any, Any], stops: np.ndarray[Any, Any]) -> bytes:
    """The hashes of positions [starts[i], stops[i]) of a packed chain (disjoint ranges,
    in the order given), laid end to end."""
    lens = stops - starts
    # Each range's positions, laid end to end: its start, plus the offset within it.
    at = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
    return np.frombuffer(packed, _HASH_ITEM)[at].tobytes()


def _retrieve(task: asyncio.Task[int]) -> None:
    if not task.cancelled():
        task.exception()


class RemoteLookup:
    """A lookup's one round to the other nodes past its local prefix (module docstring)."""

    def __init__(self, store: Store, node_id: str, placement: Placement, breakers: Breakers, puller: Puller,
                 transport: PeerTransport, counters: ClusterCounters, call_of: Callable[[bytes], PeerCall], *,
                 timeout_s: float) -> None:
        self.store = store
        self.node_id = node_id
        self.placement = placement
        self.breakers = breakers
        self.puller = puller
        self.transport = transport
        self.counters = counters
        self._call_of = call_of
        # The round's deadline; may change while the daemon runs (SetConfig, SIGHUP).
        self.timeout_s = timeout_s
        self.peers: dict[str, PeerStats] = {}
        # Store tier id -> Tier value; a block not held here (pending a pull) -> TIER_REMOTE.
        table = bytearray(256)
        for tid, name in enumerate(store.tier_id_names):
            table[tid] = TIER_BY_NAME.get(name, kvstore_pb2.TIER_UNSPECIFIED)
        table[Store.ABSENT] = kvstore_pb2.TIER_REMOTE
        self._tier_values = bytes(table)

    def _peer(self, node: str) -> PeerStats:
        """`node`'s stats, made on first use."""
        st = self.peers.get(node)
        if st is None:
            st = self.peers[node] = PeerStats()
        return st

    async def extend(self, namespace_id: bytes, chain: bytes | Sequence[bytes], held: int,
                     lease_id: str = "") -> Extension | None:
        """The rest of a lookup's answer past its local prefix of `held` blocks, from one
        round to the other nodes; None when nothing past it is found. `lease_id`: the
        store lease the lookup took, which holds what its pulls land too."""
        packed = chain if isinstance(chain, bytes) else b"".join(chain)
        if held * HASH_BYTES >= len(packed):
            return None
        ahead = self._round_ahead(namespace_id, packed, held)
        if ahead is _ENDS_HERE:
            return None
        if isinstance(ahead, _Round):
            return await self._extend_ahead(namespace_id, packed, held, ahead, lease_id)
        present = self.store.present(namespace_id, packed[held * HASH_BYTES :])
        rnd = self._round_from_held(namespace_id, packed, held, present)
        got = None
        if rnd.asks:
            if self.puller.has_room():
                got, _ = await self._ask(namespace_id, packed, rnd)
            else:
                self.counters.no_room_for_pulls += 1
        return self._combine(namespace_id, packed, held, present, rnd, got, lease_id)

    def _round_ahead(self, namespace_id: bytes, packed: bytes, held: int) -> _Round | object | None:
        """A round of every unit past the prefix, each asked of its owner, before what is
        held here is read (its `locs` come later); `_ENDS_HERE` where the prefix stops in
        this node's own unit; None where the round is planned from what is held first."""
        placement = self.placement
        if placement.in_grace() or not self.puller.has_room():
            return None
        starts, stops, unit_starts = self._unit_cut(packed, held)
        pending = self.puller.pending.get(namespace_id)
        if pending and packed[held * HASH_BYTES : (held + 1) * HASH_BYTES] in pending:
            return None
        routed = placement.owner_indices(packed, HASH_BYTES, unit_starts)
        if routed is None:
            return None
        names, sets = routed
        owner = sets[0]
        me = names.index(self.node_id) if self.node_id in names else -2
        if owner[0] == me or owner[0] < 0:
            # Unless the block there is held after all (not READY yet: a put of it under
            # way), which `_round_from_held` counts as held.
            here = self.store.present(namespace_id, packed[held * HASH_BYTES : (held + 1) * HASH_BYTES])
            return _ENDS_HERE if here[0] == Store.ABSENT else None
        ready = self.breakers.ready
        asks: dict[str, np.ndarray[Any, Any]] = {}
        for k, name in enumerate(names):
            if k != me and ready(name):
                idx = np.flatnonzero(owner == k)
                if len(idx):
                    asks[name] = idx
        if names[owner[0]] not in asks:
            return None  # its owner is suspect: `_round_from_held` ends the chain where it must
        return _Round(starts, stops, _EMPTY, unit_starts, owner, names, owner != me, asks, len(packed) // HASH_BYTES)

    async def _extend_ahead(self, namespace_id: bytes, packed: bytes, held: int, rnd: _Round,
                            lease_id: str) -> Extension | None:
        """`extend` with its round sent first (`_round_ahead`), reading what is held here
        while the answers travel."""

        def held_here() -> tuple[bytes, np.ndarray[Any, Any]]:
            present = self.store.present(namespace_id, packed[held * HASH_BYTES :])
            return present, self._held_of(namespace_id, packed, held, present, rnd.starts, rnd.stops)

        got, local = await self._ask(namespace_id, packed, rnd, held_here)
        assert local is not None
        present, rnd.locs = local
        return self._combine(namespace_id, packed, held, present, rnd, got, lease_id)

    def _unit_cut(self, packed: bytes, held: int) -> tuple[np.ndarray[Any, Any], ...]:
        """The units from position `held` on (the first from `held`, inside its unit), cut as
        `unit_spans` cuts them: their first and past-last positions, their keys' positions."""
        n = len(packed) // HASH_BYTES
        bounds = unit_bounds(n, self.placement.unit_blocks, self.placement.lead_in)
        first = int(np.searchsorted(bounds, held, side="right")) - 1
        unit_starts = bounds[first:-1]
        starts = unit_starts.copy()
        starts[0] = held
        return starts, bounds[first + 1 :], unit_starts

    def _units_past(self, namespace_id: bytes, packed: bytes, held: int,
                    present: bytes) -> tuple[np.ndarray[Any, Any], ...]:
        """`_unit_cut`'s starts, stops and key positions, with each unit's `_held_of` count."""
        starts, stops, unit_starts = self._unit_cut(packed, held)
        return starts, stops, self._held_of(namespace_id, packed, held, present, starts, stops), unit_starts

    def _held_of(self, namespace_id: bytes, packed: bytes, held: int, present: bytes, starts: np.ndarray[Any, Any],
                 stops: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Per unit [starts, stops), its leading blocks held here or pending a pull
        (`present`: `Store.present` of the chain from `held`)."""
        absent = np.frombuffer(present, np.uint8) == Store.ABSENT
        pending = self.puller.pending.get(namespace_id)
        if pending:
            gaps = np.flatnonzero(absent)
            copying = [packed[(held + g) * HASH_BYTES : (held + g + 1) * HASH_BYTES] in pending for g in gaps.tolist()]
            absent[gaps[np.array(copying, bool)]] = False
        m = len(absent)
        first_absent = np.minimum.reduceat(np.where(absent, np.arange(m), m), starts - held)
        return np.minimum(first_absent - (starts - held), stops - starts)  # type: ignore[no-any-return]

    def _round_from_held(self, namespace_id: bytes, packed: bytes, held: int, present: bytes) -> _Round:
        """The units past the prefix this node lacks part of, and whom to ask for each."""
        starts, stops, locs, unit_starts = self._units_past(namespace_id, packed, held, present)
        lacking = np.flatnonzero(locs < stops - starts)
        end = len(packed) // HASH_BYTES
        if not len(lacking):
            return _Round(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, [], _EMPTY_BOOL, {}, end)
        key_pos = unit_starts[lacking]
        joined = _keys_at(packed, key_pos)
        routed = self.placement.owner_indices(joined, HASH_BYTES)
        if routed is not None:
            return self._round_by_owner(starts[lacking], stops[lacking], locs[lacking], key_pos, end, *routed)
        owners, ranked = self.placement.route_many(split_hashes(joined))
        me = self.node_id
        ready = self.breakers.ready
        askable: dict[str, bool] = {}
        # Few distinct target lists occur (one per owner, and per previous owner): each is
        # filtered (this node, suspect peers) once.
        filtered: dict[tuple[str, ...], tuple[str, ...]] = {}
        targets: list[tuple[str, ...]] = []
        for t in ranked:
            f = filtered.get(t)
            if f is None:
                for node in t:
                    if node != me and node not in askable:
                        askable[node] = ready(node)
                f = filtered[t] = tuple(node for node in t if node != me and askable[node])
            targets.append(f)
        cut = len(targets)
        if () in filtered.values():
            cut = next(j for j, t in enumerate(targets) if not t)  # nobody to ask: the chain ends there
            end = int(starts[lacking[cut]] + locs[lacking[cut]])
        lacking = lacking[:cut]
        targets = targets[:cut]
        distinct = list(dict.fromkeys(targets))
        ids = {t: k for k, t in enumerate(distinct)}
        target_ids = np.fromiter((ids[t] for t in targets), np.int64, len(targets))
        asks: dict[str, np.ndarray[Any, Any]] = {}
        for node, ok in askable.items():
            if ok:
                mine = [k for t, k in ids.items() if node in t]
                idx = np.flatnonzero(np.isin(target_ids, mine))
                if len(idx):
                    # Its units in the order it is likeliest to hold them (module docstring):
                    # by its rank among each unit's targets (owners, the extra owners of a
                    # hot unit, then previous owners), this node and suspects counted.
                    rank = np.fromiter((ranked[j].index(node) for j in idx.tolist()), np.int64, len(idx))
                    asks[node] = idx[np.argsort(rank, kind="stable")]
        replica = np.fromiter((me not in o for o in owners[:cut]), bool, cut)
        names = sorted({n for o in owners[:cut] for n in o})
        where = {n: i for i, n in enumerate(names)}
        first_owner = np.fromiter((where[o[0]] if o else -1 for o in owners[:cut]), np.int64, cut)
        return _Round(starts[lacking], stops[lacking], locs[lacking], key_pos[:cut], first_owner, names, replica, asks,
                      end)

    def _round_by_owner(self, starts: np.ndarray[Any, Any], stops: np.ndarray[Any, Any], locs: np.ndarray[Any, Any],
                        key_pos: np.ndarray[Any, Any], end: int, names: list[str],
                        sets: list[np.ndarray[Any, Any]]) -> _Round:
        """`_round_from_held`'s round from each unit's owner under each member set still
        counted (`Placement.owner_indices`), in whole-array steps."""
        me = self.node_id
        ready = self.breakers.ready
        askable = np.array([n != me and ready(n) for n in names] + [False], bool)  # [-1]: no owner
        owner = sets[0]
        every = sets[0][None, :] if len(sets) == 1 else np.stack(sets)
        some = askable[every].any(axis=0)
        cut = len(owner)
        if not some.all():
            cut = int(np.argmin(some))  # nobody to ask: the chain ends there
            end = int(starts[cut] + locs[cut])
        asks: dict[str, np.ndarray[Any, Any]] = {}
        every = every[:, :cut]
        for k in np.flatnonzero(askable[:-1]).tolist():
            owned = every[0] == k
            idx = np.flatnonzero(owned)
            if len(every) > 1:
                # The units it owns first, then those it only owned under a previous
                # member set (module docstring).
                before = np.flatnonzero((every[1:] == k).any(axis=0) & ~owned)
                if len(before):
                    idx = np.concatenate([idx, before])
            if len(idx):
                asks[names[k]] = idx
        mine = names.index(me) if me in names else -2
        return _Round(starts[:cut], stops[:cut], locs[:cut], key_pos[:cut], owner[:cut], names, owner[:cut] != mine,
                      asks, end)

    async def _ask(self, namespace_id: bytes, packed: bytes, rnd: _Round,
                   meanwhile: Callable[[], T] | None = None) -> tuple[dict[str, np.ndarray[Any, Any]], T | None]:
        """One parallel round of lookups under the deadline: per node, what it holds of each
        unit asked of it (0 where not asked), and what `meanwhile` made while they travel.

        Each call claims its node's breaker (`Breakers.attempt`) as it is made, and ends
        the claim with its verdict; a claim left without one (this lookup cancelled) is
        released, so a half-open probe is never kept by a call that did not finish. The
        round was planned with `Breakers.ready`, which claims nothing."""
        self.counters.remote_lookups += 1
        call = self._call_of(namespace_id)
        deadline_s = self.timeout_s
        attempts: dict[str, Attempt] = {}
        for node in rnd.asks:
            attempt = self.breakers.attempt(node)
            if attempt is not None:  # (no await since the round was planned: always, in practice)
                attempts[node] = attempt
        try:
            return await self._calls(namespace_id, packed, rnd, call, deadline_s, attempts, meanwhile)
        finally:
            for attempt in attempts.values():
                attempt.release()  # a no-op once the call's verdict is in

    async def _calls(self, namespace_id: bytes, packed: bytes, rnd: _Round, call: PeerCall, deadline_s: float,
                     attempts: dict[str, Attempt],
                     meanwhile: Callable[[], T] | None) -> tuple[dict[str, np.ndarray[Any, Any]], T | None]:
        """`_ask`'s calls, one per node of `attempts`, and their verdicts."""
        requests = {node: gather_ranges(packed, rnd.starts, rnd.stops, rnd.asks[node]) for node in attempts}
        results: dict[str, int | BaseException] = {}
        # Each call is started here, by hand (`kvstore.eager`): its request leaves now, on
        # a pooled connection, rather than in a task's first step a loop turn later. With
        # one node to ask, the transport keeps the deadline; with several, the wait below.
        one = len(requests) == 1
        calls = {node: start(self.transport.lookup(node, call, hashes, deadline_s if one else 2 * deadline_s))
                 for node, hashes in requests.items()}
        try:
            local = meanwhile() if meanwhile is not None else None
        except BaseException:
            for started in calls.values():
                started.close()
            raise
        if one:
            ((node, started),) = calls.items()
            try:
                # Awaited here, not in a task of its own (a loop turn less). (Not
                # asyncio.timeout: a call over the control lane runs outside a task.)
                results[node] = await started
            except (TimeoutError, PeerError) as exc:
                results[node] = exc
        elif calls:
            tasks = {node: asyncio.ensure_future(started) for node, started in calls.items()}
            for task in tasks.values():
                task.add_done_callback(_retrieve)
            _, late = await asyncio.wait(tasks.values(), timeout=deadline_s)
            for task in late:
                task.cancel()
            for node, task in tasks.items():
                if task in late:
                    results[node] = TimeoutError()
                elif task.cancelled():
                    continue  # no verdict: its claim is released
                else:
                    failure = task.exception()
                    results[node] = failure if failure is not None else task.result()
        out: dict[str, np.ndarray[Any, Any]] = {}
        sizes = rnd.stops - rnd.starts
        for node, result in results.items():
            st = self._peer(node)
            st.lookups += 1
            if isinstance(result, BaseException):
                if isinstance(result, TimeoutError) or (isinstance(result, PeerError) and result.timed_out):
                    st.lookup_timeouts += 1
                else:
                    st.lookup_errors += 1
                    logger.debug("cluster lookup on %s failed: %r", node, result)
                attempts[node].failure()
                continue
            attempts[node].success()
            # The node answered a prefix of the units' blocks laid end to end: per unit.
            out[node] = spread_prefix(result, sizes, rnd.asks[node])
        return out, local

    def _combine(self, namespace_id: bytes, packed: bytes, held: int, present: bytes, rnd: _Round,
                 got: dict[str, np.ndarray[Any, Any]] | None, lease_id: str = "") -> Extension | None:
        """The answer past the local prefix from the round and the nodes' answers; schedules
        the pulls of what was found elsewhere."""
        reach = rnd.end
        sizes = rnd.stops - rnd.starts
        holders: list[str] = list(got) if got and len(sizes) else []
        pick: np.ndarray[Any, Any] | None = None  # which holder's answer each unit takes (None: the one)
        if len(holders) == 1:
            best_found = got[holders[0]]  # type: ignore[index]
        elif holders:
            found = np.stack([got[h] for h in holders])  # type: ignore[index]
            # Ties go to the unit's current owner.
            where = {n: i for i, n in enumerate(rnd.names)}
            owner_of = rnd.first_owner[None, :] == np.array([where.get(h, -2) for h in holders], np.int64)[:, None]
            pick = (found * 2 + owner_of).argmax(axis=0)
            best_found = found[pick, np.arange(len(sizes))]
        else:
            best_found = np.zeros(len(sizes), np.int64)
        best, short, copied = units_reach(rnd.locs, best_found, sizes)
        cut = len(sizes)
        if short < len(sizes):
            cut = short + 1
            reach = int(rnd.starts[short] + best[short])
        if reach <= held:
            return None
        # Blocks absent here within the reach are found elsewhere or pending: TIER_REMOTE.
        past = present[: reach - held]
        tiers = past.translate(self._tier_values)
        remote = tiers.count(kvstore_pb2.TIER_REMOTE)
        if lease_id:
            # The answer's blocks past the local prefix are held for the fetch that follows
            # as the prefix is: those here now (replicas, the first victims of their tier),
            # and those other lookups' pulls are copying here (this one's, as they land).
            # (Read now, not from `present`: a pull may have landed while the round was out.)
            span = packed[held * HASH_BYTES : reach * HASH_BYTES]
            self.store.lease_held(lease_id, namespace_id, span)
            if remote and self.puller.pending.get(namespace_id):
                self.puller.hold_for(lease_id, namespace_id, split_hashes(span))
        self.store.counters.count_past_prefix(past)
        self.counters.local_past_prefix_blocks += len(tiers) - remote
        self.counters.remote_hit_blocks += remote
        if copied and holders:
            # The pulls are marked (their blocks pending: a fetch that follows this answer
            # waits for them) and started once the answer is written: by a callback
            # scheduled now, which runs before the event loop reads the next request.
            asyncio.get_running_loop().call_soon(self._start_pulls, namespace_id, packed, rnd, holders, pick, best,
                                                 best_found, cut, lease_id)
        return Extension(len(tiers), tiers, remote)

    def _mark(self, holder: str, namespace_id: bytes, packed: bytes, starts: np.ndarray[Any, Any],
              stops: np.ndarray[Any, Any], replica: np.ndarray[Any, Any], key_pos: np.ndarray[Any, Any],
              lease_id: str = "") -> _Ranges:
        """One pull from `holder` of these ranges (one per unit, consecutive ones of a kind
        merged into a run), its blocks marked pending."""
        joins = (starts[1:] == stops[:-1]) & (replica[1:] == replica[:-1])
        firsts = np.concatenate([[0], np.flatnonzero(~joins) + 1]).astype(np.int64)
        lasts = np.concatenate([firsts[1:] - 1, [len(starts) - 1]]).astype(np.int64)
        run_starts, run_stops = starts[firsts], stops[lasts]
        hashes = split_hashes(gather_ranges(packed, run_starts, run_stops))
        return _Ranges(holder, self.puller.mark(namespace_id, hashes, lease_id), run_starts, run_stops, replica[firsts], hashes,
                       key_pos, firsts, lasts)

    def _start_pulls(self, namespace_id: bytes, packed: bytes, rnd: _Round, holders: list[str],
                     pick: np.ndarray[Any, Any] | None, best: np.ndarray[Any, Any], best_found: np.ndarray[Any, Any],
                     cut: int, lease_id: str = "") -> None:
        """Mark and start a lookup's pulls: from each holder picked (`pick`, None with one),
        the units of the first `cut` it holds more of than this node."""
        copied = np.flatnonzero(best_found[:cut] > rnd.locs[:cut])
        call = self._call_of(namespace_id)
        for k, holder in enumerate(holders):
            idx = copied if pick is None else copied[pick[copied] == k]
            if not len(idx):
                continue
            self._peer(holder).hit_blocks += int((best - rnd.locs)[idx].sum())
            r = self._mark(holder, namespace_id, packed, (rnd.starts + rnd.locs)[idx], (rnd.starts + best)[idx],
                           rnd.replica[idx], rnd.key_pos[idx], lease_id)
            keys = split_hashes(_keys_at(packed, r.key_pos))
            unit_keys = [keys[first : last + 1] for first, last in zip(r.firsts.tolist(), r.lasts.tolist())]
            self.puller.launch(r.holder, call, r.pull, PullSpec(namespace_id, packed, r.starts.tolist(),
                                                                r.stops.tolist(), r.replica.tolist(), unit_keys,
                                                                r.hashes))
