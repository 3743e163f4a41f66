"""The SDK's verbs, each described once and without I/O (the h11 / httpcore pattern):
`Client` and `AsyncClient` drive the same plans, one inline, one awaiting.

A plan is what a verb does, as data. Most verbs are one unary call: their plan is a
single `Unary` step, which a driver runs without a generator (the lookup path pays
for no more than that). A verb of several steps is a generator that yields steps,
receives each one's outcome, and returns the verb's result.

Steps:
- `Unary(name, request, timeout_s, answer)`: one unary KVStore call, over the control
  lane or gRPC; the plan receives `answer(response)` (the response itself by default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from kvstore.client._requests import block_keys, lookup_request, namespace_ref, prefetch_request, reuse_hint
from kvstore.client.results import (
    LookupResult,
    PinResult,
    PrefetchResult,
    lookup_result,
    pin_result,
    prefetch_result,
)
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2

T = TypeVar("T")


def _same(resp: Any) -> Any:
    return resp


class Unary(Generic[T]):
    """One unary KVStore call (over the lane, else gRPC); the plan gets `answer(response)`."""

    # A plain slotted class, not a frozen dataclass: one is made per lookup, and a
    # frozen dataclass's __init__ costs several times as much.
    __slots__ = ("name", "request", "timeout_s", "answer")

    def __init__(self, name: str, request: Any, timeout_s: float, answer: Callable[[Any], T] = _same) -> None:
        self.name = name
        self.request = request
        self.timeout_s = timeout_s
        self.answer = answer


# ------------------------------------------------------------------ one-call verbs


def lookup(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None, lease_ms: int,
           session_id: str | None, expect_reuse_within_s: float | None, timeout_s: float) -> Unary[LookupResult]:
    # The packed-hash request is built in C (`lookup_request`); the caller's own hash
    # objects come back in the result when the daemon leaves them out of its answer.
    req, mine = lookup_request(layout, token_ids, block_hashes, lease_ms, reuse_hint(session_id, expect_reuse_within_s))
    return Unary("Lookup", req, timeout_s, lambda resp: lookup_result(resp, mine))


def delete(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
           timeout_s: float) -> Unary[int]:
    req = kvstore_pb2.DeleteRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes))
    return Unary("Delete", req, timeout_s, lambda resp: resp.deleted)


def pin(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None, ttl_ms: int,
        timeout_s: float) -> Unary[PinResult]:
    req = kvstore_pb2.PinRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                 ttl_ms=ttl_ms)
    return Unary("Pin", req, timeout_s, pin_result)


def unpin(lease_id: str, timeout_s: float) -> Unary[bool]:
    return Unary("Unpin", kvstore_pb2.UnpinRequest(lease_id=lease_id), timeout_s, lambda resp: resp.released)


def hint(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
         session_id: str, expect_reuse_within_s: float, timeout_s: float) -> Unary[int]:
    req = kvstore_pb2.HintRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                  hint=reuse_hint(session_id, expect_reuse_within_s))
    return Unary("Hint", req, timeout_s, lambda resp: resp.hinted)


def end_session(session_id: str, timeout_s: float) -> Unary[None]:
    return Unary("EndSession", kvstore_pb2.EndSessionRequest(session_id=session_id), timeout_s, lambda resp: None)


def prefetch(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None, tier: str,
             timeout_s: float) -> Unary[PrefetchResult]:
    return Unary("Prefetch", prefetch_request(layout, token_ids, block_hashes, tier), timeout_s, prefetch_result)


def verify(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
           timeout_s: float) -> Unary[int]:
    req = kvstore_pb2.VerifyRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes))
    return Unary("Verify", req, timeout_s, lambda resp: resp.dropped)
