"""Shared-memory segments: mode 0600, header token, attach from another mapping, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstore.shm import AttachedSegment
from kvstore.tiers.segment import Segment, remove_stale_segments


def test_segment_is_private_and_attachable(tmp_path):
    seg = Segment(1 << 20, str(tmp_path))
    try:
        assert (os.stat(seg.path).st_mode & 0o777) == 0o600
        seg.data[100:105] = b"hello"
        other = AttachedSegment(seg.path, seg.token)
        assert bytes(other.data[100:105]) == b"hello"
        other.data[200:203] = b"abc"  # shared, both ways
        assert bytes(seg.data[200:203]) == b"abc"
        other.close()
        with pytest.raises(ValueError, match="token mismatch"):
            AttachedSegment(seg.path, b"\0" * 16)
    finally:
        seg.close()
    assert not os.path.exists(seg.path)


def test_stale_segments_of_dead_daemons_are_removed(tmp_path):
    child = subprocess.run(
        [sys.executable, "-c",
         "import os, sys; from kvstore.tiers.segment import Segment; s = Segment(4096, sys.argv[1]); "
         "print(s.path); os._exit(0)", str(tmp_path)],
        capture_output=True, text=True, check=True,
    )
    left = child.stdout.strip()
    assert os.path.exists(left)  # os._exit skipped every cleanup, as a crash would
    live = Segment(4096, str(tmp_path))
    try:
        assert remove_stale_segments(str(tmp_path)) == 1
        assert not os.path.exists(left) and os.path.exists(live.path)
    finally:
        live.close()
