"""Runs one vLLM engine (CPU) through a scripted sequence and writes what happened as JSON.

The engine tests start this in a fresh process per engine: vLLM keeps process-wide
state (its distributed environment, the KV transfer group), so two `LLM` instances with
different connector settings do not share a process cleanly.

    python vllm_runner.py SPEC.json OUT.json

SPEC: {"model": DIR, "dtype": "float32", "block_size": 32, "max_tokens": 16,
       "target": "unix:..." or null (no connector), "steps": [STEP, ...]}
STEP: {"generate": [[token ids] or {"prompt_token_ids": [...], "cache_salt": "..."}, ...]} | {"reset_prefix_cache": true} | {"kill": PID}
      | {"sleep": SECONDS}
SPEC may also carry "kv_events": {"endpoint": ..., "replay_endpoint": ...}: vLLM's own KV
event publisher (ZMQ) on those endpoints.
OUT:  {"steps": [{"outputs": [{"token_ids", "num_cached_tokens", "kv_transfer_params"}]}, ...]}
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
            kv_connector_extra_config={"target": spec["target"], "retry_interval_s": 60},
        )
    kv_events_config = None
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **spec["kv_events"])
    return LLM(
        kv_events_config=kv_events_config,
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        block_size=spec.get("block_size", 32),
        kv_cache_memory_bytes=64 << 20,
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_transfer_config=kv_transfer_config,
    )


def wait_dead(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def main(spec_path: str, out_path: str) -> None:
    from vllm import SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    llm = make_llm(spec)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True,
                            detokenize=False)
    steps: list[dict[str, Any]] = []
    for step in spec["steps"]:
        if "generate" in step:
            prompts = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in step["generate"]]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            steps.append({"outputs": [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "num_cached_tokens": o.num_cached_tokens,
                    "kv_transfer_params": o.kv_transfer_params,
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
    with open(out_path, "w") as f:
        json.dump({"steps": steps}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
