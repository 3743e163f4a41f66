"""Per-request hints as the vLLM adapters read them: good values become store hints,
bad ones a message naming the parameter and no hints, other connectors' keys nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvstore.client._request_hints import NO_HINTS, parse_request_hints


def test_a_session_with_a_reuse_time_hints_lookups_and_puts():
    hints = parse_request_hints({"kvstore_session_id": "conv-7", "kvstore_expect_reuse_within_s": 12,
                                 "do_remote_prefill": False})
    assert hints.hint_args() == {"session_id": "conv-7", "expect_reuse_within_s": 12.0}
    assert not hints.end_session and not hints.error


def test_ending_a_session_needs_no_reuse_time():
    hints = parse_request_hints({"kvstore_session_id": "conv-7", "kvstore_end_session": True})
    assert hints.end_session and hints.session_id == "conv-7"
    assert hints.hint_args() == {}


def test_no_kvstore_keys_no_hints():
    assert parse_request_hints(None) is NO_HINTS
    assert parse_request_hints({"do_remote_decode": True}) is NO_HINTS
    assert parse_request_hints("not a dict") is NO_HINTS


@pytest.mark.parametrize("params, names", [
    ({"kvstore_session_id": "s", "kvstore_expect_reuse_within_s": "soon"}, "kvstore_expect_reuse_within_s"),
    ({"kvstore_session_id": "s", "kvstore_expect_reuse_within_s": -1}, "kvstore_expect_reuse_within_s"),
    ({"kvstore_session_id": "s", "kvstore_expect_reuse_within_s": float("inf")}, "kvstore_expect_reuse_within_s"),
    ({"kvstore_session_id": "s", "kvstore_expect_reuse_within_s": True}, "kvstore_expect_reuse_within_s"),
    ({"kvstore_session_id": "", "kvstore_expect_reuse_within_s": 5}, "kvstore_session_id"),
    ({"kvstore_session_id": 7, "kvstore_expect_reuse_within_s": 5}, "kvstore_session_id"),
    ({"kvstore_session_id": "x" * 129, "kvstore_expect_reuse_within_s": 5}, "kvstore_session_id"),
    ({"kvstore_expect_reuse_within_s": 5}, "kvstore_session_id"),
    ({"kvstore_session_id": "s"}, "kvstore_expect_reuse_within_s"),
    ({"kvstore_session_id": "s", "kvstore_end_session": "yes"}, "kvstore_end_session"),
    ({"kvstore_sesion_id": "s"}, "kvstore_sesion_id"),
])
def test_a_bad_value_is_refused_with_its_name_and_gives_no_hints(params, names):
    hints = parse_request_hints(params)
    assert names in hints.error and "goes on without kvstore hints" in hints.error
    assert hints.hint_args() == {} and not hints.end_session


@dataclass
class Action:
    action_type: str
    payload: Any
    action_id: str = "a"
    action_version: str = "1"


@dataclass
class Envelope:
    actions: list[Action] = field(default_factory=list)


def test_a_kv_hints_action_carries_the_same_keys():
    envelope = Envelope([Action("other", {}), Action("kvstore.reuse", {"kvstore_session_id": "agent-1",
                                                                       "kvstore_expect_reuse_within_s": 3.5})])
    assert parse_request_hints(None, envelope).hint_args() == {"session_id": "agent-1", "expect_reuse_within_s": 3.5}
    # kv_transfer_params win when both carry hints.
    both = parse_request_hints({"kvstore_session_id": "p", "kvstore_end_session": True}, envelope)
    assert both.session_id == "p"
    bad = parse_request_hints(None, Envelope([Action("kvstore.reuse", {"kvstore_session_id": "s"})]))
    assert "kv_hints action 'kvstore.reuse' payload.kvstore_session_id" in bad.error
