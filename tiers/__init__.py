"""Tier implementations (the data plane) and their registry: where block bytes live and
how they move.

Primitives: `TIER_BUILDERS` (tier kind -> builder, top tier first), `TIER_KINDS`, the
kind names `HBM`, `HOST`, `SSD`, `TierSettings` (what the builders need, as plain
values), `build_tiers(settings) -> (tiers, absent)`, each a `Tier`; and what the daemon
calls around a build: `make_copier` (the copiers the store moves blocks with), and for
the host tier's segment directory `default_shm_dir`, `free_bytes`,
`remove_stale_segments`.

This registry is all the server imports from the data plane (tests/shared/test_layering.py):
what it needs of a built tier is in the contract, `kvstore.core.tier` (the host tier's
memory, for the shared-memory plane, is its `SharedWindow`). The implementations stay in
their modules.

A builder returns its tier, or the reason it is absent (not configured, or no CUDA
device), which stats and INFO show. The HBM and SSD modules are imported only by their
builders: the HBM tier imports torch, which a machine without CUDA never loads. The
registry is the one list of tier kinds the daemon knows; each kind is also the tier's
`name` (in config, stats, events and the proto's Tier enum, `kvstore.convert`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvstore.core.tier import Tier
from kvstore.tiers.copiers import make_copier
from kvstore.tiers.host import HostTier, SpacedHostTier
from kvstore.tiers.segment import default_shm_dir, free_bytes, remove_stale_segments

logger = logging.getLogger(__name__)

HBM, HOST, SSD = "hbm", "host", "ssd"


@dataclass(frozen=True, slots=True)
class TierSettings:
    """What the builders take: the daemon's tier settings, one field per config field."""

    host_capacity_bytes: int
    shm_dir: str | None = None
    host_spaces: bool = False  # one host segment per tenant (auth on), not one named segment
    hbm_capacity_bytes: int = 0  # 0: no HBM tier
    gpu: int = 0
    ssd_path: str = ""  # empty: no SSD tier
    ssd_capacity_bytes: int = 16 << 30
    ssd_region_size_bytes: int = 64 << 20
    ssd_io: str = "auto"
    ssd_io_threads: int = 4
    ssd_compress: bool = True


# A tier, or the reason it is absent.
TierBuilder = Callable[[TierSettings], "Tier | str"]


def build_hbm(settings: TierSettings) -> Tier | str:
    if settings.hbm_capacity_bytes <= 0:
        return "not configured (--hbm-capacity 0)"
    from kvstore.tiers.cuda import cuda_unavailable_reason

    reason = cuda_unavailable_reason(settings.gpu)
    if reason:
        logger.warning("hbm tier absent: %s", reason)
        return reason
    from kvstore.tiers.hbm import HbmTier

    return HbmTier(settings.hbm_capacity_bytes, device=settings.gpu)


def build_host(settings: TierSettings) -> Tier | str:
    if settings.host_spaces:
        return SpacedHostTier(settings.host_capacity_bytes)
    return HostTier(settings.host_capacity_bytes, shm_dir=settings.shm_dir)


def build_ssd(settings: TierSettings) -> Tier | str:
    if not settings.ssd_path:
        return "not configured (--ssd-path)"
    from kvstore.tiers.ssd import SsdTier

    return SsdTier(settings.ssd_path, settings.ssd_capacity_bytes, region_size=settings.ssd_region_size_bytes,
                   io_mode=settings.ssd_io, io_threads=settings.ssd_io_threads, compress=settings.ssd_compress)


TIER_BUILDERS: Mapping[str, TierBuilder] = {HBM: build_hbm, HOST: build_host, SSD: build_ssd}
TIER_KINDS: tuple[str, ...] = tuple(TIER_BUILDERS)


def build_tiers(settings: TierSettings,
                builders: Mapping[str, TierBuilder] = TIER_BUILDERS) -> tuple[list[Tier], list[tuple[str, str]]]:
    """The tiers `settings` ask for, top first, and (kind, reason) of the absent ones. If
    a builder fails, the tiers already built are closed before the error propagates."""
    built: list[Tier] = []
    absent: list[tuple[str, str]] = []
    try:
        for kind, build in builders.items():
            made = build(settings)
            if isinstance(made, str):
                absent.append((kind, made))
                continue
            built.append(made)
            if made.name != kind:
                raise ValueError(f"the {kind!r} builder made a tier named {made.name!r}")
    except BaseException:
        for tier in reversed(built):
            tier.close()
        raise
    return built, absent


__all__ = [
    "HBM", "HOST", "SSD", "TIER_BUILDERS", "TIER_KINDS", "Tier", "TierBuilder", "TierSettings", "build_hbm",
    "build_host", "build_ssd", "build_tiers", "default_shm_dir", "free_bytes", "make_copier",
    "remove_stale_segments",
]
