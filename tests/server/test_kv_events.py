"""KV events in vLLM's format from a real daemon (kvstore.server.kv_events), read as a router
reads them: a ZMQ SUB socket and the replay endpoint, every batch decoded (msgpack here;
tests/engines/test_vllm_kv_events.py decodes with vLLM's own classes).

What they say (names, tokens, parents, media, moves, removals, flushes, a restart), that
sequences are contiguous and a gap is filled from the replay endpoint, that neither a
subscriber that never reads nor a publisher thread that stalls slows puts (drops counted,
the stream resyncs to the exact state), that tenants never see each other's blocks, the
exposure rules, the check of a put's engine names, and `kvstore events --format vllm`.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import zmq
from conftest import daemon_in_thread, make_config

from kvstore.cli.main import main
from kvstore.client import Client, EngineNames, GroupKind, KVGroup, KVLayout
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.groups import needed
from kvstore.hashing import block_hashes as chain_hashes
from kvstore.server.auth import new_token
from kvstore.server.config import Config, load_config
from kvstore.server.daemon import Daemon
from kvstore.server.kv_events import parse_streams
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.kv_events_reader import StreamReader
from tests.polling import wait_until

BS = 4
LAYOUT = KVLayout(model="test/events", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
                  block_size_tokens=BS)  # 1 KiB blocks


def kv_config(tmp_path: Path, **overrides: Any) -> Config:
    return make_config(tmp_path, kv_events_endpoint=("tcp://127.0.0.1:0",),
                       kv_events_replay_endpoint=("tcp://127.0.0.1:0",), **overrides)


def reader_for(running: Any, tenant: str = "default", **kw: Any) -> StreamReader:
    endpoint, replay = running.daemon.kv_events.bound[tenant]
    return StreamReader(endpoint, replay, **kw)


@pytest.fixture
def readers() -> Iterator[list[StreamReader]]:
    made: list[StreamReader] = []
    yield made
    for r in made:
        r.close()


def blocks(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([seed % 256, i % 256]) * (LAYOUT.bytes_per_block // 2) for i in range(n)]


def tokens(n_blocks: int, seed: int) -> list[int]:
    return [seed * 10_000 + i for i in range(n_blocks * BS)]


def hashes_of(toks: list[int]) -> list[bytes]:
    return chain_hashes(LAYOUT.namespace_id, toks, BS)


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def router_view(events: list[dict[str, Any]]) -> set[tuple[Any, str]]:
    """What a router holds after applying the events: (block name, medium)."""
    view: set[tuple[Any, str]] = set()
    for e in events:
        if e["type"] == "AllBlocksCleared":
            view.clear()
        elif e["type"] == "BlockStored":
            view |= {(h, e["medium"]) for h in e["block_hashes"]}
        elif e["type"] == "BlockRemoved":
            view -= {(h, e["medium"]) for h in e["block_hashes"]}
    return view


def stored_names(events: list[dict[str, Any]]) -> list[Any]:
    return [h for e in of_type(events, "BlockStored") for h in e["block_hashes"]]


# ------------------------------------------------------------------ what the events say


def test_puts_moves_removals_flush_and_restart(tmp_path, readers):
    cfg = kv_config(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_capacity=8 << 20, ssd_region_size=1 << 20,
                    node_id="node-a")
    t1, t2, t3 = tokens(6, 1), tokens(3, 2), tokens(2, 3)
    with daemon_in_thread(cfg) as d, Client(d.unix_target) as kv:
        r = reader_for(d)
        readers.append(r)
        first = r.wait_for(lambda ev: len(ev) >= 1, "the stream's first batch")
        assert first[0] == {"type": "AllBlocksCleared"}  # a start: forget what this node said before

        # A put by tokens with vLLM's names, then its continuation, then a put by hashes alone.
        kv.put(LAYOUT, t1[: 4 * BS], blocks(4, 1), engine_names=EngineNames([101, 102, 103, 104], lora_name="ad"))
        kv.put(LAYOUT, t1, blocks(2, 11), first_block=4, engine_names=EngineNames([105, 106], lora_name="ad"))
        kv_hashes = hashes_of(t2)
        kv.put(LAYOUT, None, blocks(3, 2), block_hashes=kv_hashes)
        ev = r.wait_for(lambda ev: len(of_type(ev, "BlockStored")) >= 3, "three BlockStored")
        s1, s2, s3 = of_type(ev, "BlockStored")
        assert s1["block_hashes"] == [101, 102, 103, 104] and s1["parent_block_hash"] is None
        assert s1["token_ids"] == t1[: 4 * BS] and s1["block_size"] == BS and s1["lora_name"] == "ad"
        assert (s1["medium"], s1["locality"], s1["ownership"], s1["group_idx"]) == ("CPU", "LOCAL", "node-a", 0)
        assert s2["block_hashes"] == [105, 106] and s2["parent_block_hash"] == 104  # the daemon knew 104's name
        assert s2["token_ids"] == t1[4 * BS:]
        assert s3["block_hashes"] == kv_hashes and s3["token_ids"] == []  # named by kvstore's hashes

        # Every block to SSD: a move is a removal from CPU and a store in STORAGE, same names.
        assert main(["evict", "--tier", "host", "--bytes", "64MiB", "--target", d.unix_target]) == 0
        ev = r.wait_for(lambda ev: {(h, "STORAGE") for h in (101, 106, *kv_hashes)} <= router_view(ev),
                        "the blocks reported in STORAGE")
        moved = [e for e in of_type(ev, "BlockStored") if e["medium"] == "STORAGE"]
        again = {h: e for e in moved for h in e["block_hashes"]}
        assert again[101]["token_ids"][:BS] == t1[:BS] and again[105]["parent_block_hash"] in (104, None)
        assert router_view(ev) == {(h, "STORAGE") for h in [101, 102, 103, 104, 105, 106, *kv_hashes]}

        # A delete and a flush are removals of the names the blocks were stored under.
        kv.delete(LAYOUT, None, block_hashes=kv_hashes)
        ev = r.wait_for(lambda ev: not any(h in kv_hashes for h, _ in router_view(ev)), "the deleted blocks gone")
        assert main(["flush", "--yes", "--target", d.unix_target]) == 0
        ev = r.wait_for(lambda ev: router_view(ev) == set(), "every block gone after the flush")
        assert set(h for e in of_type(ev, "BlockRemoved") for h in e["block_hashes"]) >= {101, 106, *kv_hashes}

        kv.put(LAYOUT, t3, blocks(2, 3))
        r.wait_for(lambda ev: len(router_view(ev)) == 2, "the last put")
        assert r.contiguous() and r.batches[0].seq == 0
        wait_until(lambda: d.store.pending_ssd_writes == 0, "the last put on SSD")

    # A restart: a new stream from sequence 0, AllBlocksCleared, then what recovery found.
    with daemon_in_thread(cfg) as d:
        r2 = reader_for(d)
        readers.append(r2)
        ev = r2.wait_for(lambda ev: len(ev) >= 2, "the restart's announcement")
        assert ev[0] == {"type": "AllBlocksCleared"}
        assert router_view(ev) == {(h, "STORAGE") for h in hashes_of(t3)}
        assert r2.batches[0].seq == 0 and r2.contiguous()


def test_a_gap_is_filled_from_the_replay_endpoint(tmp_path, readers):
    with daemon_in_thread(kv_config(tmp_path)) as d, Client(d.unix_target) as kv:
        r = reader_for(d)
        readers.append(r)
        r.wait_for(lambda ev: len(ev) >= 1, "the first batch")
        r.unsubscribe()  # a router that lost its connection for a while
        sent = d.daemon.kv_events.stats()[0].counters.batches
        for i in range(3):
            kv.put(LAYOUT, tokens(1, 10 + i), blocks(1, i), engine_names=EngineNames([1000 + i]))
        wait_until(lambda: d.daemon.kv_events.stats()[0].counters.batches > sent, "the puts' batch sent")
        r.subscribe()
        # The new subscription takes hold at some point; puts until one arrives live.
        kept = len(r.batches)
        i = 3
        while not any(b.via == "live" for b in r.batches[kept:]):
            kv.put(LAYOUT, tokens(1, 10 + i), blocks(1, i), engine_names=EngineNames([1000 + i]))
            i += 1
            r.sync(replay_first=False)
        assert r.gaps_filled and r.gaps_filled[0][0] == 1  # the batches missed were asked for again
        assert r.contiguous()
        assert stored_names(r.events()) == [1000 + k for k in range(i)]


def test_a_grouped_layout_publishes_each_groups_parts(tmp_path, readers):
    """Full attention, a sliding window and a state: each group's parts are events of
    their own (its index, kind and window), under the names the put gave the blocks."""
    hybrid = KVLayout(model="test/events-hybrid", dtype="bfloat16", num_layers=3, num_kv_heads=1, head_dim=8,
                      block_size_tokens=BS, groups=(
                          KVGroup("full", GroupKind.FULL, "bfloat16", (2, 1, BS, 1, 8)),
                          KVGroup("swa", GroupKind.SLIDING_WINDOW, "bfloat16", (2, 1, BS, 1, 8), window_tokens=9),
                          KVGroup("ssm", GroupKind.STATE, "float32", (32,))))
    n = 6
    parts = [{g.name: os.urandom(g.bytes_per_block) for g in hybrid.groups} for _ in range(n)]
    with daemon_in_thread(kv_config(tmp_path)) as d, Client(d.unix_target) as kv:
        r = reader_for(d)
        readers.append(r)
        kv.put(hybrid, tokens(n, 9), parts, engine_names=EngineNames([900 + i for i in range(n)]))
        stored = {}
        for need in needed(hybrid, n):  # the parts the put keeps, per group
            stored[need.group] = [900 + j for j in range(need.start, need.stop)]
        ev = r.wait_for(lambda ev: sum(len(e["block_hashes"]) for e in of_type(ev, "BlockStored")) ==
                        sum(map(len, stored.values())), "every part's event")
        got: dict[int, list[int]] = {}
        for e in of_type(ev, "BlockStored"):
            got.setdefault(e["group_idx"], []).extend(e["block_hashes"])
            assert e["kv_cache_spec_kind"] == ("full_attention", "sliding_window", "mamba")[e["group_idx"]]
            assert e.get("kv_cache_spec_sliding_window") == (9 if e["group_idx"] == 1 else None)
        assert got == {g: names for g, names in stored.items() if names}


# ------------------------------------------------------------------ slow consumers


def test_a_subscriber_that_never_reads_does_not_slow_puts(tmp_path, readers):
    n = 400
    with daemon_in_thread(kv_config(tmp_path, kv_events_hwm=4)) as d, Client(d.unix_target) as kv:
        endpoint, _ = d.daemon.kv_events.bound["default"]
        ctx = zmq.Context()
        stuck = ctx.socket(zmq.SUB)  # subscribed, never read
        stuck.setsockopt(zmq.RCVHWM, 4)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(endpoint)
        r = reader_for(d)
        readers.append(r)
        r.wait_for(lambda ev: len(ev) >= 1, "the first batch")
        try:
            for i in range(n):
                kv.put(LAYOUT, tokens(4, 100 + i), blocks(4, i % 250), engine_names=EngineNames(
                    [4 * i + k for k in range(4)]))
            assert kv.lookup(LAYOUT, tokens(4, 100 + n - 1)).num_blocks == 4
            # The reader that keeps up (and asks the replay endpoint for what ZMQ dropped
            # for it) sees every block.
            r.wait_for(lambda ev: len(stored_names(ev)) == 4 * n, "every block reported")
            assert stored_names(r.events()) == list(range(4 * n)) and r.contiguous()
            stats = d.daemon.kv_events.stats()[0]
            assert stats.counters.dropped_events == 0 and stats.counters.events >= n
        finally:
            stuck.close(linger=0)
            ctx.term()


def test_a_stalled_publisher_drops_counts_and_resyncs(tmp_path, readers):
    """The publisher thread held (a stand-in for a machine too busy to send): puts still
    complete, the batches the full queue refuses are counted, and once the thread runs
    again the stream says AllBlocksCleared and every block held, so a router's view is
    exact again."""
    with daemon_in_thread(kv_config(tmp_path, kv_events_max_queue_size=4)) as d, Client(d.unix_target) as kv:
        streams = d.daemon.kv_events
        r = reader_for(d)
        readers.append(r)
        r.wait_for(lambda ev: len(ev) >= 1, "the first batch")
        held = threading.Event()
        release = threading.Event()
        encode = streams.publisher.encode

        def stalled(events: Any) -> list[Any]:
            held.set()
            release.wait(60)
            return encode(events)

        streams.publisher.encode = stalled
        kv.put(LAYOUT, tokens(1, 1), blocks(1, 1), engine_names=EngineNames([1]))
        wait_until(held.is_set, "the publisher thread holding a batch")
        # Puts go on at full speed while the queue fills (a batch every few milliseconds)
        # and overflows.
        i = 2
        while streams.stats()[0].counters.dropped_events == 0:
            assert i < 100_000, "the publisher's queue never filled"
            kv.put(LAYOUT, tokens(1, i), blocks(1, i), engine_names=EngineNames([i]))
            i += 1
        for j in range(i, i + 5):  # and on, after the drops
            kv.put(LAYOUT, tokens(1, j), blocks(1, j), engine_names=EngineNames([j]))
        kv.delete(LAYOUT, tokens(1, 1))
        streams.publisher.encode = encode
        release.set()
        expected = {(k, "CPU") for k in range(2, i + 5)}
        ev = r.wait_for(lambda ev: router_view(ev) == expected, "the resynced view")
        assert streams.resyncs == 1
        assert ev.count({"type": "AllBlocksCleared"}) == 2  # the start's, and the resync's
        assert r.contiguous()
        metrics = scrape(d)
        assert 'kvstore_kv_events_dropped_total{tenant="default"}' in metrics
        assert "kvstore_kv_events_resyncs_total 1.0" in metrics


def scrape(d: Any) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://{d.daemon.metrics_address}/metrics", timeout=10) as resp:
        return resp.read().decode()


# ------------------------------------------------------------------ tenants


class Tokens:
    def __init__(self, path: Path, names: tuple[str, ...]) -> None:
        self.path = path
        self.tokens: dict[str, str] = {}
        entries = []
        for name in names:
            token, digest = new_token()
            self.tokens[name] = token
            role = "admin" if name == "ops" else "client"
            entries.append(f'[[tenant]]\nname = "{name}"\nrole = "{role}"\ntokens = ["{digest}"]\n')
        path.write_text("\n".join(entries))
        os.chmod(path, 0o600)


def test_each_tenant_sees_only_its_own_blocks(tmp_path, readers):
    toks = Tokens(tmp_path / "tokens.toml", ("ops", "alpha", "gamma"))
    cfg = make_config(tmp_path, auth_token_file=str(toks.path),
                      kv_events_endpoint=("alpha=tcp://127.0.0.1:0", "gamma=tcp://127.0.0.1:0"),
                      kv_events_replay_endpoint=("alpha=tcp://127.0.0.1:0", "gamma=tcp://127.0.0.1:0"))
    same = tokens(2, 7)
    with daemon_in_thread(cfg) as d:
        ra, rg = reader_for(d, "alpha"), reader_for(d, "gamma")
        readers += [ra, rg]
        with Client(d.unix_target, token=toks.tokens["alpha"]) as a, \
                Client(d.unix_target, token=toks.tokens["gamma"]) as g, \
                Client(d.unix_target, token=toks.tokens["ops"]) as ops:
            a.put(LAYOUT, same, blocks(2, 1), engine_names=EngineNames([11, 12]))
            g.put(LAYOUT, same, blocks(2, 2), engine_names=EngineNames([21, 22]))
            ops.put(LAYOUT, tokens(1, 8), blocks(1, 3), engine_names=EngineNames([31]))  # no stream of its own
            a.put(LAYOUT, tokens(1, 9), blocks(1, 4), engine_names=EngineNames([13]))
            a.delete(LAYOUT, same)
            ev_a = ra.wait_for(lambda ev: 13 in stored_names(ev) and of_type(ev, "BlockRemoved"), "alpha's events")
            ev_g = rg.wait_for(lambda ev: stored_names(ev) == [21, 22], "gamma's events")
            # gamma's last batch is behind alpha's removal: had it been published there, it would be there.
            assert router_view(ev_a) == {(13, "CPU")}
            assert router_view(ev_g) == {(21, "CPU"), (22, "CPU")}
            everything = json.dumps([ev_a, ev_g])
            assert "31" not in everything.replace("131", "")
            assert set(stored_names(ev_a)) == {11, 12, 13}


def test_after_a_restart_a_tenants_recovered_blocks_wait_for_its_requests(tmp_path, readers):
    """With a token file, blocks recovered from SSD have no known tenant until a request of
    their tenant names their layout: then they are published on that tenant's stream, and
    on no other."""
    toks = Tokens(tmp_path / "tokens.toml", ("alpha", "gamma"))
    cfg = make_config(tmp_path, auth_token_file=str(toks.path), ssd_path=str(tmp_path / "ssd"),
                      ssd_capacity=8 << 20, ssd_region_size=1 << 20,
                      kv_events_endpoint=("alpha=tcp://127.0.0.1:0", "gamma=tcp://127.0.0.1:0"),
                      kv_events_replay_endpoint=("alpha=tcp://127.0.0.1:0", "gamma=tcp://127.0.0.1:0"))
    mine = tokens(3, 4)
    with daemon_in_thread(cfg) as d, Client(d.unix_target, token=toks.tokens["alpha"]) as a:
        a.put(LAYOUT, mine, blocks(3, 4))
        wait_until(lambda: d.store.pending_ssd_writes == 0, "the put on SSD")
    with daemon_in_thread(cfg) as d:
        ra, rg = reader_for(d, "alpha"), reader_for(d, "gamma")
        readers += [ra, rg]
        assert ra.wait_for(lambda ev: len(ev) >= 1, "alpha's start") == [{"type": "AllBlocksCleared"}]
        with Client(d.unix_target, token=toks.tokens["alpha"]) as a:
            assert a.lookup(LAYOUT, mine).num_blocks == 3  # names the layout: the blocks are alpha's
            ev = ra.wait_for(lambda ev: len(router_view(ev)) == 3, "alpha's recovered blocks")
        assert router_view(ev) == {(h, "STORAGE") for h in hashes_of(mine)}
        # Gamma's stream has said nothing but its start; alpha's announcement came after
        # the lookup, so gamma's would have been published by then too.
        assert rg.wait_for(lambda ev: len(ev) >= 1, "gamma's start") == [{"type": "AllBlocksCleared"}]


def test_stream_settings_are_checked(tmp_path):
    def cfg(**kw: Any) -> Config:
        return replace(make_config(tmp_path), **kw)

    with pytest.raises(ConfigError, match="kv-events-remote"):
        parse_streams(cfg(kv_events_endpoint=("tcp://0.0.0.0:5557",)))
    with pytest.raises(ConfigError, match="kv-events-remote"):
        parse_streams(cfg(kv_events_endpoint=("tcp://*:5557",)))
    with pytest.raises(ConfigError, match="kv-events-remote"):  # connecting out leaves the host too
        parse_streams(cfg(kv_events_endpoint=("tcp://indexer.example:5557",), kv_events_connect=True))
    assert parse_streams(cfg(kv_events_endpoint=("tcp://*:5557",), kv_events_remote=True))[0].endpoint == "tcp://*:5557"
    with pytest.raises(ConfigError, match="neither tcp"):
        parse_streams(cfg(kv_events_endpoint=("udp://127.0.0.1:1",)))
    with pytest.raises(ConfigError, match="absolute path"):
        parse_streams(cfg(kv_events_endpoint=("ipc://events.sock",)))
    with pytest.raises(ConfigError, match="has no kv_events_endpoint"):
        parse_streams(cfg(kv_events_replay_endpoint=("tcp://127.0.0.1:5558",)))
    with pytest.raises(ConfigError, match="only tenant is 'default'"):
        parse_streams(cfg(kv_events_endpoint=("alpha=tcp://127.0.0.1:5557",)))
    toks = Tokens(tmp_path / "tokens.toml", ("alpha",))
    with pytest.raises(ConfigError, match="names no tenant"):
        parse_streams(cfg(auth_token_file=str(toks.path), kv_events_endpoint=("tcp://127.0.0.1:5557",)))
    with pytest.raises(ConfigError, match="does not have"):
        parse_streams(cfg(auth_token_file=str(toks.path), kv_events_endpoint=("beta=tcp://127.0.0.1:5557",)),
                      tenants={"alpha"})
    assert parse_streams(cfg()) == []  # off by default
    # The same spelling everywhere: flags and env reach the same fields.
    loaded = load_config({"kv_events_endpoint": "tcp://127.0.0.1:5557"}, env={"KVSTORE_KV_EVENTS_TOPIC": "kv@p@m"})
    assert (loaded.kv_events_endpoint, loaded.kv_events_topic) == (("tcp://127.0.0.1:5557",), "kv@p@m")


def test_config_validate_checks_the_streams(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('kv_events_endpoint = "tcp://0.0.0.0:5557"\n')
    assert main(["config", "validate", str(bad)]) == 1
    assert "kv-events-remote" in capsys.readouterr().out
    good = tmp_path / "good.toml"
    good.write_text('kv_events_endpoint = "tcp://127.0.0.1:5557"\nkv_events_replay_endpoint = "tcp://127.0.0.1:5558"\n')
    assert main(["config", "validate", str(good)]) == 0


async def test_an_endpoint_in_use_stops_the_daemon(tmp_path):
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    taken.bind("tcp://127.0.0.1:0")
    try:
        endpoint = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        d = Daemon(make_config(tmp_path, kv_events_endpoint=(endpoint,)))
        with pytest.raises(ConfigError, match="cannot bind kv_events_endpoint"):
            await d.start()
    finally:
        taken.close(linger=0)
        ctx.term()


def test_an_ipc_stream_is_the_daemons_uid_only(tmp_path, readers):
    path = tmp_path / "run" / "kv-events.sock"
    cfg = make_config(tmp_path, kv_events_endpoint=(f"ipc://{path}",),
                      kv_events_replay_endpoint=(f"ipc://{tmp_path / 'run' / 'kv-replay.sock'}",))
    with daemon_in_thread(cfg) as d, Client(d.unix_target) as kv:
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        r = reader_for(d)
        readers.append(r)
        kv.put(LAYOUT, tokens(1, 1), blocks(1, 1), engine_names=EngineNames([b"vllm-name"]))
        assert stored_names(r.wait_for(lambda ev: stored_names(ev), "a store")) == [b"vllm-name"]
    assert not path.exists()


def test_the_stream_connects_to_a_collector_that_binds(tmp_path):
    """`kv_events_connect`: the daemon's PUB socket connects to a router's SUB socket that
    binds (llm-d's indexer in its centralized mode), instead of the router connecting."""
    ctx = zmq.Context()
    collector = ctx.socket(zmq.SUB)
    collector.setsockopt(zmq.SUBSCRIBE, b"")
    collector.bind("tcp://127.0.0.1:0")
    try:
        endpoint = collector.getsockopt_string(zmq.LAST_ENDPOINT)
        cfg = make_config(tmp_path, kv_events_endpoint=(endpoint,), kv_events_connect=True)
        with daemon_in_thread(cfg) as d, Client(d.unix_target) as kv:
            i = 0
            seen: list[Any] = []
            while not seen:  # puts until the connection has taken hold and one arrives
                if collector.poll(50):
                    _, _, payload = collector.recv_multipart()
                    seen += [h for e in msgpack.unpackb(payload, raw=False)[1] for h in e.get("block_hashes", ())]
                else:
                    kv.put(LAYOUT, tokens(1, 70 + i), blocks(1, i), engine_names=EngineNames([700 + i]))
                    i += 1
                    assert i < 2000, "nothing reached the collector"
            assert set(seen) <= {700 + k for k in range(i)}
    finally:
        collector.close(linger=0)
        ctx.term()


# ------------------------------------------------------------------ the names a put carries


def test_engine_names_are_checked(daemon_thread):
    with Client(daemon_thread.unix_target) as kv:
        with pytest.raises(InvalidArgument, match="2 hashes for a put of 1 blocks"):
            kv.put(LAYOUT, tokens(1, 1), blocks(1), engine_names=EngineNames([1, 2]))
        with pytest.raises(InvalidArgument, match="integer in"):
            kv.put(LAYOUT, tokens(2, 1), blocks(2), engine_names=EngineNames([1, b"x"]))
        with pytest.raises(InvalidArgument, match="integer in"):
            kv.put(LAYOUT, tokens(1, 1), blocks(1), engine_names=EngineNames([1 << 64]))
        with pytest.raises(InvalidArgument, match="sends its token ids"):
            kv.put(LAYOUT, tokens(1, 1), blocks(1), engine_names=EngineNames([1], token_ids=tokens(1, 1)))
        with pytest.raises(InvalidArgument, match="need 4"):
            kv.put(LAYOUT, None, blocks(1), block_hashes=hashes_of(tokens(1, 1)),
                   engine_names=EngineNames([1], token_ids=[1, 2]))
        assert kv.lookup(LAYOUT, tokens(2, 1)).num_blocks == 0
    # The daemon checks too, whoever the client: a raw Put with one name for two blocks.
    header = kvstore_pb2.PutHeader(
        namespace=kvstore_pb2.Namespace(layout=kvstore_pb2.Layout(
            model=LAYOUT.model, dtype=LAYOUT.dtype, num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=BS)),
        keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens(2, 1))), num_blocks=2,
        engine_names=kvstore_pb2.EngineNames(names=[b"\x00" * 8], integers=True))
    msgs = [kvstore_pb2.PutRequest(header=header)] + [
        kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=i, data=b)) for i, b in enumerate(blocks(2))]
    with grpc.insecure_channel(daemon_thread.tcp_target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            kvstore_pb2_grpc.KVStoreStub(channel).Put(iter(msgs), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1 names for a put of 2 blocks" in info.value.details()
    with Client(daemon_thread.unix_target) as kv:
        assert kv.lookup(LAYOUT, tokens(2, 1)).num_blocks == 0
        # A daemon without a stream takes well-formed names and stores as ever.
        assert kv.put(LAYOUT, tokens(2, 1), blocks(2), engine_names=EngineNames([1, 2])).stored == 2


# ------------------------------------------------------------------ the CLI


def test_kvstore_events_format_vllm(tmp_path, capsys):
    with daemon_in_thread(kv_config(tmp_path)) as d, Client(d.unix_target) as kv:
        endpoint, replay = d.daemon.kv_events.bound["default"]
        kv.put(LAYOUT, tokens(2, 1), blocks(2), engine_names=EngineNames([b"\x01\x02", b"\x03"]))
        kv.delete(LAYOUT, tokens(2, 1))
        wait_until(lambda: d.daemon.kv_events.stats()[0].counters.events >= 3, "three events published")
        code = main(["events", "--format", "vllm", "--endpoint", endpoint, "--replay", replay, "--from-seq", "0",
                     "--count", "3", "--duration", "30"])
        assert code == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [x["type"] for x in lines] == ["AllBlocksCleared", "BlockStored", "BlockRemoved"]
        assert lines[0]["seq"] == 0 and [x["seq"] for x in lines] == sorted(x["seq"] for x in lines)
        assert lines[1]["block_hashes"] == ["0102", "03"] and lines[1]["token_ids"] == tokens(2, 1)
        assert all(x["endpoint"] == endpoint for x in lines)
        # Bad command lines are usage errors, and say what is missing.
        assert main(["events", "--format", "vllm"]) == 2
        assert "--endpoint" in capsys.readouterr().out
        assert main(["events", "--format", "vllm", "--endpoint", endpoint, "--replay", replay, "--replay", replay]) == 2
        assert main(["events", "--endpoint", endpoint, "--target", d.unix_target]) == 2
        assert "--format vllm" in capsys.readouterr().out
        # An endpoint ZMQ cannot parse is an error that says so, and the command returns.
        assert main(["events", "--format", "vllm", "--endpoint", "127.0.0.1:5557"]) == 1
        assert "cannot connect to 127.0.0.1:5557" in capsys.readouterr().out
        # INFO's events section names the stream and its figures.
        assert main(["info", "events", "--target", d.unix_target]) == 0
        section = capsys.readouterr().out
        batches = d.daemon.kv_events.stats()[0].counters.batches
        for line in ("kv_events:on", f"kv_events_default_endpoint:{endpoint}", f"kv_events_default_batches:{batches}",
                     "kv_events_default_published:3", "kv_events_default_dropped:0", "kv_events_default_replays:1"):
            assert line in section.splitlines(), (line, section)


def test_a_batch_decodes_as_vllms_structs_encode(tmp_path, readers):
    """The wire, byte for byte where it is fixed: the three frames, the 8-byte sequence, a
    batch as [ts, events, data_parallel_rank] and each event a map whose first key is its
    type."""
    with daemon_in_thread(kv_config(tmp_path, kv_events_topic="kv@pod-1@test/events")) as d, \
            Client(d.unix_target) as kv:
        endpoint, _ = d.daemon.kv_events.bound["default"]
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(endpoint)
        try:
            i = 0
            event = None
            while event is None:  # the start's AllBlocksCleared may come first
                if not sub.poll(100):
                    kv.put(LAYOUT, tokens(1, 50 + i), blocks(1, i), engine_names=EngineNames([i]))
                    i += 1
                    continue
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv@pod-1@test/events" and len(seq) == 8
                batch = msgpack.unpackb(payload, raw=False)
                assert len(batch) == 3 and isinstance(batch[0], float) and batch[2] == 0  # [ts, events, dp rank]
                event = next((e for e in batch[1] if e["type"] == "BlockStored"), None)
            assert list(event)[:5] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size"]
        finally:
            sub.close(linger=0)
            ctx.term()


def test_the_stream_stops_with_the_daemon(tmp_path):
    async def run() -> None:
        d = Daemon(kv_config(tmp_path))
        await d.start()
        endpoint, replay = d.kv_events.bound["default"]  # type: ignore[union-attr]
        await d.stop(grace_s=0)
        # Both ports are free again: the sockets were closed.
        ctx = zmq.Context()
        for ep in (endpoint, replay):
            s = ctx.socket(zmq.PUB)
            s.bind(ep)
            s.close(linger=0)
        ctx.term()

    asyncio.run(run())
