"""Tenancy and authentication against the real daemon: bearer tokens from a token file,
roles, tenant-salted namespaces, per-tenant quotas, reload, and the exposure rules."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from conftest import daemon_in_thread, make_config

from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.convert import layout_to_proto
from kvstore.errors import (
    ConfigError,
    FailedPrecondition,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from kvstore.hashing import block_hashes, tenant_namespace_id
from kvstore.server.auth import hash_token, new_token, parse_token_file
from kvstore.server.config import load_config
from kvstore.server.daemon import Daemon
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc


def blocks_for(layout, n, seed=0):
    return [bytes([(seed + i) % 251]) * layout.bytes_per_block for i in range(n)]


class Tenants:
    """Writes a token file; `token(name)` is the plain token each tenant was given."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tokens: dict[str, str] = {}
        self.entries: list[str] = []

    def add(self, name: str, role: str = "client", extra: str = "") -> str:
        token, token_hash = new_token()
        self.tokens[name] = token
        self.entries.append(f'[[tenant]]\nname = "{name}"\nrole = "{role}"\ntokens = ["{token_hash}"]\n{extra}')
        self.write()
        return token

    def write(self) -> None:
        self.path.write_text("\n".join(self.entries))
        os.chmod(self.path, 0o600)


@pytest.fixture
def tenants(tmp_path: Path) -> Tenants:
    t = Tenants(tmp_path / "tokens.toml")
    t.add("ops", "admin")
    t.add("alpha", extra="local_plane = true\n")
    t.add("beta")
    t.add("small", extra='quota = { host = "4KiB" }\n')
    return t


@pytest.fixture
def auth_daemon(tmp_path, tenants):
    with daemon_in_thread(make_config(tmp_path, auth_token_file=str(tenants.path))) as running:
        yield running


# ------------------------------------------------------------------ the token file


def test_token_file_round_trip(tenants):
    table = parse_token_file(str(tenants.path))
    assert table.authenticate(tenants.tokens["alpha"]).tenant == "alpha"
    assert table.authenticate(tenants.tokens["ops"]).role == "admin"
    assert table.authenticate("kvs_not-a-token") is None
    assert table.authenticate(tenants.tokens["alpha"] + "x") is None
    assert table.quotas() == {"small": {"host": 4096}}
    # The file holds no plain token.
    text = tenants.path.read_text()
    assert all(tok not in text for tok in tenants.tokens.values())


def test_a_tenant_may_have_several_tokens_for_rotation(tmp_path):
    (old, old_hash), (new, new_hash) = new_token(), new_token()
    path = tmp_path / "t.toml"
    path.write_text(f'[[tenant]]\nname = "a"\ntokens = ["{old_hash}", "{new_hash}"]\n')
    os.chmod(path, 0o600)
    table = parse_token_file(str(path))
    assert table.authenticate(old).tenant == table.authenticate(new).tenant == "a"
    path.write_text(f'[[tenant]]\nname = "a"\ntokens = ["{new_hash}"]\n')  # the old one retired
    table = parse_token_file(str(path))
    assert table.authenticate(old) is None and table.authenticate(new).tenant == "a"


def test_token_hash_is_salted():
    a, b = hash_token("same"), hash_token("same")
    assert a != b and a.startswith("sha256:")


@pytest.mark.parametrize(
    "body, match",
    [
        ('[[tenant]]\nname = "a"\nrole = "root"\ntokens = ["{h}"]\n', "role must be one of"),
        ('[[tenant]]\nname = "a b"\ntokens = ["{h}"]\n', "name must be"),
        ('[[tenant]]\nname = "a"\ntokens = ["kvs_plaintext"]\n', "never put a plain token"),
        ('[[tenant]]\nname = "a"\ntokens = []\n', "has no tokens"),
        ('[[tenant]]\nname = "a"\ntokens = ["{h}"]\nquota = {{ gpu = "1GiB" }}\n', "quota names tier"),
        ('[[tenant]]\nname = "a"\ntokens = ["{h}"]\n[[tenant]]\nname = "a"\ntokens = ["{h}"]\n', "appears twice"),
        ('[[tenant]]\nname = "a"\ntokens = ["{h}"]\n[[tenant]]\nname = "b"\nsalt = "a"\ntokens = ["{h}"]\n',
         "would share blocks"),
        ('allow = 1\n', "unknown key"),
    ],
)
def test_bad_token_files_are_refused(tmp_path, body, match):
    path = tmp_path / "t.toml"
    path.write_text(body.format(h=hash_token("x")))
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match=match):
        parse_token_file(str(path))


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620, 0o606])
def test_token_file_open_to_other_users_is_refused(tenants, mode):
    os.chmod(tenants.path, mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        parse_token_file(str(tenants.path))


def test_token_file_readable_by_its_group_is_warned_about(tenants, caplog):
    os.chmod(tenants.path, 0o440)  # a Kubernetes Secret mounted with fsGroup
    assert parse_token_file(str(tenants.path)).authenticate(tenants.tokens["alpha"]) is not None
    assert "readable by its group" in caplog.text


def test_token_new_cli_prints_a_working_entry(tmp_path, capsys):
    import json

    from kvstore.cli.main import main

    assert main(["token", "new", "--tenant", "team-a", "--role", "admin", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    path = tmp_path / "t.toml"
    path.write_text(out["entry"])
    os.chmod(path, 0o600)
    identity = parse_token_file(str(path)).authenticate(out["token"])
    assert identity is not None and identity.tenant == "team-a" and identity.role == "admin"
    assert main(["token", "new", "--tenant", "bad name"]) == 2


# ------------------------------------------------------------------ exposure rules


def test_non_loopback_listen_needs_a_token_file_and_tls(tmp_path, tenants):
    base = make_config(tmp_path, listen=("0.0.0.0:0",))
    with pytest.raises(ConfigError, match="auth-token-file"):
        Daemon(base)
    with pytest.raises(ConfigError, match="tls-cert"):
        Daemon(replace(base, auth_token_file=str(tenants.path)))
    # An explicit opt-out of TLS is accepted (the daemon is only built here, not started).
    Daemon(replace(base, auth_token_file=str(tenants.path), insecure_remote=True))
    # Loopback and Unix sockets stay open without a token file, as before.
    Daemon(make_config(tmp_path))


def test_a_daemon_with_a_bad_token_file_does_not_start(tmp_path, tenants):
    os.chmod(tenants.path, 0o604)
    with pytest.raises(ConfigError, match="accessible to other users"):
        Daemon(make_config(tmp_path, auth_token_file=str(tenants.path)))


def test_allow_remote_is_refused_with_what_replaced_it(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("allow_remote = true\n")
    with pytest.raises(ConfigError, match="auth_token_file.*metrics_remote"):
        load_config({"config": str(path)}, env={})
    with pytest.raises(ConfigError, match="replaced"):
        load_config({}, env={"KVSTORE_ALLOW_REMOTE": "1"})


def test_allow_remote_flag_says_what_replaced_it(capsys):
    from kvstore.cli.main import main

    assert main(["serve", "--allow-remote"]) == 2
    assert "allow_remote was replaced" in capsys.readouterr().err


# ------------------------------------------------------------------ authentication and roles


def test_calls_need_a_valid_token(auth_daemon, layout, tenants):
    for target in (auth_daemon.unix_target, auth_daemon.tcp_target):
        with Client(target, data_plane="grpc") as anon:
            with pytest.raises(Unauthenticated, match="requires a token"):
                anon.lookup(layout, list(range(8)))
        with Client(target, token="kvs_wrong", data_plane="grpc") as wrong:
            with pytest.raises(Unauthenticated, match="not valid"):
                wrong.lookup(layout, list(range(8)))
        with Client(target, token=tenants.tokens["alpha"], data_plane="grpc") as ok:
            assert ok.lookup(layout, list(range(8))).num_blocks == 0
    # Refused calls are counted by status in the metrics (no tenant names there).
    import urllib.request

    with urllib.request.urlopen(f"http://{auth_daemon.daemon.metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'kvstore_rpc_duration_seconds_count{code="UNAUTHENTICATED",method="Lookup"}' in text
    assert "alpha" not in text and "beta" not in text


def test_health_needs_no_token(auth_daemon, capsys):
    from kvstore.cli.main import main

    assert main(["health", "--target", auth_daemon.unix_target]) == 0


def test_admin_rpcs_need_the_admin_role(auth_daemon, tenants):
    with AdminClient(auth_daemon.unix_target, token=tenants.tokens["alpha"]) as client_role:
        with pytest.raises(PermissionDenied, match="admin role"):
            client_role.stats()
        with pytest.raises(PermissionDenied):
            client_role.flush()
    with AdminClient(auth_daemon.unix_target, token=tenants.tokens["ops"]) as admin:
        assert admin.stats().tiers


def test_cli_reads_the_token_from_a_file_or_the_environment(auth_daemon, tenants, tmp_path, capsys, monkeypatch):
    from kvstore.cli.main import main

    token_file = tmp_path / "ops.token"
    token_file.write_text(tenants.tokens["ops"] + "\n")
    assert main(["stats", "--target", auth_daemon.unix_target, "--json"]) == 1
    assert "requires a token" in capsys.readouterr().err
    assert main(["stats", "--target", auth_daemon.unix_target, "--json", "--token-file", str(token_file)]) == 0
    capsys.readouterr()
    monkeypatch.setenv("KVSTORE_TOKEN", tenants.tokens["beta"])
    assert main(["stats", "--target", auth_daemon.unix_target]) == 1
    assert "admin role" in capsys.readouterr().err


# ------------------------------------------------------------------ tenant isolation


def test_tenants_never_see_or_touch_each_others_blocks(auth_daemon, layout, tenants):
    target = auth_daemon.unix_target
    tokens = list(range(16))
    a_blocks, b_blocks = blocks_for(layout, 4, seed=1), blocks_for(layout, 4, seed=100)
    with Client(target, token=tenants.tokens["alpha"], data_plane="grpc") as a, \
         Client(target, token=tenants.tokens["beta"], data_plane="grpc") as b:
        assert a.put(layout, tokens, a_blocks).stored == 4
        hit = a.lookup(layout, tokens)
        assert hit.num_blocks == 4
        # Same layout, same tokens: beta has no hits, and its own put stores new blocks.
        assert b.lookup(layout, tokens).num_blocks == 0
        assert b.put(layout, tokens, b_blocks).stored == 4
        assert [bytes(x) for x in a.fetch(layout, tokens)] == a_blocks
        assert [bytes(x) for x in b.fetch(layout, tokens)] == b_blocks
        # The block hashes are the public ones (clients compute the same), the ids differ.
        public = layout.namespace_id
        assert hit.block_hashes == block_hashes(public, tokens, layout.block_size_tokens)
        assert hit.namespace_id == tenant_namespace_id(public, b"alpha") != b.lookup(layout, tokens).namespace_id
        # Beta deleting "the same" blocks deletes its own only.
        assert b.delete(layout, tokens) == 4
        assert a.lookup(layout, tokens).num_blocks == 4
        # Naming alpha's namespace by id does not reach it: it reads as unknown.
        channel = grpc.insecure_channel(target)
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        md = (("authorization", f"Bearer {tenants.tokens['beta']}"),)
        ref = kvstore_pb2.Namespace(id=hit.namespace_id)
        keys = kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=hit.block_hashes))
        for call, request in (
            (stub.Lookup, kvstore_pb2.LookupRequest(namespace=ref, keys=keys)),
            (stub.Delete, kvstore_pb2.DeleteRequest(namespace=ref, keys=keys)),
            (stub.Pin, kvstore_pb2.PinRequest(namespace=ref, keys=keys)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(request, metadata=md)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "not known" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Fetch(kvstore_pb2.FetchRequest(namespace=ref, keys=keys), metadata=md))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        channel.close()
        assert [bytes(x) for x in a.fetch(layout, tokens)] == a_blocks
    # The admin sees both namespaces with their tenants, and may name any by id.
    with AdminClient(target, token=tenants.tokens["ops"]) as admin:
        owners = {ns.namespace_id: ns.tenant for ns in admin.list_namespaces()}
        assert owners[hit.namespace_id] == "alpha" and "beta" in owners.values()
        assert admin.fetch_blocks(hit.namespace_id, hit.block_hashes) == a_blocks
        assert "tenant_alpha:" in admin.info("tenants")


def test_without_a_token_file_namespace_ids_are_the_public_ones(daemon_thread, layout):
    with Client(daemon_thread.unix_target, data_plane="grpc") as kv:
        kv.put(layout, list(range(8)), blocks_for(layout, 2))
        assert kv.lookup(layout, list(range(8))).namespace_id == layout.namespace_id
    with AdminClient(daemon_thread.unix_target) as admin:
        assert [ns.tenant for ns in admin.list_namespaces()] == ["default"]


def test_local_plane_is_only_for_tenants_allowed_it(auth_daemon, layout, tenants):
    target = auth_daemon.unix_target
    with Client(target, token=tenants.tokens["beta"], data_plane="local") as beta:
        with pytest.raises(FailedPrecondition, match="local_plane = false"):
            beta.put(layout, list(range(8)), blocks_for(layout, 2))
    with Client(target, token=tenants.tokens["beta"]) as beta_auto:  # falls back to gRPC
        assert beta_auto.put(layout, list(range(8)), blocks_for(layout, 2)).stored == 2
        assert beta_auto.data_plane_in_use == "grpc"
    with Client(target, token=tenants.tokens["alpha"], data_plane="local") as alpha:
        data = blocks_for(layout, 2, seed=7)
        assert alpha.put(layout, list(range(8)), data).stored == 2
        assert [bytes(x) for x in alpha.fetch(layout, list(range(8)))] == data


def test_a_local_put_can_only_be_committed_by_its_tenant(tmp_path, layout, tenants):
    tenants.entries[2] = tenants.entries[2] + "local_plane = true\n"  # beta may use the plane too
    tenants.write()
    with daemon_in_thread(make_config(tmp_path, auth_token_file=str(tenants.path))) as running, \
            grpc.insecure_channel(running.unix_target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        alpha = (("authorization", f"Bearer {tenants.tokens['alpha']}"),)
        beta = (("authorization", f"Bearer {tenants.tokens['beta']}"),)
        header = kvstore_pb2.PutHeader(
            namespace=kvstore_pb2.Namespace(layout=layout_to_proto(layout)),
            keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=list(range(8)))),
        )
        begun = stub.LocalPut(kvstore_pb2.LocalPutRequest(header=header), metadata=alpha)
        with pytest.raises(grpc.RpcError) as err:
            stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True), metadata=beta)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not open" in err.value.details()
        # Still open for its owner.
        assert stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True), metadata=alpha)


# ------------------------------------------------------------------ quotas


def test_quota_evicts_the_tenants_own_blocks_then_refuses(auth_daemon, layout, tenants):
    target = auth_daemon.unix_target
    store = auth_daemon.store
    with Client(target, token=tenants.tokens["small"], data_plane="grpc") as small, \
         Client(target, token=tenants.tokens["beta"], data_plane="grpc") as beta:
        beta_tokens = list(range(1000, 1024))
        assert beta.put(layout, beta_tokens, blocks_for(layout, 6)).stored == 6
        first, second = list(range(12)), list(range(100, 112))
        assert small.put(layout, first, blocks_for(layout, 3)).stored == 3
        assert store.tenancy.usage("small") == {"host": 3 * 1024}
        # 3 more blocks would make 6 KiB against a 4 KiB quota: two of its own older blocks go.
        assert small.put(layout, second, blocks_for(layout, 3, seed=50)).stored == 3
        assert store.tenancy.usage("small") == {"host": 4 * 1024}
        assert small.lookup(layout, second).num_blocks == 3
        assert small.lookup(layout, first).num_blocks < 3
        # Nobody else paid for it.
        assert beta.lookup(layout, beta_tokens).num_blocks == 6
        # With everything it holds pinned, the next put is refused and changes nothing.
        kept = [t for t in (first, second) if small.lookup(layout, t).num_blocks]
        for t in kept:
            small.pin(layout, t, ttl_ms=60_000)
        before = store.tenancy.usage("small")
        with pytest.raises(ResourceExhausted, match=r"tenant 'small' is at its host quota: 4096 of 4096 bytes"):
            small.put(layout, list(range(200, 204)), blocks_for(layout, 1))
        assert small.lookup(layout, list(range(200, 204))).num_blocks == 0
        assert store.tenancy.usage("small") == before
        # A put larger than the whole quota says so.
        with pytest.raises(ResourceExhausted, match="more than the tenant's whole host quota"):
            small.put(layout, list(range(300, 320)), blocks_for(layout, 5))


def test_usage_returns_to_zero_after_delete_and_flush(auth_daemon, layout, tenants):
    store = auth_daemon.store
    with Client(auth_daemon.unix_target, token=tenants.tokens["alpha"], data_plane="grpc") as alpha:
        alpha.put(layout, list(range(16)), blocks_for(layout, 4))
        assert store.tenancy.usage("alpha") == {"host": 4 * 1024}
        assert alpha.delete(layout, list(range(16))) == 4
        assert store.tenancy.usage("alpha") == {}
        alpha.put(layout, list(range(16)), blocks_for(layout, 4))
        ns = alpha.lookup(layout, list(range(4))).namespace_id
    with AdminClient(auth_daemon.unix_target, token=tenants.tokens["ops"]) as admin:
        assert admin.flush(ns).blocks == 4
    assert store.tenancy.usage("alpha") == {}


# ------------------------------------------------------------------ reload


def test_reload_picks_up_new_tokens_and_keeps_the_old_table_on_a_broken_file(tmp_path, layout, tenants, caplog):
    cfg = make_config(tmp_path, auth_token_file=str(tenants.path))
    with daemon_in_thread(cfg) as running:
        d = running.daemon
        gamma = tenants.add("gamma")
        with Client(running.unix_target, token=gamma, data_plane="grpc") as kv:
            with pytest.raises(Unauthenticated):
                kv.lookup(layout, list(range(4)))
            assert d.reload_tokens()
            assert kv.lookup(layout, list(range(4))).num_blocks == 0
            tenants.path.write_text("[[tenant]]\nname = 'broken'\n")
            assert not d.reload_tokens()
            assert "token file reload failed" in caplog.text
            assert kv.lookup(layout, list(range(4))).num_blocks == 0  # the old table stays


def test_sighup_reloads_the_token_file(tmp_path, layout, tenants):
    import signal
    import subprocess
    import sys
    import time

    sock = tmp_path / "hup.sock"
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "server.py", "--listen", f"unix:{sock}", "--auth-token-file", str(tenants.path),
         "--metrics-listen", "off", "--host-capacity", "16MiB", "--no-host-prefault", "--shm-dir", str(tmp_path)],
        cwd=Path(__file__).resolve().parents[2], stderr=log, stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
            assert time.monotonic() < deadline, "daemon did not start"
            time.sleep(0.1)
        delta = tenants.add("delta")
        with Client(f"unix:{sock}", token=delta, data_plane="grpc") as kv:
            with pytest.raises(Unauthenticated):
                kv.lookup(layout, list(range(4)))
            proc.send_signal(signal.SIGHUP)
            while True:  # waits for the reload to happen; never passes on timing alone
                try:
                    assert kv.lookup(layout, list(range(4))).num_blocks == 0
                    break
                except Unauthenticated:
                    assert time.monotonic() < deadline, "SIGHUP did not reload the token file"
                    time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert "token file reloaded" in (tmp_path / "daemon.log").read_text()


# ------------------------------------------------------------------ defaults


def test_shared_memory_segment_and_socket_are_private(daemon_thread):
    sock = daemon_thread.unix_target[len("unix:"):]
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    seg = daemon_thread.daemon.store.tiers[0].tier.segment.path
    assert stat.S_IMODE(os.stat(seg).st_mode) == 0o600


def test_no_pickle_or_eval_in_the_package():
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for package in ("kvstore", "tiers", "client"):
        for path in (root / package).rglob("*.py"):
            if "/v1/" in str(path):
                continue
            text = path.read_text()
            for needle in ("import pickle", "pickle.", "eval(", "exec("):
                if needle in text:
                    offenders.append(f"{path.relative_to(root)}: {needle}")
    assert offenders == []



def test_export_by_an_admin_imports_under_the_importing_tenant(auth_daemon, layout, tenants, tmp_path):
    import io

    from kvstore.client.export import export_namespace, import_namespace

    target = auth_daemon.unix_target
    tokens = list(range(12))
    data = blocks_for(layout, 3, seed=9)
    with Client(target, token=tenants.tokens["alpha"], data_plane="grpc") as alpha:
        alpha.put(layout, tokens, data)
        ns = alpha.lookup(layout, tokens).namespace_id
    buf = io.BytesIO()
    with AdminClient(target, token=tenants.tokens["ops"]) as admin:
        assert export_namespace(admin, ns, buf).blocks == 3
    buf.seek(0)
    with AdminClient(target, token=tenants.tokens["beta"]) as beta_admin_client:
        assert import_namespace(beta_admin_client, buf).stored == 3
    with Client(target, token=tenants.tokens["beta"], data_plane="grpc") as beta:
        assert [bytes(x) for x in beta.fetch(layout, tokens)] == data
        assert beta.lookup(layout, tokens).namespace_id not in (ns, layout.namespace_id)


def _wait(condition, what: str) -> None:
    import time

    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_ssd_quota_and_usage_across_write_through_delete_and_restart(tmp_path, layout, tenants):
    tenants.add("disk", extra='quota = { ssd = "2KiB" }\n')
    cfg = make_config(tmp_path, auth_token_file=str(tenants.path), ssd_path=str(tmp_path / "ssd"),
                      ssd_capacity=8 << 20, ssd_region_size=1 << 20, ssd_io="buffered")
    first, second = list(range(16)), list(range(100, 108))
    with daemon_in_thread(cfg) as running:
        store = running.store
        with Client(running.unix_target, token=tenants.tokens["disk"], data_plane="grpc") as disk:
            assert disk.put(layout, first, blocks_for(layout, 4)).stored == 4
            _wait(lambda: store.pending_ssd_writes == 0, "SSD writes did not finish")
            # Write-through stops at the tenant's SSD quota; the rest stays in memory only.
            assert store.tenancy.usage("disk") == {"host": 4096, "ssd": 2048}
            assert disk.delete(layout, first) == 4
            assert store.tenancy.usage("disk") == {}
            assert disk.put(layout, second, blocks_for(layout, 2, seed=3)).stored == 2
            _wait(lambda: store.pending_ssd_writes == 0, "SSD writes did not finish")
            assert store.tenancy.usage("disk") == {"host": 2048, "ssd": 2048}
    # After a restart the recovered SSD blocks count again once the tenant names its layout.
    with daemon_in_thread(cfg) as running:
        with Client(running.unix_target, token=tenants.tokens["disk"], data_plane="grpc") as disk:
            assert disk.lookup(layout, second).num_blocks == 2
            usage = running.store.tenancy.usage("disk")
            assert usage.get("ssd") == 2048
            assert disk.delete(layout, second) == 2
            assert running.store.tenancy.usage("disk") == {}


def test_unix_socket_peers_may_act_as_a_named_tenant(tmp_path, layout, tenants):
    cfg = make_config(tmp_path, auth_token_file=str(tenants.path), unix_socket_tenant="alpha")
    with daemon_in_thread(cfg) as running:
        data = blocks_for(layout, 2, seed=4)
        with Client(running.unix_target, data_plane="grpc") as local:  # no token
            assert local.put(layout, list(range(8)), data).stored == 2
        with Client(running.tcp_target, data_plane="grpc") as tcp_anon:
            with pytest.raises(Unauthenticated):
                tcp_anon.lookup(layout, list(range(8)))
        with Client(running.tcp_target, token=tenants.tokens["alpha"], data_plane="grpc") as alpha:
            assert [bytes(x) for x in alpha.fetch(layout, list(range(8)))] == data
        # A token on the socket still decides: beta sees none of alpha's blocks.
        with Client(running.unix_target, token=tenants.tokens["beta"], data_plane="grpc") as beta:
            assert beta.lookup(layout, list(range(8))).num_blocks == 0
        with AdminClient(running.unix_target) as admin_anon:
            with pytest.raises(PermissionDenied):  # alpha is a client
                admin_anon.stats()
    with pytest.raises(ConfigError, match="not a tenant"):
        Daemon(make_config(tmp_path, auth_token_file=str(tenants.path), unix_socket_tenant="nobody"))
    with pytest.raises(ConfigError, match="set auth_token_file"):
        load_config({"unix_socket_tenant": "alpha"}, env={})


def test_a_tenant_cannot_end_another_tenants_lease(auth_daemon, layout, tenants):
    target = auth_daemon.unix_target
    tokens = list(range(8))
    with Client(target, token=tenants.tokens["alpha"], data_plane="grpc") as alpha, \
         Client(target, token=tenants.tokens["beta"], data_plane="grpc") as beta:
        alpha.put(layout, tokens, blocks_for(layout, 2))
        pin = alpha.pin(layout, tokens, ttl_ms=60_000)
        assert pin.pinned == 2
        assert not beta.unpin(pin.lease_id)
        assert not beta.unpin(pin.lease_id.rpartition(".")[0] + ".é")  # a malformed tag is just not a lease
        assert auth_daemon.store.stats().leases_active == 1  # still held
        assert alpha.unpin(pin.lease_id)
        assert auth_daemon.store.stats().leases_active == 0
        # A fetch ends the lease its lookup took, and only the caller's own.
        leased = alpha.lookup(layout, tokens, lease_ms=60_000)
        assert auth_daemon.store.stats().leases_active == 1
        beta.fetch(layout, tokens, lease_id=leased.lease_id)
        assert auth_daemon.store.stats().leases_active == 1
        alpha.fetch(layout, tokens, lease_id=leased.lease_id)
        assert auth_daemon.store.stats().leases_active == 0
        # Admins may end any lease (kvstore unpin).
        pin = alpha.pin(layout, tokens, ttl_ms=60_000)
    with AdminClient(target, token=tenants.tokens["ops"]) as admin:
        assert admin.unpin(pin.lease_id)


def test_namespaces_per_tenant_are_capped(tmp_path, layout, tenants):
    cfg = make_config(tmp_path, auth_token_file=str(tenants.path), max_namespaces_per_tenant=2)
    layouts = [replace(layout, model=f"test/m{i}") for i in range(3)]
    with daemon_in_thread(cfg) as running:
        with Client(running.unix_target, token=tenants.tokens["alpha"], data_plane="grpc") as alpha, \
             Client(running.unix_target, token=tenants.tokens["beta"], data_plane="grpc") as beta:
            # Puts register namespaces (lookups of unknown layouts are misses and register none).
            for lay in layouts[:2]:
                assert alpha.put(lay, list(range(4)), blocks_for(lay, 1)).stored == 1
            before = len(running.store.namespaces())
            with pytest.raises(ResourceExhausted, match="tenant 'alpha' already holds 2 namespaces"):
                alpha.put(layouts[2], list(range(4)), blocks_for(layouts[2], 1))
            assert len(running.store.namespaces()) == before
            assert alpha.lookup(layouts[2], list(range(4))).num_blocks == 0  # a miss, not an error
            assert alpha.lookup(layouts[0], list(range(4))).num_blocks == 1  # known ones still work
            # Others are not affected.
            assert beta.put(layouts[2], list(range(4)), blocks_for(layouts[2], 1)).stored == 1


def test_leases_per_tenant_are_capped(tmp_path, layout, tenants):
    cfg = make_config(tmp_path, auth_token_file=str(tenants.path), max_leases_per_tenant=2)
    tokens = list(range(8))
    with daemon_in_thread(cfg) as running:
        with Client(running.unix_target, token=tenants.tokens["alpha"], data_plane="grpc") as alpha, \
             Client(running.unix_target, token=tenants.tokens["beta"], data_plane="grpc") as beta:
            alpha.put(layout, tokens, blocks_for(layout, 2))
            beta.put(layout, tokens, blocks_for(layout, 2, seed=5))
            first = alpha.pin(layout, tokens, ttl_ms=60_000)
            assert alpha.lookup(layout, tokens, lease_ms=60_000).lease_id
            assert running.store.stats().leases_active == 2
            with pytest.raises(ResourceExhausted, match=r"tenant 'alpha' has 2 leases active.*max_leases_per_tenant \(2\)"):
                alpha.pin(layout, tokens, ttl_ms=60_000)
            with pytest.raises(ResourceExhausted, match="tenant 'alpha' has 2 leases active"):
                alpha.lookup(layout, tokens, lease_ms=60_000)
            assert running.store.stats().leases_active == 2  # the refusals took nothing
            assert running.store.tenant_leases("alpha") == 2
            # Other tenants are not affected.
            assert beta.pin(layout, tokens, ttl_ms=60_000).pinned == 2
            assert beta.lookup(layout, tokens, lease_ms=60_000).lease_id
            assert running.store.tenant_leases("beta") == 2
            # Ending a lease gives the tenant room again.
            assert alpha.unpin(first.lease_id)
            assert running.store.tenant_leases("alpha") == 1
            assert alpha.pin(layout, tokens, ttl_ms=60_000).pinned == 2


async def test_async_client_sends_its_token(tmp_path, layout, tenants):
    from kvstore.client import AsyncClient

    d = Daemon(make_config(tmp_path, auth_token_file=str(tenants.path)))
    await d.start()
    try:
        data = blocks_for(layout, 3, seed=11)
        async with AsyncClient(d.bound[0], token=tenants.tokens["alpha"]) as alpha:
            assert (await alpha.put(layout, list(range(12)), data)).stored == 3
            hit = await alpha.lookup(layout, list(range(12)), lease_ms=5_000)
            assert hit.num_blocks == 3
            assert [bytes(x) for x in await alpha.fetch(layout, list(range(12)))] == data
        async with AsyncClient(d.bound[1], token=tenants.tokens["beta"], data_plane="grpc") as beta:
            assert (await beta.lookup(layout, list(range(12)))).num_blocks == 0
        async with AsyncClient(d.bound[1], data_plane="grpc") as anon:
            with pytest.raises(Unauthenticated):
                await anon.lookup(layout, list(range(12)))
    finally:
        await d.stop(grace_s=0)


def test_a_token_over_plain_tcp_to_another_host_is_warned_about(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="kvstore.client.security"):
        Client("192.0.2.1:50051", token="kvs_example").close()  # TEST-NET-1: nothing is contacted
        assert "without TLS" in caplog.text
        caplog.clear()
        Client("127.0.0.1:50051", token="kvs_example").close()
        Client("unix:/nonexistent/kv.sock", token="kvs_example").close()
        assert "without TLS" not in caplog.text


def test_session_ids_are_per_tenant(tmp_path, layout, tenants):
    cfg = make_config(tmp_path, auth_token_file=str(tenants.path), host_capacity=8 * layout.bytes_per_block,
                      host_prefault=False, policy="hint-lru", hint_budget=1.0)
    hinted = list(range(8))  # 2 blocks
    with daemon_in_thread(cfg) as running, \
            Client(running.unix_target, token=tenants.tokens["alpha"], data_plane="grpc") as alpha, \
            Client(running.unix_target, token=tenants.tokens["beta"], data_plane="grpc") as beta:
        alpha.put(layout, hinted, blocks_for(layout, 2), session_id="conv-1", expect_reuse_within_s=600)
        beta.end_session("conv-1")  # the same id from another tenant is another session
        for i in range(6):  # 12 of beta's blocks through an 8-block tier
            beta.put(layout, list(range(1000 * (i + 1), 1000 * (i + 1) + 8)), blocks_for(layout, 2, seed=i))
        assert alpha.lookup(layout, hinted).num_blocks == 2
        alpha.end_session("conv-1")
        for i in range(6):
            beta.put(layout, list(range(50_000 * (i + 1), 50_000 * (i + 1) + 8)), blocks_for(layout, 2, seed=i))
        assert alpha.lookup(layout, hinted).num_blocks == 0


def test_serve_help_lists_the_security_flags(capsys):
    from kvstore.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--auth-token-file", "--tls-cert", "--tls-client-ca", "--insecure-remote", "--metrics-remote",
                 "--unix-socket-tenant", "--max-calls-per-tenant", "--max-tokens-per-call"):
        assert flag in out
    assert "saves >= 5%" in out and "--allow-remote" not in out


def test_token_new_can_append_to_the_token_file(tmp_path, capsys):
    import json

    from kvstore.cli.main import main

    path = tmp_path / "tokens.toml"
    assert main(["token", "new", "--tenant", "a", "--file", str(path), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["token"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert main(["token", "new", "--tenant", "b", "--role", "admin", "--file", str(path), "--json"]) == 0
    second = json.loads(capsys.readouterr().out)["token"]
    table = parse_token_file(str(path))
    assert table.authenticate(first).tenant == "a" and table.authenticate(second).role == "admin"
    before = path.read_text()
    assert main(["token", "new", "--tenant", "a", "--file", str(path)]) == 1
    assert "already in" in capsys.readouterr().err and path.read_text() == before
