"""The SSD path's block codec: byte-plane shuffle + lz4, kept only when it pays.

KV tensors are fp16/bf16 (or fp32/fp8) numbers whose high bytes (sign, exponent) repeat
far more than their low mantissa bytes. Plain lz4 sees interleaved high/low bytes and
finds almost nothing; grouping byte 0 of every element, then byte 1, ... (a byte-plane
shuffle, as in Blosc) gives lz4 long runs of similar exponent bytes. A block is stored
compressed only when that saves at least `MIN_SAVING` of its size; otherwise it is stored
raw, so incompressible data costs one failed attempt and no read-side work.

The checksum is always over the uncompressed bytes (the store's block checksum), so a
decode bug or a corrupt payload is caught by the same verification as any other damage.

Primitives: `encode(data, itemsize) -> Encoded`, `decode(codec, payload, itemsize, raw_len)`.
CPU-bound: callers run these in an executor for blocks over 64 KiB.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import lz4.block
import numpy as np

# Keep a compressed payload only if it is at most 95% of the raw size.
MIN_SAVING = 0.05


class Codec(enum.IntEnum):
    RAW = 0
    SHUFFLE_LZ4 = 1


@dataclass(frozen=True, slots=True)
class Encoded:
    codec: Codec
    payload: bytes | memoryview
    raw_len: int


def shuffle(data: bytes | memoryview, itemsize: int) -> bytes:
    """Byte planes: byte 0 of every element, then byte 1, ... (length must divide)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    return arr.reshape(-1, itemsize).T.tobytes()


def unshuffle(data: bytes, itemsize: int) -> bytes:
    arr = np.frombuffer(data, dtype=np.uint8)
    return arr.reshape(itemsize, -1).T.tobytes()


def encode(data: bytes | memoryview, itemsize: int, min_saving: float = MIN_SAVING) -> Encoded:
    raw_len = len(data)
    if raw_len == 0 or itemsize < 1:
        return Encoded(Codec.RAW, data, raw_len)
    planes = shuffle(data, itemsize) if itemsize > 1 and raw_len % itemsize == 0 else bytes(data)
    packed = lz4.block.compress(planes, store_size=False)
    if len(packed) <= raw_len * (1.0 - min_saving):
        return Encoded(Codec.SHUFFLE_LZ4, packed, raw_len)
    return Encoded(Codec.RAW, data, raw_len)


def decode(codec: int, payload: bytes | memoryview, itemsize: int, raw_len: int) -> bytes:
    """The raw bytes; raises ValueError on a payload that does not decode to `raw_len`."""
    if codec == Codec.RAW:
        if len(payload) != raw_len:
            raise ValueError(f"raw payload is {len(payload)} bytes, header says {raw_len}")
        return bytes(payload)
    if codec == Codec.SHUFFLE_LZ4:
        try:
            planes = lz4.block.decompress(payload, uncompressed_size=raw_len)
        except lz4.block.LZ4BlockError as exc:
            raise ValueError(f"lz4 payload does not decode: {exc}") from None
        if len(planes) != raw_len:
            raise ValueError(f"payload decoded to {len(planes)} bytes, header says {raw_len}")
        if itemsize > 1 and raw_len % itemsize == 0:
            return unshuffle(planes, itemsize)
        return planes
    raise ValueError(f"unknown codec {codec}")
