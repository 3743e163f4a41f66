"""A forwarder's close ends its workers even when a call below them dropped the
cancellation (they would otherwise wait for their next job forever, and the daemon's
stop with them)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvstore.cluster.breaker import Breakers
from kvstore.cluster.forward import Forwarder, ForwardJob
from kvstore.cluster.transport import PeerCall
from kvstore.v1 import kvstore_pb2


async def test_close_ends_a_worker_whose_cancellation_was_lost() -> None:
    sending = asyncio.Event()
    forwarder = Forwarder(None, None, Breakers(1.0), queue_blocks=10, timeout_s=1.0, workers=1)  # type: ignore[arg-type]

    async def send_losing_the_cancellation(job: ForwardJob) -> int:
        sending.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return 0  # what asyncio.wait_for on 3.11 does when the answer comes in the same turn
        return 1

    forwarder._send = send_losing_the_cancellation  # type: ignore[method-assign]
    forwarder.start()
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    job = ForwardJob("n1", b"\0" * 16, PeerCall.of("t", kvstore_pb2.Layout()), [b"\1" * 16], None, 0, done)
    assert forwarder.submit(job)
    await asyncio.wait_for(sending.wait(), 5)
    closing = asyncio.get_running_loop().create_task(forwarder.aclose())
    await asyncio.wait({closing}, timeout=10)  # (a bound on a hang, not a timing)
    assert closing.done() and closing.exception() is None, "the close still waits for its worker"
    assert done.result() == 0
