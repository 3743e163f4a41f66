"""A tiny Llama with random weights, built locally: a real model whose output depends on
its KV cache, without downloading anything.

`initializer_range=0.2` makes the random weights large enough that logits are far apart,
so greedy decoding is decided by the KV cache rather than by rounding noise.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512


def build_tiny_llama(path: Path, *, seed: int = 0, num_layers: int = 2) -> Path:
    """Save a tiny random Llama (hidden 128, head_dim 32, 4 query / 2 KV heads) to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return path
