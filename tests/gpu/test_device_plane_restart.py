"""The device plane (CUDA IPC) across a daemon restart: an engine that keeps its client
while the daemon is killed (-9) or stopped cleanly and started again on the same socket
puts CUDA tensors device to device into the new daemon's HBM slab (its client let go of
the old slab and opened the new one by itself), fetches them byte-exact, sees the old
daemon's blocks as a miss, and another client reads the same bytes from the daemon. The
daemon counts no checksum failure. Skips without CUDA (`make test-gpu` runs it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.layout import KVLayout
from kvstore.tiers.cuda import cuda_available
from tests import procs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]

LAYOUT = KVLayout(model="test/device-restart", dtype="bfloat16", num_layers=2, num_kv_heads=4, head_dim=64,
                  block_size_tokens=16)  # 32 KiB blocks
BLOCK = LAYOUT.bytes_per_block


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[list[procs.DaemonProc]]:
    sock = tmp_path / "kv.sock"
    args = procs.daemon_args(sock, "--host-capacity", "64MiB", "--hbm-capacity", "64MiB", "--put-tier", "hbm",
                             "--shm-dir", str(tmp_path))
    running = [procs.start(args, sock, tmp_path / "daemon.log")]  # the one running now: `restart` replaces it
    yield running
    pid = running[0].pid
    running[0].stop()
    procs.remove_segments(pid)


def restart(running: list[procs.DaemonProc], how: str, tmp_path: Path) -> None:
    proc = running[0]
    if how == "kill-9":
        pid = proc.pid
        proc.kill9()
        for seg in tmp_path.glob(f"kvstore-{pid}-*"):
            seg.unlink()
    else:
        assert proc.stop() == 0
    running[0] = procs.start(list(proc.popen.args), tmp_path / "kv.sock", tmp_path / "daemon.log")  # type: ignore[arg-type]


def _blocks(n: int):  # type: ignore[no-untyped-def]
    import torch

    return [torch.randint(0, 255, (BLOCK,), dtype=torch.uint8, device="cuda:0") for _ in range(n)]


@pytest.mark.parametrize("how", ["kill-9", "term"])
def test_cuda_tensors_across_a_daemon_restart(daemon: list[procs.DaemonProc], tmp_path: Path, how: str) -> None:
    import torch

    target = daemon[0].target
    before, before_hashes = _blocks(8), [os.urandom(16) for _ in range(8)]
    after, after_hashes = _blocks(8), [os.urandom(16) for _ in range(8)]
    out = [torch.empty(BLOCK, dtype=torch.uint8, device="cuda:0") for _ in range(8)]
    with Client(target) as kv:
        assert kv.put(LAYOUT, None, before, block_hashes=before_hashes).stored == 8
        assert kv.device_plane_in_use
        restart(daemon, how, tmp_path)
        # The first call after the restart is a device put: stored in the new slab.
        assert kv.put(LAYOUT, None, after, block_hashes=after_hashes).stored == 8
        assert kv.device_plane_in_use
        hit = kv.lookup(LAYOUT, block_hashes=after_hashes)
        assert hit.num_blocks == 8 and set(hit.tiers) == {"hbm"}
        assert len(kv.fetch(LAYOUT, block_hashes=after_hashes, out=out)) == 8
        for o, b in zip(out, after):
            assert torch.equal(o, b)
        assert kv.fetch(LAYOUT, block_hashes=before_hashes, out=out) == []  # gone with the old daemon
    with Client(target, data_plane="grpc") as other:
        assert other.fetch(LAYOUT, block_hashes=after_hashes) == [b.cpu().numpy().tobytes() for b in after]
        stats = other.stats()
    assert stats.counters.checksum_failures == 0 and all(t.checksum_failures == 0 for t in stats.tiers)
