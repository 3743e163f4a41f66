"""How many client connections the daemon holds, and for how long.

Every connection costs a file descriptor, and the descriptors are the daemon's, shared
with its SSD region files, its segments and its listeners. Past the limit accept()
fails, health checks time out and every call with them; loopback TCP is open to every
user of the host, so any of them could get there with idle connections. So:

- at start the soft RLIMIT_NOFILE is raised to the hard limit (`raise_open_file_limit`);
- each listener (each gRPC address, each control lane) holds at most `max_connections`
  connections, fewer when the descriptors left once the tiers are open do not cover
  that for every listener with room to spare (`fit_connection_limits`); gRPC closes a
  connection past its cap as soon as it accepts it, the lane first drops the oldest one
  that has not said hello yet;
- a connection that has not finished its handshake (HTTP/2 preface, TLS, the lane's
  hello) within `handshake_timeout_s`, or has carried no call for `connection_idle_s`,
  is closed (clients reconnect on their next call); a gRPC connection with calls open
  that has been silent for `keepalive_s` is pinged, and closed when the ping is not
  answered (a client that vanished).

Primitives: `raise_open_file_limit()`, `open_file_count()`, `ConnectionLimits`,
`fit_connection_limits(config, listeners)`, `grpc_server_options(limits)`.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from typing import Any

from kvstore.server.config import Config

logger = logging.getLogger(__name__)

# Descriptors kept free of connections: files the daemon opens as it runs (SSD snapshots,
# client segments it maps, the metrics endpoint's connections), at least this many or
# this fraction of the limit.
SPARE_FDS = 32
SPARE_FRACTION = 8
# A listener serves at least this many connections, however low the limit.
MIN_CONNECTIONS = 4
# How long an unanswered keepalive ping may take before the connection is closed.
KEEPALIVE_TIMEOUT_S = 20.0
# Where /proc does not say how many descriptors are open.
ASSUMED_OPEN_FDS = 64


def _nr_open() -> int:
    """The kernel's ceiling on a process's descriptors (what an unlimited hard limit means)."""
    try:
        with open("/proc/sys/fs/nr_open") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return 1 << 20


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one (logged); returns the soft limit
    in force. A limit that cannot be raised is kept, with a warning."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _nr_open() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
            return soft
        logger.info("raised the open-file limit from %d to %d (the hard limit)", soft, target)
        return target
    return target if soft == resource.RLIM_INFINITY else soft


def open_file_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir opened
    except OSError:
        return ASSUMED_OPEN_FDS


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int  # per listener
    handshake_timeout_s: float
    idle_s: float
    keepalive_s: float


def fit_connection_limits(config: Config, listeners: int) -> ConnectionLimits:
    """The limits from `config`, with `max_connections` lowered so that `listeners`
    listeners at their cap stay below the open-file limit, with room to spare."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = _nr_open()
    spare = max(SPARE_FDS, soft // SPARE_FRACTION)
    room = (soft - open_file_count() - spare) // max(1, listeners)
    per_listener = min(config.max_connections, max(MIN_CONNECTIONS, room))
    if per_listener < config.max_connections:
        logger.info("the open-file limit (%d) leaves room for %d connections on each of %d listeners "
                    "(max_connections %d); raise the limit (ulimit -n, LimitNOFILE) for more",
                    soft, per_listener, listeners, config.max_connections)
    return ConnectionLimits(per_listener, config.handshake_timeout_s, config.connection_idle_s, config.keepalive_s)


def grpc_server_options(limits: ConnectionLimits) -> list[tuple[str, Any]]:
    """The gRPC server's channel arguments for `limits`."""
    return [
        ("grpc.max_allowed_incoming_connections", limits.max_connections),
        ("grpc.server_handshake_timeout_ms", int(limits.handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", int(limits.idle_s * 1000)),
        ("grpc.keepalive_time_ms", int(limits.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(min(KEEPALIVE_TIMEOUT_S, limits.keepalive_s) * 1000)),
        # Keep probing a connection whose open calls send nothing (an event stream).
        ("grpc.http2.max_pings_without_data", 0),
    ]
