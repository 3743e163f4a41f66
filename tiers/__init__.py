"""Tier implementations (the data plane): where block bytes live and how they move."""

from kvstore.core.tier import Slot, Tier
from kvstore.tiers.copiers import make_copier
from kvstore.tiers.host import HostTier

__all__ = ["HostTier", "Slot", "Tier", "make_copier"]
