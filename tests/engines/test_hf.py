"""transformers with kvstore: a 512-token prefix restored from the daemon gives the same
logits as a full prefill.

Tolerance: float32 on CPU; the check uses torch's float32 tolerance (rtol 1.3e-6,
atol 1e-5) because attention over a restored cache multiplies in different shapes than
a full prefill. On the machines this was written on the logits came out bit-identical.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import DaemonProcess

from kvstore.client import Client

PREFIX_TOKENS = 512
BLOCK = 32


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@torch.inference_mode()
def test_restored_prefix_gives_the_logits_of_a_full_prefill(model, daemon: DaemonProcess):
    from kvstore.client.hf import layout_for_model, prefill, store_prefix

    rng = random.Random(512)
    tokens = [rng.randrange(3, model.config.vocab_size) for _ in range(PREFIX_TOKENS + 20)]
    input_ids = torch.tensor([tokens])
    layout = layout_for_model(model, model_id="test/tiny-llama", block_size_tokens=BLOCK)
    full = model(input_ids, use_cache=True)

    with Client(daemon.target) as kv:
        stored = store_prefix(kv, layout, tokens[:PREFIX_TOKENS], full.past_key_values)
        assert stored is not None and stored.stored == PREFIX_TOKENS // BLOCK
        before = kv.stats().counters
        result = prefill(model, kv, layout, input_ids)
        after = kv.stats().counters

    assert result.reused_tokens == PREFIX_TOKENS
    assert result.logits.shape[1] == len(tokens) - PREFIX_TOKENS  # only the suffix was computed
    torch.testing.assert_close(result.logits[0], full.logits[0, PREFIX_TOKENS:], rtol=1.3e-6, atol=1e-5)
    assert result.logits[0, -1].argmax() == full.logits[0, -1].argmax()
    assert after.hit_blocks - before.hit_blocks == PREFIX_TOKENS // BLOCK
    assert after.blocks_fetched - before.blocks_fetched == PREFIX_TOKENS // BLOCK
    # The cache handed back covers the whole sequence, ready for decoding.
    assert result.cache.get_seq_length() == len(tokens)


@torch.inference_mode()
def test_generate_continues_from_a_restored_cache(model, daemon: DaemonProcess):
    from kvstore.client.hf import layout_for_model, restore_prefix, store_prefix

    rng = random.Random(7)
    tokens = [rng.randrange(3, model.config.vocab_size) for _ in range(200)]
    input_ids = torch.tensor([tokens])
    layout = layout_for_model(model, model_id="test/tiny-llama-generate", block_size_tokens=BLOCK)
    plain = model.generate(input_ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    with Client(daemon.target) as kv:
        assert restore_prefix(kv, layout, tokens, config=model.config).num_tokens == 0  # a miss is a value
        store_prefix(kv, layout, tokens, plain.past_key_values)
        restored = restore_prefix(kv, layout, tokens, config=model.config)
    assert restored.num_tokens == (len(tokens) - 1) // BLOCK * BLOCK
    again = model.generate(input_ids, past_key_values=restored.cache, max_new_tokens=8, do_sample=False)
    assert again[0].tolist() == plain.sequences[0].tolist()


def test_a_cache_of_another_shape_is_refused(model, daemon: DaemonProcess):
    from kvstore.client.hf import layout_for_model, store_prefix
    from kvstore.errors import InvalidArgument
    from kvstore.layout import KVLayout

    layout = layout_for_model(model, model_id="test/tiny-llama", block_size_tokens=BLOCK)
    wrong = KVLayout(model=layout.model, dtype="float32", num_layers=layout.num_layers, num_kv_heads=4,
                     head_dim=layout.head_dim, block_size_tokens=BLOCK, kv_layout=layout.kv_layout)
    with torch.inference_mode():
        out = model(torch.arange(3, 3 + 64).unsqueeze(0), use_cache=True)
    with Client(daemon.target) as kv, pytest.raises(InvalidArgument, match="KV heads"):
        store_prefix(kv, wrong, list(range(3, 67)), out.past_key_values)
