"""`kvstore.deadlines.within`: a deadline on an awaitable that never loses the awaiting
task's cancellation (asyncio.wait_for on Python 3.11 can, when the awaitable completes
in the same loop turn as the cancellation)."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.deadlines import within


async def test_the_result_comes_back_before_the_deadline() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 7

    assert await within(answer(), 5.0) == 7
    assert await within(asyncio.sleep(0, "now"), None) == "now"


async def test_past_the_deadline_it_raises_and_cancels_what_it_waited_for() -> None:
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await within(fut, 0.01)
    assert fut.cancelled()
    ended = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    with pytest.raises(TimeoutError):
        await within(slow(), 0.01)
    assert ended.is_set()


async def test_a_cancellation_as_the_awaitable_completes_is_kept() -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    waiter = loop.create_task(within(fut, 5.0))
    await asyncio.sleep(0)  # the waiter waits on fut now
    fut.set_result(1)  # completes ...
    waiter.cancel()  # ... in the same loop turn as the cancellation
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_a_cancellation_the_awaitable_swallows_is_kept() -> None:
    async def stubborn() -> int:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return 3  # a library below that drops the cancellation
        return 0

    waiter = asyncio.get_running_loop().create_task(within(stubborn(), 5.0))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
