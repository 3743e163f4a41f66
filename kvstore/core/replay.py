"""Trace replay: hit ratios of eviction policies on a recorded workload, next to OPT.

Reads Mooncake-format JSONL (one request a line: `timestamp` in ms, `input_length`,
`output_length`, `hash_ids`; optional `session_id`, `turn`, `type`, `block_size`) and
drives the daemon's own `Store` (index, put transactions, eviction loop) and policy code
over a `ReplayTier` that accounts `capacity_blocks` blocks and holds no bytes:

* a request's hit is the longest prefix of its blocks that is cached at its arrival
  (`Store.lookup`, which also touches that prefix, tail first);
* then the request's missing blocks are put: the store makes room by evicting the
  policy's victims, and publishes the new blocks tail first, so that a chain's head is
  the most recently used part of it;
* time-based logic (hint deadlines, leases) runs on the trace's clock, not the wall clock.

Hints: ``none``; ``trace`` derives "this request's prefix is extended by a later one"
from the trace itself (a semi-oracle: it knows whether and when the session returns),
and sends it as a hint with that gap plus a margin as the time to live, or ends the
session when it does not return; ``noisy:P`` flips a seeded fraction P of those.

`--opt` also replays Bélády's offline optimum on the same trace and capacity, through
the same store: like any demand cache it admits every block, and evicts the resident
block whose next use is farthest away.

Primitives: `load_trace`, `derive_hints`, `replay`, `replay_opt`, `capacity_from_fraction`.
The command line (`kvstore replay`: flags, table, plot) is kvstore.cli.replay.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.core.index import make_key
from kvstore.core.policies import DEFAULT_HINT_BUDGET_FRACTION, make_policy
from kvstore.core.policies.base import BlockKey, EvictionPolicy
from kvstore.core.policies.opt import NEVER, BeladyPolicy
from kvstore.core.store import Store, StoreTier
from kvstore.core.tier import Slot, Tier
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.hashing import HASH_BYTES
from kvstore.layout import KVLayout

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE_TOKENS = 512
# A trace hint's time to live is the true gap times this, plus the floor below: a client
# that knows its session returns "in about T" would leave some room.
HINT_TTL_MARGIN = 1.25
HINT_TTL_FLOOR_S = 1.0
# A common prefix of one block is a shared system prompt, not a returning session.
MIN_SESSION_PREFIX_BLOCKS = 2
DEFAULT_SEED = 0


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    distinct_blocks: int
    lookups: int


@dataclass(frozen=True, slots=True)
class Hint:
    """What the client of one request says after it: come back soon, or never."""

    session_id: str
    # None: the session is over (end_session); else the time to live of the hint.
    expect_reuse_within_s: float | None
    # How many leading blocks of the request the hint names.
    blocks: int = 0


@dataclass(frozen=True, slots=True)
class HintSpec:
    mode: str  # "none" | "trace" | "noisy"
    flip_fraction: float = 0.0
    seed: int = DEFAULT_SEED

    @classmethod
    def parse(cls, text: str, seed: int = DEFAULT_SEED) -> HintSpec:
        if text in ("none", "trace"):
            return cls(mode=text, seed=seed)
        if text.startswith("noisy:"):
            try:
                p = float(text.removeprefix("noisy:"))
            except ValueError:
                p = math.nan
            if not 0.0 <= p <= 1.0:
                raise ConfigError(f"--hints noisy:P needs P within [0, 1], got {text!r}")
            return cls(mode="noisy", flip_fraction=p, seed=seed)
        raise ConfigError(f"--hints must be none, trace or noisy:P (e.g. noisy:0.3), got {text!r}")

    def __str__(self) -> str:
        return f"noisy:{self.flip_fraction:g}" if self.mode == "noisy" else self.mode


@dataclass(frozen=True, slots=True)
class ReplayResult:
    policy: str
    hints: str
    capacity_blocks: int
    requests: int
    lookups: int
    hits: int
    hit_ratio: float
    input_tokens: int
    tokens_saved: int
    token_hit_ratio: float
    opt_hit_ratio: float | None = None
    opt_token_hit_ratio: float | None = None


# -- trace ---------------------------------------------------------------------------


def _parse_request(record: object, where: str) -> TraceRequest:
    if not isinstance(record, dict):
        raise InvalidArgument(f"{where}: expected a JSON object per line")
    try:
        hash_ids = tuple(int(h) for h in record["hash_ids"])
        session = record.get("session_id")
        return TraceRequest(
            timestamp_s=float(record["timestamp"]) / 1000.0,
            input_length=int(record["input_length"]),
            output_length=int(record.get("output_length", 0)),
            hash_ids=hash_ids,
            block_size_tokens=int(record.get("block_size", DEFAULT_BLOCK_SIZE_TOKENS)),
            session_id=None if session is None else str(session),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"{where}: not a Mooncake trace record ({exc!r}); each line needs "
            "timestamp (ms), input_length and hash_ids"
        ) from None


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """The first `limit` requests (all by default) of a JSONL trace, in file order."""
    requests: list[TraceRequest] = []
    distinct: set[int] = set()
    lookups = 0
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument(f"cannot read trace {path}: {exc.strerror}; pass a Mooncake JSONL file") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            req = _parse_request(record, f"{path}:{lineno}")
            requests.append(req)
            distinct.update(req.hash_ids)
            lookups += len(req.hash_ids)
    if not requests:
        raise InvalidArgument(f"{path}: no requests in the trace")
    return Trace(requests=tuple(requests), distinct_blocks=len(distinct), lookups=lookups)


def next_uses(trace: Trace) -> list[list[float]]:
    """For each request and block position, the index of the next request using that block."""
    seen: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in trace.requests]
    for i in range(len(trace.requests) - 1, -1, -1):
        ids = trace.requests[i].hash_ids
        out[i] = [seen.get(h, NEVER) for h in ids]
        for h in ids:
            seen[h] = i
    return out


def derive_hints(trace: Trace, spec: HintSpec, ttl_s: float | None = None) -> list[Hint | None]:
    """One hint per request (None: send nothing), derived from the trace's future.

    A request's reused prefix is its longest prefix of blocks that some later request
    holds again; it is "extended" when that prefix is longer than one block (a single
    shared block is a common system prompt, not a conversation coming back). Such a
    request hints its reused prefix, with the gap to the request that reuses the deepest
    of those blocks (times a margin, plus a floor) as the time to live, or `ttl_s` if
    given. Any other request ends its session. Sessions are the trace's `session_id`
    where present, else the chain of such returns.

    ``noisy:P`` flips each request's claim with probability P (seeded): a true return
    goes unhinted and ends the session, a request that never returns hints its whole
    chain with a typical time to live (the median of the true ones).
    """
    if spec.mode == "none":
        return [None] * len(trace.requests)
    nxt = next_uses(trace)
    reqs = trace.requests
    session_of = [req.session_id or f"chain-{i}" for i, req in enumerate(reqs)]
    ttls: list[float | None] = []
    lengths: list[int] = []
    claimed: set[int] = set()
    for i, req in enumerate(reqs):
        reused = 0
        for use in nxt[i]:
            if use == NEVER:
                break
            reused += 1
        if reused < MIN_SESSION_PREFIX_BLOCKS:
            ttls.append(None)
            lengths.append(len(req.hash_ids))
            continue
        j = int(nxt[i][reused - 1])
        gap = reqs[j].timestamp_s - req.timestamp_s
        ttls.append(ttl_s if ttl_s is not None else gap * HINT_TTL_MARGIN + HINT_TTL_FLOOR_S)
        lengths.append(reused)
        # The first request to be continued by j names j's session.
        if reqs[j].session_id is None and j not in claimed:
            claimed.add(j)
            session_of[j] = session_of[i]
    if spec.mode == "noisy":
        rng = random.Random(spec.seed)
        true_ttls = [t for t in ttls if t is not None]
        # A made-up "comes back" claims a typical time to live, not an oracle one.
        wrong_ttl = ttl_s if ttl_s is not None else (statistics.median(true_ttls) if true_ttls else 60.0)
        ttls = [
            (None if t is not None else wrong_ttl) if rng.random() < spec.flip_fraction else t
            for t in ttls
        ]
    return [
        Hint(session_id=session_of[i], expect_reuse_within_s=t, blocks=lengths[i])
        for i, t in enumerate(ttls)
    ]


# -- replay --------------------------------------------------------------------------


class _TraceClock:
    """The trace's time, advanced by the replay loop; policies read it as their clock."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ReplayTier(Tier):
    """Capacity accounting without bytes: a tier of `capacity_blocks` for replays.

    Puts through the store allocate and free slots here exactly as in a byte-holding
    tier, so the store's own eviction loop runs; writes and reads carry nothing.
    """

    name = "memory"

    def __init__(self, capacity_blocks: int, block_bytes: int) -> None:
        super().__init__(capacity_blocks * block_bytes)
        self._next_offset = 0

    def _allocate(self, nbytes: int) -> Slot | None:
        if self.used_bytes + nbytes > self.capacity_bytes:
            return None
        self._next_offset += nbytes
        return Slot(self.name, self._next_offset, nbytes)

    def _free(self, slot: Slot) -> None:
        pass

    async def write(self, slot: Slot, offset: int, data: memoryview | bytes) -> None:
        pass

    async def read(self, slot: Slot, nbytes: int) -> bytes:
        return bytes(nbytes)


def _replay_layout(block_size_tokens: int) -> KVLayout:
    # The smallest real layout: the replay needs a namespace, not bytes.
    return KVLayout(
        model="kvstore-trace-replay",
        dtype="float16",
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        block_size_tokens=block_size_tokens,
    )


@dataclass(frozen=True, slots=True)
class _Counts:
    hits: int
    input_tokens: int
    tokens_saved: int


def _block_hash(hash_id: int) -> bytes:
    """A trace's integer block id as a store block hash (16 bytes)."""
    return hash_id.to_bytes(HASH_BYTES, "big", signed=True)


async def _drive_store(
    trace: Trace,
    policy: EvictionPolicy,
    clock: _TraceClock,
    capacity_blocks: int,
    hints: Sequence[Hint | None],
    before_request: Callable[[int, bytes], None] | None,
    progress: Callable[[int], None] | None,
) -> _Counts:
    layout = _replay_layout(trace.requests[0].block_size_tokens)
    tier = ReplayTier(capacity_blocks, layout.bytes_per_block)
    store = Store([StoreTier(tier, policy)], clock=clock)
    ns = store.register(layout)
    memo: dict[int, bytes] = {}
    hits = tokens = saved = 0
    for i, req in enumerate(trace.requests):
        clock.now = req.timestamp_s
        if before_request is not None:
            before_request(i, ns)
        hashes = []
        for hid in req.hash_ids:
            b = memo.get(hid)
            if b is None:
                b = memo[hid] = _block_hash(hid)
            hashes.append(b)
        if not hashes:
            continue
        # The lookup touches the cached prefix, tail first; the put then makes room
        # through the store's own eviction loop and publishes the new blocks tail first.
        hit = store.lookup(ns, hashes).num_blocks
        hits += hit
        tokens += req.input_length
        saved += min(hit * req.block_size_tokens, req.input_length)
        if hit < len(hashes):
            # A request longer than the whole tier keeps its head: only a prefix is useful.
            put = hashes[:capacity_blocks]
            async with store.begin_put(ns, put) as txn:
                txn.mark_written()
                await txn.commit(checksums=[0] * len(put))
        h = hints[i]
        if h is not None:
            # Through the store's tier, which brings the policy up to date first (its
            # touches and inserts reach it after each call returns), as the daemon does.
            if h.expect_reuse_within_s is None:
                store.tiers[0].policy.end_session(h.session_id)
            else:
                keys = [make_key(ns, b) for b in hashes[: h.blocks]]
                store.tiers[0].policy.hint(keys, h.session_id, h.expect_reuse_within_s)
        # The request's touches and inserts reach the policy before the next request's
        # bookkeeping (the daemon applies them right after each answer).
        store.tiers[0].apply_deferred()
        if progress is not None and i % 500 == 0:
            progress(i)
    store.close()
    return _Counts(hits, tokens, saved)


def capacity_from_fraction(trace: Trace, fraction: float) -> int:
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"--capacity-fraction must be within (0, 1], got {fraction!r}")
    return max(1, round(fraction * trace.distinct_blocks))


def replay(
    trace: Trace,
    policy_name: str,
    capacity_blocks: int,
    hint_spec: HintSpec = HintSpec("none"),
    *,
    hint_ttl_s: float | None = None,
    hint_budget_fraction: float = DEFAULT_HINT_BUDGET_FRACTION,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay `trace` through the store with policy `policy_name` and `capacity_blocks`."""
    if capacity_blocks < 1:
        raise ConfigError(f"capacity must be at least one block, got {capacity_blocks}")
    clock = _TraceClock()
    policy = make_policy(policy_name, clock, hint_budget_fraction=hint_budget_fraction)
    hints = derive_hints(trace, hint_spec, hint_ttl_s)
    counts = asyncio.run(_drive_store(trace, policy, clock, capacity_blocks, hints, None, progress))
    return _result(trace, policy_name, str(hint_spec), capacity_blocks, counts)


def replay_opt(
    trace: Trace,
    capacity_blocks: int,
    *,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Bélády's optimum through the same store: the farthest next use is evicted first."""
    if capacity_blocks < 1:
        raise ConfigError(f"capacity must be at least one block, got {capacity_blocks}")
    nxt = next_uses(trace)
    upcoming: dict[BlockKey, float] = {}

    def before_request(i: int, ns: bytes) -> None:
        # Every block of request i is touched or inserted now; record its next use first.
        for hid, use in zip(trace.requests[i].hash_ids, nxt[i]):
            upcoming[make_key(ns, _block_hash(hid))] = use

    clock = _TraceClock()
    policy = BeladyPolicy(upcoming.__getitem__, clock)
    hints: list[Hint | None] = [None] * len(trace.requests)
    counts = asyncio.run(_drive_store(trace, policy, clock, capacity_blocks, hints, before_request, progress))
    return _result(trace, "opt", "none", capacity_blocks, counts)


def _result(trace: Trace, policy: str, hints: str, capacity: int, counts: _Counts) -> ReplayResult:
    hits, tokens, saved = counts.hits, counts.input_tokens, counts.tokens_saved
    return ReplayResult(
        policy=policy,
        hints=hints,
        capacity_blocks=capacity,
        requests=len(trace.requests),
        lookups=trace.lookups,
        hits=hits,
        hit_ratio=hits / trace.lookups if trace.lookups else 0.0,
        input_tokens=tokens,
        tokens_saved=saved,
        token_hit_ratio=saved / tokens if tokens else 0.0,
    )
