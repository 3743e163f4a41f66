#!/usr/bin/env bash
# Builds the venv the SGLang HiCache backend is tested in (VENV, default .venv-sglang):
# SGLang's storage layer (its host pools, storage interface and factory) on the CPU.
#
# SGLang's wheel pins a CUDA torch, flashinfer, sglang-kernel and other GPU packages, none
# of which the storage layer imports, so the wheel goes in with --no-deps and only the
# packages its import chain needs follow, with torch held at the CPU build by a
# constraints file. Pins follow SGLang's own where it pins (transformers, sentencepiece,
# compressed-tensors, apache-tvm-ffi). triton (about 1 GB installed) is imported at module
# level by sglang/srt/utils/common.py and installs as is. torchvision is the one package
# replaced by a stand-in (scripts/sglang/torchvision, which says why). Used by
# `make setup-sglang`; the Makefile stamps the venv so it is built once per machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-sglang}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
PIP="--quiet --disable-pip-version-check"

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "SGLang 0.5.23 ships for CPython 3.11 only; set PYTHON=python3.11")'
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install $PIP "torch==$TORCH_VERSION"
echo "torch==$TORCH_VERSION" > "$VENV/constraints.txt"
"$PY" -m pip install $PIP --no-deps "sglang==$SGLANG_VERSION"
echo "install-sglang.sh: pip will list SGLang's GPU requirements as missing or conflicting; that is expected" \
     "(the wheel is installed without them) and does not fail the install"
# What `import sglang.srt.mem_cache.{hicache_storage,storage.backend_factory,memory_pool_host,
# pool_host.*}` and `sglang.srt.observability.metrics_collector` need, found by importing them.
"$PY" -m pip install $PIP -c "$VENV/constraints.txt" \
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
    IPython aiohttp dill gguf "triton==3.9.0" "transformers==5.19.0" "apache-tvm-ffi==0.1.11" \
    "sentencepiece==0.2.1" "compressed-tensors==0.18.0" prometheus-client
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$SITE/torchvision"
cp -r scripts/sglang/torchvision "$SITE/torchvision"
"$PY" -m pip install $PIP -c "$VENV/constraints.txt" -e '.[dev]'
"$PY" - <<'PY'
import warnings
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import sglang.srt.mem_cache.memory_pool_host, sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    import sglang.srt.observability.metrics_collector  # noqa: F401
PY
touch "$VENV/.installed"
