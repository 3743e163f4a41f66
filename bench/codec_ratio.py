"""The SSD codec's ratio on realistic KV: fp16 and bf16 caches from a real forward pass.

Builds a small Llama with transformers from a config (random init, nothing downloaded),
runs a forward pass over a prompt, takes the past key/values, cuts them into blocks the
way an engine would (`[2, L, block, H, D]`), and encodes each block with the SSD codec.
Reports the stored/raw ratio with shuffle + lz4, plain lz4 for comparison, and how many
blocks the 5% rule keeps compressed. Needs `transformers` (not a kvstore dependency).
"""

from __future__ import annotations

import json
import os
import sys
import time

import lz4.block
import torch

from kvstore.tiers.codec import Codec, encode

BLOCK_TOKENS = 16


def kv_blocks(model: torch.nn.Module, dtype: torch.dtype, tokens: int) -> list[bytes]:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    with torch.no_grad():
        out = model.to(dtype)(ids, use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    layers = [(layer.keys, layer.values) for layer in cache.layers] if hasattr(cache, "layers") else list(cache)
    k = torch.stack([kk[0] for kk, _ in layers])  # [L, H, T, D]
    v = torch.stack([vv[0] for _, vv in layers])
    kv = torch.stack([k, v]).permute(0, 1, 3, 2, 4).contiguous()  # [2, L, T, H, D]
    blocks = []
    for start in range(0, tokens - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        blk = kv[:, :, start : start + BLOCK_TOKENS].contiguous()
        blocks.append(blk.view(torch.uint8).numpy().tobytes())
    return blocks


def measure(blocks: list[bytes]) -> dict[str, float | int]:
    raw = sum(len(b) for b in blocks)
    stored = kept = 0
    t = time.perf_counter()
    for b in blocks:
        enc = encode(b, 2)
        stored += len(enc.payload)
        kept += enc.codec is Codec.SHUFFLE_LZ4
    secs = time.perf_counter() - t
    forced = sum(len(encode(b, 2, min_saving=-1.0).payload) for b in blocks)
    plain = sum(min(len(lz4.block.compress(b, store_size=False)), len(b)) for b in blocks)
    return {"blocks": len(blocks), "block_bytes": len(blocks[0]), "stored_ratio": round(stored / raw, 4),
            "shuffle_lz4_ratio": round(forced / raw, 4), "plain_lz4_ratio": round(plain / raw, 4),
            "kept_compressed": kept, "encode_gbps": round(raw / secs / 1e9, 3)}


def main() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    model = LlamaForCausalLM(config).eval()
    results = {}
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        results[name] = measure(kv_blocks(model, dtype, 512))
    print("SSD codec on KV from a random-init Llama (4 layers, 4 KV heads x 64, 16-token blocks):")
    for name, r in results.items():
        print(f"  {name:9s} stored/raw {r['stored_ratio']:.3f} (shuffle+lz4 {r['shuffle_lz4_ratio']:.3f}, "
              f"plain lz4 {r['plain_lz4_ratio']:.3f}); {r['kept_compressed']}/{r['blocks']} blocks kept "
              f"compressed; encode {r['encode_gbps']} GB/s")
    os.makedirs("bench/results", exist_ok=True)
    with open(f"bench/results/codec-{int(time.time())}.json", "w") as fh:
        json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
