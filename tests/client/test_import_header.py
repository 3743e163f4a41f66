"""`kvstore import` of files whose header is not what `kvstore export` writes: wrong
types, nesting, bytes that are not UTF-8. Each is one line on stderr and exit 1, with
nothing sent to the daemon; a real export still imports."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from kvstore.cli.main import main
from kvstore.client import Client
from kvstore.client.export import MAGIC

LAYOUT = {"model": "m", "dtype": "float16", "num_layers": 1, "num_kv_heads": 1, "head_dim": 1,
          "block_size_tokens": 1}


def export_file(path: Path, header: bytes) -> Path:
    path.write_bytes(MAGIC + struct.pack("<I", len(header)) + header + b"E" + struct.pack("<Q", 0))
    return path


HEADERS = {
    "a list, not an object": b"[1, 2]",
    "layout is a list": json.dumps({"namespace_id": "00", "layout": [1], "block_bytes": 4}).encode(),
    "layout is text": json.dumps({"namespace_id": "00", "layout": "m", "block_bytes": 4}).encode(),
    "namespace_id is a number": json.dumps({"namespace_id": 7, "layout": LAYOUT, "block_bytes": 4}).encode(),
    "block_bytes is text": json.dumps({"namespace_id": "00", "layout": LAYOUT, "block_bytes": "4"}).encode(),
    "block_bytes is infinite": b'{"namespace_id": "00", "layout": {}, "block_bytes": 1e999}',
    "block_bytes is true": json.dumps({"namespace_id": "00", "layout": LAYOUT, "block_bytes": True}).encode(),
    "a layout field of the wrong type": json.dumps(
        {"namespace_id": "00", "layout": {**LAYOUT, "num_layers": "two"}, "block_bytes": 4}).encode(),
    "a layout field missing": json.dumps(
        {"namespace_id": "00", "layout": {"model": "m"}, "block_bytes": 4}).encode(),
    "deep nesting": b"[" * 200_000 + b"]" * 200_000,
    "not UTF-8": b'{"namespace_id": "\xff"}',
    "not JSON": b"namespace_id = 00",
}


@pytest.mark.parametrize("case", HEADERS)
def test_import_of_a_damaged_header_is_one_line_and_exit_1(daemon_thread, tmp_path, capsys, case):
    path = export_file(tmp_path / "bad.kvx", HEADERS[case])
    code = main(["import", str(path), "--target", daemon_thread.tcp_target])
    err = capsys.readouterr().err
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore import: export header is damaged"), err
    with Client(daemon_thread.tcp_target) as kv:
        assert kv.stats().counters.puts == 0


def test_a_real_export_still_imports(daemon_thread, layout, tmp_path, capsys):
    t = daemon_thread.tcp_target
    tokens = list(range(layout.block_size_tokens * 2))
    with Client(t) as kv:
        kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(2)])
        ns = kv.lookup(layout, tokens).namespace_id.hex()
    path = tmp_path / "ns.kvx"
    assert main(["export", ns, str(path), "--target", t]) == 0
    capsys.readouterr()
    assert main(["import", str(path), "--target", t, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["blocks"] == 2
