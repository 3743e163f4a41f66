"""Circuit breakers for calls to peers, with a manual clock: closed while calls succeed,
open (suspect) after a couple of failures in a row, one probe once the cool-down is over,
claimed only by a call made and given back when none is, twice as long after a failed
probe (capped), and forgotten when told (calls begun before no longer count)."""

from __future__ import annotations

from kvstore.cluster.breaker import Breakers
from kvstore.cluster.pool import PackedChain
from tests.fakes import ManualClock


def _call(b: Breakers, node: str, ok: bool) -> bool:
    """One call to `node`, if its breaker lets one out, with its verdict; whether it went out."""
    attempt = b.attempt(node)
    if attempt is None:
        return False
    if ok:
        attempt.success()
    else:
        attempt.failure()
    return True


def test_failures_open_the_breaker_and_a_probe_closes_it() -> None:
    clock = ManualClock(0.0)
    b = Breakers(2.0, threshold=2, max_cool_s=5.0, clock=clock)
    assert _call(b, "x", ok=False)
    assert b.ready("x") and not b.suspect("x")  # one failure is not enough
    assert _call(b, "x", ok=False)
    assert b.suspect("x") and not b.ready("x") and b.attempt("x") is None and b.suspects() == {"x": 2.0}
    clock.now += 2.0
    probe = b.attempt("x")
    assert probe is not None and probe.probe
    assert not b.ready("x") and b.attempt("x") is None  # one probe at a time
    probe.failure()  # the probe failed: open for twice as long
    clock.now += 3.9
    assert not b.ready("x")
    clock.now += 0.2
    assert _call(b, "x", ok=False)
    assert abs(b.suspects()["x"] - 5.0) < 1e-9  # capped
    clock.now += 5.0
    assert _call(b, "x", ok=True)
    assert not b.suspect("x") and b.ready("x") and b.trips("x") == 3
    assert _call(b, "x", ok=False)
    assert not b.suspect("x")  # the count started again
    b.forget("x")
    assert b.trips("x") == 0


def test_a_success_resets_the_run_of_failures() -> None:
    b = Breakers(1.0, threshold=2, clock=ManualClock(0.0))
    for _ in range(5):
        _call(b, "y", ok=False)
        _call(b, "y", ok=True)
    assert not b.suspect("y")


def test_readiness_claims_nothing_and_a_probe_not_used_goes_back() -> None:
    """A lookup round asks `ready` of every member while it plans; only the calls it makes
    claim a probe, and a claim that ends without a verdict (no call made, cancelled)
    gives the probe back: the next call is the probe."""
    clock = ManualClock(0.0)
    b = Breakers(2.0, threshold=1, clock=clock)
    _call(b, "x", ok=False)
    clock.now += 2.0
    for _ in range(10):
        assert b.ready("x")  # planning, over and over: nothing taken
    with b.attempt("x") as probe:  # a call that ends without a verdict (its lookup was cancelled)
        assert probe.probe and not b.ready("x")
    assert b.ready("x") and b.suspect("x")
    assert _call(b, "x", ok=True)
    assert not b.suspect("x")


def test_a_peer_forgotten_starts_closed_and_calls_begun_before_do_not_count() -> None:
    """A peer that restarted or left the view and came back is forgotten: closed, and
    the verdicts of calls made to it before that are of the peer as it was."""
    clock = ManualClock(0.0)
    b = Breakers(2.0, threshold=2, clock=clock)
    early = [b.attempt("x"), b.attempt("x")]
    b.forget("x")
    for attempt in early:
        assert attempt is not None
        attempt.failure()  # the calls to the old process fail after it was forgotten
    assert not b.suspect("x") and b.ready("x")
    _call(b, "x", ok=False)
    _call(b, "x", ok=False)
    assert b.suspect("x")
    stale = b.attempt("y")
    b.forget("x")
    assert stale is not None and not b.suspect("x")


def test_a_packed_chain_reads_as_its_hashes() -> None:
    hashes = [bytes([i]) * 16 for i in range(5)]
    chain = PackedChain(b"".join(hashes))
    assert len(chain) == 5 and list(chain) == hashes and chain[-1] == hashes[4]
    assert list(chain[1:3]) == hashes[1:3]
