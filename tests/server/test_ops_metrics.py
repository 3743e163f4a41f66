"""The Prometheus endpoint of a real daemon, scraped over HTTP and parsed with
prometheus-client's own parser."""

from __future__ import annotations

import asyncio
import os
import urllib.error
import urllib.request
from dataclasses import replace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import AsyncClient
from kvstore.errors import ConfigError
from kvstore.server.config import load_config
from kvstore.server.daemon import Daemon
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, "", exc.read().decode()


async def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, ctype, body = await asyncio.to_thread(_get, f"http://{address}/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def test_metrics_scrape(daemon, layout):
    address = daemon.daemon.metrics_address
    assert address.startswith("127.0.0.1:")
    tokens = list(range(layout.block_size_tokens * 4))
    async with AsyncClient(daemon.tcp_target, data_plane="grpc") as kv:
        await kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(3)])
        await kv.lookup(layout, tokens)  # 3 hits, 1 miss
        await kv.fetch(layout, tokens)
    async with AsyncClient(daemon.unix_target, data_plane="local") as kv:  # co-located: shared memory
        await kv.fetch(layout, tokens)
        await kv.put(layout, tokens[:4], [os.urandom(layout.bytes_per_block)])  # present: stores nothing
        await kv.put(layout, list(range(100, 100 + layout.block_size_tokens)), [os.urandom(layout.bytes_per_block)])
    async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await kvstore_pb2_grpc.KVStoreStub(channel).Lookup(kvstore_pb2.LookupRequest())  # names no namespace
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    m = await scrape(address)
    assert m[("kvstore_lookup_blocks_total", (("result", "hit"),))] == 3
    assert m[("kvstore_lookup_blocks_total", (("result", "miss"),))] == 1
    assert m[("kvstore_tier_hits_total", (("tier", "host"),))] == 3
    assert m[("kvstore_data_in_bytes_total", (("plane", "grpc"),))] == 3 * layout.bytes_per_block
    assert m[("kvstore_data_out_bytes_total", (("plane", "grpc"),))] == 3 * layout.bytes_per_block
    assert m[("kvstore_data_in_bytes_total", (("plane", "shm"),))] == layout.bytes_per_block
    assert m[("kvstore_data_out_bytes_total", (("plane", "shm"),))] == 3 * layout.bytes_per_block
    assert m[("kvstore_tier_used_bytes", (("tier", "host"),))] == 4 * layout.bytes_per_block
    assert m[("kvstore_tier_capacity_bytes", (("tier", "host"),))] == 16 << 20
    assert m[("kvstore_checksum_failures_total", (("tier", "host"),))] == 0
    assert m[("kvstore_leases_active", ())] == 0
    assert m[("kvstore_rpc_duration_seconds_count", (("code", "OK"), ("method", "Put")))] == 1
    assert m[("kvstore_rpc_duration_seconds_count", (("code", "OK"), ("method", "Fetch")))] == 1
    assert m[("kvstore_rpcs_in_flight", (("method", "Fetch"),))] == 0  # all done
    # The failed lookup is counted under its status code.
    assert m[("kvstore_rpc_duration_seconds_count", (("code", "INVALID_ARGUMENT"), ("method", "Lookup")))] == 1


async def test_the_collectors_pauses_are_in_the_metrics_and_info(daemon):
    import gc

    gc.collect()  # the daemon runs in this process: a full collection it must have timed
    m = await scrape(daemon.daemon.metrics_address)
    full = m[("kvstore_gc_collections_total", (("generation", "2"),))]
    assert full >= 1 and m[("kvstore_gc_pause_seconds_total", (("generation", "2"),))] > 0
    assert ("kvstore_gc_collections_total", (("generation", "0"),)) in m
    assert m[("kvstore_gc_frozen_at_blocks", ())] == daemon.daemon.gc_freezer.pauses().frozen_at_blocks
    async with AsyncClient(daemon.unix_target) as kv:
        text = await kv.info("server")
    lines = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    assert int(lines["gc_gen2_collections"]) >= full and float(lines["gc_gen2_pause_ms"]) > 0
    assert float(lines["gc_gen2_longest_pause_ms"]) <= float(lines["gc_gen2_pause_ms"])
    assert {"gc_gen0_collections", "gc_gen1_collections", "gc_frozen_at_blocks", "gc_freezes"} <= lines.keys()


async def test_metrics_serves_nothing_else(daemon):
    address = daemon.daemon.metrics_address
    for path in ("/env", "/", "/metrics/../env"):
        status, _, body = await asyncio.to_thread(_get, f"http://{address}{path}")
        assert status == 404, path
        assert "PATH" not in body


async def test_metrics_off_and_loopback_only(tmp_path):
    base = load_config({"listen": f"unix:{tmp_path / 'kv.sock'}", "host_capacity": "16MiB"}, env={})
    d = Daemon(replace(base, metrics_listen="off"))
    await d.start()
    try:
        assert d.metrics_address == ""
    finally:
        await d.stop(grace_s=0)
    with pytest.raises(ConfigError, match="metrics-remote"):
        Daemon(replace(base, metrics_listen="0.0.0.0:0"))


async def test_metrics_port_in_use_is_refused(daemon, tmp_path):
    taken = daemon.daemon.metrics_address
    base = load_config({"listen": f"unix:{tmp_path / 'second.sock'}", "host_capacity": "16MiB"}, env={})
    second = Daemon(replace(base, metrics_listen=taken))
    with pytest.raises(ConfigError, match=f"cannot serve metrics on {taken}"):
        await second.start()
    assert not (tmp_path / "second.sock").exists()


async def test_metrics_endpoint_closes_with_a_scraper_still_connected(tmp_path):
    base = load_config({"listen": f"unix:{tmp_path / 'kv.sock'}", "host_capacity": "16MiB",
                        "metrics_listen": "127.0.0.1:0"}, env={})
    d = Daemon(base)
    await d.start()
    host, port = d.metrics_address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /metr")  # a scraper that stalls mid-request
    await writer.drain()
    await asyncio.sleep(0.05)  # let the endpoint accept it (the case under test either way)
    await asyncio.wait_for(d.stop(grace_s=0), 10)  # does not wait out the 5 s read timeout
    try:
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, no response
    except ConnectionResetError:
        pass  # also closed
    writer.close()


def test_migration_and_drop_counters_are_exported_when_the_store_has_them():
    """A tiered store's per-tier counters (promotions, demotions, drops) appear as
    kvstore_migrations_total and kvstore_tier_drops_total without further wiring."""
    from types import SimpleNamespace

    from kvstore.core.store import StoreCounters, StoreStatus, TierStatus
    from kvstore.server.metrics import Metrics

    counters = SimpleNamespace(hits=5, misses=1, evictions=0, checksum_failures=0, promotions=3, demotions=4, drops=2)
    status = StoreStatus(
        tiers=[TierStatus("host", 100, 50, 5, "lru", counters, {})],  # type: ignore[arg-type]
        counters=StoreCounters(), namespaces=0, leases_active=0,
    )
    store = SimpleNamespace(stats=lambda: status)
    body = Metrics(lambda: store).exposition().decode()  # type: ignore[arg-type, return-value]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body) for s in f.samples}
    assert samples[("kvstore_migrations_total", (("direction", "promote"), ("tier", "host")))] == 3
    assert samples[("kvstore_migrations_total", (("direction", "demote"), ("tier", "host")))] == 4
    assert samples[("kvstore_tier_drops_total", (("tier", "host"),))] == 2
