"""Fixtures for the SGLang HiCache backend tests: SGLang's real host pools on the CPU, the
real storage factory, and a real daemon process.

These tests need SGLang 0.5.23's storage layer; they run in their own venv through
`make test-sglang` (scripts/install-sglang.sh builds it) and are not collected by
`make test`. Pools are built with `pin_memory=False` inside `host_memory_budget_scope`
(otherwise a pool checks the machine's free memory minus a 10 GiB reserve). Page keys are
SHA-256 chains of token pages, shaped as SGLang's (its own hash is a C++ extension
compiled on first use, which these tests do not need).
"""

from __future__ import annotations

import hashlib
import random
import types
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    # Importing SGLang's layers on a CPU machine warns (AWQ and GGUF need a GPU, torch's
    # inductor uses a deprecated torch.jit API); pytest would make each warning an error.
    warnings.simplefilter("ignore")
    import torch
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MambaStateBufferInfo,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool_host import (
        DeepSeekV4PagedHostPool,
        DeepSeekV4StateHostPool,
        LogicalHostPool,
    )
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tests.procs import DaemonProc, daemon_args, remove_segments, start

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def host_budget() -> Iterator[None]:
    with host_memory_budget_scope(8 << 30):
        yield


# ------------------------------------------------------------------ pools


def mha_pool(layout: str = "page_first", *, page_size: int = 16, layers: int = 2, heads: int = 2, head_dim: int = 32,
             dtype: torch.dtype = torch.float32, capacity: int = 256, label: str = "kv") -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool over CPU "device" buffers (twice the device capacity)."""
    k = tuple(torch.zeros(capacity + page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(capacity + page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v]), layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype, device=CPU)
    return MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=capacity, start_layer=0, end_layer=layers, pool_label=label)


def mla_pool(layout: str = "page_first", *, page_size: int = 16, layers: int = 2, lora_rank: int = 64,
             rope_dim: int = 32, dtype: torch.dtype = torch.bfloat16, capacity: int = 256) -> MLATokenToKVPoolHost:
    width = lora_rank + rope_dim
    bufs = tuple(torch.zeros(capacity + page_size, 1, width, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs]),
                         layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page_size,
                         kv_lora_rank=lora_rank, qk_rope_head_dim=rope_dim, kv_cache_dim=width, dtype=dtype,
                         device=CPU)
    return MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=capacity, start_layer=0, end_layer=layers,
                                target_layer_num=layers)


def v4_pool(name: str, *, page_size: int = 16, layers: int = 3, item_bytes: int = 64, pages: int = 40,
            layout: str = "page_first") -> DeepSeekV4PagedHostPool:
    """DeepSeek-V4's paged host pool (compressed KV, indexer, rope or SWA rows): one row of
    `item_bytes` per layer per page."""
    device = [torch.zeros(pages, item_bytes, dtype=torch.uint8) for _ in range(layers)]
    return DeepSeekV4PagedHostPool(name, device, item_bytes, pages, page_size, layout=layout, device="cpu",
                                   pin_memory=False)


def v4_state_pool(name: str, *, layers: int = 2, ring: int = 4, page_size: int = 8,
                  pages: int = 40) -> DeepSeekV4StateHostPool:
    """DeepSeek-V4's compression-state host pool: per layer, a ring of `ring` state slots a
    page. The device state pools it mirrors are described by what the host pool reads of
    them (`kv_score_buffer.kv_score`, `ring_size`)."""
    device = [types.SimpleNamespace(kv_score_buffer=types.SimpleNamespace(
        kv_score=torch.zeros(pages * ring, 2, 12, dtype=torch.float32)), ring_size=ring) for _ in range(layers)]
    return DeepSeekV4StateHostPool(name, device, pages, page_size, layout="page_first", device="cpu",
                                   pin_memory=False)


def logical_pool(*, page_size: int = 16, pages: int = 40) -> LogicalHostPool:
    return LogicalHostPool(pages * page_size, page_size, layout="page_first")


def mamba_pool(*, layers: int = 3, slots: int = 8) -> MambaPoolHost:
    """SGLang's Mamba state host pool: a temporal state and one conv state per layer slot."""
    temporal = torch.zeros(layers, slots + 1, 4, 8, dtype=torch.float32)
    conv = (torch.zeros(layers, slots + 1, 6, 3, dtype=torch.bfloat16),)
    return MambaPoolHost(MambaStateBufferInfo(temporal=temporal, conv=conv), 2.0, 0, device_capacity=slots,
                         pin_memory=False, device="cpu", layout="page_first")


def fill_random(pool: Any, seed: int) -> None:
    """Random bytes in every buffer of `pool` (as uint8, so any dtype's bits are exact)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = list(pool.get_hybrid_pool_buffer()) if hasattr(pool, "get_hybrid_pool_buffer") else []
    kv = getattr(pool, "kv_buffer", None)
    tensors += list(kv) if isinstance(kv, (list, tuple)) else ([kv] if kv is not None else [])
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def page(pool: Any, index: int) -> bytes:
    """One page of a pool as bytes, read through SGLang's own accessor."""
    data = pool.get_data_page(int(index), flat=True)
    return bytes(data.contiguous().view(torch.uint8).numpy())


def pages(pool: Any, host_indices: torch.Tensor, n: int) -> list[bytes]:
    ps = pool.page_size
    return [page(pool, host_indices[i * ps]) for i in range(n)]


# ------------------------------------------------------------------ keys


def page_keys(n: int, seed: int = 0, prior: str = "") -> list[str]:
    """`n` chained page keys (64 hex characters each, as SGLang's)."""
    rng = random.Random(seed)
    keys, prev = [], bytes.fromhex(prior) if prior else b""
    for _ in range(n):
        tokens = bytes(rng.randrange(256) for _ in range(64))
        prev = hashlib.sha256(prev + tokens).digest()
        keys.append(prev.hex())
    return keys


# ------------------------------------------------------------------ the backend


def storage_config(*, target: str, model: str = "test/tiny-model", tp_rank: int = 0, tp_size: int = 1,
                   mla: bool = False, page_first: bool = True, interface_v1: bool = True,
                   **extra: Any) -> HiCacheStorageConfig:
    cfg = {"backend_name": "kvstore", "module_path": "kvstore.client.sglang", "class_name": "HiCacheKVStore",
           "interface_v1": 1 if interface_v1 else 0, "target": target, **extra}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=page_first, model_name=model, extra_config=cfg)


_OPEN: list[Any] = []


@pytest.fixture(autouse=True)
def close_backends() -> Iterator[None]:
    """Close every backend a test made (SGLang closes its backend on detach)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def make_backend(cfg: HiCacheStorageConfig, host_pool: Any, others: Sequence[tuple[str, Any]] = ()) -> Any:
    """The backend as SGLang's cache controllers attach it: the factory, the anchor pool,
    every other pool through v2, then the end of the registration burst."""
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host_pool)
    _OPEN.append(backend)
    backend.register_mem_pool_host(host_pool)
    for name, pool in others:
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


# ------------------------------------------------------------------ the daemon


def start_daemon(directory: Path, *extra: str) -> DaemonProc:
    directory.mkdir(parents=True, exist_ok=True)
    sock = directory / "kv.sock"
    return start(daemon_args(sock, "--host-capacity", "256MiB", *extra), sock, directory / "daemon.log")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    proc = start_daemon(tmp_path_factory.mktemp("daemon"))
    try:
        yield proc
    finally:
        proc.stop()
        remove_segments(proc.pid)
