"""Tier implementations (the data plane): where block bytes live and how they move."""

from kvstore.core.tier import Slot, Tier
from kvstore.tiers.host import HostTier
from kvstore.tiers.segment import Segment, default_shm_dir, free_bytes, remove_stale_segments

__all__ = ["HostTier", "Segment", "Slot", "Tier", "default_shm_dir", "free_bytes", "remove_stale_segments"]
