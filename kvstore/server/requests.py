"""The server's request boundary: what a request names, resolved into what the store takes.

Primitives: `RequestResolver` (`known(ref, keys)` and `namespace(ref)` for reads,
`put_namespace(ref)` for puts, `chain(ns_id, keys)`, `hashes(ns_id, keys)`,
`check_keys(keys, layout)`, `put_keys(info, header)` (the engine's names of a put's blocks
checked by `check_engine_names`, and handed to `put_names`), `session(...)`, `put_session(header)`,
and the caller's lease ids through `tags`), `Miss` and `UnregisteredLayout` (a read of a
layout the daemon holds nothing of, as a value and as an error), and the answer helpers
`packed_reply(keys)` and `hash_fields(hashes, packed)`.

Only a put registers a namespace, and only when it publishes: a read of an unknown
layout is a miss (no block, no lease), so lookups of made-up layouts cannot fill
`max_namespaces`. `known` is that rule, written once: the read's keys are checked as any
read's, and it answers a `Miss` that the read turns into its empty answer.

This is the one place the servicers validate input, and it checks only what the store
never sees or cannot check: a layout's size against `max_block_bytes` and the tenant's
namespace cap before it is registered, a tenant's right to a namespace id, the token
count of a call, the shape of packed fields before they are cut into objects, and the
block range a put's tokens name. What the store receives it checks itself (namespace
ids, hash sizes and the per-call block limit, hint values), so those are not checked
here again. Every failure is a `kvstore.errors` exception.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.convert import layout_from_proto
from kvstore.core.store import NamespaceInfo, Store, check_hint
from kvstore.errors import InvalidArgument, NotFound, ResourceExhausted
from kvstore.hashing import HASH_BYTES, block_hashes_packed, split_hashes, tenant_namespace_id, token_bytes
from kvstore.layout import KVLayout
from kvstore.server.auth import current_identity
from kvstore.server.lease_tags import LeaseTags
from kvstore.v1 import kvstore_pb2

# Layouts whose namespace id the resolver remembers (see RequestResolver.namespace).
LAYOUT_IDS_KEPT = 1024
# The hint window EndSession's session id is checked with (it names no window).
END_SESSION_WINDOW_S = 1.0


class UnregisteredLayout(NotFound):
    """A read named a layout whose namespace the daemon does not hold (nothing was put in
    it, or everything put went away): each read answers it as a miss. Left unanswered, it
    is NOT_FOUND with a message that says so."""

    def __init__(self, namespace_id: bytes, layout: KVLayout) -> None:
        super().__init__(f"namespace {namespace_id.hex()} (model {layout.model}) holds no blocks on this daemon; "
                         "put blocks with this layout first")
        self.namespace_id = namespace_id
        self.layout = layout


@dataclass(frozen=True, slots=True)
class Miss:
    """A read of a layout the daemon holds nothing of (`RequestResolver.known`): the
    namespace id the layout would have, the layout, and how many blocks the read names."""

    namespace_id: bytes
    layout: KVLayout
    blocks: int


# (namespace record, the put's hashes, its parent's hash, its blocks' packed token ids or
# b"", the engine's names or None)
PutNames = Callable[[NamespaceInfo, list[bytes], "bytes | None", bytes, "kvstore_pb2.EngineNames | None"], None]

ENGINE_NAME_MAX_BYTES = 64


def check_engine_names(names: kvstore_pb2.EngineNames, num_blocks: int, block_size_tokens: int,
                       keyed_by_tokens: bool) -> None:
    """A put's `engine_names`, checked against the put: one name per block, each the size
    its form allows, tokens only for a put by hashes and then a whole number of blocks."""
    if len(names.names) != num_blocks:
        raise InvalidArgument(f"engine_names has {len(names.names)} names for a put of {num_blocks} blocks; "
                              "send one per block")
    for i, name in enumerate(names.names):
        if names.integers and len(name) != 8 or not 1 <= len(name) <= ENGINE_NAME_MAX_BYTES:
            raise InvalidArgument(f"engine_names.names[{i}] is {len(name)} bytes; names are 1..{ENGINE_NAME_MAX_BYTES} "
                                  "bytes, exactly 8 with engine_names.integers")
    for what, parent in (("parent", names.parent), *((f"parents[{i}]", p) for i, p in enumerate(names.parents))):
        if parent and (names.integers and len(parent) != 8 or len(parent) > ENGINE_NAME_MAX_BYTES):
            raise InvalidArgument(f"engine_names.{what} is {len(parent)} bytes; it has the form of the names")
    if names.parents and len(names.parents) != num_blocks:
        raise InvalidArgument(f"engine_names has {len(names.parents)} parents for a put of {num_blocks} blocks; "
                              "send one per block, or none")
    if names.token_ids_packed:
        if keyed_by_tokens:
            raise InvalidArgument("engine_names.token_ids_packed is for a put by hashes; this put sends token ids")
        if len(names.token_ids_packed) != num_blocks * block_size_tokens * 4:
            raise InvalidArgument(f"engine_names.token_ids_packed is {len(names.token_ids_packed)} bytes; {num_blocks} "
                                  f"blocks of {block_size_tokens} tokens take {num_blocks * block_size_tokens * 4}")


def packed_reply(keys: kvstore_pb2.BlockKeys) -> bool:
    """Whether a request's answer carries its block hashes packed (`block_hashes_packed`)
    rather than in the repeated field older clients read (see BlockKeys.packed_reply)."""
    return keys.packed_reply or keys.WhichOneof("keys") == "packed_hashes"


def hash_fields(hashes: Sequence[bytes] | bytes, packed: bool) -> dict[str, Any]:
    """A response's block hash field, in the form the request asked for, from hashes given
    one by one or already packed (N x 16 bytes)."""
    if isinstance(hashes, bytes):
        return {"block_hashes_packed": hashes} if packed else {"block_hashes": split_hashes(hashes)}
    return {"block_hashes_packed": b"".join(hashes)} if packed else {"block_hashes": hashes}


class RequestResolver:
    """Namespace refs, block keys and session ids of requests, for one store.

    `max_tokens_per_call` may change while the daemon runs (SetConfig, SIGHUP)."""

    def __init__(self, store: Store, tags: LeaseTags, *, max_tokens_per_call: int = 1 << 20,
                 max_block_bytes: int = 256 << 20, max_namespaces_per_tenant: int | None = None) -> None:
        self.store = store
        self.tags = tags
        self.max_tokens_per_call = max_tokens_per_call
        self.max_block_bytes = max_block_bytes
        self.max_namespaces_per_tenant = max_namespaces_per_tenant
        # Told of each put's keys, tokens and engine names when a KV event stream is on
        # (kvstore.server.kv_events.KvEventStreams.offer_put); None: nobody listens.
        self.put_names: PutNames | None = None
        # (tenant, salt, layout message bytes) -> namespace id: an engine names its layout
        # in every call, and parsing, checking and hashing it each time cost more than a
        # short lookup itself. Only layouts that passed the checks below are kept.
        self._layout_ids: dict[tuple[str, bytes, bytes], bytes] = {}

    # -------------------------------------------------------------- namespaces

    def namespace(self, ref: kvstore_pb2.Namespace, *, register: bool = False) -> bytes:
        """The caller's namespace, for a read: a layout is filed under the caller's tenant
        (salted id); an id must name a namespace of the caller's tenant (admins may name
        any). A layout the daemon holds nothing of raises `UnregisteredLayout`, and is
        not registered: the read is a miss (blocks recovered from SSD are adopted).
        `register` files it instead (the caps checked): a daemon of a pool looks such a
        layout up on the other nodes, and copies what they hold into it."""
        who = current_identity()
        which = ref.WhichOneof("ref")
        if which == "layout":
            wire = ref.layout.SerializeToString()
            known = self._layout_ids.get((who.tenant, who.salt, wire))
            if known is not None and self.store.has_namespace(known):
                return known
            layout = self._checked_layout(ref.layout)
            ns_id = tenant_namespace_id(layout.namespace_id, who.salt)
            if not self.store.has_namespace(ns_id):
                if not register and not self.store.has_recovered(ns_id, layout):
                    raise UnregisteredLayout(ns_id, layout)
                if self.max_namespaces_per_tenant is not None:
                    self._check_tenant_namespaces(layout, who.tenant, who.salt)
                self.store.register(layout, who.tenant, who.salt)
            self._remember(who.tenant, who.salt, wire, ns_id)
            return ns_id
        return self._by_id(ref)

    def known(self, ref: kvstore_pb2.Namespace, keys: kvstore_pb2.BlockKeys) -> bytes | Miss:
        """The caller's namespace for a read, as `namespace` gives it; for a layout the
        daemon holds nothing of, a `Miss`, with `keys` checked as a registered
        namespace's would be (bad input is refused the same either way) and nothing
        registered. Reads call it on every request: a layout seen before is answered
        here, without the call `namespace` would add."""
        if ref.WhichOneof("ref") == "layout":
            who = current_identity()
            found = self._layout_ids.get((who.tenant, who.salt, ref.layout.SerializeToString()))
            if found is not None and self.store.has_namespace(found):
                return found
        try:
            return self.namespace(ref)
        except UnregisteredLayout as unknown:
            return Miss(unknown.namespace_id, unknown.layout, self.check_keys(keys, unknown.layout))

    def put_namespace(self, ref: kvstore_pb2.Namespace) -> NamespaceInfo:
        """The namespace record a put works with: the registered one, or for a new layout
        one the store files only when the put publishes (`Store.prepare_namespace`), so a
        refused put registers nothing. The caps (`max_namespaces`, and the tenant's) are
        checked now, before any byte arrives."""
        who = current_identity()
        which = ref.WhichOneof("ref")
        if which == "layout":
            wire = ref.layout.SerializeToString()
            known = self._layout_ids.get((who.tenant, who.salt, wire))
            if known is not None and self.store.has_namespace(known):
                return self.store.namespace(known)
            layout = self._checked_layout(ref.layout)
            if self.max_namespaces_per_tenant is not None:
                self._check_tenant_namespaces(layout, who.tenant, who.salt)
            info = self.store.prepare_namespace(layout, who.tenant, who.salt)
            if self.store.has_namespace(info.namespace_id):
                self._remember(who.tenant, who.salt, wire, info.namespace_id)
            return info
        return self.store.namespace(self._by_id(ref))

    def _checked_layout(self, msg: kvstore_pb2.Layout) -> KVLayout:
        layout = layout_from_proto(msg)
        if layout.bytes_per_block > self.max_block_bytes:
            raise InvalidArgument(
                f"the layout describes {layout.bytes_per_block} bytes per block, more than max_block_bytes "
                f"({self.max_block_bytes}); use smaller blocks (fewer tokens per block)"
            )
        return layout

    def _remember(self, tenant: str, salt: bytes, wire: bytes, ns_id: bytes) -> None:
        """Keep a registered layout's id for the next request that sends it."""
        if len(self._layout_ids) >= LAYOUT_IDS_KEPT:
            self._layout_ids.clear()
        self._layout_ids[(tenant, salt, wire)] = ns_id

    def _by_id(self, ref: kvstore_pb2.Namespace) -> bytes:
        who = current_identity()
        if ref.WhichOneof("ref") == "id":
            info = self.store.namespace(ref.id)
            if info.tenant != who.tenant and not who.is_admin:
                # The same answer as for an unknown id: another tenant's ids are not confirmed.
                raise NotFound(
                    f"namespace {ref.id.hex()} is not known to this daemon; "
                    "send the full layout instead of its id (the daemon forgets namespaces on restart)"
                )
            return info.namespace_id
        raise InvalidArgument("request names no namespace: set namespace.layout (or namespace.id once registered)")

    def _check_tenant_namespaces(self, layout: KVLayout, tenant: str, salt: bytes) -> None:
        """Refuse a tenant's new namespace past `max_namespaces_per_tenant` (counted only
        when the namespace is new, so the common path is one dictionary lookup)."""
        if self.store.has_namespace(tenant_namespace_id(layout.namespace_id, salt)):
            return
        limit = self.max_namespaces_per_tenant
        assert limit is not None
        held = sum(1 for ns in self.store.namespaces() if ns.tenant == tenant)
        if held >= limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} already holds {held} namespaces, the most max_namespaces_per_tenant allows; "
                "ask an operator to flush unused ones"
            )

    # -------------------------------------------------------------- block keys

    def chain(self, ns_id: bytes, keys: kvstore_pb2.BlockKeys) -> bytes | list[bytes]:
        """The chain a lookup-like request names, for `Store.lookup` / `lease_prefix`
        (which check it): packed as it came, hashed from its tokens, or the hashes listed."""
        which = keys.WhichOneof("keys")
        if which == "packed_hashes":
            return keys.packed_hashes
        if which == "tokens":
            return self.store.chain_for_tokens(ns_id, self._chain_tokens(keys))
        if which == "hashes":
            return list(keys.hashes.hashes)
        raise InvalidArgument("request names no blocks: set keys.packed_hashes, keys.hashes or keys.tokens")

    def hashes(self, ns_id: bytes, keys: kvstore_pb2.BlockKeys) -> list[bytes]:
        """The block hashes a request names, one object each."""
        which = keys.WhichOneof("keys")
        if which == "packed_hashes":
            return self._split(keys.packed_hashes)
        if which == "hashes":
            return list(keys.hashes.hashes)
        if which == "tokens":
            return self.store.hashes_for_tokens(ns_id, self._chain_tokens(keys))
        raise InvalidArgument("request names no blocks: set keys.packed_hashes, keys.hashes or keys.tokens")

    def check_keys(self, keys: kvstore_pb2.BlockKeys, layout: KVLayout) -> int:
        """How many blocks a read of an unregistered `layout` names, its keys checked as a
        registered namespace's would be (their shape and the per-call limits): bad input
        is refused the same whether the daemon knows the layout or not."""
        which = keys.WhichOneof("keys")
        if which == "packed_hashes":
            n = len(self._split(keys.packed_hashes))
        elif which == "hashes":
            hashes = list(keys.hashes.hashes)
            self.store.check_hashes(hashes)
            n = len(hashes)
        elif which == "tokens":
            n = len(self._chain_tokens(keys)) // 4 // layout.block_size_tokens
        else:
            raise InvalidArgument("request names no blocks: set keys.packed_hashes, keys.hashes or keys.tokens")
        self._check_block_count(n)
        return n

    def put_keys(self, info: NamespaceInfo, header: kvstore_pb2.PutHeader) -> tuple[list[bytes], bytes | None]:
        """A put's block hashes and the hash of the block before them (None at a chain's start).

        The engine's names for the blocks (`header.engine_names`) are checked here too, and
        handed with the put's tokens to `put_names` (the KV event streams) when it is set."""
        hashes, parent, tokens = self._put_keys(info, header)
        if header.HasField("engine_names"):
            check_engine_names(header.engine_names, len(hashes), info.layout.block_size_tokens, bool(tokens))
        if self.put_names is not None and (tokens or header.HasField("engine_names")):
            self.put_names(info, hashes, parent, tokens, header.engine_names if header.HasField("engine_names")
                           else None)
        return hashes, parent

    def _put_keys(self, info: NamespaceInfo, header: kvstore_pb2.PutHeader) -> tuple[list[bytes], bytes | None, bytes]:
        """`put_keys`, and the put's blocks' token ids packed (empty for a put by hashes)."""
        keys = header.keys
        which = keys.WhichOneof("keys")
        if which == "hashes" or which == "packed_hashes":
            hashes = self._split(keys.packed_hashes) if which == "packed_hashes" else list(keys.hashes.hashes)
            if header.num_blocks and header.num_blocks != len(hashes):
                raise InvalidArgument(f"num_blocks is {header.num_blocks} but {len(hashes)} hashes were sent")
            return hashes, header.parent_hash or None, b""
        if which == "tokens":
            tokens = keys.tokens
            packed = self._packed_tokens(tokens)
            first, count = tokens.first_block, header.num_blocks
            bst = info.layout.block_size_tokens
            n_tokens = len(packed) // 4
            full = n_tokens // bst
            if count == 0:
                count = full - first
            if count <= 0 or first + count > full:
                raise InvalidArgument(
                    f"the put covers blocks [{first}, {first + max(count, 0)}) but {n_tokens} tokens "
                    f"make {full} full blocks of {bst} tokens; send the whole prefix up to the last block"
                )
            self._check_block_count(count)  # before hashing
            # The prefix before `first` is hashed too (the chain needs it) but not bounded
            # by the per-call block limit: it names no blocks of this put.
            all_hashes = block_hashes_packed(info.chain_seed or info.namespace_id,
                                             memoryview(packed)[: (first + count) * bst * 4], bst)
            return (all_hashes[first : first + count], all_hashes[first - 1] if first else None,
                    packed[first * bst * 4 : (first + count) * bst * 4])
        raise InvalidArgument("put header names no blocks: set keys.packed_hashes, keys.hashes or keys.tokens")

    def _split(self, packed: bytes) -> list[bytes]:
        if len(packed) % HASH_BYTES == 0:
            # Bounded before the hashes are cut out; each is 16 bytes by construction.
            self._check_block_count(len(packed) // HASH_BYTES)
        return split_hashes(packed)  # names the length when it is not a multiple of 16

    def _check_block_count(self, n: int) -> None:
        limit = self.store.limits.max_blocks_per_call
        if n > limit:
            raise InvalidArgument(f"{n} block hashes in one call; the limit is {limit}: split the request")

    def _chain_tokens(self, keys: kvstore_pb2.BlockKeys) -> bytes:
        """The packed token ids of a request outside a Put, which names its chain from block 0."""
        if keys.tokens.first_block:
            raise InvalidArgument("first_block is only meaningful in a Put")
        return self._packed_tokens(keys.tokens)

    def _packed_tokens(self, tokens: kvstore_pb2.TokenIds) -> bytes:
        n = len(tokens.packed_u32le) // 4 + len(tokens.token_ids)
        if n > self.max_tokens_per_call:
            raise InvalidArgument(
                f"{n} token ids in one call; the limit is max_tokens_per_call = {self.max_tokens_per_call}: "
                "send fewer tokens (a lookup needs only the prefix it asks about)"
            )
        if tokens.packed_u32le:
            if len(tokens.token_ids):
                raise InvalidArgument("set token_ids or packed_u32le, not both")
            if len(tokens.packed_u32le) % 4:
                raise InvalidArgument(f"packed_u32le is {len(tokens.packed_u32le)} bytes, not a multiple of 4")
            return tokens.packed_u32le
        return token_bytes(tokens.token_ids)

    # -------------------------------------------------------------- sessions

    def session(self, session_id: str, expect_reuse_within_s: float = END_SESSION_WINDOW_S) -> str:
        """The policies' key for the caller's session id, checked here: with auth on the
        store sees only a digest of it (`LeaseTags.session`)."""
        check_hint(session_id, expect_reuse_within_s)
        return self.tags.session(session_id)

    def put_session(self, header: kvstore_pb2.PutHeader) -> str:
        """The session key of a put's hint ("" without one), checked before the put
        begins, so a bad hint refuses the put instead of failing it after its blocks
        were stored."""
        if not header.HasField("hint"):
            return ""
        return self.session(header.hint.session_id, header.hint.expect_reuse_within_s)
