"""End-to-end block authentication (kvstore.client.block_auth) against a real daemon on
every plane: sealed blocks round-trip byte-exact, authenticated and plain namespaces
never share a block, and bytes that were not sealed under the tenant's key for that
place (forged, replayed at another position, or sealed under another key) are a miss
from that block on, never bytes handed to the caller."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import SMALL_LAYOUT

from kvstore.client import Client
from kvstore.client.block_auth import TAG_BYTES, AuthenticatedClient, BlockKey, seal, sealed_layout
from kvstore.errors import InvalidArgument
from kvstore.hashing import block_hashes, namespace_id

LAYOUT = SMALL_LAYOUT
N = 6


def chain(n: int, seed: int) -> tuple[list[int], list[bytes]]:
    rng = np.random.default_rng(seed)
    toks = [seed * 100_000 + i for i in range(n * LAYOUT.block_size_tokens)]
    return toks, [rng.integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.mark.parametrize("plane", ["local", "lane", "grpc"])
def test_sealed_blocks_round_trip_on_every_plane(daemon_thread, plane: str) -> None:
    target = daemon_thread.unix_target if plane == "local" else daemon_thread.tcp_target
    key = BlockKey.generate()
    toks, blocks = chain(N, seed=1)
    with Client(target, data_plane=plane) as kv:
        auth = AuthenticatedClient(kv, key)
        assert auth.put(LAYOUT, toks, blocks).stored == N
        assert auth.lookup(LAYOUT, toks).num_blocks == N
        got = auth.fetch(LAYOUT, toks)
        assert [bytes(g) for g in got] == blocks
        assert auth.put(LAYOUT, toks[: 2 * LAYOUT.block_size_tokens], blocks[:2]).existing == 2
        assert (auth.stats.sealed_blocks, auth.stats.verified_blocks, auth.stats.rejected_blocks) == (N + 2, N, 0)
        # The daemon holds payload || tag in a namespace of its own.
        wire = auth.sealed_layout(LAYOUT)
        assert wire.bytes_per_block == LAYOUT.bytes_per_block + TAG_BYTES
        assert kv.lookup(wire, toks).num_blocks == N


def test_plain_and_authenticated_namespaces_never_share(daemon_thread) -> None:
    toks, blocks = chain(N, seed=2)
    k1, k2 = BlockKey.generate("k1"), BlockKey.generate("k2")
    with Client(daemon_thread.tcp_target) as kv:
        assert kv.put(LAYOUT, toks, blocks).stored == N
        one, two = AuthenticatedClient(kv, k1), AuthenticatedClient(kv, k2)
        assert one.lookup(LAYOUT, toks).num_blocks == 0 and one.fetch(LAYOUT, toks) == []
        assert one.put(LAYOUT, toks, blocks).stored == N  # not `existing`: another namespace
        assert two.lookup(LAYOUT, toks).num_blocks == 0  # another key id, another namespace
        # The same key id with other key bytes (a key rotated without a new id): every
        # block is refused, none is served.
        impostor = AuthenticatedClient(kv, BlockKey(os.urandom(32), "k1"))
        assert impostor.lookup(LAYOUT, toks).num_blocks == N
        assert impostor.fetch(LAYOUT, toks) == [] and impostor.stats.rejected_blocks == 1


def test_bytes_not_sealed_for_their_place_are_a_miss_from_there_on(daemon_thread) -> None:
    """What a compromised daemon, a stolen node credential or any writer of the sealed
    namespace can do to it: put bytes of its own under the tenant's chain. Without the
    key every block it makes, or moves from another position, fails its tag."""
    key = BlockKey.generate()
    _, blocks = chain(N, seed=3)
    wire = sealed_layout(LAYOUT, key)
    ns = namespace_id(wire)
    for n, what in enumerate(("forged payload", "tag made without the key", "a valid block of another position",
                              "random bytes")):
        toks = [n * 10_000_000 + i for i in range(N * LAYOUT.block_size_tokens)]  # a chain per case
        hashes = block_hashes(ns, toks, LAYOUT.block_size_tokens)
        good = [seal(key, ns, h, b) for h, b in zip(hashes, blocks)]
        bad = {"forged payload": _flip(good[3]),
               "tag made without the key": seal(BlockKey.generate(), ns, hashes[3], blocks[3]),
               "a valid block of another position": good[4],
               "random bytes": bytearray(os.urandom(wire.bytes_per_block))}[what]
        with Client(daemon_thread.tcp_target) as kv:
            # The writer has no key: it stores what it likes under the sealed layout.
            assert kv.put(wire, toks, [*good[:3], bad, *good[4:]]).stored == N
            auth = AuthenticatedClient(kv, key)
            got = auth.fetch(LAYOUT, toks)
            assert [bytes(g) for g in got] == blocks[:3], what
            assert auth.stats.rejected_blocks == 1, what


def _flip(block: bytearray) -> bytearray:
    out = bytearray(block)
    out[0] ^= 1
    return out


def test_keys_and_layouts_are_checked(tmp_path) -> None:
    with pytest.raises(InvalidArgument):
        BlockKey(b"short")
    with pytest.raises(InvalidArgument):
        BlockKey(os.urandom(32), "bad id!")
    path = tmp_path / "key"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o644)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        BlockKey.from_file(str(path))
    path.chmod(0o600)
    assert len(BlockKey.from_file(str(path)).key) == 32


def test_a_batch_written_in_place_is_sealed_without_a_copy_and_serves_one_put(daemon_thread) -> None:
    key = BlockKey.generate()
    toks, blocks = chain(N, seed=4)
    with Client(daemon_thread.unix_target) as kv:
        auth = AuthenticatedClient(kv, key)
        batch = auth.batch(LAYOUT, N)
        for dst, src in zip(batch.payloads, blocks):
            dst[:] = src
        assert auth.put(LAYOUT, toks, batch).stored == N
        assert [bytes(g) for g in auth.fetch(LAYOUT, toks)] == blocks
        with pytest.raises(InvalidArgument, match="one put"):
            auth.put(LAYOUT, toks, batch)
