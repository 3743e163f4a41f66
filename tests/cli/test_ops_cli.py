"""The operator CLI against a real daemon: `--json` parsed, human tables checked for key fields,
exit codes (0 ok, 1 refused or unreachable, 2 bad command line)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from kvstore.cli.main import main
from kvstore.client import Client

N_BLOCKS = 6


@pytest.fixture
def loaded(daemon_thread, layout):
    """A daemon holding N_BLOCKS blocks of one namespace, looked up once."""
    tokens = list(range(layout.block_size_tokens * N_BLOCKS))
    with Client(daemon_thread.tcp_target) as kv:
        kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(N_BLOCKS)])
        hit = kv.lookup(layout, tokens + [7] * layout.block_size_tokens)  # N hits, 1 miss
    return daemon_thread, hit


def run(capsys, *argv: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_stats_json_and_table(loaded, capsys):
    d, _ = loaded
    code, out, _ = run(capsys, "stats", "--target", d.unix_target, "--json")
    assert code == 0
    stats = json.loads(out)
    (host,) = [t for t in stats["tiers"] if t["name"] == "host"]
    assert host["blocks"] == N_BLOCKS
    assert (host["hits"], host["misses"]) == (N_BLOCKS, 1)
    assert stats["counters"]["blocks_stored"] == N_BLOCKS

    code, out, _ = run(capsys, "stats", "--target", d.unix_target)
    assert code == 0
    for key in ("TIER", "CAPACITY", "USED", "BLOCKS", "HIT%", "PROMOTED", "DEMOTED", "DROPPED", "BAD_CHECKSUM"):
        assert key in out
    host_row = next(line for line in out.splitlines() if " host " in line)
    assert f" {N_BLOCKS} " in host_row and "85.7" in host_row  # 6 hits of 7 looked-up blocks


def test_stats_by_namespace_and_ls(loaded, layout, capsys):
    d, hit = loaded
    code, out, _ = run(capsys, "stats", "--by-namespace", "--target", d.tcp_target, "--json")
    assert code == 0
    (ns,) = json.loads(out)["by_namespace"]
    assert ns["namespace_id"] == hit.namespace_id.hex()
    assert (ns["layout"]["model"], ns["blocks"], ns["used_bytes"]) == (layout.model, N_BLOCKS, N_BLOCKS * layout.bytes_per_block)
    assert (ns["lookup_blocks"], ns["hit_blocks"]) == (N_BLOCKS + 1, N_BLOCKS)

    code, out, _ = run(capsys, "ls", "--target", d.tcp_target)
    assert code == 0
    assert hit.namespace_id.hex() in out and layout.model in out and "2,L,B,H,D" in out and "85.7" in out


def test_target_from_environment(loaded, capsys, monkeypatch):
    d, _ = loaded
    monkeypatch.setenv("KVSTORE_TARGET", d.tcp_target)
    code, out, _ = run(capsys, "ls", "--json")
    assert code == 0 and len(json.loads(out)["namespaces"]) == 1


def test_evict(loaded, layout, capsys):
    d, _ = loaded
    code, out, _ = run(capsys, "evict", "--tier", "host", "--bytes", str(2 * layout.bytes_per_block),
                       "--target", d.tcp_target, "--json")
    assert code == 0
    assert json.loads(out) == {"tier": "host", "target_bytes": 2048, "blocks": 2, "removed_bytes": 2048}
    code, _, err = run(capsys, "evict", "--tier", "ssd9", "--bytes", "1KiB", "--target", d.tcp_target)
    assert code == 1 and "no tier named 'ssd9'" in err
    with pytest.raises(SystemExit) as exc:
        main(["evict", "--tier", "host", "--bytes", "lots", "--target", d.tcp_target])
    assert exc.value.code == 2


def test_flush_asks_first(loaded, capsys, monkeypatch):
    d, hit = loaded
    code, _, err = run(capsys, "flush", "--target", d.tcp_target, stdin="n\n", monkeypatch=monkeypatch)
    assert code == 1 and "nothing flushed" in err and f"{N_BLOCKS} blocks" in err
    code, out, _ = run(capsys, "flush", "--namespace", hit.namespace_id.hex(), "--target", d.tcp_target,
                       stdin="y\n", monkeypatch=monkeypatch)
    assert code == 0 and f"flushed {N_BLOCKS} blocks" in out
    code, out, _ = run(capsys, "flush", "--yes", "--json", "--target", d.tcp_target)
    assert code == 0 and json.loads(out)["blocks"] == 0
    code, _, err = run(capsys, "flush", "--yes", "--namespace", "00" * 16, "--target", d.tcp_target)
    assert code == 1 and "not known" in err


def test_pin_and_unpin(loaded, capsys):
    d, hit = loaded
    hashes = [h.hex() for h in hit.block_hashes[:2]]
    code, out, _ = run(capsys, "pin", hit.namespace_id.hex(), *hashes, "--ttl-ms", "60000",
                       "--target", d.tcp_target, "--json")
    assert code == 0
    pinned = json.loads(out)
    assert pinned["pinned"] == 2
    code, out, _ = run(capsys, "stats", "--json", "--target", d.tcp_target)
    assert json.loads(out)["counters"]["leases_active"] == 1
    assert run(capsys, "unpin", pinned["lease_id"], "--target", d.tcp_target)[0] == 0
    assert run(capsys, "unpin", pinned["lease_id"], "--target", d.tcp_target)[0] == 1  # already released

    # A runtime change takes effect on the next call: pins are now capped at 5 s.
    assert run(capsys, "config", "set", "max_lease_ms", "5000", "--target", d.tcp_target)[0] == 0
    code, out, _ = run(capsys, "pin", hit.namespace_id.hex(), *hashes, "--ttl-ms", "60000",
                       "--target", d.tcp_target, "--json")
    assert code == 0 and json.loads(out)["expires_in_ms"] == 5000


def test_config_get_set(daemon_thread, capsys):
    t = daemon_thread.tcp_target
    code, out, _ = run(capsys, "config", "get", "--json", "--target", t)
    fields = {f["name"]: f for f in json.loads(out)["fields"]}
    assert code == 0 and fields["max_lease_ms"]["runtime"] and not fields["host_capacity"]["runtime"]
    assert fields["max_lease_ms"]["bounds"] == "[1, 86400000]"

    code, out, _ = run(capsys, "config", "set", "max_lease_ms", "5000", "--target", t, "--json")
    assert code == 0 and json.loads(out) == {"name": "max_lease_ms", "value": "5000", "previous": "600000"}
    assert run(capsys, "config", "get", "max_lease_ms", "--target", t)[1].strip() == "5000"
    code, out, _ = run(capsys, "info", "config", "--json", "--target", t)
    info = json.loads(out)["config"]
    assert info["max_lease_ms"] == "5000"
    assert (info["host_capacity"], info["host_capacity_human"]) == (str(16 << 20), "16.00MiB")

    code, _, err = run(capsys, "config", "set", "host_capacity", "1GiB", "--target", t)
    assert code == 1 and "restart" in err
    code, _, err = run(capsys, "config", "set", "max_lease_ms", "0", "--target", t)
    assert code == 1 and "out of bounds" in err
    code, _, err = run(capsys, "config", "set", "no_such_thing", "1", "--target", t)
    assert code == 1 and "unknown setting" in err


def test_config_validate(tmp_path: Path, capsys):
    good = tmp_path / "good.toml"
    good.write_text('[kvstore]\nhost_capacity = "64MiB"\nmetrics_listen = "off"\n')
    code, out, _ = run(capsys, "config", "validate", str(good), "--json")
    data = json.loads(out)
    assert code == 0 and data["valid"] and data["config"]["host_capacity"] == str(64 << 20)
    code, out, _ = run(capsys, "config", "validate", str(good))
    assert code == 0 and "valid" in out and "file" in out

    bad = tmp_path / "bad.toml"
    bad.write_text('max_lease_ms = 0\n')
    code, out, _ = run(capsys, "config", "validate", str(bad))
    assert code == 1 and "max_lease_ms" in out and "out of bounds" in out
    remote = tmp_path / "remote.toml"
    remote.write_text('metrics_listen = "0.0.0.0:9464"\n')
    code, out, _ = run(capsys, "config", "validate", str(remote), "--json")
    assert code == 1 and "metrics-remote" in json.loads(out)["error"]


def test_unreachable_daemon_exits_1(tmp_path: Path, capsys):
    target = f"unix:{tmp_path / 'nobody.sock'}"
    code, _, err = run(capsys, "stats", "--target", target, "--timeout", "2")
    assert code == 1 and "unavailable" in err
    code, out, _ = run(capsys, "health", "--target", target, "--timeout", "2", "--json")
    assert code == 1 and json.loads(out)["status"] == "UNREACHABLE"


def test_health_serving(daemon_thread, capsys):
    code, out, _ = run(capsys, "health", "--target", daemon_thread.unix_target, "--json")
    assert code == 0 and json.loads(out)["status"] == "SERVING"


def test_export_then_import_warms_a_node(daemon_thread, layout, capsys, tmp_path):
    t = daemon_thread.tcp_target
    tokens = list(range(layout.block_size_tokens * 5))
    blocks = [os.urandom(layout.bytes_per_block) for _ in range(5)]
    with Client(t) as kv:
        kv.put(layout, tokens, blocks)
        kv.put(layout, tokens[:8] + [9] * 4, [os.urandom(layout.bytes_per_block)], first_block=2)  # a branch
        ns = kv.lookup(layout, tokens).namespace_id.hex()
    path = tmp_path / "ns.kvx"
    code, out, _ = run(capsys, "export", ns, str(path), "--target", t, "--json")
    assert code == 0 and json.loads(out)["blocks"] == 6
    assert run(capsys, "flush", "--yes", "--target", t)[0] == 0

    code, out, _ = run(capsys, "import", str(path), "--target", t, "--json")
    assert code == 0
    assert json.loads(out) == {"file": str(path), "namespace_id": ns, "blocks": 6, "stored": 6, "existing": 0}
    with Client(t) as kv:
        assert kv.fetch(layout, tokens) == blocks
        assert kv.lookup(layout, tokens[:8] + [9] * 4).num_blocks == 3
    code, out, _ = run(capsys, "import", str(path), "--target", t)
    assert code == 0 and "0 stored, 6 already present" in out


def test_import_refuses_damaged_files(daemon_thread, layout, capsys, tmp_path):
    t = daemon_thread.tcp_target
    tokens = list(range(layout.block_size_tokens * 3))
    with Client(t) as kv:
        kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(3)])
        ns = kv.lookup(layout, tokens).namespace_id.hex()
    good = tmp_path / "ns.kvx"
    assert run(capsys, "export", ns, str(good), "--target", t)[0] == 0
    assert run(capsys, "flush", "--yes", "--target", t)[0] == 0
    data = good.read_bytes()

    flipped = tmp_path / "flipped.kvx"
    flipped.write_bytes(data[:-20] + bytes([data[-20] ^ 1]) + data[-19:])  # inside the last payload
    code, _, err = run(capsys, "import", str(flipped), "--target", t)
    assert code == 1 and "fails its checksum" in err
    with Client(t) as kv:  # the two blocks before the damage verified and were kept
        assert kv.lookup(layout, tokens).num_blocks == 2

    truncated = tmp_path / "truncated.kvx"
    truncated.write_bytes(data[:-5])
    code, _, err = run(capsys, "import", str(truncated), "--target", t)
    assert code == 1 and "truncated" in err
    code, _, err = run(capsys, "import", str(tmp_path / "missing.kvx"), "--target", t)
    assert code == 1


def test_stats_table_shows_fields_of_newer_daemons():
    from kvstore.cli.ops import format_stats

    tier = {"name": "ssd", "present": True, "reason": "", "capacity_bytes": 1 << 30, "used_bytes": 1 << 29,
            "blocks": 10, "hits": 3, "misses": 1, "evictions": 0, "checksum_failures": 0, "policy": "lru",
            "promotions": 4, "demotions": 7, "drops": 2, "pending_writes": 5, "io_mode": "direct",
            "facts": {"regions": "8"}}
    counters = dict.fromkeys(("lookups", "lookup_blocks", "hit_blocks", "puts", "put_failures", "blocks_stored",
                              "blocks_fetched", "bytes_in", "bytes_out", "evictions", "checksum_failures",
                              "leases_active"), 0)
    text = format_stats({"tiers": [tier], "counters": counters, "namespaces": 0, "uptime_s": 1.0, "version": "x"})
    header = next(line for line in text.splitlines() if "TIER" in line)
    assert "PENDING_WRITES" in header and "IO_MODE" in header and "FACTS" not in header
    cells = [c.strip() for c in next(line for line in text.splitlines() if " ssd " in line).split("|")]
    assert cells[cells.index("ssd") + 9 : cells.index("ssd") + 14] == ["4", "7", "0", "2", "0"]
    assert cells[-3:-1] == ["5", "direct"]


def test_events_command(loaded, capsys):
    d, hit = loaded
    code, out, _ = run(capsys, "events", "--snapshot", "--count", "1", "--target", d.tcp_target)
    (line,) = out.splitlines()
    event = json.loads(line)
    assert code == 0 and event["kind"] == "stored" and event["namespace_id"] == hit.namespace_id.hex()
    assert sorted(event["block_hashes"]) == sorted(h.hex() for h in hit.block_hashes)
    code, out, _ = run(capsys, "events", "--duration", "0.3", "--target", d.tcp_target)  # nothing happens
    assert (code, out) == (0, "")


def test_hint_budget_changes_live(daemon_thread, capsys):
    t = daemon_thread.tcp_target
    code, out, _ = run(capsys, "config", "set", "hint_budget", "0.25", "--target", t, "--json")
    assert code == 0 and json.loads(out)["value"] == "0.25"
    policy = daemon_thread.store.tiers[0].policy
    assert getattr(policy, "budget_fraction", 0.25) == 0.25  # hint-aware policies take it at once
    code, _, err = run(capsys, "config", "set", "hint_budget", "1.5", "--target", t)
    assert code == 1 and "out of bounds [0, 1]" in err
