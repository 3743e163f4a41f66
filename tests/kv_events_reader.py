"""A router's end of a KV event stream in vLLM's format, for the tests: a ZMQ SUB socket on
the stream and the replay endpoint beside it.

`StreamReader.sync()` first asks the replay endpoint for what was published before the
subscription took hold (ZMQ's SUB misses what precedes it), then reads the live stream;
a gap in the live sequence is filled from the replay endpoint, as a router does. Every
batch is kept as (sequence, how it arrived, decoded batch), so a test can check that the
sequence is contiguous and which batches came from the replay. `decode` turns a payload
into (ts, events); the main suite decodes with msgpack into dicts, the engine suite with
vLLM's own msgspec classes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

END_SEQ = -1
DEADLINE_S = 30.0


def decode_msgpack(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) in (2, 3), batch
    return batch[0], batch[1]


@dataclass
class Batch:
    seq: int
    via: str  # "live" or "replay"
    ts: float
    events: list[Any]


@dataclass
class StreamReader:
    endpoint: str
    replay_endpoint: str  # "" for a stream read live only
    decode: Callable[[bytes], tuple[float, list[Any]]] = decode_msgpack
    topic: bytes = b""
    batches: list[Batch] = field(default_factory=list)
    gaps_filled: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ctx = zmq.Context()
        self.sub: Any = None
        self.subscribe()

    def subscribe(self) -> None:
        """(Re)open the SUB socket: what is published while it is closed is a gap."""
        if self.sub is not None:
            self.sub.close(linger=0)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)

    def unsubscribe(self) -> None:
        self.sub.close(linger=0)
        self.sub = None

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close(linger=0)
        self.ctx.term()

    @property
    def last(self) -> int | None:
        return self.batches[-1].seq if self.batches else None

    def replay(self, start: int, timeout_s: float = DEADLINE_S) -> list[tuple[int, bytes, bytes]]:
        """(sequence, topic, payload) of every batch the replay endpoint holds from `start`."""
        # A DEALER with an empty delimiter, as a REQ socket sends it; unlike REQ it takes the
        # several answers the ROUTER sends to one request.
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        got = []
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                assert sock.poll(int(timeout_s * 1000)), f"replay endpoint {self.replay_endpoint} did not answer"
                empty, topic, seq, payload = sock.recv_multipart()
                assert empty == b""
                n = int.from_bytes(seq, "big", signed=True)
                if n == END_SEQ:
                    assert topic == b"" and payload == b""
                    return got
                got.append((n, topic, payload))
        finally:
            sock.close(linger=0)

    def _keep(self, seq: int, via: str, payload: bytes) -> None:
        ts, events = self.decode(payload)
        self.batches.append(Batch(seq, via, ts, events))

    def sync(self, timeout_s: float = DEADLINE_S, replay_first: bool = True) -> None:
        """Read what is there now: the replay from after the last batch kept (all of it at
        first; unless not `replay_first`), then the live stream until it is quiet, filling
        gaps from the replay."""
        if self.replay_endpoint and (replay_first or self.last is None):
            start = 0 if self.last is None else self.last + 1
            for seq, _, payload in self.replay(start, timeout_s):
                if self.last is None or seq > self.last:
                    self._keep(seq, "replay", payload)
        while self.sub is not None and self.sub.poll(50):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic.startswith(self.topic) and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if self.last is not None and seq <= self.last:
                continue  # kept already, from the replay
            if self.last is not None and seq > self.last + 1 and self.replay_endpoint:
                first = self.last + 1
                for rseq, _, rpayload in self.replay(first, timeout_s):
                    if rseq < seq and rseq > self.last:
                        self._keep(rseq, "replay", rpayload)
                self.gaps_filled.append((first, seq - 1))
            self._keep(seq, "live", payload)

    def events(self) -> list[Any]:
        return [e for b in self.batches for e in b.events]

    def wait_for(self, check: Callable[[list[Any]], bool], what: str, timeout_s: float = DEADLINE_S) -> list[Any]:
        """Sync until `check(all events so far)` holds; the events."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.sync()
            events = self.events()
            if check(events):
                return events
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout_s:g} s: {what}; events: {events[-10:]}")
            time.sleep(0.02)

    def contiguous(self) -> bool:
        seqs = [b.seq for b in self.batches]
        return seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True
