"""vLLM (CPU) with the kvstore connector, a model with several KV groups: a tiny Gemma-3
with three sliding-window layers (window 48 tokens) and one full-attention layer, run
with vLLM's hybrid KV cache manager. Engine A fills a fresh daemon; engine B, with an
empty local prefix cache, gets its prefill from the daemon (each group loaded through
its own block table, the sliding-window layers only inside the window) and produces
the tokens of a plain engine exactly. An engine whose model has another window never
hits A's blocks. The MLA model vLLM's CPU backend runs is refused (docs/engines.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, EngineRun, run_engine
from tinyhybrid import build_tiny_deepseek_v3, build_tiny_gemma3

from kvstore.client.admin import AdminClient

BLOCK = 32  # vLLM's CPU backend rounds the block size up to 32
WINDOW = 48
EVEN = 8 * BLOCK  # a prompt of whole blocks: a repeat of it asks for one block less


def loaded(output: dict[str, Any]) -> int:
    return output["kv_transfer_params"]["kvstore_loaded_tokens"]


def tokens(run: EngineRun, step: int) -> list[list[int]]:
    return [o["token_ids"] for o in run.outputs(step)]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines-groups")


@pytest.fixture(scope="module")
def reference(gemma3: Path, prompts: dict[str, list[int]], workdir: Path) -> dict[str, list[int]]:
    p = prompts
    run = run_engine(workdir, "reference", {"model": str(gemma3), "block_size": BLOCK, "target": None,
                                            "steps": [{"generate": [p["P1"], p["P2"], p["P1"] + p["S"],
                                                                    p["P3"][:EVEN]]}]})
    return dict(zip(["P1", "P2", "P1+S", "P3even"], tokens(run, 0), strict=True))


@pytest.fixture(scope="module")
def engine_a(gemma3: Path, prompts: dict[str, list[int]], daemon: DaemonProcess, workdir: Path) -> EngineRun:
    return run_engine(workdir, "A", {"model": str(gemma3), "block_size": BLOCK, "target": daemon.target,
                                     "steps": [{"generate": [prompts["P1"], prompts["P2"]]},
                                               {"generate": [prompts["P3"][:EVEN]]}]})


def test_engine_a_stores_each_group_under_its_hit_rule(engine_a, reference, daemon, prompts):
    p1, p2 = engine_a.outputs(0)
    assert [p1["token_ids"], p2["token_ids"]] == [reference["P1"], reference["P2"]]
    blocks = (len(prompts["P1"]) // BLOCK, len(prompts["P2"]) // BLOCK)
    assert (p1["kv_transfer_params"]["kvstore_stored_blocks"], p2["kv_transfer_params"]["kvstore_stored_blocks"]) \
        == blocks
    with AdminClient(daemon.target) as admin:
        (ns,) = [n for n in admin.list_namespaces() if n.groups]
        stats = admin.stats().counters
    kinds = sorted(g.kind for g in ns.groups)
    assert kinds == ["full", "sliding_window"]
    full, window = sorted(ns.groups, key=lambda g: g.kind)
    (even,) = engine_a.outputs(1)
    assert even["token_ids"] == reference["P3even"] and even["kv_transfer_params"]["kvstore_stored_blocks"] == 8
    # Every block of the full-attention layer; of the window layers, ceil((48 - 1) / 32) =
    # 2 blocks at the end of each put (one per prefill step of a prompt, and for the prompt
    # of whole blocks one more at the end a repeat of it asks for), and no others.
    assert full.blocks == sum(blocks) + 8 and 6 <= window.blocks < full.blocks
    assert stats.group_bytes_skipped == (full.blocks - window.blocks) * window.block_bytes


def test_engine_b_loads_every_group_and_matches_a(engine_a, reference, daemon, prompts, gemma3, workdir):
    before = daemon.stats().counters
    p1, p2, s = prompts["P1"], prompts["P2"], prompts["S"]
    run = run_engine(workdir, "B", {"model": str(gemma3), "block_size": BLOCK, "target": daemon.target, "steps": [
        {"generate": [p1, p2, prompts["P3"][:EVEN]]},
        {"reset_prefix_cache": True},
        {"generate": [p1 + s]},
    ]})
    after = daemon.stats().counters
    out_p1, out_p2, out_even = run.outputs(0)
    (out_p1s,) = run.outputs(2)
    assert out_p1["token_ids"] == reference["P1"]
    assert out_p2["token_ids"] == reference["P2"]
    assert out_p1s["token_ids"] == reference["P1+S"]
    assert loaded(out_p1) == (len(p1) - 1) // BLOCK * BLOCK > 0
    assert loaded(out_p2) == (len(p2) - 1) // BLOCK * BLOCK > 0
    assert out_even["token_ids"] == reference["P3even"] and loaded(out_even) == EVEN - BLOCK
    # P1 + S resumes at the end of A's put of P1, where the window's blocks were kept.
    assert loaded(out_p1s) == len(p1) // BLOCK * BLOCK
    assert not any(o["kv_transfer_params"]["kvstore_load_failed"] for o in (out_p1, out_p2, out_p1s))
    assert out_p1["num_cached_tokens"] >= loaded(out_p1)
    assert after.hit_blocks - before.hit_blocks == sum(map(loaded, (out_p1, out_p2, out_even, out_p1s))) // BLOCK


def test_a_model_with_another_window_never_hits(engine_a, daemon, prompts, workdir, tmp_path):
    other = build_tiny_gemma3(tmp_path / "gemma3-window-64", sliding_window=64)
    before = daemon.stats().counters
    run = run_engine(workdir, "C", {"model": str(other), "block_size": BLOCK, "target": daemon.target,
                                    "steps": [{"generate": [prompts["P1"]]}, {"generate": [prompts["P2"]]}]})
    after = daemon.stats()
    assert [loaded(o) for step in (0, 1) for o in run.outputs(step)] == [0, 0]
    # P1's put registered C's namespace, where P2's lookup then found none of A's blocks.
    assert after.counters.lookups > before.lookups and after.counters.hit_blocks == before.hit_blocks
    assert after.namespaces == 2


def test_an_mla_model_on_the_cpu_backend_is_refused_with_the_reason(daemon, prompts, workdir, tmp_path):
    model = build_tiny_deepseek_v3(tmp_path / "deepseek-v3")
    with pytest.raises(AssertionError, match="cannot prefill over a cached prefix"):
        # bfloat16: on a host with AMX the CPU backend takes MLA weights in 16 bits only.
        run_engine(workdir, "mla", {"model": str(model), "block_size": 16, "dtype": "bfloat16",
                                    "target": daemon.target, "steps": [{"generate": [prompts["P2"]]}]})
