"""Per-request reuse hints that engines pass through to the store.

An agent framework knows when a session comes back (a tool call that returns in
seconds) and says so per request; the vLLM adapters (`kvstore.client.vllm`,
`kvstore.client.vllm_tier`) read it from the request's `kv_transfer_params`, or from a
vLLM `kv_hints` action of type `kvstore.reuse` with the same keys in its payload:

    kvstore_session_id            str, 1 to 128 characters: the conversation or agent
    kvstore_expect_reuse_within_s number > 0: seconds until the session's next request
    kvstore_end_session           bool: the session will not come back; after this
                                  request its blocks lose their protection

and turn them into the store's own hints (`Client.lookup/put(session_id=...,
expect_reuse_within_s=...)`, `Client.end_session`). Parsing never raises: a bad value
gives `RequestHints.error`, a message that names the parameter, and no hints, so the
request goes on as if it had sent none. Keys outside the `kvstore_` prefix belong to
other connectors and are ignored; an unknown `kvstore_` key is refused (a typo would
otherwise silently protect nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SESSION_ID = "kvstore_session_id"
EXPECT_REUSE_WITHIN_S = "kvstore_expect_reuse_within_s"
END_SESSION = "kvstore_end_session"
HINT_KEYS = (SESSION_ID, EXPECT_REUSE_WITHIN_S, END_SESSION)
# Keys the adapters write into a finished request's kv_transfer_params: not hints.
RESULT_KEYS = ("kvstore_loaded_tokens", "kvstore_load_failed", "kvstore_stored_blocks", "kvstore_skipped_tokens",
               "kvstore_hints_error")
# The vLLM kv_hints action that carries the same keys in its payload.
KV_HINTS_ACTION = "kvstore.reuse"
MAX_SESSION_ID_CHARS = 128  # the store's limit (kvstore.core.namespaces.check_hint)


@dataclass(frozen=True, slots=True)
class RequestHints:
    """What one request asked of the store. `session_id` is "" without a session;
    `expect_reuse_within_s` is 0 when the request's blocks are not to be protected."""

    session_id: str = ""
    expect_reuse_within_s: float = 0.0
    end_session: bool = False
    error: str = ""

    @property
    def protects(self) -> bool:
        """Whether lookups and puts carry the hint."""
        return bool(self.session_id) and self.expect_reuse_within_s > 0

    def hint_args(self) -> dict[str, Any]:
        """Keyword arguments of `Client.lookup` / `Client.put`: empty without a hint."""
        if not self.protects:
            return {}
        return {"session_id": self.session_id, "expect_reuse_within_s": self.expect_reuse_within_s}


NO_HINTS = RequestHints()


def _refused(message: str) -> RequestHints:
    return RequestHints(error=f"{message}; the request goes on without kvstore hints")


def _from_mapping(params: Mapping[str, Any], where: str) -> RequestHints:
    unknown = sorted(k for k in params if isinstance(k, str) and k.startswith("kvstore_")
                     and k not in HINT_KEYS and k not in RESULT_KEYS)
    if unknown:
        return _refused(f"{where} has unknown kvstore keys {unknown}; the hint keys are {list(HINT_KEYS)}")
    if not any(k in params for k in HINT_KEYS):
        return NO_HINTS
    session = params.get(SESSION_ID)
    if not isinstance(session, str) or not 1 <= len(session) <= MAX_SESSION_ID_CHARS:
        return _refused(f"{where}.{SESSION_ID} must be a string of 1 to {MAX_SESSION_ID_CHARS} characters "
                        f"naming the session, got {session!r}")
    within = params.get(EXPECT_REUSE_WITHIN_S)
    seconds = 0.0
    if within is not None:
        if isinstance(within, bool) or not isinstance(within, (int, float)) or not math.isfinite(within) \
                or within <= 0:
            return _refused(f"{where}.{EXPECT_REUSE_WITHIN_S} must be a number of seconds > 0, got {within!r}")
        seconds = float(within)
    end = params.get(END_SESSION, False)
    if not isinstance(end, bool):
        return _refused(f"{where}.{END_SESSION} must be true or false, got {end!r}")
    if seconds == 0 and not end:
        return _refused(f"{where}.{SESSION_ID} needs {EXPECT_REUSE_WITHIN_S} (seconds until the session's next "
                        f"request) or {END_SESSION}")
    return RequestHints(session_id=session, expect_reuse_within_s=seconds, end_session=end)


def parse_request_hints(kv_transfer_params: Any, kv_hints: Any = None) -> RequestHints:
    """The hints of one request, from its `kv_transfer_params` (a dict or None) and its
    vLLM `kv_hints` envelope (or None); `kv_transfer_params` wins when both carry some."""
    if kv_transfer_params is not None and not isinstance(kv_transfer_params, Mapping):
        return NO_HINTS  # another connector's business; nothing of ours can be in it
    if kv_transfer_params:
        hints = _from_mapping(kv_transfer_params, "kv_transfer_params")
        if hints is not NO_HINTS:
            return hints
    for action in getattr(kv_hints, "actions", None) or ():
        if getattr(action, "action_type", None) == KV_HINTS_ACTION:
            payload = getattr(action, "payload", None)
            if not isinstance(payload, Mapping):
                return _refused(f"the kv_hints action {KV_HINTS_ACTION!r} needs a payload object")
            return _from_mapping(payload, f"kv_hints action {KV_HINTS_ACTION!r} payload")
    return NO_HINTS
