"""Who besides one user could change what a path names: the checks sshd's StrictModes
makes, shared by the daemon (its socket directory, the token file) and the SDK (the
socket it is about to send a token and blocks to).

Primitives: `foreign_component(path, uid)`, the first part of the path (as written,
symlinks included, and as resolved) owned by neither `uid` nor root, and
`open_directory(path)`, the first directory above it that its group or others may
write and that is not sticky. The owner of a directory can always chmod it and rename
its entries, and so can whoever may write it; in a sticky directory (/tmp) only an
entry's owner may rename or remove it, so a sticky world-writable parent is safe above
an entry of one's own. A missing tail is not reported: whoever creates it later is
checked by the caller when it matters.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Component:
    """One existing part of a path, and who owns it."""

    path: str
    uid: int
    is_dir: bool


def _components(path: str) -> list[tuple[str, os.stat_result]]:
    """Each existing prefix of `path` as written (lstat: a symlink is itself), then each
    of the resolved path where it differs."""
    out: list[tuple[str, os.stat_result]] = []
    seen: set[str] = set()
    for full in (os.path.abspath(path), os.path.realpath(path)):
        parts = [p for p in full.split("/") if p]
        for prefix in ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]:
            if prefix in seen:
                continue
            try:
                st = os.lstat(prefix)
            except OSError:
                break  # the rest does not exist (yet), or cannot be looked at
            seen.add(prefix)
            out.append((prefix, st))
    return out


def foreign_component(path: str, uid: int) -> Component | None:
    """The first existing part of `path`, or of the directories above it, that is owned
    by neither `uid` nor root (its owner could replace what `path` names), or None."""
    for prefix, st in _components(path):
        if st.st_uid not in (uid, 0):
            return Component(prefix, st.st_uid, stat.S_ISDIR(st.st_mode))
    return None


def open_directory(path: str) -> str | None:
    """The first directory above `path` (as written and as resolved) that its group or
    other users may write and that is not sticky, or None."""
    leaves = {os.path.abspath(path), os.path.realpath(path)}
    for prefix, st in _components(path):
        if prefix in leaves or not stat.S_ISDIR(st.st_mode):
            continue
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return prefix
    return None
