"""Coroutines run up to their first suspension at once, outside a task: `start`, `resume`.

A task's first step runs on a later turn of the event loop. A call whose request is
written in its first step (a peer lane call on a pooled connection: kvstore.cluster.peer_lane)
can be started by hand instead: its request leaves now, and the caller does its own work
while the answer travels, then awaits the rest (kvstore.cluster.remote_lookup, the lookup round).
The control lane starts every call this way (kvstore.server.control_lane), and answers a call
that never suspends with no task at all.

A coroutine started by hand speaks to the event loop as a task's step would: what it
yields is a future it waits for (with asyncio's `_asyncio_future_blocking` marker set)
or None for a bare yield. `resume` is that part of `asyncio.Task.__step`, written out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


async def resume(coro: Coroutine[Any, Any, T], yielded: Any) -> T:
    """Run on `coro`, which suspended on `yielded` (a future, or None for a bare yield)
    in a step run by hand, to its result. A cancellation of the task that awaits this
    is passed into `coro`."""
    while True:
        thrown: BaseException | None = None
        try:
            if yielded is None:
                await asyncio.sleep(0)
            else:
                # As a task's step does with a future its coroutine yields: mark it taken
                # (else awaiting it again reads as a bare yield), then wait for it here.
                yielded._asyncio_future_blocking = False
                await yielded
        except asyncio.CancelledError as exc:
            if yielded is None or not yielded.done():
                thrown = exc  # this task was cancelled: pass it in
        except BaseException:  # the coroutine reads the future's error itself
            pass
        try:
            yielded = coro.send(None) if thrown is None else coro.throw(thrown)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


class Started(Generic[T]):
    """A coroutine whose first step has run (`start`): await it, once, for its result or
    its exception. One never awaited must be `close`d."""

    __slots__ = ("_coro", "_yielded", "_result", "_error", "_done")

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self._coro: Coroutine[Any, Any, T] | None = coro
        self._yielded: Any = None
        self._result: T | None = None
        self._error: BaseException | None = None
        self._done = False
        try:
            self._yielded = coro.send(None)
        except StopIteration as stop:
            self._result, self._done, self._coro = stop.value, True, None
        except BaseException as exc:  # handed to whoever awaits it
            self._error, self._done, self._coro = exc, True, None

    @property
    def done(self) -> bool:
        """Whether it completed in its first step (its result is there to take)."""
        return self._done

    def __await__(self) -> Generator[Any, None, T]:
        if self._done:
            error, self._error = self._error, None
            if error is not None:
                raise error
            return self._result  # type: ignore[return-value]
        coro, self._coro = self._coro, None
        if coro is None:
            raise RuntimeError("a started coroutine is awaited once")
        return (yield from resume(coro, self._yielded).__await__())

    def close(self) -> None:
        """Stop it where it is suspended (its `finally` blocks run), if not awaited."""
        coro, self._coro = self._coro, None
        if coro is not None:
            coro.close()
        self._error = None


def start(coro: Coroutine[Any, Any, T]) -> Started[T]:
    """Run `coro` now up to its first suspension (its request sent, say); await what this
    returns for the rest."""
    return Started(coro)
