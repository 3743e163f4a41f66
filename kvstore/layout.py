"""`KVLayout`: everything that makes KV bytes differ for the same tokens.

A layout is a frozen value. Its `namespace_id` (see `kvstore.hashing`) is the first link
of every block hash chain, so two engines whose KV bytes could differ never share a key.
`block_bytes` is the size of one block's payload; by default it is derived from the
shape, `2 (K and V) * layers * block_size_tokens * kv_heads * head_dim * dtype size`,
and it can be given explicitly for layouts that do not follow that shape (MLA, packed
quantized KV). The resolved value is part of the fingerprint.

A layout may list KV groups (`KVGroup`): models whose cache is not one uniform tensor
per block (sliding-window next to full-attention layers, MLA latents, Mamba or
linear-attention state, a sparse-attention indexer, quantization scales). Each group has
its own kind, dtype, shape and bytes per block, and a hit rule (`kvstore.groups`); the
fingerprint covers every group. A layout without groups is one full-attention tensor and
keeps the fingerprint it always had; so does a layout whose only group is exactly that
(one full-attention group in the layout's dtype and size): its groups normalize to none.

A layout may ask for a lossy storage codec (`kv_codec`: "fp8-e4m3" or "kivi4", see
`kvstore.quant` and docs/codecs.md): its blocks are then stored quantized everywhere,
`bytes_per_block` is the quantized size (what every tier holds and every plane moves)
and `dense_block_bytes` the engine's. The codec is part of the fingerprint.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from kvstore.errors import InvalidArgument

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

DEFAULT_KV_LAYOUT = "2,L,B,H,D"

# Bounds that catch nonsense early; generous enough for any real model.
MAX_NAME_CHARS = 512
MAX_DIM = 1 << 20
MAX_BLOCK_BYTES = 1 << 31
MAX_GROUPS = 16
MAX_SHAPE_DIMS = 8


class GroupKind(enum.Enum):
    """What a group's part of a block holds, which decides its hit rule (`kvstore.groups`)."""

    FULL = "full"  # full attention: K and V of every token
    SLIDING_WINDOW = "sliding_window"  # attention over the last `window_tokens` only
    MLA = "mla"  # a compressed latent per token (DeepSeek): needed like full attention
    STATE = "state"  # a recurrent state (Mamba, linear attention): only at the prefix end
    AUXILIARY = "auxiliary"  # indexer keys, quantization scales: every block, or a window


def group_kind(value: str | GroupKind) -> GroupKind:
    """The kind a string names (its value, e.g. "sliding_window"); InvalidArgument if none."""
    if isinstance(value, GroupKind):
        return value
    try:
        return GroupKind(value)
    except ValueError:
        known = ", ".join(k.value for k in GroupKind)
        raise InvalidArgument(f"KV group kind {value!r} is not one of {known}") from None


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV group of a layout: the part of each block that a set of layers keeps.

    `shape` is one block's part (e.g. `(2, layers, block, heads, dim)`; for a state group
    the state at a block's end), `block_bytes=0` means `prod(shape) * sizeof(dtype)`.
    `window_tokens` is the sliding window (as engines count it, the token being computed
    included); an auxiliary group with a window follows the window rule, without one the
    full-attention rule. `kind` may be given as its string value."""

    name: str
    kind: GroupKind
    dtype: str
    shape: tuple[int, ...]
    block_bytes: int = 0
    window_tokens: int = 0
    _resolved_block_bytes: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > MAX_NAME_CHARS:
            raise InvalidArgument(f"a KV group needs a name of 1 to {MAX_NAME_CHARS} characters, got {self.name!r}")
        kind = group_kind(self.kind)
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.dtype, str) or not self.dtype or len(self.dtype) > MAX_NAME_CHARS:
            raise InvalidArgument(f"group {self.name!r}: dtype must be a non-empty string, got {self.dtype!r}")
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise InvalidArgument(f"group {self.name!r}: shape must be a sequence of integers") from None
        if not 1 <= len(shape) <= MAX_SHAPE_DIMS or any(
                not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= MAX_DIM for d in shape):
            raise InvalidArgument(f"group {self.name!r}: shape must be 1 to {MAX_SHAPE_DIMS} integers in "
                                  f"[1, {MAX_DIM}], got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.window_tokens, int) or not 0 <= self.window_tokens <= 1 << 30:
            raise InvalidArgument(f"group {self.name!r}: window_tokens must be an integer >= 0, "
                                  f"got {self.window_tokens!r}")
        if kind is GroupKind.SLIDING_WINDOW and self.window_tokens < 1:
            raise InvalidArgument(f"group {self.name!r} is a sliding-window group: give its window_tokens")
        if kind not in (GroupKind.SLIDING_WINDOW, GroupKind.AUXILIARY) and self.window_tokens:
            raise InvalidArgument(f"group {self.name!r}: only sliding-window and auxiliary groups have a window")
        if not isinstance(self.block_bytes, int) or not 0 <= self.block_bytes <= MAX_BLOCK_BYTES:
            raise InvalidArgument(f"group {self.name!r}: block_bytes must be in [0, {MAX_BLOCK_BYTES}], "
                                  f"got {self.block_bytes!r}")
        resolved = self.block_bytes
        if resolved == 0:
            itemsize = DTYPE_BYTES.get(self.dtype)
            if itemsize is None:
                raise InvalidArgument(f"group {self.name!r}: dtype {self.dtype!r} has no known size; use one of "
                                      f"{', '.join(DTYPE_BYTES)}, or give block_bytes explicitly")
            resolved = math.prod(shape) * itemsize
            if resolved > MAX_BLOCK_BYTES:
                raise InvalidArgument(f"group {self.name!r} describes {resolved} bytes per block, "
                                      f"more than {MAX_BLOCK_BYTES}")
        object.__setattr__(self, "_resolved_block_bytes", resolved)

    @property
    def bytes_per_block(self) -> int:
        """Size of this group's part of one block, in bytes."""
        return self._resolved_block_bytes


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The fingerprinted description of a KV cache's bytes.

    `kv_layout` names the axis order of one block (`"2,L,B,H,D"`: K/V, layer, token
    in block, KV head, head dim). `tp_rank`/`tp_size` keep the shards of a tensor-parallel
    engine apart. `block_bytes=0` means "derive from the shape".
    """

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size_tokens: int
    revision: str = ""
    lora_id: str = ""
    kv_layout: str = DEFAULT_KV_LAYOUT
    tp_rank: int = 0
    tp_size: int = 1
    block_bytes: int = 0
    groups: tuple[KVGroup, ...] = ()
    kv_codec: str = ""
    _resolved_block_bytes: int = field(init=False, repr=False, compare=False, default=0)
    _stored_block_bytes: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "revision", "lora_id", "kv_layout", "kv_codec"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidArgument(f"layout.{name} must be a string, got {type(value).__name__}")
            if len(value) > MAX_NAME_CHARS:
                raise InvalidArgument(f"layout.{name} is longer than {MAX_NAME_CHARS} characters")
        if not self.model:
            raise InvalidArgument("layout.model is empty; name the model (e.g. 'meta-llama/Llama-3.1-8B')")
        if not self.kv_layout:
            raise InvalidArgument(f"layout.kv_layout is empty; use {DEFAULT_KV_LAYOUT!r} or name your axis order")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size_tokens", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DIM:
                raise InvalidArgument(f"layout.{name} must be an integer in [1, {MAX_DIM}], got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"layout.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}")
        if not isinstance(self.block_bytes, int) or not 0 <= self.block_bytes <= MAX_BLOCK_BYTES:
            raise InvalidArgument(f"layout.block_bytes must be in [0, {MAX_BLOCK_BYTES}], got {self.block_bytes!r}")
        resolved = self.block_bytes
        if resolved == 0:
            itemsize = DTYPE_BYTES.get(self.dtype)
            if itemsize is None and self.groups:
                itemsize = 0  # the groups give the sizes
            if itemsize is None:
                known = ", ".join(DTYPE_BYTES)
                raise InvalidArgument(
                    f"layout.dtype {self.dtype!r} has no known size; use one of {known}, "
                    "or give block_bytes explicitly"
                )
            resolved = 2 * self.num_layers * self.block_size_tokens * self.num_kv_heads * self.head_dim * itemsize
            if resolved > MAX_BLOCK_BYTES:
                raise InvalidArgument(f"layout describes {resolved} bytes per block, more than {MAX_BLOCK_BYTES}")
        if self.groups:
            resolved = self._check_groups(resolved)
        object.__setattr__(self, "_resolved_block_bytes", resolved)
        stored = resolved
        if self.kv_codec:
            from kvstore.quant import check_layout, stored_block_bytes

            check_layout(self)
            derived = 2 * self.num_layers * self.block_size_tokens * self.num_kv_heads * self.head_dim * \
                DTYPE_BYTES[self.dtype]
            if resolved != derived:
                raise InvalidArgument(f"layout.block_bytes is {self.block_bytes}; a layout with kv_codec "
                                      f"{self.kv_codec!r} has blocks of its shape ({derived}): leave block_bytes 0")
            stored = stored_block_bytes(self.kv_codec, self.num_layers, self.num_kv_heads, self.block_size_tokens,
                                        self.head_dim)
        object.__setattr__(self, "_stored_block_bytes", stored)

    def _check_groups(self, plain_bytes: int) -> int:
        """Validate the groups; the layout's bytes per block (every part of a block).
        One full-attention group that is exactly the plain layout normalizes to none."""
        try:
            groups = tuple(self.groups)
        except TypeError:
            raise InvalidArgument("layout.groups must be a sequence of KVGroup") from None
        if not all(isinstance(g, KVGroup) for g in groups):
            raise InvalidArgument("layout.groups must be a sequence of KVGroup")
        if len(groups) > MAX_GROUPS:
            raise InvalidArgument(f"a layout has at most {MAX_GROUPS} KV groups, got {len(groups)}")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"KV group names must be distinct, got {names}")
        only = groups[0]
        if (len(groups) == 1 and only.kind is GroupKind.FULL and only.dtype == self.dtype
                and only.bytes_per_block == plain_bytes):
            object.__setattr__(self, "groups", ())
            return plain_bytes
        object.__setattr__(self, "groups", groups)
        total = sum(g.bytes_per_block for g in groups)
        if total > MAX_BLOCK_BYTES:
            raise InvalidArgument(f"layout's groups describe {total} bytes per block, more than {MAX_BLOCK_BYTES}")
        if self.block_bytes and self.block_bytes != total:
            raise InvalidArgument(f"layout.block_bytes is {self.block_bytes} but its groups hold {total} bytes per "
                                  "block; leave block_bytes 0 for a layout with groups")
        return total

    def group(self, name: str) -> KVGroup:
        """The group called `name`."""
        for g in self.groups:
            if g.name == name:
                return g
        raise InvalidArgument(f"layout {self.model} has no KV group {name!r}; its groups: "
                              f"{', '.join(g.name for g in self.groups) or '(none)'}")

    @property
    def bytes_per_block(self) -> int:
        """Payload size of one stored block in bytes (explicit `block_bytes` or derived;
        with groups, every group's part added up; with a `kv_codec`, the quantized size)."""
        return self._stored_block_bytes

    @property
    def dense_block_bytes(self) -> int:
        """The engine's size of one block (`bytes_per_block` unless there is a `kv_codec`)."""
        return self._resolved_block_bytes

    @property
    def stored_itemsize(self) -> int:
        """Element size of the stored bytes (a lossless codec's byte-plane shuffle unit):
        1 for a quantized layout and for dtypes of unknown size."""
        return 1 if self.kv_codec else DTYPE_BYTES.get(self.dtype, 1)

    def without_codec(self) -> KVLayout:
        """The same layout in full precision (its engine's bytes)."""
        return replace(self, kv_codec="")

    @property
    def namespace_id(self) -> bytes:
        """The 16-byte fingerprint that starts every block hash chain of this layout."""
        from kvstore.hashing import namespace_id

        return namespace_id(self)
