"""The tiers through the real daemon and SDK: overflow to SSD, stats, prefetch, restart,
a flipped byte on disk, and the CLI's view of it all."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import make_config

from kvstore.cli.main import main as cli_main
from kvstore.client import AsyncClient, Client
from kvstore.layout import KVLayout
from kvstore.server.config import Config
from kvstore.server.daemon import Daemon
from kvstore.tiers.cuda import cuda_available
from kvstore.tiers.ssd import RECORD, SNAPSHOT_NAME

# 2 * 2 * 4 * 2 * 128 * 2 = 8 KiB per block
LAYOUT = KVLayout(model="test/ssd", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=128,
                  block_size_tokens=4)
NBLOCKS = 320  # 2.5 MiB of blocks into a 1 MiB host tier


def ssd_config(tmp_path: Path) -> Config:
    return replace(make_config(tmp_path), host_capacity=1 << 20, ssd_path=str(tmp_path / "ssd"),
                   ssd_capacity=8 << 20, ssd_region_size=512 << 10)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return ssd_config(tmp_path)


def chain(n: int, salt: int) -> tuple[list[int], list[bytes]]:
    tokens = [salt * 1_000_000 + i for i in range(n * LAYOUT.block_size_tokens)]
    return tokens, [os.urandom(LAYOUT.bytes_per_block) for _ in range(n)]


async def put_chains(kv: AsyncClient, nchains: int, per: int) -> list[tuple[list[int], list[bytes]]]:
    chains = [chain(per, s) for s in range(nchains)]
    for tokens, blocks in chains:
        for i in range(0, per, 8):
            await kv.put(LAYOUT, tokens, blocks[i : i + 8], first_block=i)
    return chains


def tiers_by_name(stats) -> dict:  # type: ignore[no-untyped-def]
    return {t.name: t for t in stats.tiers}


async def test_overflow_to_ssd_keeps_every_block_fetchable(daemon) -> None:  # type: ignore[no-untyped-def]
    async with AsyncClient(daemon.unix_target) as kv:
        chains = await put_chains(kv, 4, NBLOCKS // 4)
        assert "ssd" in (await kv.lookup(LAYOUT, chains[0][0])).tiers  # the oldest were demoted
        for tokens, blocks in chains:
            hit = await kv.lookup(LAYOUT, tokens)
            assert hit.num_blocks == len(blocks)
            assert await kv.fetch(LAYOUT, tokens) == blocks
        assert await daemon.store.flush(10)  # write-through is asynchronous: let it finish
        t = tiers_by_name(await kv.stats())
        assert t["host"].used_bytes <= t["host"].capacity_bytes
        assert t["host"].demotions > 0 and t["ssd"].io_mode in ("direct", "buffered")
        assert t["ssd"].blocks == NBLOCKS
        assert not t["hbm"].present and "not configured" in t["hbm"].reason


async def test_prefetch_raises_cold_blocks_into_host(daemon) -> None:  # type: ignore[no-untyped-def]
    async with AsyncClient(daemon.unix_target) as kv:
        chains = await put_chains(kv, 4, NBLOCKS // 4)
        tokens, blocks = chains[0]
        first = (await kv.lookup(LAYOUT, tokens)).tiers
        cold = first.index("ssd")
        head = tokens[: (cold + 4) * LAYOUT.block_size_tokens]
        r = await kv.prefetch(LAYOUT, head, tier="host")
        assert r.tier == "host" and r.requested == cold + 4 and r.missing == 0 and r.raised >= 1
        assert (await kv.lookup(LAYOUT, head)).tiers == ["host"] * (cold + 4)
        assert await kv.fetch(LAYOUT, head) == blocks[: cold + 4]


async def test_restart_serves_everything_and_a_flipped_byte_is_a_counted_miss(tmp_path: Path) -> None:
    config = ssd_config(tmp_path)
    d = Daemon(config)
    await d.start()
    async with AsyncClient(d.bound[0]) as kv:
        chains = await put_chains(kv, 2, 24)
    await d.stop(grace_s=0)  # graceful: flushes the SSD queue and writes the snapshot

    d = Daemon(config)
    await d.start()
    async with AsyncClient(d.bound[0]) as kv:
        for tokens, blocks in chains:
            hit = await kv.lookup(LAYOUT, tokens)
            assert hit.tiers == ["ssd"] * len(blocks)
            assert await kv.fetch(LAYOUT, tokens) == blocks
    await d.stop(grace_s=0)

    # Flip one payload byte of the first block of chain 1 (found by its key in the log).
    ns = LAYOUT.namespace_id
    from kvstore.hashing import block_hashes

    target_key = ns + block_hashes(ns, chains[1][0], LAYOUT.block_size_tokens)[0]
    os.unlink(tmp_path / "ssd" / SNAPSHOT_NAME)  # the damage must be found by the log scan
    flipped = False
    for region in sorted((tmp_path / "ssd").glob("region-*.kvr")):
        raw = bytearray(region.read_bytes())
        at = raw.find(target_key)
        if at >= 0:
            raw[at - 24 + RECORD.size + 100] ^= 0x5A  # key sits 24 bytes into the header
            region.write_bytes(bytes(raw))
            flipped = True
            break
    assert flipped

    d = Daemon(config)
    await d.start()
    try:
        async with AsyncClient(d.bound[0]) as kv:
            assert (await kv.lookup(LAYOUT, chains[1][0])).num_blocks == 0  # the chain starts there
            assert await kv.fetch(LAYOUT, chains[0][0]) == chains[0][1]
            stats = await kv.stats()
            assert tiers_by_name(stats)["ssd"].checksum_failures == 1
            assert stats.counters.checksum_failures == 1
    finally:
        await d.stop(grace_s=0)


def test_cli_stats_json_shows_per_tier_movement(daemon_thread, capsys) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon_thread.unix_target) as kv:
        tokens, blocks = chain(160, 1)
        for i in range(0, 160, 16):
            kv.put(LAYOUT, tokens, blocks[i : i + 16], first_block=i)
    assert cli_main(["stats", "--json", "--target", daemon_thread.unix_target]) == 0
    out = json.loads(capsys.readouterr().out)
    tiers = {t["name"]: t for t in out["tiers"]}
    for key in ("used_bytes", "blocks", "promotions", "demotions", "drops", "checksum_failures", "pending_writes"):
        assert key in tiers["host"] and key in tiers["ssd"]
    assert tiers["host"]["demotions"] > 0
    assert tiers["ssd"]["io_mode"] in ("direct", "buffered")
    assert cli_main(["stats", "--target", daemon_thread.unix_target]) == 0
    assert "DEMOTED" in capsys.readouterr().out


@pytest.mark.skipif(cuda_available(), reason="CUDA present: the hbm tier is built")
async def test_hbm_configured_without_cuda_is_reported_absent(tmp_path: Path) -> None:
    d = Daemon(replace(make_config(tmp_path), hbm_capacity=64 << 20))
    await d.start()
    try:
        async with AsyncClient(d.bound[0]) as kv:
            hbm = tiers_by_name(await kv.stats())["hbm"]
            assert not hbm.present and "CUDA not available" in hbm.reason
            await kv.put(LAYOUT, list(range(4)), [os.urandom(LAYOUT.bytes_per_block)])
            assert (await kv.lookup(LAYOUT, list(range(4)))).tiers == ["host"]
    finally:
        await d.stop(grace_s=0)


def test_tier_settings_are_checked_before_start(tmp_path: Path) -> None:
    from kvstore.errors import ConfigError
    from kvstore.server.config import load_config

    with pytest.raises(ConfigError, match="host_low_watermark"):
        load_config({"host_low_watermark": "0.9", "host_high_watermark": "0.5"}, env={})
    with pytest.raises(ConfigError, match="ssd_write_policy"):
        load_config({"ssd_write_policy": "sometimes"}, env={})
    cfg = load_config({"ssd_path": str(tmp_path / "s"), "ssd_capacity": "2GiB", "put_tier": "host"}, env={})
    assert (cfg.ssd_path, cfg.ssd_capacity, cfg.ssd_write_policy) == (str(tmp_path / "s"), 2 << 30, "through")


async def test_ssd_capacity_beyond_the_disk_refuses_to_start(tmp_path: Path) -> None:
    from kvstore.errors import ConfigError

    d = Daemon(replace(ssd_config(tmp_path), ssd_capacity=1 << 56))
    with pytest.raises(ConfigError, match="ssd_capacity"):
        await d.start()


def test_tier_kinds_have_one_name_everywhere() -> None:
    """The registry's kinds are the names the proto's Tier enum, the policy specs and the
    token file's quotas use: a new kind is added to the registry, and these follow."""
    from kvstore.convert import TIER_BY_NAME
    from kvstore.core.policies import TIERS
    from kvstore.server.auth import QUOTA_TIERS
    from kvstore.tiers import TIER_KINDS

    assert set(TIER_KINDS) <= set(TIER_BY_NAME)
    assert tuple(TIERS) == TIER_KINDS == QUOTA_TIERS


def test_build_tiers_names_the_absent_and_closes_what_it_built_on_failure(tmp_path: Path) -> None:
    from kvstore.tiers import HOST, SSD, TierSettings, build_host, build_tiers

    settings = TierSettings(host_capacity_bytes=1 << 20, shm_dir=str(tmp_path))
    built, absent = build_tiers(settings)
    try:
        assert [t.name for t in built] == ["host"]
        assert [kind for kind, _ in absent] == ["hbm", "ssd"]
        assert all("not configured" in reason for _, reason in absent)
    finally:
        for tier in built:
            tier.close()
    assert list(tmp_path.iterdir()) == []

    def broken(settings: TierSettings) -> str:
        raise OSError("the disk is gone")

    with pytest.raises(OSError, match="the disk is gone"):
        build_tiers(settings, {HOST: build_host, SSD: broken})
    assert list(tmp_path.iterdir()) == []  # the host tier's segment was closed and removed
