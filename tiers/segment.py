"""Shared-memory segments: a file in a tmpfs directory, mapped shared, mode 0600; or,
for memory only some clients may map, an anonymous file no path leads to.

The host tier keeps its slab in segments so that clients on the same host can map them
and move block bytes with one memcpy (the local data plane). Two kinds:
- Named (`Segment(capacity, directory)`): a file in a tmpfs directory. Its mode is the
  access control: 0600 means only the daemon's user (and root) can open it, which is
  exactly the set of local peers that could attach to the daemon's process anyway. With
  auth off (one tenant) the host tier is one such segment, mapped by path.
- Anonymous (`Segment(capacity, anonymous=True)`): a `memfd_create` file, which no path
  names, handed to a client as a file descriptor (the control lane passes it with
  SCM_RIGHTS). With auth on, the host tier keeps one per tenant, so a client maps its own
  tenant's blocks and nothing else. Sealed against shrinking and growing: a client holding
  the descriptor cannot truncate the file under the daemon's mapping (which would fault
  the daemon). The daemon keeps the descriptor open (`fd`) to hand it out; a process that
  could read the daemon's /proc could reach it, which is why the daemon makes itself
  non-dumpable when auth is on (`kvstore.server.daemon.serve`). Sparse: pages exist only
  where blocks landed; `punch` gives a range's memory back to the kernel.

This is the daemon's side: creating, populating and removing segments. The layout
(a 4 KiB header, then the data area) and the client's attachment are the shared
protocol in `kvstore.shm`.

Segments are named `kvstore-<pid>-<random>`; at start-up the daemon removes named
segments left by daemons of the same user that are no longer running (a crash leaves its
file behind, and tmpfs files hold memory until removed). Anonymous ones go with the last
descriptor and mapping.
"""

from __future__ import annotations

import fcntl
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


def _release(fd: int, path: str) -> None:
    """What a segment's file needs to go: its descriptor closed, or its name unlinked."""
    if fd >= 0:
        os.close(fd)
    if path:
        _unlink_quietly(path)


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


# memfd_create(2) flags; MFD_NOEXEC_SEAL (Linux 6.3) keeps the kernel from warning
# about executable memfds, and is retried without on kernels that lack it.
MFD_NOEXEC_SEAL = getattr(os, "MFD_NOEXEC_SEAL", 0x0008)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _memfd(name: str) -> int:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        return os.memfd_create(name, flags | MFD_NOEXEC_SEAL)
    except OSError:
        return os.memfd_create(name, flags)


class Segment(MappedSegment):
    """A created (owned) segment, mapped read-write: a named file unlinked on close, or
    (`anonymous`) a memfd whose descriptor `fd` the daemon keeps to hand to clients."""

    def __init__(self, capacity_bytes: int, directory: str | None = None, anonymous: bool = False) -> None:
        self.directory = "" if anonymous else directory or default_shm_dir()
        self.token = secrets.token_bytes(16)
        self.name = f"kvstore-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = "" if anonymous else os.path.join(self.directory, self.name)
        self.capacity = capacity_bytes
        self.fd = -1
        size = HEADER_BYTES + capacity_bytes
        fd = _memfd(self.name) if anonymous else os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            if anonymous:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if not anonymous:
                os.unlink(self.path)
            raise
        if anonymous:
            self.fd = fd
        else:
            os.close(fd)
        # The file holds memory until unlinked (or, anonymous, until its last descriptor
        # and mapping go): make sure that happens even if close() is never called.
        self._unlink = weakref.finalize(self, _release, self.fd, self.path)
        HEADER.pack_into(self._map, 0, MAGIC, self.token, HEADER_BYTES, capacity_bytes)
        self._view = memoryview(self._map)
        self.data = self._view[HEADER_BYTES:]

    def punch(self, start: int, length: int) -> None:
        """Give the memory of data bytes `[start, start + length)` back to the kernel (both
        page-aligned); they read as zeros afterwards, in every mapping."""
        self._map.madvise(mmap.MADV_REMOVE, HEADER_BYTES + start, length)

    @property
    def resident_bytes(self) -> int:
        """Memory the segment's file holds (its pages in the kernel, header included)."""
        st = os.fstat(self.fd) if self.fd >= 0 else os.stat(self.path)
        return st.st_blocks * 512

    def close(self) -> None:
        self.data.release()
        self._view.release()
        self._map.close()
        self._unlink()
