"""The `kvstore` command: `serve` runs the daemon; the rest talk to a running one.

Exit codes, the same for every command: 0 success; 1 the daemon answered with an error,
is not serving, or cannot be reached; 2 the command line is wrong (argparse).
Every client command takes `--target` (default `KVSTORE_TARGET`, then the daemon's
default Unix socket, then 127.0.0.1:50051) and `--json` for machine-readable output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from kvstore import __version__
from kvstore.errors import KVStoreError

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.server.config import load_config
    from kvstore.server.daemon import serve, tune_malloc

    try:
        config = load_config(vars(args))
    except KVStoreError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from kvstore.logs import setup_logging

    setup_logging(config.log_level, config.log_format)
    if not tune_malloc():
        logging.getLogger("kvstore").debug("malloc thresholds left as they are")
    try:
        asyncio.run(serve(config, reload=lambda: load_config(vars(args))))
    except KVStoreError as exc:
        print(f"kvstore: cannot start: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:  # a path or device the settings name is unusable
        logging.getLogger("kvstore").debug("daemon failed", exc_info=True)
        print(f"kvstore: cannot start: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def _client(args: argparse.Namespace) -> Any:
    from kvstore.client import Client

    return Client(args.target, timeout_s=args.timeout, token_file=args.token_file, tls_ca=args.tls_ca,
                  tls_cert=args.tls_cert, tls_key=args.tls_key)


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


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.client._auth import Security, sync_channel
    from kvstore.client._options import resolve_target

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
            _emit(args, {"target": target, "status": status, "detail": exc.details()}, f"{status}: {exc.details()}")
            return EXIT_ERROR
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    _emit(args, {"target": target, "status": status}, f"{status} ({target})")
    return EXIT_OK if resp.status == health_pb2.HealthCheckResponse.SERVING else EXIT_ERROR


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as kv:
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


def cmd_token_new(args: argparse.Namespace) -> int:
    import os

    from kvstore.server.auth import _valid_name, entry_text, new_token, parse_token_file

    if not _valid_name(args.tenant):
        print(f"kvstore token new: tenant name {args.tenant!r} must be 1-64 letters, digits, '-', '_' or '.'",
              file=sys.stderr)
        return EXIT_USAGE
    token, token_hash = new_token()
    entry = entry_text(args.tenant, args.role, token_hash)
    if args.file:
        if os.path.exists(args.file):
            # The file must be one the daemon would accept, and the tenant new to it.
            if args.tenant in parse_token_file(args.file).identities:
                raise KVStoreError(f"tenant {args.tenant!r} is already in {args.file}; add this hash to its "
                                   f"tokens list by hand: {token_hash}")
        fd = os.open(args.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as fh:
            fh.write("\n" + entry)
    if args.json:
        print(json.dumps({"tenant": args.tenant, "role": args.role, "token": token, "hash": token_hash,
                          "entry": entry}, indent=2))
        return EXIT_OK
    print(f"token (shown once; give it to the client, e.g. as KVSTORE_TOKEN):\n{token}\n")
    if args.file:
        print(f"appended to {args.file}; send the daemon SIGHUP (systemctl reload kvstore) to use it:\n")
    else:
        print("add to the token file (an existing tenant: append the hash to its tokens list), then send the "
              "daemon SIGHUP:\n")
    print(entry, end="")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from kvstore.cli.ops import register as register_operator_commands
    from kvstore.server.config import add_arguments

    parser = argparse.ArgumentParser(prog="kvstore", description="A tiered KV-cache store for LLM inference.")
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    add_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    def client_command(name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        add_client_options(p)
        p.set_defaults(func=func)
        return p

    health = client_command("health", "is the daemon serving? (exit 0 if so)", cmd_health)
    health.add_argument("--service", default="", help="service name to check (default: the whole server)")
    info = client_command("info", "Redis-INFO-style report", cmd_info)
    info.add_argument("section", nargs="?", help="server, tiers, stats, namespaces, config, events or tenants")
    register_operator_commands(sub, client_command)

    token = sub.add_parser("token", help="make bearer tokens for the daemon's token file")
    token_sub = token.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    new = token_sub.add_parser("new", help="print a new random token once, and the entry to add to the token file")
    new.add_argument("--tenant", required=True, help="tenant name (letters, digits, '-', '_', '.')")
    new.add_argument("--role", choices=("client", "admin"), default="client", help="client (default) or admin")
    new.add_argument("--file", metavar="TOKEN_FILE", help="also append the entry to this token file (created "
                     "0600 if missing; the tenant must not be in it yet); then send the daemon SIGHUP")
    new.add_argument("--json", action="store_true", help="machine-readable output")
    new.set_defaults(func=cmd_token_new)

    from kvstore.core import replay

    replay_cmd = sub.add_parser("replay", help="replay a Mooncake-format trace through the eviction policies")
    replay.add_arguments(replay_cmd)
    replay_cmd.set_defaults(func=replay.run)
    return parser


def add_client_options(p: argparse.ArgumentParser) -> None:
    """--target, --json and --timeout: the same on every command that talks to a daemon."""
    p.add_argument("--target", default=None, help="unix:PATH or HOST:PORT (default: $KVSTORE_TARGET, "
                   "the default Unix socket, then 127.0.0.1:50051)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="per-call deadline")
    p.add_argument("--token-file", default=None, metavar="FILE", help="file holding the bearer token "
                   "(default: $KVSTORE_TOKEN, then the file named by $KVSTORE_TOKEN_FILE)")
    p.add_argument("--tls-ca", default=None, metavar="FILE", help="PEM roots that sign the daemon's certificate: "
                   "connect over TLS (default: $KVSTORE_TLS_CA)")
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="client certificate for mTLS ($KVSTORE_TLS_CERT)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="client key for mTLS ($KVSTORE_TLS_KEY)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve" and hasattr(signal, "SIGPIPE"):
        # `kvstore stats | head` should end quietly, like any Unix filter.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return int(args.func(args))
    except KVStoreError as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
