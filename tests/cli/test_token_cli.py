"""`kvstore token new` grants what a tenant's engines need: `--local-plane` (the
shared-memory plane on the daemon's host) and `--quota`, in an entry the daemon accepts;
a real daemon then serves that tenant's co-located client through shared memory, and a
tenant without the grant through gRPC, with a warning that says how to grant it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from conftest import SMALL_LAYOUT, daemon_in_thread, make_config

from kvstore.cli.main import main
from kvstore.client import Client
from kvstore.server.auth import parse_token_file


def _new(capsys: pytest.CaptureFixture[str], path: Path, *args: str) -> str:
    assert main(["token", "new", "--file", str(path), "--json", *args]) == 0
    return str(json.loads(capsys.readouterr().out)["token"])


def test_token_new_grants_the_local_plane_and_quotas(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens.toml"
    ops = _new(capsys, path, "--tenant", "ops", "--role", "admin", "--local-plane")
    engine = _new(capsys, path, "--tenant", "engine", "--local-plane", "--quota", "host=8MiB,ssd=1GiB")
    plain = _new(capsys, path, "--tenant", "plain")
    table = parse_token_file(str(path))
    granted = table.authenticate(engine)
    assert granted is not None and granted.local_plane and dict(granted.quota) == {"host": 8 << 20, "ssd": 1 << 30}
    other = table.authenticate(plain)
    assert other is not None and not other.local_plane and not other.quota
    assert table.authenticate(ops) is not None
    tokens, blocks = list(range(8)), [bytes([i]) * SMALL_LAYOUT.bytes_per_block for i in range(2)]
    with daemon_in_thread(make_config(tmp_path, auth_token_file=str(path))) as running:
        with Client(running.unix_target, token=engine) as kv:
            assert kv.data_plane_in_use == "local"
            assert kv.put(SMALL_LAYOUT, tokens, blocks).stored == 2
        with caplog.at_level(logging.WARNING, logger="kvstore.client"), Client(running.unix_target,
                                                                               token=plain) as kv:
            assert kv.data_plane_in_use == "grpc"
            assert [bytes(b) for b in kv.fetch(SMALL_LAYOUT, tokens)] == []  # another tenant's blocks: a miss
        assert "local_plane = true" in caplog.text  # said once, at WARNING, with the fix


def test_token_new_refuses_a_malformed_grant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tokens.toml"
    for bad in (["--quota", "gpu=1GiB"], ["--quota", "host"], ["--quota", "host=lots"],
                ["--role", "peer", "--local-plane"]):
        assert main(["token", "new", "--tenant", "t", "--file", str(path), *bad]) == 2, bad
        assert "kvstore token new:" in capsys.readouterr().err
    assert not os.path.exists(path)  # nothing written
    assert main(["token", "new", "--tenant", "t"]) == 0
    assert "no local_plane" in capsys.readouterr().out


def test_a_daemon_token_file_given_as_a_client_token_file_is_named(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.errors import InvalidArgument

    path = tmp_path / "tokens.toml"
    _new(capsys, path, "--tenant", "engine")
    with pytest.raises(InvalidArgument, match="daemon's token file"):
        Client("unix:/nonexistent.sock", token_file=str(path))
