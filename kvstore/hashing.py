"""Namespace fingerprints and chained block hashes, byte-exact (see docs/hashing.md).

H is XXH3-128 with seed 0, and a digest is its 16-byte canonical (big-endian) form.

    namespace_id = H(b"kvstore.ns.v1\\0" || fields)          (field encoding in the doc)
                 = H(b"kvstore.ns.v2\\0" || fields || groups)  (a layout with KV groups)
                 = H(b"kvstore.ns.q1\\0" || codec || stored size || its full-precision
                     twin's bytes)                            (a lossy storage codec)
    h_0          = H(namespace_id || block 0)
    h_i          = H(h_{i-1} || block i)
    block i      = u32le(n_tokens) || u32le(token)*n_tokens || u32le(len(extra)) || extra

Only full blocks are hashed: trailing tokens that do not fill a block have no key.
Everything here is deterministic across processes, machines and languages; no seeds,
no Python `hash()`.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.native import XXH3
from kvstore.native import native as _native

if TYPE_CHECKING:
    from kvstore.layout import KVGroup, KVLayout

HASH_BYTES = 16
NAMESPACE_DOMAIN = b"kvstore.ns.v1\x00"
GROUPED_NAMESPACE_DOMAIN = b"kvstore.ns.v2\x00"
QUANTIZED_NAMESPACE_DOMAIN = b"kvstore.ns.q1\x00"
MAX_TOKEN_ID = (1 << 32) - 1

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_h128 = xxhash.xxh3_128_digest
_NO_EXTRA = _U32.pack(0)  # u32le(len(extra)) of a block without extra bytes
_NUMPY_FROM_BLOCKS = 32  # chains at least this long lay out their blocks with numpy (faster from ~40)


def _str_field(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _U32.pack(len(raw)) + raw


def namespace_bytes(layout: KVLayout) -> bytes:
    """The exact bytes that `namespace_id` hashes (documented field by field). A layout
    with KV groups is hashed under its own domain tag, the groups after the fields; a
    layout with a lossy storage codec under another, the codec and its stored block size
    before the bytes its full-precision twin hashes."""
    if layout.kv_codec:
        return b"".join((QUANTIZED_NAMESPACE_DOMAIN, _str_field(layout.kv_codec), _U64.pack(layout.bytes_per_block),
                         namespace_bytes(layout.without_codec())))
    if layout.groups:
        return b"".join((GROUPED_NAMESPACE_DOMAIN, _layout_fields(layout), _U32.pack(len(layout.groups)),
                         *(_group_fields(g) for g in layout.groups)))
    return NAMESPACE_DOMAIN + _layout_fields(layout)


def _group_fields(group: KVGroup) -> bytes:
    return b"".join(
        (
            _str_field(group.name),
            _str_field(group.kind.value),
            _str_field(group.dtype),
            _U32.pack(len(group.shape)),
            *(_U64.pack(d) for d in group.shape),
            _U64.pack(group.window_tokens),
            _U64.pack(group.bytes_per_block),
        )
    )


def _layout_fields(layout: KVLayout) -> bytes:
    return b"".join(
        (
            _str_field(layout.model),
            _str_field(layout.revision),
            _str_field(layout.lora_id),
            _str_field(layout.dtype),
            _str_field(layout.kv_layout),
            _U64.pack(layout.num_layers),
            _U64.pack(layout.num_kv_heads),
            _U64.pack(layout.head_dim),
            _U64.pack(layout.block_size_tokens),
            _U64.pack(layout.tp_rank),
            _U64.pack(layout.tp_size),
            _U64.pack(layout.bytes_per_block),
        )
    )


def namespace_id(layout: KVLayout) -> bytes:
    return _h128(namespace_bytes(layout))


GROUP_DOMAIN = b"kvstore.group.v1\x00"


def group_namespace_id(namespace_id: bytes, group_index: int) -> bytes:
    """The id the daemon files group `group_index`'s parts of a grouped namespace under:
    H(domain || namespace_id || u32le(index)), from the id the namespace is filed under
    (tenant-salted). Block hashes are the layout's: part g of block i is keyed
    (group id g, h_i), so every group of a block shares its hash."""
    return _h128(b"".join((GROUP_DOMAIN, namespace_id, _U32.pack(group_index))))


TENANT_DOMAIN = b"kvstore.tenant.v1\x00"


def tenant_namespace_id(public_id: bytes, salt: bytes) -> bytes:
    """The id the daemon files a tenant's namespace under: the public id itself for an
    empty salt (the default tenant), else H(domain || u32le(len(salt)) || salt || id).
    Block hash chains still start from the public id, so clients compute the same
    hashes whoever they are; only the daemon's keys differ between tenants."""
    if not salt:
        return public_id
    return _h128(b"".join((TENANT_DOMAIN, _U32.pack(len(salt)), salt, public_id)))


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as packed little-endian u32 (the encoding the hash reads)."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        raise InvalidArgument("token ids must be integers; pass packed bytes to block_hashes_packed")
    if _native is not None:
        fast = _native.pack_u32(token_ids)  # a list or tuple of valid ids, in one C pass
        if fast is not None:
            return fast
    try:
        packed = array("I", token_ids)
    except OverflowError:
        raise InvalidArgument(f"token ids must be integers in [0, {MAX_TOKEN_ID}]") from None
    except TypeError:
        raise InvalidArgument("token ids must be a sequence of integers") from None
    if packed.itemsize != 4:  # pragma: no cover - every mainstream ABI has a 4-byte 'I'
        raise RuntimeError("this platform has no 4-byte unsigned int array type")
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def block_hashes(
    namespace: bytes,
    token_ids: Sequence[int],
    block_size_tokens: int,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids` under `namespace`.

    `extras[i]`, if given, is mixed into block i (e.g. a multimodal input's hash).
    """
    if block_size_tokens <= 0:
        raise InvalidArgument(f"block_size_tokens must be positive, got {block_size_tokens}")
    n_blocks = len(token_ids) // block_size_tokens
    return block_hashes_packed(namespace, token_bytes(token_ids[: n_blocks * block_size_tokens]),
                               block_size_tokens, extras)


def block_hashes_packed(
    namespace: bytes,
    packed: bytes | memoryview,
    block_size_tokens: int,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """`block_hashes` over tokens already packed as little-endian u32."""
    if len(namespace) != HASH_BYTES:
        raise InvalidArgument(f"namespace id must be {HASH_BYTES} bytes, got {len(namespace)}")
    if block_size_tokens <= 0:
        raise InvalidArgument(f"block_size_tokens must be positive, got {block_size_tokens}")
    if len(packed) % 4:
        raise InvalidArgument(f"packed token ids are {len(packed)} bytes, not a multiple of 4")
    step = block_size_tokens * 4
    n_blocks = len(packed) // step
    if extras is not None and len(extras) < n_blocks:
        raise InvalidArgument(f"extras has {len(extras)} entries for {n_blocks} blocks")
    raw = memoryview(packed)
    out: list[bytes] = []
    if extras is None and XXH3:
        return _split(_native.chain_hashes(namespace, raw, block_size_tokens), HASH_BYTES, n_blocks)
    if extras is None and n_blocks < _NUMPY_FROM_BLOCKS:
        # Short chains: each block's tokens cut out by one struct call, joined per block
        # (numpy's fixed cost would outweigh what it saves).
        count = _U32.pack(block_size_tokens)
        prev = bytes(namespace)
        h128 = _h128
        return [prev := h128(prev + count + tokens + _NO_EXTRA) for tokens in _split(raw, step, n_blocks)]
    if extras is None:
        # Every block's input but the chain link, [count | tokens | empty extra], laid out in
        # one buffer by numpy and cut into bytes objects by struct calls: the chain below
        # is then one concatenation and one digest per block, with no slicing in Python.
        width = 4 + step + 4
        rows = np.zeros((n_blocks, width), dtype=np.uint8)
        rows[:, :4] = np.frombuffer(_U32.pack(block_size_tokens), dtype=np.uint8)
        rows[:, 4 : 4 + step] = np.frombuffer(raw, dtype=np.uint8, count=n_blocks * step).reshape(n_blocks, step)
        prev = bytes(namespace)
        h128 = _h128
        return [prev := h128(prev + body) for body in _split(rows.tobytes(), width, n_blocks)]
    count = _U32.pack(block_size_tokens)
    prev = namespace
    for i in range(n_blocks):
        extra = bytes(extras[i]) if extras[i] else b""
        prev = _h128(b"".join((prev, count, raw[i * step : (i + 1) * step], _U32.pack(len(extra)), extra)))
        out.append(prev)
    return out


def chain_packed(namespace: bytes, packed: bytes | memoryview, block_size_tokens: int) -> bytes:
    """`block_hashes_packed` (no extras) as one packed chain, N x 16 bytes: what a lookup
    probes. Hashed in one compiled pass where XXH3 is bound (about 35 us per 1,000 blocks
    of 16 tokens, against about 300 us in Python)."""
    if XXH3 and len(namespace) == HASH_BYTES and block_size_tokens > 0 and len(packed) % 4 == 0:
        return _native.chain_hashes(namespace, packed, block_size_tokens)
    return b"".join(block_hashes_packed(namespace, packed, block_size_tokens))


_SPLIT_RUN = 1024  # pieces per cached struct format: bounds the cache to a few MiB


@lru_cache(maxsize=64)
def _splitter(size: int, count: int) -> Callable[[bytes | memoryview, int], tuple[bytes, ...]]:
    return struct.Struct(f"{size}s" * count).unpack_from


def _split(buf: bytes | memoryview, size: int, count: int) -> list[bytes]:
    """`count` consecutive `size`-byte pieces of `buf` as bytes objects, cut by one C call
    per 1,024 pieces rather than sliced one by one."""
    out: list[bytes] = []
    for start in range(0, count, _SPLIT_RUN):
        run = min(_SPLIT_RUN, count - start)
        out += _splitter(size, run)(buf, start * size)
    return out


def packed_count(packed: bytes) -> int:
    """How many hashes a packed hash list (N x 16 bytes, chain order) holds; a length
    that is not a multiple of 16 is refused."""
    n, rest = divmod(len(packed), HASH_BYTES)
    if rest:
        raise InvalidArgument(
            f"packed block hashes are {len(packed)} bytes, not a multiple of {HASH_BYTES}: send one "
            f"{HASH_BYTES}-byte hash per block"
        )
    return n


def split_hashes(packed: bytes) -> list[bytes]:
    """The 16-byte hashes of a packed hash list (N x 16 bytes, chain order), cut in one C
    call rather than sliced one by one."""
    return _split(packed, HASH_BYTES, packed_count(packed))
