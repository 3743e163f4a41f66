"""Runs one vLLM engine (CPU) through a scripted sequence and writes what happened as JSON.

The engine tests start this in a fresh process per engine: vLLM keeps process-wide
state (its distributed environment, the KV transfer group), so two `LLM` instances with
different connector settings do not share a process cleanly.

    python vllm_runner.py SPEC.json OUT.json

SPEC: {"model": DIR, "dtype": "float32", "block_size": 32, "max_tokens": 16,
       "target": "unix:..." or null (no connector), "steps": [STEP, ...],
       optional: "tokenizer": true (load the model's tokenizer; outputs carry "text"),
       "kv_cache_memory_bytes", "max_model_len", "break_even" (the connector's key, default
       false: tests that count loads must not depend on measured speeds),
       "slow_plane_bytes_per_s": N (the seam below),
       "kv_events": {"endpoint": ..., "replay_endpoint": ...} (vLLM's own KV event
       publisher, ZMQ, on those endpoints)}
STEP: {"generate": [PROMPT, ...]} | {"reset_prefix_cache": true} | {"kill": PID} | {"sleep": SECONDS}
      | {"restart": {"pid": PID, "how": "kill-9" | "term", "argv": [...], "target": "unix:...", "log": PATH}}
PROMPT: [token ids] or {"prompt_token_ids": [...], "cache_salt": "...", "max_tokens": n,
        "kv_transfer_params": {...}}
OUT:  {"steps": [{"outputs": [{"token_ids", "num_cached_tokens", "kv_transfer_params", "text"}]}, ...]}
      (a restart step: {"pid": the new daemon's pid})

The slowed plane (a test seam): with "slow_plane_bytes_per_s", every put and fetch of the
SDK's blocking client in this process takes at least its bytes over that rate (it runs
at full speed, then sleeps the rest), as over a slow link.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def make_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_transfer_config = None
    if spec.get("target"):
        kv_transfer_config = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.client.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"target": spec["target"], "retry_interval_s": 60,
                                       "break_even": spec.get("break_even", False)},
        )
    kv_events_config = None
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **spec["kv_events"])
    return LLM(
        kv_events_config=kv_events_config,
        model=spec["model"],
        skip_tokenizer_init=not spec.get("tokenizer", False),
        dtype=spec.get("dtype", "float32"),
        block_size=spec.get("block_size", 32),
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 64 << 20),
        max_model_len=spec.get("max_model_len", 2048),
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_transfer_config=kv_transfer_config,
    )


def slow_down_the_plane(bytes_per_s: float) -> None:
    """Make the SDK's blocking puts and fetches take at least bytes / bytes_per_s."""
    from kvstore.client.sync import Client

    def nbytes(block: Any) -> int:  # a tensor (the connector's puts) or a buffer
        return block.numel() * block.element_size() if hasattr(block, "numel") else len(memoryview(block).cast("B"))

    def slowed(method: Any, blocks_of: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = method(self, *args, **kwargs)
            n_bytes = sum(nbytes(b) for b in blocks_of(args, kwargs, result))
            time.sleep(max(0.0, n_bytes / bytes_per_s - (time.perf_counter() - started)))
            return result
        return run

    Client.put = slowed(Client.put, lambda args, kwargs, result: args[2])  # type: ignore[method-assign]
    Client.fetch = slowed(Client.fetch, lambda args, kwargs, result: result)  # type: ignore[method-assign]


def wait_dead(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def restart(pid: int, how: str, argv: list[str], target: str, log: str) -> int:
    """Stop daemon `pid` (SIGKILL or SIGTERM), start `argv` and wait until it answers on
    `target`; the new daemon's pid."""
    import glob
    import subprocess

    from kvstore.client import Client
    from kvstore.errors import KVStoreError

    os.kill(pid, signal.SIGKILL if how == "kill-9" else signal.SIGTERM)
    wait_dead(pid)
    for seg in glob.glob(f"/dev/shm/kvstore-{pid}-*"):  # what a SIGKILLed daemon could not unlink
        os.unlink(seg)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with Client(target, timeout_s=2) as kv:
                kv.stats()
            return proc.pid
        except KVStoreError:
            time.sleep(0.1)
    raise RuntimeError(f"the restarted daemon did not answer on {target}")


def main(spec_path: str, out_path: str) -> None:
    from vllm import SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("slow_plane_bytes_per_s"):
        slow_down_the_plane(spec["slow_plane_bytes_per_s"])
    llm = make_llm(spec)
    detokenize = bool(spec.get("tokenizer", False))

    def params_of(prompt: dict[str, Any]) -> SamplingParams:
        extra = {"kv_transfer_params": prompt.pop("kv_transfer_params")} if "kv_transfer_params" in prompt else None
        return SamplingParams(temperature=0.0, max_tokens=prompt.pop("max_tokens", spec.get("max_tokens", 16)),
                              ignore_eos=True, detokenize=detokenize, extra_args=extra)

    steps: list[dict[str, Any]] = []
    for step in spec["steps"]:
        if "generate" in step:
            prompts = [dict(p) if isinstance(p, dict) else {"prompt_token_ids": p} for p in step["generate"]]
            params = [params_of(p) for p in prompts]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            steps.append({"outputs": [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "num_cached_tokens": o.num_cached_tokens,
                    "kv_transfer_params": o.kv_transfer_params,
                    "text": o.outputs[0].text if detokenize else None,
                }
                for o in outputs
            ]})
        elif "reset_prefix_cache" in step:
            llm.reset_prefix_cache()
            steps.append({})
        elif "sleep" in step:
            time.sleep(step["sleep"])  # lets a subscriber connect before the engine publishes
            steps.append({})
        elif "kill" in step:
            # SIGKILL: the daemon vanishes mid-run without a goodbye, as in a crash.
            os.kill(step["kill"], signal.SIGKILL)
            wait_dead(step["kill"])
            steps.append({})
        elif "restart" in step:
            # The daemon stops (a crash, or a clean stop) and a new one starts on its
            # socket while this engine, and its connector's client, run on.
            steps.append({"pid": restart(**step["restart"])})
    with open(out_path, "w") as f:
        json.dump({"steps": steps}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
