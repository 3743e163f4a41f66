"""Lossless codecs (`kvstore.codecs`) and their chooser (`kvstore.codec_chooser`).

Round trips are exact for every codec on every dtype's bytes; a payload that does not
decode is an error, never other bytes. The chooser's decisions are checked on
observations fed to it directly (no timing in a test): raw on a fast link, a codec on a
slow one, never a codec on blocks it cannot shrink, and what it shows in its snapshot.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.codec_chooser import LEARN_MIN_BYTES, PROBE_EVERY, CodecChooser
from kvstore.codecs import Codec, CodecError, available, codec_mask, codec_named, codecs_in, decode, encode

MiB = 1 << 20
NS = b"n" * 16


def kv_bytes(dtype: str, n: int, seed: int = 0) -> bytes:
    """Values shaped like KV (normal, a few large channels) in `dtype`'s bytes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.where(np.arange(n) % 64 < 4, 8.0, 0.5)).astype(np.float32)
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    if dtype in ("int8", "uint8", "float8_e4m3fn"):
        return np.clip(x * 16, -127, 127).astype(np.int8).tobytes()
    return x.astype(dtype).tobytes()


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "int8": 1}


@pytest.mark.parametrize("codec", list(available()))
@pytest.mark.parametrize("dtype", list(ITEMSIZE))
def test_every_codec_round_trips_every_dtype_exactly(codec: Codec, dtype: str) -> None:
    size = ITEMSIZE[dtype]
    for data in (kv_bytes(dtype if dtype != "float64" else "float64", 8192), os.urandom(4096 * size), b"",
                 bytes(1000 * size), os.urandom(7)):  # odd lengths are encoded unshuffled
        enc = encode(codec, data, size)
        assert decode(codec, enc, size, len(data)) == data
        out = bytearray(len(data))
        assert decode(codec, enc, size, len(data), memoryview(out)) is None
        assert bytes(out) == data


def test_zstd_is_available_and_shrinks_bf16_kv_more_than_lz4() -> None:
    assert Codec.SHUFFLE_ZSTD in available(), "zstandard is a dependency (pyproject.toml)"
    data = kv_bytes("bfloat16", 1 << 16)
    lz4, zstd = (len(encode(c, data, 2)) for c in (Codec.SHUFFLE_LZ4, Codec.SHUFFLE_ZSTD))
    assert zstd < lz4 < len(data)


@pytest.mark.parametrize("codec", [Codec.SHUFFLE_LZ4, Codec.SHUFFLE_ZSTD])
def test_a_damaged_payload_is_an_error_or_other_bytes_never_silently_right(codec: Codec) -> None:
    data = kv_bytes("float16", 8192)
    enc = bytearray(encode(codec, data, 2))
    with pytest.raises(CodecError):
        decode(codec, bytes(enc[: len(enc) // 2]), 2, len(data))  # cut short
    with pytest.raises(CodecError):
        decode(codec, enc, 2, len(data) + 2)  # the wrong raw length
    enc[len(enc) // 3] ^= 0x40
    try:
        assert decode(codec, enc, 2, len(data)) != data  # the checksum catches this
    except CodecError:
        pass
    with pytest.raises(CodecError):
        decode(9, enc, 2, len(data))


def test_codec_names_and_masks() -> None:
    assert [c.label for c in Codec] == ["raw", "shuffle-lz4", "shuffle-zstd"]
    assert codec_named("shuffle-zstd") is Codec.SHUFFLE_ZSTD
    with pytest.raises(ValueError, match="not one of"):
        codec_named("gzip")
    mask = codec_mask([Codec.RAW, Codec.SHUFFLE_ZSTD])
    assert mask == 0b100
    assert codecs_in(mask) == (Codec.RAW, Codec.SHUFFLE_ZSTD)
    assert codecs_in(0) == (Codec.RAW,)
    assert codecs_in(1 << 7) == (Codec.RAW,)  # an id this process does not know is left out


# ---------------------------------------------------------------------- the chooser


def chooser_with(data: bytes, encode_gbps: float, decode_gbps: float) -> CodecChooser:
    """A chooser that sampled zstd on NS with `data` (its real ratio) at these speeds
    (a fake clock: each encode and decode takes what the speed says)."""
    n = len(data)
    ticks = iter([0.0, n * 1e-9 / encode_gbps, n * 1e-9 / encode_gbps + n * 1e-9 / decode_gbps] * 1000)
    chooser = CodecChooser([Codec.RAW, Codec.SHUFFLE_ZSTD], clock=lambda: next(ticks))
    chooser.sample(NS, 2, data)
    return chooser


KV = kv_bytes("bfloat16", 1 << 16)  # zstd: about 0.7 of its size
ZSTD_RATIO = len(encode(Codec.SHUFFLE_ZSTD, KV, 2)) / len(KV)


def test_raw_until_the_link_was_measured_then_raw_on_a_fast_link() -> None:
    chooser = chooser_with(KV, encode_gbps=0.5, decode_gbps=0.5)
    assert chooser.choose("a", NS, [Codec.SHUFFLE_ZSTD]) is Codec.RAW  # nothing measured yet
    chooser.observed("a", NS, Codec.RAW, 64 * MiB, 64 * MiB, 64 * MiB / 2.5e9)  # 2.5 GB/s link
    for _ in range(3 * PROBE_EVERY):
        assert chooser.choose("a", NS, [Codec.SHUFFLE_ZSTD]) is Codec.RAW  # never tried: no probe of it
    (c,) = chooser.snapshot()
    assert c.choice == "raw" and c.link_gbps == pytest.approx(2.5, rel=0.01)
    assert c.expected_gbps["shuffle-zstd"] < c.expected_gbps["raw"]


def test_a_codec_on_a_slow_link_and_back_to_raw_when_it_proves_slower() -> None:
    chooser = chooser_with(KV, encode_gbps=0.5, decode_gbps=0.5)
    chooser.observed("slow", NS, Codec.RAW, 64 * MiB, 64 * MiB, 64 * MiB / 0.125e9)  # 1 Gbit/s
    assert chooser.choose("slow", NS, [Codec.SHUFFLE_ZSTD]) is Codec.SHUFFLE_ZSTD
    assert chooser.choose("slow", NS, []) is Codec.RAW  # the other end takes no codec
    # Used, it turned out slower than raw: its observed figure wins over the model's.
    chooser.observed("slow", NS, Codec.SHUFFLE_ZSTD, 64 * MiB, 45 * MiB, 64 * MiB / 0.1e9)
    picks = [chooser.choose("slow", NS, [Codec.SHUFFLE_ZSTD]) for _ in range(2 * PROBE_EVERY)]
    assert picks.count(Codec.RAW) >= 2 * PROBE_EVERY - 2  # raw, but for a probe of zstd now and then
    assert Codec.SHUFFLE_ZSTD in picks  # ... which refreshes its figure (within PROBE_WITHIN)
    (c,) = chooser.snapshot()
    assert c.choice == "raw" and c.raw_bytes == {"raw": 64 * MiB, "shuffle-zstd": 64 * MiB}
    assert c.wire_bytes["shuffle-zstd"] == 45 * MiB
    assert c.ratios["shuffle-zstd"] == pytest.approx(ZSTD_RATIO + 0.3 * (45 / 64 - ZSTD_RATIO), abs=1e-3)


def test_never_a_codec_that_does_not_shrink_the_namespace_however_slow_the_link() -> None:
    chooser = chooser_with(os.urandom(1 << 16), encode_gbps=50, decode_gbps=50)
    chooser.observed("slow", NS, Codec.RAW, 64 * MiB, 64 * MiB, 10.0)
    assert all(chooser.choose("slow", NS, [Codec.SHUFFLE_ZSTD]) is Codec.RAW for _ in range(100))


def test_a_codec_must_beat_raw_by_the_margin_to_be_chosen() -> None:
    """Observed figures (transfers made with each option) decide: a codec 3% faster than
    raw is not worth switching to, one 10% faster is, and once on it, it stays while it
    is faster at all."""
    chooser = CodecChooser([Codec.RAW, Codec.SHUFFLE_ZSTD])
    chooser.observed("l", NS, Codec.RAW, 64 * MiB, 64 * MiB, 1.0)
    chooser.observed("l", NS, Codec.SHUFFLE_ZSTD, 64 * MiB, 40 * MiB, 0.97)
    assert chooser.choose("l", NS, [Codec.SHUFFLE_ZSTD]) is Codec.RAW
    for _ in range(10):
        chooser.observed("l", NS, Codec.SHUFFLE_ZSTD, 64 * MiB, 40 * MiB, 0.9)
    assert chooser.choose("l", NS, [Codec.SHUFFLE_ZSTD]) is Codec.SHUFFLE_ZSTD
    for _ in range(10):
        chooser.observed("l", NS, Codec.SHUFFLE_ZSTD, 64 * MiB, 40 * MiB, 0.98)
    assert chooser.choose("l", NS, [Codec.SHUFFLE_ZSTD]) is Codec.SHUFFLE_ZSTD


def test_small_transfers_teach_nothing_and_links_and_namespaces_are_apart() -> None:
    chooser = chooser_with(KV, encode_gbps=0.5, decode_gbps=0.5)
    chooser.observed("slow", NS, Codec.RAW, LEARN_MIN_BYTES - 1, LEARN_MIN_BYTES - 1, 100.0)
    assert chooser.choose("slow", NS, [Codec.SHUFFLE_ZSTD]) is Codec.RAW  # still unmeasured
    chooser.observed("slow", NS, Codec.RAW, 64 * MiB, 64 * MiB, 64 * MiB / 0.125e9)
    assert chooser.choose("slow", NS, [Codec.SHUFFLE_ZSTD]) is Codec.SHUFFLE_ZSTD
    assert chooser.choose("fast", NS, [Codec.SHUFFLE_ZSTD]) is Codec.RAW
    assert chooser.choose("slow", b"m" * 16, [Codec.SHUFFLE_ZSTD]) is Codec.RAW  # not sampled: no model
    assert {(c.link, c.namespace) for c in chooser.snapshot()} == {("slow", NS), ("fast", NS),
                                                                    ("slow", b"m" * 16)}


def test_sampling_measures_real_blocks() -> None:
    chooser = CodecChooser()
    data = kv_bytes("bfloat16", 1 << 16)
    assert chooser.wants_sample(NS)
    chooser.sample(NS, 2, data)
    chooser.choose("x", NS, available())
    (c,) = chooser.snapshot()
    zstd = len(encode(Codec.SHUFFLE_ZSTD, data, 2)) / len(data)
    assert c.ratios["shuffle-zstd"] == pytest.approx(zstd, abs=1e-3)
    assert c.encode_gbps["shuffle-lz4"] > 0 and c.decode_gbps["shuffle-zstd"] > 0
