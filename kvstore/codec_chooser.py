"""Which lossless codec a transfer uses, learned online per link and namespace.

A codec pays only where the link, not the CPU, is the bottleneck: on a 1 Gbit/s link a
bf16 block that zstd shrinks to 0.7 of its size arrives sooner compressed; on a 25 Gbit/s
link the same codec, at about 0.5 GB/s per core, makes it arrive later. So the choice is
made per transfer, from two things measured on this machine while it runs:

* the link: seconds per byte of the transfers that went on it (the byte-moving part of
  each transfer, its control calls left out), kept per (link, namespace) and per codec;
* the codecs: the ratio and the encode and decode seconds per byte of each codec on
  blocks of each namespace (KV dtypes compress differently), sampled now and then from
  the blocks that go by (`sample`), and learned from the codec's own transfers.

`choose` picks the option whose expected seconds per raw byte is lowest. An option that
has been used on this key has its observed figure; one that has not has a model's:
`max(ratio x the raw link time, encode + decode time)`: the codec's work overlaps the
wire (blocks are encoded and decoded while earlier ones cross it), but not itself (it is
counted as if one core did both ends' work, as it nearly does when both ends share a
machine, and the transfer's own copies compete for the cores): so a codec is first tried
only where it should win even then. A codec must beat raw by `MARGIN` to be
picked. An option is first tried only when its model says it wins; once used, it is run
again now and then (every `PROBE_EVERY` transfers, the best other option) while its
estimate is within `PROBE_WITHIN` of the best, to refresh its figure. On a link where a
codec is clearly slower it is never run, so the chooser costs a fast link nothing. Until a raw transfer of a key was measured,
raw is used; transfers under `LEARN_MIN_BYTES` use the current choice and teach nothing
(their fixed costs would swamp the per-byte figures).

Thread-safe: the lane's connection threads and the SSD tier's I/O threads call in. The
clock is injectable (tests use a fake one).

Primitives: `CodecChooser` (`choose`, `observed`, `sample`, `wants_sample`, `snapshot`),
`Choice`, `LINK_SSD`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.codecs import Codec, available, decode, encode

# A codec is chosen over raw only when it is expected to be at least this much faster.
MARGIN = 0.05
# Every this many transfers of a key, the best other option is run once to refresh its
# figure, if its estimate is within PROBE_WITHIN of the best one's.
PROBE_EVERY = 16
PROBE_WITHIN = 1.5
# Transfers smaller than this teach the chooser nothing (per-transfer costs dominate).
LEARN_MIN_BYTES = 1 << 20
# Weight of a new observation in the running figures.
ALPHA = 0.3
# A namespace's codecs are sampled on its first blocks, then every this many.
SAMPLE_FIRST = 3
SAMPLE_EVERY = 64
# The link name of the SSD tier's writes.
LINK_SSD = "ssd"


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


@dataclass(slots=True)
class _CodecFigures:
    """One codec on one namespace's blocks, on this machine."""

    ratio: float | None = None  # encoded / raw bytes
    encode_spb: float | None = None  # seconds per raw byte
    decode_spb: float | None = None
    samples: int = 0


@dataclass(slots=True)
class _Key:
    """One (link, namespace): what each option took, per raw byte."""

    spb: dict[Codec, float] = field(default_factory=dict)
    transfers: int = 0
    choice: Codec = Codec.RAW
    raw_bytes: dict[Codec, int] = field(default_factory=dict)
    wire_bytes: dict[Codec, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Choice:
    """What the chooser knows of one (link, namespace), for stats, INFO and metrics."""

    link: str
    namespace: bytes
    choice: str  # the codec the next transfer uses
    link_gbps: float  # raw bytes per second of raw transfers, in GB/s (0: not measured yet)
    transfers: int
    ratios: dict[str, float]  # per codec: encoded / raw bytes on this namespace's blocks
    encode_gbps: dict[str, float]
    decode_gbps: dict[str, float]
    expected_gbps: dict[str, float]  # per option: raw bytes per second expected
    raw_bytes: dict[str, int]  # per option: raw bytes moved with it
    wire_bytes: dict[str, int]  # per option: bytes that crossed the link with it


class CodecChooser:
    """Per (link, namespace): which codec the next transfer uses (see the module doc)."""

    def __init__(self, codecs: Sequence[Codec] | None = None, *, clock: Callable[[], float] = time.perf_counter,
                 learn_min_bytes: int = LEARN_MIN_BYTES) -> None:
        self.codecs = tuple(codecs) if codecs is not None else available()
        self.clock = clock
        self.learn_min_bytes = learn_min_bytes
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, bytes], _Key] = {}
        self._figures: dict[tuple[bytes, Codec], _CodecFigures] = {}
        self._seen: dict[bytes, int] = {}  # namespace -> blocks offered for sampling

    # -------------------------------------------------------------- the decision

    def choose(self, link: str, namespace: bytes, offered: Iterable[Codec] = ()) -> Codec:
        """The codec for the next transfer on `link` of `namespace`'s blocks, out of raw
        and `offered` (what the other end takes)."""
        options = [Codec.RAW, *(c for c in offered if c in self.codecs and c is not Codec.RAW)]
        with self._lock:
            key = self._keys.setdefault((link, namespace), _Key())
            estimates = self._estimates(key, namespace, options)
            raw = estimates.get(Codec.RAW)
            if raw is None:
                key.choice = Codec.RAW
                return Codec.RAW
            best = Codec.RAW
            coded = [c for c in estimates if c is not Codec.RAW]
            if coded:
                fastest = min(coded, key=lambda c: estimates[c])
                # Switching to a codec takes MARGIN; staying on it, only being faster.
                if estimates[fastest] < raw * (1.0 if key.choice is fastest else 1.0 - MARGIN):
                    best = fastest
            key.choice = best
            key.transfers += 1
            if key.transfers % PROBE_EVERY == 0:
                # Only options seen before are refreshed: one never used is tried only once
                # the model expects it to win.
                others = sorted((c for c in estimates if c is not best and c in key.spb), key=lambda c: estimates[c])
                if others and estimates[others[0]] <= estimates[best] * PROBE_WITHIN:
                    return others[0]  # a probe: the choice stays what it was
            return best

    def _estimates(self, key: _Key, namespace: bytes, options: Sequence[Codec]) -> dict[Codec, float]:
        """(under the lock) Expected seconds per raw byte of each option that has a figure."""
        raw = key.spb.get(Codec.RAW)
        out: dict[Codec, float] = {}
        if raw is not None:
            out[Codec.RAW] = raw
        for c in options:
            if c is Codec.RAW:
                continue
            seen = key.spb.get(c)
            if seen is not None:
                out[c] = seen
                continue
            fig = self._figures.get((namespace, c))
            if raw is None or fig is None or fig.ratio is None or fig.encode_spb is None or fig.decode_spb is None:
                continue
            out[c] = max(fig.ratio * raw, fig.encode_spb + fig.decode_spb)
        return out

    # -------------------------------------------------------------- learning

    def observed(self, link: str, namespace: bytes, codec: Codec, raw_bytes: int, wire_bytes: int,
                 seconds: float) -> None:
        """A transfer on `link` moved `raw_bytes` of `namespace` (`wire_bytes` on the link,
        with `codec`) in `seconds` (its byte-moving part)."""
        with self._lock:
            key = self._keys.setdefault((link, namespace), _Key())
            key.raw_bytes[codec] = key.raw_bytes.get(codec, 0) + raw_bytes
            key.wire_bytes[codec] = key.wire_bytes.get(codec, 0) + wire_bytes
            if raw_bytes < self.learn_min_bytes or raw_bytes <= 0 or seconds <= 0:
                return
            key.spb[codec] = _ewma(key.spb.get(codec), seconds / raw_bytes)
            if codec is not Codec.RAW and wire_bytes:
                fig = self._figures.setdefault((namespace, codec), _CodecFigures())
                fig.ratio = _ewma(fig.ratio, wire_bytes / raw_bytes)

    def wants_sample(self, namespace: bytes) -> bool:
        """Whether the next block of `namespace` should be `sample`d (its first few, then
        one in SAMPLE_EVERY): cheap, call it per transfer."""
        if len(self.codecs) < 2:
            return False
        with self._lock:
            n = self._seen.get(namespace, 0)
            self._seen[namespace] = n + 1
        return n < SAMPLE_FIRST or n % SAMPLE_EVERY == 0

    def sample(self, namespace: bytes, itemsize: int, block: bytes | bytearray | memoryview) -> None:
        """Encode and decode `block` with every codec, timing each: its ratio and speed on
        `namespace`'s blocks on this machine. Costs a few milliseconds per MiB."""
        raw = len(block)
        if not raw:
            return
        for c in self.codecs:
            if c is Codec.RAW:
                continue
            t0 = self.clock()
            enc = encode(c, block, itemsize)
            t1 = self.clock()
            decode(c, enc, itemsize, raw)
            t2 = self.clock()
            with self._lock:
                fig = self._figures.setdefault((namespace, c), _CodecFigures())
                fig.ratio = _ewma(fig.ratio, len(enc) / raw)
                fig.encode_spb = _ewma(fig.encode_spb, max(t1 - t0, 1e-9) / raw)
                fig.decode_spb = _ewma(fig.decode_spb, max(t2 - t1, 1e-9) / raw)
                fig.samples += 1

    # -------------------------------------------------------------- reporting

    def snapshot(self) -> list[Choice]:
        """Every (link, namespace) the chooser has seen, sorted."""
        out = []
        with self._lock:
            for (link, ns), key in sorted(self._keys.items()):
                options = list(self.codecs)
                est = self._estimates(key, ns, options)
                figs = {c: self._figures.get((ns, c)) for c in options if c is not Codec.RAW}
                raw = key.spb.get(Codec.RAW)
                out.append(Choice(
                    link=link, namespace=ns, choice=key.choice.label,
                    link_gbps=round(1e-9 / raw, 3) if raw else 0.0,
                    transfers=key.transfers,
                    ratios={c.label: round(f.ratio, 3) for c, f in figs.items() if f and f.ratio is not None},
                    encode_gbps={c.label: round(1e-9 / f.encode_spb, 3) for c, f in figs.items()
                                 if f and f.encode_spb},
                    decode_gbps={c.label: round(1e-9 / f.decode_spb, 3) for c, f in figs.items()
                                 if f and f.decode_spb},
                    expected_gbps={c.label: round(1e-9 / s, 3) for c, s in est.items() if s > 0},
                    raw_bytes={c.label: n for c, n in key.raw_bytes.items()},
                    wire_bytes={c.label: n for c, n in key.wire_bytes.items()},
                ))
        return out


__all__ = ["LINK_SSD", "Choice", "CodecChooser"]
