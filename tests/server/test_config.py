"""Config precedence, sizes, bounds, and the daemon's refusals to start."""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest

from kvstore.errors import ConfigError
from kvstore.server.config import load_config
from kvstore.server.daemon import Daemon
from kvstore.server.listen import parse_listen
from kvstore.units import human_bytes, parse_size


def test_sizes():
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512 MiB") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("10kb") == 10_000
    assert parse_size(123) == 123
    for bad in ("", "GiB", "4 GiBs", "-1", "1e9", True):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert human_bytes(1536) == "1.50KiB"


def test_precedence_defaults_file_env_flags(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('host_capacity = "1GiB"\nmax_blocks_per_call = 100\npolicy = "lru"\n')
    cfg = load_config({"config": str(path)}, env={})
    assert cfg.host_capacity == 1 << 30 and cfg.max_blocks_per_call == 100
    cfg = load_config({"config": str(path)}, env={"KVSTORE_HOST_CAPACITY": "2GiB"})
    assert cfg.host_capacity == 2 << 30 and cfg.max_blocks_per_call == 100
    cfg = load_config({"config": str(path), "host_capacity": "3GiB"}, env={"KVSTORE_HOST_CAPACITY": "2GiB"})
    assert cfg.host_capacity == 3 << 30
    assert load_config({}, env={}).host_capacity == "auto"


def test_the_config_gives_the_store_its_limits_and_migration(tmp_path):
    from kvstore.core.types import WritePolicy

    cfg = load_config({"max_blocks_per_call": 100, "max_leases": 500, "max_leases_per_tenant": 50,
                       "ssd_write_policy": "back", "put_tier": "hbm", "migration_batch_blocks": 8}, env={})
    limits = cfg.store_limits()
    assert (limits.max_blocks_per_call, limits.max_leases) == (100, 500)
    # Without a token file there is one tenant: the per-tenant cap is not applied.
    assert limits.max_leases_per_tenant is None
    tokens = tmp_path / "tokens.toml"
    assert replace(cfg, auth_token_file=str(tokens)).store_limits().max_leases_per_tenant == 50
    migration = cfg.migration(["hbm", "host"])
    assert (migration.write_policy, migration.put_tier, migration.batch_blocks) == (WritePolicy.BACK, "hbm", 8)
    # A put tier that was not built (no HBM here): puts land where there is room.
    assert cfg.migration(["host"]).put_tier == "auto"


def test_listen_list_from_env_and_section_table(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('[kvstore]\nlisten = ["unix:/run/x.sock", "127.0.0.1:7000"]\n')
    assert load_config({"config": str(path)}, env={}).listen == ("unix:/run/x.sock", "127.0.0.1:7000")
    assert load_config({}, env={"KVSTORE_LISTEN": "127.0.0.1:1, 127.0.0.1:2"}).listen == ("127.0.0.1:1", "127.0.0.1:2")


@pytest.mark.parametrize(
    "flags, match",
    [
        ({"host_capacity": "lots"}, "not a size"),
        ({"host_capacity": "10KiB"}, "out of bounds"),
        ({"max_blocks_per_call": "0"}, "out of bounds"),
        ({"max_blocks_per_call": "many"}, "bad value"),
        ({"log_level": "loud"}, "expected one of"),
        ({"chunk_bytes": "16MiB"}, "must leave room"),
        ({"policy": "nope"}, None),
    ],
)
def test_bad_values_name_the_field(flags, match, tmp_path):
    if match is None:  # an unknown policy is caught when the daemon builds the store
        cfg = load_config({**flags, "listen": f"unix:{tmp_path}/s.sock"}, env={})
        with pytest.raises(ConfigError, match="unknown eviction policy 'nope'"):
            import asyncio

            asyncio.run(Daemon(cfg).start())
        return
    with pytest.raises(ConfigError, match=match):
        load_config(flags, env={})


def test_bad_config_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({"config": str(tmp_path / "missing.toml")}, env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("host_capacity = \n")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config({"config": str(bad)}, env={})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("host_capacty = 5\n")
    with pytest.raises(ConfigError, match="unknown setting.*host_capacty"):
        load_config({"config": str(unknown)}, env={})


@pytest.mark.parametrize(
    "addr, match",
    [
        ("localhost", "neither"),
        ("127.0.0.1:http", "not a number"),
        ("127.0.0.1:70000", "65535"),
        ("unix:", "no socket path"),
    ],
)
def test_bad_listen_addresses(addr, match):
    with pytest.raises(ConfigError, match=match):
        parse_listen(addr)


def test_listen_addresses_parse():
    assert parse_listen("0.0.0.0:1").host == "0.0.0.0"
    assert parse_listen("[::1]:5").host == "::1"
    assert parse_listen("unix:///tmp/x.sock").path == "/tmp/x.sock"


async def test_refuses_a_port_in_use(config):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match="in use"):
            await Daemon(replace(config, listen=(f"127.0.0.1:{port}",))).start()
    finally:
        holder.close()


async def test_a_failed_start_leaves_nothing_behind(config, tmp_path):
    """A start that fails late (the TCP address is taken, after the tiers, the store, the
    metrics endpoint and the Unix socket were made) unwinds all of it: no socket file, no
    shared-memory segment, the metrics port closed, and the next start succeeds."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    shm = tmp_path / "shm"
    shm.mkdir()
    sock = tmp_path / "late.sock"
    cfg = replace(config, shm_dir=str(shm), listen=(f"unix:{sock}", f"127.0.0.1:{port}"))
    failed = Daemon(cfg)
    try:
        with pytest.raises(ConfigError, match="in use"):
            await failed.start()
    finally:
        holder.close()
    assert not sock.exists()
    assert list(shm.iterdir()) == []
    host, _, metrics_port = failed.metrics_address.rpartition(":")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(metrics_port)), timeout=5).close()
    d = Daemon(replace(cfg, listen=(f"unix:{sock}", "127.0.0.1:0")))
    await d.start()
    await d.stop(grace_s=0)
    assert not sock.exists() and list(shm.iterdir()) == []


async def test_refuses_a_live_unix_socket_and_replaces_a_stale_one(daemon, config, tmp_path):
    with pytest.raises(ConfigError, match="in use by another running daemon"):
        await Daemon(replace(config, listen=(daemon.unix_target,))).start()
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # bound but nobody listens: what a killed daemon leaves behind
    d = Daemon(replace(config, listen=(f"unix:{stale}",)))
    await d.start()
    assert (stale.stat().st_mode & 0o777) == 0o600
    await d.stop(grace_s=0)
    assert not stale.exists()


async def test_refuses_more_capacity_than_the_machine_has(config):
    with pytest.raises(ConfigError, match="more than this machine's available memory"):
        await Daemon(replace(config, host_capacity=1 << 50)).start()


@pytest.mark.parametrize("field, value, match", [("ssd_path", "/proc/kvstore-ssd", "cannot use ssd_path"),
                                                 ("shm_dir", "/nonexistent-shm-dir", "cannot use shm_dir")])
async def test_unusable_paths_are_refused_with_the_setting_named(config, field, value, match):
    with pytest.raises(ConfigError, match=match):
        await Daemon(replace(config, **{field: value})).start()
