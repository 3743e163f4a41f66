"""`KVLayout`: everything that makes KV bytes differ for the same tokens.

A layout is a frozen value. Its `namespace_id` (see `kvstore.hashing`) is the first link
of every block hash chain, so two engines whose KV bytes could differ never share a key.
`block_bytes` is the size of one block's payload; by default it is derived from the
shape, `2 (K and V) * layers * block_size_tokens * kv_heads * head_dim * dtype size`,
and it can be given explicitly for layouts that do not follow that shape (MLA, packed
quantized KV). The resolved value is part of the fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    _resolved_block_bytes: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "revision", "lora_id", "kv_layout"):
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
            if itemsize is None:
                known = ", ".join(DTYPE_BYTES)
                raise InvalidArgument(
                    f"layout.dtype {self.dtype!r} has no known size; use one of {known}, "
                    "or give block_bytes explicitly"
                )
            resolved = 2 * self.num_layers * self.block_size_tokens * self.num_kv_heads * self.head_dim * itemsize
            if resolved > MAX_BLOCK_BYTES:
                raise InvalidArgument(f"layout describes {resolved} bytes per block, more than {MAX_BLOCK_BYTES}")
        object.__setattr__(self, "_resolved_block_bytes", resolved)

    @property
    def bytes_per_block(self) -> int:
        """Payload size of one block in bytes (explicit `block_bytes` or derived)."""
        return self._resolved_block_bytes

    @property
    def namespace_id(self) -> bytes:
        """The 16-byte fingerprint that starts every block hash chain of this layout."""
        from kvstore.hashing import namespace_id

        return namespace_id(self)
