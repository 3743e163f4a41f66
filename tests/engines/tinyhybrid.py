"""Tiny models with several KV groups, random weights, built locally (no downloads):
Gemma-3 with sliding-window and full-attention layers, and a DeepSeek-V3 (MLA).

As in tinyllama.py, `initializer_range=0.2` (and untied embeddings) keep logits far
apart, so greedy decoding is decided by the KV cache rather than by rounding noise.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512


def build_tiny_gemma3(path: Path, *, sliding_window: int = 48, seed: int = 0) -> Path:
    """A 4-layer Gemma-3: three sliding-window layers (window `sliding_window` tokens),
    then one full-attention layer (hidden 128, head_dim 32, 4 query / 2 KV heads)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=sliding_window,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=4096, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return path


def build_tiny_deepseek_v3(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer DeepSeek-V3 with multi-head latent attention (kv_lora_rank 512, rope 64:
    the one latent size vLLM's CPU MLA kernel compiles for),
    dense MLPs only (no experts are routed: first_k_dense_replace covers every layer)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2, n_group=1, topk_group=1,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        max_position_embeddings=4096, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, rope_scaling=None,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return path


def build_tiny_qwen3_next(path: Path, *, seed: int = 0) -> Path:
    """A 4-layer Qwen3-Next: three gated delta-net (linear attention) layers, whose cache is
    a conv and a recurrent state, then one full-attention layer; dense MLPs only."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        decoder_sparse_step=1, mlp_only_layers=[0, 1, 2, 3],
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        max_position_embeddings=4096, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return path
