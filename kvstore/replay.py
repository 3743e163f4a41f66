"""Trace replay: hit ratios of eviction policies on a recorded workload, next to OPT.

Reads Mooncake-format JSONL (one request a line: `timestamp` in ms, `input_length`,
`output_length`, `hash_ids`; optional `session_id`, `turn`, `type`, `block_size`) and
drives the policy code the daemon runs, one tier of `capacity_blocks` blocks:

* a request's hit is the longest prefix of its blocks that is cached at its arrival;
* then every block of the request is touched (cached) or inserted (not cached), tail
  block first, so that a chain's head is the most recently used part of it; each insert
  into a full tier evicts the policy's victim first-come first-served;
* time-based logic (hint deadlines) runs on the trace's clock, not the wall clock.

Hints: ``none``; ``trace`` derives "this request's prefix is extended by a later one"
from the trace itself (a semi-oracle: it knows whether and when the session returns),
and sends it as a hint with that gap plus a margin as the time to live, or ends the
session when it does not return; ``noisy:P`` flips a seeded fraction P of those.

`--opt` also replays Bélády's offline optimum on the same trace and capacity.

Primitives: `load_trace`, `derive_hints`, `replay`, `replay_opt`, and `main` (the CLI).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.policies import DEFAULT_HINT_BUDGET_FRACTION, DEFAULT_POLICY, POLICIES, make_policy
from kvstore.policies.base import BlockKey, EvictionPolicy
from kvstore.policies.opt import NEVER, BeladyPolicy

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
    with open(path, encoding="utf-8") as f:
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


def block_keys(trace: Trace) -> list[list[BlockKey]]:
    """Each request's block keys; one bytes object per distinct hash id."""
    memo: dict[int, BlockKey] = {}
    out: list[list[BlockKey]] = []
    for req in trace.requests:
        keys = []
        for h in req.hash_ids:
            key = memo.get(h)
            if key is None:
                key = memo[h] = h.to_bytes(16, "big", signed=True)
            keys.append(key)
        out.append(keys)
    return out


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
        if reqs[j].session_id is None:
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


def _always(_key: BlockKey) -> bool:
    return True


def _run(
    trace: Trace,
    keys: Sequence[Sequence[BlockKey]],
    policy: EvictionPolicy,
    clock: _TraceClock,
    capacity_blocks: int,
    hints: Sequence[Hint | None],
    before_request: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, int, int]:
    """(block hits, input tokens, prefill tokens saved) over the whole trace."""
    resident: set[BlockKey] = set()
    hits = tokens = saved = 0
    insert, touch, remove, victim = policy.insert, policy.touch, policy.remove, policy.victim
    for i, req in enumerate(trace.requests):
        clock.now = req.timestamp_s
        if before_request is not None:
            before_request(i)
        chain = keys[i]
        hit = 0
        for key in chain:
            if key not in resident:
                break
            hit += 1
        hits += hit
        tokens += req.input_length
        saved += min(hit * req.block_size_tokens, req.input_length)
        for pos in range(len(chain) - 1, -1, -1):
            key = chain[pos]
            if key in resident:
                touch(key)
                continue
            insert(key, chain[pos - 1] if pos else None)
            resident.add(key)
            if len(resident) > capacity_blocks:
                out = victim(_always)
                assert out is not None, "a policy tracking blocks must name a victim"
                remove(out)
                resident.discard(out)
        h = hints[i]
        if h is not None:
            if h.expect_reuse_within_s is None:
                policy.end_session(h.session_id)
            else:
                policy.hint(chain[: h.blocks], h.session_id, h.expect_reuse_within_s)
        if progress is not None and i % 1000 == 0:
            progress(i)
    return hits, tokens, saved


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
    keys: Sequence[Sequence[BlockKey]] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay `trace` through policy `policy_name` on a tier of `capacity_blocks` blocks."""
    if capacity_blocks < 1:
        raise ConfigError(f"capacity must be at least one block, got {capacity_blocks}")
    clock = _TraceClock()
    policy = make_policy(policy_name, clock, hint_budget_fraction=hint_budget_fraction)
    hints = derive_hints(trace, hint_spec, hint_ttl_s)
    keys = keys if keys is not None else block_keys(trace)
    hits, tokens, saved = _run(trace, keys, policy, clock, capacity_blocks, hints, progress=progress)
    return _result(trace, policy_name, str(hint_spec), capacity_blocks, hits, tokens, saved)


def replay_opt(
    trace: Trace,
    capacity_blocks: int,
    *,
    keys: Sequence[Sequence[BlockKey]] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Bélády's optimum on the same loop: the farthest next use is evicted first."""
    keys = keys if keys is not None else block_keys(trace)
    nxt = next_uses(trace)
    upcoming: dict[BlockKey, float] = {}

    def before_request(i: int) -> None:
        # Every block of request i is touched or inserted now; record its next use first.
        for key, use in zip(keys[i], nxt[i]):
            upcoming[key] = use

    clock = _TraceClock()
    policy = BeladyPolicy(upcoming.__getitem__, clock)
    hints: list[Hint | None] = [None] * len(trace.requests)
    hits, tokens, saved = _run(trace, keys, policy, clock, capacity_blocks, hints, before_request, progress)
    return _result(trace, "opt", "none", capacity_blocks, hits, tokens, saved)


def _result(
    trace: Trace, policy: str, hints: str, capacity: int, hits: int, tokens: int, saved: int
) -> ReplayResult:
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
