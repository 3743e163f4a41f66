"""kill -9 in the middle of concurrent puts, then a restart on the same --ssd-path.

Every block that had reached the SSD tier before the kill (everything put before the
write queue drained) must be served byte-exact after the restart; of the puts cut off
by the kill, whatever is served must be a byte-exact prefix of what was sent, and
nothing half-written is ever returned.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.layout import KVLayout
from tests import procs

pytestmark = pytest.mark.e2e

LAYOUT = KVLayout(model="test/crash", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=128,
                  block_size_tokens=4)  # 8 KiB blocks


def start_daemon(tmp_path: Path) -> procs.DaemonProc:
    sock = tmp_path / "kv.sock"
    args = procs.daemon_args(sock, "--host-capacity", "1MiB", "--ssd-path", str(tmp_path / "ssd"),
                             "--ssd-capacity", "16MiB", "--ssd-region-size", "512KiB")
    return procs.start(args, sock, tmp_path / "daemon.log")


def chain(n: int, salt: int) -> tuple[list[int], list[bytes]]:
    tokens = [salt * 1_000_000 + i for i in range(n * LAYOUT.block_size_tokens)]
    return tokens, [os.urandom(LAYOUT.bytes_per_block) for _ in range(n)]


def ssd_pending(kv: Client) -> int:
    return next(t.pending_writes for t in kv.stats().tiers if t.name == "ssd")


def test_kill_9_during_puts_then_restart_serves_what_reached_ssd(tmp_path: Path) -> None:
    proc = start_daemon(tmp_path)
    target = proc.target
    try:
        durable = [chain(12, s) for s in range(8)]
        with Client(target) as kv:
            for tokens, blocks in durable:
                kv.put(LAYOUT, tokens, blocks)
            deadline = time.monotonic() + 20
            while ssd_pending(kv) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert ssd_pending(kv) == 0, "the SSD write queue did not drain"

        inflight = [chain(8, 100 + s) for s in range(40)]
        started = threading.Event()

        def writer(part: list[tuple[list[int], list[bytes]]]) -> None:
            try:
                with Client(target, timeout_s=5) as kv:
                    for tokens, blocks in part:
                        for i in range(0, len(blocks), 2):
                            kv.put(LAYOUT, tokens, blocks[i : i + 2], first_block=i)
                            started.set()
            except KVStoreError:
                pass  # the daemon was killed under us: expected

        threads = [threading.Thread(target=writer, args=(inflight[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        assert started.wait(20)
        time.sleep(0.2)
        proc.kill9()
        for t in threads:
            t.join(30)
    finally:
        if proc.alive():
            proc.kill9()
        procs.remove_segments(proc.pid)

    proc = start_daemon(tmp_path)
    target = proc.target
    try:
        with Client(target) as kv:
            for tokens, blocks in durable:
                assert kv.lookup(LAYOUT, tokens).num_blocks == len(blocks)
                assert kv.fetch(LAYOUT, tokens) == blocks
            for tokens, blocks in inflight:
                got = kv.fetch(LAYOUT, tokens)
                assert got == blocks[: len(got)]
    finally:
        proc.stop()
