"""The namespace registry: which layouts the daemon knows, whose they are, and the
per-call limits every verb's input is checked against.

A namespace is recorded the first time a request sends its layout (`register`, with the
caller's tenant and salt); later requests name it by id. Blocks recovered from the SSD
carry their namespace id but not its layout: they are adopted (counted, and charged to
the tenant) when the first request that sends the layout registers it.

The checks here guard the store's invariants, so they stay in the core whatever a
server checks before: a namespace id is 16 bytes and known, a block hash is 16 bytes,
a call names at most `max_blocks_per_call` blocks, a hint names a session and a bounded
time.

Each tenant also has a space (`space_of_tenant`: 1, 2, ... in order of first sight;
`space(namespace_id)`: its namespace's tenant's, 0 for a namespace not registered): a
tier with spaces keeps each space's blocks in memory of its own, so a co-located client
maps its tenant's blocks and no other's (`kvstore.core.tier.Tier.spaces`).

Primitives: `register`, `namespace`, `get`, `check_hashes`, `packed_chain`,
`chain_for_tokens`, `check_hint`, `space`, `space_of_tenant`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.core.index import BlockIndex
from kvstore.core.results import NamespaceInfo, StoreLimits
from kvstore.core.tenancy import TenantLedger
from kvstore.errors import InvalidArgument, NotFound, ResourceExhausted
from kvstore.hashing import HASH_BYTES, block_hashes_packed, chain_packed, packed_count, tenant_namespace_id
from kvstore.layout import KVLayout

logger = logging.getLogger(__name__)

MAX_SESSION_ID_CHARS = 128
MAX_HINT_S = 86_400.0


def check_hint(session_id: str, expect_reuse_within_s: float) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidArgument(f"session_id must be 1 to {MAX_SESSION_ID_CHARS} characters; use one per conversation")
    if not 0 < expect_reuse_within_s <= MAX_HINT_S:  # also false for NaN
        raise InvalidArgument(
            f"expect_reuse_within_s must be in (0, {MAX_HINT_S:g}] seconds, got {expect_reuse_within_s!r}"
        )


class NamespaceRegistry:
    """Namespaces by id, and the per-call limits (`limits`, replaced whole at runtime)."""

    def __init__(self, index: BlockIndex, tenancy: TenantLedger, limits: StoreLimits) -> None:
        self._index = index
        self._tenancy = tenancy
        self.limits = limits
        self._namespaces: dict[bytes, NamespaceInfo] = {}
        self._spaces: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._namespaces)

    def register(self, layout: KVLayout, tenant: str = "default", salt: bytes = b"") -> bytes:
        """Record a layout for `tenant`; returns its namespace id (salted by `salt`). Idempotent."""
        public_id = layout.namespace_id
        ns_id = tenant_namespace_id(public_id, salt)
        if ns_id not in self._namespaces:
            if len(self._namespaces) >= self.limits.max_namespaces:
                raise ResourceExhausted(
                    f"the daemon already holds {self.limits.max_namespaces} namespaces; "
                    "flush unused ones or raise max_namespaces"
                )
            info = NamespaceInfo(ns_id, layout, tenant=tenant, chain_seed=public_id)
            # Blocks the index holds already (recovered from SSD) are adopted now.
            usage = self._index.namespace_usage(ns_id)
            if usage is not None:
                info.blocks += usage.blocks
                info.bytes += usage.nbytes
                for name, nbytes in usage.by_tier.items():
                    self._tenancy.add(tenant, name, nbytes)
            self._namespaces[ns_id] = info
            logger.info("namespace %s registered: model=%s dtype=%s block=%d tokens / %d bytes",
                        ns_id.hex(), layout.model, layout.dtype, layout.block_size_tokens, layout.bytes_per_block)
        return ns_id

    def has(self, namespace_id: bytes) -> bool:
        return namespace_id in self._namespaces

    def get(self, namespace_id: bytes) -> NamespaceInfo | None:
        """The namespace's record, or None (not registered: e.g. blocks recovered from SSD
        whose layout no request has sent yet)."""
        return self._namespaces.get(namespace_id)

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
        return list(self._namespaces.values())

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
        return {i.namespace_id for i in self._namespaces.values() if i.tenant == tenant}

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
