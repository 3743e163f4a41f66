"""Block payloads as the SDK accepts and returns them: bytes-like objects, numpy arrays
and torch tensors (torch is imported only when a tensor is passed).

`as_buffer` gives a flat byte view of a block; `writable_view` one of a caller's `out`
buffer, checked for size and writability; `host_blocks` and `upload_blocks` move CUDA
tensors through host memory when the device plane is not in use; `out_buffers` are the
destinations of a fetch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.errors import InvalidArgument


def _is_tensor(obj: object) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "torch"


def is_cuda(obj: object) -> bool:
    return _is_tensor(obj) and getattr(obj, "is_cuda", False) is True


def all_cuda(blocks: Sequence[Any] | None) -> bool:
    """Whether `blocks` are CUDA tensors, every one (the device plane's case)."""
    if not blocks:
        return False
    return all(getattr(b, "is_cuda", False) for b in blocks)


def any_cuda(blocks: Sequence[Any] | None) -> bool:
    return blocks is not None and any(getattr(b, "is_cuda", False) for b in blocks)


def as_buffer(block: Any) -> memoryview:
    """A flat byte view of a block: bytes-like, numpy array, or CPU torch tensor."""
    if _is_tensor(block):
        from kvstore.client.tensors import tensor_bytes

        return tensor_bytes(block)
    try:
        view = memoryview(block)
    except TypeError:
        raise InvalidArgument(
            f"a block must be bytes-like, a numpy array or a torch tensor, got {type(block).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument("a block buffer must be C-contiguous; call .copy() or np.ascontiguousarray first")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def writable_view(buf: Any, index: int, block_bytes: int) -> memoryview:
    view = as_buffer(buf)
    if len(view) != block_bytes:
        raise InvalidArgument(f"out[{index}] holds {len(view)} bytes; a block is {block_bytes} bytes")
    if view.readonly:
        raise InvalidArgument(f"out[{index}] is read-only")
    return view


def out_buffers(out: Sequence[Any] | None, count: int, block_bytes: int) -> list[Any]:
    """Destinations for `count` blocks: the caller's buffers, or new bytearrays."""
    if out is None:
        return [bytearray(block_bytes) for _ in range(count)]
    return list(out[:count])


def host_blocks(blocks: Sequence[Any]) -> Sequence[Any]:
    """`blocks` with CUDA tensors copied to host memory (when the device plane is not in
    use); everything else as given."""
    if not any(is_cuda(b) for b in blocks):
        return blocks
    return [b.detach().cpu() if is_cuda(b) else b for b in blocks]


def upload_blocks(blocks: Sequence[Any], dsts: Sequence[Any]) -> None:
    """Copy host blocks (bytes-like) into caller buffers, CUDA tensors included."""
    for i, (src, dst) in enumerate(zip(blocks, dsts)):
        if is_cuda(dst):
            from kvstore.client.tensors import upload

            upload(src, dst, i)
        else:
            view = writable_view(dst, i, len(memoryview(src)))
            view[:] = memoryview(src).cast("B")
