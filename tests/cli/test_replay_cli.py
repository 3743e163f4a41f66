"""`kvstore replay`: its JSON keys, its table, its errors and its plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.cli.replay import main
from tests.traces import write_trace


@pytest.fixture
def single_blocks(tmp_path: Path) -> Path:
    # [1] [2] [1] [3] [2] [1], one block each
    return write_trace(tmp_path / "t.jsonl", [(i * 1000, [b]) for i, b in enumerate([1, 2, 1, 3, 2, 1])])


def test_cli_json_has_the_documented_keys(single_blocks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(single_blocks), "--policy", "lru", "--capacity-blocks", "2", "--opt", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("hit_ratio", "token_hit_ratio", "opt_hit_ratio", "requests", "lookups", "capacity_blocks"):
        assert key in out
    assert (out["requests"], out["lookups"], out["capacity_blocks"]) == (6, 6, 2)
    assert out["hit_ratio"] == pytest.approx(1 / 6) and out["opt_hit_ratio"] == pytest.approx(2 / 6)


def test_cli_table_lists_every_policy(single_blocks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(single_blocks), "--policy", "lru,arc@none,hint-arc@noisy:0.3", "--capacity-fraction", "0.5,1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hit ratio" in out and "noisy:0.3" in out
    assert sum(line.startswith(("lru ", "arc ", "hint-arc ")) for line in out.splitlines()) == 6


def test_cli_rejects_bad_input(tmp_path: Path, single_blocks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert main([str(single_blocks), "--policy", "nope"]) == 2
    assert main([str(single_blocks), "--hints", "sometimes"]) == 2
    assert "kvstore replay:" in capsys.readouterr().err


def test_cli_plot_writes_a_png(single_blocks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "hit.png"
    assert main([str(single_blocks), "--plot", str(png), "--policy", "lru,arc", "--capacity-fraction", "0.34,0.67"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    captured = capsys.readouterr()
    assert "100.0%" in captured.err  # the progress bar reached the end
