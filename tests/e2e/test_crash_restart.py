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


def put_and_drain(target: str, chains: list[tuple[list[int], list[bytes]]]) -> None:
    with Client(target) as kv:
        for tokens, blocks in chains:
            kv.put(LAYOUT, tokens, blocks)
        deadline = time.monotonic() + 20
        while ssd_pending(kv) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ssd_pending(kv) == 0, "the SSD write queue did not drain"


def kill_9_during_puts(proc: procs.DaemonProc, inflight: list[tuple[list[int], list[bytes]]]) -> None:
    """Put `inflight` from four clients, two blocks a call, and kill -9 the daemon midway."""
    started = threading.Event()

    def writer(part: list[tuple[list[int], list[bytes]]]) -> None:
        try:
            with Client(proc.target, timeout_s=5) as kv:
                for tokens, blocks in part:
                    for i in range(0, len(blocks), 2):
                        kv.put(LAYOUT, tokens, blocks[i : i + 2], first_block=i)
                        started.set()
        except KVStoreError:
            pass  # the daemon was killed under us: expected

    threads = [threading.Thread(target=writer, args=(inflight[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        assert started.wait(20)
        time.sleep(0.2)
    finally:
        proc.kill9()
        for t in threads:
            t.join(30)
        procs.remove_segments(proc.pid)


def assert_served(target: str, durable: list[tuple[list[int], list[bytes]]],
                  inflight: list[tuple[list[int], list[bytes]]]) -> None:
    with Client(target) as kv:
        for tokens, blocks in durable:
            assert kv.lookup(LAYOUT, tokens).num_blocks == len(blocks)
            assert kv.fetch(LAYOUT, tokens) == blocks
        for tokens, blocks in inflight:
            got = kv.fetch(LAYOUT, tokens)
            assert got == blocks[: len(got)]


def test_kill_9_during_puts_then_restart_serves_what_reached_ssd(tmp_path: Path) -> None:
    proc = start_daemon(tmp_path)
    try:
        durable = [chain(12, s) for s in range(8)]
        put_and_drain(proc.target, durable)
        inflight = [chain(8, 100 + s) for s in range(40)]
        kill_9_during_puts(proc, inflight)
    finally:
        if proc.alive():
            proc.kill9()
        procs.remove_segments(proc.pid)

    proc = start_daemon(tmp_path)
    try:
        assert_served(proc.target, durable, inflight)
    finally:
        proc.stop()


def test_a_second_kill_9_during_puts_into_the_reopened_region_loses_nothing_that_reached_ssd(
        tmp_path: Path) -> None:
    """A restart appends to the region it was filling, torn records of the first crash
    included; a second crash in the middle of those appends is sorted out by the scan."""
    durable: list[tuple[list[int], list[bytes]]] = []
    inflight: list[tuple[list[int], list[bytes]]] = []
    for round_ in range(2):
        proc = start_daemon(tmp_path)
        try:
            assert_served(proc.target, durable, inflight)
            more = [chain(12, 1000 * round_ + s) for s in range(4)]
            put_and_drain(proc.target, more)
            durable += more
            cut = [chain(8, 1000 * round_ + 100 + s) for s in range(20)]
            kill_9_during_puts(proc, cut)
            inflight += cut
        finally:
            if proc.alive():
                proc.kill9()
            procs.remove_segments(proc.pid)
    proc = start_daemon(tmp_path)
    try:
        assert_served(proc.target, durable, inflight)
    finally:
        proc.stop()
