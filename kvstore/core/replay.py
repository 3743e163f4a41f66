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

Primitives: `load_trace`, `derive_hints`, `replay`, `replay_opt`, and `main` (the CLI).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvstore.core.index import make_key
from kvstore.core.policies import DEFAULT_HINT_BUDGET_FRACTION, DEFAULT_POLICY, POLICIES, make_policy
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


# -- output --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One line of a replay table: a policy, under some hints, at one capacity."""

    policy: str
    hints: HintSpec
    capacity_blocks: int


def parse_policies(text: str, default_hints: HintSpec) -> list[tuple[str, HintSpec]]:
    """``"lru,hint-arc@trace"`` -> policies with their hint mode (``@HINTS`` overrides)."""
    out: list[tuple[str, HintSpec]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, hints = part.partition("@")
        if name not in POLICIES:
            known = ", ".join(sorted(POLICIES))
            raise ConfigError(f"unknown eviction policy {name!r}; choose one of: {known}")
        out.append((name, HintSpec.parse(hints, default_hints.seed) if sep else default_hints))
    if not out:
        raise ConfigError("--policy needs at least one policy name")
    return out


def _fractions(text: str) -> list[float]:
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(f"--capacity-fraction takes numbers like 0.05 or 0.01,0.05, got {text!r}") from None


class _ProgressBar:
    """A one-line progress bar on stderr, redrawn in place."""

    def __init__(self, total_steps: int, width: int = 30) -> None:
        self.total = max(total_steps, 1)
        self.width = width
        self.done = 0

    def show(self, label: str, fraction_of_step: float = 0.0) -> None:
        frac = min((self.done + fraction_of_step) / self.total, 1.0)
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r[{bar}] {frac * 100:5.1f}% {label:<40.40}")
        sys.stderr.flush()

    def step(self) -> None:
        self.done += 1

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def _format_table(results: Sequence[ReplayResult], distinct_blocks: int) -> str:
    header = ("policy", "hints", "capacity", "blocks", "hit ratio", "token hit", "OPT")
    rows = [header]
    for r in results:
        rows.append(
            (
                r.policy,
                r.hints,
                f"{100 * r.capacity_blocks / distinct_blocks:.1f}%",
                str(r.capacity_blocks),
                f"{r.hit_ratio:.4f}",
                f"{r.token_hit_ratio:.4f}",
                "-" if r.opt_hit_ratio is None else f"{r.opt_hit_ratio:.4f}",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _plot(results: Sequence[ReplayResult], opt: dict[int, ReplayResult], distinct: int, path: str) -> None:
    # Imported here: matplotlib is an optional extra, needed only for --plot.
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvstore[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[ReplayResult]] = {}
    for r in results:
        label = r.policy if r.hints == "none" else f"{r.policy} ({r.hints} hints)"
        series.setdefault(label, []).append(r)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r.capacity_blocks)
        ax.plot([100 * r.capacity_blocks / distinct for r in rs], [r.hit_ratio for r in rs], marker="o", label=label)
    if opt:
        caps = sorted(opt)
        ax.plot([100 * c / distinct for c in caps], [opt[c].hit_ratio for c in caps], "k--", marker="x", label="Bélády OPT")
    ax.set_xscale("log")
    ticks = sorted({100 * r.capacity_blocks / distinct for r in results})
    ax.set_xticks(ticks, [f"{t:.3g}%" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("capacity (% of distinct blocks)")
    ax.set_ylabel("block hit ratio")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- command line --------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvstore replay`; shared by the CLI and `python -m kvstore.core.replay`."""
    parser.add_argument("trace", help="Mooncake-format JSONL trace")
    cap = parser.add_mutually_exclusive_group()
    cap.add_argument(
        "--capacity-fraction",
        help="tier capacity as a fraction of the trace's distinct blocks; a comma list "
        "replays each (default 0.05, or 0.01,0.02,0.05,0.1,0.25,0.5 with --plot)",
    )
    cap.add_argument("--capacity-blocks", type=int, help="tier capacity in blocks")
    parser.add_argument(
        "--policy",
        help=f"policy name, or a comma list; NAME@HINTS overrides --hints for one entry "
        f"(default {DEFAULT_POLICY}, or lru,arc,s3fifo,{DEFAULT_POLICY} with --plot)",
    )
    parser.add_argument("--hints", default="none", help="none | trace | noisy:P (default none)")
    parser.add_argument(
        "--hint-ttl-s",
        type=float,
        help="fixed time to live for trace hints (default: the true gap plus a margin)",
    )
    parser.add_argument(
        "--hint-budget-fraction",
        type=float,
        default=DEFAULT_HINT_BUDGET_FRACTION,
        help=f"most of a tier hints may protect (default {DEFAULT_HINT_BUDGET_FRACTION})",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed for noisy hints")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--opt", action="store_true", help="also compute Bélády's optimum")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.png", help="draw hit ratio against capacity")


def run(args: argparse.Namespace) -> int:
    """Run the replays `args` ask for and print their results; the exit status."""
    trace = load_trace(args.trace, args.limit)
    hint_spec = HintSpec.parse(args.hints, args.seed)
    plot = args.plot is not None
    default_policies = f"lru,arc,s3fifo,{DEFAULT_POLICY}" if plot else DEFAULT_POLICY
    policies = parse_policies(args.policy or default_policies, hint_spec)
    if args.capacity_blocks is not None:
        if args.capacity_blocks < 1:
            raise ConfigError(f"--capacity-blocks must be at least 1, got {args.capacity_blocks}")
        capacities = [args.capacity_blocks]
    else:
        default_fracs = "0.01,0.02,0.05,0.1,0.25,0.5" if plot else "0.05"
        capacities = [capacity_from_fraction(trace, f) for f in _fractions(args.capacity_fraction or default_fracs)]
    capacities = list(dict.fromkeys(capacities))
    with_opt = args.opt or plot
    steps = len(policies) * len(capacities) + (len(capacities) if with_opt else 0)
    bar = _ProgressBar(steps) if plot else None
    n = len(trace.requests)

    def progress_for(label: str) -> Callable[[int], None] | None:
        if bar is None:
            return None
        return lambda i: bar.show(label, i / n)

    opt: dict[int, ReplayResult] = {}
    if with_opt:
        for c in capacities:
            opt[c] = replay_opt(trace, c, progress=progress_for(f"opt @ {c} blocks"))
            if bar is not None:
                bar.step()
    results: list[ReplayResult] = []
    for name, hints in policies:
        for c in capacities:
            r = replay(
                trace,
                name,
                c,
                hints,
                hint_ttl_s=args.hint_ttl_s,
                hint_budget_fraction=args.hint_budget_fraction,
                progress=progress_for(f"{name} ({hints}) @ {c} blocks"),
            )
            if c in opt:
                r = replace(r, opt_hit_ratio=opt[c].hit_ratio, opt_token_hit_ratio=opt[c].token_hit_ratio)
            results.append(r)
            logger.debug("replayed %s hints=%s capacity=%d: %.4f", name, hints, c, r.hit_ratio)
            if bar is not None:
                bar.step()
    if bar is not None:
        bar.show("done")
        bar.close()
    if plot:
        _plot(results, opt, trace.distinct_blocks, args.plot)
    if args.json:
        objs = [asdict(r) for r in results]
        print(json.dumps(objs[0] if len(objs) == 1 else objs, indent=2))
    else:
        print(
            f"{args.trace}: {len(trace.requests)} requests, {trace.lookups} block lookups, "
            f"{trace.distinct_blocks} distinct blocks"
        )
        print(_format_table(results, trace.distinct_blocks))
        if plot:
            print(f"plot written to {args.plot}")
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstore replay",
        description="Replay a Mooncake-format trace through the eviction policies.",
    )
    add_arguments(parser)
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        return run(args)
    except (ConfigError, InvalidArgument) as exc:
        print(f"kvstore replay: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
