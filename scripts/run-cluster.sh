#!/usr/bin/env bash
# `make run-cluster`: a local etcd and three daemons (n0, n1, n2) forming one pool on this
# host, to try the cluster out. Each daemon has its own Unix socket (for co-located
# clients) and loopback TCP port (for the other daemons). Ctrl-C stops them all and
# removes the temporary directory; nothing is left running.
#
# Extra arguments go to every daemon, e.g.
#   bash scripts/run-cluster.sh --host-capacity 1GiB --cluster-lookup-timeout-ms 10
set -euo pipefail

PY=${PY:-.venv/bin/python}
ETCD=${ETCD:-$(command -v etcd || true)}
if [[ -z "$ETCD" ]]; then
    echo "run-cluster: etcd is not installed; run scripts/install-etcd.sh (make run-cluster does)" >&2
    exit 1
fi

DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvstore-cluster.XXXXXX")
pids=()

cleanup() {
    trap - EXIT INT TERM
    echo
    echo "stopping the pool..."
    # The daemons first, while etcd is still there for them to leave the pool; then etcd.
    local daemons=("${pids[@]:1}")
    for pid in "${daemons[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${daemons[@]}"; do
        # Their drain takes at most grace_s (10 s); past 30 s one is killed.
        for _ in $(seq 300); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
    if [[ ${#pids[@]} -gt 0 ]]; then
        kill -TERM "${pids[0]}" 2>/dev/null || true
        wait "${pids[0]}" 2>/dev/null || true
    fi
    rm -rf "$DIR"
    echo "stopped"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_ports() {
    "$PY" - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
for s in socks:
    s.close()
EOF
}

read -r ETCD_CLIENT ETCD_PEER P0 P1 P2 M0 M1 M2 <<<"$(free_ports 8)"
PORTS=("$P0" "$P1" "$P2")
METRICS=("$M0" "$M1" "$M2")

env ETCD_UNSUPPORTED_ARCH="$(uname -m | grep -qE 'aarch64|arm64' && echo arm64 || true)" \
    "$ETCD" --name run-cluster --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT" --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "run-cluster=http://127.0.0.1:$ETCD_PEER" --logger zap --log-level warn \
    >"$DIR/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
    if "$PY" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$ETCD_CLIENT/health', timeout=1)" \
        2>/dev/null; then
        break
    fi
    sleep 0.1
done

# Three daemons on one machine share its cores with whatever else runs there: a deadline
# of 50 ms for a lookup's round to the other nodes, not the 5 ms a fleet's network is
# given, so a busy laptop shows hits rather than misses (later arguments override it).
for i in 0 1 2; do
    "$PY" server.py --listen "unix:$DIR/n$i.sock,127.0.0.1:${PORTS[$i]}" \
        --metrics-listen "127.0.0.1:${METRICS[$i]}" --shm-dir /dev/shm --host-capacity 256MiB \
        --cluster --cluster-etcd "127.0.0.1:$ETCD_CLIENT" --cluster-prefix /kvstore-run-cluster \
        --cluster-lookup-timeout-ms 50 --node-id "n$i" "$@" >"$DIR/n$i.log" 2>&1 &
    pids+=($!)
done
for i in 0 1 2; do
    for _ in $(seq 200); do
        [[ -S "$DIR/n$i.sock" ]] && break
        sleep 0.05
    done
done
sleep 1

cat <<EOF
A pool of three daemons on etcd 127.0.0.1:$ETCD_CLIENT (logs in $DIR):
  n0  unix:$DIR/n0.sock  peers at 127.0.0.1:${PORTS[0]}  metrics http://127.0.0.1:${METRICS[0]}/metrics
  n1  unix:$DIR/n1.sock  peers at 127.0.0.1:${PORTS[1]}  metrics http://127.0.0.1:${METRICS[1]}/metrics
  n2  unix:$DIR/n2.sock  peers at 127.0.0.1:${PORTS[2]}  metrics http://127.0.0.1:${METRICS[2]}/metrics

Try, in another shell:
  $PY -m kvstore.cli cluster members --target unix:$DIR/n0.sock
  $PY -m kvstore.cli info cluster --target unix:$DIR/n1.sock
  $PY scripts/cluster-demo.py unix:$DIR/n0.sock unix:$DIR/n2.sock   # put on n0, hit on n2

Ctrl-C stops the pool.
EOF
wait
