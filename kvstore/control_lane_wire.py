"""The local control lane's framing, shared by the daemon and the SDK (no I/O here).

The lane is a second Unix stream socket next to the daemon's gRPC Unix socket
(`<socket path>.lane`) that carries the KVStore service's unary calls without HTTP/2 and
without grpc-python's per-call machinery: a co-located client's `Lookup` and the local
data plane's `LocalPut`/`LocalCommit`/`LocalFetch` then cost one write and one read each
way. Messages are the same protobuf messages as over gRPC; only the envelope differs.

Frames, both ways: a 5-byte header `u32le payload length | u8 kind`, then the payload.

- Requests: `kind` is a method id (`METHOD_IDS`), the payload the serialized request.
- Answers: `kind` is a gRPC status code (0 = OK); the payload is the serialized
  response for OK and the UTF-8 error message otherwise, so the SDK raises exactly the
  exception it would raise for the same status over gRPC.
- The first frame on a connection is `HELLO` (kind 0): `MAGIC` then the client's bearer
  token (UTF-8; empty when it has none). The answer's payload is `MAGIC` and
  `u32le` the largest request frame the daemon accepts; or an error status, after
  which the daemon closes the connection. A hello that starts with `MAGIC_GENERATION`
  instead is answered `MAGIC_GENERATION`, the same `u32le`, and `u64le` the daemon's
  boot id (this start of it: `kvstore.server.generation`). The SDK says that hello, and
  the first one again where a daemon that predates it refuses it (bad magic); the
  daemons of a pool say the first.

Calls on one connection are answered in order, one at a time; clients that want calls
in flight together open more connections.

The peer lane is the same framing on TCP (TLS when the daemon has a certificate), for
the unary calls the daemons of a pool make on each other (Lookup and the data lane's
control calls: what `kvstore.server.auth` admits from a peer; see docs/cluster.md). Its
hello carries the pool's credential, and each request payload starts with an envelope,
the sending node's id and the tenant the call is made for (each a u8 length and that
many UTF-8 bytes), what a gRPC call carries as metadata, followed by the serialized
request.

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import struct

from kvstore.v1 import kvstore_pb2

SUFFIX = ".lane"
MAGIC = b"KVL1"
MAGIC_GENERATION = b"KVL2"  # a hello that asks for the daemon's boot id too
HEADER = struct.Struct("<IB")
HELLO_ANSWER = struct.Struct("<4sI")
HELLO_ANSWER_GENERATION = struct.Struct("<4sIQ")
HELLO = 0
# The hello frame is the magic and a token: tokens are at most 256 characters.
MAX_HELLO_BYTES = 4096
SERVICE = "kvstore.v1.KVStore"

# Every unary KVStore method (Put and Fetch stream block bytes: they stay on gRPC, and
# the local data plane moves those bytes by shared memory anyway). Append only: the
# position is the wire id.
METHODS: tuple[str, ...] = (
    "Lookup", "Delete", "Pin", "Unpin", "Prefetch", "Verify", "Hint", "EndSession",
    "LocalSegment", "LocalPut", "LocalCommit", "LocalFetch", "DeviceSegment", "DeviceFetch", "DevicePut",
    "DataLane", "LaneFetch", "LanePut", "LaneCommit",
)
METHOD_IDS = {name: i + 1 for i, name in enumerate(METHODS)}
METHOD_NAMES = {i: name for name, i in METHOD_IDS.items()}

_service = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]
REQUEST_TYPES = {name: getattr(kvstore_pb2, _service.methods_by_name[name].input_type.name) for name in METHODS}
RESPONSE_TYPES = {name: getattr(kvstore_pb2, _service.methods_by_name[name].output_type.name) for name in METHODS}

# Methods a client may send again after a connection broke mid-call or the daemon
# answered UNAVAILABLE (it may or may not have run them): reads, and verbs whose second
# run changes nothing a first run did not (a second Pin takes a second lease that
# expires on its own). The one list: the lane client resends these, and the SDK's gRPC
# retry policy names the KVStore methods among them. Put is not here: a client stream
# cannot be replayed without buffering every byte.
IDEMPOTENT = frozenset({"Lookup", "Fetch", "Delete", "Pin", "Unpin", "Prefetch", "Verify", "LocalSegment",
                        "DeviceSegment", "DataLane"})


MAX_ENVELOPE_FIELD_BYTES = 255


def peer_envelope(node_id: str, tenant: str) -> bytes:
    """The start of every request payload on the peer lane (see the module docstring).
    Node ids (1-63 characters) and tenant names (1-64) always fit its fields."""
    node, ten = node_id.encode("utf-8"), tenant.encode("utf-8")
    if len(node) > MAX_ENVELOPE_FIELD_BYTES or len(ten) > MAX_ENVELOPE_FIELD_BYTES:
        raise ValueError("a node id or tenant name of more than 255 bytes cannot travel on the peer lane")
    return bytes((len(node),)) + node + bytes((len(ten),)) + ten


def split_envelope(payload: bytes) -> tuple[str, str, bytes] | None:
    """(node id, tenant, request bytes) of a peer lane request payload; None if it does
    not start with a whole envelope."""
    if not payload:
        return None
    n = payload[0]
    if len(payload) < 2 + n:
        return None
    t = payload[1 + n]
    end = 2 + n + t
    if len(payload) < end:
        return None
    try:
        return payload[1 : 1 + n].decode("utf-8"), payload[2 + n : end].decode("utf-8"), payload[end:]
    except UnicodeDecodeError:
        return None


def method_path(name: str) -> str:
    """The gRPC method path of `name` (what auth, the drain gate and logs key on)."""
    return f"/{SERVICE}/{name}"


def lane_path(socket_path: str) -> str:
    """Where the lane of the gRPC Unix socket at `socket_path` listens."""
    return socket_path + SUFFIX


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload
