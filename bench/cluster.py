"""Cluster benchmark, part 1: what a pool is worth.

Replays a Mooncake-format trace (default: the shared conversation trace) through N
engines, each with its own daemon, and compares three set-ups of the same total capacity
(`--capacity-fraction` of the trace's distinct blocks, split evenly over the nodes):

* **islands**: each node alone (today's sidecar daemon): a request hits only what its
  own node holds;
* **cluster**: the pool of ARCHITECTURE.md section 8 through the real placement code
  (kvstore.cluster.placement: rendezvous owners of placement units, lead-in units, R
  owners): the node looks in its own stores unit by unit, and asks the owners of the
  units it lacks (one call per owner); a remote hit is copied into the local node;
  blocks the engine computes are put locally and forwarded to their units' owners. A
  node keeps copies of units it does not own in a replica budget, `--replica-budget`
  of its capacity with its own eviction, so copies cannot crowd out the units it owns;
  the default, 0, keeps a copy only while it is served (one block of room: the next
  copy evicts it). The variant "copies share capacity" lets copies compete with owned
  blocks under one policy instead, as the plainest reading of section 8 would;
* **shared**: one cache holding the whole capacity, seen by every request (the upper
  bound a pool can approach).

Every node is a real `Store` (index, put transactions, eviction loop, policy) over a
metadata-only `ReplayTier`, driven as kvstore/core/replay.py drives one: a lookup touches
the hit prefix, a put makes room through the store's own eviction. Requests reach nodes
either at random (seeded) or session-sticky. The conversation trace carries no session
id: a request's session is its first two blocks (`hash_ids[:2]`). Every request starts
with block 0 (a shared system prompt), and the chained hashes make the second block the
same for every turn of one conversation, so that pair names the conversation; a request
of a single block is a session of its own. Sticky routing sends a session to node
``xxh3_64(session) mod N``.

Reported per cell: block hit ratio (hit blocks / looked-up blocks), token hit ratio,
the cluster's local and remote hits, remote bytes moved per hit block (each remote hit
block is copied once to the requesting node), forwarded put bytes per request, and the
calls to owners per request (one per owner asked), and the busiest node's owner calls
over the mean (balance). Bytes use
`--block-bytes`, by default 64 MiB: one 512-token block of Llama-3.1-8B in fp16
(2 x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token).

Parts 2 and 3 run real daemons, each a process of its own, on this host
(bench/cluster_daemons.py): 2, the latency of a lookup of a 1,000-block chain of which
half is on another node, next to the same lookup once the chain is local (cluster on)
and on a single daemon (cluster off), in the same run; 3, a failover: three daemons on
etcd, eight clients, one daemon killed with SIGKILL part-way, the hit ratio and errors
per second, wrong bytes, and how long until the dead node had left the views.

Results: bench/results/cluster.json (`results`: one row per trace, nodes, routing,
setup, policy; `remote_lookup_p50_us`, `remote_lookup_p99_us`, `local_lookup_p99_us`
and `remote_lookup` with the rest of part 2; `failover`), bench/results/cluster.txt
(the tables) and bench/results/cluster.png. Part 1 is CPU only, its cells run in
`--jobs` processes. `make bench-cluster` runs everything (under 10 minutes on two
cores); `--smoke` runs a reduced version of each part in about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sys
import textwrap
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from kvstore.cluster.placement import DEFAULT_UNIT_BLOCKS, Placement  # noqa: E402
from kvstore.core.policies import make_policy  # noqa: E402
from kvstore.core.replay import ReplayTier, Trace, capacity_from_fraction, load_trace  # noqa: E402
from kvstore.core.store import Store, StoreTier  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore.hashing import HASH_BYTES  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402

DEFAULT_TRACE = ROOT / ".." / "shared" / "traces" / "conversation_trace.jsonl"
DEFAULT_BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * 512  # Llama-3.1-8B, fp16, 512 tokens: 64 MiB
BLOCK_BYTES_MODEL = "Llama-3.1-8B fp16, 512-token block (128 KiB per token)"
RESULTS = HERE / "results"
SETUPS = ("islands", "cluster", "shared")
DEFAULT_REPLICA_BUDGET = 0.0


@dataclass(frozen=True, slots=True)
class Cell:
    setup: str
    nodes: int
    routing: str
    policy: str
    unit_blocks: int = DEFAULT_UNIT_BLOCKS
    lead_in: bool = True
    replicas: int = 1
    replica_fraction: float | None = None  # None: copies share the node's capacity with owned blocks
    label: str = ""  # a variant's name; "" for the main matrix


@dataclass(slots=True)
class Counts:
    lookups: int = 0
    hits: int = 0
    local_hits: int = 0
    remote_hits: int = 0
    input_tokens: int = 0
    tokens_saved: int = 0
    forwarded_blocks: int = 0
    remote_lookups: int = 0


def _layout(block_size_tokens: int) -> KVLayout:
    return KVLayout(model="kvstore-cluster-bench", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=1,
                    block_size_tokens=block_size_tokens)


class Node:
    """One daemon's store over a metadata-only tier of `capacity_blocks`."""

    def __init__(self, capacity_blocks: int, policy: str, clock: Any, layout: KVLayout) -> None:
        self.capacity_blocks = capacity_blocks
        tier = ReplayTier(capacity_blocks, layout.bytes_per_block)
        self.store = Store([StoreTier(tier, make_policy(policy, clock))], clock=clock)
        self.ns = self.store.register(layout)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        return self.store.lookup(self.ns, hashes).num_blocks

    async def put(self, hashes: Sequence[bytes]) -> None:
        put = list(hashes[: self.capacity_blocks])  # longer than the tier: keep the head
        if not put:
            return
        async with self.store.begin_put(self.ns, put) as txn:
            txn.mark_written()
            await txn.commit(checksums=[0] * len(put))

    def settle(self) -> None:
        # The request's touches and inserts reach the policy before the next request.
        self.store.tiers[0].apply_deferred()

    def close(self) -> None:
        self.store.close()


class _Clock:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def session_of(index: int, hash_ids: Sequence[int]) -> bytes:
    """A request's session: its first two blocks (see the module docstring)."""
    if len(hash_ids) >= 2:
        return f"{hash_ids[0]}:{hash_ids[1]}".encode()
    return f"single:{index}".encode()


def route(trace: Trace, nodes: int, routing: str, seed: int) -> list[int]:
    if routing == "random":
        rng = random.Random(seed)
        return [rng.randrange(nodes) for _ in trace.requests]
    if routing == "sticky":
        return [xxhash.xxh3_64_intdigest(session_of(i, r.hash_ids)) % nodes for i, r in enumerate(trace.requests)]
    raise SystemExit(f"unknown routing {routing!r}: use random or sticky")


class Daemon:
    """One node of the pool: a store for what it owns and, with a replica budget, a
    separate one (a fraction of the same capacity) for copies of units it does not own."""

    def __init__(self, capacity_blocks: int, policy: str, clock: Any, layout: KVLayout,
                 replica_fraction: float | None) -> None:
        if replica_fraction is None:
            self.main = Node(capacity_blocks, policy, clock, layout)
            self.replicas = self.main
        else:
            room = max(1, round(capacity_blocks * replica_fraction))
            self.main = Node(max(1, capacity_blocks - room), policy, clock, layout)
            self.replicas = Node(room, policy, clock, layout)
        self.owner_lookups = 0

    def store_for(self, owned: bool) -> Node:
        return self.main if owned else self.replicas

    def settle(self) -> None:
        self.main.settle()
        if self.replicas is not self.main:
            self.replicas.settle()

    def close(self) -> None:
        self.main.close()
        if self.replicas is not self.main:
            self.replicas.close()


async def _drive(trace: Trace, cell: Cell, capacity_total: int, seed: int) -> tuple[Counts, list[int]]:
    clock = _Clock()
    layout = _layout(trace.requests[0].block_size_tokens)
    n = 1 if cell.setup == "shared" else cell.nodes
    per_node = max(1, capacity_total // n)
    cluster = cell.setup == "cluster"
    daemons = [Daemon(per_node, cell.policy, clock, layout, cell.replica_fraction if cluster else None)
               for _ in range(n)]
    ids = [f"node-{i}" for i in range(n)]
    index_of = {nid: i for i, nid in enumerate(ids)}
    placement = Placement(ids, unit_blocks=cell.unit_blocks, lead_in=cell.lead_in, replicas=cell.replicas)
    targets = [0] * len(trace.requests) if n == 1 else route(trace, n, cell.routing, seed)
    c = Counts()
    memo: dict[int, bytes] = {}
    for i, req in enumerate(trace.requests):
        clock.now = req.timestamp_s
        hashes = []
        for hid in req.hash_ids:
            b = memo.get(hid)
            if b is None:
                b = memo[hid] = hid.to_bytes(HASH_BYTES, "big", signed=True)
            hashes.append(b)
        if not hashes:
            continue
        here = targets[i]
        me = daemons[here]
        touched = {here}
        if not cluster:
            hit = local = me.main.lookup(hashes)
            spans = []
        else:
            # This node's own stores first, unit by unit (a unit it owns is in its main
            # store even when the prefix before it was elsewhere), then one round of calls
            # to the owners of the units it lacks: the chain goes on while some node holds
            # the rest of each unit.
            spans = placement.spans(hashes)
            owned = [ids[here] in placement.owners(sp.key) for sp in spans]
            hit = local = 0
            asked: set[int] = set()
            for k, span in enumerate(spans):
                part = hashes[span.start:span.stop]
                mine = me.store_for(owned[k]).lookup(part)
                best = mine
                if mine < len(part):
                    for owner in placement.lookup_targets(span.key):
                        j = index_of[owner]
                        if j == here:
                            continue
                        asked.add(j)
                        touched.add(j)
                        best = max(best, daemons[j].main.lookup(part))
                        if best == len(part):
                            break
                hit += best
                local += mine  # only the rest of the unit moves
                if best < len(part):
                    # The real round asks every owner past this point at once: count them.
                    for later in spans[k + 1:]:
                        asked.update(index_of[o] for o in placement.lookup_targets(later.key) if o != ids[here])
                    break
            c.remote_lookups += len(asked)
            for j in asked:
                daemons[j].owner_lookups += 1
        c.lookups += len(hashes)
        c.hits += hit
        c.local_hits += local
        c.remote_hits += hit - local
        c.input_tokens += req.input_length
        c.tokens_saved += min(hit * req.block_size_tokens, req.input_length)
        if local == len(hashes):
            pass
        elif not cluster:
            await me.main.put(hashes)
        else:
            # Local commit first (remote hits land here as replicas, computed blocks as new
            # ones), then the computed blocks go to their units' owners, one put per owner.
            mine_owned: list[bytes] = []
            mine_copies: list[bytes] = []
            forward: dict[int, list[bytes]] = {}
            for k, span in enumerate(spans):
                part = hashes[span.start:span.stop]
                (mine_owned if owned[k] else mine_copies).extend(part)
                if span.stop <= hit:
                    continue
                computed = hashes[max(span.start, hit):span.stop]
                for owner in placement.owners(span.key):
                    j = index_of[owner]
                    if j != here:
                        forward.setdefault(j, []).extend(computed)
            if me.replicas is me.main:
                await me.main.put(hashes)
            else:
                await me.main.put(mine_owned)
                await me.replicas.put(mine_copies)
            for j, blocks in forward.items():
                c.forwarded_blocks += len(blocks)
                await daemons[j].main.put(blocks)
                touched.add(j)
        for j in touched:
            daemons[j].settle()
    loads = [d.owner_lookups for d in daemons]
    for d in daemons:
        d.close()
    return c, loads


def run_cell(args: tuple[Cell, str, int | None, int, int, int]) -> dict[str, Any]:
    cell, trace_path, limit, capacity_total, block_bytes, seed = args
    trace = load_trace(trace_path, limit)
    began = time.process_time()
    c, loads = asyncio.run(_drive(trace, cell, capacity_total, seed))
    mean_load = sum(loads) / len(loads) if loads else 0.0
    return {
        "trace": Path(trace_path).stem,
        "nodes": cell.nodes,
        "routing": cell.routing,
        "setup": cell.setup,
        "policy": cell.policy,
        "variant": cell.label,
        "unit_blocks": cell.unit_blocks,
        "lead_in": cell.lead_in,
        "replicas": cell.replicas,
        "replica_budget": cell.replica_fraction,
        "hit_ratio": c.hits / c.lookups if c.lookups else 0.0,
        "token_hit_ratio": c.tokens_saved / c.input_tokens if c.input_tokens else 0.0,
        "hits": c.hits,
        "lookups": c.lookups,
        "local_hits": c.local_hits,
        "remote_hits": c.remote_hits,
        "remote_bytes_per_hit": c.remote_hits * block_bytes / c.hits if c.hits else 0.0,
        "forwarded_blocks": c.forwarded_blocks,
        "forwarded_bytes_per_request": c.forwarded_blocks * block_bytes / len(trace.requests),
        "remote_lookups_per_request": c.remote_lookups / len(trace.requests),
        "owner_load_max_over_mean": max(loads) / mean_load if mean_load else 0.0,
        "capacity_blocks_per_node": max(1, capacity_total // (1 if cell.setup == "shared" else cell.nodes)),
        "cpu_s": round(time.process_time() - began, 2),
    }


def cells_for(nodes: Sequence[int], routings: Sequence[str], policies: Sequence[str], unit_blocks: int,
              replicas: int, budget: float, variants: bool) -> list[Cell]:
    out: list[Cell] = []
    for policy in policies:
        out.append(Cell("shared", 1, "-", policy))
        for n in nodes:
            for r in routings:
                out.append(Cell("islands", n, r, policy))
                out.append(Cell("cluster", n, r, policy, unit_blocks, True, replicas, budget))
    if variants:
        # Why the rules are what they are: the largest pool, random routing, the first policy.
        n, policy = max(nodes), policies[0]
        out.append(Cell("cluster", n, "random", policy, unit_blocks, True, replicas, None, "copies share capacity"))
        out.append(Cell("cluster", n, "random", policy, unit_blocks, True, replicas, 0.10, "replica budget 10%"))
        out.append(Cell("cluster", n, "random", policy, unit_blocks, False, replicas, budget, "no lead-in"))
        for s in (1, 4, 16):
            if s != unit_blocks:
                out.append(Cell("cluster", n, "random", policy, s, True, replicas, budget, f"S={s}"))
        out.append(Cell("cluster", n, "random", policy, unit_blocks, True, 2, budget, "R=2"))
    return out


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def table(rows: list[dict[str, Any]]) -> str:
    main = [r for r in rows if not r["variant"]]
    shared = {r["policy"]: r for r in main if r["setup"] == "shared"}
    head = ("policy", "nodes", "routing", "islands", "cluster", "shared", "cluster/shared",
            "remote/hit", "fwd/request", "owner max/mean")
    lines = [head]
    keyed = {(r["policy"], r["nodes"], r["routing"], r["setup"]): r for r in main}
    for policy, s in shared.items():
        combos = sorted({(r["nodes"], r["routing"]) for r in main if r["policy"] == policy and r["setup"] != "shared"})
        for n, routing in combos:
            isl = keyed[(policy, n, routing, "islands")]
            clu = keyed[(policy, n, routing, "cluster")]
            lines.append((policy, str(n), routing, f"{isl['hit_ratio']:.4f}", f"{clu['hit_ratio']:.4f}",
                          f"{s['hit_ratio']:.4f}", f"{clu['hit_ratio'] / s['hit_ratio']:.3f}x",
                          _fmt_bytes(clu["remote_bytes_per_hit"]), _fmt_bytes(clu["forwarded_bytes_per_request"]),
                          f"{clu['owner_load_max_over_mean']:.2f}"))
    variants = [r for r in rows if r["variant"]]
    for v in variants:
        s = shared[v["policy"]]
        lines.append((v["policy"], str(v["nodes"]), v["routing"], "", f"{v['hit_ratio']:.4f}", f"{s['hit_ratio']:.4f}",
                      f"{v['hit_ratio'] / s['hit_ratio']:.3f}x", _fmt_bytes(v["remote_bytes_per_hit"]),
                      _fmt_bytes(v["forwarded_bytes_per_request"]),
                      f"{v['owner_load_max_over_mean']:.2f}  ({v['variant']})"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [r for r in rows if not r["variant"]]
    policies = list(dict.fromkeys(r["policy"] for r in main))
    fig, axes = plt.subplots(1, len(policies), figsize=(6.5 * len(policies), 4.5), squeeze=False)
    for ax, policy in zip(axes[0], policies):
        shared = next(r for r in main if r["policy"] == policy and r["setup"] == "shared")["hit_ratio"]
        combos = sorted({(r["nodes"], r["routing"]) for r in main if r["policy"] == policy and r["setup"] != "shared"})
        keyed = {(r["nodes"], r["routing"], r["setup"]): r["hit_ratio"] for r in main if r["policy"] == policy}
        xs = range(len(combos))
        width = 0.38
        for k, (setup, color) in enumerate((("islands", "#bbbbbb"), ("cluster", "#3a76c4"))):
            vals = [keyed[(n, r, setup)] for n, r in combos]
            bars = ax.bar([x + (k - 0.5) * width for x in xs], vals, width, label=setup, color=color)
            ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.axhline(shared, color="k", linestyle="--", linewidth=1, label=f"one shared cache ({shared:.3f})")
        ax.axhline(0.95 * shared, color="k", linestyle=":", linewidth=1, label="0.95 x shared")
        ax.set_xticks(list(xs), [f"{n} nodes\n{r}" for n, r in combos])
        ax.set_ylabel("block hit ratio")
        ax.set_title(f"{policy.upper()}")
        ax.set_ylim(0, shared * 1.45)
        ax.legend(fontsize="small", loc="upper center", ncol=2)
    fig.suptitle(textwrap.fill(title, 110), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    p.add_argument("--nodes", default="3,8", help="pool sizes, comma-separated (default 3,8)")
    p.add_argument("--routing", default="random,sticky", help="random and/or sticky (default both)")
    p.add_argument("--policies", default="lru,arc", help="eviction policies (default lru,arc)")
    p.add_argument("--capacity-fraction", type=float, default=0.05, help="total capacity / distinct blocks")
    p.add_argument("--unit-blocks", type=int, default=DEFAULT_UNIT_BLOCKS, help="placement unit S in blocks")
    p.add_argument("--replicas", type=int, default=1, help="owners per unit R")
    p.add_argument("--replica-budget", type=float, default=DEFAULT_REPLICA_BUDGET,
                   help="fraction of a node's capacity for copies of units it does not own (default 0: "
                   "a copy lives only while it is served)")
    p.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES, help="bytes of one block")
    p.add_argument("--no-variants", action="store_true", help="skip the unit-rule variants")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--seed", type=int, default=0, help="seed of random routing")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (default 2)")
    p.add_argument("--out", default=str(RESULTS / "cluster.json"), help="JSON results (the table and plot beside it)")
    p.add_argument("--parts", default="1,2,3", help="which parts to run (default 1,2,3)")
    p.add_argument("--smoke", action="store_true", help="a reduced run of every part (about a minute): a slice of "
                   "the trace, LRU only, no variants, fewer chains, a shorter failover")
    p.add_argument("--chains", type=int, default=400, help="part 2: 1,000-block chains looked up (default 400)")
    p.add_argument("--failover-s", type=float, default=30.0, help="part 3: seconds of load (the kill at a third)")
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if args.smoke:
        args.limit = args.limit or 600
        args.policies = "lru"
        args.no_variants = True
        args.chains = min(args.chains, 40)
        args.failover_s = min(args.failover_s, 9.0)
    if not Path(args.trace).exists():
        print(f"bench/cluster.py: no trace at {args.trace}; pass the path of a Mooncake JSONL trace "
              "(make bench-cluster CLUSTER_TRACE=PATH)", file=sys.stderr)
        return 2
    trace = None
    if "1" in parts:
        # Read (and checked) before the daemons' parts, which take minutes.
        try:
            trace = load_trace(args.trace, args.limit)
        except InvalidArgument as exc:
            print(f"bench/cluster.py: {exc}", file=sys.stderr)
            return 2
    extra: dict[str, Any] = {}
    if "2" in parts:
        from cluster_daemons import remote_lookup

        print(f"part 2: remote lookups of {args.chains} chains of 1,000 blocks", flush=True)
        rl = remote_lookup(args.chains, unit_blocks=args.unit_blocks)
        extra.update({"remote_lookup_p50_us": rl["remote_lookup_p50_us"],
                      "remote_lookup_p99_us": rl["remote_lookup_p99_us"],
                      "local_lookup_p99_us": rl["local_lookup_p99_us"], "remote_lookup": rl})
    if "3" in parts:
        from cluster_daemons import failover

        print(f"part 3: failover, {args.failover_s:g} s of load, kill -9 at {args.failover_s / 3:.1f} s", flush=True)
        extra["failover"] = failover(args.failover_s, args.failover_s / 3, unit_blocks=args.unit_blocks)
    if "1" not in parts:
        return _write_daemon_parts(Path(args.out), extra)
    assert trace is not None
    capacity = capacity_from_fraction(trace, args.capacity_fraction)
    nodes = [int(x) for x in args.nodes.split(",") if x]
    cells = cells_for(nodes, [r for r in args.routing.split(",") if r], [q for q in args.policies.split(",") if q],
                      args.unit_blocks, args.replicas, args.replica_budget, not args.no_variants)
    print(f"{args.trace}: {len(trace.requests)} requests, {trace.lookups} block lookups, {trace.distinct_blocks} "
          f"distinct blocks; total capacity {capacity} blocks ({100 * args.capacity_fraction:g}%); "
          f"{len(cells)} cells on {args.jobs} processes", flush=True)
    began = time.monotonic()
    jobs = [(cell, args.trace, args.limit, capacity, args.block_bytes, args.seed) for cell in cells]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows = list(pool.map(run_cell, jobs))
    else:
        rows = [run_cell(j) for j in jobs]
    wall_s = time.monotonic() - began
    report = table(rows)
    meta = {
        "trace": str(Path(args.trace).name),
        "requests": len(trace.requests),
        "lookups": trace.lookups,
        "distinct_blocks": trace.distinct_blocks,
        "capacity_fraction": args.capacity_fraction,
        "capacity_blocks_total": capacity,
        "block_bytes": args.block_bytes,
        "block_bytes_model": BLOCK_BYTES_MODEL if args.block_bytes == DEFAULT_BLOCK_BYTES else "",
        "unit_blocks": args.unit_blocks,
        "replicas": args.replicas,
        "replica_budget": args.replica_budget,
        "session_rule": "hash_ids[:2] (a single-block request is a session of its own)",
        "seed": args.seed,
        "wall_s": round(wall_s, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "smoke": args.smoke, "results": rows, **extra}, indent=2) + "\n")
    header = (f"{meta['trace']}: {meta['requests']} requests, {meta['distinct_blocks']} distinct blocks; "
              f"{100 * args.capacity_fraction:g}% capacity ({capacity} blocks in all); S={args.unit_blocks}, "
              f"R={args.replicas}, replica budget {100 * args.replica_budget:g}%; "
              f"bytes per block {_fmt_bytes(args.block_bytes)} ({meta['block_bytes_model'] or 'given'})")
    daemon_report = daemon_parts_text(extra)
    out.with_suffix(".txt").write_text(header + "\n" + report + "\n" + daemon_report)
    plot(rows, out.with_suffix(".png"), header)
    print(header)
    print(report)
    print(daemon_report, end="")
    print(f"results: {out}, {out.with_suffix('.txt')}, {out.with_suffix('.png')} ({wall_s:.0f} s)")
    return 0



def daemon_parts_text(extra: dict[str, Any]) -> str:
    """Parts 2 and 3 as text, for people."""
    lines = []
    rl = extra.get("remote_lookup")
    if rl:
        lines += [
            "",
            f"remote lookup: {rl['chains']} chains of {rl['chain_blocks']} blocks in {rl['namespaces']} namespaces, "
            f"{rl['remote_share_mean']:.0%} of each on the other node, deadline {rl['lookup_deadline_ms']:g} ms "
            f"({rl['complete_answers']} complete answers, {rl['wrong_blocks']} wrong blocks)",
            "  A and B in two network namespaces joined by a veth pair" if rl.get("link") == "veth" else
            f"  A and B on loopback ({rl.get('link_note') or 'one network namespace'})",
            f"  remote (cluster on, half elsewhere) p50 {rl['remote_lookup_p50_us']:.0f} us  "
            f"p99 {rl['remote_lookup_p99_us']:.0f} us",
            f"  local  (cluster on, chain here)     p50 {rl['local_lookup_p50_us']:.0f} us  "
            f"p99 {rl['local_lookup_p99_us']:.0f} us",
            f"  single (cluster off)                p50 {rl['single_node_lookup_p50_us']:.0f} us  "
            f"p99 {rl['single_node_lookup_p99_us']:.0f} us",
            f"  single, a second one (cluster off)  p50 {rl['single_node_2_lookup_p50_us']:.0f} us  "
            f"p99 {rl['single_node_2_lookup_p99_us']:.0f} us",
            f"  bare round trip, A's link to B      p50 {rl['round_trip_p50_us']:.0f} us  "
            f"p99 {rl['round_trip_p99_us']:.0f} us  ({rl['round_trip_request_bytes'] >> 10} KiB asked, 16 B answered)",
            f"  local p99 / single p99 {rl['local_vs_single_p99_ratio']:.2f}x; the two single nodes' p99 differ "
            f"{rl['single_nodes_p99_ratio']:.2f}x in the same run",
        ]
        if "steal_pct" in rl:
            lines.append(f"  CPU time the hypervisor took meanwhile (steal): {rl['steal_pct']:.1f}%")
        if "remote_fetch_p50_us" in rl:
            lines += [
                f"  fetch after the remote lookup (A)  p50 {rl['remote_fetch_p50_us'] / 1e3:.1f} ms  "
                f"p99 {rl['remote_fetch_p99_us'] / 1e3:.1f} ms  (waits for the copy of B's half)",
                f"  the same fetch, cluster off (S)     p50 {rl['single_fetch_p50_us'] / 1e3:.1f} ms  "
                f"p99 {rl['single_fetch_p99_us'] / 1e3:.1f} ms",
            ]
        if "owner_put_p50_us" in rl:
            lines += [
                f"  put waiting for the owners (on B)  p50 {rl['owner_put_p50_us'] / 1e3:.1f} ms  "
                f"p99 {rl['owner_put_p99_us'] / 1e3:.1f} ms",
                f"  the same put, cluster off (on S)    p50 {rl['single_put_p50_us'] / 1e3:.1f} ms  "
                f"p99 {rl['single_put_p99_us'] / 1e3:.1f} ms",
            ]
        gc_during = rl.get("gc_during")
        if gc_during:
            lines.append("  garbage collections while the chains ran (gen0/gen1/gen2, pause ms):  " + "; ".join(
                f"{name} {g['gen0_collections']:.0f}/{g['gen1_collections']:.0f}/{g['gen2_collections']:.0f}, "
                f"{g['pause_ms']:.1f} ms" for name, g in gc_during.items()))
    fo = extra.get("failover")
    if fo:
        lines += ["", f"failover: {fo['clients']} clients, kill -9 of one of 3 nodes at {fo['killed_at_s']:.1f} s: "
                  f"{fo['wrong_bytes']} wrong bytes, {fo['client_errors']} client errors, left the views after "
                  f"{fo['view_update_s']} s (lease TTL {fo['lease_ttl_s']} s)",
                  "  second | lookups | hit ratio | errors"]
        lines += [f"  {r['t']:>6} | {r['lookups']:>7} | {r['hit_ratio']:>9.3f} | {r['errors']}" for r in fo["per_second"]]
    return "\n".join(lines) + ("\n" if lines else "")


def _write_daemon_parts(out: Path, extra: dict[str, Any]) -> int:
    """Parts 2 and 3 alone: merged into an existing results file, else one of their own."""
    out.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(out.read_text()) if out.exists() else {"results": []}
    data.update(extra)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(daemon_parts_text(extra), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
