"""`kvstore replay`: the command line over the core's trace replay (kvstore.core.replay).

Flags, the policy list (`NAME@HINTS`), a progress bar, the table or JSON, and the plot
(matplotlib, an optional extra, imported only for `--plot`). The replays themselves run
the daemon's own store and policies; see kvstore.core.replay.

Primitives: `add_arguments`, `run`, `main`, `parse_policies`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from kvstore.errors import ConfigError, InvalidArgument

if TYPE_CHECKING:
    from kvstore.core.replay import HintSpec, ReplayResult

logger = logging.getLogger(__name__)


# -- output --------------------------------------------------------------------------


def parse_policies(text: str, default_hints: HintSpec) -> list[tuple[str, HintSpec]]:
    """``"lru,hint-arc@trace"`` -> policies with their hint mode (``@HINTS`` overrides)."""
    from kvstore.core.policies import POLICIES
    from kvstore.core.replay import HintSpec

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
    """The flags of `kvstore replay`; shared by the CLI and `python -m kvstore.cli.replay`."""
    from kvstore.core.policies import DEFAULT_HINT_BUDGET_FRACTION, DEFAULT_POLICY
    from kvstore.core.replay import DEFAULT_SEED

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
    from kvstore.core.policies import DEFAULT_POLICY
    from kvstore.core.replay import HintSpec, capacity_from_fraction, load_trace, replay, replay_opt

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
