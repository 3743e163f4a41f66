"""The standard health service against the real daemon: `Check` and the streaming
`Watch` (which grpcio's servicer answers with `context.write`, not by yielding), and
the change to NOT_SERVING that a watcher sees when the daemon shuts down."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from conftest import make_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.server.daemon import Daemon

pytestmark = pytest.mark.asyncio

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Daemon]:
    d = Daemon(make_config(tmp_path, grace_s=2.0))
    await d.start()
    try:
        yield d
    finally:
        await d.stop(grace_s=0)  # a second stop returns once the first has finished


@pytest.mark.parametrize("service", ["", "kvstore.v1.KVStore", "kvstore.v1.Admin"])
async def test_check_and_watch_say_serving(running, service):
    for target in running.bound:  # the Unix socket and TCP
        async with grpc.aio.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert (await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)).status == SERVING
            call = health.Watch(health_pb2.HealthCheckRequest(service=service), timeout=10)
            first = await asyncio.wait_for(call.read(), 10)
            assert first.status == SERVING
            call.cancel()


async def test_watch_of_an_unknown_service_says_so(running):
    async with grpc.aio.insecure_channel(running.bound[1]) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="no.such.Service"),
                                                         timeout=10)
        assert (await asyncio.wait_for(call.read(), 10)).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        call.cancel()


async def test_a_watcher_sees_not_serving_when_the_daemon_shuts_down(running):
    async with grpc.aio.insecure_channel(running.bound[1]) as channel:
        calls = [health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=s), timeout=30)
                 for s in ("", "kvstore.v1.KVStore")]
        for call in calls:
            assert (await asyncio.wait_for(call.read(), 10)).status == SERVING
        stopping = asyncio.create_task(running.stop())
        try:
            for call in calls:
                assert (await asyncio.wait_for(call.read(), 10)).status == NOT_SERVING
        finally:
            await stopping
        # The streams do not outlive the daemon: the server ends them once the grace is spent.
        for call in calls:
            with contextlib.suppress(grpc.aio.AioRpcError):
                assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF
            assert call.done()


async def test_an_open_watch_does_not_hold_the_shutdown_for_the_whole_grace(tmp_path):
    d = Daemon(make_config(tmp_path, grace_s=60.0))
    await d.start()
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(d.bound[1]) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
        assert (await asyncio.wait_for(call.read(), 10)).status == SERVING
        started = loop.time()
        await asyncio.wait_for(d.stop(), 60)
        # The drain had nothing to wait for: the watch must not keep the daemon up for the
        # remaining minute of grace.
        assert loop.time() - started < 30
        assert (await asyncio.wait_for(call.read(), 10)).status == NOT_SERVING

