"""`Info` text in Redis INFO style: `# Section` headers and `key:value` lines.

Byte counts have `_human` twins. Sections: server, tiers, stats, namespaces, config.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore import __version__
from kvstore.errors import InvalidArgument
from kvstore.units import human_bytes

if TYPE_CHECKING:
    from kvstore.core.store import Store
    from kvstore.server.host_resources import GcPauses

SECTIONS = ("server", "tiers", "stats", "namespaces", "config")


def _bytes_line(key: str, n: int) -> list[str]:
    return [f"{key}:{n}", f"{key}_human:{human_bytes(n)}"]


def render_info(
    store: Store,
    uptime_s: float,
    config: dict[str, object],
    absent_tiers: Sequence[tuple[str, str]] = (),
    section: str = "",
    gc: GcPauses | None = None,
) -> str:
    section = section.strip().lower()
    if section and section not in SECTIONS:
        raise InvalidArgument(f"unknown info section {section!r}; choose one of: {', '.join(SECTIONS)}")
    status = store.stats()
    out: list[str] = []
    if section in ("", "server"):
        out += ["# Server", f"kvstore_version:{__version__}", f"python_version:{platform.python_version()}",
                f"process_id:{os.getpid()}", f"uptime_in_seconds:{int(uptime_s)}"]
        if gc is not None:
            # The collector's stops of the event loop, by generation (kvstore.server.host_resources).
            for g, (n, took, longest) in enumerate(zip(gc.collections, gc.pause_s, gc.longest_s)):
                out += [f"gc_gen{g}_collections:{n}", f"gc_gen{g}_pause_ms:{took * 1e3:.2f}",
                        f"gc_gen{g}_longest_pause_ms:{longest * 1e3:.2f}"]
            out += [f"gc_frozen_at_blocks:{gc.frozen_at_blocks}", f"gc_freezes:{gc.freezes}"]
        out.append("")
    if section in ("", "tiers"):
        out.append("# Tiers")
        for t in status.tiers:
            p = f"tier_{t.name}"
            out += [f"{p}_present:1", f"{p}_policy:{t.policy}"]
            out += _bytes_line(f"{p}_capacity_bytes", t.capacity_bytes)
            out += _bytes_line(f"{p}_used_bytes", t.used_bytes)
            out += [f"{p}_blocks:{t.blocks}", f"{p}_hits:{t.counters.hits}", f"{p}_misses:{t.counters.misses}",
                    f"{p}_evictions:{t.counters.evictions}", f"{p}_checksum_failures:{t.counters.checksum_failures}",
                    f"{p}_promotions:{t.counters.promotions}", f"{p}_demotions:{t.counters.demotions}",
                    f"{p}_drops:{t.counters.drops}", f"{p}_pending_writes:{t.pending_writes}"]
            out += [f"{p}_{k}:{v}" for k, v in sorted(t.facts.items())]
        for name, reason in absent_tiers:
            out += [f"tier_{name}_present:0", f"tier_{name}_reason:{reason}"]
        out.append("")
    if section in ("", "stats"):
        c = status.counters
        ratio = c.hit_blocks / c.lookup_blocks if c.lookup_blocks else 0.0
        out += ["# Stats", f"lookups:{c.lookups}", f"lookup_blocks:{c.lookup_blocks}", f"hit_blocks:{c.hit_blocks}",
                f"miss_blocks:{c.miss_blocks}", f"block_hit_ratio:{ratio:.4f}", f"puts:{c.puts}",
                f"put_failures:{c.put_failures}", f"blocks_stored:{c.blocks_stored}",
                f"blocks_existing:{c.blocks_existing}"]
        out += _bytes_line("bytes_in", c.bytes_in)
        if c.group_parts_stored:
            out += [f"group_parts_stored:{c.group_parts_stored}", f"group_parts_dropped:{c.group_parts_dropped}"]
            out += _bytes_line("group_bytes_skipped", c.group_bytes_skipped)
        out += [f"fetches:{c.fetches}", f"blocks_fetched:{c.blocks_fetched}"]
        out += _bytes_line("bytes_out", c.bytes_out)
        out += [f"deletes:{c.deletes}", f"evictions:{c.evictions}", f"checksum_failures:{c.checksum_failures}",
                f"leases_active:{status.leases_active}", f"hinted_lookups:{c.hinted_lookups}",
                f"hinted_puts:{c.hinted_puts}", f"sessions_ended:{c.sessions_ended}", ""]
    if section in ("", "namespaces"):
        out.append("# Namespaces")
        out.append(f"namespaces:{status.namespaces}")
        for ns in store.namespaces():
            lay = ns.layout
            out.append(
                f"ns_{ns.namespace_id.hex()}:model={lay.model},revision={lay.revision},lora={lay.lora_id},"
                f"dtype={lay.dtype},layers={lay.num_layers},kv_heads={lay.num_kv_heads},head_dim={lay.head_dim},"
                f"block_tokens={lay.block_size_tokens},block_bytes={lay.bytes_per_block},"
                f"tp={lay.tp_rank}/{lay.tp_size},blocks={ns.blocks},bytes={ns.bytes}"
            )
        out.append("")
    if section in ("", "config"):
        out.append("# Config")
        from kvstore.server.config import FIELD_BY_NAME

        for key, value in config.items():
            shown = ",".join(value) if isinstance(value, (list, tuple)) else value
            out.append(f"{key}:{shown}")
            field = FIELD_BY_NAME.get(key)
            if field is not None and field.kind == "size" and isinstance(value, int):
                out.append(f"{key}_human:{human_bytes(value)}")
        out.append("")
    return "\n".join(out)
