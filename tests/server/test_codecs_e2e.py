"""Codecs through a real daemon and the real SDK (docs/codecs.md).

Lossless: the data lane's fetches and puts are byte-exact in every codec, the daemon
counts what it moved encoded, a client's choice shows in `codec_stats`, a block damaged
on its way in a codec is never returned nor stored, and a daemon with `lane_codecs` off
gets raw frames only. Quantized namespaces: never a hit across codecs, fetched
dequantized (or as stored) on every plane, a damaged quantized block is a miss, and
eviction to SSD, a restart and an export keep the codec.
"""

from __future__ import annotations

import io
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import daemon_in_thread, make_config

from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.client.export import export_namespace, import_namespace
from kvstore.convert import layout_to_proto
from kvstore.errors import DataLoss
from kvstore.layout import KVLayout
from kvstore.quant import quantizer_for
from kvstore.shm import AttachedSegment
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.lane_proxy import LaneProxy
from tests.server.test_data_lane import lane_address, wait_until

# bf16 KV-shaped blocks of 64 KiB: every codec shrinks them.
DENSE = KVLayout(model="test/codecs", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64,
                 block_size_tokens=32, kv_layout="L,2,H,B,D")
FP8 = KVLayout(**{**{f: getattr(DENSE, f) for f in ("model", "dtype", "num_layers", "num_kv_heads", "head_dim",
                                                    "block_size_tokens", "kv_layout")}, "kv_codec": "fp8-e4m3"})
KIVI = KVLayout(**{**{f: getattr(DENSE, f) for f in ("model", "dtype", "num_layers", "num_kv_heads", "head_dim",
                                                     "block_size_tokens", "kv_layout")}, "kv_codec": "kivi4"})


def kv_blocks(n: int, seed: int, layout: KVLayout = DENSE) -> list[bytes]:
    rng = np.random.default_rng(seed)
    count = layout.dense_block_bytes // 2
    out = []
    for _ in range(n):
        x = (rng.standard_normal(count) * np.where(np.arange(count) % 64 < 3, 6.0, 0.4)).astype(np.float32)
        out.append((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    return out


def metric(running, name: str) -> float:
    """A sample of the daemon's /metrics exposition, by its name and labels as written."""
    for line in running.daemon.metrics.exposition().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in the metrics")


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n * DENSE.block_size_tokens))


# ---------------------------------------------------------------------- lossless on the lane


@pytest.mark.parametrize("codec", ["raw", "shuffle-lz4", "shuffle-zstd"])
def test_lane_fetches_and_puts_are_byte_exact_in_each_codec(daemon_thread, codec: str) -> None:
    data = kv_blocks(24, seed=1)
    with Client(daemon_thread.tcp_target, data_plane="lane", lane_codec=codec) as kv:
        assert kv.put(DENSE, tokens(24), data).stored == 24
    with Client(daemon_thread.tcp_target, data_plane="lane", lane_codec=codec) as kv:
        assert [bytes(b) for b in kv.fetch(DENSE, tokens(24))] == data
        (choice,) = kv.codec_stats
        assert choice.raw_bytes == {codec: 24 * DENSE.bytes_per_block}
        wire = choice.wire_bytes[codec]
    counters = daemon_thread.daemon.data_lane.counters
    if codec == "raw":
        assert wire == 24 * DENSE.bytes_per_block
        assert counters.get("encoded_raw_bytes_out") == counters.get("encoded_raw_bytes_in") == 0
    else:
        assert wire < 0.95 * 24 * DENSE.bytes_per_block
        assert counters.get("encoded_raw_bytes_out") == counters.get("encoded_raw_bytes_in") == 24 * 65536
        assert counters.get("encoded_wire_bytes_out") == wire
        assert metric(daemon_thread, 'kvstore_datalane_encoded_wire_bytes_total{direction="out"}') == wire
    # Whatever the lane did, the stored bytes are the raw ones: gRPC gets them exact.
    with Client(daemon_thread.tcp_target, data_plane="grpc") as kv:
        assert [bytes(b) for b in kv.fetch(DENSE, tokens(24))] == data


def test_a_daemon_with_lane_codecs_off_gets_and_sends_raw_frames(tmp_path: Path) -> None:
    data = kv_blocks(8, seed=2)
    with daemon_in_thread(make_config(tmp_path, lane_codecs=False)) as running:
        with Client(running.tcp_target, data_plane="lane", lane_codec="shuffle-zstd") as kv:
            kv.put(DENSE, tokens(8), data)
            assert [bytes(b) for b in kv.fetch(DENSE, tokens(8))] == data
            assert kv.codec_stats == []  # nothing offered: no choice was made
        assert running.daemon.data_lane.counters.get("encoded_raw_bytes_in") == 0


@pytest.mark.parametrize("direction", ["to_client", "to_daemon"])
def test_an_encoded_block_damaged_on_the_way_is_never_returned_nor_stored(tmp_path: Path, direction: str) -> None:
    data = kv_blocks(6, seed=3)
    proxy = LaneProxy("flip", direction)
    cfg = make_config(tmp_path, data_lane_listen=("127.0.0.1:0",), data_lane_advertise=(proxy.address,))
    try:
        with daemon_in_thread(cfg) as running:
            proxy.upstream = lane_address(running)
            if direction == "to_client":
                with Client(running.tcp_target, data_plane="grpc") as kv:
                    kv.put(DENSE, tokens(6), data)
                with Client(running.tcp_target, data_plane="lane", lane_codec="shuffle-zstd") as kv:
                    got = kv.fetch(DENSE, tokens(6))
                    assert proxy.hits == 1 and len(got) == proxy.hit_block
                    assert [bytes(x) for x in got] == data[: len(got)]
                    assert kv.data_lane_stats.blocks_rejected == 1
                    assert [bytes(x) for x in kv.fetch(DENSE, tokens(6))] == data
            else:
                with Client(running.tcp_target, data_plane="lane", lane_codec="shuffle-lz4") as kv:
                    with pytest.raises(DataLoss, match="checksum"):
                        kv.put(DENSE, tokens(6), data)
                    assert proxy.hits == 1 and kv.lookup(DENSE, tokens(6)).num_blocks == 0
                    assert running.daemon.data_lane.counters.get("blocks_rejected") == 1
                    assert kv.put(DENSE, tokens(6), data).stored == 6
                    assert [bytes(x) for x in kv.fetch(DENSE, tokens(6))] == data
    finally:
        proxy.close()


def test_the_daemon_shows_its_ssd_chooser_in_stats_info_and_metrics(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_capacity=8 << 20, ssd_region_size=1 << 20)
    with daemon_in_thread(cfg) as running:
        with Client(running.unix_target) as kv:
            kv.put(DENSE, tokens(8), kv_blocks(8, seed=4))
            ns = kv.lookup(DENSE, tokens(8)).namespace_id
            wait_until(lambda: (ssd := next(t for t in kv.stats().tiers if t.name == "ssd")).blocks == 8
                       and not ssd.pending_writes)
            stats = kv.stats()
            (choice,) = [c for c in stats.codecs if c.path == "ssd"]
            assert choice.link == "ssd" and choice.namespace_id == ns
            figures = {f.codec: f for f in choice.codecs}
            assert sum(f.raw_bytes for f in figures.values()) == 8 * DENSE.bytes_per_block
            assert 0 < figures["shuffle-zstd"].ratio < 0.9 and figures["shuffle-zstd"].encode_gbps > 0
            info = kv.info("codecs")
            assert info.startswith("# Codecs") and f"codec_ssd_ssd_{ns.hex()}:choice={choice.choice}" in info
        assert metric(running, f'kvstore_codec_chosen{{codec="{choice.choice}",link="ssd",namespace="{ns.hex()}",'
                               'path="ssd"}') == 1.0


# ---------------------------------------------------------------------- quantized namespaces


def test_a_quantized_block_never_answers_another_codec(daemon_thread) -> None:
    data = kv_blocks(4, seed=5)
    with Client(daemon_thread.unix_target) as kv:
        kv.put(FP8, tokens(4), data)
        assert kv.lookup(FP8, tokens(4)).num_blocks == 4
        assert kv.lookup(DENSE, tokens(4)).num_blocks == 0
        assert kv.lookup(KIVI, tokens(4)).num_blocks == 0
        kv.put(DENSE, tokens(2, start=10_000), data[:2])
        assert kv.lookup(FP8, tokens(2, start=10_000)).num_blocks == 0
        ids = {n.namespace_id: n for n in AdminClient(daemon_thread.unix_target).list_namespaces()}
        assert ids[FP8.namespace_id].layout.kv_codec == "fp8-e4m3"
        assert ids[FP8.namespace_id].block_bytes == FP8.bytes_per_block < DENSE.bytes_per_block // 1.9


@pytest.mark.parametrize("plane", ["local", "lane", "grpc"])
@pytest.mark.parametrize("layout", [FP8, KIVI], ids=["fp8", "kivi4"])
def test_quantized_blocks_come_back_dequantized_or_as_stored_on_every_plane(daemon_thread, plane: str,
                                                                            layout: KVLayout) -> None:
    data = kv_blocks(5, seed=6)
    q = quantizer_for(layout)
    stored = q.quantize(data)
    dense = q.dequantize(stored)
    target = daemon_thread.unix_target if plane == "local" else daemon_thread.tcp_target
    with Client(target, data_plane=plane) as kv:
        assert kv.put(layout, tokens(5), data).stored == 5
        assert kv.data_plane_in_use == plane
        assert [bytes(b) for b in kv.fetch(layout, tokens(5))] == dense
        assert [bytes(b) for b in kv.fetch(layout, tokens(5), quantized=True)] == stored
        out = [bytearray(layout.dense_block_bytes) for _ in range(3)]  # fewer buffers: that many blocks
        got = kv.fetch(layout, tokens(5), out=out)
        assert len(got) == 3 and [bytes(b) for b in out] == dense[:3]
        # Blocks quantized by the caller go in as they are.
        assert kv.put(layout, tokens(5, start=50_000), stored, quantized=True).stored == 5
        assert [bytes(b) for b in kv.fetch(layout, tokens(5, start=50_000))] == dense


def test_a_damaged_quantized_block_is_a_miss(daemon_thread) -> None:
    data = kv_blocks(3, seed=7)
    with Client(daemon_thread.unix_target) as kv:
        kv.put(FP8, tokens(3), data)
    ns = kvstore_pb2.Namespace(layout=layout_to_proto(FP8))
    keys = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens(3)))
    with grpc.insecure_channel(daemon_thread.unix_target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        leased = stub.LocalFetch(kvstore_pb2.LocalFetchRequest(namespace=ns, keys=keys))
        stub.Unpin(kvstore_pb2.UnpinRequest(lease_id=leased.lease_id))
        seg = stub.LocalSegment(kvstore_pb2.LocalSegmentRequest())
        mapped = AttachedSegment(seg.path, seg.token)
        try:
            mapped.data[leased.offsets[1] + FP8.bytes_per_block - 3] ^= 0x10  # a scale byte of block 1
        finally:
            mapped.close()
    for plane, target in (("local", daemon_thread.unix_target), ("grpc", daemon_thread.tcp_target)):
        with Client(target, data_plane=plane) as kv:
            got = kv.fetch(FP8, tokens(3))
            assert len(got) == 1, plane  # the prefix ends before the damaged block
            assert bytes(got[0]) == quantizer_for(FP8).dequantize(quantizer_for(FP8).quantize(data[:1]))[0]


def test_eviction_to_ssd_a_restart_and_an_export_keep_the_codec(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, host_capacity=2 << 20, ssd_path=str(tmp_path / "ssd"), ssd_capacity=16 << 20,
                      ssd_region_size=1 << 20)
    data = kv_blocks(96, seed=8)  # 3 MiB of quantized blocks: more than the host tier holds
    q = quantizer_for(KIVI)
    dense = q.dequantize(q.quantize(data))
    with daemon_in_thread(cfg) as running:
        with Client(running.unix_target) as kv:
            for i in range(0, 96, 16):
                kv.put(KIVI, tokens(i + 16), data[i : i + 16], first_block=i)
            stats = {t.name: t for t in kv.stats().tiers}
            assert stats["ssd"].blocks > 0 and stats["host"].used_bytes <= 2 << 20
            assert [bytes(b) for b in kv.fetch(KIVI, tokens(96))] == dense
        with AdminClient(running.unix_target) as admin:
            buf = io.BytesIO()
            assert export_namespace(admin, KIVI.namespace_id, buf).blocks == 96
    with daemon_in_thread(cfg) as running:  # the same SSD directory: its records are found again
        with Client(running.unix_target) as kv:
            assert kv.lookup(KIVI, tokens(96)).num_blocks > 0
            assert kv.lookup(DENSE, tokens(96)).num_blocks == 0
            got = kv.fetch(KIVI, tokens(96))
            assert [bytes(b) for b in got] == dense[: len(got)]
    fresh = make_config(tmp_path / "fresh")
    (tmp_path / "fresh").mkdir()
    with daemon_in_thread(fresh) as running:
        buf.seek(0)
        with AdminClient(running.unix_target) as admin:
            assert import_namespace(admin, buf).stored == 96
        with Client(running.unix_target) as kv:
            assert [bytes(b) for b in kv.fetch(KIVI, tokens(96))] == dense
            assert kv.lookup(DENSE, tokens(96)).num_blocks == 0
