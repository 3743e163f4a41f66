"""The daemon-side commands: `kvstore serve` (also `python server.py`) and `kvstore token new`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from kvstore.cli.common import EXIT_ERROR, EXIT_OK, EXIT_USAGE
from kvstore.errors import KVStoreError


def cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.server.config import load_config
    from kvstore.server.daemon import serve
    from kvstore.server.host_resources import tune_malloc

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


def cmd_token_new(args: argparse.Namespace) -> int:
    import os

    from kvstore.server.auth import _NODE_ID, _valid_name, entry_text, new_token, parse_token_file

    node = getattr(args, "node", None) or ""
    if node:
        if not _NODE_ID.fullmatch(node):
            print(f"kvstore token new: node id {node!r} must be 1-63 letters, digits, '.', '_' or '-', starting with "
                  "a letter or digit", file=sys.stderr)
            return EXIT_USAGE
        args.role = "peer"
        args.tenant = args.tenant or f"node.{node}"
    if not args.tenant:
        print("kvstore token new: name the tenant (--tenant NAME), or the pool node (--node NODE_ID)", file=sys.stderr)
        return EXIT_USAGE
    if not _valid_name(args.tenant):
        print(f"kvstore token new: tenant name {args.tenant!r} must be 1-64 letters, digits, '-', '_' or '.'",
              file=sys.stderr)
        return EXIT_USAGE
    grants = _grants(args)
    if grants is None:
        return EXIT_USAGE
    token, token_hash = new_token()
    entry = entry_text(args.tenant, args.role, token_hash, node) + grants
    if args.file:
        if os.path.exists(args.file):
            # The file must be one the daemon would accept, and the tenant new to it.
            table = parse_token_file(args.file)
            if node and any(i.node == node for i in table.identities.values()):
                raise KVStoreError(f"node {node!r} already has a credential in {args.file}; add this hash to its "
                                   f"entry's tokens list by hand: {token_hash}")
            if args.tenant in table.identities:
                raise KVStoreError(f"tenant {args.tenant!r} is already in {args.file}; add this hash to its "
                                   f"tokens list by hand: {token_hash}")
        fd = os.open(args.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as fh:
            fh.write("\n" + entry)
    if args.json:
        print(json.dumps({"tenant": args.tenant, "role": args.role, "node": node, "token": token,
                          "hash": token_hash, "local_plane": bool(args.local_plane), "entry": entry}, indent=2))
        return EXIT_OK
    if node:
        print(f"token (shown once; node {node}'s credential: put it alone in a file of mode 0600 and give that "
              f"file to node {node}'s daemon as cluster_token_file):\n{token}\n")
    else:
        print(f"token (shown once; give it to the client, e.g. as KVSTORE_TOKEN):\n{token}\n")
    if args.file:
        print(f"appended to {args.file}; send the daemon SIGHUP (systemctl reload kvstore) to use it:\n")
    else:
        print("add to the token file (an existing tenant: append the hash to its tokens list), then send the "
              "daemon SIGHUP:\n")
    print(entry, end="")
    if args.role != "peer" and not args.local_plane:
        print("\n(no local_plane: this tenant's engines on the daemon's host move block bytes through gRPC or the "
              "data lane, not shared memory; give it --local-plane, or add `local_plane = true` to the entry)")
    return EXIT_OK


def _grants(args: argparse.Namespace) -> str | None:
    """The entry's lines for `--local-plane` and `--quota`; None (after saying why) when a
    quota is malformed."""
    from kvstore.server.auth import QUOTA_TIERS
    from kvstore.units import parse_size

    lines = ""
    if args.local_plane:
        if args.role == "peer":
            print("kvstore token new: --local-plane is for client and admin tenants (a peer credential maps "
                  "no memory)", file=sys.stderr)
            return None
        lines += "local_plane = true\n"
    quota: dict[str, str] = {}
    for item in args.quota or ():
        for part in filter(None, (p.strip() for p in item.split(","))):
            tier, sep, size = part.partition("=")
            tier, size = tier.strip(), size.strip()
            if not sep or tier not in QUOTA_TIERS:
                print(f"kvstore token new: --quota {part!r}: write TIER=SIZE with TIER one of "
                      f"{', '.join(QUOTA_TIERS)}, e.g. host=8GiB", file=sys.stderr)
                return None
            try:
                parse_size(size)
            except (KVStoreError, ValueError) as exc:
                print(f"kvstore token new: --quota {part!r}: {exc}", file=sys.stderr)
                return None
            quota[tier] = size
    if quota:
        lines += "quota = { " + ", ".join(f'{tier} = "{size}"' for tier, size in quota.items()) + " }\n"
    return lines
