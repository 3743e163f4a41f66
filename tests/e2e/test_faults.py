"""Faults against the real daemon as a subprocess: what survives and what is never served.

- kill -9 in the middle of concurrent puts: every block the daemon had reported as
  served from SSD before the kill is served byte-exact after a restart; whatever else
  is served is a byte-exact prefix of what was put.
- Damaged SSD records (a torn region tail, flipped payload bytes found at start, in
  the snapshot's records, or under a running daemon): counted, never served.
- A full disk under the SSD tier: puts keep succeeding into host memory, SSD writes
  fail and are counted, the daemon keeps serving, and accounting stays exact.
- A client that vanishes holding leases, pins and a half-read fetch stream: its holds
  end by themselves and the blocks become evictable.
- A changed layout (same model, other dtype / block size) never matches recovered blocks.

The crash test in test_crash_restart.py (kill -9 after a drained queue) and the SIGTERM
durability test in test_ops_lifecycle.py are not repeated here. Nothing asserts on
timing: every wait polls a condition with a generous deadline.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.errors import KVStoreError
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout
from kvstore.tiers.ssd import RECORD, SNAPSHOT_NAME
from tests import procs

pytestmark = pytest.mark.e2e

LAYOUT = KVLayout(model="test/faults", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=128,
                  block_size_tokens=4)  # 8 KiB blocks
BLOCK = LAYOUT.bytes_per_block
DEADLINE_S = 30.0
KEY_IN_HEADER = 16  # magic(4) codec(1) itemsize(1) flags(2) seq(8), then the 32-byte key


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def chain(n: int, salt: int) -> tuple[list[int], list[bytes]]:
    tokens = [salt * 1_000_000 + i for i in range(n * LAYOUT.block_size_tokens)]
    return tokens, [os.urandom(BLOCK) for _ in range(n)]


def ssd_args(tmp_path: Path, *extra: str, host: str = "1MiB", ssd: str = "32MiB") -> list[str]:
    return procs.daemon_args(tmp_path / "kv.sock", "--host-capacity", host, "--ssd-path", str(tmp_path / "ssd"),
                             "--ssd-capacity", ssd, "--ssd-region-size", "512KiB", *extra)


def start(tmp_path: Path, *extra: str, **kw: str) -> procs.DaemonProc:
    return procs.start(ssd_args(tmp_path, *extra, **kw), tmp_path / "kv.sock", tmp_path / "daemon.log")


def tier(kv: Client, name: str):  # type: ignore[no-untyped-def]
    return next(t for t in kv.stats().tiers if t.name == name)


def record_offset(ssd_dir: Path, tokens: list[int], index: int) -> tuple[Path, int]:
    """The region file and offset of the SSD record of block `index` of `tokens`' chain."""
    ns = LAYOUT.namespace_id
    key = ns + block_hashes(ns, tokens, LAYOUT.block_size_tokens)[index]
    for region in sorted(ssd_dir.glob("region-*.kvr")):
        at = region.read_bytes().find(key)
        if at >= 0:
            return region, at - KEY_IN_HEADER
    raise AssertionError(f"block {index} has no record on SSD")


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x5A]))
        fh.flush()
        os.fsync(fh.fileno())


# ----------------------------------------------------------------------------- kill -9


def test_kill_9_mid_puts_serves_every_block_it_reported_on_ssd(tmp_path: Path) -> None:
    """Writers put chains while a watcher records which blocks lookups report as served
    from SSD; kill -9 lands while puts are still running."""
    proc = start(tmp_path, ssd="96MiB")
    # 37.5 MiB (57 MiB as SSD records): far over the 1 MiB host tier, under the SSD tier,
    # and more than the writers get through before the watcher has seen enough.
    chains = [chain(8, s) for s in range(600)]
    completed: list[int] = []  # chains whose every put returned OK
    on_ssd: set[tuple[int, int]] = set()  # (chain, block) reported in tier "ssd"
    stop = threading.Event()
    lock = threading.Lock()

    def writer(part: list[int]) -> None:
        try:
            with Client(proc.target, timeout_s=5, data_plane="grpc") as kv:
                for c in part:
                    tokens, blocks = chains[c]
                    for i in range(0, len(blocks), 2):
                        if stop.is_set():
                            return
                        kv.put(LAYOUT, tokens, blocks[i : i + 2], first_block=i)
                    with lock:
                        completed.append(c)
        except KVStoreError:
            pass  # the daemon died under us: expected

    def watcher() -> None:
        try:
            with Client(proc.target, timeout_s=5, data_plane="grpc") as kv:
                while not stop.is_set():
                    with lock:
                        seen = list(completed)
                    for c in seen:
                        hit = kv.lookup(LAYOUT, chains[c][0])
                        for i, name in enumerate(hit.tiers):
                            if name == "ssd":
                                with lock:
                                    on_ssd.add((c, i))
        except KVStoreError:
            pass

    threads = [threading.Thread(target=writer, args=(list(range(w, len(chains), 4)),)) for w in range(4)]
    threads.append(threading.Thread(target=watcher))
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(on_ssd) >= 64, "blocks reported on SSD")
        with lock:
            reported = set(on_ssd)
        proc.kill9()
    finally:
        stop.set()
        for t in threads:
            t.join(DEADLINE_S)
        if proc.alive():
            proc.kill9()
        procs.remove_segments(proc.pid)

    proc = start(tmp_path, ssd="96MiB")
    try:
        with Client(proc.target, data_plane="grpc") as kv:
            # Block by block (by hash): a demotion may have put a chain's later block on
            # SSD while an earlier one still waited in the write-through queue.
            for c, i in sorted(reported):
                tokens, blocks = chains[c]
                h = block_hashes(LAYOUT.namespace_id, tokens, LAYOUT.block_size_tokens)[i]
                assert kv.fetch(LAYOUT, block_hashes=[h]) == [blocks[i]], f"chain {c} block {i} was on SSD"
            # Whatever else is served is exact. (A record the kill cut short fails its
            # checksum at the scan and is counted: it is not served.)
            for tokens, blocks in chains:
                got = kv.fetch(LAYOUT, tokens)
                assert got == blocks[: len(got)]
    finally:
        assert proc.stop() == 0


# ----------------------------------------------------------------------------- damaged records


def put_and_stop(tmp_path: Path, n_chains: int, per: int) -> list[tuple[list[int], list[bytes]]]:
    """Put chains, let them reach SSD, stop gracefully (which writes the snapshot)."""
    proc = start(tmp_path, host="4MiB")
    chains = [chain(per, s) for s in range(n_chains)]
    try:
        with Client(proc.target, data_plane="grpc") as kv:
            for tokens, blocks in chains:
                kv.put(LAYOUT, tokens, blocks)
            wait_for(lambda: tier(kv, "ssd").pending_writes == 0, "the SSD queue to drain")
            assert tier(kv, "ssd").blocks == n_chains * per
    finally:
        assert proc.stop() == 0
    assert (tmp_path / "ssd" / SNAPSHOT_NAME).exists()
    return chains


def test_torn_tail_and_damaged_header_are_counted_and_never_served(tmp_path: Path) -> None:
    chains = put_and_stop(tmp_path, 4, 6)
    (tmp_path / "ssd" / SNAPSHOT_NAME).unlink()  # as after a crash: the log is scanned
    # The last block of the last chain is the last record written: cut it in half.
    tokens, blocks = chains[-1]
    region, at = record_offset(tmp_path / "ssd", tokens, len(blocks) - 1)
    assert region.stat().st_size > at + RECORD.size + BLOCK // 2
    with open(region, "r+b") as fh:
        fh.truncate(at + RECORD.size + BLOCK // 2)
    # And a damaged header in the middle of chain 0: the scan skips to the next record.
    h_region, h_at = record_offset(tmp_path / "ssd", chains[0][0], 2)
    flip(h_region, h_at + 30)

    proc = start(tmp_path, host="4MiB")
    try:
        with Client(proc.target, data_plane="grpc") as kv:
            assert tier(kv, "ssd").checksum_failures == 2
            assert kv.lookup(LAYOUT, tokens).num_blocks == len(blocks) - 1
            assert kv.fetch(LAYOUT, tokens) == blocks[:-1]
            assert kv.fetch(LAYOUT, chains[0][0]) == chains[0][1][:2]
            hashes = block_hashes(LAYOUT.namespace_id, chains[0][0], LAYOUT.block_size_tokens)
            assert kv.fetch(LAYOUT, block_hashes=hashes[3:]) == chains[0][1][3:]
            for t, b in chains[1:-1]:
                assert kv.fetch(LAYOUT, t) == b
            # The same tokens under a changed layout never match the recovered blocks.
            for other in (replace(LAYOUT, dtype="float16"), replace(LAYOUT, block_size_tokens=8),
                          replace(LAYOUT, num_kv_heads=1, head_dim=256)):
                assert kv.lookup(other, chains[0][0]).num_blocks == 0
                assert kv.fetch(other, chains[0][0]) == []
    finally:
        assert proc.stop() == 0


def test_damage_behind_a_snapshot_is_caught_on_read(tmp_path: Path) -> None:
    """After a clean stop the next start trusts the snapshot (no scan), so damage done in
    between is found by the checksum on the first read: that fetch ends before the block,
    the copy is dropped and counted, and the next lookup no longer promises it."""
    chains = put_and_stop(tmp_path, 3, 6)
    tokens, blocks = chains[1]
    region, at = record_offset(tmp_path / "ssd", tokens, 3)
    flip(region, at + RECORD.size + 200)

    proc = start(tmp_path, host="4MiB")
    try:
        with Client(proc.target, data_plane="grpc") as kv:
            assert tier(kv, "ssd").checksum_failures == 0  # the snapshot was used: nothing scanned
            assert kv.fetch(LAYOUT, tokens) == blocks[:3]
            assert tier(kv, "ssd").checksum_failures == 1
            assert kv.lookup(LAYOUT, tokens).num_blocks == 3
            assert kv.fetch(LAYOUT, chains[0][0]) == chains[0][1]
    finally:
        assert proc.stop() == 0


def test_damage_under_a_running_daemon_is_never_served(tmp_path: Path) -> None:
    proc = start(tmp_path, "--no-promote-on-hit", host="1MiB")
    try:
        with Client(proc.target, data_plane="grpc") as kv:
            chains = [chain(8, s) for s in range(24)]  # 1.5 MiB: over the host tier
            for tokens, blocks in chains:
                kv.put(LAYOUT, tokens, blocks)
            wait_for(lambda: tier(kv, "ssd").pending_writes == 0, "the SSD queue to drain")
            with AdminClient(proc.target) as admin:
                admin.evict("host", 1 << 30)  # every block is on SSD: this leaves it there only
            tokens, blocks = chains[0]
            assert kv.lookup(LAYOUT, tokens).tiers == ["ssd"] * len(blocks)
            for i, where in ((2, RECORD.size + 100), (5, 20)):  # a payload byte; a header byte
                region, at = record_offset(tmp_path / "ssd", tokens, i)
                flip(region, at + where)
            # The stream ends before the first damaged copy, which is counted and dropped.
            # The second one is found by a read started ahead of the stream, if that read
            # ran before the stream ended, or else by the next fetch that reaches it: either
            # way each is counted once and never served.
            assert kv.fetch(LAYOUT, tokens) == blocks[:2]
            assert tier(kv, "ssd").checksum_failures in (1, 2)
            assert kv.lookup(LAYOUT, tokens).num_blocks == 2  # dropped, not promised again
            hashes = block_hashes(LAYOUT.namespace_id, tokens, LAYOUT.block_size_tokens)
            assert kv.fetch(LAYOUT, block_hashes=hashes[3:]) == blocks[3:5]
            assert tier(kv, "ssd").checksum_failures == 2
            assert kv.stats().counters.checksum_failures == 2
            assert kv.fetch(LAYOUT, block_hashes=hashes[3:]) == blocks[3:5]  # not found again
            assert kv.fetch(LAYOUT, block_hashes=hashes[6:]) == blocks[6:]
            assert tier(kv, "ssd").checksum_failures == 2
            for t, b in chains[1:]:
                got = kv.fetch(LAYOUT, t)
                assert got == b[: len(got)] and len(got) == len(b)
    finally:
        assert proc.stop() == 0


# ----------------------------------------------------------------------------- disk full


def _unshare_works() -> str:
    if not shutil.which("unshare"):
        return "unshare is not installed"
    try:
        r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt && umount /mnt"],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if r.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace: {r.stderr.decode().strip()}"
    return ""


def test_disk_full_under_the_ssd_tier(tmp_path: Path) -> None:
    """A 6 MiB tmpfs holds the SSD tier (4 MiB); once the daemon runs, a filler file takes
    the rest of the filesystem. Write-through then fails with ENOSPC: the puts still
    succeed into host memory, the failures are counted, the daemon keeps serving, and
    when the host tier overflows its victims are dropped instead of failing the put."""
    why = _unshare_works()
    if why:
        pytest.skip(why)
    mnt = tmp_path / "small"
    mnt.mkdir()
    sock, pid_file = tmp_path / "kv.sock", tmp_path / "daemon.pid"
    fill, filled, unfill, unfilled = (tmp_path / n for n in ("fill", "filled", "unfill", "unfilled"))
    args = procs.daemon_args(sock, "--host-capacity", "1MiB", "--ssd-path", str(mnt / "ssd"),
                             "--ssd-capacity", "4MiB", "--ssd-region-size", "512KiB", "--ssd-io", "buffered")
    # The mount exists only in the namespace; the script waits for the test's signal files
    # to fill the filesystem (and to empty it again), so every step is in the test's order.
    script = textwrap.dedent(f"""
        set -e
        mount -t tmpfs -o size=6m tmpfs {mnt}
        "$@" &
        echo $! > {pid_file}
        while [ ! -e {fill} ]; do kill -0 $! 2>/dev/null || exit 1; sleep 0.05; done
        dd if=/dev/zero of={mnt}/filler bs=64k 2>/dev/null || true
        touch {filled}
        while [ ! -e {unfill} ]; do kill -0 $! 2>/dev/null || exit 1; sleep 0.05; done
        rm -f {mnt}/filler
        touch {unfilled}
        wait $!
    """)
    proc = procs.start(["unshare", "-rm", "sh", "-c", script, "sh", *args], sock, tmp_path / "daemon.log", pid_file)
    try:
        with Client(proc.target, data_plane="grpc") as kv:
            before = [chain(4, s) for s in range(4)]
            for tokens, blocks in before:
                kv.put(LAYOUT, tokens, blocks)
            wait_for(lambda: tier(kv, "ssd").pending_writes == 0, "the SSD queue to drain")
            assert tier(kv, "ssd").blocks == 16

            fill.touch()
            wait_for(filled.exists, "the filesystem to fill")
            during = [chain(4, 100 + s) for s in range(6)]
            for tokens, blocks in during:
                assert kv.put(LAYOUT, tokens, blocks).stored == len(blocks)  # lands in host
            wait_for(lambda: tier(kv, "ssd").pending_writes == 0, "the SSD queue to settle")
            assert kv.stats().counters.ssd_write_failures > 0
            for tokens, blocks in before + during:
                assert kv.fetch(LAYOUT, tokens) == blocks  # still in host or on SSD

            # Twice the host tier's capacity: demotions to the full SSD fail, so victims
            # are dropped (a miss later), never a failed put or a crash.
            flood = [chain(8, 200 + s) for s in range(32)]
            for tokens, blocks in flood:
                assert kv.put(LAYOUT, tokens, blocks).stored == len(blocks)
            wait_for(lambda: tier(kv, "ssd").pending_writes == 0, "the SSD queue to settle")
            for tokens, blocks in before + during + flood:
                got = kv.fetch(LAYOUT, tokens)
                assert got == blocks[: len(got)]
            for tokens, blocks in before:
                assert kv.fetch(LAYOUT, tokens) == blocks  # on SSD from before the disk filled
            stats = kv.stats()
            host, ssd = (tier(kv, n) for n in ("host", "ssd"))
            assert host.used_bytes <= host.capacity_bytes and ssd.used_bytes <= ssd.capacity_bytes
            assert stats.counters.checksum_failures == 0

            # Room again: new puts reach SSD.
            failures = kv.stats().counters.ssd_write_failures
            unfill.touch()
            wait_for(unfilled.exists, "the filesystem to empty")
            after = [chain(4, 300 + s) for s in range(2)]
            for tokens, blocks in after:
                kv.put(LAYOUT, tokens, blocks)
            wait_for(lambda: tier(kv, "ssd").pending_writes == 0, "the SSD queue to drain")
            assert kv.stats().counters.ssd_write_failures == failures
            for tokens, blocks in after:
                assert kv.fetch(LAYOUT, tokens) == blocks

            # Accounting: every block the index lists is held by a tier and served whole.
            with AdminClient(proc.target) as admin:
                (ns,) = admin.list_namespaces()
                listed = [b.hash for b in admin.list_blocks(ns.namespace_id)]
                assert ns.blocks == len(listed) > 0
                got = admin.fetch_blocks(ns.namespace_id, listed)
                assert len(got) == len(listed) and all(len(b) == BLOCK for b in got)
            host, ssd = (tier(kv, n) for n in ("host", "ssd"))
            assert max(host.blocks, ssd.blocks) <= ns.blocks <= host.blocks + ssd.blocks

            # No bytes leaked by the failed writes: once the migrator is idle, each tier's
            # used bytes are its blocks times their accounted size (raw records on SSD:
            # random bytes do not compress; buffered I/O aligns records to 512 bytes).
            record = -(-(RECORD.size + BLOCK) // 512) * 512

            def balanced() -> bool:
                h, s = tier(kv, "host"), tier(kv, "ssd")
                return h.used_bytes == h.blocks * BLOCK and s.used_bytes == s.blocks * record

            wait_for(balanced, "host and SSD accounting to balance")
    finally:
        for f in (fill, unfill):
            f.touch()
        proc.stop()
        procs.remove_segments(proc.pid)


# ----------------------------------------------------------------------------- vanished client


VANISHING_CLIENT = """
import os, sys, threading
from kvstore.client import Client
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2
from kvstore.client._requests import block_keys, namespace_ref, prepare_put, put_requests

target, plane = sys.argv[1], sys.argv[2]
layout = KVLayout(model="test/faults", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=128,
                  block_size_tokens=4)
tokens = list(range(8 * 4))
kv = Client(target, data_plane=plane)
hit = kv.lookup(layout, tokens, lease_ms=60_000)
assert hit.num_blocks == 8, hit
pin = kv.pin(layout, tokens, ttl_ms=60_000)
assert pin.pinned == 8, pin
if plane == "local":
    kv.fetch(layout, tokens)  # its lease ends only with the next local call, which never comes
else:
    stream = kv._fetch(kvstore_pb2.FetchRequest(namespace=namespace_ref(layout), keys=block_keys(tokens, None)))
    next(stream)  # the first chunk only: the stream stays open on the daemon
# A put stream that stops after a few chunks of its first block: PENDING slots on the daemon.
prepared = prepare_put(layout, list(range(5000, 5000 + 4 * 4)), None, [os.urandom(8192)] * 4, 0)
sent = threading.Event()
def requests():
    for n, msg in enumerate(put_requests(prepared, 2048)):
        if n == 3:
            sent.set()
            threading.Event().wait()
        yield msg
threading.Thread(target=lambda: kv._put(requests()), daemon=True).start()
sent.wait()
print("holding", flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.parametrize("plane", ["grpc", "local"])
def test_a_vanished_client_releases_its_leases_and_pins(tmp_path: Path, plane: str) -> None:
    """A client killed while holding a lookup lease, a pin, a fetch (an open gRPC stream,
    or a shared-memory fetch lease) and a half-sent put: everything it held ends."""
    proc = procs.start(procs.daemon_args(tmp_path / "kv.sock", "--host-capacity", "1MiB", "--max-lease-ms", "1500",
                                         "--chunk-bytes", "4096"),
                       tmp_path / "kv.sock", tmp_path / "daemon.log")
    client: subprocess.Popen[bytes] | None = None
    try:
        with Client(proc.target, data_plane="grpc") as kv:
            tokens = list(range(8 * 4))
            blocks = [os.urandom(BLOCK) for _ in range(8)]
            kv.put(LAYOUT, tokens, blocks)
            client = subprocess.Popen([sys.executable, "-c", VANISHING_CLIENT, proc.target, plane],
                                      env=procs.clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert client.stdout is not None
            assert client.stdout.readline() == b"holding\n", "the client did not take its holds"
            assert kv.stats().counters.leases_active >= 2
            wait_for(lambda: tier(kv, "host").used_bytes > 8 * BLOCK, "the half-sent put to reserve its slots")
            with AdminClient(proc.target) as admin:
                # While held, nothing of the chain can be evicted.
                assert admin.evict("host", 1 << 30).blocks == 0
                assert kv.lookup(LAYOUT, tokens).num_blocks == 8
                client.send_signal(signal.SIGKILL)
                client.wait(DEADLINE_S)
                wait_for(lambda: kv.stats().counters.leases_active == 0, "the vanished client's leases to expire")
                wait_for(lambda: admin.evict("host", 1 << 30).blocks > 0 or tier(kv, "host").blocks == 0,
                         "the chain to become evictable")
            assert kv.lookup(LAYOUT, tokens).num_blocks == 0
            assert kv.lookup(LAYOUT, list(range(5000, 5000 + 4 * 4))).num_blocks == 0  # the cut-off put
            host = tier(kv, "host")
            assert host.blocks == 0 and host.used_bytes == 0  # its PENDING slots were freed too
            assert kv.stats().counters.put_failures >= 1
    finally:
        if client is not None:
            if client.poll() is None:
                client.kill()
                client.wait()
            for pipe in (client.stdin, client.stdout):
                if pipe is not None:
                    pipe.close()
        assert proc.stop() == 0
