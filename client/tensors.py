"""torch helpers: byte views of CPU tensors. Imports torch; loaded only when a tensor
is actually passed to the SDK."""

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
