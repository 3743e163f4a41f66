"""Where a daemon listens by default, shared by the daemon and the SDK.

Primitives: `DEFAULT_TCP_LISTEN`, `runtime_dir()`, `default_unix_socket()`, `is_loopback(host)`. The SDK uses
them to find a local daemon without importing the daemon's configuration.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile

DEFAULT_TCP_LISTEN = "127.0.0.1:50051"


def runtime_dir() -> str:
    """Where the daemon's Unix socket lives by default: $XDG_RUNTIME_DIR/kvstore, else a
    per-user directory under the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return os.path.join(base, "kvstore")
    return os.path.join(tempfile.gettempdir(), f"kvstore-{os.getuid()}")


def default_unix_socket() -> str:
    return os.path.join(runtime_dir(), "kvstore.sock")


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 without brackets) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
