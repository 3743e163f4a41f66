"""The namespace registry: which layouts the daemon knows, whose they are, and the
per-call limits every verb's input is checked against.

A namespace is recorded when a put of its layout publishes (`prepare` gives the put a
record, `ensure` files it in the step that publishes), or when `register` is called;
later requests may name it by id. A read of a layout never registers it (the read is a
miss), so neither made-up layouts nor refused puts fill `max_namespaces`. The one
exception: blocks recovered from the SSD carry their namespace id but not its layout,
and are adopted (counted, and charged to the tenant) by the first request that sends
the layout, a read included.

Why reads may skip registration: apart from those recovered blocks, an unregistered
namespace holds no READY block (only a put publishes one, and it registers first), so
a read of it has nothing to find. The ids of namespaces with recovered blocks not yet
adopted are kept (`recovered`); every other registration skips the index scan.

A namespace that holds no block is forgotten once it has held none for
`StoreLimits.namespace_grace_s` (`expire`; None keeps every namespace). That is safe
with adoption: it has no rows left to adopt, and a put in flight re-files its record
when it publishes.

The checks here guard the store's invariants, so they stay in the core whatever a
server checks before: a namespace id is 16 bytes and known, a block hash is 16 bytes,
a call names at most `max_blocks_per_call` blocks, a hint names a session and a bounded
time.

Each tenant also has a space (`space_of_tenant`: 1, 2, ... in order of first sight;
`space(namespace_id)`: its namespace's tenant's, 0 for a namespace not registered): a
tier with spaces keeps each space's blocks in memory of its own, so a co-located client
maps its tenant's blocks and no other's (`kvstore.core.tier.Tier.spaces`). A tenant's
space outlives its namespaces.

Primitives: `prepare`/`ensure`, `register`, `recovered`/`awaits_adoption`, `expire`,
`namespace`, `get`, `check_hashes`, `packed_chain`, `chain_for_tokens`, `check_hint`,
`space`, `space_of_tenant`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from kvstore.core.index import BlockIndex
from kvstore.core.tenancy import TenantLedger
from kvstore.core.types import NamespaceInfo, StoreLimits
from kvstore.errors import InvalidArgument, NotFound, ResourceExhausted
from kvstore.hashing import (
    HASH_BYTES,
    block_hashes_packed,
    chain_packed,
    group_namespace_id,
    packed_count,
    tenant_namespace_id,
)
from kvstore.layout import KVLayout

logger = logging.getLogger(__name__)

MAX_SESSION_ID_CHARS = 128


def group_layout(layout: KVLayout, g: int) -> KVLayout:
    """The layout of group `g`'s record: its parts' dtype and size, under the layout's
    model and block size (a put's messages name them)."""
    group = layout.groups[g]
    return KVLayout(model=layout.model, revision=layout.revision, lora_id=layout.lora_id, dtype=group.dtype,
                    num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                    block_size_tokens=layout.block_size_tokens, kv_layout=f"group:{group.name}",
                    tp_rank=layout.tp_rank, tp_size=layout.tp_size, block_bytes=group.bytes_per_block)
MAX_HINT_S = 86_400.0


def check_hint(session_id: str, expect_reuse_within_s: float) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidArgument(f"session_id must be 1 to {MAX_SESSION_ID_CHARS} characters; use one per conversation")
    if not 0 < expect_reuse_within_s <= MAX_HINT_S:  # also false for NaN
        raise InvalidArgument(
            f"expect_reuse_within_s must be in (0, {MAX_HINT_S:g}] seconds, got {expect_reuse_within_s!r}"
        )


# How often `expire` looks for namespaces to forget, at most (less with a short grace).
EXPIRE_SWEEP_S = 10.0


class NamespaceRegistry:
    """Namespaces by id, and the per-call limits (`limits`, replaced whole at runtime)."""

    def __init__(self, index: BlockIndex, tenancy: TenantLedger, limits: StoreLimits) -> None:
        self._index = index
        self._tenancy = tenancy
        self.limits = limits
        self._namespaces: dict[bytes, NamespaceInfo] = {}
        # Namespaces whose blocks were recovered (from SSD) and no request has named yet.
        self._unadopted: set[bytes] = set()
        # When each registered namespace was first seen holding no block (`expire`).
        self._empty_since: dict[bytes, float] = {}
        self._next_sweep = 0.0
        # The groups of grouped namespaces (kvstore.core.groups), by their own ids: the
        # copy book accounts their parts through `get`; requests never name them.
        self._group_records: dict[bytes, NamespaceInfo] = {}
        # Told of a grouped namespace that adopted blocks recovered from SSD.
        self.on_adopted: Callable[[NamespaceInfo], object] | None = None
        self._spaces: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._namespaces)

    def recovered(self, namespace_ids: Iterable[bytes]) -> None:
        """The index holds blocks of these namespaces, recovered at start: a request that
        names one of their layouts adopts them, even a read."""
        self._unadopted.update(i for i in namespace_ids if i not in self._namespaces)

    def prepare(self, layout: KVLayout, tenant: str = "default", salt: bytes = b"") -> NamespaceInfo:
        """The record a put of `layout` works with: the registered one, or a new one that
        is filed only when the put publishes (`ensure`). Refused when it is new and the
        registry is full, before any byte of the put arrives."""
        public_id = layout.namespace_id
        ns_id = tenant_namespace_id(public_id, salt)
        info = self._namespaces.get(ns_id)
        if info is not None:
            return info
        self._check_room()
        info = NamespaceInfo(ns_id, layout, tenant=tenant, chain_seed=public_id)
        if layout.groups:
            info.groups = tuple(
                NamespaceInfo(group_namespace_id(ns_id, g), group_layout(layout, g), tenant=tenant,
                              chain_seed=public_id, group_of=info)
                for g in range(len(layout.groups))
            )
        return info

    def ensure(self, info: NamespaceInfo) -> NamespaceInfo:
        """The registered record of `info`'s namespace, filing `info` if there is none yet
        (adopting blocks recovered from SSD). Synchronous: a put calls it in the step
        that publishes. A group's record is filed with its layout's, all groups at once."""
        if info.group_of is not None:
            parent = self.ensure(info.group_of)
            return self._group_records[parent.groups[info.group_of.groups.index(info)].namespace_id]
        known = self._namespaces.get(info.namespace_id)
        if known is not None:
            return known
        self._check_room()
        ns_id = info.namespace_id
        adopted = False
        for rec in (info, *info.groups):
            if rec.namespace_id in self._unadopted:
                adopted = True
                self._adopt(rec)
        self._namespaces[ns_id] = info
        for rec in info.groups:
            self._group_records[rec.namespace_id] = rec
        if adopted and info.groups and self.on_adopted is not None:
            self.on_adopted(info)
        layout = info.layout
        logger.info("namespace %s registered: model=%s dtype=%s block=%d tokens / %d bytes",
                    ns_id.hex(), layout.model, layout.dtype, layout.block_size_tokens, layout.bytes_per_block)
        return info

    def _adopt(self, info: NamespaceInfo) -> None:
        """Blocks the index holds already (recovered from SSD) count for `info` from now."""
        ns_id = info.namespace_id
        self._unadopted.discard(ns_id)
        usage = self._index.namespace_usage(ns_id)
        if usage is not None:
            info.blocks += usage.blocks
            info.bytes += usage.nbytes
            for name, nbytes in usage.by_tier.items():
                self._tenancy.add(info.tenant, name, nbytes)

    def register(self, layout: KVLayout, tenant: str = "default", salt: bytes = b"") -> bytes:
        """Record a layout for `tenant`; returns its namespace id (salted by `salt`). Idempotent."""
        return self.ensure(self.prepare(layout, tenant, salt)).namespace_id

    def awaits_adoption(self, namespace_id: bytes, layout: KVLayout | None = None) -> bool:
        """Whether the index holds recovered blocks of this unregistered namespace (a read
        of its layout registers it to adopt them; a read of any other unregistered
        layout is a miss, and registers nothing). With the `layout`, a grouped one's
        blocks are looked for under its groups' ids."""
        if namespace_id in self._unadopted:
            return True
        if layout is None or not layout.groups or not self._unadopted:
            return False
        return any(group_namespace_id(namespace_id, g) in self._unadopted for g in range(len(layout.groups)))

    def _check_room(self) -> None:
        if len(self._namespaces) >= self.limits.max_namespaces:
            raise ResourceExhausted(
                f"the daemon already holds {self.limits.max_namespaces} namespaces; "
                "flush unused ones or raise max_namespaces"
            )

    def expire(self, now: float) -> int:
        """Forget the namespaces that have held no block for `namespace_grace_s`; how many.
        Looks at most every EXPIRE_SWEEP_S (half the grace, if shorter): a namespace is
        forgotten between one grace and one grace plus a sweep after its last block went."""
        grace = self.limits.namespace_grace_s
        if grace is None or now < self._next_sweep:
            return 0
        self._next_sweep = now + min(EXPIRE_SWEEP_S, grace / 2)
        empty_since = self._empty_since
        gone = []
        for ns_id, info in self._namespaces.items():
            if info.blocks or any(g.blocks for g in info.groups):
                empty_since.pop(ns_id, None)
                continue
            since = empty_since.setdefault(ns_id, now)
            if now - since >= grace:
                gone.append(ns_id)
        for ns_id in gone:
            for rec in self._namespaces.pop(ns_id).groups:
                del self._group_records[rec.namespace_id]
            del empty_since[ns_id]
        if gone:
            logger.info("%d namespaces forgotten: they held no block for %gs (namespace_grace_s)", len(gone), grace)
        return len(gone)

    def has(self, namespace_id: bytes) -> bool:
        return namespace_id in self._namespaces

    def get(self, namespace_id: bytes) -> NamespaceInfo | None:
        """The namespace's record, or None (not registered: e.g. blocks recovered from SSD
        whose layout no request has sent yet). Also the record of one group of a grouped
        namespace, by the group's id."""
        info = self._namespaces.get(namespace_id)
        return info if info is not None else self._group_records.get(namespace_id)

    def namespace(self, namespace_id: bytes) -> NamespaceInfo:
        """The record of a namespace a request names; InvalidArgument or NotFound if it
        cannot be one."""
        if len(namespace_id) != HASH_BYTES:
            raise InvalidArgument(f"namespace id must be {HASH_BYTES} bytes, got {len(namespace_id)}")
        info = self._namespaces.get(namespace_id)
        if info is None:
            raise NotFound(
                f"namespace {namespace_id.hex()} is not known to this daemon; "
                "send the full layout instead of its id (the daemon forgets namespaces on restart)"
            )
        return info

    def all(self) -> list[NamespaceInfo]:
        """Every namespace (not their groups' records); a grouped one's `blocks` and
        `bytes` refreshed from its groups (blocks: the most any group holds)."""
        out = list(self._namespaces.values())
        for info in out:
            if info.groups:
                info.blocks = max(g.blocks for g in info.groups)
                info.bytes = sum(g.bytes for g in info.groups)
        return out

    def space_of_tenant(self, tenant: str) -> int:
        """`tenant`'s space: the same for the daemon's lifetime, never 0."""
        space = self._spaces.get(tenant)
        if space is None:
            space = self._spaces[tenant] = len(self._spaces) + 1
        return space

    def space(self, namespace_id: bytes) -> int:
        """The space of a namespace's blocks: its tenant's; 0 if it is not registered."""
        info = self._namespaces.get(namespace_id)
        return 0 if info is None else self.space_of_tenant(info.tenant)

    def owned_by(self, tenant: str) -> set[bytes]:
        """The ids of `tenant`'s namespaces."""
        return ({i.namespace_id for i in self._namespaces.values() if i.tenant == tenant}
                | {i.namespace_id for i in self._group_records.values() if i.tenant == tenant})

    def hashes_for_tokens(self, namespace_id: bytes, packed_tokens: bytes, max_blocks: int | None = None) -> list[bytes]:
        """Block hashes of tokens packed as little-endian u32 (at most `max_blocks` blocks)."""
        return block_hashes_packed(*self._token_blocks(namespace_id, packed_tokens, max_blocks))

    def chain_for_tokens(self, namespace_id: bytes, packed_tokens: bytes, max_blocks: int | None = None) -> bytes:
        """`hashes_for_tokens` as one packed chain (N x 16 bytes), the form a lookup probes."""
        return chain_packed(*self._token_blocks(namespace_id, packed_tokens, max_blocks))

    def _token_blocks(self, namespace_id: bytes, packed_tokens: bytes,
                      max_blocks: int | None) -> tuple[bytes, memoryview, int]:
        """The chain's seed, the tokens of its full blocks (per-call limit checked) and the
        block size."""
        info = self.namespace(namespace_id)
        step = info.layout.block_size_tokens * 4
        n_blocks = len(packed_tokens) // step
        if max_blocks is not None:
            n_blocks = min(n_blocks, max_blocks)
        self.check_count(n_blocks, "blocks of tokens")
        return (info.chain_seed or namespace_id, memoryview(packed_tokens)[: n_blocks * step],
                info.layout.block_size_tokens)

    def check_hashes(self, hashes: Sequence[bytes]) -> None:
        self.check_count(len(hashes), "block hashes")
        if hashes and set(map(len, hashes)) != {HASH_BYTES}:  # one C-level pass in the common case
            i, h = next((i, h) for i, h in enumerate(hashes) if len(h) != HASH_BYTES)
            raise InvalidArgument(f"block hash {i} is {len(h)} bytes; every block hash is {HASH_BYTES} bytes")

    def packed_chain(self, hashes: Sequence[bytes] | bytes) -> bytes:
        """A chain of hashes, given one by one or packed (N x 16 bytes), packed; its
        length is checked against the per-call limit."""
        if isinstance(hashes, bytes):
            self.check_count(packed_count(hashes), "block hashes")
            return hashes
        self.check_hashes(hashes)
        return b"".join(hashes)

    def check_count(self, n: int, what: str) -> None:
        if n > self.limits.max_blocks_per_call:
            raise InvalidArgument(
                f"{n} {what} in one call; the limit is {self.limits.max_blocks_per_call}: split the request"
            )
