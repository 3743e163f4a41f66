"""A few seconds of bench/soak.py (the full run is `make soak`): it starts, mixes every
verb over both data planes, verifies bytes, and writes its result file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def short_soak(tmp_path: Path, ssd_capacity: str) -> dict:
    """Four seconds of bench/soak.py with four clients in one process; its result file."""
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--seconds", "4", "--clients", "4",
                        "--processes", "1", "--chains", "60", "--host-capacity", "4MiB", "--ssd-capacity",
                        ssd_capacity, "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


def test_short_soak_passes_and_reports(tmp_path: Path) -> None:
    doc = short_soak(tmp_path, "16MiB")
    for key in ("ops", "ops_per_s", "p99_us", "mismatches", "errors_by_status", "rss_start_bytes", "rss_end_bytes"):
        assert key in doc
    assert doc["passed"] and doc["mismatches"] == 0 and not doc["unexpected_errors"]
    assert doc["planes"] == {"local": 2, "grpc": 2}
    assert doc["blocks_verified"] > 0 and doc["ops_by_kind"].get("put", 0) > 0
    assert doc["daemon"]["host_demotions"] > 0  # the small host tier was under pressure


def test_short_soak_without_an_ssd_tier_drops_under_pressure(tmp_path: Path) -> None:
    """Host memory only, the default deployment: the full tier makes room by dropping
    victims in batches while leases, pins and deletes go on; every fetched byte verifies."""
    doc = short_soak(tmp_path, "0")
    assert doc["passed"] and doc["mismatches"] == 0 and not doc["unexpected_errors"]
    assert doc["blocks_verified"] > 0 and doc["daemon"]["evictions"] > 0 and doc["daemon"]["host_demotions"] == 0
