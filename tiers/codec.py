"""The SSD path's record codec: a lossless codec of `kvstore.codecs` (byte-plane shuffle +
lz4, or + zstd), kept for a record only when it saves at least `MIN_SAVING`; otherwise
the record is raw, so a block that does not compress costs no read-side work.

Which codec a record is tried with is the SSD tier's `CodecChooser`'s choice
(`tiers/ssd/tier.py`). The record's codec byte is the codec's id (0 raw, 1 shuffle-lz4,
2 shuffle-zstd: ids never change meaning, so every log written before stays readable).

The checksum is always over the uncompressed bytes (the store's block checksum), so a
decode bug or a corrupt payload is caught by the same verification as any other damage.

Primitives: `encode_with(codec, data, itemsize) -> Encoded`, `encode(data, itemsize)`
(shuffle + lz4, as before), `decode(codec, payload, itemsize, raw_len)`. CPU-bound:
callers run these in an executor for blocks over 64 KiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.codecs import Codec, CodecError
from kvstore.codecs import decode as _decode
from kvstore.codecs import encode as _encode

# Keep a compressed payload only if it is at most 95% of the raw size.
MIN_SAVING = 0.05


@dataclass(frozen=True, slots=True)
class Encoded:
    codec: Codec
    payload: bytes | bytearray | memoryview
    raw_len: int


def encode_with(codec: Codec, data: bytes | memoryview, itemsize: int, min_saving: float = MIN_SAVING) -> Encoded:
    """`data` in `codec` if that saves at least `min_saving` of it, else raw."""
    raw_len = len(data)
    if codec is Codec.RAW or raw_len == 0 or itemsize < 1:
        return Encoded(Codec.RAW, data, raw_len)
    packed = _encode(codec, data, itemsize)
    if len(packed) <= raw_len * (1.0 - min_saving):
        return Encoded(codec, packed, raw_len)
    return Encoded(Codec.RAW, data, raw_len)


def encode(data: bytes | memoryview, itemsize: int, min_saving: float = MIN_SAVING) -> Encoded:
    """Shuffle + lz4 where it saves `min_saving`, else raw."""
    return encode_with(Codec.SHUFFLE_LZ4, data, itemsize, min_saving)


def decode(codec: int, payload: bytes | memoryview, itemsize: int, raw_len: int) -> bytes:
    """The raw bytes; raises ValueError on a payload that does not decode to `raw_len`."""
    try:
        out = _decode(codec, payload, itemsize, raw_len)
    except CodecError as exc:
        raise ValueError(str(exc)) from None
    assert out is not None
    return out


__all__ = ["MIN_SAVING", "Codec", "Encoded", "decode", "encode", "encode_with"]
