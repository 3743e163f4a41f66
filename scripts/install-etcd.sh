#!/usr/bin/env bash
# Installs etcd from Debian's `etcd-server` package for the cluster tests, which start their
# own etcd on 127.0.0.1 with free ports and a data directory under the test's tmp dir. The
# package's system service is not used: where an init system started it on install, it is
# stopped and disabled again. Idempotent and quick when etcd is already on PATH;
# non-interactive; needs root (or sudo) only when it has something to install.
set -euo pipefail

if command -v etcd >/dev/null 2>&1; then
    echo "install-etcd: etcd already present: $(command -v etcd) ($(etcd --version 2>/dev/null | head -n1))"
    exit 0
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo "install-etcd: etcd is missing and this is not root (no sudo either):" >&2
        echo "install-etcd: run 'apt-get install etcd-server' as root, then 'make test' again." >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-etcd: etcd is missing and apt-get is not here: install etcd >= 3.4 by hand" >&2
    echo "install-etcd: so that 'etcd' is on PATH, then run 'make test' again." >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
echo "install-etcd: etcd not found; installing Debian's etcd-server"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
# Debian enables and starts a system-wide etcd on install where an init system runs; the
# tests start their own on free ports.
$SUDO systemctl disable --now etcd 2>/dev/null || $SUDO service etcd stop 2>/dev/null || true
echo "install-etcd: installed $(command -v etcd) ($(etcd --version 2>/dev/null | head -n1))"
