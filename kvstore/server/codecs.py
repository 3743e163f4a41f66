"""What the daemon's lossless codec choosers know, shown in stats, INFO and metrics.

Two choosers run in a daemon (`kvstore.codec_chooser`): the SSD tier's, for its record
writes (path "ssd"), and the pool's, for pulls and forwards on the peers' data lanes
(path "pool", one link per peer). A client's own choice for its fetches and puts is the
client's (`Client.codec_stats`); the daemon counts the encoded frames it sent and took
(`kvstore_datalane_encoded_*`).

Primitives: `CodecView` (`choices()`), `codecs_to_proto`, `render_codecs_info`,
`CodecCollector` (`kvstore_codec_*`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.codec_chooser import Choice, CodecChooser
from kvstore.core.store import Store
from kvstore.v1 import admin_pb2

Entry = tuple[str, Choice]


class CodecView:
    """The choosers of one daemon: its tiers' and the pool's (`pool`, when in a pool)."""

    def __init__(self, store: Store, pool: CodecChooser | None = None) -> None:
        self.store = store
        self.pool = pool

    def choices(self) -> list[Entry]:
        out: list[Entry] = []
        for st in self.store.tiers:
            out += [(st.name, c) for c in st.tier.codec_choices()]
        if self.pool is not None:
            out += [("pool", c) for c in self.pool.snapshot()]
        return out


def codecs_to_proto(entries: list[Entry]) -> list[admin_pb2.CodecChoice]:
    out = []
    for path, c in entries:
        names = sorted(set(c.ratios) | set(c.expected_gbps) | set(c.raw_bytes))
        out.append(admin_pb2.CodecChoice(
            path=path, link=c.link, namespace_id=c.namespace, choice=c.choice, link_gbps=c.link_gbps,
            transfers=c.transfers,
            codecs=[admin_pb2.CodecFigures(codec=n, ratio=c.ratios.get(n, 1.0 if n == "raw" else 0.0),
                                           encode_gbps=c.encode_gbps.get(n, 0.0), decode_gbps=c.decode_gbps.get(n, 0.0),
                                           expected_gbps=c.expected_gbps.get(n, 0.0),
                                           raw_bytes=c.raw_bytes.get(n, 0), wire_bytes=c.wire_bytes.get(n, 0))
                    for n in names]))
    return out


def render_codecs_info(entries: list[Entry]) -> str:
    """INFO's `# Codecs` section: one line per (path, link, namespace)."""
    lines = ["# Codecs", f"codec_keys:{len(entries)}"]
    for path, c in entries:
        parts = [f"choice={c.choice}", f"link_gbps={c.link_gbps:g}", f"transfers={c.transfers}"]
        for n in sorted(set(c.ratios) | set(c.expected_gbps)):
            if n in c.ratios:
                parts.append(f"{n}_ratio={c.ratios[n]:g}")
            if n in c.expected_gbps:
                parts.append(f"{n}_expected_gbps={c.expected_gbps[n]:g}")
        for n in sorted(c.raw_bytes):
            parts.append(f"{n}_raw_bytes={c.raw_bytes[n]},{n}_wire_bytes={c.wire_bytes.get(n, 0)}")
        link = c.link.replace(" ", "_")
        lines.append(f"codec_{path}_{link}_{c.namespace.hex()}:" + ",".join(parts))
    return "\n".join(lines) + "\n"


class CodecCollector(Collector):
    """`kvstore_codec_*`, read from the choosers at scrape time."""

    def __init__(self, choices: Callable[[], list[Entry]]) -> None:
        self._choices = choices

    def collect(self) -> Iterator[Any]:
        labels = ["path", "link", "namespace", "codec"]
        chosen = GaugeMetricFamily("kvstore_codec_chosen", "1 for the lossless codec the next transfer of a path, "
                                   "link and namespace uses (docs/codecs.md)", labels=labels)
        ratio = GaugeMetricFamily("kvstore_codec_ratio", "encoded / raw bytes of a codec on a namespace's blocks, "
                                  "as measured", labels=labels)
        raw = CounterMetricFamily("kvstore_codec_raw_bytes", "raw block bytes moved with a codec", labels=labels)
        wire = CounterMetricFamily("kvstore_codec_wire_bytes", "bytes those blocks took on the link or disk",
                                   labels=labels)
        link_rate = GaugeMetricFamily("kvstore_codec_link_bytes_per_second", "measured rate of raw transfers on "
                                      "a link (per namespace)", labels=labels[:3])
        for path, c in self._choices():
            base = [path, c.link, c.namespace.hex()]
            chosen.add_metric([*base, c.choice], 1.0)
            for n, r in c.ratios.items():
                ratio.add_metric([*base, n], r)
            for n, b in c.raw_bytes.items():
                raw.add_metric([*base, n], b)
                wire.add_metric([*base, n], c.wire_bytes.get(n, 0))
            link_rate.add_metric(base, c.link_gbps * 1e9)
        yield from (chosen, ratio, raw, wire, link_rate)
