"""`kvstore cluster`: the pool of daemons as one of them sees it (docs/cluster.md).

* `members`: the members in this daemon's view (addresses, zone, whether each owns
  units, is suspect or draining) and the state of its membership (etcd reachable or not);
* `where`: which daemons own each placement unit of a chain, named by token ids or block
  hashes in a namespace (an id from `kvstore ls`), and how much of each this daemon holds;
* `drain`: before a planned removal, hand this daemon's units off and leave the pool
  (it keeps serving its local clients until stopped).

Output and exit codes as every other command (`kvstore.cli.common`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvstore.cli.common import EXIT_ERROR, EXIT_OK, add_client_options, emit, message_to_dict, open_admin, seconds
from kvstore.cli.ops import confirm, hash_arg, namespace_arg, render_table, token_ids_arg


def _members(args: argparse.Namespace) -> int:
    with open_admin(args) as admin:
        st = admin.cluster_status()
    data = message_to_dict(st)
    if not st.enabled:
        emit(args, data, "this daemon is not one of a pool (cluster is off)")
        return EXIT_OK
    age = "never" if st.last_confirmed_age_s < 0 else f"{st.last_confirmed_age_s:.1f}s ago"
    head = (f"node {st.node_id}: {st.backend} membership, {st.state}"
            + (f" (etcd {st.endpoint}, {'reachable' if st.etcd_reachable else 'UNREACHABLE'}, confirmed {age})"
               if st.backend == "etcd" else "")
            + (", DEGRADED: serving from the last view" if st.degraded else "")
            + (", draining" if st.draining else "")
            + f"; units of {st.unit_blocks} blocks, {st.replicas} owner(s) each"
            + (", previous owners still asked" if st.in_grace else ""))
    rows = [[m.node_id + (" *" if m.self else ""), ",".join(m.addresses) or "-", m.zone or "-",
             "yes" if m.placed else "no", f"yes ({m.suspect_for_s:.1f}s)" if m.suspect else "no",
             "yes" if m.draining else "no"] for m in st.members]
    text = head + "\n" + render_table("", ["node", "addresses", "zone", "owns units", "suspect", "draining"], rows)
    emit(args, data, text)
    return EXIT_OK


def _where(args: argparse.Namespace) -> int:
    from kvstore.v1 import kvstore_pb2

    if args.tokens is None and not args.hashes:
        print("kvstore cluster where: name the chain with --tokens or --hashes", file=sys.stderr)
        return EXIT_ERROR
    if args.tokens is not None:
        keys = kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=args.tokens), packed_reply=True)
    else:
        keys = kvstore_pb2.BlockKeys(packed_hashes=b"".join(args.hashes))
    with open_admin(args) as admin:
        resp = admin.cluster_where(kvstore_pb2.Namespace(id=args.namespace), keys)
    data: dict[str, Any] = {"node_id": resp.node_id, "namespace_id": resp.namespace_id.hex(), "units": [
        {"start": u.start, "stop": u.stop, "key": u.key.hex(), "owners": list(u.owners),
         "lookup_targets": list(u.lookup_targets), "held_here": u.held_here} for u in resp.units]}
    rows = [[f"{u.start}-{u.stop - 1}", u.key.hex()[:16], ",".join(u.owners), ",".join(u.lookup_targets),
             f"{u.held_here}/{u.stop - u.start}"] for u in resp.units]
    text = (f"as node {resp.node_id} sees it, namespace {resp.namespace_id.hex()}:\n"
            + render_table("", ["blocks", "unit key", "owners", "looked up on", "held here"], rows))
    if not resp.units:
        text += ("\nno placement unit: the chain is shorter than one block" if args.tokens is not None
                 else "\nno placement unit")
    emit(args, data, text)
    return EXIT_OK


def _drain(args: argparse.Namespace) -> int:
    # As `kvstore flush` asks: whatever standard input is (a script's closed or empty
    # input answers no), never drain without a yes.
    if not args.yes and not confirm(f"Drain {args.target or 'the daemon'}: hand its units off and leave the pool?"):
        print("kvstore cluster drain: not confirmed; nothing drained (pass --yes to skip the question)",
              file=sys.stderr)
        return EXIT_ERROR
    with open_admin(args) as admin:
        resp = admin.cluster_drain(args.drain_timeout)
    emit(args, message_to_dict(resp), _drained(resp))
    return EXIT_OK if resp.left and not resp.units_failed else EXIT_ERROR


def _drained(resp: Any) -> str:
    """What a drain did, and what becomes of the units it could not hand off."""
    text = (f"pushed {resp.units_pushed} units ({resp.blocks_pushed} blocks) to their next owners, "
            f"{resp.units_failed} not" + (f", {resp.units_gone} no longer held" if resp.units_gone else "")
            + f"; {'left the pool' if resp.left else 'still in the pool'}")
    if resp.units_failed:
        text += (f"\n{resp.units_failed} units could not be handed off (no next owner reachable or willing, or out "
                 "of time: --drain-timeout): their blocks stay on this daemon, served to its own clients; the other "
                 "nodes find them here only while they still ask it as a previous owner (cluster_grace_s, "
                 "while this daemon runs), and miss them after that until an engine computes them again")
    return text


def register(sub: Any) -> None:
    """Add `kvstore cluster ...` to the CLI's subparsers."""
    group = sub.add_parser("cluster", help="the pool of daemons: members, where a prefix lives, drain")
    actions = group.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)

    def action(name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=help_text)
        add_client_options(p)
        p.set_defaults(func=func)
        return p

    action("members", "the members in this daemon's view and its membership state", _members)
    where = action("where", "which daemons own each placement unit of a chain", _where)
    where.add_argument("namespace", type=namespace_arg, metavar="NAMESPACE_ID", help="namespace id in hex "
                       "(see `kvstore ls`)")
    where.add_argument("--tokens", type=token_ids_arg, metavar="IDS", help="the chain's token ids from its "
                       "start, comma- or space-separated")
    where.add_argument("--hashes", type=hash_arg, nargs="+", metavar="BLOCK_HASH", help="the chain's block "
                       "hashes in hex, from its first block")
    drain = action("drain", "hand this daemon's units to their next owners and leave the pool", _drain)
    drain.add_argument("--drain-timeout", type=seconds, default=60.0, metavar="SECONDS",
                       help="how long the hand-off may take (default 60)")
    drain.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
