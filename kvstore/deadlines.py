"""`within(awaitable, timeout_s)`: `asyncio.wait_for` without Python 3.11's lost cancellation.

On 3.11, `asyncio.wait_for` returns the awaitable's result when the task awaiting it is
cancelled in the same loop turn as the awaitable completes: the cancellation is gone,
and a worker told to stop (a forwarder's, at a daemon's shutdown) goes on to wait for
its next job forever. `asyncio.timeout` keeps the cancellation but needs a task, and a
call the control lane starts by hand (`kvstore.server.control_lane`) runs its first step
outside one. `within` needs no task, and a cancellation of the task that awaits it
always comes out as `CancelledError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """`aw`'s result; past `timeout_s` (None: no limit) it is cancelled (a coroutine, or
    the future given) and `TimeoutError` raised."""
    loop = asyncio.get_running_loop()
    fut = asyncio.ensure_future(aw)
    if fut.done():
        return fut.result()
    task = asyncio.current_task()
    cancelling = task.cancelling() if task is not None else 0
    expired = False

    def expire() -> None:  # runs only while `fut` is bound: the timer is cancelled before the `del`s
        nonlocal expired
        if not fut.done():  # noqa: F821 (ruff reads the `del fut` below as an unbinding)
            expired = True
            fut.cancel()  # noqa: F821

    timer = loop.call_later(max(0.0, timeout_s), expire) if timeout_s is not None else None
    try:
        result = await fut
    except asyncio.CancelledError:
        timed_out = expired and (task is None or task.cancelling() == cancelling)
        # What the caller keeps of the exception (its frames) must not keep the task,
        # the awaitable or what they hold alive (views of tier memory, say).
        del task, fut, aw
        if timed_out:
            raise TimeoutError(f"no result within {timeout_s:g} s") from None
        raise
    finally:
        if timer is not None:
            timer.cancel()
    lost = task is not None and task.cancelling() > cancelling
    del task, fut, aw
    if lost:
        # Cancelled while `aw` finished anyway (it swallowed the cancellation it was
        # passed): the cancellation is this task's, not `aw`'s, to drop.
        raise asyncio.CancelledError()
    return result
