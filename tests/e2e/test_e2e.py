"""End to end: `python server.py` as a subprocess, driven by the SDK and the CLI,
then stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.client import Client, KVLayout

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, timeout=60,
                          env=env, cwd=ROOT)


@pytest.fixture
def server(tmp_path):
    sock = tmp_path / "kv.sock"
    port = _free_port()
    log = tmp_path / "daemon.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "server.py"), "--listen", f"unix:{sock},127.0.0.1:{port}",
             "--host-capacity", "32MiB", "--grace-s", "2",
             # port 0: a daemon from `make run` (or another test run) may hold the default 9464
             "--metrics-listen", "127.0.0.1:0"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
    deadline = time.monotonic() + 30
    while _cli("health", "--target", f"unix:{sock}").returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"daemon did not start: {log.read_text()}")
        time.sleep(0.2)
    yield proc, f"unix:{sock}", f"127.0.0.1:{port}", sock
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sdk_and_cli_against_a_real_daemon(server):
    proc, unix_target, tcp_target, sock = server
    layout = KVLayout(model="e2e", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64, block_size_tokens=16)
    tokens = list(range(16 * 6))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(6)]
    with Client(tcp_target) as kv:
        kv.put(layout, tokens, blocks[:4])
        hit = kv.lookup(layout, tokens)
        kv.put(layout, tokens, blocks[hit.num_blocks:], first_block=hit.num_blocks)
    with Client(unix_target) as kv:  # read-your-writes from another client and transport
        hit = kv.lookup(layout, tokens)
        assert hit.num_blocks == 6
        assert kv.fetch(layout, tokens[: hit.num_tokens]) == blocks
        kv.lookup(layout, list(range(5000, 5000 + 32)))  # two missed blocks

    health = _cli("health", "--target", tcp_target, "--json")
    assert health.returncode == 0 and json.loads(health.stdout)["status"] == "SERVING"

    stats = _cli("stats", "--json", env={**os.environ, "KVSTORE_TARGET": unix_target})
    assert stats.returncode == 0, stats.stderr
    data = json.loads(stats.stdout)
    host = next(t for t in data["tiers"] if t["name"] == "host")
    assert host["capacity_bytes"] == 32 << 20
    assert host["used_bytes"] == 6 * layout.bytes_per_block
    assert host["blocks"] == 6
    assert data["counters"]["hit_blocks"] == 4 + 6 and data["counters"]["miss_blocks"] == 2 + 0 + 2
    assert host["hits"] == 10 and host["misses"] == 4

    table = _cli("stats", "--target", tcp_target)
    assert table.returncode == 0
    assert "host" in table.stdout and "32.00MiB" in table.stdout and "block hit ratio" in table.stdout

    info = _cli("info", "tiers", "--target", tcp_target)
    assert "# Tiers" in info.stdout and "tier_host_used_bytes_human:" in info.stdout

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not sock.exists()
    down = _cli("health", "--target", tcp_target, "--timeout", "1")
    assert down.returncode == 1


def test_cli_exit_codes_without_a_daemon(tmp_path):
    missing = _cli("stats", "--target", f"unix:{tmp_path}/none.sock", "--timeout", "1")
    assert missing.returncode == 1 and "unavailable" in missing.stderr
    assert _cli("stats", "--bogus").returncode == 2


def test_daemon_refuses_bad_config_with_a_clear_message(tmp_path):
    bad = subprocess.run([sys.executable, str(ROOT / "server.py"), "--host-capacity", "lots"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "host_capacity" in bad.stderr and "not a size" in bad.stderr
