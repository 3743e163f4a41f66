"""Conversions between the proto messages and kvstore's own types, written once for the
SDK and the daemon: `KVLayout` <-> `Layout` (with its KV groups), and tier names <-> the `Tier` enum.

Tier names are the ones config, stats and events use ("hbm", "host", "ssd", "memory");
the enum is what Lookup, Prefetch and the local planes carry.
"""

from __future__ import annotations

from kvstore.layout import DEFAULT_KV_LAYOUT, KVGroup, KVLayout, group_kind
from kvstore.v1 import kvstore_pb2

TIER_BY_NAME: dict[str, kvstore_pb2.Tier] = {
    "hbm": kvstore_pb2.TIER_HBM,
    "host": kvstore_pb2.TIER_HOST,
    "ssd": kvstore_pb2.TIER_SSD,
    "memory": kvstore_pb2.TIER_MEMORY,
}
TIER_NAMES: dict[kvstore_pb2.Tier, str] = {value: name for name, value in TIER_BY_NAME.items()}


def unknown_tier_message(value: int, memory_tiers: list[str]) -> str:
    """What to say when a request names a `Tier` value the daemon does not know (proto3
    keeps unknown enum values as plain numbers)."""
    known = ", ".join(kvstore_pb2.Tier.Name(v) for v in TIER_NAMES)
    this = ", ".join(f"{kvstore_pb2.Tier.Name(TIER_BY_NAME[n])} ({n})" for n in memory_tiers if n in TIER_BY_NAME)
    return (f"tier {value} is not a Tier value; use TIER_UNSPECIFIED (the daemon's top tier) or one of {known}; "
            f"this daemon's memory tiers: {this}")


def layout_to_proto(layout: KVLayout) -> kvstore_pb2.Layout:
    return kvstore_pb2.Layout(
        model=layout.model,
        revision=layout.revision,
        lora_id=layout.lora_id,
        dtype=layout.dtype,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size_tokens=layout.block_size_tokens,
        kv_layout=layout.kv_layout,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp_size,
        block_bytes=layout.block_bytes,
        groups=[kvstore_pb2.LayoutGroup(name=g.name, kind=g.kind.value, dtype=g.dtype, shape=g.shape,
                                        block_bytes=g.block_bytes, window_tokens=g.window_tokens)
                for g in layout.groups],
        kv_codec=layout.kv_codec,
    )


def layout_from_proto(msg: kvstore_pb2.Layout) -> KVLayout:
    """The layout a message names; unset `kv_layout` and `tp_size` take their defaults,
    as a client written from the proto alone leaves them."""
    return KVLayout(
        model=msg.model,
        revision=msg.revision,
        lora_id=msg.lora_id,
        dtype=msg.dtype,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        block_size_tokens=msg.block_size_tokens,
        kv_layout=msg.kv_layout or DEFAULT_KV_LAYOUT,
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size or 1,
        block_bytes=msg.block_bytes,
        groups=tuple(KVGroup(name=g.name, kind=group_kind(g.kind), dtype=g.dtype, shape=tuple(g.shape),
                             block_bytes=g.block_bytes, window_tokens=g.window_tokens) for g in msg.groups),
        kv_codec=msg.kv_codec,
    )
