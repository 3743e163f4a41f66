"""Trace replay through the store: hand-worked traces, OPT, hints, real trace (the CLI: tests/cli/test_replay_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.core.replay import (
    Hint,
    HintSpec,
    capacity_from_fraction,
    derive_hints,
    load_trace,
    replay,
    replay_opt,
)
from kvstore.errors import ConfigError, InvalidArgument
from tests.traces import write_trace

REAL_TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "conversation_trace.jsonl"


@pytest.fixture
def single_blocks(tmp_path: Path) -> Path:
    # [1] [2] [1] [3] [2] [1], one block each
    return write_trace(tmp_path / "t.jsonl", [(i * 1000, [b]) for i, b in enumerate([1, 2, 1, 3, 2, 1])])


def test_lru_on_single_blocks(single_blocks: Path) -> None:
    # capacity 2: [1] miss, [2] miss, [1] hit, [3] evicts 2, [2] evicts 1, [1] evicts 3 -> 1 hit of 6
    r = replay(load_trace(single_blocks), "lru", 2)
    assert (r.hits, r.lookups, r.requests) == (1, 6, 6)
    assert r.hit_ratio == pytest.approx(1 / 6)


def test_opt_on_single_blocks(single_blocks: Path) -> None:
    # capacity 2, Bélády: at [3] the resident blocks are 1 (next at 5) and 2 (next at 4):
    # evict 1; then [2] hits and [1] misses -> 2 hits of 6. Every block is admitted.
    r = replay_opt(load_trace(single_blocks), 2)
    assert r.hits == 2
    assert r.policy == "opt"


def test_hit_is_the_longest_cached_prefix(tmp_path: Path) -> None:
    # capacity 3: [1,2,3] then [4] evicts 3 (the chain's tail) -> [1,2,3] hits 1 and 2 only
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, [1, 2, 3]), (1000, [4]), (2000, [1, 2, 3])]))
    r = replay(trace, "lru", 3)
    assert (r.hits, r.lookups) == (2, 7)


def test_shared_prefix_hits_and_token_ratio(tmp_path: Path) -> None:
    # [1,2,3] then [1,2,4] with room for all -> 2 hits; 2 blocks of 512 tokens saved of 2*1200
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, [1, 2, 3]), (1000, [1, 2, 4])], input_length=1200))
    r = replay(trace, "arc", 100)
    assert r.hits == 2 and r.hit_ratio == pytest.approx(2 / 6)
    assert r.tokens_saved == 1024 and r.token_hit_ratio == pytest.approx(1024 / 2400)


def test_a_request_longer_than_the_tier_keeps_its_head(tmp_path: Path) -> None:
    # capacity 2, [1,2,3] twice -> the head [1,2] is kept and hit
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, [1, 2, 3]), (1000, [1, 2, 3])]))
    assert replay(trace, "lru", 2).hits == 2


@pytest.fixture
def returning_session(tmp_path: Path) -> Path:
    # [1,2] at 0 s; six one-off blocks at 1 s; [15,16] at 1 s; [1,2] again at 2 s
    reqs = [(0, [1, 2])] + [(1000, [b]) for b in range(10, 15)] + [(1000, [15, 16]), (2000, [1, 2])]
    return write_trace(tmp_path / "t.jsonl", reqs)


def test_trace_hints_protect_the_returning_session(returning_session: Path) -> None:
    # capacity 7: LRU evicts 1 and 2 to make room for [15,16] -> 0 hits; with the hint on
    # [1,2] (whole budget) the one-off blocks 10 and 11 go instead -> 2 hits
    trace = load_trace(returning_session)
    assert replay(trace, "hint-lru", 7).hits == 0
    hinted = replay(trace, "hint-lru", 7, HintSpec.parse("trace"), hint_budget_fraction=1.0)
    assert hinted.hits == 2 and hinted.hints == "trace"
    # every claim flipped: the session is not hinted, the one-off requests are
    wrong = replay(trace, "hint-lru", 7, HintSpec.parse("noisy:1"), hint_budget_fraction=1.0)
    assert wrong.hits == 0


def test_derive_hints_from_the_trace(tmp_path: Path) -> None:
    # [1,2,3] at 0 s returns as [1,2,3] at 3 s; [1,2,4] at 1 s shares [1,2] with it;
    # [5,6] never returns.
    trace = load_trace(
        write_trace(tmp_path / "t.jsonl", [(0, [1, 2, 3]), (1000, [1, 2, 4]), (2000, [5, 6]), (3000, [1, 2, 3])])
    )
    hints = derive_hints(trace, HintSpec.parse("trace"))
    assert hints[0] == Hint("chain-0", 3 * 1.25 + 1.0, 3)
    assert hints[1] == Hint("chain-1", 2 * 1.25 + 1.0, 2)
    assert hints[2] == Hint("chain-2", None, 2)
    # request 3 continues request 0's session, and ends it
    assert hints[3] == Hint("chain-0", None, 3)
    assert derive_hints(trace, HintSpec.parse("none")) == [None] * 4
    assert derive_hints(trace, HintSpec.parse("noisy:0")) == hints
    flipped = derive_hints(trace, HintSpec.parse("noisy:1"))
    assert [h.expect_reuse_within_s is None for h in flipped if h] == [True, True, False, False]
    # fixed time to live instead of the oracle gap
    assert derive_hints(trace, HintSpec.parse("trace"), ttl_s=60.0)[0] == Hint("chain-0", 60.0, 3)


def test_noisy_hints_are_seeded(tmp_path: Path) -> None:
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(i * 1000, [0, i]) for i in range(1, 40)]))
    a = derive_hints(trace, HintSpec.parse("noisy:0.5", seed=7))
    assert a == derive_hints(trace, HintSpec.parse("noisy:0.5", seed=7))


@pytest.mark.parametrize("text", ["some", "noisy:", "noisy:1.5", "noisy:x"])
def test_bad_hint_mode_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="hints"):
        HintSpec.parse(text)


def test_bad_trace_lines_are_reported_with_their_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1, "hash_ids": [1]}\nnot json\n')
    with pytest.raises(InvalidArgument, match=":2: not JSON"):
        load_trace(bad)
    bad.write_text('{"timestamp": 0, "hash_ids": [1]}\n')
    with pytest.raises(InvalidArgument, match="input_length"):
        load_trace(bad)
    bad.write_text("")
    with pytest.raises(InvalidArgument, match="no requests"):
        load_trace(bad)


def test_optional_fields_are_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"timestamp": 1500, "input_length": 40, "output_length": 2, "hash_ids": [7],
                    "session_id": "abc", "turn": 2, "type": "chat", "block_size": 16}) + "\n"
    )
    req = load_trace(path).requests[0]
    assert (req.timestamp_s, req.session_id, req.block_size_tokens) == (1.5, "abc", 16)


def test_capacity_from_fraction(single_blocks: Path) -> None:
    trace = load_trace(single_blocks)  # 3 distinct blocks
    assert capacity_from_fraction(trace, 1.0) == 3
    assert capacity_from_fraction(trace, 0.01) == 1
    with pytest.raises(ConfigError):
        capacity_from_fraction(trace, 0.0)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="the shared conversation trace is not present")
def test_real_trace_prefix_lru_is_bounded_by_opt() -> None:
    trace = load_trace(REAL_TRACE, limit=2000)
    capacity = capacity_from_fraction(trace, 0.05)
    lru = replay(trace, "lru", capacity)
    opt = replay_opt(trace, capacity)
    for r in (lru, opt):
        assert 0.0 <= r.hit_ratio <= 1.0 and 0.0 <= r.token_hit_ratio <= 1.0
        assert r.requests == 2000 and r.lookups == trace.lookups
    assert lru.hits <= opt.hits
