"""Lossy storage codecs for opt-in quantized namespaces (`KVLayout.kv_codec`).

A quantized namespace stores every block in a smaller, lossy form: the SDK quantizes a
block when it is put and dequantizes it when it is fetched (or hands the quantized form
with its scales to an engine that takes it); the daemon, every tier and every plane
only ever see the quantized bytes, so a tier holds 2 to 4 times the blocks. The codec is
part of the namespace id (docs/hashing.md), so a quantized block never answers a
full-precision lookup, nor the reverse.

Both codecs work on a block's K and V as `[2, L, H, B, D]` (K/V, layer, KV head, token,
head dim), whatever axis order the engine keeps (`kv_layout` names it: any order of the
letters `2`, `L`, `B`, `H`, `D`, brackets and a `;`-suffix aside). Inputs are float32,
float16 or bfloat16.

`fp8-e4m3`: one scale per (K/V, layer, head) of a block, `amax / 448`, float32; each
value is `x / scale` rounded to the nearest float8 e4m3fn value (ties to even, as
`torch.float8_e4m3fn` rounds). Stored: codes `[2, L, H, B, D]` u8, then scales
`[2, L, H]` f32 LE. Bound per value: `|x - x'| <= max(|x| / 16, scale / 1024)` before
the cast back to the engine's dtype (3 mantissa bits: half an ulp is 1/16 of the value;
subnormals are 2^-9 apart).

`kivi4` (as KIVI quantizes, at 4 bits): keys per channel (for each layer, head and head
dim channel, over the block's B tokens), values per token (for each layer, head and
token, over groups of `VALUE_GROUP` channels), asymmetric: `x' = min + q * scale`, q in
0..15, scale and min float16 (min rounded down and scale rounded up, so every value
lies in the range its 16 levels cover). Stored: codes `[2, L, H, B, D]` two per byte (the
even index in the low nibble), then K scales and K mins `[L, H, D]` f16, then V scales
and V mins `[L, H, B, D / G]` f16. Bound per value: `|x - x'| <= scale / 2` of its
group (plus float32 rounding), before the cast back.

Primitives: `KV_CODECS`, `check_layout(layout)`, `stored_block_bytes(...)`,
`BlockQuantizer` (`quantize`, `dequantize`, `parts`, `bound`), `quantizer_for(layout)`,
`to_e4m3`, `from_e4m3`. numpy only; CPU-bound (callers keep it off event loops).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    from kvstore.layout import KVLayout

FP8 = "fp8-e4m3"
KIVI4 = "kivi4"
KV_CODECS = (FP8, KIVI4)
VALUE_GROUP = 32
E4M3_MAX = 448.0
FP16_MAX = 65504.0
CANONICAL = ("2", "L", "H", "B", "D")
DENSE_DTYPES = ("float32", "float16", "bfloat16")


def layout_axes(kv_layout: str) -> tuple[str, ...] | None:
    """The axis order `kv_layout` names, if it is an order of `2,L,B,H,D` (brackets and a
    `;` suffix ignored: `L,[H,2,B,D];vllm-cpu-attn/x` is L, H, 2, B, D); else None."""
    body = kv_layout.split(";", 1)[0].replace("[", "").replace("]", "")
    axes = tuple(a.strip() for a in body.split(","))
    return axes if sorted(axes) == sorted(CANONICAL) else None


def stored_block_bytes(codec: str, layers: int, heads: int, tokens: int, dim: int) -> int:
    """Bytes of one quantized block."""
    n = 2 * layers * heads * tokens * dim
    if codec == FP8:
        return n + 4 * 2 * layers * heads
    if codec == KIVI4:
        return n // 2 + 2 * 2 * layers * heads * dim + 2 * 2 * layers * heads * tokens * (dim // _value_group(dim))
    raise InvalidArgument(f"kv_codec {codec!r} is not one of {', '.join(KV_CODECS)} (or '' for none)")


def _value_group(dim: int) -> int:
    return VALUE_GROUP if dim % VALUE_GROUP == 0 else dim


def check_layout(layout: KVLayout) -> None:
    """Refuse a quantized layout these codecs cannot handle, saying why."""
    codec = layout.kv_codec
    if codec not in KV_CODECS:
        raise InvalidArgument(f"kv_codec {codec!r} is not one of {', '.join(KV_CODECS)} (or '' for none)")
    if layout.groups:
        raise InvalidArgument(f"kv_codec {codec!r} quantizes one K/V tensor per block; a layout with KV groups "
                              "cannot use it")
    if layout.dtype not in DENSE_DTYPES:
        raise InvalidArgument(f"kv_codec {codec!r} quantizes {', '.join(DENSE_DTYPES)} KV, not {layout.dtype!r}")
    if layout_axes(layout.kv_layout) is None:
        raise InvalidArgument(f"kv_codec {codec!r} needs to know the block's axes: kv_layout must be an order of "
                              f"2,L,B,H,D (e.g. '2,L,B,H,D' or 'L,2,H,B,D'), got {layout.kv_layout!r}")
    if codec == KIVI4 and (layout.num_layers * layout.num_kv_heads * layout.block_size_tokens * layout.head_dim) % 2:
        raise InvalidArgument("kv_codec 'kivi4' packs two values per byte: a block needs an even number of values")


# ------------------------------------------------------------------ element conversions


def _to_f32(raw: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    if dtype == "float32":
        return raw.view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # bfloat16


def _from_f32(x: np.ndarray[Any, Any], dtype: str, out: np.ndarray[Any, Any]) -> None:
    """`x` (float32) into `out` (raw bytes of `dtype`, same shape in elements), rounded to
    nearest even."""
    if dtype == "float32":
        out.view(np.float32)[...] = x
    elif dtype == "float16":
        out.view(np.float16)[...] = x
    else:
        bits = x.view(np.uint32)
        out.view(np.uint16)[...] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def to_e4m3(y: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """float32 values (|y| <= 448) as float8 e4m3fn codes, rounded to nearest even."""
    y = np.ascontiguousarray(y, dtype=np.float32)
    bits = y.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    a = np.abs(y)
    ab = a.view(np.uint32)
    # Round the float32 mantissa to 3 bits (ties to even) by adding the bias below the kept bits.
    r = (ab + np.uint32(0x7FFFF) + ((ab >> 20) & 1)) & np.uint32(0xFFF00000)
    exp = (r >> 23).astype(np.int32) - 120  # float32 bias 127, e4m3 bias 7
    normal = (np.clip(exp, 0, 15) << 3) | ((r >> 20) & 7).astype(np.int32)
    sub = np.rint(a * np.float32(512.0)).astype(np.int32)  # subnormals: multiples of 2^-9
    code = np.where(a < np.float32(2.0**-6), sub, normal)
    return (np.minimum(code, 0x7E).astype(np.uint8)) | sign  # 0x7E is 448, the largest finite


def _e4m3_table() -> np.ndarray[Any, Any]:
    c = np.arange(256)
    e, m = (c >> 3) & 15, c & 7
    mag = np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))
    vals = np.where(c & 0x80, -mag, mag).astype(np.float32)
    vals[[0x7F, 0xFF]] = np.nan
    return vals


_E4M3 = _e4m3_table()


def from_e4m3(codes: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return _E4M3[codes]  # type: ignore[no-any-return]


def _f16_down(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) > x, np.nextafter(h, np.float16(-np.inf)), h)


def _f16_up(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


# ------------------------------------------------------------------ the codecs


class BlockQuantizer:
    """Quantizes and dequantizes the blocks of one layout (`quantizer_for` caches them)."""

    def __init__(self, layout: KVLayout) -> None:
        check_layout(layout)
        self.codec = layout.kv_codec
        self.dtype = layout.dtype
        axes = layout_axes(layout.kv_layout)
        assert axes is not None
        size = {"2": 2, "L": layout.num_layers, "H": layout.num_kv_heads, "B": layout.block_size_tokens,
                "D": layout.head_dim}
        self.engine_shape = tuple(size[a] for a in axes)
        self.to_canonical = tuple(axes.index(a) for a in CANONICAL)
        self.from_canonical = tuple(CANONICAL.index(a) for a in axes)
        self.L, self.H, self.B, self.D = layout.num_layers, layout.num_kv_heads, layout.block_size_tokens, layout.head_dim
        self.itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]
        self.dense_bytes = 2 * self.L * self.H * self.B * self.D * self.itemsize
        self.stored_bytes = stored_block_bytes(self.codec, self.L, self.H, self.B, self.D)
        self.group = _value_group(self.D)
        # Blocks per numpy step: about 4 MiB of float32 temporaries at a time.
        self.batch = max(1, (4 << 20) // (2 * self.L * self.H * self.B * self.D * 4))

    # -------------------------------------------------------------- layout of the stored form

    def parts(self, stored: bytes | bytearray | memoryview) -> dict[str, np.ndarray[Any, Any]]:
        """The named arrays of one quantized block (views of `stored`): `codes`
        (`[2, L, H, B, D]`; kivi4: packed `[2*L*H*B*D/2]` u8) and the scales: fp8-e4m3
        `scales` `[2, L, H]` f32; kivi4 `k_scale`, `k_min` `[L, H, D]` f16, `v_scale`,
        `v_min` `[L, H, B, D/G]` f16. What an engine that takes the quantized form reads."""
        buf = np.frombuffer(stored, dtype=np.uint8, count=self.stored_bytes)
        L, H, B, D = self.L, self.H, self.B, self.D
        n = 2 * L * H * B * D
        if self.codec == FP8:
            return {"codes": buf[:n].reshape(2, L, H, B, D),
                    "scales": buf[n:].view("<f4").reshape(2, L, H)}
        at = n // 2
        out = {"codes": buf[:at]}
        for name, shape in (("k_scale", (L, H, D)), ("k_min", (L, H, D)),
                            ("v_scale", (L, H, B, D // self.group)), ("v_min", (L, H, B, D // self.group))):
            size = 2 * int(np.prod(shape))
            out[name] = buf[at : at + size].view("<f2").reshape(shape)
            at += size
        return out

    # -------------------------------------------------------------- quantize

    def _canonical(self, blocks: Sequence[Any]) -> np.ndarray[Any, Any]:
        """`[n, 2, L, H, B, D]` float32 of the engine's blocks."""
        raws = []
        for b in blocks:
            raw = np.frombuffer(_bytes_of(b), dtype=np.uint8)
            if raw.size != self.dense_bytes:
                raise InvalidArgument(f"a block of this layout is {self.dense_bytes} bytes (its engine dtype), got "
                                      f"{raw.size}")
            raws.append(raw)
        x = _to_f32(np.stack(raws) if len(raws) > 1 else raws[0][None], self.dtype)
        x = x.reshape(len(raws), *self.engine_shape)
        return x.transpose(0, *(1 + a for a in self.to_canonical))

    def quantize(self, blocks: Sequence[Any]) -> list[bytes]:
        """Each block (bytes, a buffer or a numpy array of the engine's bytes) quantized,
        a few blocks at a time (the temporaries of a step stay in cache)."""
        out: list[bytes] = []
        for start in range(0, len(blocks), self.batch):
            x = self._canonical(blocks[start : start + self.batch])
            stored = self._quantize_fp8(x) if self.codec == FP8 else self._quantize_kivi(x)
            out += [row.tobytes() for row in stored]
        return out

    def _quantize_fp8(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        n = x.shape[0]
        amax = np.abs(x).max(axis=(4, 5))  # [n, 2, L, H]
        scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
        codes = to_e4m3(x / scale[..., None, None])
        out = np.empty((n, self.stored_bytes), dtype=np.uint8)
        m = codes[0].size
        out[:, :m] = codes.reshape(n, m)
        out[:, m:] = scale.reshape(n, -1).astype("<f4").view(np.uint8)
        return out

    def _quantize_kivi(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        n, G = x.shape[0], self.group
        L, H, B, D = self.L, self.H, self.B, self.D
        if not np.isfinite(x).all() or np.abs(x).max(initial=0.0) > FP16_MAX:
            raise InvalidArgument(f"kivi4 keeps scales in float16: KV values must be finite and within "
                                  f"+-{FP16_MAX:g}")
        k, v = x[:, 0], x[:, 1]  # [n, L, H, B, D]
        k_lo, k_hi = k.min(axis=3), k.max(axis=3)  # per channel: [n, L, H, D]
        vg = v.reshape(n, L, H, B, D // G, G)
        v_lo, v_hi = vg.min(axis=5), vg.max(axis=5)  # per token and group: [n, L, H, B, D/G]
        k_min, k_scale = self._range(k_lo, k_hi)
        v_min, v_scale = self._range(v_lo, v_hi)
        kq = np.clip(np.rint((k - k_min.astype(np.float32)[:, :, :, None, :])
                             / k_scale.astype(np.float32)[:, :, :, None, :]), 0, 15)
        vq = np.clip(np.rint((vg - v_min.astype(np.float32)[..., None]) / v_scale.astype(np.float32)[..., None]),
                     0, 15).reshape(n, L, H, B, D)
        q = np.stack((kq, vq), axis=1).astype(np.uint8).reshape(n, -1)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        return np.concatenate([packed, *(a.astype("<f2").reshape(n, -1).view(np.uint8)
                                         for a in (k_scale, k_min, v_scale, v_min))], axis=1)

    @staticmethod
    def _range(lo: np.ndarray[Any, Any], hi: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(min rounded down, scale rounded up) in float16: 16 levels from min cover hi."""
        m = _f16_down(lo)
        span = (hi - m.astype(np.float32)) / np.float32(15.0)
        s = _f16_up(np.maximum(span, np.float32(2.0**-24)))
        return m, s

    # -------------------------------------------------------------- dequantize

    def dequantize(self, stored: Sequence[bytes | bytearray | memoryview],
                   out: Sequence[memoryview] | None = None) -> list[bytes] | None:
        """The engine's bytes of each quantized block: returned, or written into `out`
        (one writable buffer of the engine's block size each; then None)."""
        if len(stored) > self.batch:
            got: list[bytes] = []
            for start in range(0, len(stored), self.batch):
                part = self.dequantize(stored[start : start + self.batch],
                                       None if out is None else out[start : start + self.batch])
                got += part or []
            return got if out is None else None
        if not len(stored):
            return [] if out is None else None
        raws = [np.frombuffer(s, dtype=np.uint8, count=self.stored_bytes) for s in stored]
        q = np.stack(raws) if len(raws) > 1 else raws[0][None]
        x = self._dequantize_fp8(q) if self.codec == FP8 else self._dequantize_kivi(q)
        engine = x.transpose(0, *(1 + a for a in self.from_canonical))  # [n, engine axes]
        n = len(raws)
        dense = np.empty((n, self.dense_bytes), dtype=np.uint8) if out is None else None
        for i in range(n):
            target = (dense[i] if dense is not None
                      else np.frombuffer(out[i], dtype=np.uint8, count=self.dense_bytes))  # type: ignore[index]
            _from_f32(np.ascontiguousarray(engine[i]).reshape(-1), self.dtype, target.view(_VIEW[self.dtype]))
        return [row.tobytes() for row in dense] if dense is not None else None

    def _dequantize_fp8(self, q: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        n, L, H, B, D = q.shape[0], self.L, self.H, self.B, self.D
        m = 2 * L * H * B * D
        scale = np.ascontiguousarray(q[:, m:]).view("<f4").reshape(n, 2, L, H)
        return from_e4m3(q[:, :m]).reshape(n, 2, L, H, B, D) * scale[..., None, None]

    def _dequantize_kivi(self, q: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        n, G = q.shape[0], self.group
        L, H, B, D = self.L, self.H, self.B, self.D
        half = L * H * B * D  # (2*L*H*B*D) / 2 bytes of codes
        packed = q[:, :half]
        codes = np.empty((n, 2 * half), dtype=np.float32)
        codes[:, 0::2] = packed & 15
        codes[:, 1::2] = packed >> 4
        codes = codes.reshape(n, 2, L, H, B, D)
        at = half
        arrays = []
        for count in (L * H * D, L * H * D, L * H * B * (D // G), L * H * B * (D // G)):
            arrays.append(np.ascontiguousarray(q[:, at : at + 2 * count]).view("<f2").astype(np.float32))
            at += 2 * count
        k_scale, k_min = (a.reshape(n, L, H, D) for a in arrays[:2])
        v_scale, v_min = (a.reshape(n, L, H, B, D // G) for a in arrays[2:])
        out = np.empty((n, 2, L, H, B, D), dtype=np.float32)
        out[:, 0] = k_min[:, :, :, None, :] + codes[:, 0] * k_scale[:, :, :, None, :]
        vg = codes[:, 1].reshape(n, L, H, B, D // G, G)
        out[:, 1] = (v_min[..., None] + vg * v_scale[..., None]).reshape(n, L, H, B, D)
        return out

    # -------------------------------------------------------------- the stated bound

    def bound(self, stored: bytes | bytearray | memoryview, dense: Any) -> np.ndarray[Any, Any]:
        """Per value of one block (canonical `[2, L, H, B, D]`, float32): the most its
        dequantized value may differ from `dense` (the original block), as the module
        doc states it, before the cast back to the engine's dtype."""
        x = self._canonical([dense])[0]
        p = self.parts(stored)
        if self.codec == FP8:
            scale = p["scales"].astype(np.float32)[..., None, None]
            return np.maximum(np.abs(x) / 16, scale / 1024)  # type: ignore[no-any-return]
        L, H, B, D, G = self.L, self.H, self.B, self.D, self.group
        k = np.broadcast_to(p["k_scale"].astype(np.float32)[:, :, None, :], (L, H, B, D))
        v = np.repeat(p["v_scale"].astype(np.float32), G, axis=3)
        return np.stack((k, v)) / 2 * (1 + 2.0**-20) + 1e-30  # type: ignore[no-any-return]

    def dense_canonical(self, dense: Any) -> np.ndarray[Any, Any]:
        """One engine block as canonical `[2, L, H, B, D]` float32 (for comparisons)."""
        return self._canonical([dense])[0]


_VIEW = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def _bytes_of(block: Any) -> bytes | bytearray | memoryview:
    if isinstance(block, (bytes, bytearray, memoryview)):
        return block
    if isinstance(block, np.ndarray):
        return np.ascontiguousarray(block).reshape(-1).view(np.uint8).data
    raise InvalidArgument(f"a block must be bytes, a buffer or a numpy array (the SDK passes tensors as their "
                          f"bytes), got {type(block).__name__}")


@lru_cache(maxsize=64)
def quantizer_for(layout: KVLayout) -> BlockQuantizer:
    return BlockQuantizer(layout)


__all__ = ["FP8", "KIVI4", "KV_CODECS", "VALUE_GROUP", "BlockQuantizer", "check_layout", "from_e4m3",
           "layout_axes", "quantizer_for", "stored_block_bytes", "to_e4m3"]
