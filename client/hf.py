"""Hugging Face transformers adapter: store and restore a model's KV cache by token prefix.

A transformers generate loop can skip the part of its prefill that kvstore already holds:

    from kvstore.client import Client
    from kvstore.client.hf import layout_for_model, restore_prefix, store_prefix

    layout = layout_for_model(model, model_id="org/name", block_size_tokens=32)
    with Client(target) as kv:
        restored = restore_prefix(kv, layout, prompt_ids, config=model.config)
        out = model.generate(prompt_ids_tensor, past_key_values=restored.cache, ...)
        store_prefix(kv, layout, prompt_ids, out.past_key_values)

Primitives: `layout_for_model` (the namespace from the model config), `pack_blocks` /
`unpack_blocks` (cache <-> kvstore block payloads), `store_prefix`, `restore_prefix`, and
`prefill` (restore, run the rest, store the new blocks).

One kvstore block holds `block_size_tokens` tokens of every layer's K and V, laid out
`[L, 2, H, B, D]` (layer, K/V, KV head, token, head dim), the order a transformers cache
keeps per layer (`[batch, H, seq, D]`), so packing is one gather per block. Only batch
row 0 is stored: a prefix cache is keyed by one token sequence. Only full blocks are
stored, and a restore never covers the whole prompt: the last token is always computed,
because its logits are what the next step needs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.client.results import PutResult
from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout

logger = logging.getLogger(__name__)

KV_LAYOUT = "L,2,H,B,D"
DEFAULT_BLOCK_SIZE_TOKENS = 32


@dataclass(frozen=True, slots=True)
class RestoredPrefix:
    """What `restore_prefix` brought back: a cache holding `num_tokens` tokens (0 on a miss)."""

    cache: Any
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prefill that reused `reused_tokens` tokens from kvstore and stored `stored_blocks` new ones."""

    logits: torch.Tensor
    cache: Any
    reused_tokens: int
    stored_blocks: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_for_model(
    model: Any,
    *,
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
    model_id: str | None = None,
    revision: str = "",
    lora_id: str = "",
    dtype: torch.dtype | None = None,
) -> KVLayout:
    """The `KVLayout` of a transformers causal LM's cache.

    `model_id` defaults to the config's `_name_or_path`; give the hub id (and `revision`)
    explicitly when the model was loaded from a local path, so that copies of the same
    weights share blocks and different weights never do.
    """
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    name = model_id or getattr(config, "_name_or_path", "") or ""
    if not name:
        raise InvalidArgument("the model config names no model; pass model_id='org/name'")
    if dtype is None:
        dtype = next(model.parameters()).dtype
    return KVLayout(
        model=name,
        revision=revision,
        lora_id=lora_id,
        dtype=_dtype_name(dtype),
        num_layers=text_config.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size_tokens=block_size_tokens,
        kv_layout=KV_LAYOUT,
    )


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    # transformers >= 4.56 keeps per-layer objects; older versions keep two lists.
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _check_cache(cache: Any, layout: KVLayout) -> int:
    """The number of tokens `cache` holds, after checking it matches `layout`."""
    keys, _ = _layer_kv(cache, 0)
    if keys.dim() != 4:
        raise InvalidArgument(f"expected per-layer keys shaped [batch, heads, seq, dim], got {tuple(keys.shape)}")
    _, heads, seq, dim = keys.shape
    if (heads, dim) != (layout.num_kv_heads, layout.head_dim):
        raise InvalidArgument(
            f"the cache has {heads} KV heads of dim {dim}; the layout says {layout.num_kv_heads} of "
            f"dim {layout.head_dim}: build the layout with layout_for_model(model)"
        )
    if _dtype_name(keys.dtype) != layout.dtype:
        raise InvalidArgument(f"the cache holds {keys.dtype}; the layout says {layout.dtype}")
    return int(seq)


def pack_blocks(cache: Any, layout: KVLayout, first_block: int, num_blocks: int) -> list[torch.Tensor]:
    """Blocks `[first_block, first_block + num_blocks)` of batch row 0 as contiguous CPU tensors."""
    bst = layout.block_size_tokens
    start, stop = first_block * bst, (first_block + num_blocks) * bst
    per_layer = []
    for layer in range(layout.num_layers):
        k, v = _layer_kv(cache, layer)
        # [2, H, n*B, D] -> [2, H, n, B, D]; one stack for all blocks, split below.
        kv = torch.stack((k[0, :, start:stop], v[0, :, start:stop]))
        per_layer.append(kv.reshape(2, layout.num_kv_heads, num_blocks, bst, layout.head_dim))
    packed = torch.stack(per_layer)  # [L, 2, H, n, B, D]
    packed = packed.permute(3, 0, 1, 2, 4, 5).contiguous().cpu()  # [n, L, 2, H, B, D]
    return list(packed.unbind(0))


def _new_cache(config: Any) -> Any:
    from transformers import DynamicCache

    try:
        # With the config, the cache builds the right layer kinds (e.g. sliding-window).
        return DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # older transformers take no config
        return DynamicCache()


def unpack_blocks(blocks: Sequence[Any], layout: KVLayout, config: Any = None,
                  device: torch.device | str | None = None) -> Any:
    """A fresh cache (the installed transformers' `DynamicCache`) holding `blocks` in order."""
    cache = _new_cache(config)
    if not blocks:
        return cache
    n, bst = len(blocks), layout.block_size_tokens
    # One copy out of the received buffers, then a view: [n, L, 2, H, B, D] -> [L, 2, H, n*B, D].
    flat = torch.frombuffer(bytearray().join(blocks), dtype=getattr(torch, layout.dtype))
    whole = (flat.view(n, layout.num_layers, 2, layout.num_kv_heads, bst, layout.head_dim)
             .permute(1, 2, 3, 0, 4, 5).reshape(layout.num_layers, 2, layout.num_kv_heads, n * bst, layout.head_dim))
    if device is not None:
        whole = whole.to(device)
    for layer in range(layout.num_layers):
        # unsqueeze adds the batch axis: [1, H, seq, D]
        cache.update(whole[layer, 0].unsqueeze(0), whole[layer, 1].unsqueeze(0), layer)
    return cache


def store_prefix(client: Any, layout: KVLayout, token_ids: Sequence[int], cache: Any, *,
                 held_blocks: int | None = None) -> PutResult | None:
    """Store every full block of `token_ids` that `cache` covers and the daemon lacks.

    `held_blocks` is how many leading blocks the daemon is known to hold (e.g. just
    restored from it); None asks it with a lookup. Returns None when nothing is new.
    """
    tokens = [int(t) for t in token_ids]
    held = _check_cache(cache, layout)
    n_blocks = min(len(tokens), held) // layout.block_size_tokens
    if held_blocks is None:
        held_blocks = client.lookup(layout, tokens[: n_blocks * layout.block_size_tokens]).num_blocks
    first = min(held_blocks, n_blocks)
    if first >= n_blocks:
        return None
    blocks = pack_blocks(cache, layout, first, n_blocks - first)
    result = client.put(layout, tokens[: n_blocks * layout.block_size_tokens], blocks, first_block=first)
    logger.debug("stored blocks [%d, %d) of a %d-token prefix", first, n_blocks, len(tokens))
    return result


def restore_prefix(client: Any, layout: KVLayout, token_ids: Sequence[int], *, config: Any = None,
                   max_tokens: int | None = None, device: torch.device | str | None = None) -> RestoredPrefix:
    """A cache for the longest held prefix of `token_ids`, leaving at least one token to compute.

    `max_tokens` caps the restored length (default `len(token_ids) - 1`). On a miss the
    cache is empty and `num_tokens` is 0.
    """
    tokens = [int(t) for t in token_ids]
    limit = len(tokens) - 1 if max_tokens is None else min(max_tokens, len(tokens) - 1)
    limit = max(limit, 0) // layout.block_size_tokens * layout.block_size_tokens
    if limit:
        hit = client.lookup(layout, tokens[:limit], lease_ms=10_000)
        if hit.num_blocks:
            blocks = client.fetch(layout, block_hashes=hit.block_hashes, lease_id=hit.lease_id)
            if blocks:
                cache = unpack_blocks(blocks, layout, config, device)
                return RestoredPrefix(cache, len(blocks) * layout.block_size_tokens)
    return RestoredPrefix(_new_cache(config), 0)


@torch.inference_mode()
def prefill(model: Any, client: Any, layout: KVLayout, input_ids: torch.Tensor) -> PrefillResult:
    """Prefill `input_ids` (shape [1, n]) reusing kvstore's prefix, then store the new blocks.

    Returns the logits of the computed positions (the last row is the next-token
    distribution) and the full cache, ready for decoding.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise InvalidArgument(f"prefill takes one sequence shaped [1, n], got {tuple(input_ids.shape)}")
    tokens = input_ids[0].tolist()
    device = input_ids.device
    restored = restore_prefix(client, layout, tokens, config=model.config, device=device)
    n = restored.num_tokens
    cache_position = torch.arange(n, len(tokens), device=device)
    out = model(input_ids[:, n:], past_key_values=restored.cache, cache_position=cache_position, use_cache=True)
    # The restored blocks are held by the daemon: storing starts after them.
    result = store_prefix(client, layout, tokens, out.past_key_values,
                          held_blocks=n // layout.block_size_tokens if n else None)
    return PrefillResult(out.logits, out.past_key_values, n, result.stored if result else 0)
