"""The pool as one daemon takes part in it: `ClusterNode`, what the daemon's servicers call.

Engines talk only to their local daemon; the daemons of a pool find each other's blocks
(ARCHITECTURE.md section 8, docs/cluster.md). A `ClusterNode` holds the membership, the
placement over its live members, the transport to them, a circuit breaker per peer, and
the two background movers: pulls (copies of remote blocks into this node) and forwards
(blocks committed here sent to their owners).

Reads (`extend`). A lookup answers its local prefix from the local store as a single
node does; only when the chain goes on past it does the node look further, and a chain
held locally is answered without contacting anyone. Past the prefix the chain is cut
into placement units; units this node holds (it owns them, or holds a replica) count as
they are, and blocks a pull is already copying count as remote. For the others, one
parallel round of lookups goes to their units' lookup targets (owners, then previous
owners within the grace period), one call per node naming all the units asked of it,
under `lookup_timeout_s`. A node that does not answer in time, fails or is suspect is a
miss, never an error or a wait past the deadline. The answer extends the local prefix
unit by unit while some node holds the rest of each unit; the blocks found elsewhere are
TIER_REMOTE in it, and one pull per holder starts copying them at once. The lookup does
not wait for the bytes (docs/cluster.md has the measurement behind that): a fetch that
follows joins the pull (`settle_fetch`, bounded by `fetch_timeout_s`) and serves what
landed and verified, so it may return a shorter prefix than the lookup promised, never
wrong bytes.

Writes (`after_put`). A put commits locally first; then its blocks are placed by chain
position (a unit's key is the hash of its first block): units this node does not own are
queued for their owners (`Forwarder`, bounded, drops counted) and held here as replicas
(the first victims when room is needed, so copies never crowd out owned units), units it
owns are remembered for a drain. A put may wait for its owners' commits (`ForwardTicket`).

Hot units (`HotUnits`, from the units this node had to look for elsewhere) get extra
owners, capped: a pull of a hot unit also pushes it to the extra owners that do not hold
it yet, and a node that is one of them keeps its copy as its own. A pull from a previous
owner (after a membership change) pushes the copy to the unit's current owner too, so
the traffic rebuilds what moved.

Membership changes (`_on_view`) feed the placement (members with another placement rule,
or draining, are never owners), the transport (addresses) and the breakers (a member that
rejoined is tried at once). `drain` hands off before a planned removal, `leave` leaves.

Primitives: `ClusterSettings`, `placement_rule`, `PackedChain`, `Extension`,
`ForwardTicket`, `UnitPlace`, `MemberState`, `ClusterStatus`, `DrainResult`, `ClusterNode`.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar, overload

import numpy as np

from kvstore.cluster.breaker import Breakers
from kvstore.cluster.forward import Forwarder, ForwardJob
from kvstore.cluster.membership import Member, Membership, MembershipStatus, View
from kvstore.cluster.placement import (
    DEFAULT_GRACE_S,
    DEFAULT_MAX_EXTRA_OWNERS,
    DEFAULT_REPLICAS,
    DEFAULT_UNIT_BLOCKS,
    HotUnits,
    Placement,
    unit_start,
    unit_stop,
)
from kvstore.cluster.pull import Puller, PullRun, PullSpec
from kvstore.cluster.transport import PeerCall, PeerError, PeerTransport
from kvstore.convert import TIER_BY_NAME, layout_to_proto
from kvstore.core.store import Store
from kvstore.eager import start
from kvstore.errors import FailedPrecondition, KVStoreError
from kvstore.hashing import HASH_BYTES, split_hashes
from kvstore.native import native
from kvstore.v1 import kvstore_pb2

logger = logging.getLogger(__name__)

DEFAULT_LOOKUP_TIMEOUT_S = 0.005
DEFAULT_FETCH_TIMEOUT_S = 5.0
DEFAULT_FORWARD_QUEUE_BLOCKS = 4096
DEFAULT_FORWARD_TIMEOUT_S = 10.0
DEFAULT_PULLS = 16
DEFAULT_SUSPECT_S = 2.0
DEFAULT_DRAIN_TIMEOUT_S = 60.0
# How far a put's position is looked for through the parents of its first block.
MAX_PARENT_WALK = 1 << 16
OWNED_UNITS_KEPT = 65536
PUSHED_KEPT = 65536
POSITIONS_KEPT = 4096
LAYOUTS_KEPT = 1024
DRAIN_BATCH_UNITS = 64
# Most blocks in one forward job (one put on the owner): a put's runs for one owner are
# one job up to this, so a large put still fits the forward queue a part at a time.
FORWARD_JOB_BLOCKS = 1024
# From how many blocks a put is placed in whole-array steps (`ClusterNode.after_put`).
PLAN_ARRAYS_FROM_BLOCKS = 16
MAINTENANCE_S = 5.0
_ABSENT = bytes([Store.ABSENT])


def placement_rule(unit_blocks: int, replicas: int) -> str:
    """What members must agree on to agree on owners; published in the member record."""
    return f"units={unit_blocks},lead-in,replicas={replicas}"


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    unit_blocks: int = DEFAULT_UNIT_BLOCKS
    replicas: int = DEFAULT_REPLICAS
    hot_extra_owners: int = DEFAULT_MAX_EXTRA_OWNERS
    grace_s: float = DEFAULT_GRACE_S
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    forward_queue_blocks: int = DEFAULT_FORWARD_QUEUE_BLOCKS
    forward_timeout_s: float = DEFAULT_FORWARD_TIMEOUT_S
    pulls: int = DEFAULT_PULLS
    suspect_s: float = DEFAULT_SUSPECT_S

    @property
    def rule(self) -> str:
        return placement_rule(self.unit_blocks, self.replicas)


class PackedChain(Sequence[bytes]):
    """A packed chain (N x 16-byte hashes) read as a sequence of hashes, without cutting it."""

    __slots__ = ("packed",)

    def __init__(self, packed: bytes) -> None:
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed) // HASH_BYTES

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("a packed chain slices with step 1")
            return PackedChain(self.packed[start * HASH_BYTES : stop * HASH_BYTES])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.packed[i * HASH_BYTES : (i + 1) * HASH_BYTES]


@dataclass(frozen=True, slots=True)
class Extension:
    """What a lookup's answer gains past its local prefix."""

    blocks: int
    tiers: bytes  # one Tier value per added block (TIER_REMOTE for those elsewhere)
    remote: int  # of them, held by other nodes (being copied here)


@dataclass(slots=True)
class PeerStats:
    lookups: int = 0
    lookup_errors: int = 0
    lookup_timeouts: int = 0
    hit_blocks: int = 0  # blocks it held that lookups here counted


@dataclass(slots=True)
class ClusterCounters:
    remote_lookups: int = 0  # lookups that asked other nodes
    remote_hit_blocks: int = 0  # blocks those answers added (held elsewhere)
    local_past_prefix_blocks: int = 0  # blocks held here past a local miss (owned units)
    no_room_for_pulls: int = 0  # lookups that could not promise remote blocks: pulls at their cap
    unplaced_blocks: int = 0  # put blocks whose chain position was unknown: not forwarded
    replica_blocks: int = 0  # blocks marked replicas (put here or pulled, of units owned elsewhere)
    hot_pushes: int = 0  # copies of hot units pushed to their extra owners
    handoff_pushes: int = 0  # copies found on a previous owner pushed to the current one
    peer_lookups: int = 0  # other nodes' lookups answered here (not counted as this node's lookups)
    peer_lookup_blocks: int = 0  # blocks they asked for
    peer_hit_blocks: int = 0  # of them, held here


@dataclass(frozen=True, slots=True)
class UnitPlace:
    start: int
    stop: int
    key: bytes
    owners: tuple[str, ...]
    lookup_targets: tuple[str, ...]
    held_here: int


@dataclass(frozen=True, slots=True)
class MemberState:
    member: Member
    is_self: bool
    suspect: bool
    suspect_for_s: float
    placed: bool


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    node_id: str
    membership: MembershipStatus
    members: tuple[MemberState, ...]
    unit_blocks: int
    replicas: int
    in_grace: bool
    draining: bool
    left: bool


@dataclass(frozen=True, slots=True)
class DrainResult:
    units_pushed: int
    blocks_pushed: int
    units_failed: int
    left: bool


@dataclass(slots=True)
class _Piece:
    """Blocks of one placement unit within a put."""

    key: bytes
    position: int
    hashes: list[bytes]
    parent: bytes | None


@dataclass(slots=True)
class PutPlan:
    """Where a put's blocks go (`ClusterNode.after_put`), as offsets [start, stop) into
    its hashes: the pieces of units this node owns (with each one's unit key), the runs
    it holds as replicas, per owner elsewhere its forward jobs (each a list of runs of
    consecutive blocks, at most FORWARD_JOB_BLOCKS blocks but for a longer single piece),
    how many blocks went elsewhere, and for `ForwardTicket` per forwarded part the
    (owner, job, offset in the job, blocks) of each of its owners."""

    owned: list[tuple[bytes, int, int]]
    replicas: list[tuple[int, int]]
    jobs: dict[str, list[list[tuple[int, int]]]]
    forwarded: int
    parts: list[tuple[tuple[str, int, int, int], ...]]


def _add_range(runs: list[tuple[int, int]], a: int, b: int) -> None:
    """Append [a, b) to runs of offsets, joined to the last one where it follows it."""
    if runs and runs[-1][1] == a:
        runs[-1] = (runs[-1][0], b)
    else:
        runs.append((a, b))


def _runs(starts: np.ndarray[Any, Any], stops: np.ndarray[Any, Any]) -> list[tuple[int, int]]:
    """Ranges [starts[i], stops[i]) (in order, disjoint) with consecutive ones joined."""
    if not len(starts):
        return []
    cut = np.flatnonzero(starts[1:] != stops[:-1]) + 1
    firsts = np.concatenate([_ZERO, cut])
    lasts = np.concatenate([cut, np.array([len(starts)], np.int64)]) - 1
    return list(zip(starts[firsts].tolist(), stops[lasts].tolist()))


# A unit this node owns, as far as it holds it from its first block on: (namespace id,
# unit key, position of its first block, its blocks' hashes laid end to end, parent).
# A plain tuple of bytes and ints, which the garbage collector stops tracking: a node
# keeps tens of thousands of them, which a full collection would otherwise walk (an
# object and a list each).
_OwnedUnit = tuple[bytes, bytes, int, bytes, "bytes | None"]


@dataclass(slots=True)
class ForwardTicket:
    """A put's forwards: how many blocks went to other owners, and (when the put waits
    for them) how many every owner committed."""

    blocks: int
    # (future of the owner's job, offset of the piece in the job, blocks of the piece), per
    # piece; none where the put does not wait for its owners
    parts: list[list[tuple[asyncio.Future[int], int, int]]] = field(default_factory=list)

    async def committed(self, timeout_s: float) -> int:
        futures = {f for part in self.parts for f, _, _ in part}
        if futures:
            await asyncio.wait(futures, timeout=timeout_s)
        total = 0
        for part in self.parts:
            got = min((max(0, min(n, (f.result() if f.done() else 0) - off)) for f, off, n in part), default=0)
            total += got
        return total


@dataclass(slots=True)
class _Round:
    """A lookup's units past its local prefix that this node lacks part of (all of them,
    in a round routed ahead: `ClusterNode._route_ahead`), in chain order,
    as arrays: positions [starts, stops), blocks held or pending here from the start
    (`locs`), the position of each one's key (its first block), its first current owner
    (an index into `names`, -1: none), whether a copy here is a replica; the units asked
    of each node (indices, in the order they are asked of it: see `ClusterNode._ask`),
    and where the chain ends for sure."""

    starts: np.ndarray[Any, Any]
    stops: np.ndarray[Any, Any]
    locs: np.ndarray[Any, Any]
    key_pos: np.ndarray[Any, Any]
    first_owner: np.ndarray[Any, Any]
    names: list[str]
    replica: np.ndarray[Any, Any]
    asks: dict[str, np.ndarray[Any, Any]]
    end: int


class _Ranges(NamedTuple):
    """What one pull of a lookup copies from `holder`, its blocks already pending: its
    runs of consecutive positions [starts, stops) of one kind (replica or owned) and
    their blocks' hashes, and per unit in them (`firsts`/`lasts`: each run's first and
    last), the position of its key."""

    holder: str
    pull: Any  # kvstore.cluster.pull's handle of the pull, made by `Puller.mark`
    starts: np.ndarray[Any, Any]
    stops: np.ndarray[Any, Any]
    replica: np.ndarray[Any, Any]
    hashes: list[bytes]
    key_pos: np.ndarray[Any, Any]
    firsts: np.ndarray[Any, Any]
    lasts: np.ndarray[Any, Any]


_EMPTY = np.zeros(0, np.int64)
_ZERO = np.zeros(1, np.int64)
_HASH_ITEM = np.dtype(f"V{HASH_BYTES}")  # one hash as one array item
_EMPTY_BOOL = np.zeros(0, bool)

# `ClusterNode._route_ahead`: nothing past the local prefix is to be found elsewhere.
_ENDS_HERE = object()

T = TypeVar("T")


def _keys_at(packed: bytes, positions: np.ndarray[Any, Any]) -> bytes:
    """The hashes at these positions of a packed chain, laid end to end."""
    return np.frombuffer(packed, np.uint8).reshape(-1, HASH_BYTES)[positions].tobytes()  # type: ignore[no-any-return]


# The round's steps in one native pass each where the module is built (kvstore/_native/
# units.c); the numpy steps below are their reference and fallback.
_UNITS = native if native is not None and hasattr(native, "units_reach") else None


def _ranges(packed: bytes, starts: np.ndarray[Any, Any], stops: np.ndarray[Any, Any],
            idx: np.ndarray[Any, Any] | None = None) -> bytes:
    """The hashes of positions [starts[j], stops[j]) of a packed chain for each j of
    `idx` in its order (every j where None), laid end to end (int64 arrays)."""
    if _UNITS is not None:
        return _UNITS.gather_ranges(packed, HASH_BYTES, starts, stops, idx)
    if idx is not None:
        starts, stops = starts[idx], stops[idx]
    return _concat(packed, starts, stops)


def _spread(count: int, sizes: np.ndarray[Any, Any], idx: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A node's answer, that it holds the first `count` blocks of units `idx` laid end
    to end in that order, as blocks per unit (0 for units not asked of it)."""
    got = np.zeros(len(sizes), np.int64)
    if _UNITS is not None:
        _UNITS.spread_prefix(count, sizes, idx, got)
        return got
    asked = sizes[idx]
    got[idx] = np.clip(count - (np.cumsum(asked) - asked), 0, asked)
    return got


def _reach(locs: np.ndarray[Any, Any], found: np.ndarray[Any, Any],
           sizes: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], int, bool]:
    """Per unit, the more of its leading blocks held here (`locs`) or found elsewhere
    (`found`); the first unit short of its size (`len(sizes)` if none), where the chain
    ends; whether a unit up to it was found beyond what is held here."""
    if _UNITS is not None:
        best = np.empty(len(sizes), np.int64)
        short, copied = _UNITS.units_reach(locs, found, sizes, best)
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


_BOUNDS: OrderedDict[tuple[int, int, bool], np.ndarray[Any, Any]] = OrderedDict()


def _unit_bounds(n: int, unit_blocks: int, lead_in: bool) -> np.ndarray[Any, Any]:
    """The unit boundaries of an n-block chain, 0 and n included (kept for recent n)."""
    key = (n, unit_blocks, lead_in)
    bounds = _BOUNDS.get(key)
    if bounds is None:
        head = [0] + [p for p in (1 << k for k in range(unit_blocks.bit_length())) if p < unit_blocks] \
            if lead_in else [0]
        rest = np.arange(unit_blocks if lead_in else unit_blocks, n, unit_blocks, dtype=np.int64)
        bounds = np.unique(np.concatenate([np.array(head, np.int64), rest, np.array([n], np.int64)]))
        bounds = bounds[bounds <= n]
        _BOUNDS[key] = bounds
        if len(_BOUNDS) > 64:
            _BOUNDS.popitem(last=False)
    return bounds


def put_pieces(placement: Placement, hashes: list[bytes], parent: bytes | None, pos: int, key0: bytes) -> list[_Piece]:
    """A put's blocks cut into the units they are in (`key0`: the first one's key)."""
    s, lead_in = placement.unit_blocks, placement.lead_in
    out: list[_Piece] = []
    end = pos + len(hashes)
    p = pos
    while p < end:
        start = unit_start(p, s, lead_in)
        stop = min(unit_stop(start, s, lead_in), end)
        key = hashes[start - pos] if start >= pos else key0
        out.append(_Piece(key, p, hashes[p - pos : stop - pos], hashes[p - pos - 1] if p > pos else parent))
        p = stop
    return out


def plan_put_by_piece(placement: Placement, me: str, pieces: list[_Piece], pos: int, from_peer: bool) -> PutPlan:
    """`ClusterNode.after_put`'s plan for node `me`, one unit (piece) at a time: any
    replication factor, hot units."""
    plan = PutPlan([], [], {}, 0, [])
    filled: dict[str, int] = {}  # blocks in each owner's last job
    singles: dict[tuple[str, int], list[int]] = {}  # a one-owner piece's part, merged per job
    for piece in pieces:
        if piece.key == b"":
            continue  # its unit's first block is unknown here: kept as if owned
        a = piece.position - pos
        b = a + len(piece.hashes)
        owners = placement.owners(piece.key)
        if me in owners:
            plan.owned.append((piece.key, a, b))
        else:
            _add_range(plan.replicas, a, b)
        if from_peer:
            continue
        part = []
        for node in owners:
            if node == me:
                continue
            jobs = plan.jobs.setdefault(node, [])
            if not jobs or filled[node] + (b - a) > FORWARD_JOB_BLOCKS:
                jobs.append([])
                filled[node] = 0
            part.append((node, len(jobs) - 1, filled[node], b - a))
            _add_range(jobs[-1], a, b)
            filled[node] += b - a
        if part:
            plan.forwarded += b - a
            if len(part) == 1:
                # One owner: its consecutive pieces in one job are one part (what it
                # committed of them is one count: `ForwardTicket.committed`).
                node, j, off, n = part[0]
                merged = singles.get((node, j))
                if merged is not None and merged[0] + merged[1] == off:
                    merged[1] += n
                else:
                    if merged is not None:
                        plan.parts.append(((node, j, merged[0], merged[1]),))
                    singles[(node, j)] = [off, n]
            else:
                plan.parts.append(tuple(part))
    plan.parts += [((node, j, off, n),) for (node, j), (off, n) in singles.items()]
    return plan


def plan_put_arrays(placement: Placement, me: str, hashes: list[bytes], pos: int, key0: bytes,
                    from_peer: bool) -> PutPlan | None:
    """`plan_put_by_piece`'s plan in whole-array steps over the put's units: one
    ranking of every unit's key (`Placement.owner_indices`), then runs of units per
    owner. None where the placement needs the unit-by-unit plan (R > 1, a hot unit)."""
    n = len(hashes)
    return _plan_arrays(placement, me, b"".join(hashes), np.array([0, n], np.int64), np.array([pos], np.int64),
                        [key0], from_peer)


def plan_runs_arrays(placement: Placement, me: str, hashes: list[bytes], runs: Sequence[tuple[int, int, bytes]]
                     ) -> PutPlan | None:
    """The plan of a forward from another node that holds several runs of one chain laid
    end to end in `hashes`, each (offset in hashes, chain position, its first unit's key),
    in one ranking for all of them: as `plan_put_arrays` per run with from_peer set
    (nothing is forwarded again), its offsets into the whole of `hashes`."""
    offsets = np.array([r[0] for r in runs] + [len(hashes)], np.int64)
    positions = np.array([r[1] for r in runs], np.int64)
    return _plan_arrays(placement, me, b"".join(hashes), offsets, positions, [r[2] for r in runs], True)


def _plan_arrays(placement: Placement, me: str, packed: bytes, offsets: np.ndarray[Any, Any],
                 positions: np.ndarray[Any, Any], key0s: list[bytes], from_peer: bool) -> PutPlan | None:
    """The array plan of runs laid end to end in `packed` (run i: offsets [offsets[i],
    offsets[i + 1]), chain positions from positions[i], its first unit's key key0s[i],
    b"" where unknown)."""
    lens = np.diff(offsets)
    ends = positions + lens
    bounds = _unit_bounds(int(ends.max()), placement.unit_blocks, placement.lead_in)
    # The units that start inside each run, as offsets into packed.
    lo = np.searchsorted(bounds, positions, side="right")
    counts = np.searchsorted(bounds, ends, side="left") - lo
    run_of = np.repeat(np.arange(len(lens)), counts)
    at = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + lo[run_of]
    inner = bounds[at] - positions[run_of] + offsets[run_of]
    known = np.array([bool(k) for k in key0s])
    starts = np.concatenate([offsets[:-1], inner])
    order = np.argsort(starts, kind="stable")
    starts = starts[order]
    stops = np.concatenate([starts[1:], offsets[-1:]])
    items = np.frombuffer(packed, _HASH_ITEM)[starts]
    firsts = np.flatnonzero(order < len(lens))  # the pieces a run starts with
    keep = np.ones(len(starts), bool)
    keep[firsts[~known]] = False  # the first unit's key is unknown: kept as if owned (see `plan_put_by_piece`)
    if known.any():
        items[firsts[known]] = np.frombuffer(b"".join(key0s), _HASH_ITEM)
    starts, stops = starts[keep], stops[keep]
    if not len(starts):
        return PutPlan([], [], {}, 0, [])
    keys = items[keep].tobytes()
    routed = placement.owner_indices(keys, HASH_BYTES)
    if routed is None:
        return None
    names, sets = routed
    owner = sets[0]
    mine = owner == (names.index(me) if me in names else -2)
    plan = PutPlan([], _runs(starts[~mine], stops[~mine]), {}, 0, [])
    for i, a, b in zip(np.flatnonzero(mine).tolist(), starts[mine].tolist(), stops[mine].tolist()):
        plan.owned.append((keys[i * HASH_BYTES : (i + 1) * HASH_BYTES], a, b))
    if from_peer:
        return plan
    elsewhere = ~mine & (owner >= 0)
    plan.forwarded = int((stops - starts)[elsewhere].sum())
    for k in np.unique(owner[elsewhere]).tolist():
        node = names[k]
        jobs: list[list[tuple[int, int]]] = [[]]
        blocks = 0
        ours = owner == k
        # Cut into jobs as `plan_put_by_piece` cuts them (a unit never splits).
        for a, b in zip(starts[ours].tolist(), stops[ours].tolist()):
            if blocks and blocks + (b - a) > FORWARD_JOB_BLOCKS:
                plan.parts.append(((node, len(jobs) - 1, 0, blocks),))
                jobs.append([])
                blocks = 0
            _add_range(jobs[-1], a, b)
            blocks += b - a
        plan.parts.append(((node, len(jobs) - 1, 0, blocks),))
        plan.jobs[node] = jobs
    return plan


def _retrieve(task: asyncio.Task[int]) -> None:
    if not task.cancelled():
        task.exception()


class ClusterNode:
    """One daemon's part in the pool (see the module docstring)."""

    def __init__(self, store: Store, membership: Membership, transport: PeerTransport,
                 settings: ClusterSettings = ClusterSettings(), *, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.membership = membership
        self.transport = transport
        self.settings = settings
        self.node_id = membership.node_id
        self.rule = settings.rule
        self._clock = clock
        self.hot = HotUnits(max_extra=settings.hot_extra_owners, clock=clock)
        self.placement = Placement([self.node_id], unit_blocks=settings.unit_blocks, replicas=settings.replicas,
                                   max_extra_owners=settings.hot_extra_owners, grace_s=settings.grace_s,
                                   hotness=self.hot, clock=clock)
        self.breakers = Breakers(settings.suspect_s, clock=clock)
        self.forwarder = Forwarder(store, transport, self.breakers, queue_blocks=settings.forward_queue_blocks,
                                   timeout_s=settings.forward_timeout_s)
        self.puller = Puller(store, transport, self.breakers, executor=executor, max_running=settings.pulls,
                             timeout_s=settings.fetch_timeout_s)
        self.puller.pulled = self._pulled
        # May change while the daemon runs (SetConfig, SIGHUP).
        self.lookup_timeout_s = settings.lookup_timeout_s
        self.counters = ClusterCounters()
        self.peers: dict[str, PeerStats] = {}
        self.draining = False
        self.left = False
        # Store tier id -> Tier value; a block not held here (pending a pull) -> TIER_REMOTE.
        table = bytearray(256)
        for tid, name in enumerate(store.tier_id_names):
            table[tid] = TIER_BY_NAME.get(name, kvstore_pb2.TIER_UNSPECIFIED)
        table[Store.ABSENT] = kvstore_pb2.TIER_REMOTE
        self._tier_values = bytes(table)
        self._calls: dict[bytes, PeerCall] = {}
        self._owned: OrderedDict[bytes, _OwnedUnit] = OrderedDict()
        self._pushed: OrderedDict[tuple[bytes, str], None] = OrderedDict()
        self._positions: OrderedDict[bytes, int] = OrderedDict()  # ns id + hash -> chain position
        self._started: dict[str, float] = {}  # node id -> started_at of the record last seen
        self._present: set[str] = set()  # the members of the last view
        self._unplaced_rules: set[str] = set()
        self._unsubscribe: Callable[[], None] | None = None
        self._first_view = True
        self._maintenance: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def fetch_timeout_s(self) -> float:
        return self.puller.timeout_s

    @fetch_timeout_s.setter
    def fetch_timeout_s(self, value: float) -> None:
        self.puller.timeout_s = value

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Join: start the membership (waits briefly for a first view from etcd) and the movers."""
        self._unsubscribe = self.membership.subscribe(self._on_view)
        await self.membership.start()
        self._on_view(self.membership.view)
        self.forwarder.start()
        self._maintenance = asyncio.get_running_loop().create_task(self._maintain(), name="kvstore-cluster")

    async def leave(self) -> None:
        """Leave every view now (a clean stop revokes the lease); keep serving peers' calls."""
        if self.left:
            return
        self.left = True
        await self.membership.aclose()

    async def aclose(self) -> None:
        await self.leave()
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._closing = True
        if self._maintenance is not None:
            self._maintenance.cancel()
            # (gather: a cancellation of this call stays this call's)
            await asyncio.gather(self._maintenance, return_exceptions=True)
        await self.forwarder.aclose()
        await self.puller.aclose()
        await self.transport.aclose()

    async def _maintain(self) -> None:
        # Ends on `_closing` too: a cancellation lost in a library's call below (a gRPC
        # channel's close) must not keep the close waiting for this loop forever.
        while not self._closing:
            await asyncio.sleep(MAINTENANCE_S)
            try:
                await self.transport.reap()
                self.placement.in_grace()  # expires past member sets
            except Exception:  # task boundary: try again next round
                logger.exception("cluster maintenance failed")

    def _on_view(self, view: View) -> None:
        placed: set[str] = set()
        for node, member in view.members.items():
            if member.draining or (node == self.node_id and self.draining):
                continue
            if member.placement and member.placement != self.rule:
                if node not in self._unplaced_rules:
                    self._unplaced_rules.add(node)
                    logger.error("cluster: member %s places by %r, this node by %r: it is not used as an owner; "
                                 "give every node the same cluster_unit_blocks and cluster_replicas",
                                 node, member.placement, self.rule)
                continue
            placed.add(node)
        if self._first_view:
            # Joining is a change of the pool's member set: the units this node wins were
            # the others' until now, so for the grace period it asks their previous owners.
            self._first_view = False
            p = self.placement
            others = placed - {self.node_id}
            self.placement = Placement(others or placed, unit_blocks=p.unit_blocks, replicas=p.replicas,
                                       max_extra_owners=p.max_extra_owners, grace_s=p.grace_s, hotness=self.hot,
                                       clock=self._clock)
            self.placement.update(placed)
        elif self.placement.update(placed):
            logger.info("cluster: %d members place units (%s)", len(placed), ", ".join(sorted(placed)))
        self.transport.update({n: m.addresses for n, m in view.members.items() if n != self.node_id})
        for node, member in view.members.items():
            seen = self._started.get(node)
            if node not in self._present or (seen is not None and seen != member.started_at):
                # It restarted, or came back after it was gone (a partition healed): a new
                # channel, and no suspicion carried over.
                if node != self.node_id:
                    self.transport.forget(node)
                self.breakers.forget(node)
            self._started[node] = member.started_at
        self._present = set(view.members)

    # ------------------------------------------------------------------ reads

    def peer_looked_up(self, asked: int, held: int) -> None:
        """Count another node's lookup answered here: `held` of its `asked` blocks."""
        c = self.counters
        c.peer_lookups += 1
        c.peer_lookup_blocks += asked
        c.peer_hit_blocks += held

    def _call(self, namespace_id: bytes) -> PeerCall:
        call = self._calls.get(namespace_id)
        if call is None:
            info = self.store.namespace(namespace_id)
            if len(self._calls) >= LAYOUTS_KEPT:
                self._calls.clear()
            call = self._calls[namespace_id] = PeerCall.of(info.tenant, layout_to_proto(info.layout))
        return call

    def _peer(self, node: str) -> PeerStats:
        st = self.peers.get(node)
        if st is None:
            st = self.peers[node] = PeerStats()
        return st

    async def extend(self, namespace_id: bytes, chain: bytes | Sequence[bytes], held: int) -> Extension | None:
        """The rest of a lookup's answer past its local prefix of `held` blocks (see the
        module docstring); None when nothing past it is found.

        Its work is in whole-array steps over the chain's units, not a Python step per
        unit where it can be helped: a 1,000-block chain has hundreds of units."""
        if self.left or self.store.namespace(namespace_id).groups:
            return None  # a grouped layout's parts stay on the node that computed them
        packed = chain if isinstance(chain, bytes) else b"".join(chain)
        if held * HASH_BYTES >= len(packed):
            return None
        ahead = self._route_ahead(namespace_id, packed, held)
        if ahead is _ENDS_HERE:
            return None
        if isinstance(ahead, _Round):
            return await self._extend_ahead(namespace_id, packed, held, ahead)
        present = self.store.present(namespace_id, packed[held * HASH_BYTES :])
        rnd = self._plan(namespace_id, packed, held, present)
        got = None
        if rnd.asks:
            if self.puller.has_room():
                got, _ = await self._ask(namespace_id, packed, rnd)
            else:
                self.counters.no_room_for_pulls += 1
        return self._combine(namespace_id, packed, held, present, rnd, got)

    def _route_ahead(self, namespace_id: bytes, packed: bytes, held: int) -> _Round | object | None:
        """Whom to ask for the units past the prefix, before this node knows which of them
        it holds: each other owner for the units it owns, as a round of every unit past
        the prefix whose `locs` are read later (`_extend_ahead`). `_ENDS_HERE` when the unit the
        prefix stops in is this node's own (nobody else is asked for it: nothing past the
        prefix is found); None where the round is planned from what is held here first
        (`_plan`): in the grace of a member change (a previous owner, which may be this
        node, holds what the new one lacks, and a node answers only a prefix of what it is
        asked), with a hot unit or R > 1 among them, a block at the prefix pending a
        pull, or no room for pulls."""
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
            # way), which `_plan` counts as held.
            here = self.store.present(namespace_id, packed[held * HASH_BYTES : (held + 1) * HASH_BYTES])
            return _ENDS_HERE if here[0] == Store.ABSENT else None
        allow = self.breakers.allow
        asks: dict[str, np.ndarray[Any, Any]] = {}
        for k, name in enumerate(names):
            if k != me and allow(name):
                idx = np.flatnonzero(owner == k)
                if len(idx):
                    asks[name] = idx
        if names[owner[0]] not in asks:
            return None  # its owner is suspect: `_plan` ends the chain where it must
        return _Round(starts, stops, _EMPTY, unit_starts, owner, names, owner != me, asks, len(packed) // HASH_BYTES)

    async def _extend_ahead(self, namespace_id: bytes, packed: bytes, held: int, rnd: _Round) -> Extension | None:
        """`extend` with its round sent first (`_route_ahead`): what this node holds past
        the prefix is read while the answers travel, and the round covers every unit past
        the prefix (one held here whole is never short of blocks, whatever its owner says)."""

        def held_here() -> tuple[bytes, np.ndarray[Any, Any]]:
            present = self.store.present(namespace_id, packed[held * HASH_BYTES :])
            return present, self._held_of(namespace_id, packed, held, present, rnd.starts, rnd.stops)

        got, local = await self._ask(namespace_id, packed, rnd, held_here)
        assert local is not None
        present, rnd.locs = local
        return self._combine(namespace_id, packed, held, present, rnd, got)

    def _unit_cut(self, packed: bytes, held: int) -> tuple[np.ndarray[Any, Any], ...]:
        """The units from position `held` on (the first one from `held`, inside its unit),
        as arrays: their first and past-last positions and the position of each unit's
        first block (its key). Cut as `unit_spans` cuts them, in whole-array steps."""
        n = len(packed) // HASH_BYTES
        bounds = _unit_bounds(n, self.placement.unit_blocks, self.placement.lead_in)
        first = int(np.searchsorted(bounds, held, side="right")) - 1
        unit_starts = bounds[first:-1]
        starts = unit_starts.copy()
        starts[0] = held
        return starts, bounds[first + 1 :], unit_starts

    def _units_past(self, namespace_id: bytes, packed: bytes, held: int,
                    present: bytes) -> tuple[np.ndarray[Any, Any], ...]:
        """`_unit_cut`'s units and, per unit, how many of its leading blocks are held
        here or pending a pull (`_held_of`): starts, stops, those counts, key positions."""
        starts, stops, unit_starts = self._unit_cut(packed, held)
        return starts, stops, self._held_of(namespace_id, packed, held, present, starts, stops), unit_starts

    def _held_of(self, namespace_id: bytes, packed: bytes, held: int, present: bytes, starts: np.ndarray[Any, Any],
                 stops: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """How many leading blocks of each unit [starts, stops) past position `held` are
        held here or pending a pull (`present`: `Store.present` of the chain from `held`)."""
        absent = np.frombuffer(present, np.uint8) == Store.ABSENT
        pending = self.puller.pending.get(namespace_id)
        if pending:
            gaps = np.flatnonzero(absent)
            copying = [packed[(held + g) * HASH_BYTES : (held + g + 1) * HASH_BYTES] in pending for g in gaps.tolist()]
            absent[gaps[np.array(copying, bool)]] = False
        m = len(absent)
        first_absent = np.minimum.reduceat(np.where(absent, np.arange(m), m), starts - held)
        return np.minimum(first_absent - (starts - held), stops - starts)  # type: ignore[no-any-return]

    def _plan(self, namespace_id: bytes, packed: bytes, held: int, present: bytes) -> _Round:
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
            return self._plan_indexed(starts[lacking], stops[lacking], locs[lacking], key_pos, end, *routed)
        owners, ranked = self.placement.route_many(split_hashes(joined))
        me = self.node_id
        allow = self.breakers.allow
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
                        askable[node] = allow(node)
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
                    # Its units in the order it is likeliest to hold them (see `_ask`):
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

    def _plan_indexed(self, starts: np.ndarray[Any, Any], stops: np.ndarray[Any, Any], locs: np.ndarray[Any, Any],
                      key_pos: np.ndarray[Any, Any], end: int, names: list[str],
                      sets: list[np.ndarray[Any, Any]]) -> _Round:
        """`_plan`'s round from each unit's owner under each member set still counted
        (`Placement.owner_indices`), in whole-array steps: a unit is asked of its owners
        that are not this node and not suspect; the chain ends at the first unit with none."""
        me = self.node_id
        allow = self.breakers.allow
        askable = np.array([n != me and allow(n) for n in names] + [False], bool)  # [-1]: no owner
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
                # member set (see `_ask`).
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
        """One parallel round of lookups, one per node, under the lookup deadline: what
        each node holds of each unit asked of it (in `_Round` order; 0 where not asked),
        and what `meanwhile` returns, made while the answers travel.

        A node is asked for its units laid end to end and answers the prefix of them it
        holds, so the first unit it lacks hides those after it: its units go in the order
        it is likeliest to hold them (`_Round.asks`), the units it owns before those it is
        asked for as a previous owner in the grace of a change, which lacks every block
        put since."""
        self.counters.remote_lookups += 1
        call = self._call(namespace_id)
        deadline_s = self.lookup_timeout_s
        requests = {node: _ranges(packed, rnd.starts, rnd.stops, idx) for node, idx in rnd.asks.items()}
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
        else:
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
                    results[node] = asyncio.CancelledError()
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
                self.breakers.failure(node)
                continue
            self.breakers.success(node)
            # The node answered a prefix of the units' blocks laid end to end: per unit.
            out[node] = _spread(result, sizes, rnd.asks[node])
        return out, local

    def _combine(self, namespace_id: bytes, packed: bytes, held: int, present: bytes, rnd: _Round,
                 got: dict[str, np.ndarray[Any, Any]] | None) -> Extension | None:
        """The answer past the local prefix from the plan and the nodes' answers, and the
        pulls that copy what it found elsewhere."""
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
        best, short, copied = _reach(rnd.locs, best_found, sizes)
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
        self.store.count_past_prefix(past)
        self.counters.local_past_prefix_blocks += len(tiers) - remote
        self.counters.remote_hit_blocks += remote
        if copied and holders:
            # The pulls are marked (their blocks pending: a fetch that follows this answer
            # waits for them) and started once the answer is written: by a callback
            # scheduled now, which runs before the event loop reads the next request.
            asyncio.get_running_loop().call_soon(self._start_pulls, namespace_id, packed, rnd, holders, pick, best,
                                                 best_found, cut)
        return Extension(len(tiers), tiers, remote)

    def _mark(self, holder: str, namespace_id: bytes, packed: bytes, starts: np.ndarray[Any, Any],
              stops: np.ndarray[Any, Any], replica: np.ndarray[Any, Any], key_pos: np.ndarray[Any, Any]) -> _Ranges:
        """One pull from `holder` of these ranges (one per unit), consecutive ones of the
        same kind merged into one run each, its blocks marked pending."""
        joins = (starts[1:] == stops[:-1]) & (replica[1:] == replica[:-1])
        firsts = np.concatenate([[0], np.flatnonzero(~joins) + 1]).astype(np.int64)
        lasts = np.concatenate([firsts[1:] - 1, [len(starts) - 1]]).astype(np.int64)
        run_starts, run_stops = starts[firsts], stops[lasts]
        hashes = split_hashes(_ranges(packed, run_starts, run_stops))
        return _Ranges(holder, self.puller.mark(namespace_id, hashes), run_starts, run_stops, replica[firsts], hashes,
                       key_pos, firsts, lasts)

    def _start_pulls(self, namespace_id: bytes, packed: bytes, rnd: _Round, holders: list[str],
                     pick: np.ndarray[Any, Any] | None, best: np.ndarray[Any, Any], best_found: np.ndarray[Any, Any],
                     cut: int) -> None:
        """Mark and start a lookup's pulls (`_combine`): from each holder picked (`pick`,
        None with one), the units of the first `cut` it holds more of than this node."""
        copied = np.flatnonzero(best_found[:cut] > rnd.locs[:cut])
        call = self._call(namespace_id)
        for k, holder in enumerate(holders):
            idx = copied if pick is None else copied[pick[copied] == k]
            if not len(idx):
                continue
            self._peer(holder).hit_blocks += int((best - rnd.locs)[idx].sum())
            r = self._mark(holder, namespace_id, packed, (rnd.starts + rnd.locs)[idx], (rnd.starts + best)[idx],
                           rnd.replica[idx], rnd.key_pos[idx])
            keys = split_hashes(_keys_at(packed, r.key_pos))
            unit_keys = [keys[f : l + 1] for f, l in zip(r.firsts.tolist(), r.lasts.tolist())]
            self.puller.launch(r.holder, call, r.pull, PullSpec(namespace_id, packed, r.starts.tolist(),
                                                                r.stops.tolist(), r.replica.tolist(), unit_keys,
                                                                r.hashes))

    @property
    def pulling(self) -> bool:
        """Whether any pull is copying blocks now (a fetch has something to wait for)."""
        return bool(self.puller.pending)

    async def settle_fetch(self, namespace_id: bytes, chain: bytes | Sequence[bytes]) -> None:
        """Before a fetch: wait (bounded by `fetch_timeout_s`) for the pulls copying the
        blocks where its held prefix ends, so it serves them once they landed."""
        puller = self.puller
        if namespace_id not in puller.pending:
            return
        packed = chain if isinstance(chain, bytes) else b"".join(chain)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.fetch_timeout_s
        while namespace_id in puller.pending:
            gap = self.store.present(namespace_id, packed).find(_ABSENT)
            if gap < 0:
                return
            h = packed[gap * HASH_BYTES : (gap + 1) * HASH_BYTES]
            if not await puller.wait(namespace_id, h, deadline - loop.time()):
                return

    def peer_fetched(self, namespace_id: bytes, hashes: Sequence[bytes]) -> None:
        """Another node fetched these blocks from here: units this node owns among them heat up."""
        owned = self._owned
        if not owned:
            return
        for h in hashes:
            key = namespace_id + h
            if key in owned:
                self.hot.record(h)

    # ------------------------------------------------------------------ writes

    def after_put(self, namespace_id: bytes, hashes: Sequence[bytes], parent: bytes | None, position: int | None,
                  *, tokens: bytes = b"", wait: bool = False, from_peer: str = "") -> ForwardTicket | None:
        """A put committed here: queue its blocks for the owners of their units, hold the
        blocks of units owned elsewhere as replicas, remember the units owned here. A put
        from another node (`from_peer`) is not forwarded again. `tokens`: the put's packed
        token ids from the chain's start, when it named its blocks by tokens.

        It runs before the engine's commit is answered, on the event loop: a put of a
        long chain is placed in whole-array steps over its units (`plan_put_arrays`),
        one ranking pass for all of them, where the placement allows (one owner per unit,
        no hot unit among them); else unit by unit (`plan_put_by_piece`). Both give the
        same plan (tests/cluster/test_put_plan.py)."""
        if self.left or not hashes or self.store.namespace(namespace_id).groups:
            return None
        pos = position if position is not None else self._position_of(namespace_id, parent)
        if pos is None:
            self.counters.unplaced_blocks += len(hashes)
            return None
        self._remember_position(namespace_id, hashes[-1], pos + len(hashes) - 1)
        hashes = list(hashes)
        key0 = self._first_key(namespace_id, hashes, parent, pos, tokens)
        plan = None
        if len(hashes) >= PLAN_ARRAYS_FROM_BLOCKS:
            plan = plan_put_arrays(self.placement, self.node_id, hashes, pos, key0, bool(from_peer))
        if plan is None:
            plan = plan_put_by_piece(self.placement, self.node_id, put_pieces(self.placement, hashes, parent, pos, key0),
                                     pos, bool(from_peer))
        return self._apply_put(namespace_id, hashes, parent, pos, plan, wait)

    def after_peer_put(self, namespace_id: bytes,
                       runs: Sequence[tuple[Sequence[bytes], bytes | None, int | None]]) -> None:
        """A forward from another node of several runs of one chain, each (hashes,
        parent, position), committed here: `after_put` of each run as a peer's (nothing
        is forwarded again), in one plan and one ranking for all of them where the
        placement allows. (Only peers put several runs in one call: `put_runs`.)"""
        if self.left or not runs or self.store.namespace(namespace_id).groups:
            return
        hashes: list[bytes] = []
        placed: list[tuple[int, int, bytes, bytes | None]] = []  # (offset in hashes, position, key0, parent)
        for run_hashes, parent, position in runs:
            if not run_hashes:
                continue
            pos = position if position is not None else self._position_of(namespace_id, parent)
            if pos is None:
                self.counters.unplaced_blocks += len(run_hashes)
                continue
            self._remember_position(namespace_id, run_hashes[-1], pos + len(run_hashes) - 1)
            run_list = list(run_hashes)
            placed.append((len(hashes), pos, self._first_key(namespace_id, run_list, parent, pos, b""), parent))
            hashes += run_list
        if not placed:
            return
        plan = None
        if len(hashes) >= PLAN_ARRAYS_FROM_BLOCKS:
            plan = plan_runs_arrays(self.placement, self.node_id, hashes, [(o, p, k) for o, p, k, _ in placed])
        if plan is None:  # unit by unit, run by run
            for i, (o, pos, key0, parent) in enumerate(placed):
                run = hashes[o : placed[i + 1][0] if i + 1 < len(placed) else len(hashes)]
                piece_plan = plan_put_by_piece(self.placement, self.node_id,
                                               put_pieces(self.placement, run, parent, pos, key0), pos, True)
                self._apply_put(namespace_id, run, parent, pos, piece_plan, False)
            return
        offsets = [o for o, _, _, _ in placed]
        for key, a, b in plan.owned:
            r = bisect.bisect_right(offsets, a) - 1
            o, pos, _, parent = placed[r]
            self._remember_owned(namespace_id, _Piece(key, pos + a - o, hashes[a:b], hashes[a - 1] if a > o else parent))
        self._hold_replicas(namespace_id, hashes, plan.replicas)

    def _hold_replicas(self, namespace_id: bytes, hashes: list[bytes], runs: list[tuple[int, int]]) -> None:
        """Mark a plan's replica runs (offsets [a, b) into `hashes`) as replicas here."""
        if runs:
            replicas = [h for a, b in runs for h in hashes[a:b]]
            self.counters.replica_blocks += self.store.mark_replicas(namespace_id, replicas)

    def _first_key(self, namespace_id: bytes, hashes: list[bytes], parent: bytes | None, pos: int,
                   tokens: bytes) -> bytes:
        """The key of the unit a put's first block is in: that block's hash where the unit
        starts there, else the hash of the unit's first block, held here or from the
        put's token ids (b"" where neither is known: the piece is kept as if owned)."""
        start = unit_start(pos, self.placement.unit_blocks, self.placement.lead_in)
        if start == pos:
            return hashes[0]
        return self._ancestor(namespace_id, parent, pos - start, tokens, start) or b""

    def _apply_put(self, namespace_id: bytes, hashes: list[bytes], parent: bytes | None, pos: int, plan: PutPlan,
                   wait: bool) -> ForwardTicket:
        """Carry out `after_put`'s plan: remember the owned units, submit the jobs, mark
        the replicas."""
        for key, a, b in plan.owned:
            self._remember_owned(namespace_id, _Piece(key, pos + a, hashes[a:b], hashes[a - 1] if a else parent))
        loop = asyncio.get_running_loop()
        submitted: list[ForwardJob] = []
        done: dict[tuple[str, int], asyncio.Future[int]] = {}
        call = self._call(namespace_id) if plan.jobs else None
        for node, jobs in plan.jobs.items():
            for j, runs in enumerate(jobs):
                a, b = runs[0]
                job = ForwardJob(node, namespace_id, call, hashes[a:b],  # type: ignore[arg-type]
                                 hashes[a - 1] if a else parent, pos + a, loop.create_future() if wait else None)
                for a, b in runs[1:]:
                    # A run after a gap: a run of the job (one put where the owner's
                    # transport takes runs, else one put per run).
                    job.runs.append((len(job.hashes), hashes[a - 1] if a else parent, pos + a))
                    job.hashes += hashes[a:b]
                if job.done is not None:
                    done[(node, j)] = job.done
                submitted.append(job)
        parts = [[(done[(node, j)], off, n) for node, j, off, n in part] for part in plan.parts] if wait else []
        for job in submitted:
            self.forwarder.submit(job)
        self._hold_replicas(namespace_id, hashes, plan.replicas)
        return ForwardTicket(plan.forwarded, parts)

    def _ancestor(self, namespace_id: bytes, parent: bytes | None, distance: int, tokens: bytes,
                  position: int) -> bytes | None:
        """The hash `distance` blocks before a put's first block (1: its parent): through
        the parents held here, else from the put's token ids."""
        h = self.store.ancestor(namespace_id, parent, distance - 1) if parent is not None else None
        if h is not None:
            return h
        if tokens:
            try:
                info = self.store.namespace(namespace_id)
                bst = info.layout.block_size_tokens
                chain = self.store.hashes_for_tokens(namespace_id, tokens[: (position + 1) * bst * 4])
            except KVStoreError:
                return None
            return chain[position] if len(chain) > position else None
        return None

    def _position_of(self, namespace_id: bytes, parent: bytes | None) -> int | None:
        """A put's first block's position from its parent: 0 without one, else the
        parent's position + 1, known from recent puts or by walking the parents held here."""
        if parent is None:
            return 0
        known = self._positions.get(namespace_id + parent)
        if known is not None:
            return known + 1
        held = self.store.chain_position(namespace_id, parent, MAX_PARENT_WALK)
        return held + 1 if held is not None else None

    def _remember_position(self, namespace_id: bytes, last_hash: bytes, position: int) -> None:
        positions = self._positions
        positions[namespace_id + last_hash] = position
        if len(positions) > POSITIONS_KEPT:
            positions.popitem(last=False)

    def _remember_owned(self, namespace_id: bytes, piece: _Piece) -> None:
        key = namespace_id + piece.key
        owned = self._owned
        unit = owned.get(key)
        if unit is not None and unit[2] + len(unit[3]) // HASH_BYTES == piece.position:
            owned[key] = (*unit[:3], unit[3] + b"".join(piece.hashes), unit[4])
            owned.move_to_end(key)
        elif unit is None or piece.position <= unit[2]:
            owned[key] = (namespace_id, piece.key, piece.position, b"".join(piece.hashes), piece.parent)
            owned.move_to_end(key)
        if len(owned) > OWNED_UNITS_KEPT:
            owned.popitem(last=False)

    def _pulled(self, holder: str, landed: Sequence[tuple[PullRun, int]]) -> None:
        """Runs of a pull published (with how many of their blocks). Their copies also go
        where the pool wants them and lacks them: to the extra owners of a hot unit, and
        to the current owners of a unit found on a previous owner (a membership change:
        the traffic rebuilds the new owner's units)."""
        keys = [key for run, _ in landed for key in run.unit_keys]
        for key in keys:
            self.hot.record(key)  # found elsewhere and copied here: its heat
        # Every unit's owners in one ranking pass (a pull has hundreds of units).
        owners_of = dict(zip(keys, self.placement.route_many(keys)[0])) if keys else {}
        for run, blocks in landed:
            self._pulled_run(holder, run, blocks, owners_of)

    def _pulled_run(self, holder: str, run: PullRun, blocks: int, owners_of: dict[bytes, tuple[str, ...]]) -> None:
        me = self.node_id
        if not run.replica:
            for key in run.unit_keys:
                if me in owners_of[key]:
                    self._remember_owned(run.namespace_id, _Piece(key, run.position, run.hashes[:blocks], run.parent))
                    break
        for key in run.unit_keys:
            owners = owners_of[key]
            hot = bool(self.hot.extra_owners(key))
            if not hot and holder in owners:
                continue
            for node in owners:
                if node in (me, holder) or (key, node) in self._pushed:
                    continue
                self._pushed[(key, node)] = None
                if len(self._pushed) > PUSHED_KEPT:
                    self._pushed.popitem(last=False)
                if self.forwarder.submit(ForwardJob(node, run.namespace_id, self._call(run.namespace_id),
                                                    run.hashes[:blocks], run.parent, run.position)):
                    self.counters.hot_pushes += hot
                    self.counters.handoff_pushes += not hot
            break  # one push per run and owner, by its first unit that needs one

    # ------------------------------------------------------------------ operations

    def where(self, namespace_id: bytes, chain: bytes | Sequence[bytes]) -> list[UnitPlace]:
        """Each placement unit of a chain (from its first block): owners, lookup targets
        and how many of its leading blocks this node holds."""
        packed = chain if isinstance(chain, bytes) else b"".join(chain)
        present = self.store.present(namespace_id, packed)
        out = []
        for span in self.placement.spans(PackedChain(packed)):
            gap = present.find(_ABSENT, span.start, span.stop)
            out.append(UnitPlace(span.start, span.stop, span.key, self.placement.owners(span.key),
                                 self.placement.lookup_targets(span.key),
                                 (span.stop if gap < 0 else gap) - span.start))
        return out

    def status(self) -> ClusterStatus:
        view = self.membership.view
        suspects = self.breakers.suspects()
        placed = self.placement.members
        members = tuple(
            MemberState(m, n == self.node_id, n in suspects, suspects.get(n, 0.0), n in placed)
            for n, m in sorted(view.members.items()))
        return ClusterStatus(self.node_id, self.membership.status(), members, self.placement.unit_blocks,
                             self.placement.replicas, self.placement.in_grace(), self.draining, self.left)

    async def drain(self, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> DrainResult:
        """Before a planned removal: stop taking ownership (peers stop placing units here
        and ask this node only as a previous owner, during their grace period), push the
        owned units it remembers (hottest first) to their next owners, then leave the view."""
        if self.left:
            raise FailedPrecondition("this node has left the pool already")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self.draining = True
        await self.membership.update_me(replace(self.membership.me, draining=True))
        self._on_view(self.membership.view)
        units = sorted(self._owned.values(), key=lambda u: -self.hot.count(u[1]))
        pushed = failed = blocks = 0
        me = self.node_id
        for first in range(0, len(units), DRAIN_BATCH_UNITS):
            batch: list[tuple[_OwnedUnit, list[asyncio.Future[int]]]] = []
            for unit in units[first : first + DRAIN_BATCH_UNITS]:
                ns, key, position, packed, parent = unit
                owners = [n for n in self.placement.owners(key) if n != me]
                futures: list[asyncio.Future[int]] = []
                for node in owners:
                    job = ForwardJob(node, ns, self._call(ns), split_hashes(packed), parent, position,
                                     loop.create_future())
                    self.forwarder.submit(job)
                    assert job.done is not None
                    futures.append(job.done)
                batch.append((unit, futures))
            remaining = deadline - loop.time()
            every = [f for _, fs in batch for f in fs]
            if every and remaining > 0:
                await asyncio.wait(every, timeout=remaining)
            for unit, futures in batch:
                got = [f.result() if f.done() else 0 for f in futures]
                if futures and min(got) > 0:
                    pushed += 1
                    blocks += min(got)
                else:
                    failed += 1
            if loop.time() >= deadline:
                failed += max(0, len(units) - first - DRAIN_BATCH_UNITS)
                break
        await self.leave()
        logger.info("cluster: drained %d units (%d blocks) to their next owners, %d not; left the pool",
                    pushed, blocks, failed)
        return DrainResult(pushed, blocks, failed, True)
