"""The pool as one daemon takes part in it: `ClusterNode`, what the daemon's servicers call.

Engines talk only to their local daemon; the daemons of a pool find each other's blocks
(ARCHITECTURE.md section 8, docs/cluster.md). A `ClusterNode` holds the membership, the
placement over its live members, the transport to them, a circuit breaker per peer, and
its parts: the remote lookup round (kvstore.cluster.remote_lookup), pulls (copies of
remote blocks into this node, kvstore.cluster.pull) and forwards (blocks committed here
sent to their owners, kvstore.cluster.forward).

Reads: `extend` answers past a lookup's local prefix through `RemoteLookup`; a fetch
that follows joins the pulls that lookup started (`settle_fetch`, bounded by
`fetch_timeout_s`).

Writes (`after_put`): a put commits locally first, then its blocks are placed by chain
position (kvstore.cluster.put_plan): units owned elsewhere are queued for their owners
(bounded, drops counted) and held here as replicas, the first victims when room is
needed; units owned here are remembered for a drain. A put may wait for its owners'
commits (`ForwardTicket`). Hot units (`HotUnits`, from the units this node had to look
for elsewhere) get extra owners, capped: a pull of one also pushes it to the extra
owners that lack it, and a node that is one of them keeps its copy as its own. A pull
from a previous owner (after a membership change) pushes the copy to the unit's current
owner too, so the traffic rebuilds what moved.

Membership changes (`_on_view`) feed the placement (members with another placement rule,
or draining, are never owners), the transport (addresses) and the breakers (a member that
rejoined, or restarted, starts trusted: `Breakers.forget`). `drain` hands off before a planned removal, `leave` leaves.

Primitives: `ClusterSettings`, `placement_rule`, `PackedChain`, `ForwardTicket`,
`UnitPlace`, `MemberState`, `ClusterStatus`, `DrainResult`, `ClusterNode`.
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
from typing import overload

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
)
from kvstore.cluster.pull import Puller, PullRun
from kvstore.cluster.put_plan import (
    PLAN_ARRAYS_FROM_BLOCKS,
    Piece,
    PutPlan,
    plan_put_arrays,
    plan_put_by_piece,
    plan_runs_arrays,
    put_pieces,
)
from kvstore.cluster.remote_lookup import Extension, PeerStats, RemoteLookup
from kvstore.cluster.transport import PeerCall, PeerTransport
from kvstore.convert import layout_to_proto
from kvstore.core.store import Store
from kvstore.errors import FailedPrecondition, KVStoreError
from kvstore.hashing import HASH_BYTES, split_hashes

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
    units_failed: int  # not handed off: their blocks stay here, out of the pool's placement
    left: bool
    units_gone: int = 0  # no longer held here when the drain came to them: nothing to hand off


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
        self.counters = ClusterCounters()
        self.remote_lookup = RemoteLookup(store, self.node_id, self.placement, self.breakers, self.puller, transport,
                                          self.counters, self._call, timeout_s=settings.lookup_timeout_s)
        self.draining = False
        self.left = False
        self._calls: dict[bytes, PeerCall] = {}
        self._owned: OrderedDict[bytes, _OwnedUnit] = OrderedDict()
        self._pushed: OrderedDict[tuple[bytes, str], None] = OrderedDict()
        self._positions: OrderedDict[bytes, int] = OrderedDict()  # ns id + hash -> chain position
        self._started: dict[str, float] = {}  # node id -> started_at of the record last seen
        self._present: set[str] = set()  # the members of the last view
        self._unplaced_rules: set[str] = set()
        # Whether a member may own units here: with a token file, only a node this
        # daemon holds a credential entry for (a revoked node is placed nowhere, even
        # while it keeps its record in etcd). Set by the daemon; `refresh` after a change.
        self.admits: Callable[[str], bool] = lambda node: True
        self._unadmitted: set[str] = set()
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

    @property
    def lookup_timeout_s(self) -> float:
        """The lookup round's deadline; may change while the daemon runs (SetConfig, SIGHUP)."""
        return self.remote_lookup.timeout_s

    @lookup_timeout_s.setter
    def lookup_timeout_s(self, value: float) -> None:
        self.remote_lookup.timeout_s = value

    @property
    def peers(self) -> dict[str, PeerStats]:
        """What this node's lookup rounds got from each other node."""
        return self.remote_lookup.peers

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

    def refresh(self) -> None:
        """Place again after `admits` changed (a reload of the token file)."""
        self._unadmitted.clear()
        self._on_view(self.membership.view)

    def _on_view(self, view: View) -> None:
        placed: set[str] = set()
        for node, member in view.members.items():
            if member.draining or (node == self.node_id and self.draining):
                continue
            if node != self.node_id and not self.admits(node):
                if node not in self._unadmitted:
                    self._unadmitted.add(node)
                    logger.error("cluster: member %s has no credential in this daemon's token file: it owns no units "
                                 "here, and nothing is forwarded to it or asked of it", node)
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
            self.remote_lookup.placement = self.placement  # one placement for reads and writes
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

    async def extend(self, namespace_id: bytes, chain: bytes | Sequence[bytes], held: int,
                     lease_id: str = "") -> Extension | None:
        """The rest of a lookup's answer past its local prefix of `held` blocks, from the
        other nodes (`RemoteLookup.extend`); None when nothing past it is found. The blocks
        its pulls land are held under `lease_id` (the lookup's store lease), if any."""
        if self.left or self.store.namespace(namespace_id).groups:
            return None  # a grouped layout's parts stay on the node that computed them
        return await self.remote_lookup.extend(namespace_id, chain, held, lease_id)

    def _call(self, namespace_id: bytes) -> PeerCall:
        call = self._calls.get(namespace_id)
        if call is None:
            info = self.store.namespace(namespace_id)
            if len(self._calls) >= LAYOUTS_KEPT:
                self._calls.clear()
            call = self._calls[namespace_id] = PeerCall.of(info.tenant, layout_to_proto(info.layout))
        return call

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
            self._remember_owned(namespace_id, Piece(key, pos + a - o, hashes[a:b], hashes[a - 1] if a > o else parent))
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
            self._remember_owned(namespace_id, Piece(key, pos + a, hashes[a:b], hashes[a - 1] if a else parent))
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

    def _remember_owned(self, namespace_id: bytes, piece: Piece) -> None:
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
                    self._remember_owned(run.namespace_id, Piece(key, run.position, run.hashes[:blocks], run.parent))
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
        pushed = failed = blocks = gone = 0
        me = self.node_id
        for first in range(0, len(units), DRAIN_BATCH_UNITS):
            batch: list[tuple[_OwnedUnit, list[asyncio.Future[int]]]] = []
            for unit in units[first : first + DRAIN_BATCH_UNITS]:
                ns, key, position, packed, parent = unit
                if not self._holds_start(ns, packed):
                    gone += 1  # evicted or deleted since it was put: nothing is lost by not sending it
                    continue
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
            for _unit, futures in batch:
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
        log = logger.warning if failed else logger.info
        log("cluster: drained %d units (%d blocks) to their next owners, %d not (their blocks stay on this node, "
            "out of the pool's placement), %d no longer held; left the pool", pushed, blocks, failed, gone)
        return DrainResult(pushed, blocks, failed, True, gone)

    def _holds_start(self, namespace_id: bytes, packed: bytes) -> bool:
        """Whether the first block of a remembered unit is still held here."""
        try:
            return self.store.present(namespace_id, packed[:HASH_BYTES]) != _ABSENT
        except KVStoreError:  # its namespace is gone
            return False
