"""`kvstore events --format vllm`: read KV event streams in vLLM's format and print them.

It reads what a router would: each `--endpoint` with a ZMQ SUB socket, each message
`(topic, sequence, payload)` with the payload a msgpack batch `[ts, events, ...]`, and
prints one JSON object a line per event, with the endpoint it came from, the batch's
sequence number and timestamp, and the event's fields (block hashes given as bytes are
printed in hex, integers as they are). Any publisher of vLLM's format can be read, a
vLLM engine as well as a kvstore daemon.

With `--replay` (one per endpoint, in the same order), a gap in an endpoint's sequence is
filled from its replay endpoint before the stream goes on, and `--from-seq N` first asks
for everything buffered from N (0: all of it). A gap that cannot be filled is printed as
`{"gap": [first, last]}`; a sequence that goes back is a publisher that restarted.

Primitives: `cmd_vllm_events`, `decode_batch`, `replay`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvstore.cli.common import EXIT_ERROR, EXIT_OK, EXIT_USAGE

END_SEQ = -1
POLL_MS = 100


@dataclass
class _Source:
    endpoint: str
    replay_endpoint: str
    sub: Any
    last: int | None = None  # the highest sequence printed
    replayed_from: int | None = None  # the first sequence the last replay printed


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """A batch's timestamp and events, each a dict with its `type` first. ValueError when
    the payload is not a batch of vLLM's format."""
    import msgpack

    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a batch: expected the array [ts, events, ...]")
    events = []
    for ev in batch[1]:
        if isinstance(ev, dict) and "type" in ev:
            events.append({"type": ev["type"], **{k: _plain(v) for k, v in ev.items() if k != "type"}})
        elif isinstance(ev, list) and ev and isinstance(ev[0], str):  # vLLM before 0.32: array form
            events.append({"type": ev[0], "fields": _plain(ev[1:])})
        else:
            raise ValueError(f"an event that is neither a tagged map nor a tagged array: {ev!r}")
    ts = batch[0] if isinstance(batch[0], int | float) else 0.0
    return float(ts), events


def replay(ctx: Any, endpoint: str, start: int, timeout_s: float) -> Iterator[tuple[int, bytes]]:
    """Ask `endpoint` (a replay ROUTER) for every batch from `start`: (sequence, payload)
    until its end marker. TimeoutError when it does not answer within `timeout_s`."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"replay endpoint {endpoint} did not answer within {timeout_s:g} s")
            frames = sock.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                raise ValueError(f"replay endpoint {endpoint} sent {len(frames)} frames, not (b'', topic, seq, data)")
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                return
            yield seq, frames[3]
    finally:
        sock.close(linger=0)


def _print(source: _Source, seq: int, payload: bytes, topic: bytes | None) -> int:
    try:
        ts, events = decode_batch(payload)
    except ValueError as exc:
        print(json.dumps({"endpoint": source.endpoint, "seq": seq, "error": str(exc)}), flush=True)
        return 1
    head: dict[str, Any] = {"endpoint": source.endpoint, "seq": seq, "ts": ts}
    if topic:
        head["topic"] = topic.decode("utf-8", "replace")
    for ev in events:
        print(json.dumps({**head, **ev}), flush=True)
    return len(events)


def _fill(ctx: Any, source: _Source, start: int, upto: int | None, timeout_s: float) -> int:
    """Print the batches [start, upto) (all from `start` when upto is None) from the
    replay endpoint; how many events. Missing ones are printed as a gap."""
    printed = 0
    got = start
    source.replayed_from = None
    try:
        for seq, payload in replay(ctx, source.replay_endpoint, start, timeout_s):
            if upto is not None and seq >= upto:
                break
            if seq < got:
                continue
            if seq > got:
                print(json.dumps({"endpoint": source.endpoint, "gap": [got, seq - 1]}), flush=True)
            printed += _print(source, seq, payload, None)
            if source.replayed_from is None or got == start:
                source.replayed_from = seq
            source.last = seq
            got = seq + 1
    except (TimeoutError, ValueError) as exc:
        print(json.dumps({"endpoint": source.endpoint, "error": str(exc)}), flush=True)
    if upto is not None and got < upto:
        print(json.dumps({"endpoint": source.endpoint, "gap": [got, upto - 1]}), flush=True)
    return printed


def cmd_vllm_events(args: argparse.Namespace) -> int:
    """Print the events of every --endpoint as JSON lines until --count, --duration or Ctrl-C."""
    import zmq

    endpoints: list[str] = args.endpoint or []
    replays: list[str] = args.replay or []
    if not endpoints:
        print("kvstore events: --format vllm reads a KV event stream: give --endpoint tcp://HOST:PORT (the "
              "daemon's kv_events_endpoint; `kvstore config get kv_events_endpoint` shows it)")
        return EXIT_USAGE
    if replays and len(replays) != len(endpoints):
        print(f"kvstore events: {len(replays)} --replay for {len(endpoints)} --endpoint; give one per endpoint, "
              "in the same order")
        return EXIT_USAGE
    ctx = zmq.Context()
    sources: list[_Source] = []
    poller = zmq.Poller()
    try:
        for i, endpoint in enumerate(endpoints):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            try:
                sub.connect(endpoint)
            except zmq.ZMQError as exc:
                sub.close(linger=0)  # an open socket would hold ctx.term() below for ever
                print(f"kvstore events: cannot connect to {endpoint}: {exc.strerror}")
                return EXIT_ERROR
            sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
            sources.append(_Source(endpoint, replays[i] if replays else "", sub))
            poller.register(sub, zmq.POLLIN)
        seen = 0
        if args.from_seq is not None:
            for source in sources:
                if source.replay_endpoint:
                    seen += _fill(ctx, source, args.from_seq, None, args.timeout)
        deadline = time.monotonic() + args.duration if args.duration is not None else None
        while not (args.count and seen >= args.count):
            wait = POLL_MS if deadline is None else min(POLL_MS, max(0, int((deadline - time.monotonic()) * 1000)))
            ready = dict(poller.poll(wait))
            for source in sources:
                if source.sub not in ready:
                    continue
                frames = source.sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    print(json.dumps({"endpoint": source.endpoint, "error": f"a message of {len(frames)} frames, "
                                      "not (topic, 8-byte sequence, payload)"}), flush=True)
                    continue
                topic, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                if source.last is not None and seq <= source.last:
                    if source.replayed_from is not None and seq >= source.replayed_from:
                        continue  # printed already, from the replay endpoint
                    # The sequence went back: the publisher started again.
                    print(json.dumps({"endpoint": source.endpoint, "restarted": True, "seq": seq}), flush=True)
                    source.replayed_from = None
                elif source.last is not None and seq > source.last + 1:
                    if source.replay_endpoint:
                        seen += _fill(ctx, source, source.last + 1, seq, args.timeout)
                    else:
                        print(json.dumps({"endpoint": source.endpoint, "gap": [source.last + 1, seq - 1]}),
                              flush=True)
                seen += _print(source, seq, payload, topic)
                source.last = seq
            if deadline is not None and time.monotonic() >= deadline:
                break
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a person stops watching
    finally:
        for source in sources:
            source.sub.close(linger=0)
        ctx.term()
    return EXIT_OK
