"""The SSD region log: recovery from the log and from the snapshot, damage counted, reclaim,
the reopened region after a restart, and the geometry a directory records."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstore.checksum import checksum
from kvstore.core.tier import BlockMeta, Slot
from kvstore.errors import ConfigError, DataLoss
from kvstore.tiers.codec import Codec, decode, encode
from kvstore.tiers.ssd import GEOMETRY_NAME, RECORD, SNAPSHOT_NAME, SsdTier, probe_direct_io

BLOCK = 8192
REGION = 64 * 1024
ROOT = Path(__file__).resolve().parents[2]


def make(path: Path, capacity: int = 512 * 1024) -> SsdTier:
    return SsdTier(str(path), capacity, region_size=REGION, io_threads=2)


def meta(i: int, data: bytes, parent: int | None = None) -> BlockMeta:
    key = bytes(16) + i.to_bytes(16, "big")
    pkey = bytes(16) + parent.to_bytes(16, "big") if parent is not None else None
    return BlockMeta(key, pkey, checksum(data), 2)


def kv_like(n: int, seed: int) -> bytes:
    """bf16 values with KV-like magnitudes: the exponent plane compresses after the shuffle."""
    rng = np.random.default_rng(seed)
    f32 = rng.normal(0, 0.5, n // 2).astype(np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def block_data(i: int) -> bytes:
    """Block i's bytes: every other one compresses. The same in every process, so a child
    that crashes after writing them tells its parent only where they went."""
    return kv_like(BLOCK, i) if i % 2 else np.random.default_rng(1_000_000 + i).bytes(BLOCK)


async def put_many(tier: SsdTier, n: int, first: int = 0) -> dict[bytes, tuple[Slot, bytes]]:
    out = {}
    for i in range(first, first + n):
        data = block_data(i)
        m = meta(i, data, i - 1 if i else None)
        slot = await tier.put_block(m, data)
        assert slot is not None
        out[m.key] = (slot, data)
    return out


def put_then_crash(path: Path, n: int, first: int = 0,
                   capacity: int = 512 * 1024) -> dict[bytes, tuple[Slot, bytes]]:
    """Recover the tier at `path` and put blocks first..first+n-1 in a child process that
    then dies without closing the tier (no snapshot; the kernel drops its lock), as a
    kill -9 would. The blocks put, with their slots."""
    code = f"""
import asyncio, json, os
from pathlib import Path
from tests.tiers.test_ssd_tier import make, put_many

async def main():
    tier = make(Path({str(path)!r}), {capacity})
    await tier.recover()
    written = await put_many(tier, {n}, {first})
    print(json.dumps({{k.hex(): list(s) for k, (s, _) in written.items()}}), flush=True)
    os._exit(0)

asyncio.run(main())
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    slots: dict[str, Any] = json.loads(r.stdout)
    return {bytes.fromhex(k): (Slot(*v), block_data(int.from_bytes(bytes.fromhex(k)[16:], "big")))
            for k, v in slots.items()}


async def test_scan_recovers_every_block_after_a_crash(tmp_path: Path) -> None:
    written = put_then_crash(tmp_path, 20)
    again = make(tmp_path)
    try:
        report = await again.recover()
        assert not report.from_snapshot and report.checksum_failures == 0
        assert {b.key for b in report.blocks} == set(written)
        for b in report.blocks:
            assert await again.get_block(b.slot, b.nbytes) == written[b.key][1]
            i = int.from_bytes(b.key[16:], "big")
            assert b.parent == (meta(i - 1, b"").key if i else None)
        assert again.used_bytes == sum(s.size for s, _ in written.values())
    finally:
        again.close()


async def test_clean_close_writes_a_snapshot_used_once(tmp_path: Path) -> None:
    tier = make(tmp_path)
    written = await put_many(tier, 10)
    tier.close()
    assert (tmp_path / SNAPSHOT_NAME).exists()
    again = make(tmp_path)
    report = await again.recover()
    assert report.from_snapshot and {b.key for b in report.blocks} == set(written)
    assert not (tmp_path / SNAPSHOT_NAME).exists(), "a snapshot must not outlive the start that read it"
    for b in report.blocks:
        assert await again.get_block(b.slot, b.nbytes) == written[b.key][1]
    again.close()


async def test_flipped_payload_byte_is_counted_and_dropped_at_scan(tmp_path: Path) -> None:
    tier = make(tmp_path)
    written = await put_many(tier, 6)
    tier.close()
    os.unlink(tmp_path / SNAPSHOT_NAME)  # force the scan
    victim_key, (slot, _) = next(iter(written.items()))
    region, off = divmod(slot.offset, REGION)
    path = tmp_path / f"region-{region:05d}.kvr"
    raw = bytearray(path.read_bytes())
    raw[off + RECORD.size + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    again = make(tmp_path)
    report = await again.recover()
    assert report.checksum_failures == 1
    assert {b.key for b in report.blocks} == set(written) - {victim_key}
    again.close()


async def test_damaged_header_does_not_hide_the_rest_of_the_region(tmp_path: Path) -> None:
    tier = make(tmp_path)
    written = await put_many(tier, 6)
    tier.close()
    os.unlink(tmp_path / SNAPSHOT_NAME)
    victim_key, (slot, _) = next(iter(written.items()))
    region, off = divmod(slot.offset, REGION)
    path = tmp_path / f"region-{region:05d}.kvr"
    raw = bytearray(path.read_bytes())
    raw[off + 20] ^= 0x01  # inside the header: its own checksum catches it
    path.write_bytes(bytes(raw))
    again = make(tmp_path)
    report = await again.recover()
    assert {b.key for b in report.blocks} == set(written) - {victim_key}
    assert report.checksum_failures == 1  # the next record of the fill shows it was one
    again.close()


async def test_read_of_a_damaged_record_raises_data_loss(tmp_path: Path) -> None:
    tier = make(tmp_path)
    data = os.urandom(BLOCK)
    slot = await tier.put_block(meta(1, data), data)
    assert slot is not None
    with open(tmp_path / "region-00000.kvr", "r+b") as fh:
        fh.seek(slot.offset + 4)
        fh.write(b"\xee")
    with pytest.raises(DataLoss):
        await tier.get_block(slot, BLOCK)
    tier.close()


async def test_region_reclaim_frees_whole_regions(tmp_path: Path) -> None:
    tier = make(tmp_path, capacity=4 * REGION)
    written = await put_many(tier, 14)  # more than one region's worth
    slots = [s for s, _ in written.values()]
    first_region = [s for s in slots if s.offset // REGION == 0]
    keys = tier.region_keys(first_region[0])
    assert len(keys) == len(first_region)
    free_before = int(tier.describe()["regions_free"])
    for s in first_region:
        tier.free(s)
    assert int(tier.describe()["regions_free"]) == free_before + 1


def test_codec_keeps_compression_only_when_it_pays() -> None:
    noise = os.urandom(BLOCK)
    assert encode(noise, 2).codec is Codec.RAW
    kv = kv_like(BLOCK, 7)
    enc = encode(kv, 2)
    assert enc.codec is Codec.SHUFFLE_LZ4 and len(enc.payload) <= 0.95 * len(kv)
    assert decode(enc.codec, enc.payload, 2, len(kv)) == kv
    with pytest.raises(ValueError):
        decode(Codec.SHUFFLE_LZ4, b"\xff" * 40, 2, len(kv))


async def test_codec_is_never_tried_on_a_namespace_that_does_not_compress(tmp_path: Path) -> None:
    """Random bytes: the chooser samples them, finds no codec shrinks them (ratio >= 1),
    so its model never expects a codec to be faster than raw, whatever the timings."""
    tier = make(tmp_path, capacity=2 << 20)
    try:
        for i in range(40):
            data = os.urandom(BLOCK)
            assert await tier.put_block(meta(i, data), data) is not None
        assert int(tier.describe()["codec_attempts"]) == 0
        (choice,) = tier.codec_choices()
        assert choice.link == "ssd" and choice.choice == "raw"
        assert choice.ratios and all(r >= 1.0 for r in choice.ratios.values())
        assert choice.raw_bytes == {"raw": 40 * BLOCK}
    finally:
        tier.close()


@pytest.mark.parametrize("codec", ["shuffle-lz4", "shuffle-zstd"])
@pytest.mark.parametrize("source", ["snapshot", "log"])
async def test_records_of_each_codec_read_back_after_a_restart(tmp_path: Path, codec: str, source: str) -> None:
    """A tier told to use a codec stores KV-like blocks in it (each record says which),
    and reads them back exact, before and after a restart (snapshot or log scan)."""
    tier = SsdTier(str(tmp_path), 8 << 20, region_size=REGION, io_mode="buffered", compress=codec)
    blocks = {}
    try:
        for i in range(10):
            data = kv_like(BLOCK, i)
            slot = await tier.put_block(meta(i, data), data)
            assert slot is not None and await tier.get_block(slot, BLOCK) == data
            blocks[meta(i, data).key] = data
        assert int(tier.describe()["compressed_blocks"]) > 0  # those the codec shrank by 5% or more
    finally:
        tier.close()
    if source == "log":
        os.unlink(tmp_path / SNAPSHOT_NAME)
    tier = SsdTier(str(tmp_path), 8 << 20, region_size=REGION, io_mode="buffered", compress=codec)
    try:
        report = await tier.recover()
        assert report.checksum_failures == 0 and report.from_snapshot == (source == "snapshot")
        assert {b.key for b in report.blocks} == set(blocks)
        for b in report.blocks:
            assert await tier.get_block(b.slot, b.nbytes) == blocks[b.key]
    finally:
        tier.close()


@pytest.mark.parametrize("source", ["snapshot", "log"])
async def test_a_key_written_twice_recovers_its_newest_record(tmp_path: Path, source: str) -> None:
    """Recovery keeps the highest sequence number of a key and accounts only that record;
    the older one still occupies its region up to its end."""
    tier = make(tmp_path)
    written = await put_many(tier, 6)
    newer = os.urandom(BLOCK)
    m = meta(2, newer, 1)
    slot = await tier.put_block(m, newer)
    assert slot is not None
    written[m.key] = (slot, newer)
    occupied = tier.occupied_bytes
    tier.close()
    if source == "log":
        os.unlink(tmp_path / SNAPSHOT_NAME)
    again = make(tmp_path)
    try:
        report = await again.recover()
        assert report.from_snapshot == (source == "snapshot")
        assert len(report.keys) == len(written) and set(report.keys) == set(written)
        by_key = {b.key: b for b in report.blocks}
        assert by_key[m.key].slot == slot
        assert await again.get_block(slot, BLOCK) == newer
        assert again.used_bytes == sum(s.size for s, _ in written.values())
        assert again.blocks == len(written)
        assert again.occupied_bytes == occupied
        assert [b.slot.offset for b in report.blocks] == sorted(b.slot.offset for b in report.blocks)
    finally:
        again.close()


@pytest.mark.parametrize("source", ["snapshot", "log"])
async def test_a_restart_appends_to_the_region_it_was_filling(tmp_path: Path, source: str) -> None:
    tier = make(tmp_path)
    written = await put_many(tier, 3)
    end = max(s.offset + s.size for s, _ in written.values())
    used, occupied = tier.used_bytes, tier.occupied_bytes
    tier.close()
    if source == "log":
        os.unlink(tmp_path / SNAPSHOT_NAME)
    again = make(tmp_path)
    try:
        await again.recover()
        assert (again.used_bytes, again.occupied_bytes) == (used, occupied)
        slot = (await put_many(again, 1, 3))[meta(3, b"").key][0]
        assert slot.offset == end, "the first put after a restart must continue the open region"
    finally:
        again.close()


async def test_a_reopened_region_never_takes_back_its_previous_fill(tmp_path: Path) -> None:
    """Region 0 filled, emptied, refilled with two records, reopened by a restart and
    appended to: a scan finds exactly the live records, none of the first fill's."""
    tier = make(tmp_path, capacity=2 * REGION)
    first_fill: dict[bytes, tuple[Slot, bytes]] = {}
    i = 0
    while True:  # fill region 0; the first record that does not fit opens region 1
        put = await put_many(tier, 1, i)
        i += 1
        (k, (slot, _)), = put.items()
        if slot.offset >= REGION:
            break
        first_fill.update(put)
    live = dict(put)
    for slot, _ in first_fill.values():
        tier.free(slot)  # region 0 is sealed and now empty: reclaimed
    while True:  # fill region 1; then region 0 takes records again from its start
        put = await put_many(tier, 1, i)
        i += 1
        live.update(put)
        (k, (slot, _)), = put.items()
        if slot.offset < REGION:
            break
    live.update(await put_many(tier, 1, i))
    i += 1
    tier.close()
    os.unlink(tmp_path / SNAPSHOT_NAME)
    again = make(tmp_path, capacity=2 * REGION)
    try:
        report = await again.recover()
        assert set(report.keys) == set(live)
        appended = await put_many(again, 2, i)
        assert all(s.offset < REGION for s, _ in appended.values()), "appends go to the reopened region"
        live.update(appended)
    finally:
        again.close()
    os.unlink(tmp_path / SNAPSHOT_NAME)
    third = make(tmp_path, capacity=2 * REGION)
    try:
        report = await third.recover()
        assert report.checksum_failures == 0
        assert set(report.keys) == set(live), "records of the region's first fill came back"
        for b in report.blocks:
            assert await third.get_block(b.slot, b.nbytes) == live[b.key][1]
    finally:
        third.close()


async def test_a_crash_mid_append_after_a_reopen_is_handled_by_the_scan(tmp_path: Path) -> None:
    # Five records fit a region at either alignment: two, two after a restart, one more.
    written = put_then_crash(tmp_path, 2)
    more = put_then_crash(tmp_path, 2, 2)  # recovered, reopened, appended to
    assert {s.offset // REGION for s, _ in more.values()} == {0}
    written.update(more)
    # Cut the last record short, as a crash in the middle of its write would.
    torn_key, (torn, _) = max(more.items(), key=lambda kv: kv[1][0].offset)
    os.truncate(tmp_path / "region-00000.kvr", torn.offset + RECORD.size + 100)
    del written[torn_key]
    last = put_then_crash(tmp_path, 1, 4)  # the torn record is found, then written over
    assert [s.offset for s, _ in last.values()] == [torn.offset]
    written.update(last)
    again = make(tmp_path)
    try:
        report = await again.recover()
        assert set(report.keys) == set(written)
        assert report.checksum_failures == 0, "the torn record was written over and is gone"
        for b in report.blocks:
            assert await again.get_block(b.slot, b.nbytes) == written[b.key][1]
        assert again.used_bytes == sum(s.size for s, _ in written.values())
    finally:
        again.close()


async def test_a_directory_written_with_buffered_io_stays_buffered(tmp_path: Path) -> None:
    tier = SsdTier(str(tmp_path), 512 * 1024, region_size=REGION, io_threads=2, io_mode="buffered")
    written = await put_many(tier, 3)
    tier.close()
    if probe_direct_io(str(tmp_path)):
        with pytest.raises(ConfigError, match="--ssd-io auto or buffered"):
            SsdTier(str(tmp_path), 512 * 1024, region_size=REGION, io_mode="direct")
    again = make(tmp_path)  # auto: O_DIRECT could not read its 512-byte records
    try:
        assert again.describe()["io_mode"] == "buffered"
        report = await again.recover()
        assert report.from_snapshot and set(report.keys) == set(written)
        for b in report.blocks:
            assert await again.get_block(b.slot, b.nbytes) == written[b.key][1]
    finally:
        again.close()


@pytest.mark.parametrize("content, message", [
    (b"{not json", "unreadable"),
    (b'{"format": 1, "region_size": 65536, "regions": 8}', "unreadable"),
    (b'{"format": 1, "region_size": "64KiB", "regions": 8, "alignment": 512}', "positive whole numbers"),
    (b'{"format": 2, "region_size": 65536, "regions": 8, "alignment": 512}', "newer kvstore"),
])
def test_a_geometry_file_that_cannot_be_followed_is_refused(tmp_path: Path, content: bytes, message: str) -> None:
    make(tmp_path).close()
    (tmp_path / GEOMETRY_NAME).write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        make(tmp_path)
    make(tmp_path / "other").close()  # the refusal let go of nothing it should hold


async def test_the_snapshot_of_a_directory_without_geometry_file_shows_its_geometry(tmp_path: Path) -> None:
    """A clean stop of a release before the geometry file left a version 2 snapshot: its
    header names the region size, which then counts as recorded."""
    tier = make(tmp_path)
    written = await put_many(tier, 4)
    alignment = tier.alignment
    tier.close()
    os.unlink(tmp_path / GEOMETRY_NAME)
    body = struct.pack("<8sIQIIQ", b"KVSNAP\x00\x02", 2, REGION, alignment, 8, 0)
    (tmp_path / SNAPSHOT_NAME).write_bytes(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))
    with pytest.raises(ConfigError, match="--ssd-region-size 64KiB as recorded"):
        SsdTier(str(tmp_path), 512 * 1024, region_size=2 * REGION)
    again = make(tmp_path)
    try:
        report = await again.recover()
        assert not report.from_snapshot  # an older snapshot format: the log is scanned
        assert set(report.keys) == set(written)
    finally:
        again.close()
    assert (tmp_path / GEOMETRY_NAME).exists()
