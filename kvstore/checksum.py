"""Block checksums: XXH3-64 (seed 0) over a block's uncompressed bytes.

Computed once when a put completes and verified whenever a block leaves the daemon or
crosses a tier boundary. Hashing runs in a bounded thread pool when a batch is large,
inline when it is small: the hand-off costs more than hashing a few KiB. Large inputs go
through xxhash's streaming object, whose `update` releases the GIL in every release this
package accepts (the one-shot function holds it in the 3.x releases), so a pool thread
hashing never stalls the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor

import xxhash

# Below this many bytes in a batch, hashing inline beats the thread hand-off.
INLINE_LIMIT_BYTES = 64 * 1024

Buffer = bytes | bytearray | memoryview


def checksum(data: Buffer) -> int:
    if len(data) <= INLINE_LIMIT_BYTES:
        return xxhash.xxh3_64_intdigest(data)
    h = xxhash.xxh3_64()
    h.update(data)  # releases the GIL (see the module note)
    return h.intdigest()


def checksum_many(buffers: Sequence[Buffer]) -> list[int]:
    return [checksum(b) for b in buffers]


async def checksum_batch(buffers: Sequence[Buffer], executor: Executor | None) -> list[int]:
    """Checksums of `buffers`, off the loop when the batch is large."""
    total = sum(len(b) for b in buffers)
    if executor is None or total <= INLINE_LIMIT_BYTES:
        return checksum_many(buffers)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, checksum_many, buffers)


def checksum_pieced(blocks: Sequence[Sequence[Buffer]]) -> list[int]:
    """Checksum of each block given as consecutive pieces (equal to hashing the joined bytes)."""
    out = []
    for pieces in blocks:
        if len(pieces) == 1:
            out.append(checksum(pieces[0]))
            continue
        h = xxhash.xxh3_64()
        for piece in pieces:
            h.update(piece)
        out.append(h.intdigest())
    return out
