"""Where a daemon listens by default, shared by the daemon and the SDK.

Primitives: `DEFAULT_TCP_LISTEN`, `runtime_dir()`, `default_unix_socket()`, `is_loopback(host)`,
`dial_problem(address)`. The SDK uses them to find a local daemon without importing the
daemon's configuration.
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


def dial_problem(address: str) -> str | None:
    """What keeps `address` from being dialed as another daemon's (`HOST:PORT`, `[V6]:PORT`
    or `unix:PATH`), in words; None if nothing does. A wildcard host (0.0.0.0, ::) is
    where a daemon listens, not where one is reached."""
    if address.startswith("unix:"):
        return None if address[len("unix:"):].lstrip("/") else "a unix: address needs a socket path"
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        return "it is not HOST:PORT"
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        return "an IPv6 host is written in brackets, [V6]:PORT"
    if not 1 <= int(port_text) <= 65535:
        return f"port {port_text} is not in [1, 65535]"
    if host.strip("[]") in ("0.0.0.0", "::"):
        return f"{host} is a wildcard (where a daemon listens), not an address to reach one at"
    return None
