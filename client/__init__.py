"""The kvstore SDK: `Client` (blocking) and `AsyncClient` (asyncio), same methods.

    from kvstore.client import Client, KVLayout
    layout = KVLayout(model="m", dtype="float16", num_layers=2, num_kv_heads=2,
                      head_dim=64, block_size_tokens=16)
    with Client("127.0.0.1:50051") as kv:
        kv.put(layout, token_ids, blocks)
        hit = kv.lookup(layout, token_ids)
        got = kv.fetch(layout, token_ids[: hit.num_tokens])

Importing this package does not import torch; tensors are handled lazily.
"""

from kvstore.client.results import LookupResult, PinResult, PrefetchResult, PutResult
from kvstore.client.aio import AsyncClient
from kvstore.client.sync import Client
from kvstore.hashing import block_hashes
from kvstore.layout import KVLayout

__all__ = ["AsyncClient", "Client", "KVLayout", "LookupResult", "PinResult", "PrefetchResult", "PutResult", "block_hashes"]
