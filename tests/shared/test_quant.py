"""Quantized namespaces' codecs (`kvstore.quant`): float8 e4m3 rounding as torch rounds
it, and every dequantized value within the bound each codec states, on random KV-shaped
blocks in each dtype and axis order (real model KV: tests/engines/test_codec_accuracy.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout
from kvstore.quant import FP8, KIVI4, from_e4m3, quantizer_for, to_e4m3

# Rounding the dequantized float32 value to the engine dtype adds up to half an ulp of the result.
CAST = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def test_e4m3_rounds_as_torch_does_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    y = torch.cat([(torch.randn(200_000, generator=g) * s).clamp(-448, 448) for s in (1e-3, 0.1, 3.0, 100.0)])
    edges = torch.tensor([0.0, -0.0, 448.0, -448.0, 2**-6, 2**-7, 2**-9, 2**-10, 3 * 2**-10, 1.0625, 1.1875,
                          440.0, 432.0, 2**-6 * 1.0625, 2**-6 * 0.9375])
    y = torch.cat([y, edges])
    mine = to_e4m3(y.numpy())
    assert np.array_equal(mine, y.to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    back = y.to(torch.float8_e4m3fn).to(torch.float32).numpy()
    assert np.array_equal(from_e4m3(mine), back)


def _layout(codec: str, dtype: str, kv_layout: str) -> KVLayout:
    return KVLayout(model="q", dtype=dtype, num_layers=3, num_kv_heads=2, head_dim=64, block_size_tokens=16,
                    kv_layout=kv_layout, kv_codec=codec)


def _blocks(layout: KVLayout, n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    count = layout.dense_block_bytes // {"float32": 4, "float16": 2, "bfloat16": 2}[layout.dtype]
    out = []
    for _ in range(n):
        # KV-like: most channels small, a few large (outlier channels), a zero stretch.
        x = (rng.standard_normal(count) * np.where(rng.random(count) < 0.03, 20.0, 0.7)).astype(np.float32)
        x[: count // 50] = 0.0
        if layout.dtype == "bfloat16":
            out.append((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
        else:
            out.append(x.astype(layout.dtype).tobytes())
    return out


@pytest.mark.parametrize("kv_layout", ["2,L,B,H,D", "L,2,H,B,D", "L,[H,2,B,D];vllm-cpu-attn/x"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("codec", [FP8, KIVI4])
def test_dequantized_values_are_within_the_stated_bound(codec: str, dtype: str, kv_layout: str) -> None:
    layout = _layout(codec, dtype, kv_layout)
    q = quantizer_for(layout)
    dense = _blocks(layout, 4, seed=len(kv_layout))
    stored = q.quantize(dense)
    assert all(len(s) == layout.bytes_per_block for s in stored)
    back = q.dequantize(stored)
    assert back is not None and all(len(b) == layout.dense_block_bytes for b in back)
    for d, s, b in zip(dense, stored, back):
        x, y = q.dense_canonical(d), q.dense_canonical(b)
        bound = q.bound(s, d) * (1 + 1e-6) + np.abs(y) * CAST[dtype] * 1.01 + 1e-30
        assert (np.abs(x - y) <= bound).all(), float((np.abs(x - y) / bound).max())
        assert np.abs(x - y).max() > 0  # lossy indeed: a codec that copies would not be one
    # Into caller buffers: the same bytes.
    outs = [bytearray(layout.dense_block_bytes) for _ in stored]
    assert q.dequantize(stored, [memoryview(o) for o in outs]) is None
    assert [bytes(o) for o in outs] == back


def test_a_broken_codec_breaks_the_bound() -> None:
    """The bound is not vacuous: dequantizing with the wrong scales fails it."""
    layout = _layout(FP8, "float32", "2,L,B,H,D")
    q = quantizer_for(layout)
    d = _blocks(layout, 1, seed=1)[0]
    s = bytearray(q.quantize([d])[0])
    q.parts(s)["scales"][...] *= 1.5
    y = q.dense_canonical(q.dequantize([bytes(s)])[0])  # type: ignore[index]
    x = q.dense_canonical(d)
    assert (np.abs(x - y) > q.bound(bytes(s), d)).any()


def test_parts_name_codes_and_scales() -> None:
    fp8 = quantizer_for(_layout(FP8, "bfloat16", "2,L,B,H,D"))
    parts = fp8.parts(bytes(fp8.stored_bytes))
    assert parts["codes"].shape == (2, 3, 2, 16, 64) and parts["scales"].shape == (2, 3, 2)
    kivi = quantizer_for(_layout(KIVI4, "bfloat16", "2,L,B,H,D"))
    parts = kivi.parts(bytes(kivi.stored_bytes))
    assert parts["codes"].shape == (2 * 3 * 2 * 16 * 64 // 2,)
    assert parts["k_scale"].shape == parts["k_min"].shape == (3, 2, 64)
    assert parts["v_scale"].shape == parts["v_min"].shape == (3, 2, 16, 2)


def test_sizes_and_bad_blocks() -> None:
    layout = _layout(KIVI4, "float16", "2,L,B,H,D")
    assert layout.dense_block_bytes == 2 * 3 * 2 * 16 * 64 * 2
    assert layout.bytes_per_block < layout.dense_block_bytes * 0.4
    assert layout.stored_itemsize == 1
    with pytest.raises(InvalidArgument, match="bytes"):
        quantizer_for(layout).quantize([b"short"])
    big = np.full(layout.dense_block_bytes // 2, 60000, np.float16).tobytes()
    assert quantizer_for(layout).quantize([big])  # float16 values fit float16 scales
    f32 = _layout(KIVI4, "float32", "2,L,B,H,D")
    with pytest.raises(InvalidArgument, match="float16"):
        quantizer_for(f32).quantize([np.full(f32.dense_block_bytes // 4, 1e6, np.float32).tobytes()])
