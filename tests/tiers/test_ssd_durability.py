"""The SSD tier's directory across daemons and restarts, through the real daemon.

- One daemon per `--ssd-path`: a second daemon on a directory in use refuses to start,
  naming the holder, and leaves the first one's blocks alone; a daemon that stopped (or
  was killed) leaves no stale lock behind.
- A restart reopens the region that was being filled: restarts with puts between them
  keep every block that fits, and the tier's used and occupied bytes are what they were.
- The directory records its geometry: a smaller capacity or region size is refused with
  the recorded value, a larger capacity adds regions, and a directory written before the
  geometry was recorded is adopted only when its files agree with the settings.
- Start-up errors of the SSD tier reach the command line as one line, never a traceback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import make_config

from kvstore.client import AsyncClient, Client
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.server.config import Config
from kvstore.server.daemon import Daemon
from tests import procs

LAYOUT = KVLayout(model="test/ssd-durability", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=128,
                  block_size_tokens=4)  # 8 KiB blocks
DEADLINE_S = 30.0

Chain = tuple[list[int], list[bytes]]


def chain(n: int, salt: int) -> Chain:
    tokens = [salt * 1_000_000 + i for i in range(n * LAYOUT.block_size_tokens)]
    return tokens, [os.urandom(LAYOUT.bytes_per_block) for _ in range(n)]


def ssd_config(tmp_path: Path, name: str = "a", **overrides: Any) -> Config:
    """A daemon with a 1 MiB host tier over the SSD directory tmp_path/ssd (shared by every
    daemon of a test); its socket under tmp_path/name."""
    home = tmp_path / name
    home.mkdir(exist_ok=True)
    settings: dict[str, Any] = {"host_capacity": 1 << 20, "ssd_path": str(tmp_path / "ssd"),
                                "ssd_capacity": 8 << 20, "ssd_region_size": 512 << 10}
    settings.update(overrides)
    return replace(make_config(home), **settings)


def ssd_of(stats: Any) -> Any:
    return next(t for t in stats.tiers if t.name == "ssd")


async def put_chains(kv: AsyncClient, chains: list[Chain]) -> None:
    for tokens, blocks in chains:
        for i in range(0, len(blocks), 8):
            await kv.put(LAYOUT, tokens, blocks[i : i + 8], first_block=i)


async def assert_served(kv: AsyncClient, chains: list[Chain]) -> None:
    for n, (tokens, blocks) in enumerate(chains):
        hit = await kv.lookup(LAYOUT, tokens)
        assert hit.num_blocks == len(blocks), f"chain {n}: {hit.num_blocks} of {len(blocks)} blocks found"
        assert await kv.fetch(LAYOUT, tokens) == blocks, f"chain {n} came back different"


async def fill(config: Config, chains: list[Chain]) -> None:
    """Start a daemon on `config`, put `chains`, and stop it gracefully."""
    d = Daemon(config)
    await d.start()
    try:
        async with AsyncClient(d.bound[0]) as kv:
            await put_chains(kv, chains)
    finally:
        await d.stop(grace_s=0)


async def assert_refused(config: Config, *needles: str) -> str:
    d = Daemon(config)
    try:
        await d.start()
    except ConfigError as exc:
        message = str(exc)
    else:
        await d.stop(grace_s=0)
        pytest.fail("the daemon started")
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


async def assert_recovers(config: Config, chains: list[Chain]) -> None:
    d = Daemon(config)
    await d.start()
    try:
        async with AsyncClient(d.bound[0]) as kv:
            await assert_served(kv, chains)
    finally:
        await d.stop(grace_s=0)


def serve_args(tmp_path: Path, *flags: str) -> list[str]:
    sock = tmp_path / "cli" / "kv.sock"
    sock.parent.mkdir(exist_ok=True)
    return procs.daemon_args(sock, "--host-capacity", "1MiB", "--ssd-path", str(tmp_path / "ssd"), *flags)


def start_failure(args: list[str]) -> str:
    """Run a daemon that must refuse to start; its stderr, checked to be one line."""
    r = subprocess.run(args, env=procs.clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, f"the daemon started: {r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: cannot start: "), r.stderr
    return lines[0]


def ssd_pending(kv: Client) -> int:
    return int(next(t.pending_writes for t in kv.stats().tiers if t.name == "ssd"))


# ------------------------------------------------------------------ one daemon per directory


@pytest.mark.parametrize("first_stops_by", ["sigterm", "kill9"])
async def test_a_second_daemon_on_an_ssd_path_in_use_refuses_and_the_first_keeps_its_blocks(
        tmp_path: Path, first_stops_by: str) -> None:
    sock = tmp_path / "first" / "kv.sock"
    sock.parent.mkdir()
    args = procs.daemon_args(sock, "--host-capacity", "1MiB", "--ssd-path", str(tmp_path / "ssd"),
                             "--ssd-capacity", "8MiB", "--ssd-region-size", "512KiB")
    first = procs.start(args, sock, tmp_path / "first.log")
    chains = [chain(40, s) for s in range(4)]
    try:
        with Client(first.target) as kv:
            for tokens, blocks in chains:
                for i in range(0, len(blocks), 8):
                    kv.put(LAYOUT, tokens, blocks[i : i + 8], first_block=i)
            deadline = time.monotonic() + DEADLINE_S
            while ssd_pending(kv) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert ssd_pending(kv) == 0, "the SSD write queue did not drain"

        # In this process and as a command line: refused, naming the holder and the setting.
        message = await assert_refused(ssd_config(tmp_path, "second"), "--ssd-path", f"pid {first.pid}",
                                       socket.gethostname())
        assert str(tmp_path / "ssd") in message
        line = start_failure(serve_args(tmp_path, "--ssd-capacity", "8MiB", "--ssd-region-size", "512KiB"))
        assert "--ssd-path" in line and f"pid {first.pid}" in line

        with Client(first.target) as kv:  # the first daemon's blocks are untouched
            for tokens, blocks in chains:
                assert kv.fetch(LAYOUT, tokens) == blocks
            assert int(ssd_of(kv.stats()).blocks) == 160
    finally:
        if first_stops_by == "kill9":
            first.kill9()  # the kernel releases the lock: nothing stale stays behind
            procs.remove_segments(first.pid)
        else:
            assert first.stop() == 0

    await assert_recovers(ssd_config(tmp_path, "third"), chains)


# ------------------------------------------------------------------ restarts reopen the open region


def tier_bytes(kv: Client) -> tuple[int, int, int]:
    """The SSD tier's blocks, used bytes and occupied bytes (live and dead records)."""
    ssd = ssd_of(kv.stats())
    return int(ssd.blocks), int(ssd.used_bytes), int(ssd.facts["occupied_bytes"])


@pytest.mark.parametrize("stop_by", ["sigterm", "kill9"])
def test_restarts_with_puts_between_them_keep_every_block_and_the_same_ssd_bytes(
        tmp_path: Path, stop_by: str) -> None:
    """Four regions of 1 MiB, six starts with 40 blocks put in each: 2-3 MiB in all, so
    every block fits, and no start may cost a region."""
    sock = tmp_path / "kv.sock"
    args = procs.daemon_args(sock, "--host-capacity", "1MiB", "--ssd-path", str(tmp_path / "ssd"),
                             "--ssd-capacity", "4MiB", "--ssd-region-size", "1MiB")
    chains: list[Chain] = []
    before: tuple[int, int, int] | None = None
    for start in range(6):
        proc = procs.start(args, sock, tmp_path / "daemon.log")
        try:
            with Client(proc.target) as kv:
                if before is not None:
                    assert tier_bytes(kv) == before, f"start {start}: the SSD tier's blocks and bytes changed"
                for n, (tokens, blocks) in enumerate(chains):
                    got = kv.lookup(LAYOUT, tokens).num_blocks
                    assert got == len(blocks), f"start {start}: chain {n} has {got} of {len(blocks)} blocks"
                    assert kv.fetch(LAYOUT, tokens) == blocks
                chains.append(chain(40, start))
                tokens, blocks = chains[-1]
                for i in range(0, len(blocks), 8):
                    kv.put(LAYOUT, tokens, blocks[i : i + 8], first_block=i)
                deadline = time.monotonic() + DEADLINE_S
                while ssd_pending(kv) and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert ssd_pending(kv) == 0, "the SSD write queue did not drain"
                before = tier_bytes(kv)
                assert before[0] == 40 * len(chains)
        finally:
            if stop_by == "kill9" or proc.stop() != 0:
                proc.kill9()
            procs.remove_segments(proc.pid)


async def test_an_ssd_tier_of_one_region_is_refused_with_the_minimum(tmp_path: Path) -> None:
    # 64 MiB is the default region size: one region, which every reclaim would empty.
    config = ssd_config(tmp_path, ssd_capacity=64 << 20, ssd_region_size=64 << 20)
    await assert_refused(config, "--ssd-capacity", "--ssd-region-size", "at least 2 regions", "128MiB", "32MiB")
    line = start_failure(serve_args(tmp_path, "--ssd-capacity", "64MiB"))
    assert "at least 2 regions" in line and "128MiB" in line


# ------------------------------------------------------------------ the directory's geometry

# 320 blocks of 8 KiB over 8 MiB in 512 KiB regions: every region holds records.
FILLED = 320


async def filled(tmp_path: Path) -> tuple[Config, list[Chain]]:
    config = ssd_config(tmp_path)
    chains = [chain(FILLED // 8, s) for s in range(8)]
    await fill(config, chains)
    return config, chains


def keep_only_region_files(ssd_dir: Path) -> None:
    """The directory as a daemon that predates the geometry file leaves it after a crash."""
    for f in ssd_dir.iterdir():
        if not f.name.startswith("region-"):
            f.unlink()


async def test_a_lower_ssd_capacity_on_restart_is_refused_naming_the_recorded_capacity(tmp_path: Path) -> None:
    config, chains = await filled(tmp_path)
    await assert_refused(replace(config, ssd_capacity=4 << 20), "--ssd-capacity", "8MiB", "16 regions", "empty")
    line = start_failure(serve_args(tmp_path, "--ssd-capacity", "4MiB", "--ssd-region-size", "512KiB"))
    assert "--ssd-capacity" in line and "8MiB" in line
    await assert_recovers(config, chains)  # a refused start changed nothing


async def test_a_lower_ssd_region_size_on_restart_is_refused_naming_the_recorded_size(tmp_path: Path) -> None:
    config, chains = await filled(tmp_path)
    await assert_refused(replace(config, ssd_region_size=256 << 10), "--ssd-region-size 512KiB", "empty")
    await assert_refused(replace(config, ssd_region_size=1 << 20), "--ssd-region-size 512KiB")
    line = start_failure(serve_args(tmp_path, "--ssd-capacity", "8MiB", "--ssd-region-size", "256KiB"))
    assert "--ssd-region-size 512KiB" in line
    await assert_recovers(config, chains)


async def test_a_larger_ssd_capacity_on_restart_adds_regions_and_keeps_every_block(tmp_path: Path) -> None:
    config, chains = await filled(tmp_path)
    larger = replace(config, ssd_capacity=16 << 20)
    d = Daemon(larger)
    await d.start()
    try:
        async with AsyncClient(d.bound[0]) as kv:
            ssd = ssd_of(await kv.stats())
            assert int(ssd.capacity_bytes) == 16 << 20 and int(ssd.blocks) == FILLED
            assert int(ssd.facts["regions_free"]) >= 16
            await assert_served(kv, chains)
            more = [chain(40, 100)]
            await put_chains(kv, more)
    finally:
        await d.stop(grace_s=0)
    # The larger capacity is now the recorded one.
    await assert_refused(config, "--ssd-capacity", "16MiB")
    await assert_recovers(larger, chains + more)


async def test_a_directory_from_before_the_geometry_file_is_adopted_when_its_files_agree(tmp_path: Path) -> None:
    config, chains = await filled(tmp_path)
    keep_only_region_files(tmp_path / "ssd")
    # Its region files show what it was written with: fewer or smaller regions are refused.
    # (The region size shows only as at least its fullest file.)
    await assert_refused(replace(config, ssd_region_size=256 << 10), "--ssd-region-size", "at least")
    # (Its regions count up to the last file that holds records: 6 to 8 of the 16 here.)
    await assert_refused(replace(config, ssd_capacity=2 << 20), "--ssd-capacity", "or more")
    await assert_recovers(config, chains)
    # Adopted: its geometry is recorded now, and a change is refused as for any directory.
    await assert_refused(replace(config, ssd_region_size=1 << 20), "--ssd-region-size 512KiB")
    await assert_recovers(config, chains)


# ------------------------------------------------------------------ bad settings are one line


def test_more_ssd_regions_than_open_files_allowed_is_one_clear_line(tmp_path: Path) -> None:
    """Every region is an open file: 16 MiB of 64 KiB regions is 256 of them."""
    flags = ["--ssd-capacity", "16MiB", "--ssd-region-size", "64KiB"]
    line = start_failure(["bash", "-c", 'ulimit -n 200 && exec "$@"', "bash", *serve_args(tmp_path, *flags)])
    assert "open files" in line and "--ssd-region-size" in line and "ulimit -n" in line
    assert not list((tmp_path / "ssd").glob("region-*")), "a refused start left region files behind"
    # Under a soft limit that the hard one allows to raise, the daemon raises it and starts.
    sock = tmp_path / "cli" / "kv.sock"
    proc = procs.start(["bash", "-c", 'ulimit -Sn 200 && exec "$@"', "bash", *serve_args(tmp_path, *flags)],
                       sock, tmp_path / "soft.log")
    try:
        with Client(proc.target) as kv:
            assert int(ssd_of(kv.stats()).capacity_bytes) == 16 << 20
    finally:
        assert proc.stop() == 0


async def test_an_index_snapshot_that_is_a_directory_is_ignored_and_the_log_scanned(tmp_path: Path, caplog):
    """docs/tiers.md: an unreadable snapshot is ignored and the log is scanned. A directory
    in its place (an operator's mistake, a volume mounted at the wrong path) is one."""
    chains = [chain(24, salt) for salt in range(3)]
    config = ssd_config(tmp_path)
    await fill(config, chains)
    snapshot = tmp_path / "ssd" / "index.snapshot"
    snapshot.unlink()
    snapshot.mkdir()
    await assert_recovers(config, chains)  # started, scanned the log, served every block
    assert "index.snapshot" in caplog.text and "scanning the log" in caplog.text
    assert snapshot.is_dir()  # left for the operator: not ours to remove
    assert not (tmp_path / "ssd" / "index.snapshot.tmp").exists()  # the snapshot not written leaves nothing
