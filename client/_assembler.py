"""Fetch assembly: the chunks of a `Fetch` stream (gRPC bytes) put back together into
whole blocks, or written straight into the caller's `out` buffers. Sans-I/O: the caller
feeds it the stream's messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.client._buffers import writable_view
from kvstore.errors import KVStoreError
from kvstore.v1 import kvstore_pb2
from kvstore.wire import RawChunk


class FetchAssembler:
    """Collects a Fetch stream into whole blocks, optionally into caller buffers.

    With `out`, each chunk is copied straight to its place in the block's buffer as it
    arrives (one copy per byte whatever the chunk size, and no received message is kept
    past its chunk); a buffer past the blocks returned may hold part of a block when the
    stream broke off. Without `out`, a block's chunks are joined into one `bytes`.
    """

    def __init__(self, out: Sequence[Any] | None) -> None:
        self.out = list(out) if out is not None else None
        self.block_bytes = 0
        self.blocks: list[bytes] = []
        self._parts: list[memoryview] = []
        self._index = 0
        self._filled = 0
        self._dst: memoryview | None = None  # the current block's buffer (with `out`)
        self._offset = 0  # bytes of the current block received so far

    def feed(self, msg: kvstore_pb2.FetchResponse | RawChunk) -> None:
        if isinstance(msg, RawChunk):
            block, data = msg.block, msg.data
        elif msg.WhichOneof("msg") == "header":
            self.block_bytes = msg.header.block_bytes
            return
        else:
            block, data = msg.chunk.block, memoryview(msg.chunk.data)
        if block != self._index:
            self._finish_block()
            self._index = block
        end = self._offset + len(data)
        if end > self.block_bytes:
            raise KVStoreError(f"fetched block {self._index} has at least {end} bytes, expected {self.block_bytes}")
        if self.out is None:
            self._parts.append(data)
        else:
            if self._dst is None:
                # fetch_keys() asked for at most len(out) blocks, so there is a buffer for each.
                self._dst = writable_view(self.out[self._filled], self._filled, self.block_bytes)
            self._dst[self._offset : end] = data
        self._offset = end

    def _finish_block(self) -> None:
        if not self._offset and not self._parts:
            return
        if self._offset != self.block_bytes:
            raise KVStoreError(f"fetched block {self._index} has {self._offset} bytes, expected {self.block_bytes}")
        self._offset = 0
        if self.out is None:
            parts, self._parts = self._parts, []
            self.blocks.append(bytes(parts[0]) if len(parts) == 1 else b"".join(parts))
            return
        self._dst = None
        self._filled += 1

    def result(self) -> list[Any]:
        self._finish_block()
        if self.out is None:
            return self.blocks
        return self.out[: self._filled]
