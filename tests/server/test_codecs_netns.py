"""The codec chooser on real links: a daemon in one network namespace, a client in
another, joined by a veth pair. Unshaped (the veth moves GB/s), the client's fetches stay
raw and no codec is ever run on the wire; shaped to 40 Mbit/s by `tc ... tbf`, the same
client switches to a lossless codec after its first transfers, and its `codec_stats`
say so. Needs root and iproute2; skipped (with the reason) where namespaces cannot be made.

The decision is a timing one by nature; the margins make it robust on a loaded machine:
the shaped link is 10 times slower than the codecs run here, the unshaped one several
times faster than they do.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests import procs
from tests.server.test_data_lane_netns import PORT, two_namespaces  # noqa: F401 - the fixture

CLIENT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from kvstore.client import Client
    from kvstore.layout import KVLayout

    target, phase = sys.argv[1], sys.argv[2]
    layout = KVLayout(model="netns-codec", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64,
                      block_size_tokens=32)  # 64 KiB blocks
    rng = np.random.default_rng(0)
    n = 24  # 1.5 MiB a fetch: each one teaches the chooser
    x = (rng.standard_normal(n * layout.bytes_per_block // 2) * 0.5).astype(np.float32)
    raw = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    blocks = [raw[i * layout.bytes_per_block:(i + 1) * layout.bytes_per_block] for i in range(n)]
    tokens = list(range(n * 32))
    with Client(target, data_plane="lane") as kv:
        if phase == "put":
            kv.put(layout, tokens, blocks)
        picks = []
        for _ in range(6):
            assert [bytes(b) for b in kv.fetch(layout, tokens)] == blocks
            picks.append(kv.codec_stats[0].choice)
        c = kv.codec_stats[0]
        print(json.dumps({"picks": picks, "raw_bytes": c.raw_bytes, "link_gbps": c.link_gbps,
                          "ratios": c.ratios}))
""")


def _client(ns: str, target: str, phase: str) -> dict:  # type: ignore[type-arg]
    import json

    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, target, phase],
                         capture_output=True, text=True, timeout=180, env=procs.clean_env(),
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _shape(ns: str, dev: str, rate: str | None) -> None:
    if rate is None:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False,
                       capture_output=True, timeout=30)
        return
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", "64kb", "latency", "100ms"], check=True, capture_output=True, timeout=30)


def test_raw_on_a_fast_link_and_a_codec_on_a_slow_one(two_namespaces, tmp_path: Path) -> None:  # noqa: F811
    client_ns, daemon_ns, _, daemon_addr = two_namespaces
    sock = tmp_path / "kv.sock"
    args = procs.daemon_args(sock, "--listen", f"unix:{sock},{daemon_addr}:{PORT}", "--data-lane-listen",
                             f"{daemon_addr}:0", "--insecure-remote", "--host-capacity", "64MiB", "--shm-dir",
                             str(tmp_path))
    # Non-loopback without a token file is refused; a token file with one tenant does.
    from kvstore.server.auth import new_token

    token, digest = new_token()
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(f'[[tenant]]\nname = "t"\nrole = "admin"\ntokens = ["{digest}"]\n')
    tokens_file.chmod(0o600)
    args += ["--auth-token-file", str(tokens_file), "--unix-socket-tenant", "t"]
    daemon = procs.start(["ip", "netns", "exec", daemon_ns, *args], sock, tmp_path / "daemon.log")
    dev = next(line.split(":")[1].strip().split("@")[0] for line in subprocess.run(
        ["ip", "-n", daemon_ns, "-o", "link", "show", "type", "veth"], capture_output=True, text=True,
        check=True).stdout.splitlines())
    global CLIENT
    try:
        CLIENT = CLIENT.replace('Client(target, data_plane="lane")', f'Client(target, data_plane="lane", '
                                                                     f'token="{token}")')
        fast = _client(client_ns, f"{daemon_addr}:{PORT}", "put")
        assert fast["picks"] == ["raw"] * 6, fast
        assert set(fast["raw_bytes"]) == {"raw"}, fast  # no codec ever ran on the wire
        assert fast["ratios"]["shuffle-zstd"] < 0.9  # it would shrink the blocks: speed alone decided
        _shape(daemon_ns, dev, "40mbit")  # the daemon's egress: what a fetch crosses
        slow = _client(client_ns, f"{daemon_addr}:{PORT}", "fetch")
        assert slow["picks"][0] == "raw", slow  # a new client measures the link first
        assert slow["picks"][-1] in ("shuffle-lz4", "shuffle-zstd"), slow
        assert slow["link_gbps"] < 0.01, slow
        assert sum(v for k, v in slow["raw_bytes"].items() if k != "raw") > 0, slow
    finally:
        _shape(daemon_ns, dev, None)
        assert daemon.stop() == 0, (tmp_path / "daemon.log").read_text()[-2000:]
