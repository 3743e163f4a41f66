"""Where a put's blocks go in a pool: pure functions from a put's chain position and the
placement to a `PutPlan`, which `kvstore.cluster.pool.ClusterNode` carries out.

A put's blocks are placed by chain position (a unit's key is the hash of its first
block): the pieces of units this node owns are remembered, those of units owned
elsewhere are held here as replicas and, unless the put came from another node, cut
into forward jobs per owner (at most `FORWARD_JOB_BLOCKS` blocks each; a unit never
splits across jobs).

Two planners give the same plan (tests/cluster/test_put_plan.py): `plan_put_by_piece`,
one unit at a time, for any placement (R > 1, hot units); and `plan_put_arrays` /
`plan_runs_arrays`, whole-array steps with one ranking of every unit's key, which a put
of `PLAN_ARRAYS_FROM_BLOCKS` blocks or more takes where the placement allows (they
answer None where it does not). The planning runs before the engine's commit is
answered, on the event loop, so a long chain is not placed one Python step per unit.

Primitives: `Piece`, `PutPlan`, `put_pieces`, `plan_put_by_piece`, `plan_put_arrays`,
`plan_runs_arrays`, `unit_bounds`, `add_range`, `FORWARD_JOB_BLOCKS`,
`PLAN_ARRAYS_FROM_BLOCKS`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.cluster.placement import Placement, unit_start, unit_stop
from kvstore.hashing import HASH_BYTES

# Most blocks in one forward job (one put on the owner): a put's runs for one owner are
# one job up to this, so a large put still fits the forward queue a part at a time.
FORWARD_JOB_BLOCKS = 1024
# From how many blocks a put is placed in whole-array steps (`ClusterNode.after_put`).
PLAN_ARRAYS_FROM_BLOCKS = 16

_ZERO = np.zeros(1, np.int64)
_HASH_ITEM = np.dtype(f"V{HASH_BYTES}")  # one hash as one array item


@dataclass(slots=True)
class Piece:
    """Blocks of one placement unit within a put."""

    key: bytes
    position: int
    hashes: list[bytes]
    parent: bytes | None


@dataclass(slots=True)
class PutPlan:
    """Where a put's blocks go, as offsets [start, stop) into its hashes."""

    owned: list[tuple[bytes, int, int]]  # pieces of units this node owns: (unit key, start, stop)
    replicas: list[tuple[int, int]]  # runs held here as replicas (units owned elsewhere)
    # Per owner elsewhere, its forward jobs: each a list of runs of consecutive blocks, at
    # most FORWARD_JOB_BLOCKS blocks but for a longer single piece.
    jobs: dict[str, list[list[tuple[int, int]]]]
    forwarded: int  # blocks that go elsewhere
    # Per forwarded part (`ForwardTicket`), (owner, job, offset in the job, blocks) of
    # each of its owners.
    parts: list[tuple[tuple[str, int, int, int], ...]]


def add_range(runs: list[tuple[int, int]], a: int, b: int) -> None:
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


_BOUNDS: OrderedDict[tuple[int, int, bool], np.ndarray[Any, Any]] = OrderedDict()


def unit_bounds(n: int, unit_blocks: int, lead_in: bool) -> np.ndarray[Any, Any]:
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


def put_pieces(placement: Placement, hashes: list[bytes], parent: bytes | None, pos: int, key0: bytes) -> list[Piece]:
    """A put's blocks cut into the units they are in (`key0`: the first one's key)."""
    s, lead_in = placement.unit_blocks, placement.lead_in
    out: list[Piece] = []
    end = pos + len(hashes)
    p = pos
    while p < end:
        start = unit_start(p, s, lead_in)
        stop = min(unit_stop(start, s, lead_in), end)
        key = hashes[start - pos] if start >= pos else key0
        out.append(Piece(key, p, hashes[p - pos : stop - pos], hashes[p - pos - 1] if p > pos else parent))
        p = stop
    return out


def plan_put_by_piece(placement: Placement, me: str, pieces: list[Piece], pos: int, from_peer: bool) -> PutPlan:
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
            add_range(plan.replicas, a, b)
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
            add_range(jobs[-1], a, b)
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
    bounds = unit_bounds(int(ends.max()), placement.unit_blocks, placement.lead_in)
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
            add_range(jobs[-1], a, b)
            blocks += b - a
        plan.parts.append(((node, len(jobs) - 1, 0, blocks),))
        plan.jobs[node] = jobs
    return plan
