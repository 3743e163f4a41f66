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
`unpack_blocks` (cache <-> kvstore block payloads), `pack_parts` / `unpack_parts` (the
same for layouts with KV groups), `store_prefix`, `restore_prefix`, and `prefill`
(restore, run the rest, store the new blocks).

Models with several KV groups get a layout with groups (`kvstore.groups`):
- sliding-window layers next to full-attention ones (Gemma-2/3, Mistral with a window,
  any config whose `layer_types` names "sliding_attention"): a "full" and a "sliding"
  group, each part `[L_g, 2, H, B, D]` of its layers; a put stores the sliding group's
  blocks only inside the window before its end. The caches this adapter builds keep
  every token of every layer (a plain `DynamicCache`, whose sliding layers the model's
  sliding mask still limits to the window), so the window's blocks are whole when they
  are stored; on restore, a sliding layer's tokens before the window are zeros, which its
  mask never reads. A cache of transformers' own sliding-window layers keeps only the last
  `window - 1` tokens, so its first window block is incomplete: storing one is refused
  unless the window's blocks are all held.
- multi-head latent attention (DeepSeek-V2/V3, `kv_lora_rank` in the config): one "mla"
  group, each part `[L, B, kv_lora_rank + qk_rope_head_dim]`, the latent and the rope key
  that transformers caches as a layer's keys and values.
- linear attention next to full attention (Qwen3-Next: `layer_types` names
  "linear_attention"): a "full" group and a "state" group, whose part is each linear
  layer's conv and recurrent state after the block's last token (their shapes in the
  group's shape: layers, then the conv state's dims, then the recurrent state's, batch
  left out), kept only at a put's end. A state exists only where a forward stopped, so
  `prefill` runs the prompt in two pieces, up to its last full block and then the rest,
  and stores at that boundary; `store_prefix` refuses a cache that went past its last
  full block.
Other layer kinds (chunked attention, Mamba layers of other cache classes) are refused.

One kvstore block holds `block_size_tokens` tokens of every layer's K and V, laid out
`[L, 2, H, B, D]` (layer, K/V, KV head, token, head dim), the order a transformers cache
keeps per layer (`[batch, H, seq, D]`), so packing is one gather per block. Only batch
row 0 is stored: a prefix cache is keyed by one token sequence. Only full blocks are
stored, and a restore never covers the whole prompt: the last token is always computed,
because its logits are what the next step needs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.client.results import PutResult
from kvstore.errors import InvalidArgument
from kvstore.groups import Rule, needed, rule_of
from kvstore.layout import GroupKind, KVGroup, KVLayout

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
    kv_codec: str = "",
) -> KVLayout:
    """The `KVLayout` of a transformers causal LM's cache.

    `model_id` defaults to the config's `_name_or_path`; give the hub id (and `revision`)
    explicitly when the model was loaded from a local path, so that copies of the same
    weights share blocks and different weights never do.

    `kv_codec` (off by default): store the cache quantized, `"fp8-e4m3"` or `"kivi4"`
    (docs/codecs.md: what each costs in accuracy on a real model). A restore then gives
    the dequantized cache in the model's dtype. Models with KV groups cannot use it.
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
    dtype_name = _dtype_name(dtype)
    num_layers = text_config.num_hidden_layers
    kv_layout = KV_LAYOUT
    groups: tuple[KVGroup, ...] = ()
    latent = getattr(text_config, "kv_lora_rank", None)
    if latent:
        # MLA: the latent and the rope key of each token, one "head".
        num_kv_heads, head_dim = 1, latent + text_config.qk_rope_head_dim
        kv_layout = MLA_KV_LAYOUT
        groups = (KVGroup("mla", GroupKind.MLA, dtype_name, (num_layers, block_size_tokens, head_dim)),)
    else:
        kinds = _layer_kinds(text_config)
        if GroupKind.STATE in kinds:
            groups = (KVGroup("full", GroupKind.FULL, dtype_name,
                              (kinds.count(GroupKind.FULL), 2, num_kv_heads, block_size_tokens, head_dim)),
                      _state_group(model, kinds.count(GroupKind.STATE)))
        elif GroupKind.SLIDING_WINDOW in kinds:
            for kind, group_name in ((GroupKind.FULL, "full"), (GroupKind.SLIDING_WINDOW, "sliding")):
                layers = kinds.count(kind)
                if layers:
                    groups += (KVGroup(group_name, kind, dtype_name,
                                       (layers, 2, num_kv_heads, block_size_tokens, head_dim),
                                       window_tokens=text_config.sliding_window if kind is not GroupKind.FULL else 0),)
    return KVLayout(
        model=name,
        revision=revision,
        lora_id=lora_id,
        dtype=dtype_name,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size_tokens=block_size_tokens,
        kv_layout=kv_layout,
        groups=groups,
        kv_codec=kv_codec,
    )


MLA_KV_LAYOUT = "L,B,[latent|rope]"


def _layer_kinds(text_config: Any) -> list[GroupKind]:
    """Each layer's group kind, from the config's `layer_types` (all full attention when it
    has none, or no sliding window)."""
    n = text_config.num_hidden_layers
    types = getattr(text_config, "layer_types", None)
    window = getattr(text_config, "sliding_window", None)
    if not types:
        return [GroupKind.FULL] * n
    kinds = []
    for i, kind in enumerate(types):
        if kind == "full_attention":
            kinds.append(GroupKind.FULL)
        elif kind == "sliding_attention" and window:
            kinds.append(GroupKind.SLIDING_WINDOW)
        elif kind == "linear_attention":
            kinds.append(GroupKind.STATE)
        else:
            raise InvalidArgument(f"layer {i} is {kind!r}, which the transformers adapter cannot store "
                                  "(it stores full-attention, sliding-window and MLA layers)")
    return kinds


def _state_group(model: Any, layers: int) -> KVGroup:
    """The state group of a linear-attention model, its shapes read from a one-token
    forward (they depend on the model's heads and kernel, not on the prompt)."""
    cache = _new_cache(model.config)
    with torch.inference_mode():
        model(torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device), past_key_values=cache,
              use_cache=True)
    conv, rec = next((layer.conv_states[0], layer.recurrent_states[0]) for layer in cache.layers
                     if hasattr(layer, "conv_states"))
    shape = (layers, conv.dim() - 1, *conv.shape[1:], *rec.shape[1:])
    nbytes = layers * (conv[0].numel() * conv.element_size() + rec[0].numel() * rec.element_size())
    return KVGroup("state", GroupKind.STATE, f"{_dtype_name(conv.dtype)}+{_dtype_name(rec.dtype)}", shape,
                   block_bytes=nbytes)


def _seq_length(cache: Any) -> int:
    """Tokens an attention layer of `cache` has seen (linear layers count none)."""
    lengths = [int(getattr(layer, "cumulative_length", 0) or layer.keys.shape[-2])
               for layer in getattr(cache, "layers", [])
               if getattr(layer, "keys", None) is not None and layer.keys.numel()]
    return max(lengths) if lengths else int(cache.get_seq_length())


def _group_layers(layout: KVLayout, config: Any) -> list[list[int]]:
    """The layers of each of `layout`'s groups, in order."""
    if layout.groups[0].kind is GroupKind.MLA:
        return [list(range(layout.num_layers))]
    if config is None:
        raise InvalidArgument("a layout with KV groups needs the model config to tell its layers apart: "
                              "pass config=model.config")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = _layer_kinds(text_config)
    return [[i for i, k in enumerate(kinds) if k is g.kind] for g in layout.groups]


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


def _layer_rows(cache: Any, layer: int, layout: KVLayout) -> tuple[torch.Tensor, int]:
    """Layer `layer` of batch row 0 as one row per token ([tokens, row]: MLA's latent and
    rope key side by side; else K and V of every head, as `[2, H, tokens, D]` flattened per
    token later), and the position of its first token (a sliding layer keeps only the last)."""
    k, v = _layer_kv(cache, layer)
    held = k.shape[-2]
    total = int(getattr(_layer(cache, layer), "cumulative_length", 0) or held)
    return torch.stack((k[0], v[0])) if layout.groups[0].kind is not GroupKind.MLA else \
        torch.cat((k[0, 0], v[0, 0]), dim=-1), total - held


def _layer(cache: Any, layer: int) -> Any:
    layers = getattr(cache, "layers", None)
    return layers[layer] if layers is not None else None


def pack_parts(cache: Any, layout: KVLayout, first_block: int, num_blocks: int,
               config: Any = None) -> list[dict[str, torch.Tensor]]:
    """A grouped layout's parts of blocks `[first_block, first_block + num_blocks)`, as a
    put of them needs them (`kvstore.groups.needed`): one dict of CPU tensors per block."""
    bst = layout.block_size_tokens
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(num_blocks)]
    mla = layout.groups[0].kind is GroupKind.MLA
    for need, layers in zip(needed(layout, num_blocks), _group_layers(layout, config)):
        if not len(need):
            continue
        group = layout.groups[need.group]
        start, stop = (first_block + need.start) * bst, (first_block + need.stop) * bst
        if group.kind is GroupKind.STATE:
            seen = _seq_length(cache)
            if seen != stop:
                raise InvalidArgument(
                    f"the cache's states are the states after token {seen}, but a put ending at token {stop} needs "
                    "the states there: store from a cache that stopped at the put's last full block (prefill does)")
            state = torch.cat([torch.cat((cache.layers[layer].conv_states[0][0].contiguous().view(torch.uint8).flatten(),
                                          cache.layers[layer].recurrent_states[0][0].contiguous().view(torch.uint8)
                                          .flatten())) for layer in layers]).cpu()
            out[need.stop - 1][group.name] = state
            continue
        per_layer = []
        for layer in layers:
            rows, offset = _layer_rows(cache, layer, layout)
            if start < offset or stop - offset > (rows.shape[-2]):
                raise InvalidArgument(
                    f"layer {layer} holds tokens [{offset}, {offset + rows.shape[-2]}) but the {group.name} group "
                    f"needs [{start}, {stop}): a sliding-window cache that keeps only the window cannot give whole "
                    "blocks; store from a cache restore_prefix or prefill built (every token kept)")
            if mla:  # [tokens, row] -> [n, B, row]
                per_layer.append(rows[start - offset : stop - offset].reshape(len(need), bst, -1))
            else:  # [2, H, tokens, D] -> [n, 2, H, B, D]
                kv = rows[:, :, start - offset : stop - offset]
                per_layer.append(kv.reshape(2, layout.num_kv_heads, len(need), bst, layout.head_dim)
                                 .permute(2, 0, 1, 3, 4))
        packed = torch.stack(per_layer, dim=1).contiguous().cpu()  # [n, L_g, ...]
        for k, j in enumerate(range(need.start, need.stop)):
            out[j][group.name] = packed[k]
    return out


def unpack_parts(parts: Sequence[dict[str, bytes]], layout: KVLayout, config: Any = None,
                 device: torch.device | str | None = None) -> Any:
    """A fresh cache holding a grouped prefix (`parts`, one dict per block from position
    0, as a fetch answers it): every layer a plain `DynamicCache` layer of all the
    prefix's tokens, a sliding layer's tokens before its window zeros (never read)."""
    stateful = any(g.kind is GroupKind.STATE for g in layout.groups)
    # A linear-attention model needs its cache's linear layers; others keep every token.
    cache = _new_cache(config if stateful else None)
    n, bst = len(parts), layout.block_size_tokens
    if not n:
        return cache
    dtype = getattr(torch, layout.dtype)
    mla = layout.groups[0].kind is GroupKind.MLA
    latent = layout.head_dim - (config.get_text_config() if hasattr(config, "get_text_config") else config
                                ).qk_rope_head_dim if mla and config is not None else 0
    if mla and not latent:
        raise InvalidArgument("restoring an MLA cache needs the model config (its qk_rope_head_dim)")
    per_layer: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for need, layers in zip(needed(layout, n), _group_layers(layout, config)):
        group = layout.groups[need.group]
        got = len(need)
        if group.kind is GroupKind.STATE:
            _restore_states(cache, group, layers, parts[n - 1][group.name], device)
            continue
        flat = torch.frombuffer(bytearray().join(parts[j][group.name] for j in range(need.start, need.stop)),
                                dtype=dtype)
        if mla:
            whole = flat.view(got, len(layers), bst, layout.head_dim).permute(1, 0, 2, 3).reshape(
                len(layers), got * bst, layout.head_dim)
        else:
            whole = flat.view(got, len(layers), 2, layout.num_kv_heads, bst, layout.head_dim).permute(
                1, 2, 3, 0, 4, 5).reshape(len(layers), 2, layout.num_kv_heads, got * bst, layout.head_dim)
        for i, layer in enumerate(layers):
            if mla:
                k, v = whole[i, :, :latent].unsqueeze(0), whole[i, :, latent:].unsqueeze(0)
                k, v = k.unsqueeze(0), v.unsqueeze(0)
            else:
                k, v = whole[i, 0].unsqueeze(0), whole[i, 1].unsqueeze(0)
            if need.start:  # a window: the tokens before it are never attended to
                pad = need.start * bst
                k = torch.cat((k.new_zeros(*k.shape[:-2], pad, k.shape[-1]), k), dim=-2)
                v = torch.cat((v.new_zeros(*v.shape[:-2], pad, v.shape[-1]), v), dim=-2)
            per_layer[layer] = (k, v)
    for layer in sorted(per_layer):
        k, v = per_layer[layer]
        if device is not None:
            k, v = k.to(device), v.to(device)
        cache.update(k.contiguous(), v.contiguous(), layer)
    return cache


def _restore_states(cache: Any, group: KVGroup, layers: list[int], part: bytes,
                    device: torch.device | str | None) -> None:
    """Each linear layer's conv and recurrent state from a state part (see `_state_group`)."""
    conv_dims = group.shape[1]
    conv_shape, rec_shape = group.shape[2 : 2 + conv_dims], group.shape[2 + conv_dims :]
    conv_dtype, rec_dtype = (getattr(torch, name) for name in group.dtype.split("+"))
    conv_bytes = math.prod(conv_shape) * torch.tensor([], dtype=conv_dtype).element_size()
    rec_bytes = math.prod(rec_shape) * torch.tensor([], dtype=rec_dtype).element_size()
    raw = torch.frombuffer(bytearray(part), dtype=torch.uint8)
    offset = 0
    for layer in layers:
        conv = raw[offset : offset + conv_bytes].view(conv_dtype).view(1, *conv_shape)
        rec = raw[offset + conv_bytes : offset + conv_bytes + rec_bytes].view(rec_dtype).view(1, *rec_shape)
        offset += conv_bytes + rec_bytes
        if device is not None:
            conv, rec = conv.to(device), rec.to(device)
        cache.layers[layer].update_conv_state(conv.clone())
        cache.layers[layer].update_recurrent_state(rec.clone())


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
                 held_blocks: int | None = None, config: Any = None) -> PutResult | None:
    """Store every full block of `token_ids` that `cache` covers and the daemon lacks.

    `held_blocks` is how many leading blocks the daemon is known to hold (e.g. just
    restored from it); None asks it with a lookup. Returns None when nothing is new.
    """
    tokens = [int(t) for t in token_ids]
    if layout.groups:
        return _store_parts(client, layout, tokens, cache, held_blocks, config)
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


def _store_parts(client: Any, layout: KVLayout, tokens: list[int], cache: Any, held_blocks: int | None,
                 config: Any) -> PutResult | None:
    """`store_prefix` of a grouped layout: every full block the cache holds; the parts the
    hit rules keep for a put ending there."""
    held = _seq_length(cache)
    n_blocks = min(len(tokens), held) // layout.block_size_tokens
    if held_blocks is None:
        held_blocks = client.lookup(layout, tokens[: n_blocks * layout.block_size_tokens]).num_blocks
    first = min(held_blocks, n_blocks)
    if first >= n_blocks:
        return None
    parts = pack_parts(cache, layout, first, n_blocks - first, config)
    return client.put(layout, tokens[: n_blocks * layout.block_size_tokens], parts, first_block=first)


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
                cache = (unpack_parts(blocks, layout, config, device) if layout.groups
                         else unpack_blocks(blocks, layout, config, device))
                return RestoredPrefix(cache, len(blocks) * layout.block_size_tokens)
    # A grouped layout's caches keep every token of every layer (see the module docstring),
    # and a linear-attention model's its linear layers' states.
    stateful = any(g.kind is GroupKind.STATE for g in layout.groups)
    return RestoredPrefix(_new_cache(config if stateful or not layout.groups else None), 0)


def _prefill_to_ends(model: Any, client: Any, layout: KVLayout, input_ids: torch.Tensor, cache: Any, n: int,
                     ends: list[int]) -> PrefillResult:
    """`prefill` of a layout with window or state groups: a put at each of `ends`. A state
    exists only where a forward stops, so a stateful model runs up to each end in turn;
    the others keep every token, so they run once and store each end from the cache."""
    tokens = input_ids[0].tolist()
    device = input_ids.device
    stateful = any(g.kind is GroupKind.STATE for g in layout.groups)
    stops = [*ends, len(tokens)] if stateful else [len(tokens)]
    logits = []
    stored = 0
    done = n
    for stop in stops:
        if stop > done:
            out = model(input_ids[:, done:stop], past_key_values=cache,
                        cache_position=torch.arange(done, stop, device=device), use_cache=True)
            cache, done = out.past_key_values, stop
            logits.append(out.logits)
        if stateful and stop in ends:
            result = store_prefix(client, layout, tokens[:stop], cache, config=model.config)
            stored += result.stored if result else 0
    if not stateful:
        for end in ends:
            result = store_prefix(client, layout, tokens[:end], cache, config=model.config)
            stored += result.stored if result else 0
    return PrefillResult(torch.cat(logits, dim=1), cache, n, stored)


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
    bst = layout.block_size_tokens
    if any(rule_of(g) is not Rule.EVERY for g in layout.groups):
        # Only put ends are reusable with a window or a state group: the prompt's last full
        # block, and the end a later restore of this same prompt asks for (it leaves the
        # last token to compute, one block less when the length is a multiple of the block).
        ends = sorted({e for e in ((len(tokens) - 1) // bst * bst, len(tokens) // bst * bst) if e > n})
        return _prefill_to_ends(model, client, layout, input_ids, restored.cache, n, ends)
    cache_position = torch.arange(n, len(tokens), device=device)
    out = model(input_ids[:, n:], past_key_values=restored.cache, cache_position=cache_position, use_cache=True)
    # The restored blocks are held by the daemon: storing starts after them.
    result = store_prefix(client, layout, tokens, out.past_key_values,
                          held_blocks=n // layout.block_size_tokens if n else None, config=model.config)
    return PrefillResult(out.logits, out.past_key_values, n, result.stored if result else 0)
