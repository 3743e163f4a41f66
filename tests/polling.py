"""Waiting for a state a daemon reaches on its own: poll what it exposes until a condition
holds, or fail naming what never happened once a generous deadline has passed.

A fixed sleep followed by an assertion is a guess about how fast the daemon is: on a
loaded machine it may not be there yet (a failure that says nothing), on an idle one
the sleep is time lost. The deadline here only bounds how long a broken daemon is
waited for; a working one passes as soon as it gets there.

Polling proves that something happened, never that something did not: to check an
absence, wait for the positive event that says the daemon is past the point where it
would have happened, then assert the absence once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

DEADLINE_S = 30.0
INTERVAL_S = 0.02


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    """Return once `check()` is true; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(INTERVAL_S)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = DEADLINE_S) -> None:
    """`wait_until` for a check that is a coroutine (a call to the daemon under test)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(INTERVAL_S)
