"""kvstore.eager: a coroutine's first step run by hand, the rest awaited later."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.deadlines import within
from kvstore.eager import start


async def _waiting(answer: asyncio.Future[None], ended: list[str]) -> None:
    """A call waiting for its answer that says when its cleanup ran."""
    try:
        await answer
    finally:
        ended.append("cleaned up")


async def test_a_call_that_never_suspends_is_done_at_once() -> None:
    async def answer() -> int:
        return 7

    started = start(answer())
    assert started.done
    assert await started == 7


async def test_an_error_in_the_first_step_comes_out_of_the_await() -> None:
    async def refused() -> int:
        raise LookupError("no such peer")

    started = start(refused())
    assert started.done
    with pytest.raises(LookupError, match="no such peer"):
        await started


async def test_the_first_step_runs_now_and_the_rest_when_awaited() -> None:
    loop = asyncio.get_running_loop()
    sent: list[str] = []
    answer = loop.create_future()

    async def call() -> str:
        sent.append("request")  # what a peer call writes in its first step
        return f"answer to {await answer}"

    started = start(call())
    assert sent == ["request"] and not started.done  # sent before anything was awaited
    loop.call_soon(answer.set_result, "lookup")
    assert await started == "answer to lookup"
    with pytest.raises(RuntimeError, match="awaited once"):
        await started


async def test_started_in_a_callback_and_awaited_in_a_task() -> None:
    loop = asyncio.get_running_loop()
    answer = loop.create_future()
    box: list[object] = []

    async def call() -> int:
        return int(await within(answer, 5.0)) + 1

    loop.call_soon(lambda: box.append(start(call())))  # outside any task
    await asyncio.sleep(0)
    answer.set_result(41)
    assert await asyncio.ensure_future(box[0]) == 42  # type: ignore[arg-type]


async def test_a_deadline_in_the_started_call_still_expires() -> None:
    never = asyncio.get_running_loop().create_future()
    started = start(within(never, 0.01))
    with pytest.raises(TimeoutError):
        await started
    assert never.cancelled()


async def test_cancelling_the_awaiting_task_cancels_the_started_call() -> None:
    answer = asyncio.get_running_loop().create_future()
    ended: list[str] = []

    async def waiter() -> None:
        await start(_waiting(answer, ended))

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["cleaned up"] and answer.cancelled()


async def test_a_started_call_never_awaited_is_closed() -> None:
    answer = asyncio.get_running_loop().create_future()
    ended: list[str] = []
    started = start(_waiting(answer, ended))
    started.close()
    assert ended == ["cleaned up"]
    started.close()  # again: nothing left to close
