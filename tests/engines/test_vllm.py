"""vLLM (CPU) with the kvstore connector, end to end: real engines, a real daemon process.

Engine A fills a fresh daemon; engine B, a new `LLM` with an empty local prefix cache,
must get its prefill back from the daemon and produce A's tokens exactly. A reference
engine without any connector gives the tokens every run must match.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, EngineRun, run_engine, start_daemon

BLOCK = 32


def loaded(output: dict[str, Any]) -> int:
    return output["kv_transfer_params"]["kvstore_loaded_tokens"]


def tokens(run: EngineRun, step: int) -> list[list[int]]:
    return [o["token_ids"] for o in run.outputs(step)]


def held_tokens(prompt: list[int]) -> int:
    """What the connector may load: full blocks, leaving the last prompt token to compute."""
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def reference_run(tiny_model: Path, prompts: dict[str, list[int]], workdir: Path) -> EngineRun:
    """A plain engine, no connector, over every prompt the tests use."""
    p = prompts
    return run_engine(workdir, "reference", {"model": str(tiny_model), "target": None, "steps": [
        {"generate": [p["P1"], p["P2"], p["P1"] + p["S"], p["P3"], p["P2"] + p["S"]]}]})


@pytest.fixture(scope="module")
def reference(reference_run: EngineRun) -> dict[str, list[int]]:
    """Greedy tokens of the plain engine, by prompt name."""
    return dict(zip(["P1", "P2", "P1+S", "P3", "P2+S"], tokens(reference_run, 0), strict=True))


@pytest.fixture(scope="module")
def engine_a(tiny_model: Path, prompts: dict[str, list[int]], daemon: DaemonProcess, workdir: Path) -> EngineRun:
    return run_engine(workdir, "A", {"model": str(tiny_model), "target": daemon.target,
                                     "steps": [{"generate": [prompts["P1"], prompts["P2"]]}]})


def test_engine_a_on_a_fresh_daemon_stores_its_prompt_blocks(engine_a, reference, daemon, prompts):
    p1, p2 = engine_a.outputs(0)
    assert [p1["token_ids"], p2["token_ids"]] == [reference["P1"], reference["P2"]]
    assert (loaded(p1), loaded(p2)) == (0, 0)
    stored = (len(prompts["P1"]) // BLOCK, len(prompts["P2"]) // BLOCK)
    assert (p1["kv_transfer_params"]["kvstore_stored_blocks"], p2["kv_transfer_params"]["kvstore_stored_blocks"]) \
        == stored
    counters = daemon.stats().counters
    assert counters.blocks_stored == sum(stored)
    assert counters.hit_blocks == 0


def test_engine_b_gets_its_prefill_from_the_daemon_and_matches_a(engine_a, reference, daemon, prompts, tiny_model,
                                                                 workdir):
    before = daemon.stats().counters
    p1, p2, s = prompts["P1"], prompts["P2"], prompts["S"]
    run = run_engine(workdir, "B", {"model": str(tiny_model), "target": daemon.target, "steps": [
        # A salted request's KV must not be shared through kvstore: neither loaded nor stored.
        {"generate": [p1, p2, {"prompt_token_ids": p2, "cache_salt": "tenant-b"}]},
        # P1 + S must come from the daemon, not from the P1 blocks B itself just computed.
        {"reset_prefix_cache": True},
        {"generate": [p1 + s]},
    ]})
    after = daemon.stats().counters
    out_p1, out_p2, out_salted = run.outputs(0)
    (out_p1s,) = run.outputs(2)

    assert out_p1["token_ids"] == tokens(engine_a, 0)[0] == reference["P1"]
    assert out_p2["token_ids"] == tokens(engine_a, 0)[1] == reference["P2"]
    assert out_p1s["token_ids"] == reference["P1+S"]
    assert out_salted["token_ids"] == reference["P2"]
    assert out_salted["kv_transfer_params"]["kvstore_loaded_tokens"] == 0
    assert out_salted["kv_transfer_params"]["kvstore_stored_blocks"] == 0

    # B's connector loaded every full block A stored (the suffix's blocks were never stored).
    assert loaded(out_p1) == held_tokens(p1) > 0
    assert loaded(out_p2) == held_tokens(p2) > 0
    assert loaded(out_p1s) == len(p1) // BLOCK * BLOCK > 0
    assert not any(o["kv_transfer_params"]["kvstore_load_failed"] for o in (out_p1, out_p2, out_p1s))
    # ...and vLLM counted those tokens as cached rather than computed.
    assert out_p1["num_cached_tokens"] >= loaded(out_p1)

    loaded_blocks = (loaded(out_p1) + loaded(out_p2) + loaded(out_p1s)) // BLOCK
    assert after.hit_blocks - before.hit_blocks == loaded_blocks
    assert after.blocks_fetched - before.blocks_fetched == loaded_blocks
    # The suffix's one new full block was stored for the next engine.
    assert out_p1s["kv_transfer_params"]["kvstore_stored_blocks"] == (len(p1) + len(s)) // BLOCK - len(p1) // BLOCK


def test_a_differently_configured_engine_gets_no_hits(engine_a, reference, daemon, prompts, tiny_model, workdir):
    before = daemon.stats()
    run = run_engine(workdir, "C", {"model": str(tiny_model), "target": daemon.target, "block_size": 64,
                                    "steps": [{"generate": [prompts["P1"], prompts["P2"]]}]})
    after = daemon.stats()
    assert [loaded(o) for o in run.outputs(0)] == [0, 0]
    assert after.counters.lookups > before.counters.lookups  # it did ask...
    assert after.counters.hit_blocks == before.counters.hit_blocks  # ...and its namespace holds nothing of A's
    # The block size changes the paging, not the arithmetic: same tokens, computed afresh.
    assert tokens(run, 0) == [reference["P1"], reference["P2"]]
    assert after.namespaces == before.namespaces + 1


def test_hits_survive_a_daemon_restart_on_the_ssd_tier(tiny_model, prompts, reference, workdir, tmp_path):
    """Engine A stores into a daemon with an SSD tier; the daemon restarts (its memory
    tiers come back empty); engine B still gets its prefill, now from the SSD."""
    home = tmp_path / "ssd-daemon"
    ssd_args = ("--ssd-path", str(home / "ssd"), "--ssd-capacity", "64MiB", "--ssd-region-size", "4MiB")
    p1, p2 = prompts["P1"], prompts["P2"]
    first = start_daemon(home, *ssd_args)
    try:
        run_engine(workdir, "A-ssd", {"model": str(tiny_model), "target": first.target,
                                      "steps": [{"generate": [p1, p2]}]})
    finally:
        first.stop()  # SIGTERM: a graceful stop flushes pending SSD writes
    second = start_daemon(home, *ssd_args)
    try:
        assert second.stats().counters.blocks_stored == 0  # a new process: nothing put into it
        run = run_engine(workdir, "B-ssd", {"model": str(tiny_model), "target": second.target,
                                            "steps": [{"generate": [p1, p2]}]})
        stats = second.stats()
    finally:
        second.stop()
    out_p1, out_p2 = run.outputs(0)
    assert [out_p1["token_ids"], out_p2["token_ids"]] == [reference["P1"], reference["P2"]]
    assert (loaded(out_p1), loaded(out_p2)) == (held_tokens(p1), held_tokens(p2))
    ssd = next(t for t in stats.tiers if t.name == "ssd")
    assert ssd.present and ssd.hits == (held_tokens(p1) + held_tokens(p2)) // BLOCK


def corrupt_payloads(ssd_dir: Path) -> int:
    """Flip bytes in the middle of every 4 KiB page of the SSD tier's region files, as a
    failing disk would: record headers sit at page starts and stay intact, so the daemon
    still lists the blocks, and only reading them reveals the damage."""
    damaged = 0
    for region in sorted(ssd_dir.glob("region-*.kvr")):
        data = bytearray(region.read_bytes())
        for offset in range(2048, len(data), 4096):
            data[offset:offset + 64] = bytes(b ^ 0xFF for b in data[offset:offset + 64])
            damaged += 1
        region.write_bytes(bytes(data))
    return damaged


def test_blocks_that_fail_to_load_are_recomputed(tiny_model, prompts, reference, workdir, tmp_path):
    """The daemon promises blocks at lookup and then cannot deliver them (their SSD copies
    fail verification): the connector reports them, vLLM recomputes, the tokens stay exact."""
    home = tmp_path / "damaged-daemon"
    ssd_args = ("--ssd-path", str(home / "ssd"), "--ssd-capacity", "64MiB", "--ssd-region-size", "4MiB",
                "--no-ssd-compress")
    p1, p2 = prompts["P1"], prompts["P2"]
    first = start_daemon(home, *ssd_args)
    try:
        run_engine(workdir, "A-damaged", {"model": str(tiny_model), "target": first.target,
                                          "steps": [{"generate": [p1, p2]}]})
    finally:
        first.stop()
    assert corrupt_payloads(home / "ssd") > 0
    second = start_daemon(home, *ssd_args)
    try:
        run = run_engine(workdir, "B-damaged", {"model": str(tiny_model), "target": second.target,
                                                "steps": [{"generate": [p1, p2]}]})
        stats = second.stats()
    finally:
        second.stop()
    out_p1, out_p2 = run.outputs(0)
    assert [out_p1["token_ids"], out_p2["token_ids"]] == [reference["P1"], reference["P2"]]
    assert stats.counters.hit_blocks > 0  # the lookups promised blocks...
    assert stats.counters.checksum_failures > 0  # ...whose bytes did not verify
    for out in (out_p1, out_p2):
        assert out["kv_transfer_params"]["kvstore_load_failed"]
        assert loaded(out) == 0
    assert "client/vllm.py" not in run.log


def test_daemon_killed_mid_run_engine_recomputes_with_one_warning(tiny_model, prompts, reference, reference_run,
                                                                  workdir, tmp_path):
    daemon = start_daemon(tmp_path / "doomed")
    try:
        p = prompts
        run = run_engine(workdir, "F", {"model": str(tiny_model), "target": daemon.target, "steps": [
            {"generate": [p["P1"], p["P2"]]},
            {"kill": daemon.pid},
            {"reset_prefix_cache": True},
            {"generate": [p["P1"] + p["S"], p["P3"], p["P2"] + p["S"]]},
        ]})
    finally:
        daemon.stop()
    assert tokens(run, 0) == [reference["P1"], reference["P2"]]
    assert tokens(run, 3) == [reference["P1+S"], reference["P3"], reference["P2+S"]]
    assert [loaded(o) for o in run.outputs(3)] == [0, 0, 0]
    warnings = [line for line in run.log.splitlines() if "kvstore daemon at" in line and "failed during" in line]
    assert len(warnings) == 1, "\n".join(warnings) or run.log[-4000:]
    # vLLM logs a traceback of its own when run without a tokenizer; the connector adds none.
    assert run.log.count("Traceback") == reference_run.log.count("Traceback")
    assert "kvstore/errors.py" not in run.log and "client/vllm.py" not in run.log
