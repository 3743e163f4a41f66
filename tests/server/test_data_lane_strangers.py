"""The data lane under strangers (SECURITY.md, *The data lane*): connections that never
say hello cannot take the slots of authenticated ones, and a client that cannot get a
lane connection moves its bytes through gRPC with the same results (docs/net.md).
Real daemon, real sockets, the real SDK."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from conftest import SMALL_LAYOUT, daemon_in_thread, make_config

from kvstore.client import Client
from kvstore.server.auth import new_token

LAYOUT = SMALL_LAYOUT
FLOOD = 300


def token_file(tmp_path: Path) -> tuple[str, str]:
    token, digest = new_token()
    path = tmp_path / "tokens.toml"
    path.write_text(f'[[tenant]]\nname = "alpha"\nrole = "client"\ntokens = ["{digest}"]\n')
    os.chmod(path, 0o600)
    return str(path), token


def chain(n: int, seed: int) -> tuple[list[int], list[bytes]]:
    rng = np.random.default_rng(seed)
    toks = [seed * 100_000 + i for i in range(n * LAYOUT.block_size_tokens)]
    return toks, [rng.integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8).tobytes() for _ in range(n)]


def lane_address(running) -> tuple[str, int]:
    endpoint = running.daemon.data_lane.endpoints()[0].address
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


@contextlib.contextmanager
def silent_connections(address: tuple[str, int], n: int) -> Iterator[list[socket.socket]]:
    """`n` TCP connections to the lane that never send a byte."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(address, timeout=5))
        yield socks
    finally:
        for s in socks:
            s.close()


def test_a_flood_of_silent_connections_takes_no_slot_from_a_client(tmp_path: Path) -> None:
    path, token = token_file(tmp_path)
    with daemon_in_thread(make_config(tmp_path, auth_token_file=path)) as running:
        with silent_connections(lane_address(running), FLOOD):
            toks, blocks = chain(6, seed=1)
            with Client(running.tcp_target, token=token, data_plane="auto", timeout_s=10) as kv:
                assert kv.data_plane_in_use == "lane"
                assert kv.put(LAYOUT, toks, blocks).stored == 6
                assert [bytes(b) for b in kv.fetch(LAYOUT, toks)] == blocks
                stats = kv.data_lane_stats
                # The client's own connections got slots: its bytes went on the lane.
                assert stats is not None and stats.bytes_sent and stats.bytes_received


def test_a_client_refused_a_lane_connection_completes_through_grpc(tmp_path: Path) -> None:
    path, token = token_file(tmp_path)
    cfg = make_config(tmp_path, auth_token_file=path, data_lane_max_connections=2)
    with daemon_in_thread(cfg) as running:
        toks, blocks = chain(6, seed=2)
        # Another client holds both slots with authenticated, idle connections.
        with Client(running.tcp_target, token=token, data_plane="lane", data_lane_connections=2) as holder:
            assert holder.put(LAYOUT, *chain(4, seed=3)).stored == 4
            with silent_connections(lane_address(running), FLOOD), \
                    Client(running.tcp_target, token=token, data_plane="auto", timeout_s=10) as kv:
                assert kv.put(LAYOUT, toks, blocks).stored == 6
                assert [bytes(b) for b in kv.fetch(LAYOUT, toks)] == blocks
                assert kv.lookup(LAYOUT, toks).num_blocks == 6
                stats = kv.data_lane_stats
                assert stats is None or (stats.bytes_sent, stats.bytes_received) == (0, 0)
