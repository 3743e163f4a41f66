"""Tier implementations (the data plane): where block bytes live and how they move."""

from kvstore.core.tier import Slot, Tier
from kvstore.tiers.host import HostTier
from kvstore.tiers.segment import Segment

__all__ = ["HostTier", "Segment", "Slot", "Tier"]
