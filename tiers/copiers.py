"""Copiers: how one block's bytes move between two addressable tiers.

One copier per (source tier, destination tier) pair, chosen once when the store is
built (`make_copier`), after vLLM's per-medium transfer handlers:

- `MemcpyCopier`: both tiers expose host views (host segment, memory): one memcpy.
- `HostToHbmCopier` / `HbmToHostCopier` (in kvstore.tiers.hbm): DMA straight between the
  host view and the device slab on the HBM tier's FIFO streams, completion observed
  through CUDA events; no bounce through a Python bytes object.
- `BounceCopier` (in kvstore.core.tier, the store's default): anything else: `read`
  into bytes, then `write`.

The SSD tier is not addressable and has no copier: blocks reach it through its own
`put_block` (encode, append) and leave it through `get_block` (read, decode).

The `Copier` contract is in `kvstore.core.tier`. A copier moves bytes only; the store verifies checksums on either side and publishes
the new location after `copy` returned (for CUDA copies: after the event completed).
"""

from __future__ import annotations

from kvstore.core.tier import BounceCopier, Copier, Slot, Tier

__all__ = ["BounceCopier", "MemcpyCopier", "make_copier"]


class MemcpyCopier(Copier):
    name = "memcpy"

    async def copy(self, src: Tier, src_slot: Slot, dst: Tier, dst_slot: Slot, nbytes: int) -> None:
        sv = src.view(src_slot, nbytes)
        dv = dst.view(dst_slot, nbytes)
        if sv is None or dv is None:
            raise TypeError(f"memcpy needs host views of both {src.name} and {dst.name}")
        dv[:] = sv


def make_copier(src: Tier, dst: Tier) -> Copier:
    """The copier for moving blocks from `src` to `dst` (both addressable)."""
    if (copier := dst.copier_from_host(src)) is not None:
        return copier
    if (copier := src.copier_to_host(dst)) is not None:
        return copier
    if src.has_host_view and dst.has_host_view:
        return MemcpyCopier()
    return BounceCopier()
