#!/usr/bin/env python3
"""Time to first token of vLLM (CPU) on a long prompt, without and with kvstore.

    python examples/vllm_ttft.py [--prompt-tokens 3072] [--target unix:/path/kv.sock] [--hybrid]

Runs three measurements, each engine in a fresh process:
  1. plain vLLM, no connector;
  2. vLLM with the kvstore connector on a cold daemon (a miss: prefill, then store);
  3. the same engine after its local prefix cache is reset: the prefill comes from kvstore.
Without --target a daemon is started on a temp Unix socket. The model is a random Llama
built locally (about 100M parameters, fp32), so nothing is downloaded; with --hybrid, a
random Gemma-3 of the same size whose layers are three sliding-window (512 tokens) to one
full-attention, stored as KV groups: the line after the times gives the bytes kvstore
kept for the prompt's reusable prefix against keeping every layer in full.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _setup import Daemon, build_random_gemma3, build_random_llama  # noqa: E402


def measure(model: str, prompt: list[int], target: str | None) -> list[float]:
    """(child process) TTFT of `prompt`; with a target: cold, then from kvstore."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if target:
        kv = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.client.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"target": target})
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=32,
              kv_cache_memory_bytes=1 << 30, max_model_len=8192, enforce_eager=True,
              enable_prefix_caching=True, kv_transfer_config=kv)
    first_token = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    rng = random.Random(1)
    llm.generate([{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(64)]}], first_token,
                 use_tqdm=False)  # warm-up: first-call costs are not prefill
    times = []
    for _ in range(2 if target else 1):
        llm.reset_prefix_cache()  # every measurement starts with vLLM's own cache empty
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], first_token, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return times


def child(args: argparse.Namespace) -> None:
    prompt = json.loads(Path(args.prompt_file).read_text())
    print("TTFT=" + json.dumps(measure(args.model, prompt, args.target)), flush=True)


def run_child(model: Path, prompt_file: Path, target: str | None) -> list[float]:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--prompt-file", str(prompt_file)]
    if target:
        cmd += ["--target", target]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("TTFT="):
            return json.loads(line[len("TTFT="):])
    raise RuntimeError(f"the engine process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=3072)
    parser.add_argument("--target", help="a running kvstore daemon (default: start one on a temp socket)")
    parser.add_argument("--model", help="a local model directory (default: a random Llama built here)")
    parser.add_argument("--hybrid", action="store_true",
                        help="a random Gemma-3 (sliding-window and full-attention layers) instead of the Llama")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    import vllm

    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-ttft-") as tmp:
        workdir = Path(tmp)
        build = build_random_gemma3 if args.hybrid else build_random_llama
        model = Path(args.model) if args.model else build(workdir / "model")
        rng = random.Random(0)
        prompt_file = workdir / "prompt.json"
        prompt_file.write_text(json.dumps([rng.randrange(3, 32000) for _ in range(args.prompt_tokens)]))
        (plain,) = run_child(model, prompt_file, None)
        if args.target:
            cold, warm = run_child(model, prompt_file, args.target)
            counters = stored_counters(args.target)
        else:
            with Daemon(workdir) as daemon:
                cold, warm = run_child(model, prompt_file, daemon.target)
                counters = stored_counters(daemon.target)
    print(f"vLLM {vllm.__version__} (CPU), {args.prompt_tokens}-token prompt, time to first token:")
    print(f"  without kvstore                 {plain:7.2f} s")
    print(f"  with kvstore, miss (+ store)    {cold:7.2f} s")
    print(f"  with kvstore, hit               {warm:7.2f} s   ({plain / warm:.1f}x faster than without)")
    stored, skipped = counters
    if skipped:
        print(f"  stored for the reusable prefix  {stored / 2**20:7.1f} MiB of {(stored + skipped) / 2**20:.1f} MiB "
              f"with every layer in full ({100 * stored / (stored + skipped):.0f}%)")


def stored_counters(target: str) -> tuple[int, int]:
    """Bytes the daemon stored, and the bytes its hit rules did not need to store."""
    from kvstore.client.admin import AdminClient

    with AdminClient(target) as admin:
        c = admin.stats().counters
    return c.bytes_in, c.group_bytes_skipped


if __name__ == "__main__":
    main()
