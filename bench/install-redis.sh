#!/usr/bin/env bash
# Installs redis-server from Debian for the side-by-side benchmark. The benchmark starts
# its own instance on 127.0.0.1 and stops it; the package's system service is not used.
set -euo pipefail
if command -v redis-server >/dev/null; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq redis-server >/dev/null
# Debian starts a system-wide instance on install where an init system runs; the
# benchmark does not need it.
$SUDO systemctl stop redis-server 2>/dev/null || $SUDO service redis-server stop 2>/dev/null || true
