"""The per-call pipeline: the steps every call goes through, whatever carries it.

Primitives: `Pipeline(gate, auth, metrics)`, `Pipeline.bind(path) -> CallSteps`, and on
`CallSteps`: `enter(token, on_unix_socket, rid) -> Identity | None`, `failed(exc) ->
(code, message)`, `leave(identity, code, start)`. The transports are
`kvstore.server.interceptors` (gRPC: one server interceptor) and `kvstore.server.control_lane`
(the control lane); both run these steps, in this order:

1. metrics: the call counts in `kvstore_rpcs_in_flight` and is timed, from before the
   gate to its end, into `kvstore_rpc_duration_seconds` (method, status code);
2. the drain gate (`kvstore.server.lifecycle`): while shutting down a new call is
   refused with UNAVAILABLE (LocalCommit excepted); an admitted call is waited for;
3. the request id, set in the logs' contextvar (the transport chooses it: a gRPC
   call's `x-request-id` metadata, or a fresh one);
4. auth admission (`kvstore.server.auth`): token -> tenant, the role and `local_plane`
   checks, the tenant's cap on calls in flight; the identity becomes current;
5. the handler (the servicer's method);
6. error mapping: a `KVStoreError` becomes its status code and message; anything else
   is a bug, logged with its traceback and answered INTERNAL without internals.

Health checks (`OPEN_SERVICES`) take steps 1, 3 and 6 only: probes carry no token, and
must read NOT_SERVING during a drain, and a health Watch lives as long as its client, so
the drain must not wait for it.

Everything a call needs per method (names, the in-flight count, the histogram's
children by status code) is bound once by `bind`; a call then costs two method calls and
no allocation beyond the transport's own (no await: every step is synchronous).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc

from kvstore.errors import KVStoreError, Unavailable
from kvstore.logs import request_id
from kvstore.server.auth import Authenticator, Identity
from kvstore.server.lifecycle import REFUSAL, DrainGate
from kvstore.server.metrics import Metrics

logger = logging.getLogger(__name__)

# Calls that skip the drain gate and auth (see the module docstring).
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


class CallSteps:
    """The pipeline bound to one method. Every `enter`, whether it returned or raised, is
    followed by exactly one `leave`."""

    __slots__ = ("name", "path", "open", "in_flight", "_observed", "_histogram", "_gate", "_auth")

    def __init__(self, path: str, gate: DrainGate, auth: Authenticator, metrics: Metrics) -> None:
        self.path = path
        self.name = path.rsplit("/", 1)[-1]  # the metrics' method label
        self.open = path.startswith(OPEN_SERVICES)
        self.in_flight = metrics.in_flight(self.name)
        self._histogram = metrics.rpc_seconds
        self._observed: dict[grpc.StatusCode, Any] = {}  # histogram children by status
        self._gate = gate
        self._auth = auth

    def enter(self, token: str | None, on_unix_socket: bool, rid: str,
              peer: tuple[str, str] | None = None) -> Identity | None:
        """Steps 1 to 4: the caller's identity (None for an open method). Raises the
        refusal (`KVStoreError`) when the gate or auth refuses; nothing is held then
        but the in-flight count, which `leave` ends. `peer`: a node-to-node call's
        (node id, tenant), from `kvstore.server.auth.peer_call`."""
        self.in_flight.n += 1
        if self.open:
            request_id.set(rid)
            return None
        gate = self._gate
        if gate.refuses(self.path):
            raise Unavailable(REFUSAL)
        gate.enter()
        try:
            request_id.set(rid)
            return self._auth.admit(self.path, token, on_unix_socket, peer)
        except BaseException:
            gate.leave()
            raise

    def failed(self, exc: Exception) -> tuple[grpc.StatusCode, str]:
        """Step 6: the status and message a call that raised `exc` answers. Call it from
        the `except` clause (an unexpected error is logged with its traceback)."""
        if isinstance(exc, KVStoreError):
            logger.debug("%s failed: %s: %s", self.path, exc.code.name, exc)
            return exc.code, str(exc)
        logger.exception("%s failed unexpectedly", self.path)
        return grpc.StatusCode.INTERNAL, f"internal error in {self.path}; see the daemon's log"

    def leave(self, identity: Identity | None, code: grpc.StatusCode, start: float) -> None:
        """The call ended with `code`; `identity` is what `enter` returned (None if it
        raised); `start` the `time.perf_counter()` taken before `enter`."""
        self.release(identity)
        self.record(code, start, time.perf_counter())

    def release(self, identity: Identity | None) -> None:
        """`leave`'s first half: the call no longer counts against its tenant's cap nor
        holds off a drain."""
        if identity is not None:
            self._auth.leave(identity)
            self._gate.leave()

    def record(self, code: grpc.StatusCode, start: float, end: float) -> None:
        """`leave`'s second half, which may follow the answer out: the call leaves the
        in-flight gauge, and its duration from `start` to `end` is observed."""
        self.in_flight.n -= 1
        child = self._observed.get(code)
        if child is None:
            child = self._observed[code] = self._histogram.labels(self.name, code.name)
        child.observe(end - start)


class Pipeline:
    """The daemon's one pipeline; `bind` hands out each method's steps, made once and
    shared by every transport."""

    def __init__(self, gate: DrainGate, auth: Authenticator, metrics: Metrics) -> None:
        self.gate = gate
        self.auth = auth
        self.metrics = metrics
        self._bound: dict[str, CallSteps] = {}

    def bind(self, path: str) -> CallSteps:
        """The steps of method `path` (a gRPC method path, `/package.Service/Method`)."""
        steps = self._bound.get(path)
        if steps is None:
            steps = self._bound[path] = CallSteps(path, self.gate, self.auth, self.metrics)
        return steps
