"""Operator commands of the `kvstore` CLI: health, info, stats, ls, evict, flush, pin,
unpin, config, events, export, import (and `top`, in `kvstore.cli.top`).

Every command prints a table for people (rich, plain when not a terminal) or, with
`--json`, one JSON document for machines; exit codes follow `kvstore.cli.common` (0 success,
1 the daemon refused or cannot be reached, 2 a wrong command line). `register` adds the
commands to the CLI's parser; the functions here only format and translate.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.cli.common import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    ClientCommand,
    add_client_options,
    emit,
    message_to_record,
    open_admin,
    open_client,
    seconds,
)
from kvstore.units import human_bytes, parse_size

ABSENT = "-"


# ------------------------------------------------------------------ rendering


def render_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], *, width: int | None = None) -> str:
    """A rich table as text; plain (no colour, ASCII-safe box) when not writing to a terminal."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    tty = sys.stdout.isatty()
    # In a terminal, collapsed padding keeps wide tables (ls has 12 columns) on screen; if
    # one is still too wide, other columns are cut short, never the first (the id or tier
    # name an operator copies into the next command). --json always has everything.
    table = Table(title=title or None, box=box.SIMPLE_HEAD if tty else box.ASCII2, title_justify="left",
                  collapse_padding=tty, pad_edge=not tty)
    for i, col in enumerate(columns):
        first = max([len(col)] + [len(r[0]) for r in rows]) if i == 0 else None
        # Figures line up on the right, words (models, dtypes, layouts) on the left.
        numeric = i > 0 and all(_looks_numeric(r[i]) for r in rows)
        table.add_column(col, justify="right" if numeric else "left", no_wrap=True, min_width=first)
    for row in rows:
        table.add_row(*row)
    buf = io.StringIO()
    Console(file=buf, force_terminal=tty, no_color=not tty, width=width or (None if tty else 200),
            highlight=False).print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").splitlines())


def _looks_numeric(cell: str) -> bool:
    return cell == ABSENT or (cell[:1].isdigit() and not any(c.isalpha() for c in cell.rstrip("BKMGTi")))


def ratio(hits: int, total: int) -> float:
    return hits / total if total else 0.0


def _parse_hex(text: str, what: str, length: int = 16) -> bytes:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} {text!r} is not hex") from None
    if len(raw) != length:
        raise argparse.ArgumentTypeError(f"{what} must be {length} bytes ({2 * length} hex digits), got {len(raw)}")
    return raw


def namespace_arg(text: str) -> bytes:
    return _parse_hex(text, "namespace id")


def hash_arg(text: str) -> bytes:
    return _parse_hex(text, "block hash")


def token_ids_arg(text: str) -> list[int]:
    """Token ids, comma- or space-separated, each a u32 (what `TokenIds` carries)."""
    out = []
    for word in text.replace(",", " ").split():
        try:
            token = int(word)
        except ValueError:
            raise argparse.ArgumentTypeError(f"token id {word!r} is not a whole number") from None
        if not 0 <= token < 1 << 32:
            raise argparse.ArgumentTypeError(f"token id {token} is out of range [0, 2^32)")
        out.append(token)
    if not out:
        raise argparse.ArgumentTypeError("no token ids given")
    return out


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ------------------------------------------------------------------ health, info


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.client.admin import resolve_target
    from kvstore.client.security import Security, sync_channel

    target = resolve_target(args.target)
    # Health needs no token, but a TLS listener still needs the roots.
    security = Security.resolve(None, None, args.tls_ca, args.tls_cert, args.tls_key)
    with sync_channel(target, Security(tls_ca=security.tls_ca, tls_cert=security.tls_cert,
                                       tls_key=security.tls_key), []) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            status = "UNREACHABLE" if exc.code() == grpc.StatusCode.UNAVAILABLE else exc.code().name
            emit(args, {"target": target, "status": status, "detail": exc.details()}, f"{status}: {exc.details()}")
            return EXIT_ERROR
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    emit(args, {"target": target, "status": status}, f"{status} ({target})")
    return EXIT_OK if resp.status == health_pb2.HealthCheckResponse.SERVING else EXIT_ERROR


def cmd_info(args: argparse.Namespace) -> int:
    with open_client(args) as kv:
        text = kv.info(args.section or "")
    if args.json:
        sections: dict[str, dict[str, str]] = {}
        current: dict[str, str] = {}
        for line in text.splitlines():
            if line.startswith("# "):
                current = sections.setdefault(line[2:].strip().lower(), {})
            elif ":" in line:
                key, _, value = line.partition(":")
                current[key] = value
        print(json.dumps(sections, indent=2))
    else:
        print(text.rstrip())
    return EXIT_OK


# ------------------------------------------------------------------ stats


@dataclass(frozen=True, slots=True)
class TierColumn:
    header: str
    render: Callable[[dict[str, Any]], str]
    fields: tuple[str, ...]  # the per-tier fields this column shows


def _field(key: str) -> Callable[[dict[str, Any]], str]:
    """A counter that older daemons may not report: `-` when absent."""
    return lambda t: ABSENT if t.get(key) is None else str(t[key])


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}" if whole else "0.0"


TIER_COLUMNS = (
    TierColumn("TIER", lambda t: t["name"], ("name",)),
    TierColumn("POLICY", lambda t: t.get("policy") or ABSENT, ("policy",)),
    TierColumn("CAPACITY", lambda t: human_bytes(t["capacity_bytes"]), ("capacity_bytes",)),
    TierColumn("USED", lambda t: human_bytes(t["used_bytes"]), ("used_bytes",)),
    TierColumn("USE%", lambda t: _percent(t["used_bytes"], t["capacity_bytes"]), ()),
    TierColumn("BLOCKS", _field("blocks"), ("blocks",)),
    TierColumn("HIT%", lambda t: _percent(t["hits"], t["hits"] + t["misses"]), ()),
    TierColumn("HITS", _field("hits"), ("hits",)),
    TierColumn("MISSES", _field("misses"), ("misses",)),
    TierColumn("PROMOTED", _field("promotions"), ("promotions",)),
    TierColumn("DEMOTED", _field("demotions"), ("demotions",)),
    TierColumn("EVICTED", _field("evictions"), ("evictions",)),
    TierColumn("DROPPED", _field("drops"), ("drops",)),
    TierColumn("BAD_CHECKSUM", _field("checksum_failures"), ("checksum_failures",)),
)

# Fields shown by a column above, or not per-tier figures at all.
KNOWN_TIER_FIELDS = {"present", "reason", "facts"} | {f for c in TIER_COLUMNS for f in c.fields}


def extra_tier_fields(stats: dict[str, Any]) -> list[str]:
    """Scalar per-tier fields this daemon reports that the table does not name (newer
    daemons add some); shown as extra columns so nothing reported is hidden."""
    extra: list[str] = []
    for t in stats["tiers"]:
        for key, value in t.items():
            if key not in KNOWN_TIER_FIELDS and key not in extra and isinstance(value, (int, float, str)):
                extra.append(key)
    return extra


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value == "" or value is None:
        return ABSENT
    return str(value)


def tier_rows(stats: dict[str, Any]) -> list[list[str]]:
    rows = []
    extra = extra_tier_fields(stats)
    for t in stats["tiers"]:
        if not t["present"]:
            rows.append([t["name"]] + [ABSENT] * (len(TIER_COLUMNS) - 1 + len(extra)))
        else:
            rows.append([c.render(t) for c in TIER_COLUMNS] + [_cell(t.get(key)) for key in extra])
    return rows


def namespace_rows(namespaces: Sequence[dict[str, Any]], *, detail: bool = False) -> list[list[str]]:
    rows = []
    for ns in sorted(namespaces, key=lambda n: -n["used_bytes"]):
        lay = ns["layout"]
        dtype = lay["dtype"] + (f"/{lay['kv_codec']}" if lay.get("kv_codec") else "")  # stored quantized
        row = [ns["namespace_id"], lay["model"] + (f"@{lay['revision']}" if lay["revision"] else ""), dtype]
        if detail:
            row.insert(1, ns.get("tenant") or ABSENT)
            row += [
                f"{lay['num_layers']}x{lay['num_kv_heads']}x{lay['head_dim']}",
                str(lay["block_size_tokens"]),
                lay["kv_layout"],
                f"{lay['tp_rank']}/{lay['tp_size']}",
                lay["lora_id"] or ABSENT,
            ]
        row += [human_bytes(ns["block_bytes"]), str(ns["blocks"]), human_bytes(ns["used_bytes"]),
                _percent(ns.get("hit_blocks", 0), ns.get("lookup_blocks", 0)) if ns.get("lookup_blocks") else ABSENT]
        rows.append(row)
    return rows


NS_COLUMNS = ("NAMESPACE", "MODEL", "DTYPE", "BLOCK", "BLOCKS", "SIZE", "HIT%")
NS_DETAIL_COLUMNS = ("NAMESPACE", "TENANT", "MODEL", "DTYPE", "LxHxD", "TOKENS/BLOCK", "KV_LAYOUT", "TP", "LORA", "BLOCK",
                     "BLOCKS", "SIZE", "HIT%")


def format_stats(stats: dict[str, Any], namespaces: Sequence[dict[str, Any]] | None = None) -> str:
    columns = [c.header for c in TIER_COLUMNS] + [key.upper() for key in extra_tier_fields(stats)]
    parts = [render_table("Tiers", columns, tier_rows(stats))]
    notes = [f"tier {t['name']} absent: {t['reason']}" for t in stats["tiers"] if not t["present"]]
    c = stats["counters"]
    parts += notes
    parts.append(
        f"lookups {c['lookups']}  block hit ratio {ratio(c['hit_blocks'], c['lookup_blocks']):.3f} "
        f"({c['hit_blocks']}/{c['lookup_blocks']})  puts {c['puts']} (failed {c['put_failures']})  "
        f"stored {c['blocks_stored']}  fetched {c['blocks_fetched']}"
    )
    parts.append(
        f"in {human_bytes(c['bytes_in'])}  out {human_bytes(c['bytes_out'])}  evictions {c['evictions']}  "
        f"checksum failures {c['checksum_failures']}  leases {c['leases_active']}  namespaces {stats['namespaces']}  "
        f"uptime {stats['uptime_s']:.0f}s  version {stats['version']}"
    )
    # Store-wide counters the summary does not name (newer daemons add some).
    named = {"lookups", "lookup_blocks", "hit_blocks", "miss_blocks", "puts", "put_failures", "blocks_stored",
             "blocks_existing", "blocks_fetched", "bytes_in", "bytes_out", "evictions", "checksum_failures",
             "leases_active"}
    extra = [f"{key.replace('_', ' ')} {value}" for key, value in c.items() if key not in named]
    if extra:
        parts.append("  ".join(extra))
    if stats.get("codecs"):
        parts.append("")
        parts.append(render_table("Codecs", CODEC_COLUMNS, codec_rows(stats["codecs"])))
    if namespaces is not None:
        parts.append("")
        parts.append(render_table("Namespaces", NS_COLUMNS, namespace_rows(namespaces)))
    return "\n".join(parts)


CODEC_COLUMNS = ("PATH", "LINK", "NAMESPACE", "CHOICE", "LINK GB/S", "RATIOS", "MOVED")


def codec_rows(codecs: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row per (path, link, namespace) of the daemon's lossless codec choosers."""
    rows = []
    for c in codecs:
        figures = c.get("codecs", [])
        ratios = " ".join(f"{f['codec']} {f['ratio']:.2f}" for f in figures if f.get("ratio") and f["codec"] != "raw")
        moved = " ".join(f"{f['codec']} {human_bytes(int(f.get('raw_bytes', 0)))}" for f in figures
                         if int(f.get("raw_bytes", 0)))
        rows.append([c["path"], c["link"], c["namespace_id"], c["choice"], f"{c.get('link_gbps', 0):g}",
                     ratios or ABSENT, moved or ABSENT])
    return rows


def cmd_stats(args: argparse.Namespace) -> int:
    with open_admin(args) as admin:
        stats = message_to_record(admin.stats())
        for c in stats.get("codecs", []):  # namespace ids in hex, as operators type them
            c["namespace_id"] = c["namespace_id"].hex() if isinstance(c["namespace_id"], bytes) else c["namespace_id"]
        namespaces = [message_to_record(n) for n in admin.list_namespaces()] if args.by_namespace else None
    if namespaces is not None:
        stats["by_namespace"] = namespaces
    emit(args, stats, format_stats(stats, namespaces))
    return EXIT_OK


GROUP_COLUMNS = ("NAMESPACE", "GROUP", "KIND", "WINDOW", "DTYPE", "SHAPE", "PART", "PARTS", "SIZE")


def group_rows(namespaces: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row per KV group of the namespaces that have groups (hybrid, MLA, state caches)."""
    rows = []
    for ns in sorted(namespaces, key=lambda n: -n["used_bytes"]):
        shapes = {g["name"]: g for g in ns["layout"].get("groups", [])}
        for g in ns.get("groups", []):
            lay = shapes.get(g["name"], {})
            rows.append([ns["namespace_id"], g["name"], g["kind"], str(lay.get("window_tokens") or ABSENT),
                         lay.get("dtype", ABSENT), "x".join(str(d) for d in lay.get("shape", [])) or ABSENT,
                         human_bytes(g["block_bytes"]), str(g["blocks"]), human_bytes(g["used_bytes"])])
    return rows


def cmd_ls(args: argparse.Namespace) -> int:
    with open_admin(args) as admin:
        namespaces = [message_to_record(n) for n in admin.list_namespaces()]
    for ns in namespaces:
        for g in ns.get("groups", []):
            g["group_id"] = g["group_id"].hex() if isinstance(g.get("group_id"), bytes) else g.get("group_id")
    text = render_table("", NS_DETAIL_COLUMNS, namespace_rows(namespaces, detail=True)) if namespaces else \
        "no namespaces yet (a client's first Lookup or Put registers its layout)"
    groups = group_rows(namespaces)
    if groups:
        # A grouped namespace's BLOCK is every part of a block; its parts per group:
        text += "\n\n" + render_table("KV groups", GROUP_COLUMNS, groups)
    emit(args, {"namespaces": namespaces}, text)
    return EXIT_OK


# ------------------------------------------------------------------ removal


def cmd_evict(args: argparse.Namespace) -> int:
    with open_admin(args) as admin:
        r = admin.evict(args.tier, args.bytes)
    data = {"tier": args.tier, "target_bytes": args.bytes, "blocks": r.blocks, "removed_bytes": r.removed_bytes}
    short = " (nothing else evictable: the rest is pinned or in use)" if r.removed_bytes < args.bytes else ""
    emit(args, data, f"evicted {r.blocks} blocks, {human_bytes(r.removed_bytes)} from {args.tier}{short}")
    return EXIT_OK


def confirm(question: str) -> bool:
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    try:
        answer = input()
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def cmd_flush(args: argparse.Namespace) -> int:
    ns: bytes = args.namespace or b""
    with open_admin(args) as admin:
        if not args.yes:
            if ns:
                known = {n.namespace_id: n for n in admin.list_namespaces()}
                if ns not in known:
                    print(f"kvstore flush: namespace {ns.hex()} is not known to the daemon; see `kvstore ls`",
                          file=sys.stderr)
                    return EXIT_ERROR
                what = f"{known[ns].blocks} blocks ({human_bytes(known[ns].used_bytes)}) of namespace {ns.hex()}"
            else:
                s = admin.stats()
                what = f"every block ({sum(t.blocks for t in s.tiers)} blocks in {s.namespaces} namespaces)"
            if not confirm(f"Flush {what} from {admin.target}?"):
                print("kvstore flush: not confirmed; nothing flushed (pass --yes to skip the question)",
                      file=sys.stderr)
                return EXIT_ERROR
        r = admin.flush(ns)
    scope = f"namespace {ns.hex()}" if ns else "all namespaces"
    emit(args, {"namespace_id": ns.hex(), "blocks": r.blocks, "removed_bytes": r.removed_bytes},
         f"flushed {r.blocks} blocks, {human_bytes(r.removed_bytes)} ({scope})")
    return EXIT_OK


# ------------------------------------------------------------------ pins


def cmd_pin(args: argparse.Namespace) -> int:
    with open_admin(args) as admin:
        r = admin.pin(args.namespace, args.hashes, args.ttl_ms)
    data = {"lease_id": r.lease_id, "pinned": r.pinned, "expires_in_ms": r.expires_in_ms}
    text = (f"pinned {r.pinned} of {len(args.hashes)} blocks for {r.expires_in_ms} ms; lease {r.lease_id}"
            if r.pinned else "none of those blocks is present; nothing pinned")
    emit(args, data, text)
    return EXIT_OK


def cmd_unpin(args: argparse.Namespace) -> int:
    with open_admin(args) as admin:
        released = admin.unpin(args.lease_id)
    emit(args, {"lease_id": args.lease_id, "released": released},
         f"released lease {args.lease_id}" if released else f"lease {args.lease_id} is unknown or already expired")
    return EXIT_OK if released else EXIT_ERROR


# ------------------------------------------------------------------ config


def _field_dict(f: Any) -> dict[str, Any]:
    return {"name": f.name, "value": f.value, "kind": f.kind, "bounds": f.bounds, "runtime": f.runtime, "help": f.help}


def cmd_config_get(args: argparse.Namespace) -> int:
    with open_admin(args) as admin:
        fields = [_field_dict(f) for f in admin.get_config(args.name or "")]
    if args.name and not args.json:
        print(fields[0]["value"])
        return EXIT_OK
    rows = [[f["name"], f["value"], "yes" if f["runtime"] else "no", f["bounds"] or ABSENT] for f in fields]
    emit(args, {"fields": fields}, render_table("", ("NAME", "VALUE", "RUNTIME", "BOUNDS"), rows))
    return EXIT_OK


def cmd_config_set(args: argparse.Namespace) -> int:
    with open_admin(args) as admin:
        r = admin.set_config(args.name, args.value)
    emit(args, {"name": r.field.name, "value": r.field.value, "previous": r.previous},
         f"{r.field.name}: {r.previous} -> {r.field.value}")
    return EXIT_OK


def cmd_config_validate(args: argparse.Namespace) -> int:
    """Checks a TOML file alone (no env, no flags): what a daemon started with it would use."""
    from kvstore.errors import KVStoreError
    from kvstore.server.config import FIELDS, format_value, load_config, read_toml

    try:
        set_keys = set(read_toml(args.file))
        cfg = load_config({"config": args.file}, env={})
        from kvstore.server.data_lane.server import check_lane_exposure, lane_addresses
        from kvstore.server.listen import check_exposure

        # Addresses are checked the way the daemon checks them (loopback unless auth is set up),
        # the data lane's and the KV event streams' too, and so is the token file.
        addresses, _ = check_exposure(cfg)
        check_lane_exposure(cfg, lane_addresses(cfg, addresses))
        if cfg.cluster:
            check_lane_exposure(cfg, lane_addresses(cfg, addresses, "peer_lane_listen"), "peer_lane_listen")
        tenants = None
        if cfg.auth_token_file:
            from kvstore.server.auth import parse_token_file

            tenants = parse_token_file(cfg.auth_token_file).identities
        from kvstore.server.kv_events import parse_streams

        parse_streams(cfg, tenants)  # the KV event streams: endpoints, tenants, exposure
    except KVStoreError as exc:
        emit(args, {"file": args.file, "valid": False, "error": str(exc)}, f"{args.file}: invalid: {exc}")
        return EXIT_ERROR
    values = cfg.as_dict()
    rows = [[f.name, format_value(values[f.name]), "file" if f.name in set_keys else "default"] for f in FIELDS]
    emit(args, {"file": args.file, "valid": True, "config": {k: format_value(v) for k, v in values.items()}},
         f"{args.file}: valid\n" + render_table("", ("NAME", "VALUE", "FROM"), rows))
    return EXIT_OK


# ------------------------------------------------------------------ events


EVENT_NAMES = {1: "stored", 2: "removed", 3: "moved", 4: "resync"}


def cmd_events(args: argparse.Namespace) -> int:
    """Prints one JSON object a line per event (the same with and without --json): the
    daemon's WatchEvents, or with `--format vllm` a KV event stream in vLLM's format
    (kvstore.cli.kv_events)."""
    from kvstore.errors import DeadlineExceeded

    if args.format == "vllm":
        from kvstore.cli.kv_events import cmd_vllm_events

        return cmd_vllm_events(args)
    if args.endpoint or args.replay or args.from_seq is not None:
        print("kvstore events: --endpoint, --replay and --from-seq read a stream in vLLM's format: add --format vllm")
        return EXIT_USAGE

    seen = 0
    with open_admin(args) as admin:
        try:
            for e in admin.watch_events(args.namespace or b"", snapshot=args.snapshot, timeout_s=args.duration):
                line = {"seq": e.seq, "kind": EVENT_NAMES.get(e.kind, str(e.kind)),
                        "namespace_id": e.namespace_id.hex(), "tier": e.tier,
                        "block_hashes": [h.hex() for h in e.block_hashes]}
                if e.from_tier:
                    line["from_tier"] = e.from_tier
                if e.dropped:
                    line["dropped"] = e.dropped
                print(json.dumps(line), flush=True)
                seen += 1
                if args.count and seen >= args.count:
                    break
        except DeadlineExceeded:
            pass  # --duration elapsed
        except KeyboardInterrupt:
            pass  # Ctrl-C is how a person stops watching
    return EXIT_OK


# ------------------------------------------------------------------ export / import


class _ProgressBar:
    """A rich progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, description: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        self._progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                  console=console, disable=not console.is_terminal, transient=False)
        self._task = self._progress.add_task(description, total=None)

    def __enter__(self) -> _ProgressBar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def total(self, n: int) -> None:
        self._progress.update(self._task, total=n)

    def advance(self, n: int) -> None:
        self._progress.advance(self._task, n)


def cmd_export(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from kvstore.client.export import export_namespace

    dest = args.file
    if os.path.isdir(dest):
        print(f"kvstore export: {dest} is a directory; name the file to write, e.g. "
              f"{os.path.join(dest, args.namespace.hex() + '.kvx')}", file=sys.stderr)
        return EXIT_ERROR
    try:
        # A new file of a random name, never one already there (O_CREAT | O_EXCL |
        # O_NOFOLLOW), mode 0600: in a directory others may write (/tmp) a fixed name
        # could be a link planted to make this write elsewhere, and KV blocks can
        # reveal the prompts they were computed from. Renamed into place when whole.
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dest)}.", suffix=".partial",
                                   dir=os.path.dirname(os.path.abspath(dest)))
    except OSError as exc:
        print(f"kvstore export: cannot write {dest}: {exc.strerror}", file=sys.stderr)
        return EXIT_ERROR
    out = os.fdopen(fd, "wb")
    done = False
    try:
        with open_admin(args) as admin, _ProgressBar("export") as bar:
            with out:
                r = export_namespace(admin, args.namespace, out, bar.advance, bar.total)
            os.replace(tmp, dest)  # a file under the final name is always complete
            done = True
    finally:
        out.close()
        if not done:
            os.unlink(tmp)
    note = f" ({r.skipped} went away during the export)" if r.skipped else ""
    emit(args, {"file": dest, "namespace_id": args.namespace.hex(), "blocks": r.blocks, "exported_bytes": r.exported_bytes,
                "skipped": r.skipped},
         f"exported {r.blocks} blocks, {human_bytes(r.exported_bytes)} of namespace {args.namespace.hex()} to {dest}{note}")
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from kvstore.client.export import estimate_blocks, import_namespace, read_header

    try:
        src = open(args.file, "rb")
    except OSError as exc:
        print(f"kvstore import: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return EXIT_ERROR
    with src:
        header = read_header(src)
        total = estimate_blocks(args.file, header, src.tell())
        src.seek(0)
        with open_admin(args) as admin, _ProgressBar("import") as bar:
            bar.total(total)
            r = import_namespace(admin, src, bar.advance)
    emit(args, {"file": args.file, "namespace_id": header.namespace_id.hex(), "blocks": r.blocks,
                "stored": r.stored, "existing": r.existing},
         f"imported {r.blocks} blocks of namespace {header.namespace_id.hex()} ({header.layout.model}): "
         f"{r.stored} stored, {r.existing} already present")
    return EXIT_OK


# ------------------------------------------------------------------ registration


def register(sub: Any, client_command: ClientCommand) -> None:
    """Add the operator commands to the CLI's subparsers (`client_command` adds
    --target, --json and --timeout)."""
    from kvstore.cli.top import cmd_top

    stats = client_command("stats", "per-tier capacity, usage, hit ratio, migrations, drops", cmd_stats)
    stats.add_argument("--by-namespace", action="store_true", help="also show each namespace's blocks and bytes")

    client_command("ls", "namespaces with their layouts and sizes", cmd_ls)

    evict = client_command("evict", "evict blocks from a tier in its policy's order", cmd_evict)
    evict.add_argument("--tier", required=True, help="tier name, as shown by `kvstore stats`")
    evict.add_argument("--bytes", required=True, type=size_arg, metavar="SIZE", help="how much to free, e.g. 512MiB")

    flush = client_command("flush", "remove every block, or one namespace's (asks first)", cmd_flush)
    flush.add_argument("--namespace", type=namespace_arg, metavar="ID", help="namespace id in hex (see `kvstore ls`)")
    flush.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")

    pin = client_command("pin", "pin blocks against eviction for a while", cmd_pin)
    pin.add_argument("namespace", type=namespace_arg, metavar="NAMESPACE_ID", help="namespace id in hex")
    pin.add_argument("hashes", type=hash_arg, nargs="+", metavar="BLOCK_HASH", help="block hashes in hex")
    pin.add_argument("--ttl-ms", type=int, default=0, help="pin duration (default: the daemon's default_pin_ms)")

    unpin = client_command("unpin", "release a pin (a lease id from `kvstore pin`)", cmd_unpin)
    unpin.add_argument("lease_id")

    top = client_command("top", "live view: tier fill, hit ratio, throughput, top namespaces (q quits)", cmd_top)
    top.add_argument("--interval", type=seconds, default=1.0, metavar="SECONDS", help="refresh period")
    top.add_argument("--iterations", type=int, default=0, metavar="N", help="stop after N refreshes (0: until q)")

    events = client_command("events", "stream block events as JSON lines (stored/removed/moved/resync), or a KV "
                            "event stream in vLLM's format (--format vllm)", cmd_events)
    events.add_argument("--namespace", type=namespace_arg, metavar="ID", help="only this namespace")
    events.add_argument("--snapshot", action="store_true", help="start with every block held now")
    events.add_argument("--count", type=int, default=0, help="stop after N events")
    events.add_argument("--duration", type=seconds, default=None, metavar="SECONDS", help="stop after this long")
    events.add_argument("--format", choices=("json", "vllm"), default="json",
                        help="json: the daemon's WatchEvents (default); vllm: read the ZMQ stream at --endpoint")
    events.add_argument("--endpoint", action="append", metavar="tcp://HOST:PORT",
                        help="--format vllm: a stream to read (the daemon's kv_events_endpoint, or a vLLM engine's); "
                        "repeat for several daemons")
    events.add_argument("--replay", action="append", metavar="tcp://HOST:PORT",
                        help="--format vllm: the stream's replay endpoint, to fill gaps (one per --endpoint)")
    events.add_argument("--topic", default="", help="--format vllm: the topic prefix to subscribe to (default: all)")
    events.add_argument("--from-seq", type=int, default=None, metavar="N",
                        help="--format vllm: first print every batch the replay endpoint holds from N (0: all)")

    export = client_command("export", "write a namespace's blocks to a file (to warm another node)", cmd_export)
    export.add_argument("namespace", type=namespace_arg, metavar="NAMESPACE_ID", help="namespace id in hex")
    export.add_argument("file", help="output file (written whole or not at all)")
    import_ = client_command("import", "load blocks from an export file into the daemon", cmd_import)
    import_.add_argument("file")

    config = sub.add_parser("config", help="show, change or validate settings")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    get = _nested(config_sub, "get", "show settings (all, or one by name)", cmd_config_get)
    get.add_argument("name", nargs="?", help="one setting (prints its bare value)")
    set_ = _nested(config_sub, "set", "change a runtime-modifiable setting", cmd_config_set)
    set_.add_argument("name")
    set_.add_argument("value")
    validate = config_sub.add_parser("validate", help="check a TOML config file without starting a daemon")
    validate.add_argument("file")
    validate.add_argument("--json", action="store_true", help="machine-readable output")
    validate.set_defaults(func=cmd_config_validate)


def _nested(sub: Any, name: str, help_text: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text)
    add_client_options(p)
    p.set_defaults(func=func)
    return p
