"""Shared-memory segments: a file in a tmpfs directory, mapped shared, mode 0600.

The host tier keeps its slab in one segment so that clients on the same host, running
as the same user, can map it and move block bytes with one memcpy (the local data plane).
The file's mode is the access control: 0600 means only the daemon's user (and root) can
open it, which is exactly the set of local peers that could attach to the daemon's
process anyway.

This is the daemon's side: creating, populating and removing segments. The layout
(a 4 KiB header, then the data area) and the client's attachment are the shared
protocol in `kvstore.shm`.

Segments are named `kvstore-<pid>-<random>`; at start-up the daemon removes segments
left by daemons of the same user that are no longer running (a crash leaves its file
behind, and tmpfs files hold memory until removed).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import tempfile
import weakref

from kvstore.shm import HEADER, HEADER_BYTES, MAGIC, MappedSegment

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^kvstore-(\d+)-[0-9a-f]{12}$")


def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_stale_segments(directory: str) -> int:
    """Unlink segments of this user whose daemon is gone; returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    uid = os.getuid()
    for name in names:
        m = _NAME.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed += 1
                logger.info("removed stale segment %s", path)
            except OSError:
                pass
        except (PermissionError, OSError):
            continue
    return removed


class Segment(MappedSegment):
    """A created (owned) segment: mapped read-write, unlinked on close."""

    def __init__(self, capacity_bytes: int, directory: str | None = None) -> None:
        self.directory = directory or default_shm_dir()
        self.token = secrets.token_bytes(16)
        self.name = f"kvstore-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(self.directory, self.name)
        self.capacity = capacity_bytes
        size = HEADER_BYTES + capacity_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        # The file holds memory until unlinked: make sure it goes even if close() is
        # never called (garbage collection, interpreter exit).
        self._unlink = weakref.finalize(self, _unlink_quietly, self.path)
        HEADER.pack_into(self._map, 0, MAGIC, self.token, HEADER_BYTES, capacity_bytes)
        self._view = memoryview(self._map)
        self.data = self._view[HEADER_BYTES:]

    def close(self) -> None:
        self.data.release()
        self._view.release()
        self._map.close()
        self._unlink()
