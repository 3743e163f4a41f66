"""The SDK's check of a daemon's Unix socket before anything is sent to it.

Whoever owns the socket file, or a directory on its path, could have put a socket of
their own there, relaying calls to read the bearer token and the blocks sent, or
answering with blocks of its own. So the socket and every directory above it (as
written and as resolved) must belong to this process's uid or root, the uids a daemon
this process may trust runs as. The check runs where a channel is made; a socket that
does not exist yet is checked only as far as its path exists. The control lane also
reads the daemon's peer credentials on each connection (`kvstore.client.control_lane`).

Primitive: `check_unix_target(target)`.
"""

from __future__ import annotations

import os

from kvstore.errors import PermissionDenied
from kvstore.pathsafety import foreign_component


def check_unix_target(target: str) -> None:
    """Refuse a `unix:` gRPC target that another local user could have put in place
    (`PermissionDenied`: retrying cannot help, and no call has been sent)."""
    if not target.startswith("unix:"):
        return
    path = target[len("unix:"):]
    if path.startswith("//"):
        path = path[2:]
    me = os.geteuid()
    foreign = foreign_component(path, me)
    if foreign is None:
        return
    what = "the socket" if not foreign.is_dir else f"its directory {foreign.path}"
    raise PermissionDenied(
        f"refusing to use the daemon socket {path}: {what} is owned by uid {foreign.uid}, not this process's uid "
        f"{me} or root, so another user could be serving it to read tokens and data. Use the socket of a daemon "
        "run by your uid in a directory only it can write (e.g. $XDG_RUNTIME_DIR/kvstore)"
    )
