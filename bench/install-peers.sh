#!/usr/bin/env bash
# Installs the peers compared by `make bench-peers` into a venv of their own (VENV, default
# .venv-peers): LMCache pins and pulls packages the development venv must not get, and
# Mooncake's wheel links libibverbs even for TCP, which comes from Debian. torch is
# installed first and held at the development venv's version by a constraints file, so no
# requirement can pull a CUDA build. LMCache's usage telemetry is turned off at run time
# (LMCACHE_TRACK_USAGE=false, set by bench/peers/lmcache_peer.py).
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-peers}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
LMCACHE_VERSION=${LMCACHE_VERSION:-0.5.6}
MOONCAKE_VERSION=${MOONCAKE_VERSION:-0.3.13.post1}
PIP="--quiet --disable-pip-version-check"

if ! ldconfig -p | grep -q 'libibverbs.so.1'; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq libibverbs1 ibverbs-providers >/dev/null
fi

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install $PIP "torch==$TORCH_VERSION"
echo "torch==$TORCH_VERSION" > "$VENV/constraints.txt"
"$VENV/bin/python" -m pip install $PIP -c "$VENV/constraints.txt" \
    "lmcache==$LMCACHE_VERSION" "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
# The CUDA builds of these that LMCache's requirements bring along are never imported on
# a CPU machine; removing them keeps the venv small.
"$VENV/bin/python" -m pip uninstall $PIP -y torchvision torchaudio torchcodec triton 2>/dev/null || true
touch "$VENV/.installed"
