"""transformers with kvstore, models with several KV groups: Gemma-3 (sliding-window and
full-attention layers), DeepSeek-V3 (multi-head latent attention) and Qwen3-Next (linear
attention, a state cache, next to full attention), each a tiny random model built locally. A prefix restored from the daemon gives the logits and the greedy
tokens of the same prefix computed by the model itself; the sliding-window group keeps
only its window's blocks; a layout that differs in a group never hits.

The reference is the model's own prefill in the same two pieces (prefix, then the rest),
so the comparison is with torch's float32 tolerance (rtol 1.3e-6, atol 1e-5): MLA's
attention over a cached latent takes other shapes than a one-piece prefill, which moves
its logits by a few 1e-5 whoever made the cache.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DaemonProcess
from tinyhybrid import build_tiny_deepseek_v3, build_tiny_gemma3, build_tiny_qwen3_next

from kvstore.client import Client
from kvstore.groups import full_bytes, stored_bytes
from kvstore.layout import GroupKind

BLOCK = 16
WINDOW = 48


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), sliding_window=WINDOW)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_deepseek_v3(tmp_path_factory.mktemp("deepseek-v3"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen3next(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3-next"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


KINDS = {
    "gemma": [GroupKind.FULL, GroupKind.SLIDING_WINDOW],
    "deepseek": [GroupKind.MLA],
    "qwen3next": [GroupKind.FULL, GroupKind.STATE],
}


def draw(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@torch.inference_mode()
@pytest.mark.parametrize("which", ["gemma", "deepseek", "qwen3next"])
def test_a_restored_grouped_prefix_gives_the_logits_and_tokens_of_a_full_prefill(which, request,
                                                                                 daemon: DaemonProcess):
    from kvstore.client.hf import layout_for_model, prefill, restore_prefix

    model = request.getfixturevalue(which)
    layout = layout_for_model(model, model_id=f"test/tiny-{which}", block_size_tokens=BLOCK)
    kinds = [g.kind for g in layout.groups]
    assert kinds == KINDS[which]
    tokens = draw(3, 330)
    input_ids = torch.tensor([tokens])
    held = len(tokens) // BLOCK * BLOCK
    # The model's own cache of the prefix, then the rest: what the restored cache must reproduce.
    own = model(input_ids[:, :held], use_cache=True).past_key_values
    reference = model(input_ids[:, held:], past_key_values=own, use_cache=True)
    own_again = model(input_ids[:, :held], use_cache=True).past_key_values
    plain = model.generate(input_ids, past_key_values=own_again, max_new_tokens=12, do_sample=False)
    with Client(daemon.target) as kv:
        start = kv.stats().counters
        first = prefill(model, kv, layout, input_ids)  # a miss: computes all, stores every full block
        assert first.reused_tokens == 0 and first.stored_blocks == len(tokens) // BLOCK
        before = kv.stats().counters
        result = prefill(model, kv, layout, input_ids)
        restored = restore_prefix(kv, layout, tokens, config=model.config)
        after = kv.stats().counters
    assert result.reused_tokens == held
    torch.testing.assert_close(result.logits[0], reference.logits[0], rtol=1.3e-6, atol=1e-5)
    # Decoding from the restored cache gives the model's own greedy tokens.
    again = model.generate(input_ids, past_key_values=restored.cache, max_new_tokens=12, do_sample=False)
    assert again[0].tolist() == plain[0].tolist()
    assert after.hit_blocks - before.hit_blocks == 2 * (held // BLOCK)  # two lookups, each a whole hit
    if which == "qwen3next":
        # One state, at the put's end (the prompt's last full block), for 20 blocks.
        assert after.group_bytes_skipped - start.group_bytes_skipped == 19 * layout.groups[1].bytes_per_block
    if which == "gemma":
        # The sliding group kept only ceil((48 - 1) / 16) = 3 blocks of its 20.
        skipped = after.group_bytes_skipped - start.group_bytes_skipped
        assert skipped == full_bytes(layout, 20) - stored_bytes(layout, 20) > 0


@torch.inference_mode()
def test_a_prefix_that_was_no_put_end_misses_the_window_and_another_window_never_hits(gemma, tmp_path,
                                                                                     daemon: DaemonProcess):
    from kvstore.client.hf import layout_for_model, prefill, restore_prefix

    layout = layout_for_model(gemma, model_id="test/tiny-gemma-branch", block_size_tokens=BLOCK)
    shared = draw(11, 160)
    with Client(daemon.target) as kv:
        prefill(gemma, kv, layout, torch.tensor([shared + draw(12, 100)]))
        # The shared 10 blocks were not a put's end: the window was not kept there.
        assert restore_prefix(kv, layout, shared + draw(13, 50), config=gemma.config).num_tokens == 0
        # A layout whose sliding window differs is another namespace: never a hit.
        other = layout_for_model(gemma, model_id="test/tiny-gemma-branch", block_size_tokens=BLOCK)
        assert other == layout
        from dataclasses import replace

        changed = replace(layout, groups=(layout.groups[0], replace(layout.groups[1], window_tokens=64)))
        assert changed.namespace_id != layout.namespace_id
        assert kv.lookup(changed, shared + draw(12, 100)).num_blocks == 0
        assert kv.lookup(layout, shared + draw(12, 100)).num_blocks == 260 // BLOCK
