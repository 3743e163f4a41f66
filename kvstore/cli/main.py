"""The `kvstore` command: `serve` runs the daemon; the rest talk to a running one.

This module builds the parser and dispatches; the commands live in `serve` (the
daemon's side), `ops` (operator commands over the admin SDK), `top` and `cluster` (the
pool of daemons). Exit codes and
the client options are in `common`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any

from kvstore import __version__
from kvstore.cli.cluster import register as register_cluster_commands
from kvstore.cli.common import EXIT_ERROR, add_client_options
from kvstore.cli.ops import cmd_health, cmd_info
from kvstore.cli.ops import register as register_operator_commands
from kvstore.cli.serve import cmd_serve, cmd_token_new
from kvstore.errors import KVStoreError


def build_parser() -> argparse.ArgumentParser:
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
    info.add_argument("section", nargs="?", help="server, tiers, stats, namespaces, config, events, tenants or "
                      "cluster (a node of a pool)")
    register_operator_commands(sub, client_command)
    register_cluster_commands(sub)

    token = sub.add_parser("token", help="make bearer tokens for the daemon's token file")
    token_sub = token.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    new = token_sub.add_parser("new", help="print a new random token once, and the entry to add to the token file")
    new.add_argument("--tenant", help="tenant name (letters, digits, '-', '_', '.'); required but with --node")
    new.add_argument("--role", choices=("client", "admin", "peer"), default="client",
                     help="client (default), admin, or peer (a cluster credential for calls between daemons)")
    new.add_argument("--node", metavar="NODE_ID", help="a pool node's own credential (role peer, entry "
                     "node.NODE_ID unless --tenant): its cluster_token_file, listed in every node's token file")
    new.add_argument("--file", metavar="TOKEN_FILE", help="also append the entry to this token file (created "
                     "0600 if missing; the tenant must not be in it yet); then send the daemon SIGHUP")
    new.add_argument("--local-plane", action="store_true", help="the tenant's engines on the daemon's host may map "
                     "its shared-memory segment (local_plane = true); without it their block bytes go through gRPC")
    new.add_argument("--quota", action="append", metavar="TIER=SIZE", help="bytes the tenant may hold in a tier, "
                     "e.g. host=8GiB,ssd=200GiB (repeatable)")
    new.add_argument("--json", action="store_true", help="machine-readable output")
    new.set_defaults(func=cmd_token_new)

    from kvstore.cli import replay

    replay_cmd = sub.add_parser("replay", help="replay a Mooncake-format trace through the eviction policies")
    replay.add_arguments(replay_cmd)
    replay_cmd.set_defaults(func=replay.run)
    return parser


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
