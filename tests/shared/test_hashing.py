"""Hashing: the vectors in docs/hashing.md, and an independent encoder written from the doc."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.hashing import block_hashes, namespace_bytes
from kvstore.layout import KVLayout

DOC = Path(__file__).resolve().parents[2] / "docs" / "hashing.md"

LAYOUTS = {
    "L1": KVLayout(model="meta-llama/Llama-3.1-8B", dtype="bfloat16", num_layers=32, num_kv_heads=8,
                   head_dim=128, block_size_tokens=16),
    "L2": KVLayout(model="meta-llama/Llama-3.1-8B", revision="0e9e39f", lora_id="sql-adapter-v2", dtype="float16",
                   num_layers=32, num_kv_heads=8, head_dim=128, block_size_tokens=16, tp_rank=1, tp_size=2),
    "L3": KVLayout(model="tiny", dtype="custom-int4", num_layers=1, num_kv_heads=1, head_dim=8, block_size_tokens=4,
                   kv_layout="L,B,packed", block_bytes=4096),
}


def _doc_table(marker: str) -> list[list[str]]:
    text = DOC.read_text()
    section = text.split(f"<!-- vectors: {marker} -->", 1)[1]
    rows = []
    for line in section.strip().splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if set(cells[0]) <= {"-"} or cells[0] == "layout":
            continue
        rows.append(cells)
    return rows


def _hexes(cell: str) -> list[str]:
    return re.findall(r"`([0-9a-f]{32})`", cell)


def reference_namespace_id(layout: KVLayout) -> bytes:
    """Written from docs/hashing.md, not from kvstore/hashing.py."""

    def s(v: str) -> bytes:
        raw = v.encode()
        return struct.pack("<I", len(raw)) + raw

    data = b"kvstore.ns.v1\x00" + s(layout.model) + s(layout.revision) + s(layout.lora_id) + s(layout.dtype)
    data += s(layout.kv_layout)
    for v in (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size_tokens,
              layout.tp_rank, layout.tp_size, layout.bytes_per_block):
        data += struct.pack("<Q", v)
    return xxhash.xxh3_128(data).digest()


def reference_block_hashes(ns: bytes, tokens: list[int], bs: int, extras: list[bytes] | None = None) -> list[bytes]:
    out, prev = [], ns
    for i in range(len(tokens) // bs):
        extra = extras[i] if extras else b""
        data = prev + struct.pack("<I", bs) + struct.pack(f"<{bs}I", *tokens[i * bs : (i + 1) * bs])
        data += struct.pack("<I", len(extra)) + extra
        prev = xxhash.xxh3_128(data).digest()
        out.append(prev)
    return out


def test_hash_function_is_canonical_xxh3_128():
    assert xxhash.xxh3_128_digest(b"").hex() == "99aa06d3014798d86001c324468d497f"


def test_namespace_vectors_from_doc():
    rows = _doc_table("namespace")
    assert [r[0] for r in rows] == ["L1", "L2", "L3"]
    for name, block_bytes, ns_hex in rows:
        layout = LAYOUTS[name]
        assert layout.bytes_per_block == int(block_bytes)
        assert layout.namespace_id.hex() == _hexes(ns_hex)[0]
        assert reference_namespace_id(layout) == layout.namespace_id


def test_namespace_bytes_dump_in_doc():
    dump = DOC.read_text().split("The hashed bytes of L1's namespace", 1)[1].split("```")[1]
    assert namespace_bytes(LAYOUTS["L1"]).hex() == "".join(dump.split())


@pytest.fixture(params=["compiled", "python"])
def hashing_path(request, monkeypatch):
    """Each hashing test runs on the compiled chain (where XXH3 is bound) and on Python's."""
    import kvstore.hashing

    if request.param == "python":
        monkeypatch.setattr(kvstore.hashing, "XXH3", False)
    return request.param


def test_block_vectors_from_doc(hashing_path):
    rows = _doc_table("blocks")
    assert len(rows) == 3
    for name, tokens_cell, extras_cell, hashes_cell in rows:
        layout = LAYOUTS[name]
        if "..." in tokens_cell:
            first, last = re.findall(r"\d+", tokens_cell)[0], re.findall(r"\d+", tokens_cell)[-1]
            tokens = list(range(int(first), int(last) + 1))
        else:
            tokens = [int(t) for t in tokens_cell.split(",")]
        extras = None if extras_cell == "none" else [e.strip().strip('"').encode() for e in extras_cell.split(",")]
        got = block_hashes(layout.namespace_id, tokens, layout.block_size_tokens, extras)
        assert [h.hex() for h in got] == _hexes(hashes_cell)
        assert got == reference_block_hashes(layout.namespace_id, tokens, layout.block_size_tokens, extras)


def test_every_layout_field_changes_the_namespace():
    base = LAYOUTS["L1"]
    variants = [
        KVLayout(**{**_fields(base), "model": "other"}),
        KVLayout(**{**_fields(base), "revision": "r2"}),
        KVLayout(**{**_fields(base), "lora_id": "a"}),
        KVLayout(**{**_fields(base), "dtype": "float16"}),
        KVLayout(**{**_fields(base), "num_layers": 8}),  # the LMCache 32- vs 8-layer collision
        KVLayout(**{**_fields(base), "num_kv_heads": 4}),
        KVLayout(**{**_fields(base), "head_dim": 64}),
        KVLayout(**{**_fields(base), "block_size_tokens": 32}),
        KVLayout(**{**_fields(base), "kv_layout": "L,2,B,H,D"}),
        KVLayout(**{**_fields(base), "tp_size": 2}),
        KVLayout(**{**_fields(base), "block_bytes": 1 << 20}),
    ]
    ids = {v.namespace_id for v in variants} | {base.namespace_id}
    assert len(ids) == len(variants) + 1


def _fields(layout: KVLayout) -> dict:
    return {k: getattr(layout, k) for k in KVLayout.__dataclass_fields__ if not k.startswith("_")}


def test_chaining_depends_on_the_whole_prefix():
    ns = LAYOUTS["L3"].namespace_id
    a = block_hashes(ns, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes(ns, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, different first block
    assert block_hashes(ns, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4) == a  # partial block ignored


@pytest.mark.parametrize("tokens", [[-1, 0, 0, 0], [1 << 32, 0, 0, 0], ["a", 0, 0, 0]])
def test_bad_token_ids_are_rejected(tokens):
    with pytest.raises(InvalidArgument):
        block_hashes(LAYOUTS["L3"].namespace_id, tokens, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": ""},
        {"num_layers": 0},
        {"head_dim": -1},
        {"dtype": "float13"},
        {"tp_rank": 2, "tp_size": 2},
        {"block_size_tokens": True},
    ],
)
def test_bad_layouts_are_rejected(kwargs):
    fields = {"model": "m", "dtype": "float16", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
              "block_size_tokens": 4} | kwargs
    with pytest.raises(InvalidArgument):
        KVLayout(**fields)


def test_tenant_namespace_vectors_from_doc():
    from kvstore.hashing import tenant_namespace_id

    rows = _doc_table("tenant")
    assert len(rows) == 2
    for name, salt, want in rows:
        salt_bytes = salt.strip('"').encode()
        public = reference_namespace_id(LAYOUTS[name])
        # Written from the doc: H(domain || u32le(len(salt)) || salt || id), or the id for no salt.
        ref = public if not salt_bytes else xxhash.xxh3_128(
            b"kvstore.tenant.v1\x00" + struct.pack("<I", len(salt_bytes)) + salt_bytes + public).digest()
        assert _hexes(want)[0] == ref.hex() == tenant_namespace_id(public, salt_bytes).hex()


def test_token_ids_pack_the_same_in_c_and_in_python():
    import random
    from array import array

    from kvstore import _native
    from kvstore.hashing import token_bytes

    rng = random.Random(3)
    tokens = [rng.randrange(1 << 32) for _ in range(5000)] + [0, (1 << 32) - 1, True]
    want = array("I", tokens).tobytes()
    assert _native.pack_u32(tokens) == _native.pack_u32(tuple(tokens)) == token_bytes(tokens) == want
    assert token_bytes(iter(tokens)) == want  # other iterables: the Python path
    assert _native.pack_u32([]) == b""
    for bad in ([1, -1], [1, 1 << 32], [1, 1 << 70], [1, -(1 << 70)], [1, "a"], [1, 2.0], [None]):
        assert _native.pack_u32(bad) is None
        with pytest.raises(InvalidArgument):
            token_bytes(bad)
    assert _native.pack_u32(iter([1])) is None and _native.pack_u32(7) is None


def test_the_hashing_helpers_are_compiled():
    """XXH3 is bound from the xxhash package's library wherever the compiled module is
    built: CI fails here rather than quietly testing only the Python paths."""
    from kvstore.native import XXH3

    assert XXH3


@pytest.mark.parametrize("block_size", [1, 3, 16, 256])
def test_compiled_chains_match_python(block_size, monkeypatch):
    import random

    import kvstore.hashing
    from kvstore.hashing import block_hashes_packed, chain_packed, token_bytes

    rng = random.Random(block_size)
    ns = bytes(rng.randrange(256) for _ in range(16))
    for n_blocks in (0, 1, 63, 64, 65, 1000):
        tokens = [rng.randrange(1 << 32) for _ in range(n_blocks * block_size + block_size // 2)]
        packed = token_bytes(tokens)
        compiled = block_hashes_packed(ns, packed, block_size)
        whole = chain_packed(ns, packed, block_size)
        with monkeypatch.context() as m:
            m.setattr(kvstore.hashing, "XXH3", False)
            python = block_hashes_packed(ns, packed, block_size)
            assert chain_packed(ns, packed, block_size) == b"".join(python)
        assert len(python) == n_blocks
        assert compiled == python and whole == b"".join(python)
        assert python == reference_block_hashes(ns, tokens, block_size, None)


def test_compiled_chain_refuses_bad_arguments():
    from kvstore.native import native

    with pytest.raises(ValueError, match="16 bytes"):
        native.chain_hashes(b"short", b"\0" * 64, 16)
    for bst in (0, -1, 1 << 32):
        with pytest.raises(ValueError, match="positive and fit in 32 bits"):
            native.chain_hashes(b"\0" * 16, b"\0" * 64, bst)
    with pytest.raises(TypeError):
        native.chain_hashes(b"\0" * 16, [1, 2, 3], 1)


# ---------------------------------------------------------------- KV groups (docs/hashing.md, "KV groups")

from kvstore.layout import KVGroup  # noqa: E402

GROUPED = {
    "G1": KVLayout(model="google/gemma-3-1b-it", dtype="bfloat16", num_layers=26, num_kv_heads=1, head_dim=256,
                   block_size_tokens=16, groups=(
                       KVGroup("full", "full", "bfloat16", (2, 4, 16, 1, 256)),
                       KVGroup("swa", "sliding_window", "bfloat16", (2, 22, 16, 1, 256), window_tokens=512))),
    "G2": KVLayout(model="deepseek-ai/DeepSeek-V3.2-Exp", dtype="float8_e4m3fn", num_layers=61, num_kv_heads=1,
                   head_dim=576, block_size_tokens=64, groups=(
                       KVGroup("mla", "mla", "float8_e4m3fn", (61, 64, 656)),
                       KVGroup("indexer", "auxiliary", "float8_e4m3fn", (61, 64, 132)))),
    "G3": KVLayout(model="ai21labs/Jamba-tiny", dtype="bfloat16", num_layers=8, num_kv_heads=8, head_dim=64,
                   block_size_tokens=16, kv_layout="L,[2,B,H,D]", groups=(
                       KVGroup("attn", "full", "bfloat16", (1, 2, 16, 8, 64)),
                       KVGroup("mamba", "state", "float32", (7, 1), block_bytes=1_150_976),
                       KVGroup("scales", "auxiliary", "float32", (1, 2, 16, 8), window_tokens=33))),
}

# sizeof per dtype, as the doc lists them.
_DOC_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
              "int8": 1, "uint8": 1}


def reference_grouped_namespace_id(layout: KVLayout) -> bytes:
    """Written from docs/hashing.md ("KV groups"), not from kvstore/hashing.py."""

    def s(v: str) -> bytes:
        raw = v.encode()
        return struct.pack("<I", len(raw)) + raw

    groups = []
    for g in layout.groups:
        size = g.block_bytes
        if not size:
            size = _DOC_SIZES[g.dtype]
            for d in g.shape:
                size *= d
        groups.append(s(g.name) + s(g.kind.value) + s(g.dtype) + struct.pack("<I", len(g.shape))
                      + b"".join(struct.pack("<Q", d) for d in g.shape) + struct.pack("<QQ", g.window_tokens, size))
    total = sum(struct.unpack("<Q", raw[-8:])[0] for raw in groups)
    data = b"kvstore.ns.v2\x00" + s(layout.model) + s(layout.revision) + s(layout.lora_id) + s(layout.dtype)
    data += s(layout.kv_layout)
    for v in (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size_tokens,
              layout.tp_rank, layout.tp_size, total):
        data += struct.pack("<Q", v)
    data += struct.pack("<I", len(groups)) + b"".join(groups)
    return xxhash.xxh3_128(data).digest()


def test_grouped_namespace_vectors_from_doc():
    from kvstore.hashing import group_namespace_id

    rows = _doc_table("grouped")
    assert [r[0] for r in rows] == ["G1", "G2", "G3"]
    for name, block_bytes, ns_hex, group_hex in rows:
        layout = GROUPED[name]
        assert layout.bytes_per_block == int(block_bytes)
        want = _hexes(ns_hex)[0]
        assert layout.namespace_id.hex() == want == reference_grouped_namespace_id(layout).hex()
        # Written from the doc: H("kvstore.group.v1\0" || namespace_id || u32le(g)).
        ref_groups = [xxhash.xxh3_128(b"kvstore.group.v1\x00" + layout.namespace_id + struct.pack("<I", g)).hexdigest()
                      for g in range(len(layout.groups))]
        assert _hexes(group_hex) == ref_groups
        assert [group_namespace_id(layout.namespace_id, g).hex() for g in range(len(layout.groups))] == ref_groups


def test_grouped_namespace_bytes_dump_in_doc():
    dump = DOC.read_text().split("The hashed bytes of G1's namespace", 1)[1].split("```")[1]
    assert namespace_bytes(GROUPED["G1"]).hex() == "".join(dump.split())


def test_grouped_block_vectors_from_doc(hashing_path):
    rows = _doc_table("grouped blocks")
    assert [r[0] for r in rows] == ["G1", "G3"]
    for name, tokens_cell, hashes_cell in rows:
        layout = GROUPED[name]
        first, last = re.findall(r"\d+", tokens_cell)[0], re.findall(r"\d+", tokens_cell)[-1]
        tokens = list(range(int(first), int(last) + 1))
        got = block_hashes(layout.namespace_id, tokens, layout.block_size_tokens)
        assert [h.hex() for h in got] == _hexes(hashes_cell)
        assert got == reference_block_hashes(layout.namespace_id, tokens, layout.block_size_tokens)


def test_a_layout_of_one_plain_full_group_keeps_the_plain_id_and_bytes():
    plain = LAYOUTS["L1"]
    one = KVLayout(**{**_fields(plain), "groups": (KVGroup("kv", "full", "bfloat16", (2, 32, 16, 8, 128)),)})
    assert one == plain and one.groups == ()
    assert one.namespace_id == plain.namespace_id == reference_namespace_id(plain)
    assert namespace_bytes(one) == namespace_bytes(plain)
    # One group that is not the plain tensor (another kind, dtype or size) is a grouped layout.
    for group in (KVGroup("kv", "mla", "bfloat16", (2, 32, 16, 8, 128)),
                  KVGroup("kv", "full", "float16", (2, 32, 16, 8, 128)),
                  KVGroup("kv", "sliding_window", "bfloat16", (2, 32, 16, 8, 128), window_tokens=64)):
        grouped = KVLayout(**{**_fields(plain), "groups": (group,)})
        assert grouped.groups == (group,)
        assert grouped.namespace_id == reference_grouped_namespace_id(grouped) != plain.namespace_id


def test_every_group_field_changes_the_namespace():
    from dataclasses import replace

    base = GROUPED["G1"]
    full, swa = base.groups
    variants = [
        replace(base, groups=(replace(full, name="f"), swa)),
        replace(base, groups=(replace(full, kind="mla"), swa)),
        replace(base, groups=(replace(full, dtype="float16"), swa)),
        replace(base, groups=(replace(full, shape=(2, 4, 16, 2, 128)), swa)),
        replace(base, groups=(replace(full, block_bytes=1 << 20), swa)),
        replace(base, groups=(full, replace(swa, window_tokens=1024))),
        replace(base, groups=(swa, full)),  # the order of the groups
        replace(base, groups=(full,)),
        replace(base, dtype="float8_e4m3fn"),  # a quantized cache: the dtype is in the key
    ]
    ids = {v.namespace_id for v in variants} | {base.namespace_id}
    assert len(ids) == len(variants) + 1
    assert all(v.namespace_id == reference_grouped_namespace_id(v) for v in variants if v.groups)


@pytest.mark.parametrize(
    "group",
    [
        {"name": ""},
        {"kind": "linear"},
        {"shape": ()},
        {"shape": (0, 4)},
        {"dtype": "float13"},
        {"kind": "sliding_window", "window_tokens": 0},
        {"kind": "full", "window_tokens": 64},
        {"block_bytes": -1},
    ],
)
def test_bad_groups_are_rejected(group):
    fields = {"name": "g", "kind": "full", "dtype": "float16", "shape": (2, 4)} | group
    with pytest.raises(InvalidArgument):
        KVLayout(model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, block_size_tokens=4,
                 groups=(KVGroup(**fields),))


def test_a_layout_refuses_duplicate_group_names_and_a_block_bytes_that_disagrees():
    g = KVGroup("g", "full", "float16", (2, 4))
    with pytest.raises(InvalidArgument, match="distinct"):
        KVLayout(model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, block_size_tokens=4,
                 groups=(g, KVGroup("g", "state", "float32", (4,))))
    with pytest.raises(InvalidArgument, match="block_bytes"):
        KVLayout(model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, block_size_tokens=4,
                 block_bytes=999, groups=(g, KVGroup("s", "state", "float32", (4,))))


# ---------------------------------------------------------------------- quantized namespaces

def _quantized(name: str) -> KVLayout:
    l1 = LAYOUTS["L1"]
    codec = {"Q1": "fp8-e4m3", "Q2": "kivi4"}[name]
    return KVLayout(model=l1.model, dtype=l1.dtype, num_layers=l1.num_layers, num_kv_heads=l1.num_kv_heads,
                    head_dim=l1.head_dim, block_size_tokens=l1.block_size_tokens, kv_codec=codec)


def reference_quantized_id(layout: KVLayout, codec: str) -> bytes:
    """Written from docs/hashing.md: the codec, the stored size (from the doc's table),
    then the full-precision twin's bytes."""
    L, H, B, D = layout.num_layers, layout.num_kv_heads, layout.block_size_tokens, layout.head_dim
    G = 32 if D % 32 == 0 else D
    stored = 2 * L * H * B * D + 4 * 2 * L * H if codec == "fp8-e4m3" else \
        L * H * B * D + 2 * 2 * L * H * D + 2 * 2 * L * H * B * (D // G)
    twin = namespace_bytes(LAYOUTS["L1"])
    raw = codec.encode()
    data = b"kvstore.ns.q1\x00" + struct.pack("<I", len(raw)) + raw + struct.pack("<Q", stored) + twin
    return xxhash.xxh3_128(data).digest()


def test_quantized_namespace_vectors_from_doc(hashing_path):
    rows = _doc_table("quantized")
    assert [r[0] for r in rows] == ["Q1", "Q2"]
    for name, stored, ns_hex, hashes_cell in rows:
        layout = _quantized(name)
        assert layout.bytes_per_block == int(stored)
        assert layout.dense_block_bytes == LAYOUTS["L1"].bytes_per_block
        assert layout.namespace_id.hex() == _hexes(ns_hex)[0]
        assert reference_quantized_id(layout, layout.kv_codec) == layout.namespace_id
        got = block_hashes(layout.namespace_id, list(range(40)), 16)
        assert [h.hex() for h in got] == _hexes(hashes_cell)


def test_each_codec_is_its_own_namespace():
    ids = {_quantized(n).namespace_id for n in ("Q1", "Q2")} | {LAYOUTS["L1"].namespace_id}
    assert len(ids) == 3
    assert _quantized("Q1").without_codec() == LAYOUTS["L1"]


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_codec": "int3"}, "not one of"),
    ({"kv_codec": "fp8-e4m3", "dtype": "float8_e4m3fn"}, "quantizes"),
    ({"kv_codec": "kivi4", "kv_layout": "L,[block];vllm-cuda"}, "axes"),
    ({"kv_codec": "fp8-e4m3", "block_bytes": 4096}, "leave block_bytes 0"),
])
def test_quantized_layouts_that_cannot_be_are_refused(kwargs, match):
    base = dict(model="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=64, block_size_tokens=16)
    with pytest.raises(InvalidArgument, match=match):
        KVLayout(**{**base, **kwargs})
