"""Circuit breakers for calls to peers, with a manual clock: closed while calls succeed,
open (suspect) after a couple of failures in a row, one probe once the cool-down is over,
twice as long after a failed probe (capped), and forgotten when told."""

from __future__ import annotations

from kvstore.cluster.breaker import Breakers
from kvstore.cluster.pool import PackedChain
from tests.fakes import ManualClock


def test_failures_open_the_breaker_and_a_probe_closes_it() -> None:
    clock = ManualClock(0.0)
    b = Breakers(2.0, threshold=2, max_cool_s=5.0, clock=clock)
    assert b.allow("x")
    b.failure("x")
    assert b.allow("x") and not b.suspect("x")  # one failure is not enough
    b.failure("x")
    assert b.suspect("x") and not b.allow("x") and b.suspects() == {"x": 2.0}
    clock.now += 2.0
    assert b.allow("x") and not b.allow("x")  # one probe at a time
    b.failure("x")  # the probe failed: open for twice as long
    clock.now += 3.9
    assert not b.allow("x")
    clock.now += 0.2
    assert b.allow("x")
    b.failure("x")
    assert abs(b.suspects()["x"] - 5.0) < 1e-9  # capped
    clock.now += 5.0
    assert b.allow("x")
    b.success("x")
    assert not b.suspect("x") and b.allow("x") and b.trips("x") == 3
    b.failure("x")
    assert not b.suspect("x")  # the count started again
    b.forget("x")
    assert b.trips("x") == 0


def test_a_success_resets_the_run_of_failures() -> None:
    b = Breakers(1.0, threshold=2, clock=ManualClock(0.0))
    for _ in range(5):
        b.failure("y")
        b.success("y")
    assert not b.suspect("y")


def test_a_packed_chain_reads_as_its_hashes() -> None:
    hashes = [bytes([i]) * 16 for i in range(5)]
    chain = PackedChain(b"".join(hashes))
    assert len(chain) == 5 and list(chain) == hashes and chain[-1] == hashes[4]
    assert list(chain[1:3]) == hashes[1:3]
