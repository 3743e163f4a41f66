"""Log set-up for the daemon and the CLI: text for people, JSON lines for collectors.

Primitives: `setup_logging(level, fmt)`, `JsonFormatter`, `request_id`, the
contextvar the per-call pipeline sets so every record carries the call's request id,
and `RepeatFilter` / `rate_limited(loggers, interval_s)`, which let one record of a kind
through per interval and count the rest (for errors a flood of connections repeats).
JSON lines hold the standard fields (`ts`, `level`, `logger`, `msg`, `request_id`) plus
`exc` when a traceback is attached; nothing from the environment is ever added.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record so formats can print it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


# `extra=` keys a JSON line carries as structured fields (e.g. the effective config at start).
STRUCTURED_EXTRAS = ("config",)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", "-"),
        }
        for key in STRUCTURED_EXTRAS:
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Route every logger to stderr in `fmt` ("text" or "json") at `level`."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def set_level(level: str) -> None:
    logging.getLogger().setLevel(level.upper())


class RepeatFilter(logging.Filter):
    """Lets the first record of each kind (logger, level, message template) through, then
    at most one per `interval_s`; the rest are dropped and counted, and the next record of
    that kind to pass says how many were. A failure that every connection of a flood
    repeats (an accept that runs out of descriptors, a refused peer) then costs one line
    per interval, not one per connection. Thread-safe: gRPC's threads log too."""

    MAX_KINDS = 1024

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._kinds: dict[tuple[str, int, str], list[float]] = {}  # kind -> [last passed at, dropped since]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is not None and now - seen[0] < self.interval_s:
                seen[1] += 1
                return False
            if seen is None and len(self._kinds) >= self.MAX_KINDS:
                self._kinds.clear()
            dropped = int(seen[1]) if seen is not None else 0
            self._kinds[kind] = [now, 0]
        if dropped:
            # Appended to the text after formatting, so a '%' in it cannot break the args.
            record.msg, record.args = f"{record.getMessage()} ({dropped} more like this suppressed)", None
        return True


@contextlib.contextmanager
def rate_limited(names: Sequence[str], interval_s: float) -> Iterator[RepeatFilter]:
    """A `RepeatFilter` on each of the loggers `names` while the block runs."""
    repeat = RepeatFilter(interval_s)
    loggers = [logging.getLogger(name) for name in names]
    for log in loggers:
        log.addFilter(repeat)
    try:
        yield repeat
    finally:
        for log in loggers:
            log.removeFilter(repeat)
