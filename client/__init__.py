"""The kvstore SDK: `Client` (blocking) and `AsyncClient` (asyncio), same methods.

    from kvstore.client import Client, KVLayout
    layout = KVLayout(model="m", dtype="float16", num_layers=2, num_kv_heads=2,
                      head_dim=64, block_size_tokens=16)
    with Client("127.0.0.1:50051") as kv:
        kv.put(layout, token_ids, blocks)
        hit = kv.lookup(layout, token_ids)
        got = kv.fetch(layout, token_ids[: hit.num_tokens])

A model with several KV groups (sliding-window and full attention, MLA, Mamba state)
lists them in its layout; each block is then put as a mapping of group name to part,
and fetched as one (see kvstore.groups for which parts a prefix needs):

    layout = KVLayout(..., groups=(KVGroup("full", GroupKind.FULL, "bfloat16", (2, 4, 16, 8, 128)),
                                   KVGroup("swa", GroupKind.SLIDING_WINDOW, "bfloat16", (2, 20, 16, 8, 128),
                                           window_tokens=4096)))

Importing this package does not import torch; tensors are handled lazily.
"""

from kvstore.client._requests import EngineNames
from kvstore.client.aio import AsyncClient
from kvstore.client.results import LookupResult, PinResult, PrefetchResult, PutResult
from kvstore.client.sync import Client
from kvstore.hashing import block_hashes
from kvstore.layout import GroupKind, KVGroup, KVLayout

__all__ = ["AsyncClient", "Client", "EngineNames", "GroupKind", "KVGroup", "KVLayout", "LookupResult", "PinResult", "PrefetchResult", "PutResult", "block_hashes"]
