"""Layouts with KV groups through the SDK and a real daemon: put a block as its parts,
look up and fetch the longest prefix every group serves (sync and asyncio), the parts
a put needs checked before anything is sent, the layout through the proto and back,
old (ungrouped) layouts untouched on the same daemon, and `kvstore ls` showing groups."""

from __future__ import annotations

import json
import os

import pytest

from kvstore.cli.main import main
from kvstore.client import AsyncClient, Client, GroupKind, KVGroup, KVLayout
from kvstore.convert import layout_from_proto, layout_to_proto
from kvstore.errors import InvalidArgument
from kvstore.groups import needed
from kvstore.v1 import kvstore_pb2

BST = 4
HYBRID = KVLayout(
    model="test/sdk-hybrid", dtype="bfloat16", num_layers=3, num_kv_heads=1, head_dim=8, block_size_tokens=BST,
    groups=(
        KVGroup("full", GroupKind.FULL, "bfloat16", (2, 1, BST, 1, 8)),
        KVGroup("swa", GroupKind.SLIDING_WINDOW, "bfloat16", (2, 1, BST, 1, 8), window_tokens=9),
        KVGroup("ssm", GroupKind.STATE, "float32", (32,)),
    ),
)


def blocks_for(layout: KVLayout, n: int) -> list[dict[str, bytes]]:
    """Every group's part for every block (a put ignores the parts it does not need)."""
    return [{g.name: os.urandom(g.bytes_per_block) for g in layout.groups} for _ in range(n)]


def expected(layout: KVLayout, blocks: list[dict[str, bytes]], n: int) -> list[dict[str, bytes]]:
    out: list[dict[str, bytes]] = [{} for _ in range(n)]
    for need in needed(layout, n):
        name = layout.groups[need.group].name
        for j in range(need.start, need.stop):
            out[j][name] = blocks[j][name]
    return out


def test_the_layout_travels_through_the_proto_and_back():
    msg = layout_to_proto(HYBRID)
    assert [g.kind for g in msg.groups] == ["full", "sliding_window", "state"]
    again = layout_from_proto(kvstore_pb2.Layout.FromString(msg.SerializeToString()))
    assert again == HYBRID and again.namespace_id == HYBRID.namespace_id
    bad = kvstore_pb2.Layout()
    bad.CopyFrom(msg)
    bad.groups[0].kind = "linear"
    with pytest.raises(InvalidArgument, match="kind"):
        layout_from_proto(bad)


def test_put_lookup_and_fetch_of_parts(daemon_thread, layout):
    tokens = list(range(BST * 6))
    blocks = blocks_for(HYBRID, 6)
    plain = [os.urandom(layout.bytes_per_block) for _ in range(3)]
    with Client(daemon_thread.unix_target) as kv:
        result = kv.put(HYBRID, tokens, blocks)
        assert (result.stored, result.existing) == (6, 0)
        hit = kv.lookup(HYBRID, tokens + [9] * BST)
        assert hit.num_blocks == 6 and hit.namespace_id == HYBRID.namespace_id
        assert kv.fetch(HYBRID, tokens) == expected(HYBRID, blocks, 6)
        # A prompt that shares 4 blocks, then differs: no window or state there, no hit.
        assert kv.lookup(HYBRID, tokens[: 4 * BST] + [9] * BST).num_blocks == 0
        assert kv.fetch(HYBRID, tokens[: 4 * BST]) == []
        # An old layout on the same daemon is untouched: its bytes and its blocks.
        kv.put(layout, list(range(layout.block_size_tokens * 3)), plain)
        assert kv.fetch(layout, list(range(layout.block_size_tokens * 3))) == plain
        stats = kv.stats().counters
    assert stats.group_parts_stored == 6 + 2 + 1
    assert stats.group_bytes_skipped == (4 + 5) * 128  # 4 window parts and 5 states not kept, 128 bytes each


def test_a_put_missing_a_part_it_needs_sends_nothing(daemon_thread):
    tokens = list(range(BST * 3))
    blocks = blocks_for(HYBRID, 3)
    del blocks[2]["ssm"]
    with Client(daemon_thread.unix_target) as kv:
        with pytest.raises(InvalidArgument, match="block 2 lacks its part of group 'ssm'"):
            kv.put(HYBRID, tokens, blocks)
        blocks[2]["ssm"] = b"short"
        with pytest.raises(InvalidArgument, match="is 5 bytes"):
            kv.put(HYBRID, tokens, blocks)
        with pytest.raises(InvalidArgument, match="map group names"):
            kv.put(HYBRID, tokens, [b"x"] * 3)
        assert kv.stats().counters.puts == 0


async def test_the_asyncio_client_puts_and_fetches_parts(daemon):
    tokens = list(range(100, 100 + BST * 5))
    blocks = blocks_for(HYBRID, 5)
    async with AsyncClient(daemon.unix_target) as kv:
        await kv.put(HYBRID, tokens, blocks)
        assert (await kv.lookup(HYBRID, tokens)).num_blocks == 5
        assert await kv.fetch(HYBRID, tokens) == expected(HYBRID, blocks, 5)


def test_kvstore_ls_shows_each_group(daemon_thread, capsys):
    with Client(daemon_thread.unix_target) as kv:
        kv.put(HYBRID, list(range(BST * 4)), blocks_for(HYBRID, 4))
    assert main(["ls", "--target", daemon_thread.unix_target]) == 0
    out = capsys.readouterr().out
    assert "KV groups" in out and "sliding_window" in out and "state" in out and "2x1x4x1x8" in out
    assert main(["ls", "--target", daemon_thread.unix_target, "--json"]) == 0
    (ns,) = json.loads(capsys.readouterr().out)["namespaces"]
    assert [(g["name"], g["kind"], g["blocks"]) for g in ns["groups"]] == [
        ("full", "full", 4), ("swa", "sliding_window", 2), ("ssm", "state", 1)]
    assert ns["blocks"] == 4 and len(ns["groups"][0]["group_id"]) == 32
