"""`kvstore top` in a real pseudo-terminal: it refreshes, draws the tiers, and quits on `q`."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

from kvstore.client import Client

DEADLINE_S = 30.0


def read_until(fd: int, predicate, deadline: float) -> bytes:
    """Read the pty until `predicate(buffer)` or the deadline; returns what was read."""
    buf = b""
    while not predicate(buf):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            buf += chunk
    return buf


def test_top_refreshes_and_quits_on_q(daemon_thread, layout):
    tokens = list(range(layout.block_size_tokens * 3))
    with Client(daemon_thread.tcp_target) as kv:
        kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(3)])
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "top", "--target", daemon_thread.tcp_target, "--interval", "0.2"],
        stdin=slave, stdout=slave, stderr=slave, close_fds=True,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "120", "LINES": "40"},
    )
    os.close(slave)
    try:
        deadline = time.monotonic() + DEADLINE_S
        out = read_until(master, lambda b: b.count(b"kvstore top - ") >= 3, deadline)
        assert out.count(b"kvstore top - ") >= 3, out[-2000:]
        assert b"\x1b[H\x1b[2J" in out  # redraws in place on a terminal
        # The last frame may still be arriving; the one before it is complete.
        frame = out.split(b"kvstore top - ")[-2].decode(errors="replace")
        assert "host" in frame and "[" in frame and "3.00KiB / 16.00MiB" in frame
        assert layout.model in frame and "block hit ratio" in frame
        os.write(master, b"q")
        assert proc.wait(timeout=DEADLINE_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_top_without_a_terminal_prints_frames(daemon_thread):
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "top", "--target", daemon_thread.tcp_target, "--interval", "0.1",
         "--iterations", "2", "--json"],
        capture_output=True, text=True, timeout=DEADLINE_S, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(samples) == 2
    assert samples[1]["rates"]["lookups_s"] == 0.0 and samples[0]["stats"]["tiers"][0]["name"] == "host"


def test_top_shows_migration_rates_when_the_daemon_counts_them():
    from kvstore.cli.top import Sample, rates, render

    def sample(at: float, promotions: int, demotions: int) -> Sample:
        tier = {"name": "host", "present": True, "reason": "", "capacity_bytes": 100, "used_bytes": 50, "blocks": 5,
                "hits": 1, "misses": 1, "promotions": promotions, "demotions": demotions}
        counters = dict.fromkeys(("lookups", "lookup_blocks", "hit_blocks", "puts", "fetches", "bytes_in", "bytes_out",
                                  "evictions", "checksum_failures", "leases_active"), 0)
        return Sample(at, {"tiers": [tier], "counters": counters, "uptime_s": 1.0, "version": "x"}, [])

    first, second = sample(10.0, 0, 0), sample(12.0, 4, 10)
    frame = render("t", second, rates(first, second))
    assert "UP/s" in frame and "DOWN/s" in frame
    host = next(line for line in frame.splitlines() if line.startswith("host"))
    assert host.split()[-2:] == ["2.0", "5.0"]
    for t in first.stats["tiers"]:  # a daemon that does not count migrations: no such columns
        del t["promotions"], t["demotions"]
    assert "UP/s" not in render("t", first, rates(None, first))
