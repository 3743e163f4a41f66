"""vLLM v1 KV connector: vLLM fetches its prefill from kvstore and stores what it computed.

    LLM(model=..., kv_transfer_config={
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.client.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": "unix:/run/kvstore.sock"},
    })

Two halves, as vLLM splits every connector:

- Scheduler side (`KVStoreConnector` with role SCHEDULER): `get_num_new_matched_tokens`
  asks the daemon for the longest held prefix of the prompt beyond what vLLM already has
  (taking a short lease so the blocks survive until the fetch); `update_state_after_alloc`
  plans the load into the blocks vLLM allocated; `build_connector_meta` hands the loads and
  the saves of newly computed full prompt blocks to the workers; worker reports come back
  through `update_connector_output` and leave with the request in its
  `kv_transfer_params` (`kvstore_loaded_tokens`, `kvstore_stored_blocks`).
- Worker side (role WORKER): `start_load_kv` fetches the planned blocks and writes them
  into vLLM's paged KV cache before the forward pass (loads are synchronous: the forward
  reads them at once); `wait_for_save` copies newly computed full blocks out of the paged
  cache after the forward and puts them. A block that could not be loaded is reported by
  `get_block_ids_with_load_errors`, so vLLM recomputes it (with
  `kv_load_failure_policy="recompute"`) instead of attending to garbage.

One kvstore block holds `block_size` tokens of every layer: the per-layer paged blocks
(vLLM's standardized per-layer view puts the block index first) concatenated in layer
order, bytes as the attention backend keeps them.

Models with several KV cache groups (vLLM's hybrid allocator: sliding-window next to
full-attention layers, MLA, Mamba) get a layout with one kvstore group per vLLM group
(`layout_from_vllm_config` with the `kv_cache_config`), each part the group's layers'
paged blocks concatenated in layer order. The connector supports the hybrid allocator
(`SupportsHMA`): it loads and saves each group's blocks through that group's block
table, under the group's hit rule (`kvstore.groups`): full attention and MLA every block,
a sliding window the blocks inside its window before the prefix end (vLLM has freed the
rest), a state only at the prefix end. The namespace is built from vLLM's
config: model, revision, KV dtype, layers, KV heads, head size, block size, the backend's
in-block layout and TP rank/size, so differently configured engines never share blocks.
Requests whose KV depends on more than their token ids (multimodal inputs, prompt
embeddings, a cache salt) are neither loaded nor stored.

Each put carries vLLM's own block hashes for its blocks (`EngineNames`, as vLLM's KV events
publish them: `maybe_convert_block_hash`), so the daemon's KV events in vLLM's format name
the blocks as the engine's own events do and a KV-aware router matches both
(docs/operations.md).

When the daemon cannot be reached the connector logs one warning, answers "no hit",
skips saves, and retries after `retry_interval_s`; it logs once more when the daemon is back.

Per-request hints (`kvstore.client._request_hints`): a request's `kv_transfer_params`
(or a `kv_hints` action `kvstore.reuse`) may name its session, when the session comes
back and whether it ends; the scheduler's lookup and the workers' puts carry the hint,
and the finished request ends the session. A bad value is refused with a message (in
the log and in the finished request's `kvstore_hints_error`); the request goes on.

Break-even (`kvstore.client._breakeven`): the workers time their fetches, puts and
forward passes and report them with the step; the scheduler learns the plane's latency
and bandwidth and the engine's prefill rate from them and loads a hit only when loading
is expected to beat computing it (the tokens it leaves are reported in
`kvstore_skipped_tokens` and computed by vLLM), never so much in one step that a request
of the step would wait longer than its own recompute; a fetch past its deadline (about
its recompute time) is a miss, recomputed.

The counts a finished request reports are the workers' word: a request that stores or
loads in its last step (a prefill-only request) finishes before that step's report
reaches the scheduler, so the dict `request_finished` returned is completed in place
when the report arrives, in the same scheduler update and before vLLM sends the output.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.client._breakeven import BreakEven, LoadPlan
from kvstore.client._request_hints import NO_HINTS, RequestHints, parse_request_hints
from kvstore.client._requests import EngineNames
from kvstore.client.results import LookupResult
from kvstore.client.sync import Client
from kvstore.errors import DeadlineExceeded, InvalidArgument, KVStoreError
from kvstore.groups import Rule, needed, rule_of
from kvstore.layout import GroupKind, KVGroup, KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

DEFAULT_LOOKUP_TIMEOUT_S = 5.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
DEFAULT_RETRY_INTERVAL_S = 5.0
# Long enough to cover the gap between the scheduler's lookup and the worker's fetch of
# the same step, short enough that a lookup whose request never ran pins nothing for long.
DEFAULT_LEASE_MS = 30_000

_KV_CACHE_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


# ------------------------------------------------------------------ configuration


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """`kv_connector_extra_config`, checked: unknown keys and bad values stop the engine
    at start-up with a message, instead of being ignored."""

    target: str | None = None
    model_id: str | None = None
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    lease_ms: int = DEFAULT_LEASE_MS
    retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S
    # Load a hit only when loading it is expected to beat computing it (see the module
    # docstring); False loads every hit, however slow the plane.
    break_even: bool = True
    # A lossy storage codec (docs/codecs.md): "fp8-e4m3" or "kivi4"; off (None) by default.
    kv_codec: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise InvalidArgument(f"kv_connector_extra_config has unknown keys {unknown}; "
                                  f"the kvstore connector takes {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            if name in ("target", "model_id", "kv_codec"):
                if value is not None and not isinstance(value, str):
                    raise InvalidArgument(f"kv_connector_extra_config.{name} must be a string, got {value!r}")
                values[name] = value or None
                continue
            if name == "break_even":
                if not isinstance(value, bool):
                    raise InvalidArgument(f"kv_connector_extra_config.{name} must be true or false, got {value!r}")
                values[name] = value
                continue
            kind = int if name == "lease_ms" else float
            try:
                number = kind(value)
            except (TypeError, ValueError):
                raise InvalidArgument(f"kv_connector_extra_config.{name} must be a number, got {value!r}") from None
            if number < 0 or (number == 0 and name != "lease_ms"):
                raise InvalidArgument(f"kv_connector_extra_config.{name} must be positive, got {value!r}")
            values[name] = number
        return cls(**values)


# ------------------------------------------------------------------ namespace


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _in_block_layout(vllm_config: VllmConfig, dtype: torch.dtype) -> str:
    """How the attention backend lays out one layer's block, as a namespace string.

    The CPU backend keeps each head's K rows then V rows (`H,2,B,D`), and its kernels
    pick an ISA-specific variant; the ISA goes into the name so a block written by one
    kernel variant is never read by another.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        isa = "unknown"
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(dtype, vllm_config.cache_config.block_size,
                                vllm_config.model_config.get_head_size(), vllm_config.cache_config.cache_dtype)
        except (ImportError, NotImplementedError):  # an older or newer vLLM: stay conservative
            pass
        return f"L,[H,2,B,D];vllm-cpu-attn/{isa}"
    return f"L,[block];vllm-{current_platform.device_name}"


def layout_from_vllm_config(vllm_config: VllmConfig, *, tp_rank: int = 0, lora_id: str = "",
                            model_id: str | None = None, kv_cache_config: KVCacheConfig | None = None,
                            kv_codec: str = "") -> KVLayout:
    """The kvstore namespace of one vLLM engine's KV cache (one TP rank, one LoRA). With
    the `kv_cache_config`, a model whose cache is not one group of full-attention layers
    gets a layout with kvstore groups (`kv_groups_of`)."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel_config = vllm_config.parallel_config
    cache_dtype = cache_config.cache_dtype
    torch_dtype = model_config.dtype
    if cache_dtype in ("auto", None, ""):
        dtype = _dtype_name(torch_dtype)
    elif cache_dtype in _KV_CACHE_DTYPES:
        dtype = _KV_CACHE_DTYPES[cache_dtype]
    else:
        raise InvalidArgument(f"kv cache dtype {cache_dtype!r} is not supported by the kvstore connector; "
                              "use 'auto' or an fp8 variant")
    return KVLayout(
        model=model_id or model_config.model,
        revision=model_config.revision or "",
        lora_id=lora_id,
        dtype=dtype,
        num_layers=model_config.get_num_layers(parallel_config),
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_dim=model_config.get_head_size(),
        block_size_tokens=cache_config.block_size,
        kv_layout=_in_block_layout(vllm_config, torch_dtype),
        tp_rank=tp_rank,
        tp_size=parallel_config.tensor_parallel_size,
        groups=kv_groups_of(kv_cache_config, dtype, cache_config.block_size)[0] if kv_cache_config is not None else (),
        kv_codec=kv_codec,
    )


def kv_groups_of(kv_cache_config: KVCacheConfig, kv_dtype: str,
                 block_size: int) -> tuple[tuple[KVGroup, ...], list[list[int]]]:
    """The kvstore groups of a vLLM KV cache config, and for each the vLLM groups it holds.

    vLLM splits layers into groups of equal size (Gemma-3's 5 sliding-window layers to 1
    full-attention layer become 6 groups of one layer); vLLM groups of the same kind and
    page size make one kvstore group, whose part is their layers' pages of one block
    (unpadded), vLLM group by vLLM group, each in layer order: fewer parts per block for
    the store to index. One group of plain full attention is the layout without groups
    (the fingerprint it always had)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kinds: dict[tuple[Any, ...], list[int]] = {}
    described: dict[tuple[Any, ...], tuple[GroupKind, str, tuple[int, ...], int, int]] = {}
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        layers = len(group.layer_names)
        window = 0
        if isinstance(spec, MambaSpec):
            # A state group's hit rule fits (kvstore keeps a state at each put's end), but
            # vLLM keeps Mamba and linear-attention states per running request outside
            # its block-hash prefix cache unless mamba_cache_mode aligns them to blocks,
            # and no engine test covers that here: refused rather than guessed at.
            raise InvalidArgument(f"vLLM KV cache group {i} holds Mamba / linear-attention state, which the kvstore "
                                  "vLLM connector does not load or save yet; the transformers adapter "
                                  "(kvstore.client.hf) stores such models (docs/engines.md)")
        else:
            if isinstance(spec, MLAAttentionSpec):
                kind = GroupKind.MLA
            elif isinstance(spec, SlidingWindowSpec):
                kind, window = GroupKind.SLIDING_WINDOW, spec.sliding_window
            elif type(spec) is FullAttentionSpec and not spec.sliding_window and not spec.attention_chunk_size:
                kind = GroupKind.FULL
            else:
                raise InvalidArgument(f"vLLM KV cache group {i} is {type(spec).__name__}, which the kvstore "
                                      "connector does not support (docs/engines.md lists what works)")
            if spec.block_size != block_size:
                raise InvalidArgument(f"vLLM KV cache group {i} has {spec.block_size}-token blocks, the engine "
                                      f"{block_size}: the kvstore connector needs one block size for all groups")
            quant = getattr(spec, "kv_quant_mode", None)
            # The KV dtype is in the key, and so are the scales a quantized cache keeps with it.
            dtype = kv_dtype if quant is None or quant.name == "NONE" else f"{kv_dtype}+scales:{quant.name.lower()}"
            shape: tuple[int, ...] = (block_size, spec.num_heads, spec.state_content_size_bytes)
        key = (kind, window, dtype, shape, spec.real_page_size_bytes)
        kinds.setdefault(key, []).append(i)
        described[key] = (kind, dtype, shape, spec.real_page_size_bytes, window)
    groups: list[KVGroup] = []
    members = []
    for key, vgroups in kinds.items():
        kind, dtype, shape, page_bytes, window = described[key]
        layers = sum(len(kv_cache_config.kv_cache_groups[v].layer_names) for v in vgroups)
        groups.append(KVGroup(f"{len(groups)}:{kind.value}", kind, dtype, (layers, *shape),
                              block_bytes=layers * page_bytes, window_tokens=window))
        members.append(vgroups)
    if len(groups) == 1 and groups[0].kind is GroupKind.FULL:
        return (), members
    return tuple(groups), members


# ------------------------------------------------------------------ daemon health


class _DaemonHealth:
    """Whether the daemon answers, shared by the scheduler and worker halves of a process.

    One warning when it stops answering, one info line when it is back, and no calls in
    between until `retry_interval_s` has passed: an unreachable daemon must cost the engine
    neither a stack trace per block nor a timeout per request.
    """

    _by_target: dict[str, _DaemonHealth] = {}
    _lock = threading.Lock()

    def __init__(self, target: str, retry_interval_s: float) -> None:
        self.target = target
        self.retry_interval_s = retry_interval_s
        self._down_since: float | None = None
        self._next_try = 0.0

    @classmethod
    def for_target(cls, target: str, retry_interval_s: float) -> _DaemonHealth:
        with cls._lock:
            health = cls._by_target.get(target)
            if health is None:
                health = cls._by_target[target] = cls(target, retry_interval_s)
            return health

    def usable(self) -> bool:
        return self._down_since is None or time.monotonic() >= self._next_try

    def failed(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        self._next_try = now + self.retry_interval_s
        if self._down_since is None:
            self._down_since = now
            logger.warning(
                "kvstore daemon at %s failed during %s (%s); vLLM recomputes instead of loading, and saves are "
                "skipped; retrying every %.0f s", self.target, what, exc, self.retry_interval_s)
        else:
            logger.debug("kvstore daemon at %s still failing during %s: %s", self.target, what, exc)

    def ok(self) -> None:
        if self._down_since is not None:
            logger.info("kvstore daemon at %s is back after %.1f s", self.target,
                        time.monotonic() - self._down_since)
            self._down_since = None


# ------------------------------------------------------------------ metadata


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Fetch `block_hashes` into vLLM blocks `block_ids` (same order) for one request."""

    req_id: str
    lora_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    lease_id: str
    # Per vLLM KV cache group, its blocks for the same positions (a grouped layout).
    group_block_ids: list[list[int]] = field(default_factory=list)
    # Past this the load is a miss (vLLM recomputes): about its recompute time.
    deadline_s: float | None = None


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Put vLLM blocks `block_ids` as blocks `[first_block, ...)` of the prefix `token_ids`."""

    req_id: str
    lora_id: str
    token_ids: list[int]
    first_block: int
    block_ids: list[int]
    group_block_ids: list[list[int]] = field(default_factory=list)
    # vLLM's names of these blocks, and of the block before them, for the daemon's KV
    # events (None when vLLM's hashes do not line up with the blocks).
    engine_names: EngineNames | None = None
    hints: RequestHints = NO_HINTS


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Tokens the step computes (all requests): what the forward pass the workers time did.
    step_tokens: int = 0


@dataclass
class KVStoreWorkerReport(KVConnectorWorkerMetadata):
    """What the workers did this step, per request, for the scheduler side."""

    loaded_tokens: dict[str, int] = field(default_factory=dict)
    failed_loads: set[str] = field(default_factory=set)
    stored_blocks: dict[str, int] = field(default_factory=dict)
    # Measurements for the break-even model: (bytes, seconds) of each fetch and put, and
    # (tokens, seconds) of the step's forward pass.
    fetches: list[tuple[int, float]] = field(default_factory=list)
    puts: list[tuple[int, float]] = field(default_factory=list)
    forward: tuple[int, float] | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVStoreWorkerReport):
            return self
        self.fetches += other.fetches
        self.puts += other.puts
        if other.forward is not None and (self.forward is None or other.forward[1] > self.forward[1]):
            self.forward = other.forward  # the slowest rank's pass is the step's
        # With tensor parallelism every rank reports; a request counts as loaded as far as
        # its least successful rank got.
        for req_id, n in other.loaded_tokens.items():
            self.loaded_tokens[req_id] = min(n, self.loaded_tokens.get(req_id, n))
        self.failed_loads |= other.failed_loads
        for req_id, n in other.stored_blocks.items():
            self.stored_blocks[req_id] = min(n, self.stored_blocks.get(req_id, n))
        return self


@dataclass
class _RequestState:
    """Scheduler-side bookkeeping of one running request (mutable, private)."""

    req_id: str
    lora_id: str
    prompt: list[int]
    block_ids: list[list[int]]  # per vLLM KV cache group, by block position
    saved_blocks: int  # prompt blocks the daemon holds or a save was planned for
    block_hashes: list[Any] = field(default_factory=list)  # vLLM's, per block (the request's own list)
    lora_name: str | None = None
    hints: RequestHints = NO_HINTS
    loaded_tokens: int = 0
    stored_blocks: int = 0
    load_failed: bool = False
    skipped_tokens: int = 0  # held, but computed: loading them would have been slower

    def params(self) -> dict[str, Any]:
        """What the finished request reports in its kv_transfer_params."""
        out: dict[str, Any] = {
            "kvstore_loaded_tokens": self.loaded_tokens,
            "kvstore_load_failed": self.load_failed,
            "kvstore_stored_blocks": self.stored_blocks,
            "kvstore_skipped_tokens": self.skipped_tokens,
        }
        if self.hints.error:
            out["kvstore_hints_error"] = self.hints.error
        return out


@dataclass
class _Match:
    """The latest lookup for a waiting request, and the break-even plan for its hit."""

    hit: LookupResult | None
    num_computed_tokens: int
    plan: LoadPlan | None = None
    skipped_tokens: int = 0


# ------------------------------------------------------------------ connector


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for kvstore; see the module docstring for the protocol."""

    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a save that a preemption drops is a later miss, never a wrong token.
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._client = Client(self._config.target, timeout_s=self._config.timeout_s)
        self._health = _DaemonHealth.for_target(self._client.target, self._config.retry_interval_s)
        self._block_size = vllm_config.cache_config.block_size
        self._tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._tp_rank = get_tensor_model_parallel_rank()
        self._layouts: dict[str, KVLayout] = {}
        self._layout("")  # fail now, not mid-request, on a configuration kvstore cannot key
        self._check_platform(self._layout(""))
        # Whether only put ends are reusable (a window or state group): see `_plan_save`.
        self._ends_matter = any(rule_of(g) is not Rule.EVERY for g in self._layout("").groups)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning("kv_load_failure_policy is %r: a block kvstore fails to deliver fails its request; "
                           "set it to 'recompute' to have vLLM recompute instead",
                           self._kv_transfer_config.kv_load_failure_policy)
        # scheduler side
        self._matches: dict[str, _Match] = {}
        self._pending_loads: list[LoadSpec] = []
        self._requests: dict[str, _RequestState] = {}
        self._hints: dict[str, RequestHints] = {}
        self._breakeven = BreakEven(self._block_size)
        # Requests finished in this scheduler update, with the kv_transfer_params they
        # returned: the update's worker report (their last step's) completes them.
        self._finished: dict[str, tuple[_RequestState, dict[str, Any]]] = {}
        # worker side
        self._step_started = 0.0
        self._step_load_s = 0.0
        # An engine's first forward pass, put and load pay one-time costs (allocations,
        # kernel set-up, reservations): they are not samples of the engine's or the plane's speed.
        self._first_forward = self._first_put = self._first_fetch = True
        self._kv_caches: list[torch.Tensor] = []
        # A grouped layout: each kvstore group's layers, as (vLLM group, paged tensor) in part order.
        self._group_caches: list[list[tuple[int, torch.Tensor]]] = []
        self._load_errors: set[int] = set()
        self._report = KVStoreWorkerReport()
        logger.info("kvstore connector (%s) for %s, namespace %s", role.name.lower(), self._client.target,
                    self._layout("").namespace_id.hex())

    @staticmethod
    def _check_platform(layout: KVLayout) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and any(g.kind is GroupKind.MLA for g in layout.groups):
            # vLLM turns prefix caching off for MLA on CPU: its CPU MLA backend does not
            # prefill over cached context, so a loaded prefix would give other tokens.
            raise InvalidArgument("the kvstore connector does not load MLA caches on vLLM's CPU backend, which "
                                  "cannot prefill over a cached prefix (vLLM disables prefix caching for MLA on "
                                  "CPU); run without the connector, or on a GPU")

    def _layout(self, lora_id: str) -> KVLayout:
        layout = self._layouts.get(lora_id)
        if layout is None:
            layout = self._layouts[lora_id] = layout_from_vllm_config(
                self._vllm_config, tp_rank=self._tp_rank, lora_id=lora_id, model_id=self._config.model_id,
                kv_cache_config=self._kv_cache_config, kv_codec=self._config.kv_codec or "")
        return layout

    @staticmethod
    def _lora_id(request: Any) -> str:
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return ""
        # The name and the adapter path together identify the weights a LoRA adds.
        return f"{lora.lora_name}@{getattr(lora, 'lora_path', '') or ''}"

    @staticmethod
    def _cacheable(request: Any) -> bool:
        # kvstore keys blocks by token ids only; KV that depends on anything else is left alone.
        return not (getattr(request, "mm_features", None) or getattr(request, "cache_salt", None)
                    or getattr(request, "prompt_embeds", None) is not None)

    # ============================================================== scheduler side

    def _request_hints(self, request: Any) -> RequestHints:
        """The request's hints, parsed once; a refused one is logged once."""
        hints = self._hints.get(request.request_id)
        if hints is None:
            hints = parse_request_hints(getattr(request, "kv_transfer_params", None),
                                        getattr(request, "kv_hints", None))
            if hints.error:
                logger.warning("request %s: %s", request.request_id, hints.error)
            self._hints[request.request_id] = hints
        return hints

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        hints = self._request_hints(request)
        # The last prompt token is always computed: its logits start decoding.
        limit = (len(prompt) - 1) // self._block_size * self._block_size
        hit: LookupResult | None = None
        layout = self._layout(self._lora_id(request))
        if limit > 0 and self._cacheable(request) and self._health.usable():
            try:
                started = time.perf_counter()
                hit = self._client.lookup(layout, prompt[:limit],
                                          lease_ms=self._config.lease_ms if limit > num_computed_tokens else 0,
                                          timeout_s=self._config.lookup_timeout_s, **hints.hint_args())
                self._breakeven.transfer.round_trip(time.perf_counter() - started)
                self._health.ok()
            except KVStoreError as exc:
                self._health.failed("lookup", exc)
        match = self._matches[request.request_id] = _Match(hit, num_computed_tokens)
        if hit is None:
            return 0, False
        offered = max(0, hit.num_tokens - num_computed_tokens) // self._block_size
        if not self._config.break_even or offered == 0:
            return offered * self._block_size, False
        plan = match.plan = self._breakeven.plan(offered, layout.bytes_per_block)
        if plan.blocks < offered:
            match.skipped_tokens = (offered - plan.blocks) * self._block_size
            logger.debug("request %s: computing %d held tokens (%s: load %.4f s, compute %.4f s)", request.request_id,
                         match.skipped_tokens, plan.reason, plan.load_s or 0.0, plan.compute_s or 0.0)
            if hit.lease_id and plan.blocks == 0:
                self._unpin(hit.lease_id)
        return plan.blocks * self._block_size, False

    def _unpin(self, lease_id: str) -> None:
        try:
            self._client.unpin(lease_id, timeout_s=self._config.lookup_timeout_s)
        except KVStoreError as exc:  # the lease expires on its own
            logger.debug("unpin of a skipped hit failed: %s", exc)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        hit = match.hit if match else None
        state = _RequestState(
            req_id=request.request_id,
            lora_id=self._lora_id(request),
            prompt=list(request.prompt_token_ids or []) if self._cacheable(request) else [],
            block_ids=[],
            saved_blocks=hit.num_blocks if hit else 0,
            block_hashes=getattr(request, "block_hashes", None) or [],
            lora_name=request.lora_request.lora_name if getattr(request, "lora_request", None) else None,
            hints=self._request_hints(request),
            skipped_tokens=match.skipped_tokens if match else 0,
        )
        self._requests[request.request_id] = state
        if num_external_tokens <= 0 or hit is None or match is None:
            return
        first = match.num_computed_tokens // self._block_size
        count = num_external_tokens // self._block_size
        per_group = [list(ids[first:first + count]) for ids in blocks.get_block_ids()]
        self._pending_loads.append(LoadSpec(
            req_id=request.request_id,
            lora_id=state.lora_id,
            block_hashes=hit.block_hashes[first:first + count],
            block_ids=per_group[0],
            lease_id=hit.lease_id,
            group_block_ids=per_group,
            deadline_s=BreakEven.deadline_s(match.plan, self._config.timeout_s) if match.plan else None,
        ))
        # kvstore_loaded_tokens is what the workers report they loaded, not this plan.

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self._pending_loads,
                                        step_tokens=scheduler_output.total_num_scheduled_tokens)
        self._pending_loads = []
        self._breakeven.end_step()
        # The requests finished in the last update had their last report then.
        self._finished.clear()
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_save(state, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            # vLLM 0.34 sends a resumed request again as a new one and dropped the field.
            if req_id in getattr(cached, "resumed_req_ids", ()):
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_ids]
                for mine, ids in zip(state.block_ids, new_ids):
                    mine.extend(ids)
            self._plan_save(state, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id], meta)
        return meta

    def _plan_save(self, state: _RequestState, computed_after_step: int, meta: KVStoreConnectorMetadata) -> None:
        """Save the full prompt blocks this step completes that the daemon does not hold."""
        if not state.prompt or not self._health.usable():
            return
        full = min(computed_after_step, len(state.prompt)) // self._block_size
        if full <= state.saved_blocks or not state.block_ids or any(full > len(ids) for ids in state.block_ids):
            return
        # With window or state groups only a put's end is reusable (kvstore.groups), and
        # a later lookup of this same prompt asks for one block less than its full blocks
        # when its length is a multiple of the block size (the last token is always
        # computed): that end is put on its own too, at the cost of one block's window
        # part and one state.
        asked = (len(state.prompt) - 1) // self._block_size
        if self._ends_matter and state.saved_blocks < asked < full:
            self._save(state, asked, meta)
        self._save(state, full, meta)

    def _save(self, state: _RequestState, end: int, meta: KVStoreConnectorMetadata) -> None:
        # Each group's blocks by position; a sliding-window group's early positions may
        # name blocks vLLM freed since, but a save reads only those its hit rule keeps,
        # which lie inside the window of this step's tokens.
        per_group = [ids[state.saved_blocks:end] for ids in state.block_ids]
        meta.saves.append(SaveSpec(
            req_id=state.req_id,
            lora_id=state.lora_id,
            token_ids=state.prompt[: end * self._block_size],
            first_block=state.saved_blocks,
            block_ids=per_group[0],
            group_block_ids=per_group,
            engine_names=self._engine_names(state, state.saved_blocks, end),
            hints=state.hints,
        ))
        state.saved_blocks = end

    def _engine_names(self, state: _RequestState, start: int, end: int) -> EngineNames | None:
        """vLLM's names of blocks [start, end) of the request, as its KV events give them,
        when its block hashes are one per block of this connector's size (vLLM hashes at
        a smaller size when KV cache groups have different block sizes: then none)."""
        hashes = state.block_hashes
        if len(hashes) < end or len(hashes) > len(state.prompt) // self._block_size + 1:
            return None
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return EngineNames([maybe_convert_block_hash(h) for h in hashes[start:end]],
                           parent=maybe_convert_block_hash(hashes[start - 1]) if start else None,
                           lora_name=state.lora_name)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        if not isinstance(report, KVStoreWorkerReport):
            return
        transfer, prefill = self._breakeven.transfer, self._breakeven.prefill
        for n_bytes, seconds in report.fetches:
            transfer.fetched(n_bytes, seconds)
        for n_bytes, seconds in report.puts:
            transfer.put(n_bytes, seconds)
        if report.forward is not None:
            prefill.step(*report.forward)
        touched: set[str] = set()
        for req_id, n in report.loaded_tokens.items():
            if (state := self._state(req_id)) is not None:
                state.loaded_tokens = n
                touched.add(req_id)
        for req_id in report.failed_loads:
            if (state := self._state(req_id)) is not None:
                state.load_failed = True
                touched.add(req_id)
        for req_id, n in report.stored_blocks.items():
            if (state := self._state(req_id)) is not None:
                state.stored_blocks += n
                touched.add(req_id)
        for req_id in touched & self._finished.keys():
            state, params = self._finished[req_id]
            params.update(state.params())  # the dict vLLM is about to send with the output

    def _state(self, req_id: str) -> _RequestState | None:
        state = self._requests.get(req_id)
        if state is None and req_id in self._finished:
            state = self._finished[req_id][0]
        return state

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # Saves are synchronous (wait_for_save): no group's blocks are held past the request.
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matches.pop(request.request_id, None)
        hints = self._hints.pop(request.request_id, NO_HINTS)
        state = self._requests.pop(request.request_id, None)
        if hints.end_session:
            self._end_session(hints.session_id)
        if state is None:
            return False, ({"kvstore_hints_error": hints.error} if hints.error else None)
        params = state.params()
        self._finished[request.request_id] = (state, params)
        return False, params

    def _end_session(self, session_id: str) -> None:
        """The request said its session is over: its blocks lose their protection. Its last
        puts ran in its last step's wait_for_save, before vLLM finished it."""
        if not self._health.usable():
            return
        try:
            self._client.end_session(session_id, timeout_s=self._config.lookup_timeout_s)
            self._health.ok()
        except KVStoreError as exc:
            self._health.failed("end_session", exc)

    # ============================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=lambda name: (extract_layer_index(name), name))
        self._kv_caches = [kv_caches[name] for name in names]
        self._warm_up_plane()
        layout = self._layout("")
        if layout.groups:
            self._register_groups(kv_caches, layout, extract_layer_index)
            return
        per_layer = {kv[0].numel() * kv.element_size() for kv in self._kv_caches}
        got = sum(kv[0].numel() * kv.element_size() for kv in self._kv_caches)
        if len(self._kv_caches) != layout.num_layers or len(per_layer) != 1 or got != layout.dense_block_bytes:
            raise InvalidArgument(
                f"vLLM's KV cache has {len(self._kv_caches)} layers of {sorted(per_layer)} bytes per block "
                f"({got} in all) but the kvstore namespace expects {layout.num_layers} layers and "
                f"{layout.dense_block_bytes} bytes per block; this attention backend's layout is not supported")
        logger.info("kvstore connector: %d layers, per-layer block %s %s, %d bytes per kvstore block",
                    len(names), tuple(self._kv_caches[0].shape[1:]), self._kv_caches[0].dtype, got)

    def _warm_up_plane(self) -> None:
        """Attach the data plane and map the daemon's segment now, at start-up, so the
        first loads run (and are timed) at the plane's speed, not its set-up's."""
        if not self._health.usable():
            return
        try:
            plane = self._client.warm_up(timeout_s=self._config.timeout_s)
            self._health.ok()
            logger.info("kvstore connector: data plane %s ready", plane)
        except KVStoreError as exc:
            self._health.failed("warm_up", exc)

    def _register_groups(self, kv_caches: dict[str, torch.Tensor], layout: KVLayout, layer_index: Any) -> None:
        """Each kvstore group's layers, vLLM group by vLLM group, in layer order; each
        group's part must be the bytes of its layers' paged blocks."""
        config = self._kv_cache_config
        assert config is not None
        _, members = kv_groups_of(config, layout.dtype, self._block_size)
        self._group_caches = []
        for group, vgroups in zip(layout.groups, members):
            caches: list[tuple[int, torch.Tensor]] = []
            for v in vgroups:
                names = sorted(config.kv_cache_groups[v].layer_names, key=lambda name: (layer_index(name), name))
                missing = [n for n in names if n not in kv_caches]
                if missing:
                    raise InvalidArgument(f"vLLM registered no KV cache for layers {missing} of group {group.name}")
                caches += [(v, kv_caches[n]) for n in names]
            got = sum(kv[0].numel() * kv.element_size() for _, kv in caches)
            if got != group.bytes_per_block:
                raise InvalidArgument(
                    f"vLLM's KV cache group {group.name} holds {got} bytes per block in its layers' tensors, but "
                    f"the kvstore group expects {group.bytes_per_block}; this attention backend's layout is not "
                    "supported")
            self._group_caches.append(caches)
        logger.info("kvstore connector: %d KV groups (%s), %d bytes per kvstore block with every part",
                    len(layout.groups), ", ".join(f"{g.name}: {len(c)} layers" for g, c in
                                                  zip(layout.groups, self._group_caches)), layout.bytes_per_block)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # The step starts: its forward pass is the time from here to wait_for_save, less
        # the loads (vLLM runs start_load_kv before the forward when a step has loads).
        self._step_started = time.perf_counter()
        self._step_load_s = 0.0

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        for spec in meta.loads:
            started = time.perf_counter()
            loaded = self._load(spec)
            elapsed = time.perf_counter() - started
            self._step_load_s += elapsed
            if loaded and self._first_fetch:
                self._first_fetch = False
            elif loaded:  # the whole load (the fetch and the copy into the paged cache) is the sample
                self._report.fetches.append((loaded * self._layout(spec.lora_id).bytes_per_block, elapsed))
            self._report.loaded_tokens[spec.req_id] = loaded * self._block_size
            if loaded < len(spec.block_ids):
                # vLLM recomputes these blocks (and, for a prefix, everything after them).
                self._load_errors.update(spec.block_ids[loaded:])
                self._report.failed_loads.add(spec.req_id)

    def _load(self, spec: LoadSpec) -> int:
        """Write the fetched blocks into vLLM's cache; returns how many landed."""
        if not self._health.usable():
            return 0
        layout = self._layout(spec.lora_id)
        blocks = self._fetch(spec, layout)
        if layout.groups:
            return self._load_parts(spec, layout, blocks)
        n = min(len(blocks), len(spec.block_ids))
        if n == 0:
            return 0
        if n < len(spec.block_ids):
            logger.debug("request %s: fetched %d of %d blocks (evicted since lookup)", spec.req_id, n,
                         len(spec.block_ids))
        layer_bytes = self._kv_caches[0][0].numel() * self._kv_caches[0].element_size()
        data = torch.frombuffer(bytearray().join(blocks[:n]), dtype=torch.uint8).view(n, len(self._kv_caches),
                                                                                       layer_bytes)
        for layer, kv in enumerate(self._kv_caches):
            ids = torch.tensor(spec.block_ids[:n], dtype=torch.long, device=kv.device)
            src = data[:, layer].contiguous().view(kv.dtype).view(n, *kv.shape[1:])
            kv.index_copy_(0, ids, src.to(kv.device))
        return n

    def _fetch(self, spec: LoadSpec, layout: KVLayout) -> list[Any]:
        """The planned blocks; none past the deadline."""
        started = time.perf_counter()
        timeout_s = spec.deadline_s or self._config.timeout_s
        try:
            blocks = self._client.fetch(layout, block_hashes=spec.block_hashes, lease_id=spec.lease_id,
                                        timeout_s=timeout_s)
            self._health.ok()
        except DeadlineExceeded as exc:
            # Slower than computing them would have been: a miss, not a daemon failure.
            # The time it took is a sample too (the plane is at most this fast).
            self._report.fetches.append((len(spec.block_hashes) * layout.bytes_per_block,
                                         time.perf_counter() - started))
            logger.debug("request %s: fetch past its %.3f s deadline, recomputing: %s", spec.req_id, timeout_s, exc)
            return []
        except KVStoreError as exc:
            self._health.failed("fetch", exc)
            return []
        return blocks

    def _load_parts(self, spec: LoadSpec, layout: KVLayout, blocks: list[Any]) -> int:
        """A grouped load: every part of the longest prefix every group serves, each written
        through its group's block table. All or nothing: a prefix cut short loads none."""
        n = min(len(blocks), len(spec.block_ids))
        if n < len(blocks) or n == 0:
            return 0  # a prefix other than the one looked up: its window and state parts do not fit
        for need in needed(layout, n):
            group = layout.groups[need.group]
            positions = list(range(need.start, need.stop))
            offset = 0
            for v, kv in self._group_caches[need.group]:
                ids = [spec.group_block_ids[v][j] for j in positions]
                layer_bytes = kv[0].numel() * kv.element_size()
                raw = bytearray().join(memoryview(blocks[j][group.name])[offset:offset + layer_bytes]
                                       for j in positions)
                src = torch.frombuffer(raw, dtype=torch.uint8).view(kv.dtype).view(len(positions), *kv.shape[1:])
                kv.index_copy_(0, torch.tensor(ids, dtype=torch.long, device=kv.device), src.to(kv.device))
                offset += layer_bytes
        return n

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are complete when start_load_kv returns

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        # A kvstore block spans all layers, so blocks are saved whole in wait_for_save,
        # after the forward has written every layer; the scheduler frees no block of a
        # running step before then.
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        if meta.step_tokens and self._step_started:
            forward_s = time.perf_counter() - self._step_started - self._step_load_s
            if self._first_forward:
                self._first_forward = False
            else:
                self._report.forward = (meta.step_tokens, forward_s)
        for spec in meta.saves:
            if not self._health.usable():
                return
            layout = self._layout(spec.lora_id)
            blocks: list[Any] = (self._gather_parts(spec, layout) if layout.groups
                                 else self._gather(spec.block_ids))
            started = time.perf_counter()
            try:
                result = self._client.put(layout, spec.token_ids, blocks, first_block=spec.first_block,
                                          engine_names=spec.engine_names, **spec.hints.hint_args())
                self._health.ok()
            except KVStoreError as exc:
                self._health.failed("put", exc)
                continue
            if self._first_put:
                self._first_put = False
            else:
                self._report.puts.append((len(blocks) * layout.bytes_per_block, time.perf_counter() - started))
            self._report.stored_blocks[spec.req_id] = self._report.stored_blocks.get(spec.req_id, 0) + result.stored

    def _gather(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The named blocks as contiguous CPU byte tensors, all layers each."""
        per_layer = []
        for kv in self._kv_caches:
            ids = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
            # .cpu() waits for the forward's writes on accelerators (same stream).
            per_layer.append(kv.index_select(0, ids).cpu().contiguous().view(torch.uint8).view(len(block_ids), -1))
        packed = torch.stack(per_layer, dim=1)  # [n, L, layer_bytes]
        return list(packed.view(len(block_ids), -1).unbind(0))

    def _gather_parts(self, spec: SaveSpec, layout: KVLayout) -> list[dict[str, bytes]]:
        """A grouped put's parts, block by block: for each group, the positions its hit rule
        keeps for a put of these blocks, read through the group's block table."""
        n = len(spec.block_ids)
        out: list[dict[str, bytes]] = [{} for _ in range(n)]
        for need in needed(layout, n):
            if not len(need):
                continue
            group = layout.groups[need.group]
            per_layer = []
            for v, kv in self._group_caches[need.group]:
                index = torch.tensor(spec.group_block_ids[v][need.start:need.stop], dtype=torch.long, device=kv.device)
                per_layer.append(kv.index_select(0, index).cpu().contiguous().view(torch.uint8).view(len(need), -1))
            packed = torch.cat(per_layer, dim=1)  # [blocks, the group's layers' bytes]
            for k, j in enumerate(range(need.start, need.stop)):
                out[j][group.name] = packed[k].numpy().tobytes()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._report
        if not (report.loaded_tokens or report.failed_loads or report.stored_blocks or report.fetches
                or report.puts or report.forward):
            return None
        self._report = KVStoreWorkerReport()
        return report

    def shutdown(self) -> None:
        self._client.close()
