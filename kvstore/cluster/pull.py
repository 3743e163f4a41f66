"""Pulls: copies of blocks another node holds, made into this node's host tier.

A lookup that finds blocks on other nodes answers at once (they are TIER_REMOTE in its
answer) and starts one pull per node that holds them: one `fetch` of the runs it holds,
whose bytes go straight into the PENDING slots of a local put (`_PullSink`). A run of
consecutive blocks is published only once every block of it arrived whole and its
checksum equals the one the holder took when the block was stored: a block that does
not verify never becomes visible. Over gRPC the checksums come first and each run is a
put of its own, hashed here, off the event loop, once it arrived; over the data lane one
put for all the pull's runs is reserved first (`Store.begin_put` with `runs`), every
block lands in its slot directly and is hashed as it lands, against the checksum the
holder sends with it (the one it stored, which the holder's bytes matched before they
left: `kvstore.cluster.data_lane_transport`), and the runs that landed whole are published together. A
run cut short (the holder evicted a block meanwhile, a check failed, the lane broke) is
rolled back, with the runs after it.

While a run is in flight its blocks are `pending`: a fetch (gRPC or shared memory) that
reaches one of them waits for the run (`wait`, bounded by the fetch's deadline) and then
serves whatever landed; a second lookup of the same chain counts them without asking
again. Whatever fails (the node, the deadline, the tenant's quota, room in the host tier)
is a miss for the fetch that waited, never an error.

Blocks of units this node does not own are marked replicas once published
(`Store.mark_replicas`): the first victims when room is needed, so copies never crowd out
what this node owns.

Primitives: `PullRun`, `PullSpec`, `Puller` (`start`, `mark`, `launch`, `wait`,
`has_room`, `pending`, `aclose`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from kvstore.checksum import checksum_batch
from kvstore.cluster.breaker import Attempt, Breakers
from kvstore.cluster.transport import PeerCall, PeerError, PeerTransport
from kvstore.core.put import PutTxn
from kvstore.core.store import Store
from kvstore.errors import KVStoreError
from kvstore.hashing import HASH_BYTES

logger = logging.getLogger(__name__)

# The tier pulled blocks land in: the one the shared-memory plane serves.
PULL_TIER = "host"
# Pulls waiting for a turn, per running one, before lookups stop promising remote blocks.
QUEUED_PER_RUNNING = 4


class PullRun:
    """Consecutive blocks of one chain to copy from one node, published as one put. A
    lookup makes one per run of units it found elsewhere (a plain slotted class: a long
    chain's lookup makes hundreds)."""

    __slots__ = ("namespace_id", "hashes", "parent", "replica", "position", "unit_keys")

    def __init__(self, namespace_id: bytes, hashes: list[bytes], parent: bytes | None, replica: bool,
                 position: int = 0, unit_keys: list[bytes] | None = None) -> None:
        self.namespace_id = namespace_id
        self.hashes = hashes
        self.parent = parent
        self.replica = replica  # a unit this node does not own: marked a replica once published
        self.position = position  # of its first block in the chain
        self.unit_keys = unit_keys if unit_keys is not None else []  # the placement units it covers


@dataclass(frozen=True, slots=True)
class PullSpec:
    """What a lookup hands a pull, without an object per run (it answers first): one
    namespace, its chain packed, and runs of positions [starts[i], stops[i]), each a
    replica or not, with the placement units each covers."""

    namespace_id: bytes
    packed: bytes
    starts: list[int]
    stops: list[int]
    replicas: list[bool]
    unit_keys: list[list[bytes]]
    hashes: list[bytes]  # every block of the runs, in order (what is pending)

    def runs(self) -> list[PullRun]:
        out = []
        offset = 0
        for start, stop, replica, keys in zip(self.starts, self.stops, self.replicas, self.unit_keys):
            n = stop - start
            parent = self.packed[(start - 1) * HASH_BYTES : start * HASH_BYTES] if start else None
            out.append(PullRun(self.namespace_id, self.hashes[offset : offset + n], parent, replica, start, keys))
            offset += n
        return out


class _Pull:
    """One fetch from one node: its runs, and a future settled once it is over."""

    __slots__ = ("runs", "spec", "done", "lease_ids")

    def __init__(self, runs: list[PullRun] | None = None, spec: PullSpec | None = None) -> None:
        self.runs = runs
        self.spec = spec
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # The store leases of the lookups that promised its blocks: what it lands is held
        # under each of them too, until the fetch that follows ends it.
        self.lease_ids: list[str] = []


@dataclass(slots=True)
class PullCounters:
    pulls: int = 0
    pulled_blocks: int = 0
    failures: int = 0
    checksum_failures: int = 0
    rolled_back_blocks: int = 0
    replica_blocks: int = 0  # pulled copies of units owned elsewhere, held as replicas


class _PullSink:
    """Writes one fetch's blocks into the local puts of its runs, in order."""

    def __init__(self, puller: Puller, node: str, runs: Sequence[PullRun], lease_ids: Sequence[str] = ()) -> None:
        self._puller = puller
        self._node = node
        self._runs = list(runs)
        self._lease_ids = lease_ids  # (the pull's own list: a lookup may add to it while it runs)
        self._avail = 0
        self._sums: list[int] = []
        self._run = -1  # the run being received
        self._first = 0  # the global index of its first block
        self._txn: PutTxn | None = None
        self._n = 0  # blocks of the current run the txn carries
        # Over the lane: one put of the first `_lane_runs` runs, reserved up front
        # (`destinations`); None once published or rolled back.
        self._lane_txn: PutTxn | None = None
        self._lane_runs = 0

    def begin(self, num_blocks: int, block_bytes: int, checksums: Sequence[int]) -> None:
        store = self._puller.store
        expected = store.namespace(self._runs[0].namespace_id).layout.bytes_per_block
        if block_bytes != expected and num_blocks:
            raise PeerError(self._node, f"fetch: {block_bytes}-byte blocks where this namespace's are {expected}")
        self._avail = num_blocks
        self._sums = list(checksums)

    async def chunk(self, block: int, data: memoryview) -> None:
        while self._txn is None or block >= self._first + self._n:
            await self._next_run(block)
        assert self._txn is not None
        await self._txn.write(block - self._first, data)

    async def _next_run(self, block: int) -> None:
        if self._txn is not None:
            await self._finish_run()
        self._run += 1
        if self._run >= len(self._runs):
            raise PeerError(self._node, f"fetch: block {block} past the blocks asked for")
        first = sum(len(r.hashes) for r in self._runs[: self._run])
        run = self._runs[self._run]
        self._first = first
        self._n = max(0, min(len(run.hashes), self._avail - first))
        if self._n == 0:
            raise PeerError(self._node, f"fetch: block {block} past the {self._avail} announced")
        self._txn = self._puller.store.begin_put(run.namespace_id, run.hashes[: self._n], run.parent, tier=PULL_TIER)
        await self._txn.reserve()

    async def _finish_run(self) -> None:
        """Verify the current run's bytes against the holder's checksums, then publish."""
        txn, self._txn = self._txn, None
        if txn is None:
            return
        run = self._runs[self._run]
        puller = self._puller
        try:
            slots = txn.slots()
            sums = self._sums[self._first : self._first + self._n]
            tiers = {st.name: st.tier for st in puller.store.tiers}
            new = [(i, s) for i, s in enumerate(slots) if s is not None]
            views = []
            for _, slot in new:
                view = tiers[slot.tier].view(slot, txn.block_bytes)
                if view is None:
                    raise PeerError(self._node, f"pulled blocks landed in tier {slot.tier}, which has no host view")
                views.append(view)
            got = await checksum_batch(views, puller.executor)
            if any(g != sums[i] for (i, _), g in zip(new, got)):
                puller.counters.checksum_failures += 1
                raise PeerError(self._node, "fetch: a block's bytes do not match its checksum")
            result = await txn.commit(sums)
        except BaseException:
            txn.abort()
            puller.counters.rolled_back_blocks += self._n
            self._resolve(run, 0)
            raise
        if run.replica:
            puller.counters.replica_blocks += puller.store.mark_replicas(run.namespace_id, run.hashes[: self._n])
        for lease_id in self._lease_ids:
            puller.store.lease_more(lease_id, txn.stored_rows()[1])
        puller.counters.pulled_blocks += result.stored
        self._resolve(run, self._n)
        if puller.pulled is not None:
            puller.pulled(self._node, [(run, self._n)])

    async def finish(self) -> None:
        """The stream ended: publish the run in progress if it arrived whole."""
        if self._txn is not None:
            await self._finish_run()

    async def destinations(self) -> list[memoryview]:
        """Reserve one put for the runs, in order, as many of them as there is room for
        (the first one must fit, else this raises); a view of each block's PENDING slot.
        A block this node holds already (the put holds it meanwhile) lands in scratch
        memory, dropped. One put for a fetch's runs, not one per run: a 1,000-block chain
        found half elsewhere is about 125 runs, and a put's own steps cost about as much
        as copying a small block."""
        store = self._puller.store
        tiers = {st.name: st.tier for st in store.tiers}
        runs = self._runs
        count = len(runs)
        while True:
            txn = self._begin(runs[:count])
            try:
                await txn.reserve()
                break
            except KVStoreError:
                txn.abort()
                if count == 1:
                    raise
                count = (count + 1) // 2  # fetch the runs that have room
            except BaseException:
                txn.abort()
                raise
        self._lane_txn, self._lane_runs = txn, count
        views: list[memoryview] = []
        for slot in txn.slots():
            if slot is None:
                views.append(memoryview(bytearray(txn.block_bytes)))
                continue
            view = tiers[slot.tier].view(slot, txn.block_bytes)
            if view is None:
                raise PeerError(self._node, f"pulled blocks land in tier {slot.tier}, which has no host view")
            views.append(view)
        return views

    def _begin(self, runs: Sequence[PullRun]) -> PutTxn:
        """One put of `runs` (consecutive runs of one chain), laid end to end."""
        first = runs[0]
        hashes: list[bytes] = []
        starts: list[tuple[int, bytes | None]] = []
        for run in runs:
            if hashes:
                starts.append((len(hashes), run.parent))
            hashes += run.hashes
        return self._puller.store.begin_put(first.namespace_id, hashes, first.parent, tier=PULL_TIER, runs=starts)

    async def landed(self, blocks: int, checksums: Sequence[int], corrupt: bool) -> None:
        """Publish the reserved runs whose blocks all landed verified (`checksums`: the
        holder's, one per block landed), in one step; the others are rolled back."""
        puller = self._puller
        txn = self._lane_txn
        if txn is None:
            return
        done = total = 0
        for run in self._runs[: self._lane_runs]:
            if total + len(run.hashes) > blocks:
                break
            total += len(run.hashes)
            done += 1
        if done:
            if done < self._lane_runs:
                reserved = sum(len(run.hashes) for run in self._runs[: self._lane_runs])
                txn.shorten(total)
                puller.counters.rolled_back_blocks += reserved - total
            txn.mark_written()
            result = await txn.commit(checksums[:total])
            self._lane_txn = None
            published = self._runs[:done]
            positions, rows = txn.stored_rows()
            for lease_id in self._lease_ids:
                # Held for the fetch that follows the lookup (replicas are the first victims
                # of their tier: a small one would otherwise evict them before it reads them).
                puller.store.lease_more(lease_id, rows)
            if any(run.replica for run in published):
                replica = np.repeat([run.replica for run in published], [len(run.hashes) for run in published])
                puller.counters.replica_blocks += puller.store.mark_replica_rows(rows[replica[positions]])
            puller.counters.pulled_blocks += result.stored
            for run in published:
                self._resolve(run, len(run.hashes))
            if puller.pulled is not None:
                puller.pulled(self._node, [(run, len(run.hashes)) for run in published])
        if corrupt:
            puller.counters.checksum_failures += 1
            raise PeerError(self._node, "fetch: a block's bytes do not match its checksum")

    def abort(self) -> None:
        """Roll back what did not complete, and settle every run not settled yet."""
        if self._txn is not None:
            self._txn.abort()
            self._puller.counters.rolled_back_blocks += self._n
            self._txn = None
        if self._lane_txn is not None:
            self._lane_txn.abort()
            self._puller.counters.rolled_back_blocks += sum(len(r.hashes) for r in self._runs[: self._lane_runs])
            self._lane_txn = None
        for run in self._runs:
            self._resolve(run, 0)

    def _resolve(self, run: PullRun, blocks: int) -> None:
        self._puller.settled(run)


class Puller:
    """The pulls of one node: started by lookups, joined by fetches, bounded in number."""

    def __init__(self, store: Store, transport: PeerTransport, breakers: Breakers, *, executor: Executor | None,
                 max_running: int, timeout_s: float) -> None:
        self.store = store
        self.transport = transport
        self.breakers = breakers
        self.executor = executor
        self.timeout_s = timeout_s
        self.counters = PullCounters()
        self.max_running = max_running
        self._running = asyncio.Semaphore(max_running)
        self._tasks: set[asyncio.Task[None]] = set()
        # namespace id -> block hash -> the pull copying it
        self.pending: dict[bytes, dict[bytes, _Pull]] = {}
        self.pending_blocks = 0
        # Told of the runs each put of a pull published: (node, [(run, blocks)]).
        self.pulled: Callable[[str, Sequence[tuple[PullRun, int]]], None] | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def has_room(self) -> bool:
        """Whether a new pull may start (lookups promise remote blocks only then)."""
        return not self._closed and len(self._tasks) < self.max_running * (1 + QUEUED_PER_RUNNING)

    def start(self, node: str, call: PeerCall, runs: list[PullRun]) -> None:
        """Copy `runs` from `node` in the background; their blocks are pending until done."""
        pull = _Pull(runs)
        for run in runs:
            by_hash = self.pending.get(run.namespace_id)
            if by_hash is None:
                by_hash = self.pending[run.namespace_id] = {}
            before = len(by_hash)
            by_hash.update(dict.fromkeys(run.hashes, pull))
            self.pending_blocks += len(by_hash) - before
        self._launch(node, call, pull)

    def mark(self, namespace_id: bytes, hashes: Sequence[bytes], lease_id: str = "") -> _Pull:
        """A pull about to copy `hashes` (of one namespace): they are pending from now,
        until it is `launch`ed and done (a fetch waits for them meanwhile). With `lease_id`
        (the store lease of the lookup that started it) what it lands is held under it."""
        pull = _Pull()
        if lease_id:
            pull.lease_ids.append(lease_id)
        by_hash = self.pending.get(namespace_id)
        if by_hash is None:
            by_hash = self.pending[namespace_id] = {}
        before = len(by_hash)
        by_hash.update(dict.fromkeys(hashes, pull))
        self.pending_blocks += len(by_hash) - before
        return pull

    def launch(self, node: str, call: PeerCall, pull: _Pull, spec: PullSpec) -> None:
        """Start a `mark`ed pull, from a lookup's runs as positions (their objects are
        made in the task). Once closed, its blocks are no longer pending instead."""
        pull.spec = spec
        if self._closed:
            self._drop_marks(spec.namespace_id, spec.hashes, pull)
            return
        self._launch(node, call, pull)

    def _drop_marks(self, namespace_id: bytes, hashes: Sequence[bytes], pull: _Pull) -> None:
        by_hash = self.pending.get(namespace_id)
        if by_hash is not None:
            for h in hashes:
                if by_hash.get(h) is pull:
                    del by_hash[h]
                    self.pending_blocks -= 1
            if not by_hash:
                del self.pending[namespace_id]
        if not pull.done.done():
            pull.done.set_result(None)

    def _launch(self, node: str, call: PeerCall, pull: _Pull) -> None:
        task = asyncio.get_running_loop().create_task(self._pull(node, call, pull), name=f"kvstore-pull-{node}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def settled(self, run: PullRun) -> None:
        """`run` is published or given up: its blocks are no longer pending."""
        by_hash = self.pending.get(run.namespace_id)
        if by_hash is None:
            return
        pop = by_hash.pop
        for h in run.hashes:
            if pop(h, None) is not None:
                self.pending_blocks -= 1
        if not by_hash:
            del self.pending[run.namespace_id]

    async def _pull(self, node: str, call: PeerCall, pull: _Pull) -> None:
        try:
            if pull.runs is None:
                assert pull.spec is not None
                pull.runs = pull.spec.runs()
            await self._run_pull(node, call, pull.runs, pull.lease_ids)
        finally:
            if not pull.done.done():
                pull.done.set_result(None)

    async def _run_pull(self, node: str, call: PeerCall, runs: list[PullRun], lease_ids: Sequence[str] = ()) -> None:
        sink = _PullSink(self, node, runs, lease_ids)
        attempt: Attempt | None = None
        try:
            async with self._running:
                # Claimed once a slot is free, right before the call: a pull queued behind
                # others holds no probe meanwhile.
                attempt = self.breakers.attempt(node)
                if attempt is None:
                    raise PeerError(node, "suspect")
                self.counters.pulls += 1
                hashes = b"".join(h for run in runs for h in run.hashes)
                await self.transport.fetch(node, call, hashes, sink, self.timeout_s)
                await sink.finish()
            attempt.success()
        except PeerError as exc:
            self.counters.failures += 1
            if attempt is None:
                pass
            elif "checksum" in str(exc) or "blocks where" in str(exc):
                # It answered (with blocks this node refused): no verdict on whether it is up.
                logger.warning("pull from %s refused: %s", node, exc)
            else:
                attempt.failure()
                logger.debug("pull from %s failed: %s", node, exc)
        except (KVStoreError, OSError) as exc:  # no room, a quota, a namespace gone: a miss
            self.counters.failures += 1
            logger.debug("pull from %s not kept: %s", node, exc)
        except asyncio.CancelledError:
            raise
        except Exception:  # task boundary: the runs are rolled back, the fetches that wait get a miss
            self.counters.failures += 1
            logger.exception("pull from %s failed", node)
        finally:
            if attempt is not None:
                attempt.release()  # no verdict above (cancelled, refused, a local failure): a probe goes back
            sink.abort()

    def hold_for(self, lease_id: str, namespace_id: bytes, hashes: Sequence[bytes]) -> None:
        """Blocks of another lookup's pulls, promised by this one too: what those pulls
        land is held under `lease_id` as well."""
        by_hash = self.pending.get(namespace_id)
        if not by_hash:
            return
        for pull in {id(p): p for p in (by_hash.get(h) for h in hashes) if p is not None}.values():
            if lease_id not in pull.lease_ids:
                pull.lease_ids.append(lease_id)

    async def wait(self, namespace_id: bytes, block_hash: bytes, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for the run copying a block; whether it was pending
        and settled in time."""
        by_hash = self.pending.get(namespace_id)
        pull = None if by_hash is None else by_hash.get(block_hash)
        if pull is None or timeout_s <= 0:
            return False
        done, _ = await asyncio.wait({pull.done}, timeout=timeout_s)
        return bool(done)

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
