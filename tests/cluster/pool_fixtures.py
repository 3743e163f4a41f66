"""Real daemons forming a pool, for the cluster tests.

* In-process: `pool(tmp_path, n, ...)` starts `n` daemons on the test's event loop, each
  on a Unix socket and a loopback TCP port, joined by a static peer list or by etcd (the
  module's `etcd` fixture), and stops them at the end whatever happened.
* Subprocesses inside network namespaces (`NetworkHosts`): `serve_args` builds the
  `kvstore serve` command line of one host's daemon (token file, the node's credential,
  etcd on the switch), `start_in_host` starts it and waits until it answers on its Unix
  socket, which the test reaches from the root namespace (Unix sockets and /dev/shm do
  not depend on the network namespace: the test's clients are co-located engines).
* `Tokens`: a token file with an admin tenant for the Unix socket, client tenants, one
  credential per node (`per_node` hands each daemon its own) and a shared one of the
  form before per-node credentials.
* `chain(layout, n, seed)`: token ids and block payloads that are distinct per seed, so
  a wrong block can never compare equal to the expected one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from conftest import make_config

from kvstore.client.admin import AdminClient
from kvstore.layout import KVLayout
from kvstore.server.auth import new_token
from kvstore.server.daemon import Daemon
from tests.procs import DaemonProc, start

# Generous for a shared, loaded test machine; tests of the deadline set their own.
LOOKUP_TIMEOUT_MS = 1000.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reserve_port() -> socket.socket:
    """A loopback port held by a bound socket that gRPC can bind beside (SO_REUSEPORT)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def chain(layout: KVLayout, n: int, seed: int) -> tuple[list[int], list[bytes]]:
    """`n` blocks of token ids (distinct per seed) and their payloads (a function of the
    seed and the block's position, never equal across seeds or positions)."""
    bst = layout.block_size_tokens
    tokens = [(seed * 1_000_003 + i) % 4_000_000_000 for i in range(n * bst)]
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 256, layout.bytes_per_block, dtype=np.uint8).tobytes() for _ in range(n)]
    return tokens, payloads


@contextlib.asynccontextmanager
async def pool(tmp_path: Path, n: int, *, etcd: str = "", prefix: str = "", first: int = 0,
               per_node: Sequence[dict[str, Any]] = (), **overrides: Any) -> AsyncIterator[list[Daemon]]:
    """`n` daemons n{first}..: a static pool on loopback, or one on etcd (`etcd` endpoint);
    `per_node[i]`: settings of the i-th daemon alone."""
    # Each port is held (SO_REUSEPORT, as gRPC binds) until its daemon listens on it, so
    # the ports the first daemons' lanes take (the system's choice) cannot be these.
    held = [reserve_port() for _ in range(n)]
    ports = [sock.getsockname()[1] for sock in held]
    ids = [f"n{first + i}" for i in range(n)]
    peers = tuple(f"{node}=127.0.0.1:{port}" for node, port in zip(ids, ports))
    started: list[Daemon] = []
    try:
        for i, (node, port) in enumerate(zip(ids, ports)):
            d = tmp_path / node
            d.mkdir(exist_ok=True)
            cluster: dict[str, Any] = {"cluster_etcd": (etcd,), "cluster_prefix": prefix,
                                       "cluster_lease_ttl_s": 2} if etcd else {"cluster_peers": peers}
            options = {"cluster_lookup_timeout_ms": LOOKUP_TIMEOUT_MS, **cluster, **overrides,
                       **(per_node[i] if i < len(per_node) else {})}
            cfg = make_config(d, listen=(f"unix:{d / 'kv.sock'}", f"127.0.0.1:{port}"), cluster=True,
                              node_id=node, **options)
            daemon = Daemon(cfg)
            await daemon.start()
            held[i].close()
            started.append(daemon)
        yield started
    finally:
        for sock in held:
            sock.close()
        for daemon in reversed(started):
            await daemon.stop(grace_s=0)


def unix_target(daemon: Daemon) -> str:
    return daemon.bound[0]


def info(daemon: Daemon) -> dict[str, str]:
    """The `# Cluster` section of the daemon's INFO, as a dict."""
    from kvstore.server.cluster import info_section

    out = {}
    for line in info_section(daemon.cluster).splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value
    return out


class Tokens:
    """A token file: `ops` (admin, the Unix socket's tenant, local plane), client
    tenants, one credential per pool node (`node.n0`, ... with `node = "n0"`: what each
    daemon presents to the others, in `node_file(node)`), and `pool`, a peer credential
    that names no node (the shared form that came before per-node credentials, in
    `peer_file`)."""

    def __init__(self, path: Path, clients: Sequence[str] = ("alpha", "beta"),
                 nodes: Sequence[str] = tuple(f"n{i}" for i in range(6))) -> None:
        self.path = path
        self.tokens: dict[str, str] = {}
        self.entries: dict[str, str] = {}
        for name, role, extra in (("ops", "admin", "local_plane = true\n"), *((c, "client", "local_plane = true\n")
                                                                             for c in clients), ("pool", "peer", ""),
                                  *((f"node.{n}", "peer", f'node = "{n}"\n') for n in nodes)):
            token, token_hash = new_token()
            self.tokens[name] = token
            self.entries[name] = f'[[tenant]]\nname = "{name}"\nrole = "{role}"\ntokens = ["{token_hash}"]\n{extra}'
        self.write()
        self.peer_file = self._secret("peer.token", self.tokens["pool"])
        self.node_files = {n: self._secret(f"{n}.token", self.tokens[f"node.{n}"]) for n in nodes}

    def write(self, path: Path | None = None, without: Sequence[str] = ()) -> Path:
        """The token file (at `path`, else this one's), leaving out the entries `without`."""
        path = path or self.path
        path.write_text("\n".join(e for name, e in self.entries.items() if name not in without))
        os.chmod(path, 0o600)
        return path

    def _secret(self, name: str, token: str) -> Path:
        path = self.path.with_name(name)
        path.write_text(token + "\n")
        os.chmod(path, 0o600)
        return path

    def node(self, node: str) -> str:
        """Node `node`'s credential."""
        return self.tokens[f"node.{node}"]

    def node_file(self, node: str) -> Path:
        return self.node_files[node]

    def per_node(self, n: int, first: int = 0) -> list[dict[str, Any]]:
        """`pool(per_node=...)` settings: each daemon presents its own credential."""
        return [{"cluster_token_file": str(self.node_file(f"n{first + i}"))} for i in range(n)]


def serve_args(sock: Path, tcp: str, node_id: str, etcd: str, prefix: str, tokens: Tokens, *extra: str) -> list[str]:
    """`kvstore serve` for one host of a netns pool (a non-loopback listener: token file,
    the node's own credential, plain TCP on the test's private bridge)."""
    return [sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix:{sock},{tcp}", "--grace-s", "1",
            "--log-level", "warning", "--metrics-listen", "off", "--host-capacity", "64MiB",
            "--auth-token-file", str(tokens.path), "--unix-socket-tenant", "ops", "--insecure-remote",
            "--cluster", "--cluster-etcd", etcd, "--cluster-prefix", prefix, "--cluster-lease-ttl-s", "2",
            "--node-id", node_id, "--cluster-token-file", str(tokens.node_file(node_id)), *extra]


def start_in_host(hosts: Any, i: int, args: list[str], sock: Path, log: Path) -> DaemonProc:
    """Start a daemon inside host `i`'s namespace (`ip netns exec` execs it: same pid)."""
    return start(hosts.command(i, args), sock, log)


def members_of(target: str) -> set[str]:
    with AdminClient(target, timeout_s=5) as admin:
        return {m.node_id for m in admin.cluster_status().members}


def wait_members(target: str, want: set[str], timeout_s: float) -> float:
    """Poll a daemon's view until it is `want`; the seconds it took (AssertionError past timeout)."""
    began = time.monotonic()
    seen: set[str] = set()
    while time.monotonic() - began < timeout_s:
        seen = members_of(target)
        if seen == want:
            return time.monotonic() - began
        time.sleep(0.05)
    raise AssertionError(f"{target}: members {sorted(seen)} after {timeout_s:g}s, expected {sorted(want)}")


def with_overrides(daemon: Daemon, **changes: Any) -> Any:
    return replace(daemon.config, **changes)
