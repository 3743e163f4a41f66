"""What both TTFT examples need: a random Llama (or, for a hybrid model, a Gemma-3 with
sliding-window and full-attention layers) big enough that prefill costs something on a
CPU (built locally, nothing downloaded) and a kvstore daemon on a temp Unix socket."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build_random_llama(path: Path, *, layers: int = 8, hidden: int = 1024, seed: int = 0) -> Path:
    """A Llama with random weights (8 layers, hidden 1024, 8 heads / 4 KV heads of dim 128).

    Its outputs are meaningless, its cost is real: about 100M parameters, so a few
    thousand prompt tokens take seconds to prefill on a laptop-class CPU.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    config = LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=8192, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def build_random_gemma3(path: Path, *, layers: int = 8, hidden: int = 1024, window: int = 512,
                        seed: int = 0) -> Path:
    """A Gemma-3 with random weights of the Llama's size (8 layers, hidden 1024, 8 heads / 4
    KV heads of dim 128), three sliding-window layers (window `window` tokens) to every
    full-attention one, as Gemma-3 interleaves them (5 to 1 there)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if (path / "config.json").exists():
        return path
    config = Gemma3TextConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128, sliding_window=window,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)],
        max_position_embeddings=8192, initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


class Daemon:
    """`server.py` as a child process; stopped when the `with` block ends."""

    def __init__(self, directory: Path, capacity: str = "2GiB", cpus: set[int] | None = None) -> None:
        self.sock = directory / "kv.sock"
        self.target = f"unix:{self.sock}"
        self._log = open(directory / "daemon.log", "wb")  # noqa: SIM115 - closed in __exit__
        # `cpus`: keep the daemon off the CPUs the engines are pinned to.
        self._proc = subprocess.Popen(
            [sys.executable, str(REPO / "server.py"), "--listen", self.target, "--host-capacity", capacity,
             "--metrics-listen", "off"],
            stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)

    def __enter__(self) -> Daemon:
        from kvstore.client import Client
        from kvstore.errors import KVStoreError

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the kvstore daemon exited with {self._proc.returncode}")
            if os.path.exists(self.sock):
                try:
                    with Client(self.target, timeout_s=5) as kv:
                        kv.stats()
                    return self
                except KVStoreError:
                    pass
            time.sleep(0.1)
        raise RuntimeError("the kvstore daemon did not start within 60 s")

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        self._proc.wait(30)
        self._log.close()
