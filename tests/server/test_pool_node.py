"""The node of the pool the services are built with: a pool's `ClusterNode` and a daemon
alone's `SoloNode` both meet `PoolNode`, and the solo node gives a node alone's answers."""

from __future__ import annotations

import inspect

import pytest

from kvstore.errors import FailedPrecondition
from kvstore.server.pool_node import NOT_IN_A_POOL, PoolNode, SoloNode


def _members() -> list[str]:
    return [name for name in vars(PoolNode) if not name.startswith("_")]


def _parameters(member: object) -> list[tuple[str, object]]:
    fn = member.fget if isinstance(member, property) else member  # type: ignore[attr-defined]
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


async def _nodes() -> list[object]:
    """An unstarted ClusterNode of a one-member static pool, and a SoloNode."""
    from kvstore.cluster.membership import Member, StaticMembership
    from kvstore.cluster.pool import ClusterNode
    from kvstore.cluster.transport import GrpcPeerTransport
    from kvstore.core.policies import make_policy
    from kvstore.core.store import Store, StoreTier
    from kvstore.tiers.memory import MemoryTier

    store = Store([StoreTier(MemoryTier(1 << 20), make_policy("lru"))])
    me = Member("a", ("127.0.0.1:1",))
    return [ClusterNode(store, StaticMembership(me, [me]), GrpcPeerTransport("a")), SoloNode()]


async def test_both_nodes_meet_the_protocol() -> None:
    for node in await _nodes():
        for member in _members():
            expected = vars(PoolNode)[member]
            found = inspect.getattr_static(node, member)  # AttributeError: the node lacks it
            if inspect.isfunction(expected):
                where = (type(node).__name__, member)
                assert inspect.iscoroutinefunction(found) == inspect.iscoroutinefunction(expected), where
                assert _parameters(found) == _parameters(expected), where


async def test_a_daemon_alone_answers_as_a_node_alone() -> None:
    node = SoloNode()
    assert node.node_id == "" and node.left and not node.pulling
    assert node.status() is None
    assert await node.extend(b"n" * 16, b"h" * 32, 1) is None
    assert node.after_put(b"n" * 16, [b"h" * 16], None, 0, wait=True) is None
    await node.settle_fetch(b"n" * 16, [b"h" * 16])
    node.after_peer_put(b"n" * 16, [([b"h" * 16], None, 0)])
    node.peer_looked_up(1, 0)
    node.peer_fetched(b"n" * 16, [b"h" * 16])
    with pytest.raises(FailedPrecondition, match="not one of a pool"):
        node.where(b"n" * 16, b"h" * 16)
    with pytest.raises(FailedPrecondition, match="not one of a pool"):
        await node.drain()
    with pytest.raises(FailedPrecondition) as raised:
        _ = node.settings
    assert str(raised.value) == NOT_IN_A_POOL
    await node.leave()
    await node.aclose()
