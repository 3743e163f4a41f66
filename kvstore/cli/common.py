"""What every `kvstore` command shares: exit codes, the client options, output.

Exit codes, the same for every command: 0 success; 1 the daemon answered with an error,
is not serving, or cannot be reached; 2 the command line is wrong (argparse). Every
client command takes `--target` (default `KVSTORE_TARGET`, then the daemon's default
Unix socket, then 127.0.0.1:50051) and `--json` for machine-readable output.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2

# Adds a subcommand that talks to a daemon: (name, help, handler) -> its parser.
ClientCommand = Callable[[str, str, Callable[[argparse.Namespace], int]], argparse.ArgumentParser]


def seconds(text: str) -> float:
    """argparse type of a duration: a finite number of seconds, not negative (float()
    alone would take nan and inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def add_client_options(p: argparse.ArgumentParser) -> None:
    """--target, --json and --timeout: the same on every command that talks to a daemon."""
    p.add_argument("--target", default=None, help="unix:PATH or HOST:PORT (default: $KVSTORE_TARGET, "
                   "the default Unix socket, then 127.0.0.1:50051)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=seconds, default=5.0, metavar="SECONDS", help="per-call deadline")
    p.add_argument("--token-file", default=None, metavar="FILE", help="file holding the bearer token "
                   "(default: $KVSTORE_TOKEN, then the file named by $KVSTORE_TOKEN_FILE)")
    p.add_argument("--tls-ca", default=None, metavar="FILE", help="PEM roots that sign the daemon's certificate: "
                   "connect over TLS (default: $KVSTORE_TLS_CA)")
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="client certificate for mTLS ($KVSTORE_TLS_CERT)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="client key for mTLS ($KVSTORE_TLS_KEY)")


def open_client(args: argparse.Namespace) -> Any:
    from kvstore.client import Client

    return Client(args.target, timeout_s=args.timeout, token_file=args.token_file, tls_ca=args.tls_ca,
                  tls_cert=args.tls_cert, tls_key=args.tls_key)


def open_admin(args: argparse.Namespace) -> Any:
    from kvstore.client.admin import AdminClient

    return AdminClient(args.target, timeout_s=args.timeout, token_file=args.token_file, tls_ca=args.tls_ca,
                       tls_cert=args.tls_cert, tls_key=args.tls_key)


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    """`data` as one JSON document with --json, else `text` for people."""
    print(json.dumps(data, indent=2) if args.json else text)


def message_to_dict(msg: Any) -> Any:
    """Protobuf message -> plain dict, integers kept as integers (unlike proto3 JSON)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = {k: message_to_dict(v) if hasattr(v, "DESCRIPTOR") else v for k, v in value.items()}
        elif field.message_type is not None:
            value = [message_to_dict(v) for v in value] if _is_repeated(field) else message_to_dict(value)
        elif _is_repeated(field):
            value = list(value)
        out[field.name] = value
    return out


def _is_repeated(field: Any) -> bool:
    repeated = getattr(field, "is_repeated", None)
    if repeated is not None:
        return bool(repeated)
    return field.label == field.LABEL_REPEATED  # older protobuf


def message_to_record(msg: Any) -> Any:
    """`message_to_dict`, with a top-level namespace id in hex (as operators type it)."""
    out = message_to_dict(msg)
    if isinstance(out.get("namespace_id"), bytes):
        out["namespace_id"] = out["namespace_id"].hex()
    return out
