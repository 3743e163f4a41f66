"""Where a client connects and how: the target, the default timeout and chunk size, the
gRPC channel options (message caps, the retry policy), and the plane options.

`resolve_target` turns what a person typed into a gRPC target; `CHANNEL_OPTIONS` is what
every SDK channel is built with; `check_data_plane` / `check_control_plane` validate the
`data_plane=` / `control_plane=` arguments, and `may_be_local` says whether `auto` should
try the shared-memory plane at all.
"""

from __future__ import annotations

import json
import os

from kvstore.addresses import DEFAULT_TCP_LISTEN, default_unix_socket
from kvstore.control_lane_wire import IDEMPOTENT
from kvstore.errors import InvalidArgument
from kvstore.v1 import kvstore_pb2

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 64 << 20

# Idempotent calls (control_lane_wire.IDEMPOTENT, the one list) are retried by the channel on
# UNAVAILABLE.
_KVSTORE_METHODS = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].methods_by_name
_RETRY_METHODS = sorted(m for m in IDEMPOTENT if m in _KVSTORE_METHODS)
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "kvstore.v1.KVStore", "method": m} for m in _RETRY_METHODS]
                + [{"service": "kvstore.v1.Admin"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "0.5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.service_config", _SERVICE_CONFIG),
    ("grpc.enable_retries", 1),
]

DATA_PLANES = ("auto", "local", "lane", "grpc")
CONTROL_PLANES = ("auto", "lane", "grpc")


def resolve_target(target: str | None) -> str:
    """A gRPC target from what a person typed: unix:PATH, a socket path, or HOST:PORT.

    None means `KVSTORE_TARGET`, else the default Unix socket if a daemon made one,
    else the default TCP address.
    """
    if not target:
        target = os.environ.get("KVSTORE_TARGET", "")
    if not target:
        sock = default_unix_socket()
        return f"unix:{sock}" if os.path.exists(sock) else DEFAULT_TCP_LISTEN
    if target.startswith("/") or target.startswith("./"):
        return f"unix:{target}"
    return target


def check_control_plane(control_plane: str, target: str) -> str:
    if control_plane not in CONTROL_PLANES:
        raise InvalidArgument(f"control_plane must be one of {', '.join(CONTROL_PLANES)}, got {control_plane!r}")
    if control_plane == "lane" and not target.startswith("unix:"):
        raise InvalidArgument(f"control_plane='lane' needs a Unix socket target (unix:PATH), not {target!r}")
    return control_plane


def check_data_plane(data_plane: str) -> str:
    if data_plane not in DATA_PLANES:
        raise InvalidArgument(f"data_plane must be one of {', '.join(DATA_PLANES)}, got {data_plane!r}")
    return data_plane


def may_be_local(target: str) -> bool:
    """Whether `auto` should try the shared-memory plane: a Unix socket or a loopback
    address. The segment's token check decides for sure."""
    if target.startswith("unix:"):
        return True
    host = target.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
