"""The transport of the KV event streams in vLLM's format: ZMQ PUB sockets with a replay
ROUTER each, fed from the event loop through one bounded queue and served by one thread.

The wire is vLLM 0.32's (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`), so its
subscribers (llm-d's KV indexer, Dynamo's router, vLLM's own examples) read it unchanged:

- PUB: each batch is a three-part message `(topic, sequence, payload)`; the sequence is
  8 bytes big-endian, from 0 and increasing by one per batch of that stream; the payload
  is the msgpack batch (`kvstore.server.kv_events` builds the events).
- ROUTER (the replay endpoint): a subscriber that saw a gap sends the first sequence it
  missed (8 bytes big-endian; from a REQ socket, or a DEALER with an empty delimiter
  frame); it gets `(topic, sequence, payload)` for every buffered batch from there on,
  then the end marker `(b"", -1 as 8 signed bytes, b"")`, each behind its identity and an
  empty frame. The last `buffer_steps` batches are kept, and a requester's pipe holds a
  whole answer (vLLM's ROUTER keeps its default of 1,000 messages and cuts longer ones).

Never slowing the daemon: `submit` runs on the event loop and only appends to a bounded
queue (`max_queue_size` batches); a full queue refuses the batch, which is counted, and
the caller decides what the stream says about the loss (kv_events resyncs). The thread
packs the batches (msgpack) and sends them; a PUB socket never blocks on a subscriber:
one whose pipe holds `hwm` messages misses what follows (ZMQ drops them for it alone),
sees a gap in the sequence, and asks the replay endpoint.

Endpoints bind (`tcp://HOST:PORT`, port 0 for one of the system's choosing, or
`ipc://PATH`, made 0600), or the PUB socket connects to a collector that binds
(`connect`: llm-d's indexer in its centralized mode); the replay endpoint always binds.

Primitives: `StreamEndpoints`, `ZmqPublisher` (`start`, `submit`, `close`, `bound`,
`counters`), `PublisherCounters`, `END_SEQ`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# How long the thread waits for a batch before it looks at the replay sockets again: the
# most a replay request waits while no event is published.
IDLE_POLL_S = 0.02
CLOSE_TIMEOUT_S = 2.0
# While a Unix socket file is made: no access for group or others.
IPC_UMASK = 0o077


@dataclass(frozen=True, slots=True)
class StreamEndpoints:
    """Where one stream is published: its PUB endpoint, whether the PUB socket connects
    instead of binding, and its replay endpoint (empty: none)."""

    endpoint: str
    replay_endpoint: str = ""
    connect: bool = False


@dataclass(slots=True)
class PublisherCounters:
    """One stream's figures (read on the loop; written by the thread and `submit`)."""

    batches: int = 0  # sent on the PUB socket
    events: int = 0
    dropped_batches: int = 0  # refused by a full queue
    dropped_events: int = 0
    replays: int = 0  # replay requests answered
    bad_replays: int = 0  # replay requests that were not one


@dataclass(slots=True)
class _Stream:
    pub: Any  # zmq.Socket
    replay: Any | None
    bound: str
    bound_replay: str
    buffer: deque[tuple[int, bytes]]
    counters: PublisherCounters = field(default_factory=PublisherCounters)
    seq: int = 0


def _ipc_path(endpoint: str) -> str:
    return endpoint[len("ipc://"):]


class ZmqPublisher:
    """The PUB (and replay ROUTER) sockets of every stream and the thread that sends on them.

    `submit(i, ts, events)` queues a batch for stream `i` (loop side, never blocks);
    `encode(events)` turns the queued events into the batch's event maps on the thread.
    """

    def __init__(self, streams: Sequence[StreamEndpoints], topic: str, *, buffer_steps: int, hwm: int,
                 max_queue_size: int, encode: Callable[[Any], list[Any]]) -> None:
        self._specs = list(streams)
        self._topic = topic.encode("utf-8")
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self.encode = encode  # public: a seam tests hold the thread with
        self._queue: queue.Queue[tuple[int, float, Any] | None] = queue.Queue(maxsize=max_queue_size)
        self._ctx: Any = None
        self._streams: list[_Stream] = []
        self._ipc_paths: list[str] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        self.failures = 0  # batches the thread could not pack or send (logged)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Bind (or connect) every socket, then start the thread; a socket that cannot be
        bound stops the daemon with the endpoint named."""
        self._ctx = zmq.Context()
        made: list[Any] = []  # closed if anything fails (a context with open sockets never terminates)
        try:
            for spec in self._specs:
                pub = self._ctx.socket(zmq.PUB)
                made.append(pub)
                pub.setsockopt(zmq.SNDHWM, self._hwm)
                pub.setsockopt(zmq.LINGER, 0)
                if spec.connect:
                    self._connect(pub, spec.endpoint)
                    bound = spec.endpoint
                else:
                    bound = self._bind(pub, spec.endpoint, "kv_events_endpoint")
                replay = None
                bound_replay = ""
                if spec.replay_endpoint:
                    replay = self._ctx.socket(zmq.ROUTER)
                    made.append(replay)
                    replay.setsockopt(zmq.LINGER, 0)
                    # A ROUTER drops what passes its high-water mark: room for a whole
                    # buffer and the end marker, so an answer is never cut short.
                    replay.setsockopt(zmq.SNDHWM, self._buffer_steps + 2)
                    bound_replay = self._bind(replay, spec.replay_endpoint, "kv_events_replay_endpoint")
                self._streams.append(_Stream(pub, replay, bound, bound_replay, deque(maxlen=self._buffer_steps)))
        except BaseException:
            for sock in made:
                sock.close(linger=0)
            self._streams.clear()
            self._close_sockets()
            raise
        # The sockets pass to the thread here; Thread.start is the memory barrier ZMQ asks
        # for when a socket changes threads, and no other thread touches them after.
        self._thread = threading.Thread(target=self._run, name="kvstore-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, sock: Any, endpoint: str, key: str) -> str:
        ipc = endpoint.startswith("ipc://")
        old_umask = os.umask(IPC_UMASK) if ipc else None
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot bind {key} {endpoint}: {exc.strerror}; choose another address") from None
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        if ipc:
            os.chmod(_ipc_path(endpoint), 0o600)
            self._ipc_paths.append(_ipc_path(endpoint))
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else str(last)

    @staticmethod
    def _connect(sock: Any, endpoint: str) -> None:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot connect kv_events_endpoint {endpoint}: {exc.strerror}") from None

    def close(self) -> None:
        """Send what is queued (for up to a couple of seconds), stop the thread, close."""
        if self._closing:
            return
        self._closing = True
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
            except queue.Full:
                pass
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("the KV event thread did not stop within %.0f s", CLOSE_TIMEOUT_S)
                return  # its sockets stay open: closing them under it would crash it
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in self._streams:
            s.pub.close(linger=0)
            if s.replay is not None:
                s.replay.close(linger=0)
        self._streams.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for path in self._ipc_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._ipc_paths.clear()

    # ---------------------------------------------------------------- loop side

    @property
    def bound(self) -> list[tuple[str, str]]:
        """Each stream's endpoint and replay endpoint as bound (port 0 resolved)."""
        return [(s.bound, s.bound_replay) for s in self._streams]

    def counters(self, stream: int) -> PublisherCounters:
        return self._streams[stream].counters

    def queued(self) -> int:
        return self._queue.qsize()

    def room(self) -> int:
        """Batches the queue takes now (only the loop puts, so this holds until it does)."""
        return self._queue.maxsize - self._queue.qsize()

    def submit(self, stream: int, events: Any, count: int) -> bool:
        """Queue one batch of `count` events for `stream`; False (counted) when the queue
        is full. Never blocks."""
        try:
            self._queue.put_nowait((stream, time.time(), events))
        except queue.Full:
            c = self._streams[stream].counters
            c.dropped_batches += 1
            c.dropped_events += count
            return False
        return True

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        packer = msgpack.Packer(use_bin_type=True)
        replays = [(s, s.replay) for s in self._streams if s.replay is not None]
        while True:
            for s, sock in replays:
                while sock.poll(0):
                    self._serve_replay(s)
            try:
                item = self._queue.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            index, ts, events = item
            s = self._streams[index]
            try:
                maps = self.encode(events)
                # [ts, events, data_parallel_rank]: vLLM's publisher fills in its rank (0
                # without data parallelism), and some readers expect the third element.
                payload = packer.pack([ts, maps, 0])
                seq = s.seq.to_bytes(8, "big")
                s.pub.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                # A PUB socket drops rather than block; a connected one with no peer yet may
                # say so. The batch still takes its sequence and stays replayable.
                pass
            except Exception:  # task boundary: this batch is lost, the stream goes on
                self.failures += 1
                logger.exception("a KV event batch could not be published")
                continue
            s.buffer.append((s.seq, payload))
            s.seq += 1
            s.counters.batches += 1
            s.counters.events += len(maps)

    def _serve_replay(self, s: _Stream) -> None:
        assert s.replay is not None
        frames = s.replay.recv_multipart()
        # REQ: (identity, b"", start); a DEALER may leave the delimiter out.
        if len(frames) == 3 and frames[1] == b"":
            ident, start = frames[0], frames[2]
        elif len(frames) == 2:
            ident, start = frames
        else:
            s.counters.bad_replays += 1
            logger.debug("replay request of %d frames ignored", len(frames))
            return
        if len(start) != 8:
            s.counters.bad_replays += 1
            s.replay.send_multipart((ident, b"", b"", END_SEQ, b""))
            return
        first = int.from_bytes(start, "big")
        s.counters.replays += 1
        try:
            for seq, payload in list(s.buffer):
                if seq >= first:
                    # copy=False: the frames point at the buffered payload, not a copy of it.
                    s.replay.send_multipart((ident, b"", self._topic, seq.to_bytes(8, "big"), payload),
                                            flags=zmq.NOBLOCK, copy=False)
            s.replay.send_multipart((ident, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a requester that reads nothing loses its answer, not the stream
