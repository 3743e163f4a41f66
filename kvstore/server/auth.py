"""Tenants and bearer tokens: the token file, the table built from it, and the
admission of calls that puts the caller's identity into a contextvar.

Primitives: `parse_token_file(path) -> TokenTable`, `TokenTable.authenticate(token)`,
`new_token() -> (token, hash)`, `Authenticator` (`identify`, `admit`/`leave`: the auth
step of the per-call pipeline, `kvstore.server.pipeline`), `bearer_token(metadata)`,
`peer_call(metadata)`, `current_identity()`.

The token file is TOML, one `[[tenant]]` table per tenant (see SECURITY.md):

    [[tenant]]
    name = "team-a"
    role = "client"                    # or "admin"
    tokens = ["sha256:<salt hex>:<digest hex>"]
    quota = { host = "8GiB", ssd = "200GiB" }   # optional, bytes per tier
    local_plane = true                 # optional: may map the shared-memory segment
    salt = "team-a"                    # optional: namespace salt (default: the name)

Tokens are 256-bit random strings made by `kvstore token new`; the file holds only a
salted SHA-256 of each. A fast hash is enough for secrets of that entropy (slow KDFs
protect guessable passwords, which these are not), and it keeps per-call cost small.
Comparison is `hmac.compare_digest` over every entry, so timing does not tell which
entry a token nearly matched.

Without a token file the daemon has one tenant, `default`, with the admin role and an
empty salt: namespace ids are the public ones from docs/hashing.md, as before tenancy.

Calls between the daemons of a pool (docs/cluster.md) carry the sending node's
credential (a token of role `peer`) and two metadata entries: `x-kvstore-peer` (the
sender's node id) and `x-kvstore-tenant` (the tenant the call is made for). Each node has
a credential of its own: its token file entry names the node (`node = "<node id>"`), so
the credential proves which node sends, and a call whose `x-kvstore-peer` is another
node's is refused. The sender must also be a member of this daemon's current view of
the pool (`Authenticator.members`, set by the daemon of a pool: the etcd view, or the
static list); a daemon in no pool takes no node-to-node call. Revoking one node is
removing its entry (a reload) or its membership: no other node's credential changes. A
`peer` entry that names no node is a credential shared by the pool (the form before
per-node credentials): it is accepted as any current member, and the daemon warns.

Such a call acts as that tenant of this daemon's own token file (its salt and quotas),
only for the methods a pool uses (`PEER_METHODS`); the tenant entries are trusted only
from a peer credential, so a client (or an admin) cannot act for another tenant, and a
peer token alone reaches nothing. Without a token file there is no credential to check:
every call is the default tenant's, a call for any other tenant is refused, and a call
naming a node is still taken only from a member of the view.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvstore.errors import ConfigError, PermissionDenied, ResourceExhausted, Unauthenticated
from kvstore.pathsafety import foreign_component, open_directory
from kvstore.tiers import TIER_KINDS
from kvstore.units import parse_size

logger = logging.getLogger(__name__)

ROLES = ("client", "admin", "peer")
# Roles whose calls may act for a tenant named in the call (node-to-node calls).
ACTS_FOR_TENANTS = ("peer",)
# A node id, as kvstore.cluster.node_id validates it (not imported: a daemon alone never
# loads the pool's package).
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
PEER_HEADER = "x-kvstore-peer"
TENANT_HEADER = "x-kvstore-tenant"
# What one daemon of a pool asks of another: lookups, and block bytes over gRPC streams or
# the data lane (whose control calls open, and commit, transfers for the named tenant).
PEER_METHODS = ("/kvstore.v1.KVStore/Lookup", "/kvstore.v1.KVStore/Fetch", "/kvstore.v1.KVStore/Put",
                "/kvstore.v1.KVStore/DataLane", "/kvstore.v1.KVStore/LaneFetch", "/kvstore.v1.KVStore/LanePut",
                "/kvstore.v1.KVStore/LaneCommit")
QUOTA_TIERS = TIER_KINDS
DEFAULT_TENANT = "default"
HASH_SCHEME = "sha256"
TOKEN_PREFIX = "kvs_"
# Identities of node-to-node calls kept made (`Authenticator._acting_for`): tenants x nodes.
MAX_ACTING_KEPT = 4096
ADMIN_SERVICE = "/kvstore.v1.Admin/"
# The shared-memory plane, and the device (CUDA IPC) plane: both hand a client memory
# that holds every tenant's blocks.
LOCAL_METHODS = ("LocalSegment", "LocalPut", "LocalCommit", "LocalFetch", "DeviceSegment", "DevicePut",
                 "DeviceFetch")
MAX_TOKEN_CHARS = 256
# Bound on the memo of tokens already checked (cleared on every reload).
MEMO_ENTRIES = 4096


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is calling: a tenant, its role, and what the tenant may use."""

    tenant: str
    role: str
    salt: bytes = b""
    quota: Mapping[str, int] = field(default_factory=dict)
    local_plane: bool = True
    peer: str = ""  # the node id of the pool's daemon that made this call for the tenant
    node: str = ""  # role peer: the node this credential proves ("": a credential the pool shares)

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


# With auth off every caller is this identity: one tenant, today's namespace ids.
DEFAULT_IDENTITY = Identity(DEFAULT_TENANT, "admin", b"", {}, True)

_identity: contextvars.ContextVar[Identity] = contextvars.ContextVar("kvstore_identity", default=DEFAULT_IDENTITY)


def current_identity() -> Identity:
    """The caller of the RPC being served (the default identity outside of one)."""
    return _identity.get()


def hash_token(token: str, salt: bytes | None = None) -> str:
    """`sha256:<salt hex>:<digest hex>` of `token` (a fresh 16-byte salt unless given)."""
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hashlib.sha256(salt + token.encode("utf-8")).hexdigest()
    return f"{HASH_SCHEME}:{salt.hex()}:{digest}"


def new_token() -> tuple[str, str]:
    """A new random token and the hash to store for it."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, hash_token(token)


def entry_text(tenant: str, role: str, token_hash: str, node: str = "") -> str:
    """The token-file lines that grant `token_hash` to `tenant` with `role` (and, for a
    node's credential, the node it proves)."""
    node_line = f'node = "{node}"\n' if node else ""
    return f'[[tenant]]\nname = "{tenant}"\nrole = "{role}"\n{node_line}tokens = ["{token_hash}"]\n'


@dataclass(frozen=True, slots=True)
class _StoredHash:
    salt: bytes
    digest: bytes
    identity: Identity


def _parse_hash(text: Any, where: str) -> tuple[bytes, bytes]:
    if not isinstance(text, str):
        raise ConfigError(f"{where}: a token hash must be a string like 'sha256:<salt hex>:<digest hex>'")
    parts = text.split(":")
    if len(parts) != 3 or parts[0] != HASH_SCHEME:
        raise ConfigError(
            f"{where}: {text[:20]!r}... is not 'sha256:<salt hex>:<digest hex>'; make one with `kvstore token new` "
            "(never put a plain token in the file)"
        )
    try:
        salt, digest = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
    except ValueError:
        raise ConfigError(f"{where}: the salt and digest of a token hash must be hex") from None
    if len(salt) < 8 or len(digest) != 32:
        raise ConfigError(f"{where}: a token hash needs a salt of 8+ bytes and a 32-byte SHA-256 digest")
    return salt, digest


def _valid_name(name: Any) -> bool:
    return isinstance(name, str) and 0 < len(name) <= 64 and all(c.isalnum() or c in "-_." for c in name)


class TokenTable:
    """Token hashes -> identities, built from one reading of the token file."""

    def __init__(self, entries: list[_StoredHash], identities: list[Identity]) -> None:
        self._entries = entries
        self.identities = {i.tenant: i for i in identities}
        self._memo: dict[str, Identity | None] = {}

    def __len__(self) -> int:
        return len(self.identities)

    def authenticate(self, token: str) -> Identity | None:
        """The identity `token` grants, or None. Checks every entry (constant shape)."""
        memo = self._memo.get(token, False)
        if memo is not False:
            return memo  # type: ignore[return-value]
        raw = token.encode("utf-8")
        found: Identity | None = None
        for entry in self._entries:
            digest = hashlib.sha256(entry.salt + raw).digest()
            if hmac.compare_digest(digest, entry.digest) and found is None:
                found = entry.identity
        if len(self._memo) >= MEMO_ENTRIES:
            self._memo.clear()
        self._memo[token] = found
        return found

    def quotas(self) -> dict[str, dict[str, int]]:
        return {t: dict(i.quota) for t, i in self.identities.items() if i.quota}


def check_file_mode(path: str) -> None:
    """Refuse a token file that another user could change: one owned by neither the
    daemon's uid nor root, in (or under) a directory another user owns or may write
    (unless sticky, as /tmp), or that any user may read or write or its group may write
    (a writable file is a way in). Warn when its group may read it (what Kubernetes makes
    of a Secret mounted with fsGroup)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"auth_token_file {path} does not exist; create it with `kvstore token new`") from None
    except OSError as exc:
        raise ConfigError(f"cannot read auth_token_file {path}: {exc.strerror}") from None
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise ConfigError(
            f"auth_token_file {path} is owned by uid {st.st_uid}, not this daemon's uid {uid} or root, so that user "
            f"could grant itself any role; run `chown {uid} {path}` (as root) if its contents are yours"
        )
    foreign = foreign_component(path, uid)
    if foreign is not None:
        raise ConfigError(
            f"auth_token_file {path}: {foreign.path} is owned by uid {foreign.uid}, not this daemon's uid {uid} or "
            "root, so that user could put another file in its place; keep the token file in a directory of "
            "root's or the daemon's user's"
        )
    parent = open_directory(path)
    if parent is not None:
        raise ConfigError(
            f"auth_token_file {path} is under {parent}, which its group or other users may write (and which is not "
            "sticky), so they could put another file in its place (an older one, with a revoked token); keep it in "
            f"a directory only root or the daemon's user may write, or `chmod g-w,o-w {parent}`"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IRWXO | stat.S_IWGRP):
        raise ConfigError(
            f"auth_token_file {path} is accessible to other users (mode {mode:04o}); run `chmod 600 {path}`"
        )
    if mode & stat.S_IRGRP:
        logger.warning("auth_token_file %s is readable by its group (mode %04o); 0600 or 0400 is safer", path, mode)


def parse_token_file(path: str) -> TokenTable:
    """Read and validate the token file; any problem is a `ConfigError` naming it."""
    check_file_mode(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"auth_token_file {path} is not UTF-8 text: byte {exc.object[exc.start]:#04x} at offset "
                          f"{exc.start}; TOML files are UTF-8") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"auth_token_file {path} cannot be read: {exc}") from None
    unknown = sorted(set(data) - {"tenant"})
    if unknown:
        raise ConfigError(f"auth_token_file {path}: unknown key(s) {', '.join(unknown)}; only [[tenant]] tables")
    tenants = data.get("tenant", [])
    if not isinstance(tenants, list) or not tenants:
        raise ConfigError(f"auth_token_file {path} has no [[tenant]] entries; add one with `kvstore token new`")
    entries: list[_StoredHash] = []
    identities: list[Identity] = []
    salts: dict[bytes, str] = {}
    nodes: dict[str, str] = {}  # node id -> the tenant entry whose credential proves it
    for n, raw in enumerate(tenants):
        where = f"auth_token_file {path}, tenant #{n + 1}"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: must be a table")
        extra = sorted(set(raw) - {"name", "role", "tokens", "token", "quota", "local_plane", "salt", "node"})
        if extra:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(extra)}")
        name = raw.get("name")
        if not _valid_name(name):
            raise ConfigError(f"{where}: name must be 1-64 letters, digits, '-', '_' or '.', got {name!r}")
        assert isinstance(name, str)
        where = f"auth_token_file {path}, tenant {name!r}"
        if name in {i.tenant for i in identities}:
            raise ConfigError(f"{where}: appears twice; list all its tokens in one entry")
        role = raw.get("role", "client")
        if role not in ROLES:
            raise ConfigError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
        hashes = raw.get("tokens", [])
        if "token" in raw:
            hashes = [*hashes, raw["token"]]
        if not isinstance(hashes, list) or not hashes:
            raise ConfigError(f"{where}: has no tokens; add tokens = [\"sha256:...\"] from `kvstore token new`")
        quota: dict[str, int] = {}
        raw_quota = raw.get("quota", {})
        if not isinstance(raw_quota, dict):
            raise ConfigError(f"{where}: quota must be a table like {{ host = \"8GiB\" }}")
        for tier, size in raw_quota.items():
            if tier not in QUOTA_TIERS:
                raise ConfigError(f"{where}: quota names tier {tier!r}; tiers are {', '.join(QUOTA_TIERS)}")
            try:
                quota[tier] = parse_size(size)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{where}: quota.{tier}: {exc}") from None
        salt_text = raw.get("salt", name)
        if not isinstance(salt_text, str) or len(salt_text) > 256:
            raise ConfigError(f"{where}: salt must be a string of at most 256 characters")
        salt = salt_text.encode("utf-8")
        if salt in salts:
            raise ConfigError(f"{where}: salt is the same as tenant {salts[salt]!r}'s; they would share blocks")
        salts[salt] = name
        local_plane = raw.get("local_plane", False)
        if not isinstance(local_plane, bool):
            raise ConfigError(f"{where}: local_plane must be true or false")
        node = raw.get("node", "")
        if node:
            if role != "peer":
                raise ConfigError(f"{where}: node names the pool's node a peer credential proves; role {role!r} "
                                  "proves none (use role = \"peer\")")
            if not isinstance(node, str) or not _NODE_ID.fullmatch(node):
                raise ConfigError(f"{where}: node must be a node id (1-63 of letters, digits, '.', '_', '-', "
                                  f"starting with a letter or digit), got {node!r}")
            if node in nodes:
                raise ConfigError(f"{where}: node {node!r} already has the credential of tenant {nodes[node]!r}; "
                                  "give each node one entry (several tokens in it allow rotation)")
            nodes[node] = name
        identity = Identity(name, role, salt, quota, local_plane, node=node)
        identities.append(identity)
        for text in hashes:
            s, d = _parse_hash(text, where)
            entries.append(_StoredHash(s, d, identity))
    return TokenTable(entries, identities)


def check_unix_tenant(table: TokenTable, tenant: str, path: str) -> None:
    """Refuse a `unix_socket_tenant` that is not a tenant of the token file at `path`."""
    if tenant not in table.identities:
        raise ConfigError(
            f"unix_socket_tenant {tenant!r} is not a tenant of {path}; known: {', '.join(sorted(table.identities))}"
        )


def peer_call(metadata: Any) -> tuple[str, str] | None:
    """(sender node id, tenant) of a node-to-node call's metadata; None for other calls."""
    node = tenant = None
    for key, value in metadata or ():
        if key == PEER_HEADER:
            node = value
        elif key == TENANT_HEADER:
            tenant = value
    if node is None:
        return None
    return str(node)[:64], "" if tenant is None else str(tenant)


def bearer_token(metadata: Any) -> str | None:
    """The token of gRPC metadata's `authorization: Bearer <token>`: None when there is
    none, "" when it is malformed (refused like a wrong one)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token and len(token) <= MAX_TOKEN_CHARS:
                return token.strip()
            return ""
    return None


class Authenticator:
    """Authenticates calls, enforces roles and a per-tenant cap on calls in flight, and
    sets the identity for the servicers. Health checks never reach it (they carry no
    token: see `kvstore.server.pipeline.OPEN_SERVICES`).

    `table` None means auth is off: every caller is `DEFAULT_IDENTITY` (still counted
    against the in-flight cap). `table` is replaced when the token file is reloaded."""

    def __init__(self, table: TokenTable | None, max_calls_per_tenant: int, unix_socket_tenant: str = "") -> None:
        self.table = table
        self.max_calls_per_tenant = max_calls_per_tenant
        self.unix_socket_tenant = unix_socket_tenant
        self.in_flight: dict[str, int] = {}
        # The identities node-to-node calls act as, by (tenant, node), for the table
        # they were made from (`_acting_for`); a pool has few of each.
        self._acting: dict[tuple[str, str], Identity] = {}
        self._acting_table: TokenTable | None = None
        # Whether a node id is a member of this daemon's current view of the pool; None
        # in a daemon alone (no node-to-node call is taken). Set by the pool's daemon.
        self.members: Callable[[str], bool] | None = None

    def _authenticate(self, table: TokenTable, token: str | None, on_unix_socket: bool) -> Identity:
        if token is None:
            if self.unix_socket_tenant and on_unix_socket:
                # The socket is 0600: whoever connected runs as the daemon's uid.
                unix_identity = table.identities.get(self.unix_socket_tenant)
                if unix_identity is not None:
                    return unix_identity
            raise Unauthenticated(
                "this daemon requires a token: send metadata 'authorization: Bearer <token>' "
                "(SDK: token=..., CLI: --token-file or KVSTORE_TOKEN)"
            )
        found = table.authenticate(token) if token else None
        if found is None:
            raise Unauthenticated("the bearer token is not valid for this daemon; ask its operator for one")
        return found

    def identify(self, method: str, token: str | None, on_unix_socket: bool,
                 peer: tuple[str, str] | None = None) -> Identity:
        """Who a call of `method` (a gRPC method path) carrying `token` (None: no token;
        "": a malformed one) is, and whether it may make that call; raises
        `Unauthenticated` or `PermissionDenied`. Shared by gRPC calls and the local lane.
        `peer`: (node id, tenant) of a node-to-node call (`peer_call`)."""
        identity = DEFAULT_IDENTITY if self.table is None else self._authenticate(self.table, token, on_unix_socket)
        if peer is not None or identity.role == "peer":
            identity = self._acting_for(method, identity, peer)
        if method.startswith(ADMIN_SERVICE) and not identity.is_admin:
            raise PermissionDenied(f"{method} needs the admin role; tenant {identity.tenant!r} has role {identity.role}")
        if not identity.local_plane and method.rsplit("/", 1)[-1] in LOCAL_METHODS:
            raise PermissionDenied(
                f"tenant {identity.tenant!r} may not use the shared-memory or device data plane (local_plane = "
                "false in the token file); use Put and Fetch"
            )
        return identity

    def identify_lane(self, method: str, token: str | None, on_unix_socket: bool, source: str = "") -> Identity:
        """Who opens a data lane connection (its hello names no tenant to act for): as
        `identify` would say for a call of `method`, except that a cluster credential
        (role peer) is accepted as itself. Such a connection carries the bytes of
        transfers that node-to-node calls opened, and only those
        (`kvstore.server.data_lane.transfers`): the call that opened one was authorized for its
        tenant, and its id is the connection's claim to it."""
        if self.table is not None:
            identity = self._authenticate(self.table, token, on_unix_socket)
            if identity.role == "peer":
                if identity.node:
                    self._check_member(identity.node, source)
                return identity
        return self.identify(method, token, on_unix_socket)

    def _check_member(self, node: str, source: str = "") -> None:
        """Refuse a node-to-node call or lane connection from `node` unless it is a member
        of this daemon's current view of the pool."""
        members = self.members
        if members is None:
            raise PermissionDenied(f"node {node!r} called a daemon that is in no pool; it takes no node-to-node "
                                   "calls")
        if not members(node):
            logger.debug("node-to-node call from %r (%s) refused: not a member", node, source or "?")
            raise PermissionDenied(
                f"node {node!r} is not a member of this daemon's view of the pool (unknown, removed, or not seen "
                "yet); a node's credential works only while it is a member")

    def _acting_for(self, method: str, caller: Identity, peer: tuple[str, str] | None) -> Identity:
        """The tenant a node-to-node call acts for (see the module docstring)."""
        if peer is None:
            raise PermissionDenied(
                f"tenant {caller.tenant!r} has role peer: its token is a cluster credential for calls between "
                "daemons, which name the tenant they act for; use a client token"
            )
        node, tenant = peer
        if self.table is not None and caller.role not in ACTS_FOR_TENANTS:
            raise PermissionDenied(
                f"tenant {caller.tenant!r} (role {caller.role}) may not act for another tenant; node-to-node "
                "calls need a node's credential (role peer)"
            )
        if caller.node and caller.node != node:
            raise PermissionDenied(
                f"the credential of node {caller.node!r} was used for a call as node {node!r}; a node's "
                "credential acts only as that node")
        if method not in PEER_METHODS:
            raise PermissionDenied(f"{method} is not a node-to-node call; a pool's daemons call only "
                                   "Lookup, Fetch, Put and the data lane's calls on each other")
        self._check_member(node)
        table = self.table
        if table is None:
            acting = DEFAULT_IDENTITY if tenant in ("", DEFAULT_TENANT) else None
        else:
            acting = table.identities.get(tenant)
        if acting is None:
            raise PermissionDenied(
                f"node {node!r} called for tenant {tenant!r}, which this daemon's token file does not name; "
                "every daemon of a pool needs the same tenants with the same salts"
            )
        if table is not self._acting_table:  # reloaded: made again from the new one
            self._acting, self._acting_table = {}, table
        found = self._acting.get((tenant, node))
        if found is None:
            if len(self._acting) >= MAX_ACTING_KEPT:
                self._acting.clear()
            found = self._acting[(tenant, node)] = replace(acting, peer=node)
        return found

    def admit(self, method: str, token: str | None, on_unix_socket: bool,
              peer: tuple[str, str] | None = None) -> Identity:
        """`identify`, then count the call against the tenant's cap on calls in flight
        (`ResourceExhausted` past it), and make the identity current for the handler.
        Every admitted call must be ended with `leave`."""
        identity = self.identify(method, token, on_unix_socket, peer)
        self._enter(identity)
        _identity.set(identity)
        return identity

    def _enter(self, identity: Identity) -> None:
        n = self.in_flight.get(identity.tenant, 0)
        if n >= self.max_calls_per_tenant:
            raise ResourceExhausted(
                f"tenant {identity.tenant!r} has {n} calls in flight, the most max_calls_per_tenant allows; "
                "wait for some to finish"
            )
        self.in_flight[identity.tenant] = n + 1

    def leave(self, identity: Identity) -> None:
        """An admitted call of `identity` ended."""
        n = self.in_flight.get(identity.tenant, 1) - 1
        if n:
            self.in_flight[identity.tenant] = n
        else:
            self.in_flight.pop(identity.tenant, None)
