"""Quantized namespaces in the SDK (`KVLayout.kv_codec`, docs/codecs.md): a put's blocks
are quantized here, before any plane sees them, and a fetch's are dequantized here, after
every plane verified them, into the caller's buffers in the engine's dtype. The daemon
and its tiers only ever hold the quantized form.

A caller that takes the quantized form itself (an engine with its own dequantization
kernel) passes `quantized=True` to `put` and `fetch`: blocks then go in and come out as
stored, and `kvstore.quant.quantizer_for(layout).parts(block)` names their codes and
scales.

Primitives: `quantize_blocks(layout, blocks)`, `dequantize_blocks(layout, stored, out)`.
CPU-bound: the SDK's plans run them as `Blocking` steps (off an asyncio client's loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.client._buffers import as_buffer, host_blocks, is_cuda, upload_blocks, writable_view
from kvstore.layout import KVLayout
from kvstore.quant import quantizer_for


def quantize_blocks(layout: KVLayout, blocks: Sequence[Any]) -> list[bytes]:
    """Each block (bytes, a buffer, a tensor of the engine's dtype and layout) quantized."""
    return quantizer_for(layout).quantize([as_buffer(b) for b in host_blocks(blocks)])


def dequantize_blocks(layout: KVLayout, stored: Sequence[Any], out: Sequence[Any] | None) -> list[Any]:
    """The engine's bytes of `stored` blocks: into `out` (host buffers or CUDA tensors of
    the engine's block size), or as new bytearrays."""
    q = quantizer_for(layout)
    if out is None:
        dense = [bytearray(layout.dense_block_bytes) for _ in stored]
        q.dequantize(stored, [memoryview(d) for d in dense])
        return dense
    dsts = list(out[: len(stored)])
    if any(is_cuda(d) for d in dsts):
        staged = q.dequantize(stored)
        assert staged is not None
        upload_blocks(staged, dsts)
        return dsts
    q.dequantize(stored, [writable_view(d, i, layout.dense_block_bytes) for i, d in enumerate(dsts)])
    return dsts
