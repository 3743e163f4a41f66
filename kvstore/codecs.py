"""Lossless block codecs, shared by every path that moves block bytes across a link: the
data lane (a client's fetch and put, the pool's pulls and forwards) and the SSD tier's
records. Which one a transfer uses is decided by `kvstore.codec_chooser`; this module
only encodes and decodes.

KV tensors are fp16/bf16/fp32/fp8 numbers whose high bytes (sign, exponent) repeat far
more than their low mantissa bytes. Plain lz4 sees interleaved high/low bytes and finds
almost nothing; grouping byte 0 of every element, then byte 1, ... (a byte-plane
shuffle, as in Blosc) puts the exponent bytes side by side. lz4 then finds runs; zstd
(at its fastest level) also entropy-codes them, which is what the exponent plane needs:
its bytes take few distinct values but seldom repeat as strings.

| id | name | what |
|---|---|---|
| 0 | `raw` | the bytes as they are |
| 1 | `shuffle-lz4` | byte-plane shuffle by the element size, then lz4 (block format) |
| 2 | `shuffle-zstd` | byte-plane shuffle, then zstd level 1 (a frame with its content size) |

The ids are on the wire (a DATA frame's flags, `kvstore.data_lane`) and on disk (an SSD
record's codec byte), so they never change meaning. zstd needs the `zstandard` package;
without it `available()` leaves it out and nothing offers it.

The checksum a block carries is always over its raw bytes: a payload that does not
decode, or decodes to other bytes, fails the same verification as any other damage.

Primitives: `Codec`, `codec_named`, `available`, `codec_mask`, `codecs_in`, `encode(codec,
data, itemsize)`, `decode(codec, payload, itemsize, raw_len, out=None)`, `shuffle`,
`unshuffle`. CPU-bound: callers run them off the event loop for blocks over 64 KiB.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable

import numpy as np

ZSTD_LEVEL = 1


class Codec(enum.IntEnum):
    RAW = 0
    SHUFFLE_LZ4 = 1
    SHUFFLE_ZSTD = 2

    @property
    def label(self) -> str:
        return _NAMES[self]


_NAMES = {Codec.RAW: "raw", Codec.SHUFFLE_LZ4: "shuffle-lz4", Codec.SHUFFLE_ZSTD: "shuffle-zstd"}
_BY_NAME = {name: codec for codec, name in _NAMES.items()}


class CodecError(ValueError):
    """A payload that does not decode (to the length its header says)."""


def codec_named(name: str) -> Codec:
    """The codec called `name` (`raw`, `shuffle-lz4`, `shuffle-zstd`); ValueError if none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"codec {name!r} is not one of {', '.join(_BY_NAME)}") from None


_zstd_state = threading.local()  # zstandard's (de)compressor objects are not thread-safe


def _zstd() -> object | None:
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


def available() -> tuple[Codec, ...]:
    """The codecs this process can encode and decode (zstd only with `zstandard`)."""
    return tuple(c for c in Codec if c is not Codec.SHUFFLE_ZSTD or _zstd() is not None)


def codec_mask(codecs: Iterable[Codec]) -> int:
    """A set of codecs as the bitmask the proto carries (bit i: codec i); raw is implied."""
    mask = 0
    for c in codecs:
        if c is not Codec.RAW:
            mask |= 1 << int(c)
    return mask


def codecs_in(mask: int) -> tuple[Codec, ...]:
    """The codecs of a bitmask that this process knows, raw first (always)."""
    return (Codec.RAW, *(c for c in available() if c is not Codec.RAW and mask >> int(c) & 1))


def shuffle(data: bytes | bytearray | memoryview, itemsize: int) -> bytes:
    """Byte planes: byte 0 of every element, then byte 1, ... (the length must divide)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    return arr.reshape(-1, itemsize).T.tobytes()


def unshuffle(data: bytes | bytearray | memoryview, itemsize: int) -> bytes:
    arr = np.frombuffer(data, dtype=np.uint8)
    return arr.reshape(itemsize, -1).T.tobytes()


def _planes(data: bytes | bytearray | memoryview, itemsize: int) -> bytes | bytearray | memoryview:
    if itemsize > 1 and len(data) % itemsize == 0:
        return shuffle(data, itemsize)
    return data


def encode(codec: Codec, data: bytes | bytearray | memoryview, itemsize: int) -> bytes | bytearray | memoryview:
    """`data` encoded with `codec` (raw: `data` itself). The caller decides whether the
    result is worth sending or storing instead of the raw bytes."""
    if codec is Codec.RAW:
        return data
    planes = _planes(data, itemsize)
    if codec is Codec.SHUFFLE_LZ4:
        import lz4.block

        return lz4.block.compress(planes, store_size=False)
    if codec is Codec.SHUFFLE_ZSTD:
        cctx = getattr(_zstd_state, "cctx", None)
        if cctx is None:
            zstandard = _zstd()
            if zstandard is None:
                raise CodecError("shuffle-zstd needs the zstandard package")
            cctx = _zstd_state.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)  # type: ignore[attr-defined]
        return cctx.compress(planes)  # type: ignore[no-any-return]
    raise CodecError(f"unknown codec {codec!r}")


def decode(codec: int, payload: bytes | bytearray | memoryview, itemsize: int, raw_len: int,
           out: memoryview | None = None) -> bytes | None:
    """The raw bytes of `payload`: returned, or written into `out` (then None). Raises
    `CodecError` on a payload that does not decode to `raw_len` bytes."""
    if codec == Codec.RAW:
        if len(payload) != raw_len:
            raise CodecError(f"raw payload is {len(payload)} bytes, header says {raw_len}")
        if out is None:
            return bytes(payload)
        out[:raw_len] = payload
        return None
    planes: bytes
    if codec == Codec.SHUFFLE_LZ4:
        import lz4.block

        try:
            planes = lz4.block.decompress(payload, uncompressed_size=raw_len)
        except lz4.block.LZ4BlockError as exc:
            raise CodecError(f"lz4 payload does not decode: {exc}") from None
    elif codec == Codec.SHUFFLE_ZSTD:
        dctx = getattr(_zstd_state, "dctx", None)
        if dctx is None:
            zstandard = _zstd()
            if zstandard is None:
                raise CodecError("shuffle-zstd needs the zstandard package")
            dctx = _zstd_state.dctx = zstandard.ZstdDecompressor()  # type: ignore[attr-defined]
        try:
            planes = dctx.decompress(payload, max_output_size=raw_len)
        except Exception as exc:  # zstandard.ZstdError, or a frame without its size
            raise CodecError(f"zstd payload does not decode: {exc}") from None
    else:
        raise CodecError(f"unknown codec {codec}")
    if len(planes) != raw_len:
        raise CodecError(f"payload decoded to {len(planes)} bytes, header says {raw_len}")
    shuffled = itemsize > 1 and raw_len % itemsize == 0
    if out is None:
        return unshuffle(planes, itemsize) if shuffled else planes
    if shuffled:
        # The unshuffle writes straight into the destination: no third copy.
        dest = np.frombuffer(out, dtype=np.uint8, count=raw_len).reshape(-1, itemsize)
        dest[:] = np.frombuffer(planes, dtype=np.uint8).reshape(itemsize, -1).T
    else:
        out[:raw_len] = planes
    return None


__all__ = ["Codec", "CodecError", "available", "codec_mask", "codec_named", "codecs_in", "decode", "encode",
           "shuffle", "unshuffle"]
