"""The connector's namespace and configuration, from real vLLM configs (no engine started).

Two engines whose KV bytes could differ must never share a block: each setting that
changes the bytes changes the namespace. Settings that do not change them (the memory
given to the KV cache) leave it alone, so equal engines do share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import InvalidArgument

# Importing vLLM in the test process trips deprecations inside torch and vLLM themselves;
# they are not this project's to fix, and warnings are errors here otherwise.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def engine_config(model: Path, **overrides: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args: dict[str, Any] = dict(model=str(model), skip_tokenizer_init=True, dtype="float32", block_size=32,
                                kv_cache_memory_bytes=64 << 20, enforce_eager=True, max_model_len=2048)
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


def test_every_byte_changing_setting_changes_the_namespace(tiny_model: Path):
    from kvstore.client.vllm import layout_from_vllm_config

    base = engine_config(tiny_model)
    ids = {
        "base": layout_from_vllm_config(base).namespace_id,
        "bfloat16": layout_from_vllm_config(engine_config(tiny_model, dtype="bfloat16")).namespace_id,
        "block 64": layout_from_vllm_config(engine_config(tiny_model, block_size=64)).namespace_id,
        "lora": layout_from_vllm_config(base, lora_id="adapter@/a").namespace_id,
        "model id": layout_from_vllm_config(base, model_id="org/other").namespace_id,
    }
    assert len(set(ids.values())) == len(ids), ids
    same = layout_from_vllm_config(engine_config(tiny_model, kv_cache_memory_bytes=32 << 20))
    assert same.namespace_id == ids["base"]


def test_tensor_parallel_ranks_hold_their_own_shards(tiny_model: Path):
    from kvstore.client.vllm import layout_from_vllm_config

    tp2 = engine_config(tiny_model, tensor_parallel_size=2)  # a config only: no workers start
    rank0, rank1 = (layout_from_vllm_config(tp2, tp_rank=r) for r in (0, 1))
    assert (rank0.num_kv_heads, rank0.tp_size) == (1, 2)  # each rank keeps half the KV heads
    assert rank0.namespace_id != rank1.namespace_id
    assert rank0.namespace_id != layout_from_vllm_config(engine_config(tiny_model)).namespace_id


def test_layout_describes_the_engine(tiny_model: Path):
    from kvstore.client.vllm import layout_from_vllm_config

    layout = layout_from_vllm_config(engine_config(tiny_model))
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size_tokens, layout.dtype) \
        == (2, 2, 32, 32, "float32")
    assert layout.kv_layout.startswith("L,[H,2,B,D];vllm-cpu-attn/")


@pytest.mark.parametrize("extra, message", [
    ({"tagret": "unix:/x"}, "unknown keys"),
    ({"timeout_s": 0}, "must be positive"),
    ({"lease_ms": "soon"}, "must be a number"),
    ({"target": 5}, "must be a string"),
    ({"break_even": "yes"}, "break_even must be true or false"),
])
def test_bad_extra_config_is_refused_with_a_reason(extra, message):
    from kvstore.client.vllm import ConnectorConfig

    with pytest.raises(InvalidArgument, match=message):
        ConnectorConfig.from_extra(extra)


def test_extra_config_defaults_and_values():
    from kvstore.client.vllm import ConnectorConfig

    config = ConnectorConfig.from_extra({"target": "unix:/run/kv.sock", "timeout_s": "2.5", "lease_ms": 0})
    assert (config.target, config.timeout_s, config.lease_ms) == ("unix:/run/kv.sock", 2.5, 0)
    assert ConnectorConfig.from_extra(None) == ConnectorConfig()
    assert ConnectorConfig.from_extra(None).break_even is True
    assert ConnectorConfig.from_extra({"break_even": False}).break_even is False


def test_a_kv_codec_is_its_own_namespace_on_the_cpu_backend(tiny_model: Path):
    """`kv_connector_extra_config.kv_codec` (docs/codecs.md): the CPU backend's in-block
    layout names its axes, so the layout can be quantized, under another namespace, with
    the engine's block size as its dense size."""
    from kvstore.client.vllm import ConnectorConfig, layout_from_vllm_config

    assert ConnectorConfig.from_extra({"kv_codec": "fp8-e4m3"}).kv_codec == "fp8-e4m3"
    base = engine_config(tiny_model)
    plain = layout_from_vllm_config(base)
    fp8 = layout_from_vllm_config(base, kv_codec="fp8-e4m3")
    kivi = layout_from_vllm_config(base, kv_codec="kivi4")
    assert len({plain.namespace_id, fp8.namespace_id, kivi.namespace_id}) == 3
    assert fp8.dense_block_bytes == plain.bytes_per_block
    assert kivi.bytes_per_block < fp8.bytes_per_block < plain.bytes_per_block
    with pytest.raises(InvalidArgument, match="kv_codec"):
        layout_from_vllm_config(base, kv_codec="int3")
