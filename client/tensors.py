"""torch helpers: byte views of CPU tensors, and host bytes into CUDA tensors (when the
device plane is not in use). Imports torch; loaded only when a tensor is actually
passed to the SDK."""

from __future__ import annotations

from typing import Any

import torch

from kvstore.errors import InvalidArgument


def tensor_bytes(tensor: Any) -> memoryview:
    """A flat, writable byte view of a CPU tensor's storage (no copy when contiguous)."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise InvalidArgument(
            f"tensor is on {tensor.device}; the gRPC data plane takes CPU tensors: call .cpu() first"
        )
    if not tensor.is_contiguous():
        raise InvalidArgument("tensor is not contiguous; call .contiguous() first so the block is one byte range")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def upload(src: Any, dst: Any, index: int) -> None:
    """Copy host bytes `src` into CUDA tensor `dst` (one block; sizes must match)."""
    if not dst.is_contiguous():
        raise InvalidArgument(f"out[{index}] is not contiguous; call .contiguous() so it is one byte range")
    flat = dst.detach().reshape(-1).view(torch.uint8)
    data = src if isinstance(src, bytearray) else bytearray(src)
    if flat.numel() != len(data):
        raise InvalidArgument(f"out[{index}] holds {flat.numel()} bytes; a block is {len(data)} bytes")
    flat.copy_(torch.frombuffer(data, dtype=torch.uint8))
