"""The pool as the services see it: `PoolNode`, what the servicer, the local plane, the
data lane's transfers, the Admin service and the daemon call on this daemon's node of
the pool, and `SoloNode`, the node of a daemon that is one of no pool (`cluster = false`,
the default).

Primitives: `PoolNode`, `SoloNode`, `NOT_IN_A_POOL`.

The daemon builds its node before the services and hands it to them: a pool's
`ClusterNode` (kvstore.cluster.pool), which meets the protocol as it is, or a `SoloNode`,
whose answers are those of a node alone: nothing past the local prefix (`extend`), no
pulls to wait for (`pulling`, `settle_fetch`), nothing forwarded (`left`, `after_put`),
no pool status (`status` is None: INFO says `cluster_enabled:0`), and
FAILED_PRECONDITION for what only a pool has (`where`, `drain`, `settings`).

`SoloNode` lives here, not in kvstore.cluster: a single daemon imports no cluster code
at all (tests/cluster/test_cluster_pool.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvstore.errors import FailedPrecondition

if TYPE_CHECKING:
    from kvstore.cluster.pool import ClusterSettings, ClusterStatus, DrainResult, Extension, ForwardTicket, UnitPlace

NOT_IN_A_POOL = "this daemon is not one of a pool (cluster is off); see docs/cluster.md"


class PoolNode(Protocol):
    """This daemon's node of the pool, as its services call it."""

    @property
    def node_id(self) -> str:
        """The node's id in the pool ("" for a daemon alone)."""
        ...

    @property
    def left(self) -> bool:
        """Whether the node is in no pool's view now: it asks no other node and forwards
        nothing (a node that left the pool, or a daemon alone)."""
        ...

    @property
    def pulling(self) -> bool:
        """Whether any pull is copying blocks here now (a fetch has something to wait for)."""
        ...

    @property
    def settings(self) -> ClusterSettings:
        """The pool's settings (a forward's wait for its owners reads them)."""
        ...

    async def extend(self, namespace_id: bytes, chain: bytes | Sequence[bytes], held: int,
                     lease_id: str = "") -> Extension | None:
        """The rest of a lookup's answer past its local prefix of `held` blocks; None when
        nothing past it is found. What the pool copies here for it is held under the
        lookup's store lease `lease_id`, if any."""
        ...

    def peer_looked_up(self, asked: int, held: int) -> None:
        """Count another node's lookup answered here: `held` of its `asked` blocks."""
        ...

    async def settle_fetch(self, namespace_id: bytes, chain: bytes | Sequence[bytes]) -> None:
        """Before a fetch: wait (bounded) for the pulls copying the blocks its prefix needs."""
        ...

    def peer_fetched(self, namespace_id: bytes, hashes: Sequence[bytes]) -> None:
        """Another node fetched these blocks from here."""
        ...

    def after_put(self, namespace_id: bytes, hashes: Sequence[bytes], parent: bytes | None, position: int | None,
                  *, tokens: bytes = b"", wait: bool = False, from_peer: str = "") -> ForwardTicket | None:
        """A put committed here: its forwards to the owners of its units (None: none)."""
        ...

    def after_peer_put(self, namespace_id: bytes,
                       runs: Sequence[tuple[Sequence[bytes], bytes | None, int | None]]) -> None:
        """Another node's forward of several runs of one chain, committed here."""
        ...

    def where(self, namespace_id: bytes, chain: bytes | Sequence[bytes]) -> list[UnitPlace]:
        """Each placement unit of a chain: its owners, and how much of it is held here."""
        ...

    def status(self) -> ClusterStatus | None:
        """The pool as this node sees it; None for a daemon alone."""
        ...

    async def drain(self, timeout_s: float = ...) -> DrainResult:
        """Hand the units owned here to their next owners, then leave the pool."""
        ...

    async def leave(self) -> None:
        """Leave every view now (on SIGTERM, before the calls in flight drain)."""
        ...

    async def aclose(self) -> None: ...


class SoloNode:
    """The node of a daemon alone: the single-node answers (see the module docstring)."""

    node_id = ""
    left = True
    pulling = False

    @property
    def settings(self) -> ClusterSettings:
        # Never read: nothing is forwarded from a daemon alone, so nothing waits for owners.
        raise FailedPrecondition(NOT_IN_A_POOL)

    async def extend(self, namespace_id: bytes, chain: bytes | Sequence[bytes], held: int,
                     lease_id: str = "") -> Extension | None:
        return None

    def peer_looked_up(self, asked: int, held: int) -> None:
        pass

    async def settle_fetch(self, namespace_id: bytes, chain: bytes | Sequence[bytes]) -> None:
        pass

    def peer_fetched(self, namespace_id: bytes, hashes: Sequence[bytes]) -> None:
        pass

    def after_put(self, namespace_id: bytes, hashes: Sequence[bytes], parent: bytes | None, position: int | None,
                  *, tokens: bytes = b"", wait: bool = False, from_peer: str = "") -> ForwardTicket | None:
        return None

    def after_peer_put(self, namespace_id: bytes,
                       runs: Sequence[tuple[Sequence[bytes], bytes | None, int | None]]) -> None:
        pass

    def where(self, namespace_id: bytes, chain: bytes | Sequence[bytes]) -> list[UnitPlace]:
        raise FailedPrecondition(NOT_IN_A_POOL)

    def status(self) -> ClusterStatus | None:
        return None

    async def drain(self, timeout_s: float = 0.0) -> DrainResult:
        raise FailedPrecondition(NOT_IN_A_POOL)

    async def leave(self) -> None:
        pass

    async def aclose(self) -> None:
        pass
