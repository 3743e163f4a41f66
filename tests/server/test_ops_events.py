"""Block events: the bus under a consumer that never reads, WatchEvents over gRPC with a
consumer that falls behind (bounded queue, dropped count, resync marker), and the SDK's
BlockTracker staying exact through a resync."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc
import pytest

from kvstore.client import AsyncClient, Client
from kvstore.client.admin import AdminClient
from kvstore.client.events import BlockTracker
from kvstore.core.store import BlockGroup
from kvstore.errors import ResourceExhausted, Unavailable
from kvstore.server.events import MAX_SUBSCRIBERS, EventBus, EventKind
from kvstore.v1 import admin_pb2, admin_pb2_grpc

NS = b"n" * 16


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


async def test_bus_never_blocks_and_marks_resync():
    bus = EventBus(queue_size=100)
    slow = bus.subscribe(queue_size=4)
    fast = bus.subscribe()
    for i in range(10):  # a consumer that never reads: publishing still returns at once
        bus.blocks_stored(NS, [_h(i)], "host")
    assert bus.published == 10
    # 10 events into 4 slots: two overflows, each discarding the backlog behind a marker.
    slow.close()
    got = [e async for e in slow]
    assert got[0].kind is EventKind.RESYNC and got[0].dropped == bus.dropped == 9
    assert all(e.kind is EventKind.STORED for e in got[1:])
    assert [e.block_hashes[0] for e in got[1:]] == [_h(i) for i in range(10 - len(got) + 1, 10)]
    fast.close()
    assert [e.block_hashes for e in [e async for e in fast]] == [(_h(i),) for i in range(10)]


async def test_bus_snapshot_and_namespace_filter():
    bus = EventBus()
    snap = [BlockGroup(NS, "host", (_h(1), _h(2))), BlockGroup(b"o" * 16, "host", (_h(3),))]
    sub = bus.subscribe(NS, snapshot=snap)
    bus.blocks_removed(b"o" * 16, [_h(3)], "host")
    bus.blocks_moved(NS, [_h(1)], "host", "ssd")
    sub.close()
    got = [e async for e in sub]
    assert [(e.kind, e.block_hashes, e.tier, e.from_tier) for e in got] == [
        (EventKind.STORED, (_h(1), _h(2)), "host", ""),
        (EventKind.MOVED, (_h(1),), "ssd", "host"),
    ]


async def test_watch_events_rpc_with_a_consumer_that_falls_behind(daemon, layout):
    tokens = list(range(layout.block_size_tokens * 20))
    async with AsyncClient(daemon.unix_target) as kv, grpc.aio.insecure_channel(daemon.unix_target) as channel:
        put = await kv.put(layout, tokens[:8], [os.urandom(layout.bytes_per_block) for _ in range(2)])
        admin = admin_pb2_grpc.AdminStub(channel)
        call = admin.WatchEvents(admin_pb2.WatchEventsRequest(snapshot=True, queue_size=4), timeout=30)
        stream = call.__aiter__()
        first = await anext(stream)  # the snapshot: we are subscribed from here on
        assert first.kind == admin_pb2.EVENT_STORED and set(first.block_hashes) == set(put.block_hashes)

        await kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(18)], first_block=2)
        stored = await anext(stream)
        assert stored.kind == admin_pb2.EVENT_STORED and len(stored.block_hashes) == 18 and stored.tier == "host"

        # One flush removes 20 blocks in one synchronous step, 20 events into a queue of 4:
        # the watcher cannot keep up, the store does not wait for it.
        flushed = await admin.Flush(admin_pb2.FlushRequest())
        assert flushed.blocks == 20
        kinds, dropped, removed = [], 0, []
        while True:
            e = await anext(stream)
            kinds.append(e.kind)
            if e.kind == admin_pb2.EVENT_RESYNC:
                dropped += e.dropped
            else:
                removed += list(e.block_hashes)
            if dropped + len(removed) >= 20:
                break
        assert admin_pb2.EVENT_RESYNC in kinds and dropped > 0
        assert len(removed) <= 4
        call.cancel()

        stats = await admin.Info(admin_pb2.InfoRequest(section="stats"))
        assert "blocks_stored:20" in stats.text
        events = (await admin.Info(admin_pb2.InfoRequest(section="events"))).text
        assert f"events_dropped:{dropped}" in events and "event_subscribers:" in events
    assert daemon.daemon.events.dropped == dropped


async def test_watch_events_ends_on_shutdown(daemon, layout):
    async with AsyncClient(daemon.unix_target) as kv, grpc.aio.insecure_channel(daemon.unix_target) as channel:
        await kv.put(layout, list(range(layout.block_size_tokens)), [os.urandom(layout.bytes_per_block)])
        call = admin_pb2_grpc.AdminStub(channel).WatchEvents(admin_pb2.WatchEventsRequest(snapshot=True), timeout=30)
        stream = call.__aiter__()
        assert (await anext(stream)).kind == admin_pb2.EVENT_STORED  # subscribed
        stop = asyncio.create_task(daemon.daemon.stop(grace_s=5))
        rest = [e async for e in stream]  # ends instead of holding the drain open
        await stop
        assert rest == []
        assert await call.code() == grpc.StatusCode.OK


async def test_closed_bus_refuses_subscribers():
    bus = EventBus()
    sub = bus.subscribe()
    bus.blocks_stored(NS, [_h(1)], "host")
    bus.close()
    assert [e.block_hashes for e in [e async for e in sub]] == [(_h(1),)]  # buffered events still arrive
    with pytest.raises(Unavailable, match="shutting down"):
        bus.subscribe()


async def test_bus_caps_subscribers():
    bus = EventBus()
    subs = [bus.subscribe() for _ in range(MAX_SUBSCRIBERS)]
    with pytest.raises(ResourceExhausted, match="close unused"):
        bus.subscribe()
    subs[0].close()
    bus.subscribe().close()
    assert bus.subscribers == MAX_SUBSCRIBERS - 1


def test_tracker_follows_a_daemon_through_a_resync(daemon_thread, layout):
    def eventually(predicate) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline, "the tracker did not catch up"
            time.sleep(0.01)

    tracker, stop = BlockTracker(), threading.Event()
    with Client(daemon_thread.tcp_target, data_plane="grpc") as kv:
        tokens = list(range(layout.block_size_tokens * 12))
        first = kv.put(layout, tokens[:16], [os.urandom(layout.bytes_per_block) for _ in range(4)])
        ns = kv.lookup(layout, tokens).namespace_id
        admin = AdminClient(daemon_thread.tcp_target)
        follower = threading.Thread(target=tracker.follow, args=(admin, stop), kwargs={"queue_size": 4})
        follower.start()
        try:
            eventually(lambda: tracker.prefix_length(ns, first.block_hashes) == 4)  # from the snapshot
            rest = kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(8)], first_block=4)
            chain = first.block_hashes + rest.block_hashes
            eventually(lambda: tracker.prefix_length(ns, chain) == 12)
            assert tracker.tier_of(ns, chain[-1]) == "host"

            # 12 removals at once into a queue of 4: the tracker must resync, then be exact.
            with AdminClient(daemon_thread.tcp_target) as other:
                other.flush()
            again = kv.put(layout, tokens[:8], [os.urandom(layout.bytes_per_block) for _ in range(2)])
            eventually(lambda: tracker.resyncs >= 1 and tracker.blocks(ns) == 2)
            assert tracker.prefix_length(ns, chain) == 2 and tracker.tier_of(ns, again.block_hashes[1]) == "host"
        finally:
            stop.set()
            admin.close()  # ends the stream the follower is blocked on
            follower.join(30)
    assert not follower.is_alive()


async def test_demotion_to_ssd_is_a_moved_event(tmp_path, layout):
    from conftest import make_config

    from kvstore.server.daemon import Daemon

    d = Daemon(make_config(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_capacity=64 << 20, ssd_region_size=1 << 20))
    await d.start()
    sub = d.events.subscribe()
    try:
        tokens = list(range(layout.block_size_tokens * 4))
        async with AsyncClient(d.bound[0], data_plane="grpc") as kv, grpc.aio.insecure_channel(d.bound[0]) as ch:
            put = await kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(4)])
            assert await d.store.flush(30)  # the write-through copies are on SSD
            freed = await admin_pb2_grpc.AdminStub(ch).Evict(admin_pb2.EvictRequest(tier="host", target_bytes=1 << 20))
            assert freed.blocks == 4
            assert (await kv.lookup(layout, tokens)).tiers == ["ssd"] * 4
        events = []
        stream = sub.__aiter__()
        while sum(len(e.block_hashes) for e in events if e.kind is EventKind.MOVED) < 4:
            events.append(await asyncio.wait_for(anext(stream), 30))
        stored = [e for e in events if e.kind is EventKind.STORED]
        assert [(e.tier, set(e.block_hashes)) for e in stored] == [("host", set(put.block_hashes))]
        moved = [e for e in events if e.kind is EventKind.MOVED]
        assert {(e.from_tier, e.tier) for e in moved} == {("host", "ssd")}
        assert {h for e in moved for h in e.block_hashes} == set(put.block_hashes)
    finally:
        sub.close()
        await d.stop(grace_s=0)
