"""Export and import of a namespace with KV groups, between two real daemons and through
the CLI: every part comes back where the puts that made it left it, so each prefix end
that hit on the old node hits on the new one with the same bytes, and one that missed
still misses; a damaged grouped file is refused."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from kvstore.cli.main import main
from kvstore.client import Client, GroupKind, KVGroup, KVLayout
from kvstore.client.admin import AdminClient
from kvstore.client.export import export_namespace, import_namespace
from kvstore.errors import InvalidArgument
from tests.conftest import daemon_in_thread, make_config

BST = 4
LAYOUT = KVLayout(
    model="test/export-hybrid", dtype="bfloat16", num_layers=3, num_kv_heads=1, head_dim=8, block_size_tokens=BST,
    groups=(
        KVGroup("full", GroupKind.FULL, "bfloat16", (2, 1, BST, 1, 8)),
        KVGroup("swa", GroupKind.SLIDING_WINDOW, "bfloat16", (2, 1, BST, 1, 8), window_tokens=9),
        KVGroup("ssm", GroupKind.STATE, "float32", (32,)),
    ),
)


def blocks_for(n: int) -> list[dict[str, bytes]]:
    return [{g.name: os.urandom(g.bytes_per_block) for g in LAYOUT.groups} for _ in range(n)]


def as_bytes(got: list[dict[str, object]]) -> list[dict[str, bytes]]:
    return [{k: bytes(v) for k, v in block.items()} for block in got]  # type: ignore[call-overload]


def fill(kv: Client) -> tuple[list[int], list[int]]:
    """Two conversations: one of puts ending at 3 and 7 blocks (a second turn), one of 5."""
    first = list(range(BST * 7))
    blocks = blocks_for(7)
    kv.put(LAYOUT, first[: 3 * BST], blocks[:3])
    kv.put(LAYOUT, first, blocks[3:], first_block=3)
    other = list(range(500, 500 + BST * 5))
    kv.put(LAYOUT, other, blocks_for(5))
    return first, other


def test_a_grouped_namespace_round_trips_between_daemons(daemon_thread, tmp_path: Path):
    with Client(daemon_thread.unix_target) as kv:
        first, other = fill(kv)
        # Where the old node hits: the ends of puts, and nothing between them.
        ends = {n: kv.lookup(LAYOUT, first[: n * BST]).num_blocks for n in range(1, 8)}
        assert ends == {1: 0, 2: 0, 3: 3, 4: 3, 5: 3, 6: 3, 7: 7}  # the longest end within
        want = {n: as_bytes(kv.fetch(LAYOUT, first[: n * BST])) for n in (3, 7)}
        want_other = as_bytes(kv.fetch(LAYOUT, other))
        parts_before = kv.stats().counters.group_parts_stored
    buf = io.BytesIO()
    with AdminClient(daemon_thread.unix_target) as admin:
        result = export_namespace(admin, LAYOUT.namespace_id, buf)
    assert (result.blocks, result.skipped) == (12, 0)
    # Every block's full part, each put's last two window parts and its state: 12 + 6 + 3 parts of 128 bytes.
    assert result.exported_bytes == (12 + 6 + 3) * 128
    with daemon_in_thread(make_config(tmp_path / "b")) as new:
        with AdminClient(new.unix_target) as admin:
            imported = import_namespace(admin, io.BytesIO(buf.getvalue()))
        assert (imported.blocks, imported.stored, imported.existing) == (12, 12, 0)
        with Client(new.unix_target) as kv:
            assert {n: kv.lookup(LAYOUT, first[: n * BST]).num_blocks for n in range(1, 8)} == ends
            assert {n: as_bytes(kv.fetch(LAYOUT, first[: n * BST])) for n in (3, 7)} == want
            assert as_bytes(kv.fetch(LAYOUT, other)) == want_other
            assert kv.stats().counters.group_parts_stored == parts_before
            # Importing again stores nothing new.
        with AdminClient(new.unix_target) as admin:
            again = import_namespace(admin, io.BytesIO(buf.getvalue()))
        assert (again.stored, again.existing) == (0, 12)


def test_the_cli_exports_and_imports_a_grouped_namespace(daemon_thread, tmp_path: Path, capsys):
    with Client(daemon_thread.unix_target) as kv:
        first, _ = fill(kv)
        want = as_bytes(kv.fetch(LAYOUT, first))
    path = tmp_path / "hybrid.kvx"
    assert main(["export", LAYOUT.namespace_id.hex(), str(path), "--target", daemon_thread.unix_target]) == 0
    assert "exported 12 blocks" in capsys.readouterr().out
    with daemon_in_thread(make_config(tmp_path / "b")) as new:
        assert main(["import", str(path), "--target", new.unix_target, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["blocks"], out["stored"]) == (12, 12)
        with Client(new.unix_target) as kv:
            assert as_bytes(kv.fetch(LAYOUT, first)) == want


def test_a_damaged_grouped_file_is_refused_and_keeps_what_verified(daemon_thread, tmp_path: Path):
    with Client(daemon_thread.unix_target) as kv:
        fill(kv)
    buf = io.BytesIO()
    with AdminClient(daemon_thread.unix_target) as admin:
        export_namespace(admin, LAYOUT.namespace_id, buf)
    data = bytearray(buf.getvalue())
    data[-200] ^= 0xFF  # inside a late record's part
    with daemon_in_thread(make_config(tmp_path / "b")) as new, AdminClient(new.unix_target) as admin:
        with pytest.raises(InvalidArgument, match="damaged"):
            import_namespace(admin, io.BytesIO(bytes(data)))
        # A version-1 magic on a grouped header is refused before anything is sent.
        v1 = bytes(data).replace(b"KVSTORE-EXPORT\nv2\n", b"KVSTORE-EXPORT\nv1\n", 1)
        with pytest.raises(InvalidArgument, match="version"):
            import_namespace(admin, io.BytesIO(v1))


def test_named_parts_are_checked_before_anything_is_stored(daemon_thread):
    from kvstore.convert import layout_to_proto

    hashes = [os.urandom(16) for _ in range(3)]
    part = bytes(128)
    with AdminClient(daemon_thread.unix_target) as admin:
        layout = layout_to_proto(LAYOUT)
        for spans, why in (([(0, 0, 3), (1, 1, 3)], "each of the layout's 3 groups"),
                           ([(0, 1, 3), (1, 1, 3), (2, 2, 3)], "must be \\[0, 3\\)"),
                           ([(0, 0, 3), (1, 2, 4), (2, 2, 3)], "spans blocks \\[2, 4\\)")):
            with pytest.raises(InvalidArgument, match=why):
                admin.put_parts(layout, hashes, b"", spans, [part] * 6)
        # Parts a window group's span names, fewer than the hit rules would keep: stored as named.
        resp = admin.put_parts(layout, hashes, b"", [(0, 0, 3), (1, 2, 3), (2, 2, 3)], [part] * 5)
        assert resp.stored == 3
    with Client(daemon_thread.unix_target) as kv:
        assert kv.stats().counters.group_parts_stored == 5
        assert kv.lookup(LAYOUT, block_hashes=hashes).num_blocks == 0  # the window needs blocks 1 and 2
