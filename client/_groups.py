"""Put and fetch of layouts with KV groups: a block is its parts, one per group its hit
rule needs (`kvstore.groups`), and they travel as the wire blocks of one Put or Fetch,
group-major. Sans-I/O plans, driven like every other verb (`kvstore.client._ops`).

A grouped put takes, for each block, a mapping from group name to that group's part
(bytes, a buffer, a CPU tensor, or a CUDA tensor: all CUDA, they go device to device
when the device plane opens); it needs exactly the parts `kvstore.groups.needed`
names for a put of that many blocks (a window's last blocks, the state at the end;
other parts given are ignored, so an engine may hand every part it has). A grouped
fetch answers, for each block of the longest prefix every group serves, a dict of the
parts that prefix needs (or, given `out`, one mapping per block of group name to a
buffer or CUDA tensor, filled with the parts the prefix needs). A fetch cut short (a part failed verification or was evicted
meanwhile) answers no block at all: the parts it got belong to a prefix end it did not
reach. The parts move on every plane a plain layout's blocks do (gRPC bytes, shared
memory, the data lane): in wire order, each of its group's size (`part_sizes`), and
`parts_result` puts what landed back into one dict per block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.client._buffers import as_buffer, is_cuda
from kvstore.client._requests import EngineNames, PreparedPut, block_keys, namespace_ref, put_header
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.groups import part_count, part_order
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2
from kvstore.wire import RawChunk


def wire_parts(layout: KVLayout, blocks: Sequence[Mapping[str, Any]], what: str = "block") -> list[Any]:
    """The parts a put (or fetch into `out`) of these blocks takes, in wire order, as
    given (bytes-like, arrays, tensors); a block that lacks one is refused."""
    n = len(blocks)
    parts = []
    for g, j in part_order(layout, n):
        group = layout.groups[g]
        block = blocks[j]
        if not isinstance(block, Mapping):
            raise InvalidArgument(f"{what} {j} of a layout with KV groups must map group names to parts, "
                                  f"got {type(block).__name__}")
        part = block.get(group.name)
        if part is None:
            raise InvalidArgument(f"{what} {j} lacks its part of group {group.name!r}: a prefix of {n} blocks needs "
                                  "it (kvstore.groups.needed says which parts a put needs)")
        parts.append(part)
    return parts


def grouped_header(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None, n: int,
                   first_block: int, hint: kvstore_pb2.ReuseHint | None,
                   engine_names: EngineNames | None = None) -> kvstore_pb2.PutHeader:
    """A grouped put's header: it names the blocks; the sizes it checks are the layout's."""
    return put_header(layout, token_ids, block_hashes, [layout.bytes_per_block] * n, first_block, hint,
                      engine_names)


def prepare_grouped_put(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
                        blocks: Sequence[Mapping[str, Any]], first_block: int,
                        hint: kvstore_pb2.ReuseHint | None,
                        engine_names: EngineNames | None = None) -> PreparedPut:
    """A grouped put's header and its parts in wire order, each size-checked."""
    n = len(blocks)
    views: list[memoryview] = []
    for (g, j), part in zip(part_order(layout, n), wire_parts(layout, blocks)):
        group = layout.groups[g]
        view = as_buffer(part)
        if len(view) != group.bytes_per_block:
            raise InvalidArgument(f"block {j}'s part of group {group.name!r} is {len(view)} bytes; the layout says "
                                  f"{group.bytes_per_block} ({group.kind.value}, {group.dtype}, shape {group.shape})")
        views.append(view)
    return PreparedPut(grouped_header(layout, token_ids, block_hashes, n, first_block, hint, engine_names), views)


class GroupedFetchAssembler:
    """Collects a grouped Fetch stream into one dict of parts per block of the prefix.
    Each chunk is copied to its place in its part's buffer as it arrives (the header
    names the prefix, so every part's size is known): one copy per byte, and no message
    kept past its chunk."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.num_parts = -1
        self.prefix_blocks = 0
        self._bufs: list[bytearray] | None = None
        self._index = -1
        self._offset = 0
        self._done = 0  # parts received whole

    def feed(self, msg: kvstore_pb2.FetchResponse | RawChunk) -> None:
        if isinstance(msg, RawChunk):
            part, data = msg.block, msg.data
        elif msg.WhichOneof("msg") == "header":
            self.num_parts = msg.header.num_blocks
            self.prefix_blocks = msg.header.prefix_blocks
            sizes = part_sizes(self.layout, self.prefix_blocks)
            # A header that is not a prefix this layout has: nothing of it is usable.
            self._bufs = [bytearray(n) for n in sizes] if len(sizes) == self.num_parts else None
            return
        else:
            part, data = msg.chunk.block, memoryview(msg.chunk.data)
        bufs = self._bufs
        if bufs is None:
            return
        if part != self._index:
            if part != self._index + 1:
                raise KVStoreError(f"fetched part {part} after part {self._index}: parts out of order")
            if part >= len(bufs):
                raise KVStoreError(f"fetched part {part}; the prefix has {len(bufs)}")
            self._close_part()
            self._index = part
        buf = bufs[part]
        end = self._offset + len(data)
        if end > len(buf):
            g, j = part_order(self.layout, self.prefix_blocks)[part]
            raise KVStoreError(f"fetched part of group {self.layout.groups[g].name!r} for block {j} has at least "
                               f"{end} bytes, expected {len(buf)}")
        buf[self._offset : end] = data
        self._offset = end

    def _close_part(self) -> None:
        if self._index < 0 or self._bufs is None:
            return
        buf = self._bufs[self._index]
        if self._offset != len(buf):
            g, j = part_order(self.layout, self.prefix_blocks)[self._index]
            raise KVStoreError(f"fetched part of group {self.layout.groups[g].name!r} for block {j} has "
                               f"{self._offset} bytes, expected {len(buf)}")
        self._offset = 0
        self._done += 1

    def result(self) -> list[dict[str, Any]]:
        if self._bufs is None:
            return []
        if self._offset:
            self._close_part()
        if self._done != len(self._bufs):
            return []  # cut short: nothing of it is usable
        return parts_result(self.layout, self.prefix_blocks, self._bufs)


def grouped_fetch_request(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
                          lease_id: str) -> kvstore_pb2.FetchRequest:
    return kvstore_pb2.FetchRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                    lease_id=lease_id)


def part_sizes(layout: KVLayout, n_blocks: int) -> list[int]:
    """The size of each part of a prefix of `n_blocks`, in wire order."""
    return [layout.groups[g].bytes_per_block for g, _ in part_order(layout, n_blocks)]


def parts_result(layout: KVLayout, n_blocks: int, parts: list[Any]) -> list[dict[str, Any]]:
    """One dict of parts per block of a prefix of `n_blocks`, from its parts in wire order
    (all of them: a prefix is served whole or not at all)."""
    if len(parts) != part_count(layout, n_blocks):
        return []
    out: list[dict[str, Any]] = [{} for _ in range(n_blocks)]
    for (g, j), data in zip(part_order(layout, n_blocks), parts):
        out[j][layout.groups[g].name] = data
    return out


def host_blocks_of_parts(blocks: Sequence[Any]) -> Sequence[Any]:
    """`blocks` with parts that are CUDA tensors copied to host memory; else as given."""
    if not any(isinstance(b, Mapping) and any(is_cuda(p) for p in b.values()) for b in blocks):
        return blocks
    return [{k: (p.detach().cpu() if is_cuda(p) else p) for k, p in b.items()} if isinstance(b, Mapping) else b
            for b in blocks]
