"""A node's stable identity in the pool: the name it registers under and that placement hashes.

Placement ranks members by node id, so an id that changed at every restart would move all
of the node's units elsewhere and orphan what its SSD still holds. The rule, first match
wins:

1. **Configured**: a non-empty `configured` id is used as it is (after validation).
2. **Kept under the SSD path**: with an SSD tier, the id lives in ``<ssd_path>/node-id``.
   An existing file is read; otherwise a new id (``<host>-<12 hex digits>``, random) is
   written to a temporary file in the same directory, flushed, and published with
   ``link(2)``, which fails if the name exists: of two processes racing on one directory,
   exactly one id wins and both return it. So the id follows the SSD's contents.
3. **Derived from a data directory**: without either, ``<host>-<12 hex digits>`` where the
   digits are xxh3-64 of ``utf8(host) || 0x00 || utf8(realpath(data_dir))``: the same host
   name and directory give the same id; moving the directory or renaming the host gives
   a new one.

Otherwise there is no stable id and resolution fails with a ConfigError that says what
to set. A valid id is 1 to 63 characters of ``[A-Za-z0-9._-]`` starting with a letter or
digit (it appears in etcd keys, metrics labels and log lines). ``<host>`` is the host
name cut to its first label and to those characters.

Primitives: `NODE_ID_FILE`, `NodeIdSource`, `NodeId`, `validate_node_id`, `resolve_node_id`.
"""

from __future__ import annotations

import enum
import os
import re
import secrets
import socket
from dataclasses import dataclass

import xxhash

from kvstore.errors import ConfigError

NODE_ID_FILE = "node-id"
MAX_NODE_ID_CHARS = 63
_VALID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_HOST_CHARS = re.compile(r"[^A-Za-z0-9-]")
_HOST_PART_CHARS = 40


class NodeIdSource(enum.Enum):
    CONFIGURED = "configured"
    FILE = "file"  # read from <ssd_path>/node-id
    CREATED = "created"  # new, now kept in <ssd_path>/node-id
    DERIVED = "derived"  # from the host name and a data directory


@dataclass(frozen=True, slots=True)
class NodeId:
    value: str
    source: NodeIdSource
    path: str = ""  # the file that keeps it, or the directory it was derived from


def validate_node_id(text: str, where: str = "node id") -> str:
    if not _VALID.fullmatch(text):
        raise ConfigError(
            f"{where} {text!r} is not a valid node id: use 1 to {MAX_NODE_ID_CHARS} characters of "
            "letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return text


def _host_part(hostname: str | None) -> str:
    name = (hostname if hostname is not None else socket.gethostname()).split(".", 1)[0]
    cleaned = _HOST_CHARS.sub("-", name).strip("-")[:_HOST_PART_CHARS].strip("-")
    return cleaned or "node"


def _read_id_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except UnicodeDecodeError:
        text = "<not text>"
    return validate_node_id(text, f"the node id kept in {path}:")


def _create_id_file(directory: str, path: str, new_id: str) -> str:
    """Publish `new_id` at `path` unless another id got there first; the id that is there."""
    tmp = os.path.join(directory, f".{NODE_ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(new_id + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            # link(2) never replaces an existing name: the first writer's id stands.
            os.link(tmp, path)
        except FileExistsError:
            return _read_id_file(path)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return new_id


def resolve_node_id(
    configured: str = "", *, ssd_path: str = "", data_dir: str = "", hostname: str | None = None
) -> NodeId:
    """This node's id by the rule in the module docstring."""
    if configured:
        return NodeId(validate_node_id(configured, "the configured node id"), NodeIdSource.CONFIGURED)
    if ssd_path:
        directory = os.path.abspath(ssd_path)
        path = os.path.join(directory, NODE_ID_FILE)
        try:
            if os.path.exists(path):
                return NodeId(_read_id_file(path), NodeIdSource.FILE, path)
            os.makedirs(directory, mode=0o700, exist_ok=True)
            new_id = f"{_host_part(hostname)}-{secrets.token_hex(6)}"
            kept = _create_id_file(directory, path, new_id)
        except OSError as exc:
            raise ConfigError(
                f"cannot keep the node id in {path}: {exc.strerror}; make the SSD path writable "
                "or configure the node id"
            ) from None
        return NodeId(kept, NodeIdSource.CREATED if kept == new_id else NodeIdSource.FILE, path)
    if data_dir:
        host = _host_part(hostname)
        real = os.path.realpath(data_dir)
        digest = xxhash.xxh3_64_hexdigest(host.encode() + b"\x00" + real.encode())[:12]
        return NodeId(f"{host}-{digest}", NodeIdSource.DERIVED, real)
    raise ConfigError(
        "a cluster member needs a stable node id: configure one, or give the daemon an SSD path "
        "(the id is kept there) or a data directory to derive it from"
    )
