"""The SSD tier (package `kvstore.tiers.ssd`): a log of large regions on a directory.

Everything lives in `tier` for now; this package exports what callers import.
"""

from __future__ import annotations

from kvstore.tiers.ssd.tier import GEOMETRY_NAME, RECORD, SNAPSHOT_NAME, SsdTier, probe_direct_io

__all__ = ["GEOMETRY_NAME", "RECORD", "SNAPSHOT_NAME", "SsdTier", "probe_direct_io"]
