"""Block events name their tiers with the `Tier` enum, as Lookup does.

`Event.tier_enum` / `from_tier_enum` are the fields to read; the older `tier` /
`from_tier` strings stay filled for existing readers, and the SDK's BlockTracker reads
the enum when a daemon sends it (and the string from a daemon that does not).
"""

from __future__ import annotations

import asyncio
import os

import grpc
from conftest import make_config

from kvstore.client import AsyncClient
from kvstore.client.events import BlockTracker
from kvstore.server.daemon import Daemon
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2
from tests.polling import eventually


async def test_watch_events_carry_the_tier_enum_next_to_the_names(tmp_path, layout):
    d = Daemon(make_config(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_capacity=8 << 20, ssd_region_size=1 << 20))
    await d.start()
    try:
        tokens = list(range(layout.block_size_tokens * 2))
        async with AsyncClient(d.bound[0], data_plane="grpc") as kv, grpc.aio.insecure_channel(d.bound[0]) as ch:
            admin = admin_pb2_grpc.AdminStub(ch)
            call = admin.WatchEvents(admin_pb2.WatchEventsRequest(), timeout=30)
            stream = call.__aiter__()

            async def subscribed() -> bool:
                events = await admin.Info(admin_pb2.InfoRequest(section="events"))
                return "event_subscribers:1" in events.text.splitlines()

            # The put's STORED event reaches only a subscriber registered before it.
            await eventually(subscribed, "the WatchEvents stream subscribed")
            put = await kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(2)])
            stored = await asyncio.wait_for(anext(stream), 30)
            assert stored.kind == admin_pb2.EVENT_STORED
            assert (stored.tier, stored.tier_enum) == ("host", kvstore_pb2.TIER_HOST)
            assert stored.from_tier_enum == kvstore_pb2.TIER_UNSPECIFIED
            tracker = BlockTracker()
            tracker.apply(stored)
            assert tracker.tier_of(stored.namespace_id, put.block_hashes[0]) == "host"

            assert await d.store.flush(30)  # the write-through copies are on SSD
            await admin.Evict(admin_pb2.EvictRequest(tier="host", target_bytes=1 << 20))
            await admin.Flush(admin_pb2.FlushRequest())
            events = []
            while sum(len(e.block_hashes) for e in events if e.kind == admin_pb2.EVENT_REMOVED) < 2:
                events.append(await asyncio.wait_for(anext(stream), 30))
            call.cancel()
            moved = [e for e in events if e.kind == admin_pb2.EVENT_MOVED]
            assert {h for e in moved for h in e.block_hashes} == set(put.block_hashes)
            for e in moved:
                assert (e.from_tier, e.tier) == ("host", "ssd")
                assert (e.from_tier_enum, e.tier_enum) == (kvstore_pb2.TIER_HOST, kvstore_pb2.TIER_SSD)
                tracker.apply(e)
            assert tracker.tier_of(stored.namespace_id, put.block_hashes[0]) == "ssd"
            removed = [e for e in events if e.kind == admin_pb2.EVENT_REMOVED]
            assert {(e.tier, e.tier_enum) for e in removed} == {("ssd", kvstore_pb2.TIER_SSD)}
    finally:
        await d.stop(grace_s=0)


def test_the_tracker_reads_the_string_from_an_older_daemon():
    tracker = BlockTracker()
    ns, h = b"n" * 16, b"h" * 16
    tracker.apply(admin_pb2.Event(kind=admin_pb2.EVENT_STORED, namespace_id=ns, block_hashes=[h], tier="host"))
    assert tracker.tier_of(ns, h) == "host"
    tracker.apply(admin_pb2.Event(kind=admin_pb2.EVENT_MOVED, namespace_id=ns, block_hashes=[h], tier="ssd",
                                  tier_enum=kvstore_pb2.TIER_SSD, from_tier="host",
                                  from_tier_enum=kvstore_pb2.TIER_HOST))
    assert tracker.tier_of(ns, h) == "ssd"
