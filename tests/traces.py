"""Small Mooncake-format traces written for a test."""

from __future__ import annotations

import json
from pathlib import Path


def write_trace(path: Path, requests: list[tuple[int, list[int]]], input_length: int | None = None) -> Path:
    """Requests as (timestamp ms, hash ids); input length = 512 tokens a block unless given."""
    with path.open("w") as f:
        for ts, ids in requests:
            length = input_length if input_length is not None else 512 * len(ids)
            f.write(json.dumps({"timestamp": ts, "input_length": length, "output_length": 10, "hash_ids": ids}) + "\n")
    return path
