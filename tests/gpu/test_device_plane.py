"""The device data plane (CUDA IPC): HBM-tier blocks opened by an engine process and
copied device-to-device, verified after every copy, under the local plane's lease rules.

The `gpu` tests run a real two-process exchange: the daemon is `python server.py` with an
HBM tier, the test process is the engine (CUDA opens an IPC handle only in another
process). They skip without CUDA (`make test-gpu` runs them). The first tests need no
GPU: what a daemon without an HBM tier answers, and the client's refusals.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.client import Client
from kvstore.layout import GroupKind, KVGroup, KVLayout
from kvstore.tiers.cuda import cuda_available
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(model="test/device", dtype="bfloat16", num_layers=2, num_kv_heads=4, head_dim=64,
                  block_size_tokens=16)  # 32 KiB blocks
BLOCK = LAYOUT.bytes_per_block


# --------------------------------------------------------------- without a GPU


def _ns() -> kvstore_pb2.Namespace:
    return kvstore_pb2.Namespace(layout=kvstore_pb2.Layout(
        model=LAYOUT.model, dtype=LAYOUT.dtype, num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
        head_dim=LAYOUT.head_dim, block_size_tokens=LAYOUT.block_size_tokens))


def test_daemon_without_hbm_tier_refuses_the_device_rpcs_and_stores_nothing(daemon_thread) -> None:
    hashes = [os.urandom(16) for _ in range(3)]
    keys = kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=hashes))
    with grpc.insecure_channel(daemon_thread.unix_target) as ch:
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        calls = [
            lambda: stub.DeviceSegment(kvstore_pb2.DeviceSegmentRequest(), timeout=5),
            lambda: stub.DeviceFetch(kvstore_pb2.LocalFetchRequest(namespace=_ns(), keys=keys), timeout=5),
            lambda: stub.DevicePut(kvstore_pb2.LocalPutRequest(
                header=kvstore_pb2.PutHeader(namespace=_ns(), keys=keys, num_blocks=3)), timeout=5),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "no HBM tier" in (info.value.details() or "")
    with Client(daemon_thread.unix_target) as kv:
        assert kv.lookup(LAYOUT, block_hashes=hashes).num_blocks == 0


def test_cpu_tensors_still_take_the_shared_memory_plane(daemon_thread) -> None:
    torch = pytest.importorskip("torch")
    blocks = [torch.randint(0, 255, (BLOCK,), dtype=torch.uint8) for _ in range(4)]
    hashes = [os.urandom(16) for _ in blocks]
    out = [torch.empty(BLOCK, dtype=torch.uint8) for _ in blocks]
    with Client(daemon_thread.unix_target) as kv:
        kv.put(LAYOUT, None, blocks, block_hashes=hashes)
        got = kv.fetch(LAYOUT, block_hashes=hashes, out=out)
        assert len(got) == 4 and all(torch.equal(o, b) for o, b in zip(out, blocks))
        assert kv.data_plane_in_use == "local"
        assert not kv.device_plane_in_use  # no CUDA tensor was passed: never tried


def test_device_plane_refuses_another_daemons_answer_and_its_own_process() -> None:
    pytest.importorskip("torch")
    from kvstore.client._device import DevicePlane

    other = kvstore_pb2.DeviceSegmentResponse(token=b"b" * 16, pid=os.getpid() + 1)
    with pytest.raises(ValueError, match="another daemon"):
        DevicePlane.attach(other, b"a" * 16)
    same_process = kvstore_pb2.DeviceSegmentResponse(token=b"a" * 16, pid=os.getpid())
    with pytest.raises(ValueError, match="this process"):
        DevicePlane.attach(same_process, b"a" * 16)


# --------------------------------------------------------------- with a GPU


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def hbm_daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """`python server.py` with a 64 MiB HBM tier; puts land where the test's marker says."""
    put_tier = getattr(request, "param", "hbm")
    sock = tmp_path / "kv.sock"
    log = tmp_path / "daemon.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "server.py"), "--listen", f"unix:{sock}", "--host-capacity", "64MiB",
             "--hbm-capacity", "64MiB", "--put-tier", put_tier, "--grace-s", "1", "--metrics-listen", "off",
             "--shm-dir", str(tmp_path)],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
    target = f"unix:{sock}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with Client(target, timeout_s=2) as kv:
                kv.stats()
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                pytest.fail(f"daemon did not start: {log.read_text()}")
            time.sleep(0.2)
    yield target
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _stub(target: str) -> tuple[grpc.Channel, kvstore_pb2_grpc.KVStoreStub]:
    ch = grpc.insecure_channel(target)
    return ch, kvstore_pb2_grpc.KVStoreStub(ch)


def _blocks(n: int):  # type: ignore[no-untyped-def]
    import torch

    return [torch.randint(0, 255, (BLOCK,), dtype=torch.uint8, device="cuda:0") for _ in range(n)]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_put_and_fetch_cuda_tensors_device_to_device(hbm_daemon: str) -> None:
    import torch

    blocks = _blocks(32)
    hashes = [os.urandom(16) for _ in blocks]
    # Another dtype on the engine side: blocks are bytes, the view is the engine's.
    out = [torch.empty(BLOCK // 2, dtype=torch.bfloat16, device="cuda:0") for _ in blocks]
    with Client(hbm_daemon) as kv:
        res = kv.put(LAYOUT, None, blocks, block_hashes=hashes)
        assert res.stored == 32
        assert kv.device_plane_in_use
        hit = kv.lookup(LAYOUT, block_hashes=hashes)
        assert hit.num_blocks == 32 and set(hit.tiers) == {"hbm"}
        got = kv.fetch(LAYOUT, block_hashes=hashes, out=out)
        assert len(got) == 32
        for o, b in zip(out, blocks):
            assert torch.equal(o.view(torch.uint8), b)
    # What the device plane stored is what the gRPC plane serves (the daemon verifies it).
    with Client(hbm_daemon, data_plane="grpc") as other:
        assert other.fetch(LAYOUT, block_hashes=hashes[:2]) == [b.cpu().numpy().tobytes() for b in blocks[:2]]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hbm_daemon", ["host"], indirect=True)
def test_blocks_outside_hbm_reach_cuda_tensors_through_host_memory(hbm_daemon: str) -> None:
    import numpy as np
    import torch

    src = [np.random.randint(0, 255, BLOCK, dtype=np.uint8) for _ in range(8)]
    hashes = [os.urandom(16) for _ in src]
    out = [torch.empty(BLOCK, dtype=torch.uint8, device="cuda:0") for _ in src]
    with Client(hbm_daemon) as kv:
        kv.put(LAYOUT, None, src, block_hashes=hashes)  # lands in the host tier
        assert kv.lookup(LAYOUT, block_hashes=hashes).tiers == ["host"] * 8
        got = kv.fetch(LAYOUT, block_hashes=hashes, out=out)
        assert len(got) == 8
        for o, s in zip(out, src):
            assert np.array_equal(o.cpu().numpy(), s)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_a_corrupted_device_block_is_never_returned_and_gets_dropped(hbm_daemon: str) -> None:
    import torch

    from kvstore.client._device import DevicePlane

    blocks = _blocks(4)
    hashes = [os.urandom(16) for _ in blocks]
    out = [torch.empty(BLOCK, dtype=torch.uint8, device="cuda:0") for _ in blocks]
    ch, stub = _stub(hbm_daemon)
    with ch, Client(hbm_daemon) as kv:
        kv.put(LAYOUT, None, blocks, block_hashes=hashes)
        # A second opener of the slab (as a faulty engine could be) flips block 2's bytes.
        token = stub.LocalSegment(kvstore_pb2.LocalSegmentRequest(), timeout=5).token
        plane = DevicePlane.attach(stub.DeviceSegment(kvstore_pb2.DeviceSegmentRequest(), timeout=5), token)
        keys = kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=hashes))
        leased = stub.DeviceFetch(kvstore_pb2.LocalFetchRequest(namespace=_ns(), keys=keys), timeout=5)
        off = leased.offsets[2]
        plane.slab[off : off + BLOCK].bitwise_not_()
        torch.cuda.synchronize()
        stub.Unpin(kvstore_pb2.UnpinRequest(lease_id=leased.lease_id), timeout=5)
        got = kv.fetch(LAYOUT, block_hashes=hashes, out=out)
        assert len(got) == 2  # the prefix before the bad block, verified
        assert all(torch.equal(o, b) for o, b in zip(out[:2], blocks[:2]))
        # The client asked the daemon to Verify: it found the bad block itself and dropped it.
        assert kv.lookup(LAYOUT, block_hashes=hashes).num_blocks == 2
        plane.close()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_a_leased_device_slot_is_not_reused_after_its_block_is_deleted(hbm_daemon: str) -> None:
    blocks = _blocks(8)
    hashes = [os.urandom(16) for _ in blocks]
    ch, stub = _stub(hbm_daemon)
    with ch, Client(hbm_daemon) as kv:
        kv.put(LAYOUT, None, blocks, block_hashes=hashes)
        keys = kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=hashes))
        leased = stub.DeviceFetch(kvstore_pb2.LocalFetchRequest(namespace=_ns(), keys=keys, lease_ms=60_000),
                                  timeout=5)
        assert len(leased.offsets) == 8
        assert kv.delete(LAYOUT, block_hashes=hashes) == 8
        # Freed slots would be the allocator's first choice: none may be a leased one.
        new_offsets: set[int] = set()
        for _ in range(4):
            new_hashes = [os.urandom(16) for _ in range(32)]
            header = kvstore_pb2.PutHeader(namespace=_ns(), num_blocks=32, keys=kvstore_pb2.BlockKeys(
                hashes=kvstore_pb2.BlockHashes(hashes=new_hashes)))
            begun = stub.DevicePut(kvstore_pb2.LocalPutRequest(header=header), timeout=10)
            new_offsets.update(begun.offsets)
            stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True), timeout=5)
        assert not new_offsets & set(leased.offsets)
        assert stub.Unpin(kvstore_pb2.UnpinRequest(lease_id=leased.lease_id), timeout=5).released


# --------------------------------------------------------------- KV groups

GROUPED = KVLayout(model="test/device-groups", dtype="bfloat16", num_layers=3, num_kv_heads=4, head_dim=64,
                   block_size_tokens=16, groups=(
                       KVGroup("full", GroupKind.FULL, "bfloat16", (2, 1, 16, 4, 64)),
                       KVGroup("swa", GroupKind.SLIDING_WINDOW, "bfloat16", (2, 2, 16, 4, 64), window_tokens=33),
                       KVGroup("ssm", GroupKind.STATE, "float32", (1000,)),
                   ))


def _grouped_blocks(n: int):  # type: ignore[no-untyped-def]
    import torch

    return [{g.name: torch.randint(0, 255, (g.bytes_per_block,), dtype=torch.uint8, device="cuda:0")
             for g in GROUPED.groups} for _ in range(n)]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_grouped_parts_go_device_to_device_and_match_every_other_plane(hbm_daemon: str) -> None:
    import torch

    from kvstore.groups import part_order

    n = 6
    blocks = _grouped_blocks(n)
    hashes = [os.urandom(16) for _ in range(n)]
    out = [{g.name: torch.zeros(g.bytes_per_block, dtype=torch.uint8, device="cuda:0") for g in GROUPED.groups}
           for _ in range(n)]
    with Client(hbm_daemon) as kv:
        assert kv.put(GROUPED, None, blocks, block_hashes=hashes).stored == n
        assert kv.device_plane_in_use
        assert set(kv.lookup(GROUPED, block_hashes=hashes).tiers) == {"hbm"}
        assert kv.fetch(GROUPED, block_hashes=hashes, out=out) == out
        for g, j in part_order(GROUPED, n):
            name = GROUPED.groups[g].name
            assert torch.equal(out[j][name], blocks[j][name])
    want = [{GROUPED.groups[g].name: blocks[j][GROUPED.groups[g].name].cpu().numpy().tobytes()}
            for g, j in part_order(GROUPED, n)]
    for plane in ("grpc", "local"):
        with Client(hbm_daemon, data_plane=plane) as other:
            got = other.fetch(GROUPED, block_hashes=hashes)
            flat = [{GROUPED.groups[g].name: bytes(got[j][GROUPED.groups[g].name])} for g, j in part_order(GROUPED, n)]
            assert flat == want


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_a_corrupted_grouped_part_on_the_device_is_a_miss(hbm_daemon: str) -> None:
    import torch

    from kvstore.client._device import DevicePlane
    from kvstore.convert import layout_to_proto

    n = 4
    blocks = _grouped_blocks(n)
    hashes = [os.urandom(16) for _ in range(n)]
    out = [{g.name: torch.zeros(g.bytes_per_block, dtype=torch.uint8, device="cuda:0") for g in GROUPED.groups}
           for _ in range(n)]
    ch, stub = _stub(hbm_daemon)
    with ch, Client(hbm_daemon) as kv:
        kv.put(GROUPED, None, blocks, block_hashes=hashes)
        token = stub.LocalSegment(kvstore_pb2.LocalSegmentRequest(), timeout=5).token
        plane = DevicePlane.attach(stub.DeviceSegment(kvstore_pb2.DeviceSegmentRequest(), timeout=5), token)
        keys = kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=hashes))
        ns = kvstore_pb2.Namespace(layout=layout_to_proto(GROUPED))
        leased = stub.DeviceFetch(kvstore_pb2.LocalFetchRequest(namespace=ns, keys=keys), timeout=5)
        off = leased.offsets[1]  # the second part of the full group: block 1's
        plane.slab[off : off + 8].bitwise_not_()
        torch.cuda.synchronize()
        stub.Unpin(kvstore_pb2.UnpinRequest(lease_id=leased.lease_id), timeout=5)
        assert kv.fetch(GROUPED, block_hashes=hashes, out=out) == []
        assert kv.lookup(GROUPED, block_hashes=hashes).num_blocks == 0  # block 1 dropped whole
        plane.close()
