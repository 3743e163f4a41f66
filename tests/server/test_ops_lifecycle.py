"""Lifecycle: graceful drain of in-flight RPCs, SIGHUP reload, SIGTERM exit 0, JSON logs,
and durability across a restart on the SSD tier.

A put that is in flight when shutdown begins still completes OK; the daemon exits 0
once every call has finished and pending SSD writes have landed; after a restart on
the same SSD directory, every put that returned OK is readable.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvstore.client import Client
from kvstore.client._local import LocalPlane
from kvstore.client._requests import namespace_ref
from kvstore.client.admin import AdminClient
from kvstore.errors import Cancelled, ConfigError, KVStoreError, Unavailable
from kvstore.server.config import Config
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

DEADLINE_S = 30.0


async def test_stop_drains_an_in_flight_put(daemon, layout):
    d = daemon.daemon
    tokens = list(range(layout.block_size_tokens * 2))
    payload = os.urandom(layout.bytes_per_block)
    half = layout.bytes_per_block // 2
    gate = asyncio.Event()

    async def requests():
        header = kvstore_pb2.PutHeader(
            namespace=namespace_ref(layout),
            keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens)),
        )
        yield kvstore_pb2.PutRequest(header=header)
        yield kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=0, data=payload[:half]))
        await gate.wait()  # the put stays in flight until shutdown has begun
        yield kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=0, data=payload[half:]))
        yield kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=1, data=payload))

    async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
        call = kvstore_pb2_grpc.KVStoreStub(channel).Put(requests(), timeout=DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while d.store.stats().tiers[0].used_bytes == 0:  # the daemon has reserved the put's slots
            assert time.monotonic() < deadline, "the put never reached the daemon"
            await asyncio.sleep(0.01)
        stop = asyncio.create_task(d.stop(grace_s=DEADLINE_S))
        while (await d.health.Check(health_pb2.HealthCheckRequest(), None)).status != \
                health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health never turned NOT_SERVING"
            await asyncio.sleep(0.01)
        gate.set()
        response = await call
        assert response.stored == 2
        await stop


async def test_stop_lets_a_local_put_being_copied_commit(daemon, layout):
    """A co-located client has reserved slots and is copying when shutdown begins: new
    calls are refused, but its commit is accepted and the put lands."""
    d = daemon.daemon
    tokens = list(range(layout.block_size_tokens * 2))
    payload = memoryview(os.urandom(layout.bytes_per_block))
    async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        plane = LocalPlane.attach(await stub.LocalSegment(kvstore_pb2.LocalSegmentRequest()))
        try:
            header = kvstore_pb2.PutHeader(
                namespace=namespace_ref(layout), keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))
            )
            begun = await stub.LocalPut(kvstore_pb2.LocalPutRequest(header=header))
            stop = asyncio.create_task(d.stop(grace_s=DEADLINE_S))
            deadline = time.monotonic() + DEADLINE_S
            while (await d.health.Check(health_pb2.HealthCheckRequest(), None)).status != \
                    health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "health never turned NOT_SERVING"
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # new work is refused meanwhile
                await stub.Lookup(kvstore_pb2.LookupRequest(namespace=namespace_ref(layout)), timeout=DEADLINE_S)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
            sums = plane.copy_in(begun.offsets, [payload, payload])
            committed = await stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, checksums=sums))
            assert committed.stored == 2
            await stop
        finally:
            plane.close()


async def test_reload_that_fails_changes_nothing(daemon, caplog):
    def unreadable() -> Config:
        raise ConfigError("config file kvstore.toml cannot be read: permission denied")

    before = daemon.daemon.runtime.current
    daemon.daemon.reload(unreadable)
    assert daemon.daemon.runtime.current == before
    assert "reload failed, settings unchanged" in caplog.text and "permission denied" in caplog.text


def _wait_ready(target: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert proc.poll() is None, "the daemon exited during start-up"
        try:
            with AdminClient(target, timeout_s=1) as admin:
                admin.stats()
            return
        except KVStoreError:
            assert time.monotonic() < deadline, "the daemon did not come up"
            time.sleep(0.05)


def _write_config(path: Path, sock: Path, max_lease_ms: int, capacity: str) -> None:
    path.write_text(
        "[kvstore]\n"
        f'listen = "unix:{sock}"\n'
        f'host_capacity = "{capacity}"\n'
        f'ssd_path = "{path.parent / "ssd"}"\n'
        'ssd_capacity = "64MiB"\n'
        'ssd_region_size = "1MiB"\n'
        'metrics_listen = "off"\n'
        'log_format = "json"\n'
        "grace_s = 20\n"
        f"max_lease_ms = {max_lease_ms}\n"
    )


def _start(cfg: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--config", str(cfg)],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KVSTORE_TARGET": ""})


@pytest.mark.e2e
def test_sighup_reload_and_sigterm_drain_then_restart(tmp_path, layout):
    """SIGHUP applies a live setting; SIGTERM with puts in flight exits 0; after a
    restart on the same SSD directory every put that returned OK is there."""
    sock, cfg = tmp_path / "kv.sock", tmp_path / "kvstore.toml"
    _write_config(cfg, sock, 1000, "16MiB")
    target = f"unix:{sock}"
    proc = _start(cfg, tmp_path / "daemon.log")
    try:
        _wait_ready(target, proc)

        # SIGHUP: the runtime field changes, the restart-only one is reported and kept.
        _write_config(cfg, sock, 2000, "32MiB")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + DEADLINE_S
        with AdminClient(target) as admin:
            while admin.get_config("max_lease_ms")[0].value != "2000":
                assert time.monotonic() < deadline, "SIGHUP did not apply max_lease_ms"
                time.sleep(0.05)
            assert admin.get_config("host_capacity")[0].value == str(16 << 20)

        # Puts keep arriving from several clients while SIGTERM lands.
        ok: list[list[int]] = []
        refused: list[BaseException] = []
        stop = threading.Event()

        def writer(worker: int) -> None:
            with Client(target, timeout_s=DEADLINE_S) as kv:
                for i in range(10_000):
                    if stop.is_set():
                        return
                    tokens = [worker, i] + [0] * (layout.block_size_tokens * 2 - 2)
                    try:
                        kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(2)])
                    except (Unavailable, Cancelled) as exc:  # arrived after the listeners closed
                        refused.append(exc)
                        return
                    ok.append(tokens)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + DEADLINE_S
        while len(ok) < 6:
            assert time.monotonic() < deadline, "no puts completed"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE_S) == 0
        stop.set()
        for t in threads:
            t.join(DEADLINE_S)
            assert not t.is_alive()
        assert all(isinstance(e, (Unavailable, Cancelled)) for e in refused)
        assert not sock.exists()
        first_run = (tmp_path / "daemon.log").read_text()

        # Restart on the same SSD directory: every put that returned OK is readable.
        proc = _start(cfg, tmp_path / "restart.log")
        _wait_ready(target, proc)
        with Client(target, timeout_s=DEADLINE_S) as kv:
            missing = [tokens[:2] for tokens in ok if kv.lookup(layout, tokens).num_blocks != 2]
            assert not missing, f"{len(missing)} of {len(ok)} acknowledged puts lost: {missing[:5]}"
            assert len(kv.fetch(layout, ok[-1])) == 2  # and they verify on the way out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # gRPC's C core may add its own plain lines on stderr; every Python log line is JSON.
    lines = first_run.splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    messages = [r["msg"] for r in records]
    assert all({"ts", "level", "logger", "msg", "request_id"} <= set(r) for r in records)
    assert any(m.startswith("effective config:") for m in messages)
    assert any("host_capacity changed in the config; restart" in m for m in messages)
    ours = [r["msg"] for r in records if r["logger"].startswith("kvstore")]
    assert any(m.startswith("shutting down") for m in ours) and ours[-1] == "kvstore stopped"
