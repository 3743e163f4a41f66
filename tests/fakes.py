"""Fakes shared by the tests: only for time (the rest of the suite uses real components)."""

from __future__ import annotations


class ManualClock:
    """A clock the test moves by hand: `clock.now += 5`."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    """A compact policy key for scenario tests."""
    return i.to_bytes(4, "big")


def always(_key: bytes) -> bool:
    """An `evictable` predicate that admits every block."""
    return True
