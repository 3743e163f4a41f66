"""Log set-up for the daemon and the CLI: text for people, JSON lines for collectors.

Primitives: `setup_logging(level, fmt)`, `JsonFormatter`, and `request_id`, the
contextvar the per-call pipeline sets so every record carries the call's request id.
JSON lines hold the standard fields (`ts`, `level`, `logger`, `msg`, `request_id`) plus
`exc` when a traceback is attached; nothing from the environment is ever added.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

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
