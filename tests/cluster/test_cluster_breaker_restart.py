"""A restarted peer is trusted again: real daemons (a static pool of three on loopback, on
the test's loop), one of them stopped and started again on the same address while the
others keep working.

The sequence a pool meets after a peer's restart: calls to the stopped node fail, its
breaker opens (suspect); the node comes back; meanwhile the lookups on the surviving node
are of chains the restarted node owns no unit of, and the puts there forward to it.
Whatever that traffic is, the first call made to the peer once its cool-down is over
probes it, and a probe that succeeds closes its breaker:

* lookups whose round asks the restarted node nothing must not take its probe (and
  keep it: no other call could then try it, ever);
* a forward to a suspect owner whose cool-down is over is the probe, not dropped.

No timing decides a result: each test waits until the node's status says its cool-down
is over (`suspect_for_s` 0), makes the calls of the sequence, and then asserts what one
call to the peer must have settled.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from conftest import SMALL_LAYOUT

from kvstore.client import AsyncClient
from kvstore.cluster.placement import Placement
from kvstore.hashing import block_hashes, namespace_id
from kvstore.server.daemon import Daemon
from tests.cluster.pool_fixtures import chain, pool, unix_target
from tests.polling import eventually

LAYOUT = SMALL_LAYOUT
IDS = ("n0", "n1", "n2")
# Longer than the pool's gRPC channels' largest reconnect backoff (2 s), so the probe
# finds the restarted node's channel ready to connect again.
SUSPECT_S = 2.5
CHAIN_BLOCKS = 8
# No grace period after the pool forms: a round asks each unit's owner alone, never a
# previous owner (which n1 could be of a unit n2 owns now).
SETTINGS = {"cluster_suspect_s": SUSPECT_S, "cluster_lookup_timeout_ms": 1000.0, "cluster_grace_s": 0.0}


def _owners(tokens: list[int]) -> list[str]:
    """The owner of each placement unit of the chain of `tokens`, in chain order."""
    placement = Placement(IDS)
    hashes = block_hashes(namespace_id(LAYOUT), tokens, LAYOUT.block_size_tokens)
    return [placement.owners(unit.key)[0] for unit in placement.spans(hashes)]


def _chains(want: str, first: str, never: str = "", seeds: Iterator[int] | None = None) -> Iterator[list[int]]:
    """Token ids of chains whose first unit `first` owns, some unit `want` owns, and no
    unit `never` owns."""
    for seed in seeds or iter(range(1000, 100_000)):
        tokens, _ = chain(LAYOUT, CHAIN_BLOCKS, seed)
        owners = _owners(tokens)
        if owners[0] == first and want in owners and never not in owners:
            yield tokens


def _state(daemon: Daemon, node: str) -> tuple[bool, float]:
    """(suspect, seconds until it is tried again) of `node` as `daemon` sees it."""
    assert daemon.cluster is not None
    m = next(m for m in daemon.cluster.status().members if m.member.node_id == node)
    return m.suspect, m.suspect_for_s


async def _restart(daemons: list[Daemon], i: int) -> Daemon:
    """Stop daemon `i` and start it again with its config (same node id, same address)."""
    await daemons[i].stop(grace_s=0)
    again = Daemon(daemons[i].config)
    await again.start()
    daemons[i] = again  # the pool fixture stops this one at the end
    return again


async def _due(daemon: Daemon, node: str) -> None:
    async def due() -> bool:
        suspect, wait_s = _state(daemon, node)
        return suspect and wait_s == 0.0

    await eventually(due, f"{node}'s cool-down over on {daemon.config.node_id}", 4 * SUSPECT_S)


async def test_lookups_that_ask_a_restarted_peer_nothing_leave_its_probe_to_a_call(tmp_path: Path) -> None:
    async with pool(tmp_path, 3, **SETTINGS) as daemons:
        a = daemons[0]
        # Chains looked up on n0: some whose first unit n1 owns (a lookup asks n1), and
        # some n1 owns no unit of (a round asks n2 alone). Nobody holds any: every
        # answer is 0 blocks, which is an answer (the breaker counts it a success).
        asks_n1 = _chains("n1", "n1")
        asks_n2_only = _chains("n2", "n2", never="n1")
        await daemons[1].stop(grace_s=0)
        async with AsyncClient(unix_target(a)) as kv:
            for tokens in asks_n1:
                await kv.lookup(LAYOUT, tokens)
                if _state(a, "n1")[0]:
                    break
            assert _state(a, "n1")[0], "n1 stopped: its calls failed, it is suspect"
            await _restart(daemons, 1)
            await _due(a, "n1")
            # While n1 is due for a probe, lookups whose rounds ask it nothing.
            for _ in range(5):
                assert (await kv.lookup(LAYOUT, next(asks_n2_only))).num_blocks == 0
            assert _state(a, "n1")[0], "no call was made to n1: nothing could have closed its breaker"
            # The next lookup that asks n1 is its probe: n1 answers, and is trusted again.
            await kv.lookup(LAYOUT, next(asks_n1))
            assert _state(a, "n1") == (False, 0.0)


async def test_a_forward_to_a_suspect_owner_probes_it_once_its_cool_down_is_over(tmp_path: Path) -> None:
    async with pool(tmp_path, 3, **SETTINGS) as daemons:
        a = daemons[0]
        # Puts on n0 of chains with units n1 owns: forwarded to n1.
        to_n1 = _chains("n1", "n0")
        await daemons[1].stop(grace_s=0)
        async with AsyncClient(unix_target(a)) as kv:
            seed = 0
            while not _state(a, "n1")[0]:
                seed += 1
                assert seed < 20, "forwards to a stopped node keep failing: it becomes suspect"
                tokens = next(to_n1)
                _, blocks = chain(LAYOUT, CHAIN_BLOCKS, seed)
                put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
                assert put.stored == CHAIN_BLOCKS and put.owner_committed_blocks < put.forwarded_blocks
            await _restart(daemons, 1)
            await _due(a, "n1")
            # The cool-down is over: the next forward to n1 goes out, and it is the probe.
            tokens = next(to_n1)
            _, blocks = chain(LAYOUT, CHAIN_BLOCKS, 500)
            put = await kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
            assert put.forwarded_blocks > 0 and put.owner_committed_blocks == put.forwarded_blocks
            assert _state(a, "n1") == (False, 0.0)
