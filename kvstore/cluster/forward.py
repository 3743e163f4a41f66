"""Forwards: blocks committed here sent on to the nodes that own their placement units.

A put commits locally first (read-your-writes is a local matter), then its blocks that
belong to units other nodes own are queued here: one job per owner, of one or more runs
of the put's chain (`runs`), sent as one put to an owner whose transport takes several
(`PeerTransport.takes_runs`: a data lane that says so) and as one put per run otherwise.
A few workers take jobs in order: each reads its blocks out of the local store (a
verified fetch, framed by the transport into the messages it sends) and puts them on the
owner. The queue is bounded in blocks: a job that does not fit is dropped and counted,
and so is one for a node that is suspect, since the pool is a cache and the engine must
never wait for it. A suspect owner whose cool-down is over is not skipped: the first
forward to it is its probe (`Breakers.attempt`), so a restarted owner that only ever
receives forwards from this node is trusted again once one of them lands. A job whose
blocks were evicted meanwhile sends what is left of its prefix.

A put that asked to wait for its owners (`PutHeader.wait_for_owners`) holds a future per
job, settled with the blocks the owner committed (0 when dropped or failed).

Primitives: `ForwardJob`, `Forwarder` (`submit`, `start`, `aclose`, `queued_blocks`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.cluster.breaker import Breakers
from kvstore.cluster.transport import PeerCall, PeerError, PeerTransport
from kvstore.core.fetch import FetchStream
from kvstore.core.store import Store
from kvstore.errors import KVStoreError
from kvstore.v1 import kvstore_pb2

logger = logging.getLogger(__name__)

DEFAULT_WORKERS = 4


@dataclass(slots=True)
class ForwardJob:
    node: str
    namespace_id: bytes
    call: PeerCall
    hashes: list[bytes]
    parent: bytes | None
    position: int
    done: asyncio.Future[int] | None = None
    # The runs after the first, when `hashes` are several runs of one chain laid end to
    # end: (where it starts in `hashes`, its parent's hash, its chain position).
    runs: list[tuple[int, bytes | None, int]] = field(default_factory=list)


@dataclass(slots=True)
class NodeForwards:
    jobs: int = 0
    blocks: int = 0  # committed on the node (stored or already there)
    failures: int = 0


@dataclass(slots=True)
class ForwardCounters:
    forwarded_blocks: int = 0
    dropped_blocks: int = 0  # the queue was full, or the owner suspect
    failed_blocks: int = 0  # the owner refused or the call failed
    by_node: dict[str, NodeForwards] = field(default_factory=dict)

    def node(self, node: str) -> NodeForwards:
        c = self.by_node.get(node)
        if c is None:
            c = self.by_node[node] = NodeForwards()
        return c


class Forwarder:
    def __init__(self, store: Store, transport: PeerTransport, breakers: Breakers, *, queue_blocks: int,
                 timeout_s: float, workers: int = DEFAULT_WORKERS) -> None:
        self.store = store
        self.transport = transport
        self.breakers = breakers
        self.queue_blocks = queue_blocks
        self.timeout_s = timeout_s
        self.counters = ForwardCounters()
        # The engine's names of the blocks a forward sends (the daemon's KV events,
        # kvstore.server.kv_events), so the owner publishes them under the same names;
        # None: forwards carry none.
        self.names: Callable[[bytes, Sequence[bytes]], kvstore_pb2.EngineNames | None] | None = None
        self.queued_blocks = 0
        self._queue: deque[ForwardJob] = deque()
        self._wakeup = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._n_workers = workers
        self._closed = False

    def start(self) -> None:
        for i in range(self._n_workers):
            self._workers.append(asyncio.get_running_loop().create_task(self._work(), name=f"kvstore-forward-{i}"))

    def submit(self, job: ForwardJob) -> bool:
        """Queue `job`; False (dropped, counted, its future settled with 0) when the queue
        is full, the owner is suspect (and not due for a probe), or the forwarder is
        closed. Never waits."""
        n = len(job.hashes)
        if self._closed or self.queued_blocks + n > self.queue_blocks or not self.breakers.ready(job.node):
            self.counters.dropped_blocks += n
            _settle(job, 0)
            return False
        self.queued_blocks += n
        self._queue.append(job)
        self._wakeup.set()
        return True

    async def _work(self) -> None:
        # `_closed` as well as the cancellation ends a worker: a cancellation can be lost
        # where a call completes in the same loop turn (asyncio.wait_for on Python 3.11,
        # in a library below), and the worker must not then wait for its next job forever.
        while not self._closed:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            job = self._queue.popleft()
            self.queued_blocks -= len(job.hashes)
            committed = 0
            try:
                committed = await self._send(job)
            except asyncio.CancelledError:
                _settle(job, 0)
                raise
            except Exception:  # task boundary: this job is lost, the worker goes on
                logger.exception("forward to %s failed", job.node)
            _settle(job, committed)

    async def _send(self, job: ForwardJob) -> int:
        if not job.runs or self.transport.takes_runs(job.node):
            return await self._send_one(job)
        # One put per run: the owner's transport cannot take several in one.
        sent = 0
        starts = [0] + [offset for offset, _, _ in job.runs] + [len(job.hashes)]
        heads = [(job.parent, job.position)] + [(parent, position) for _, parent, position in job.runs]
        for k, (parent, position) in enumerate(heads):
            part = ForwardJob(job.node, job.namespace_id, job.call, job.hashes[starts[k] : starts[k + 1]], parent,
                              position)
            got = await self._send_one(part)
            sent += got
            if got < len(part.hashes):
                break  # the rest of the job's prefix is not committed there
        return sent

    async def _send_one(self, job: ForwardJob) -> int:
        c = self.counters.node(job.node)
        attempt = self.breakers.attempt(job.node)
        if attempt is None:  # suspect, or another call is its probe
            self.counters.dropped_blocks += len(job.hashes)
            return 0
        with attempt:  # released (a probe given back) where no call was made or it ended without a verdict
            try:
                async with self.store.open_fetch(job.namespace_id, job.hashes) as stream:
                    k = stream.num_blocks
                    if k == 0:
                        return 0
                    hashes = b"".join(job.hashes[:k])
                    assert isinstance(stream, FetchStream)  # grouped layouts are not forwarded (`ClusterNode.after_put`)
                    names = self.names(job.namespace_id, job.hashes[:k]) if self.names is not None else None
                    stored, existing = await self.transport.put(
                        job.node, job.call, hashes, job.parent or b"", job.position, self.transport.outgoing(stream),
                        self.timeout_s, [run for run in job.runs if run[0] < k], names=names)
            except PeerError as exc:
                attempt.failure()
                c.failures += 1
                self.counters.failed_blocks += len(job.hashes)
                logger.debug("forward of %d blocks to %s failed: %s", len(job.hashes), job.node, exc)
                return 0
            except KVStoreError as exc:  # the namespace went away here: nothing to send
                logger.debug("forward to %s not sent: %s", job.node, exc)
                return 0
            attempt.success()
        c.jobs += 1
        c.blocks += stored + existing
        self.counters.forwarded_blocks += stored + existing
        return stored + existing

    async def aclose(self) -> None:
        self._closed = True
        self._wakeup.set()
        for task in self._workers:
            task.cancel()
        # (gather: a cancellation of this call is this call's, never taken for a worker's)
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers.clear()
        while self._queue:
            _settle(self._queue.popleft(), 0)
        self.queued_blocks = 0


def _settle(job: ForwardJob, blocks: int) -> None:
    if job.done is not None and not job.done.done():
        job.done.set_result(blocks)
