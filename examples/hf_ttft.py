#!/usr/bin/env python3
"""Time to first token of a transformers model on a long prompt, without and with kvstore.

    python examples/hf_ttft.py [--prompt-tokens 3072] [--target unix:/path/kv.sock]

Without kvstore: `generate(max_new_tokens=1)` prefills the whole prompt. With kvstore:
the prompt's blocks were stored by an earlier run; `restore_prefix` fetches them and
`generate` computes only the rest. Without --target a daemon is started on a temp Unix
socket. The model is a random Llama built locally (about 100M parameters, fp32).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _setup import Daemon, build_random_llama  # noqa: E402

from kvstore.client import Client  # noqa: E402
from kvstore.client.hf import layout_for_model, restore_prefix, store_prefix  # noqa: E402


@torch.inference_mode()
def run(model_dir: Path, target: str, prompt_tokens: int) -> None:
    import transformers
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(0)
    tokens = [rng.randrange(3, model.config.vocab_size) for _ in range(prompt_tokens)]
    input_ids = torch.tensor([tokens])
    layout = layout_for_model(model, model_id="example/random-llama-100m", block_size_tokens=32)
    model.generate(input_ids[:, :64], max_new_tokens=1, do_sample=False)  # warm-up

    t0 = time.perf_counter()
    plain = model.generate(input_ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    ttft_plain = time.perf_counter() - t0

    with Client(target) as kv:
        t0 = time.perf_counter()
        store_prefix(kv, layout, tokens, plain.past_key_values)
        store_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        restored = restore_prefix(kv, layout, tokens, config=model.config)
        fetched_s = time.perf_counter() - t0
        out = model.generate(input_ids, past_key_values=restored.cache, max_new_tokens=1, do_sample=False)
        ttft_kv = time.perf_counter() - t0

    assert out[0, -1] == plain.sequences[0, -1], "the first token differs; the restored cache is wrong"
    print(f"transformers {transformers.__version__} (CPU), {prompt_tokens}-token prompt, time to first token:")
    print(f"  without kvstore     {ttft_plain:7.2f} s")
    print(f"  with kvstore, hit   {ttft_kv:7.2f} s   ({restored.num_tokens} tokens restored in {fetched_s:.2f} s; "
          f"{ttft_plain / ttft_kv:.1f}x faster)")
    print(f"  (storing the prompt's blocks once took {store_s:.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=3072)
    parser.add_argument("--target", help="a running kvstore daemon (default: start one on a temp socket)")
    parser.add_argument("--model", help="a local Llama directory (default: a random Llama built here)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstore-hf-ttft-") as tmp:
        workdir = Path(tmp)
        model = Path(args.model) if args.model else build_random_llama(workdir / "model")
        if args.target:
            run(model, args.target, args.prompt_tokens)
        else:
            with Daemon(workdir) as daemon:
                run(model, daemon.target, args.prompt_tokens)


if __name__ == "__main__":
    main()
