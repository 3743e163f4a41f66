"""What another local user can do to a daemon and its clients (SECURITY.md, "Who can
reach the daemon"): plant the socket directory, race the socket's creation, plant a
link where `kvstore export` writes, or own the token file.

Each test acts as another uid the way an attacker would: as root it makes files owned
by that uid, or runs a child that drops to it (the child loads its interpreter first,
since the test's own interpreter may live where that uid cannot read).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import make_config

from kvstore.addresses import default_unix_socket
from kvstore.cli.main import main
from kvstore.client import AsyncClient, Client
from kvstore.client.admin import AdminClient
from kvstore.errors import ConfigError, KVStoreError, PermissionDenied, Unauthenticated
from kvstore.server.auth import entry_text, new_token
from kvstore.server.daemon import Daemon

OTHER_UID = 65534  # nobody: stands for any other local user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp (world-writable, sticky) that other users can reach."""
    path = Path(tempfile.mkdtemp(prefix="kvstore-shared-"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def planted_dir(parent: Path, name: str) -> Path:
    """A directory another user made first, open to everyone (`mkdir -m 777`)."""
    path = parent / name
    path.mkdir()
    os.chmod(path, 0o777)
    os.chown(path, OTHER_UID, OTHER_UID)
    return path


async def start_refused(config: Any) -> str:
    """The message of the ConfigError a daemon with `config` refuses to start with."""
    daemon = Daemon(config)
    try:
        await daemon.start()
    except ConfigError as exc:
        return str(exc)
    await daemon.stop(grace_s=0)
    pytest.fail(f"the daemon started on {config.listen}")


# ------------------------------------------------------------------ the socket directory


async def test_daemon_refuses_the_default_socket_directory_another_user_made(shared_tmp, tmp_path, monkeypatch):
    # Without XDG_RUNTIME_DIR the default socket lives in $TMPDIR/kvstore-<uid>/, a name
    # any user can take first.
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    planted = planted_dir(shared_tmp, f"kvstore-{os.getuid()}")
    sock = default_unix_socket()
    assert os.path.dirname(sock) == str(planted)
    message = await start_refused(make_config(tmp_path, listen=(f"unix:{sock}",)))
    assert str(planted) in message and f"uid {OTHER_UID}" in message
    assert os.listdir(planted) == []


async def test_daemon_refuses_a_socket_directory_others_may_write(shared_tmp, tmp_path):
    mine = shared_tmp / "mine"
    mine.mkdir()
    os.chmod(mine, 0o777)  # the daemon's own, but anyone may replace the socket in it
    message = await start_refused(make_config(tmp_path, listen=(f"unix:{mine / 'kv.sock'}",)))
    assert str(mine) in message and "chmod" in message

    # A parent anyone may write (and not sticky): the socket directory could be renamed away.
    parent = shared_tmp / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    (parent / "run").mkdir(mode=0o700)
    message = await start_refused(make_config(tmp_path, listen=(f"unix:{parent / 'run' / 'kv.sock'}",)))
    assert str(parent) in message

    # A sticky world-writable parent, as /tmp, is fine above a directory of the daemon's own.
    daemon = Daemon(make_config(tmp_path, listen=(f"unix:{shared_tmp / 'run' / 'kv.sock'}",)))
    await daemon.start()
    try:
        assert stat.S_IMODE(os.stat(shared_tmp / "run").st_mode) == 0o700
    finally:
        await daemon.stop(grace_s=0)


async def test_a_shared_socket_directory_is_accepted_only_when_configured(shared_tmp, tmp_path):
    # A Kubernetes emptyDir is root-owned and 0777; every container of the pod runs as one uid.
    empty_dir = shared_tmp / "emptydir"
    empty_dir.mkdir()
    os.chmod(empty_dir, 0o777)
    listen = (f"unix:{empty_dir / 'kv.sock'}",)
    assert "unix_socket_shared_dir" in await start_refused(make_config(tmp_path, listen=listen))
    daemon = Daemon(make_config(tmp_path, listen=listen, unix_socket_shared_dir=True))
    await daemon.start()
    await daemon.stop(grace_s=0)
    # Even then, not a directory another user owns.
    planted = planted_dir(shared_tmp, "planted")
    message = await start_refused(make_config(tmp_path, listen=(f"unix:{planted / 'kv.sock'}",),
                                              unix_socket_shared_dir=True))
    assert f"uid {OTHER_UID}" in message


class _Relay(grpc.GenericRpcHandler):
    """What another user would serve on a socket it planted: records each call's metadata
    (a relay would pass the call on to the real daemon; answering none shows enough)."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[str, Any], ...]] = []

    def service(self, handler_call_details: Any) -> None:
        self.seen.append(tuple(handler_call_details.invocation_metadata))
        return None


@pytest.fixture
def relay(shared_tmp) -> Iterator[tuple[Path, _Relay]]:
    """A gRPC server on `<a directory another user made>/kvstore.sock`, its socket file
    owned by that user, and no lane next to it (so the SDK would use gRPC)."""
    sock = planted_dir(shared_tmp, "kvstore-0") / "kvstore.sock"
    handler = _Relay()
    server = grpc.server(ThreadPoolExecutor(2), handlers=[handler])
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    os.chown(sock, OTHER_UID, OTHER_UID)
    try:
        yield sock, handler
    finally:
        server.stop(0).wait()


def _tokens_seen(handler: _Relay) -> list[Any]:
    return [value for md in handler.seen for key, value in md if key == "authorization"]


async def test_sdk_sends_nothing_to_a_socket_another_user_serves(relay):
    sock, handler = relay
    target = f"unix:{sock}"
    errors: list[KVStoreError] = []
    for make in (lambda: Client(target, token="kvs_secret", timeout_s=2),
                 lambda: AdminClient(target, token="kvs_secret", timeout_s=2),
                 lambda: Client(target, timeout_s=2)):
        try:
            with make() as kv:
                kv.stats()
        except KVStoreError as exc:
            errors.append(exc)
    try:
        async with AsyncClient(target, token="kvs_secret", timeout_s=2) as akv:
            await akv.stats()
    except KVStoreError as exc:
        errors.append(exc)
    assert _tokens_seen(handler) == [] and handler.seen == []
    assert len(errors) == 4
    for exc in errors:
        assert isinstance(exc, PermissionDenied), exc
        assert str(sock) in str(exc) and f"uid {OTHER_UID}" in str(exc)


def test_sdk_refuses_its_own_uids_socket_in_a_directory_another_user_owns(relay):
    # The socket is root's, but whoever owns the directory can swap it after any check.
    sock, handler = relay
    os.chown(sock, 0, 0)
    with pytest.raises(PermissionDenied, match=str(sock.parent)):
        with Client(f"unix:{sock}", token="kvs_secret", timeout_s=2) as kv:
            kv.stats()
    assert handler.seen == []


# ------------------------------------------------------------------ the gRPC socket's creation

RACER = """
import os, socket, sys, time
path, stop = sys.argv[1], sys.argv[2]
os.setgroups([]); os.setgid(65534); os.setuid(65534)
print("ready", flush=True)
hits = 0
deadline = time.monotonic() + 120
while not os.path.exists(stop) and time.monotonic() < deadline:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        hits += 1
    except OSError:
        pass
    finally:
        s.close()
print(hits)
"""
STARTS = 12


async def test_grpc_unix_socket_admits_no_other_user_while_it_starts(shared_tmp, tmp_path):
    # A socket directory others may enter (as /run/kvstore with mode 0755) and a permissive
    # umask: only the socket's own mode keeps another user out, from the moment it exists.
    run = shared_tmp / "run"
    run.mkdir()
    os.chmod(run, 0o755)
    sock, stop = run / "kv.sock", shared_tmp / "stop"
    racer = subprocess.Popen([sys.executable, "-c", RACER, str(sock), str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        assert racer.stdout is not None and racer.stdout.readline().strip() == "ready"
        old = os.umask(0)
        try:
            for _ in range(STARTS):
                daemon = Daemon(make_config(tmp_path, listen=(f"unix:{sock}",), metrics_listen="off",
                                            host_prefault=False))
                await daemon.start()
                await daemon.stop(grace_s=0)
        finally:
            os.umask(old)
            stop.touch()
        out, _ = racer.communicate(timeout=60)
    finally:
        if racer.poll() is None:
            racer.kill()
            racer.wait()
    assert int(out.strip()) == 0, f"another user connected {out.strip()} times in {STARTS} starts"


# ------------------------------------------------------------------ kvstore export


@pytest.fixture
def namespace(daemon_thread, layout) -> str:
    tokens = list(range(layout.block_size_tokens * 3))
    with Client(daemon_thread.tcp_target) as kv:
        kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(3)])
        return kv.lookup(layout, tokens).namespace_id.hex()


def test_export_never_follows_a_link_planted_at_its_partial_file(daemon_thread, namespace, shared_tmp, capsys):
    victim = shared_tmp / "victim"  # any file root can write: /etc/shadow, a key, a config
    victim.write_text("precious\n")
    os.chmod(victim, 0o644)
    out = shared_tmp / "ns.kvx"
    planted = Path(f"{out}.partial")
    os.symlink(victim, planted)
    os.lchown(planted, OTHER_UID, OTHER_UID)

    code = main(["export", namespace, str(out), "--target", daemon_thread.tcp_target])
    assert code == 0, capsys.readouterr().err
    assert victim.read_bytes() == b"precious\n"
    assert not out.is_symlink() and stat.S_IMODE(out.stat().st_mode) == 0o600
    assert out.read_bytes()[:4] != b"prec"
    assert os.readlink(planted) == str(victim)  # not the export's to remove
    leftovers = sorted(p.name for p in shared_tmp.iterdir())
    assert leftovers == ["ns.kvx", "ns.kvx.partial", "victim"], leftovers


def test_export_to_a_directory_is_refused_before_exporting(daemon_thread, namespace, tmp_path, capsys):
    dest = tmp_path / "exports"
    dest.mkdir()
    code = main(["export", namespace, str(dest), "--target", daemon_thread.tcp_target])
    err = capsys.readouterr().err
    assert code == 1 and str(dest) in err and "directory" in err and "Traceback" not in err
    # An export that fails leaves nothing behind either.
    code = main(["export", "00" * 16, str(dest / "none.kvx"), "--target", daemon_thread.tcp_target])
    assert code == 1 and list(dest.iterdir()) == []


# ------------------------------------------------------------------ the token file


def token_file(path: Path, *entries: tuple[str, str]) -> dict[str, str]:
    """Write a 0600 token file granting each (tenant, role); returns tenant -> token."""
    tokens, text = {}, ""
    for tenant, role in entries:
        tokens[tenant], digest = new_token()
        text += entry_text(tenant, role, digest)
    path.write_text(text)
    os.chmod(path, 0o600)
    return tokens


def test_token_file_owned_by_another_user_is_refused(tmp_path):
    path = tmp_path / "tokens.toml"
    token_file(path, ("mallory", "admin"))
    os.chown(path, OTHER_UID, OTHER_UID)  # 0600, but its owner may write what it likes
    with pytest.raises(ConfigError, match=f"owned by uid {OTHER_UID}"):
        Daemon(make_config(tmp_path, auth_token_file=str(path)))


def test_token_file_in_a_directory_others_may_write_is_refused(shared_tmp, tmp_path):
    etc = shared_tmp / "etc"
    etc.mkdir()
    os.chmod(etc, 0o777)  # anyone may put another file in its place (an old one, with a revoked token)
    path = etc / "tokens.toml"
    token_file(path, ("ops", "admin"))
    with pytest.raises(ConfigError, match=str(etc)):
        Daemon(make_config(tmp_path, auth_token_file=str(path)))
    # A sticky world-writable directory (like /tmp, or a Secret volume) is fine.
    sticky = shared_tmp / "tokens.toml"
    token_file(sticky, ("ops", "admin"))
    assert Daemon(make_config(tmp_path, auth_token_file=str(sticky))).tokens is not None


async def test_reload_keeps_the_tokens_when_the_file_changes_owner(tmp_path):
    path = tmp_path / "tokens.toml"
    ops = token_file(path, ("ops", "admin"))["ops"]
    daemon = Daemon(make_config(tmp_path, auth_token_file=str(path)))
    await daemon.start()
    try:
        target = daemon.bound[0]
        # Another user takes the file over and grants itself an admin token.
        mallory = token_file(path, ("mallory", "admin"))["mallory"]
        os.chown(path, OTHER_UID, OTHER_UID)
        assert daemon.reload_tokens() is False
        with pytest.raises(Unauthenticated):
            async with AsyncClient(target, token=mallory, timeout_s=5) as kv:
                await kv.stats()
        async with AsyncClient(target, token=ops, timeout_s=5) as kv:  # the previous table stays in force
            assert (await kv.stats()) is not None
        os.chown(path, 0, 0)  # the operator's file again: it takes effect
        assert daemon.reload_tokens() is True
        async with AsyncClient(target, token=mallory, timeout_s=5) as kv:
            assert (await kv.stats()) is not None
    finally:
        await daemon.stop(grace_s=0)
