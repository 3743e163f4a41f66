"""Engines that keep their kvstore client while the daemon restarts under them (kill -9,
and a clean stop), on the shared-memory plane: vLLM through the connector, transformers
through the adapter.

After a restart the engine sees misses for what the old daemon held (it kept no SSD
here), never an error, and what it stores from then on is stored: the same engine hits
it, and so does another client, which reads the daemon's own copy (a client whose puts
went into the old daemon's memory would read back its own bytes, while every other
reader found them failing verification). The daemon counts no checksum failure.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, DaemonProcess, run_engine, start_daemon
from test_vllm import BLOCK, held_tokens, loaded, tokens, workdir  # noqa: F401 (workdir: a fixture)

from kvstore.client import Client
from tests.procs import remove_segments

HOW = ("kill-9", "term")


def daemon_argv(directory: Path) -> list[str]:
    """The command line `start_daemon(directory)` runs."""
    return [sys.executable, str(REPO / "server.py"), "--listen", f"unix:{directory / 'kv.sock'}", "--host-capacity",
            "256MiB"]


def stop_pid(pid: int) -> None:
    """Stop a daemon that is not this process's child (the engine's runner started it)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
    remove_segments(pid)


def checksum_failures(target: str) -> int:
    with Client(target) as kv:
        stats = kv.stats()
    return int(stats.counters.checksum_failures + sum(t.checksum_failures for t in stats.tiers))


def test_a_vllm_engine_keeps_its_connector_across_daemon_restarts(tiny_model, prompts, workdir, tmp_path):
    """Tokens computed after the restart (every load a miss) and tokens over blocks
    loaded back from the daemon must be the same: greedy decoding over the same KV."""
    home = tmp_path / "restarted"
    daemon = start_daemon(home)
    p = prompts
    restart: dict[str, Any] = {"argv": daemon_argv(home), "target": daemon.target, "log": str(daemon.log_path)}
    pids = [daemon.pid]
    try:
        run = run_engine(workdir, "R", {"model": str(tiny_model), "target": daemon.target, "steps": [
            {"generate": [p["P1"], p["P2"]]},
            {"restart": {**restart, "pid": daemon.pid, "how": "kill-9"}},
            {"reset_prefix_cache": True},
            {"generate": [p["P1"] + p["S"], p["P3"]]},  # misses: the new daemon holds nothing yet
            {"reset_prefix_cache": True},
            {"generate": [p["P1"] + p["S"], p["P3"]]},  # hits: what this engine stored since the restart
        ]})
        pids.append(run.steps[1]["pid"])
        # A clean stop next, under another engine that keeps its client across it.
        run2 = run_engine(workdir, "R2", {"model": str(tiny_model), "target": daemon.target, "steps": [
            {"generate": [p["P2"] + p["S"]]},
            {"restart": {**restart, "pid": pids[-1], "how": "term"}},
            {"reset_prefix_cache": True},
            {"generate": [p["P3"]]},
            {"reset_prefix_cache": True},
            {"generate": [p["P3"]]},
        ]})
        pids.append(run2.steps[1]["pid"])
        # Another engine, another client: it reads the daemon's own copy of what R2 stored.
        other = run_engine(workdir, "R3", {"model": str(tiny_model), "target": daemon.target,
                                           "steps": [{"generate": [p["P3"]]}]})
        failures = checksum_failures(daemon.target)
    finally:
        daemon.stop()
        for pid in pids[1:]:
            stop_pid(pid)
    assert tokens(run, 3) == tokens(run, 5)
    assert [loaded(o) for o in run.outputs(3)] == [0, 0]
    assert [loaded(o) for o in run.outputs(5)] == [len(p["P1"] + p["S"]) // BLOCK * BLOCK, held_tokens(p["P3"])]
    assert tokens(run2, 3) == tokens(run2, 5) == tokens(other, 0) == [tokens(run, 3)[1]]
    assert [loaded(o) for o in run2.outputs(3)] == [0]
    assert [loaded(o) for o in run2.outputs(5)] == [held_tokens(p["P3"])]
    assert [loaded(o) for o in other.outputs(0)] == [held_tokens(p["P3"])]
    assert failures == 0
    for r in (run, run2):
        assert not any(o["kv_transfer_params"]["kvstore_load_failed"] for s in (3, 5) for o in r.outputs(s))
        assert "failed during" not in r.log  # no call failed: nothing for the connector to warn of


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.mark.parametrize("how", HOW)
@torch.inference_mode()
def test_the_transformers_adapter_keeps_its_client_across_a_daemon_restart(model, tmp_path, how):
    from kvstore.client.hf import layout_for_model, prefill, restore_prefix, store_prefix

    rng = random.Random(42)
    tokens_ = [rng.randrange(3, model.config.vocab_size) for _ in range(256 + 10)]
    prefix = tokens_[:256]
    input_ids = torch.tensor([tokens_])
    layout = layout_for_model(model, model_id="test/tiny-llama-restart", block_size_tokens=BLOCK)
    full = model(input_ids, use_cache=True)
    home = tmp_path / "hf"
    first: DaemonProcess | None = start_daemon(home)
    second: DaemonProcess | None = None
    try:
        with Client(first.target) as kv:
            assert store_prefix(kv, layout, prefix, full.past_key_values).stored == 256 // BLOCK
            assert kv.data_plane_in_use == "local"
            if how == "kill-9":
                first.proc.kill()
                first.proc.wait(30)
            first.stop()
            second = start_daemon(home)
            # The same client: what the old daemon held is a miss, never an error...
            assert restore_prefix(kv, layout, prefix, config=model.config).num_tokens == 0
            # ...and what it stores now is stored.
            assert store_prefix(kv, layout, prefix, full.past_key_values).stored == 256 // BLOCK
            result = prefill(model, kv, layout, input_ids)
            assert kv.data_plane_in_use == "local"
        assert result.reused_tokens == 256
        torch.testing.assert_close(result.logits[0], full.logits[0, 256:], rtol=1.3e-6, atol=1e-5)
        with Client(second.target, data_plane="grpc") as other:  # the daemon's own copy
            again = restore_prefix(other, layout, prefix, config=model.config)
        assert again.num_tokens == 256 - BLOCK  # the last prompt block is left to compute
        assert checksum_failures(second.target) == 0
    finally:
        for d in (first, second):
            if d is not None:
                d.stop()
