"""`kvstore top`: a live view of a daemon, refreshed every `--interval` seconds.

Each refresh polls `Stats` and `ListNamespaces` and renders tier fill bars, the block
hit ratio (overall and over the last interval), throughput in and out, operation rates
and the largest namespaces. Rates are differences between two samples, so the first
frame shows totals and zero rates.

Works in a plain terminal: ANSI "home + clear" between frames (none with TERM=dumb)
and ASCII bars, no full-screen library. When stdin is a terminal it is switched to cbreak mode (restored
on exit) so a single `q` quits; Ctrl-C quits too. Without a terminal, frames are simply
printed one after another (`--iterations` bounds them), and `--json` prints one JSON
sample a line.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvstore.cli.common import EXIT_OK, message_to_record, open_admin
from kvstore.units import human_bytes

BAR_WIDTH = 30
TOP_NAMESPACES = 5
CLEAR = "\x1b[H\x1b[2J"


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    stats: dict[str, Any]
    namespaces: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class TierRates:
    promoted_s: float  # blocks copied up into the tier, per second
    demoted_s: float  # blocks moved down out of it, per second


@dataclass(frozen=True, slots=True)
class Rates:
    lookups_s: float
    puts_s: float
    fetches_s: float
    in_bytes_s: float
    out_bytes_s: float
    interval_hit_ratio: float | None  # None: no block was looked up in the interval
    tiers: dict[str, TierRates]  # only for daemons that count migrations


def _tier_rates(prev: Sample, cur: Sample, dt: float) -> dict[str, TierRates]:
    before = {t["name"]: t for t in prev.stats["tiers"]}
    out = {}
    for t in cur.stats["tiers"]:
        a = before.get(t["name"])
        if a is None or "promotions" not in t or "demotions" not in t:
            continue
        out[t["name"]] = TierRates(max(0, t["promotions"] - a.get("promotions", 0)) / dt,
                                   max(0, t["demotions"] - a.get("demotions", 0)) / dt)
    return out


def rates(prev: Sample | None, cur: Sample) -> Rates:
    if prev is None or cur.at <= prev.at:
        return Rates(0.0, 0.0, 0.0, 0.0, 0.0, None, {})
    dt = cur.at - prev.at
    a, b = prev.stats["counters"], cur.stats["counters"]

    def per_s(key: str) -> float:
        return max(0, b[key] - a[key]) / dt

    looked = b["lookup_blocks"] - a["lookup_blocks"]
    hit = b["hit_blocks"] - a["hit_blocks"]
    return Rates(per_s("lookups"), per_s("puts"), per_s("fetches"), per_s("bytes_in"), per_s("bytes_out"),
                 hit / looked if looked > 0 else None, _tier_rates(prev, cur, dt))


def bar(used: int, capacity: int, width: int = BAR_WIDTH) -> str:
    filled = min(width, round(width * used / capacity)) if capacity else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"


def render(target: str, cur: Sample, r: Rates, error: str = "", hint: str = "(q quits)") -> str:
    s, c = cur.stats, cur.stats["counters"]
    lines = [f"kvstore top - {target} - up {s['uptime_s']:.0f}s - v{s['version']} - "
             f"{time.strftime('%H:%M:%S')}   {hint}".rstrip(), ""]
    # Migration columns appear only for daemons that count promotions and demotions.
    migrating = any("promotions" in t for t in s["tiers"])
    lines.append(f"{'TIER':<8}{'FILL':<{BAR_WIDTH + 2}}{'USE%':>7}  {'USED / CAPACITY':>23}  {'BLOCKS':>8}  "
                 f"{'HIT%':>6}" + (f"  {'UP/s':>7}  {'DOWN/s':>7}" if migrating else ""))
    for t in s["tiers"]:
        if not t["present"]:
            lines.append(f"{t['name']:<8}absent: {t['reason']}")
            continue
        cap, used = t["capacity_bytes"], t["used_bytes"]
        lookups = t["hits"] + t["misses"]
        hit = f"{100 * t['hits'] / lookups:.1f}" if lookups else "-"
        pct = 100 * used / cap if cap else 0.0
        line = (f"{t['name']:<8}{bar(used, cap):<{BAR_WIDTH + 2}}{pct:>6.1f}%  "
                f"{human_bytes(used) + ' / ' + human_bytes(cap):>23}  {t['blocks']:>8}  {hit:>6}")
        if migrating:
            tr = r.tiers.get(t["name"])
            line += f"  {tr.promoted_s:>7.1f}  {tr.demoted_s:>7.1f}" if tr else f"  {'-':>7}  {'-':>7}"
        lines.append(line)
    overall = c["hit_blocks"] / c["lookup_blocks"] if c["lookup_blocks"] else 0.0
    recent = "-" if r.interval_hit_ratio is None else f"{r.interval_hit_ratio:.3f}"
    lines += [
        "",
        f"block hit ratio {overall:.3f} (last interval {recent})   lookups/s {r.lookups_s:.1f}   "
        f"puts/s {r.puts_s:.1f}   fetches/s {r.fetches_s:.1f}",
        f"throughput in {human_bytes(int(r.in_bytes_s))}/s   out {human_bytes(int(r.out_bytes_s))}/s   "
        f"evictions {c['evictions']}   checksum failures {c['checksum_failures']}   leases {c['leases_active']}",
        "",
        f"top namespaces by size ({len(cur.namespaces)} in all)",
        f"{'NAMESPACE':<34}{'MODEL':<28}{'BLOCKS':>8}  {'SIZE':>10}  {'HIT%':>6}",
    ]
    for ns in sorted(cur.namespaces, key=lambda n: -n["used_bytes"])[:TOP_NAMESPACES]:
        looked = ns.get("lookup_blocks", 0)
        hit_pct = f"{100 * ns.get('hit_blocks', 0) / looked:.1f}" if looked else "-"
        lines.append(f"{ns['namespace_id']:<34}{ns['layout']['model'][:27]:<28}{ns['blocks']:>8}  "
                     f"{human_bytes(ns['used_bytes']):>10}  {hit_pct:>6}")
    if error:
        lines += ["", f"last refresh failed: {error}"]
    return "\n".join(lines)


def take_sample(admin: Any) -> Sample:

    stats = message_to_record(admin.stats())
    namespaces = [message_to_record(n) for n in admin.list_namespaces()]
    return Sample(time.monotonic(), stats, namespaces)


class KeyReader:
    """Single keys from a terminal stdin in cbreak mode; inert when stdin is not a terminal."""

    def __init__(self) -> None:
        self._fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else -1
        self._saved: Any = None

    @property
    def interactive(self) -> bool:
        return self._fd >= 0

    def __enter__(self) -> KeyReader:
        if self._fd >= 0:
            import termios
            import tty

            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def wait_for_quit(self, timeout_s: float) -> bool:
        """Sleep up to `timeout_s`; True if q was pressed meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._fd < 0:
                time.sleep(left)
                return False
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                key = os.read(self._fd, 1)
                if key in (b"q", b"Q", b""):
                    return True


def cmd_top(args: argparse.Namespace) -> int:
    from kvstore.errors import KVStoreError

    interval = max(0.1, args.interval)
    # A terminal that cannot move the cursor (TERM=dumb) gets frames one after another.
    clear = sys.stdout.isatty() and not args.json and os.environ.get("TERM", "") != "dumb"
    prev: Sample | None = None
    shown = 0
    with open_admin(args) as admin, KeyReader() as keys:
        cur = take_sample(admin)  # fails (exit 1) if the daemon cannot be reached at all
        error = ""
        try:
            while True:
                r = rates(prev, cur)
                if args.json:
                    print(json.dumps({"stats": cur.stats, "namespaces": cur.namespaces, "rates": {
                        "lookups_s": r.lookups_s, "puts_s": r.puts_s, "fetches_s": r.fetches_s,
                        "in_bytes_s": r.in_bytes_s, "out_bytes_s": r.out_bytes_s,
                        "interval_hit_ratio": r.interval_hit_ratio,
                        "tiers": {name: {"promoted_s": tr.promoted_s, "demoted_s": tr.demoted_s}
                                  for name, tr in r.tiers.items()}}}), flush=True)
                else:
                    frame = render(admin.target, cur, r, error, "(q quits)" if keys.interactive else "")
                    sys.stdout.write((CLEAR if clear else "") + frame + "\n" + ("" if clear else "\n"))
                    sys.stdout.flush()
                shown += 1
                if args.iterations and shown >= args.iterations:
                    break
                if keys.wait_for_quit(interval):
                    break
                try:
                    prev, cur = cur, take_sample(admin)
                    error = ""
                except KVStoreError as exc:
                    # Keep the last numbers on screen and say why; the daemon may be restarting.
                    error = str(exc)
                    prev = None
        except KeyboardInterrupt:
            pass
    return EXIT_OK
