"""The data lane between two network namespaces joined by a veth pair: a daemon in one,
an SDK client in the other reaching it by its veth address (so `auto` picks the lane,
not shared memory), put and fetch byte-exact on the lane and on gRPC, with a token.
Needs root and iproute2; skipped (with the reason) where namespaces cannot be made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.server.auth import new_token
from tests import procs

PORT = 50051


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def two_namespaces() -> Iterator[tuple[str, str, str, str]]:
    """(client namespace, daemon namespace, client address, daemon address); removed after."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (`ip`)")
    tag = f"kvl{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    made: list[str] = []
    try:
        for name in (a, b):
            if _ip("netns", "add", name, check=False).returncode != 0:
                pytest.skip("cannot create network namespaces here (`ip netns add` failed)")
            made.append(name)
        _ip("link", "add", f"{tag}x", "netns", a, "type", "veth", "peer", "name", f"{tag}y", "netns", b)
        for ns, dev, addr in ((a, f"{tag}x", "10.231.7.1/24"), (b, f"{tag}y", "10.231.7.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, "10.231.7.1", "10.231.7.2"
    finally:
        for name in made:  # removing a namespace removes its end of the veth pair, and the pair
            _ip("netns", "del", name, check=False)


CLIENT = textwrap.dedent("""
    import os, sys
    from kvstore.client import Client
    from kvstore.layout import KVLayout

    target, token = sys.argv[1], sys.argv[2]
    layout = KVLayout(model="netns", dtype="float16", num_layers=4, num_kv_heads=4, head_dim=64,
                      block_size_tokens=64)  # 256 KiB blocks
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(12)]
    tokens = list(range(12 * 64))
    with Client(target, token=token) as lane, Client(target, token=token, data_plane="grpc") as grpc_kv:
        assert lane.data_plane_in_use == "lane", lane.data_plane_in_use
        put = lane.put(layout, tokens, blocks)
        assert (put.stored, put.existing) == (12, 0), put
        assert [bytes(b) for b in lane.fetch(layout, tokens)] == blocks
        assert [bytes(b) for b in grpc_kv.fetch(layout, tokens)] == blocks
        again = grpc_kv.put(layout, tokens, blocks)
        assert (again.stored, again.existing) == (0, 12)
        stats = lane.data_lane_stats
        assert stats.bytes_sent == 12 * layout.bytes_per_block and stats.blocks_rejected == 0
    print("OK")
""")


def test_put_and_fetch_on_the_lane_between_two_network_namespaces(two_namespaces, tmp_path: Path):
    client_ns, daemon_ns, _, daemon_addr = two_namespaces
    remote_token, remote_hash = new_token()
    _, ops_hash = new_token()
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[tenant]]\nname = "remote"\nrole = "client"\ntokens = ["{remote_hash}"]\n\n'
                      f'[[tenant]]\nname = "ops"\nrole = "admin"\ntokens = ["{ops_hash}"]\n')
    os.chmod(tokens, 0o600)
    sock = tmp_path / "kv.sock"
    args = procs.daemon_args(sock, "--listen", f"unix:{sock},{daemon_addr}:{PORT}",
                             "--data-lane-listen", f"{daemon_addr}:0", "--auth-token-file", str(tokens),
                             "--unix-socket-tenant", "ops", "--insecure-remote", "--host-capacity", "64MiB",
                             "--shm-dir", str(tmp_path))
    daemon = procs.start(["ip", "netns", "exec", daemon_ns, *args], sock, tmp_path / "daemon.log")
    try:
        out = subprocess.run(["ip", "netns", "exec", client_ns, sys.executable, "-c", CLIENT,
                              f"{daemon_addr}:{PORT}", remote_token],
                             capture_output=True, text=True, timeout=120, env=procs.clean_env(),
                             cwd=Path(__file__).resolve().parents[2])
        assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr
    finally:
        assert daemon.stop() == 0, (tmp_path / "daemon.log").read_text()[-2000:]
