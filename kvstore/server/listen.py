"""Where the daemon listens, and what exposing it beyond this host requires.

Primitives: `ListenAddress`, `parse_listen(text)`, `check_exposure(config)` (the listen
and metrics addresses, refused when they would expose the daemon without a token file,
TLS or the operator's explicit consent), `tls_credentials(config)`,
`prepare_unix_path(path, shared_dir)` (its directory made 0700, or checked when it
exists; a stale socket cleared, a live one refused), `bind(server, addr, tls,
shared_dir)` (a Unix socket is created owner-only, then made 0600).

Safe by default: a Unix socket and loopback TCP need nothing; any other TCP address
needs authentication, and TLS unless `insecure_remote`; the metrics endpoint has no
authentication, so it leaves loopback only with `metrics_remote`.

A Unix socket is only as private as its directory: whoever owns the directory, or may
write it, can put a socket of their own in its place and read what clients send it
(tokens, blocks). So, as sshd's StrictModes does for `~/.ssh`, the socket directory
must be the daemon's uid's or root's and writable by nobody else, and so must every
directory above it, where a sticky world-writable one (/tmp) is fine.
`unix_socket_shared_dir` accepts a directory others may write (a Kubernetes emptyDir);
one another user owns is refused in any case.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass

import grpc

from kvstore.addresses import is_loopback
from kvstore.errors import ConfigError
from kvstore.pathsafety import foreign_component, open_directory
from kvstore.server.config import Config

# While grpc creates a Unix socket: no access for group or others.
UNIX_SOCKET_UMASK = 0o077


@dataclass(frozen=True, slots=True)
class ListenAddress:
    kind: str  # "unix" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    @property
    def grpc_target(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_listen(addr: str) -> ListenAddress:
    """`unix:PATH`, `unix:///PATH`, `HOST:PORT` or `[V6]:PORT` -> `ListenAddress`."""
    if addr.startswith("unix:"):
        path = addr[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ConfigError(f"listen address {addr!r} has no socket path; write unix:/path/to/kvstore.sock")
        return ListenAddress("unix", path=os.path.abspath(path))
    host, sep, port_text = addr.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"listen address {addr!r} is neither unix:PATH nor HOST:PORT")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"listen address {addr!r} has a port that is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"listen address {addr!r}: port must be in [0, 65535]")
    return ListenAddress("tcp", host=host, port=port)


def check_exposure(config: Config) -> tuple[list[ListenAddress], ListenAddress | None]:
    """The listen and metrics addresses, refused when they expose the daemon beyond this
    host without what that needs: a token file for gRPC, and TLS unless `insecure_remote`;
    `metrics_remote` for the (unauthenticated) metrics endpoint."""
    addresses = [parse_listen(a) for a in config.listen]
    for addr in addresses:
        if addr.kind != "tcp" or is_loopback(addr.host):
            continue
        if not config.auth_token_file:
            raise ConfigError(
                f"listen address {addr.grpc_target} is not loopback, and serving other hosts needs "
                "authentication: set --auth-token-file (tokens from `kvstore token new`; see SECURITY.md)"
            )
        if not config.tls_cert and not config.insecure_remote:
            raise ConfigError(
                f"listen address {addr.grpc_target} is not loopback and TLS is off, so tokens would cross the "
                "network in clear text: set --tls-cert and --tls-key, or --insecure-remote on a trusted network"
            )
    metrics_addr = None
    if config.metrics_listen.strip().lower() != "off":
        metrics_addr = parse_listen(config.metrics_listen)
        if metrics_addr.kind != "tcp":
            raise ConfigError(f"metrics_listen {config.metrics_listen!r} must be HOST:PORT or 'off'")
        if not is_loopback(metrics_addr.host) and not config.metrics_remote:
            raise ConfigError(
                f"metrics_listen {config.metrics_listen!r} is not loopback and the metrics endpoint has no "
                "authentication: set --metrics-remote to serve it to other hosts, or use a loopback address"
            )
    return addresses, metrics_addr


def _read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None


def tls_credentials(config: Config) -> grpc.ServerCredentials | None:
    """The TCP listeners' TLS credentials (None: TLS off); with `tls_client_ca`, clients
    must present a certificate it signed."""
    if not config.tls_cert:
        return None
    client_ca = _read_pem(config.tls_client_ca, "tls_client_ca") if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(_read_pem(config.tls_key, "tls_key"), _read_pem(config.tls_cert, "tls_cert"))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def check_socket_directory(directory: str, shared_dir: bool = False) -> None:
    """Refuse a socket directory another user could put a socket of their own in (see the
    module docstring)."""
    uid = os.geteuid()
    foreign = foreign_component(directory, uid)
    if foreign is not None:
        what = (f"socket directory {directory}" if foreign.path in (directory, os.path.realpath(directory))
                else f"{foreign.path}, above the socket directory {directory},")
        raise ConfigError(
            f"{what} is owned by uid {foreign.uid}, not this daemon's uid {uid} or root: another user made it and "
            "could swap the socket for one of their own to read clients' tokens and data. Remove it (as root) or "
            "choose another --listen path (or set XDG_RUNTIME_DIR)"
        )
    if shared_dir:
        return
    mode = stat.S_IMODE(os.stat(directory).st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"socket directory {directory} may be written by {'other users' if mode & stat.S_IWOTH else 'its group'} "
            f"(mode {mode:04o}), who could swap the socket for one of their own: run `chmod 700 {directory}`, "
            "choose another --listen path, or set unix_socket_shared_dir = true if everyone who may write it is "
            "trusted (a Kubernetes emptyDir shared by containers of one uid)"
        )
    parent = open_directory(directory)
    if parent is not None:
        raise ConfigError(
            f"socket directory {directory} is inside {parent}, which its group or other users may write and which "
            "is not sticky: they could move the socket directory away and put their own in its place. Choose a "
            f"--listen path under private directories, or `chmod o-w,g-w {parent}` (or +t)"
        )


def prepare_unix_path(path: str, shared_dir: bool = False) -> None:
    """Create the socket's directory (0700) or check the one there, and clear a stale
    socket, refusing a live one."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create socket directory {directory}: {exc.strerror}") from None
    check_socket_directory(directory, shared_dir)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path} exists and is not a socket; choose another --listen path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            _remove_stale(path)  # left behind by a daemon that did not shut down cleanly
            return
        raise ConfigError(f"cannot check socket {path}: {exc.strerror}") from None
    else:
        raise ConfigError(f"{path} is in use by another running daemon; stop it or choose another --listen path")
    finally:
        probe.close()


def _remove_stale(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot remove the stale socket {path}: {exc.strerror}; remove it or choose another "
                          "--listen path") from None


def bind(server: grpc.aio.Server, addr: ListenAddress, tls: grpc.ServerCredentials | None,
         shared_dir: bool = False) -> str:
    """Add `addr` to `server` (TLS on TCP when `tls`); returns the target bound (a TCP
    port 0 resolved). A Unix socket is made 0600 (in a directory `prepare_unix_path`
    checked); the caller removes it once the server has stopped."""
    if addr.kind == "unix":
        prepare_unix_path(addr.path, shared_dir)
    try:
        if addr.kind == "tcp" and tls is not None:
            port = server.add_secure_port(addr.grpc_target, tls)
        elif addr.kind == "tcp":
            port = server.add_insecure_port(addr.grpc_target)
        else:
            # grpc binds and listens inside add_insecure_port, before the chmod below: with
            # this umask the socket is the owner's alone from the moment it exists. The
            # umask is the whole process's, so it is held only around this one call, and
            # 0o077 still gives files other threads create meanwhile to their owner.
            old_umask = os.umask(UNIX_SOCKET_UMASK)
            try:
                port = server.add_insecure_port(addr.grpc_target)
            finally:
                os.umask(old_umask)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {addr.grpc_target}: {exc}; is it in use? choose another --listen") from None
    if addr.kind == "unix":
        os.chmod(addr.path, 0o600)
        return addr.grpc_target
    if port == 0:
        raise ConfigError(f"cannot listen on {addr.grpc_target}: address in use or not available")
    return ListenAddress("tcp", host=addr.host, port=port).grpc_target
