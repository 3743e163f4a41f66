"""TLS and mTLS on TCP listeners, with certificates made for the test by the openssl CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import daemon_in_thread, make_config

from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.errors import ConfigError, KVStoreError, Unauthenticated
from kvstore.server.config import load_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=kvstore test CA",
             cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", *ext, cwd=d)
    # A second CA that signed nothing of ours: a client trusting it must not connect.
    _openssl("req", "-x509", *ec, "-keyout", "other.key", "-out", "other.pem", "-days", "1", "-subj", "/CN=other",
             cwd=d)
    for key in d.glob("*.key"):
        os.chmod(key, 0o600)
    return d


def test_tls_listener_serves_clients_that_trust_its_ca(tmp_path, pki, layout):
    cfg = make_config(tmp_path, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    with daemon_in_thread(cfg) as running:
        with Client(running.tcp_target, tls_ca=str(pki / "ca.pem"), data_plane="grpc") as kv:
            data = [os.urandom(layout.bytes_per_block) for _ in range(2)]
            assert kv.put(layout, list(range(8)), data).stored == 2
            assert [bytes(b) for b in kv.fetch(layout, list(range(8)))] == data
        # Plain-text clients and clients trusting another CA cannot talk to it.
        with Client(running.tcp_target, data_plane="grpc", timeout_s=3) as plain:
            with pytest.raises(KVStoreError):
                plain.lookup(layout, list(range(8)))
        with Client(running.tcp_target, tls_ca=str(pki / "other.pem"), data_plane="grpc", timeout_s=3) as wrong:
            with pytest.raises(KVStoreError):
                wrong.lookup(layout, list(range(8)))
        from kvstore.cli.main import main

        assert main(["health", "--target", running.tcp_target, "--tls-ca", str(pki / "ca.pem")]) == 0
        # The Unix socket stays plain (its file mode is its boundary); TLS settings given
        # for it (say, from KVSTORE_TLS_CA) do not get in the way.
        with Client(running.unix_target, data_plane="grpc") as local, \
             Client(running.unix_target, tls_ca=str(pki / "ca.pem"), data_plane="grpc") as also_local:
            assert local.lookup(layout, list(range(8))).num_blocks == 2
            assert also_local.lookup(layout, list(range(8))).num_blocks == 2


def test_mtls_needs_a_client_certificate(tmp_path, pki, layout):
    cfg = make_config(tmp_path, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                      tls_client_ca=str(pki / "ca.pem"))
    with daemon_in_thread(cfg) as running:
        with Client(running.tcp_target, tls_ca=str(pki / "ca.pem"), data_plane="grpc", timeout_s=3) as anon:
            with pytest.raises(KVStoreError):
                anon.lookup(layout, list(range(8)))
        with Client(running.tcp_target, tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"),
                    tls_key=str(pki / "client.key"), data_plane="grpc") as kv:
            assert kv.lookup(layout, list(range(8))).num_blocks == 0


def test_tls_and_a_token_together(tmp_path, pki, layout):
    from kvstore.server.auth import new_token

    token, token_hash = new_token()
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[tenant]]\nname = "ops"\nrole = "admin"\ntokens = ["{token_hash}"]\n')
    os.chmod(tokens, 0o600)
    cfg = make_config(tmp_path, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                      auth_token_file=str(tokens))
    with daemon_in_thread(cfg) as running:
        with AdminClient(running.tcp_target, tls_ca=str(pki / "ca.pem")) as anon:
            with pytest.raises(Unauthenticated):
                anon.stats()
        with AdminClient(running.tcp_target, tls_ca=str(pki / "ca.pem"), token=token) as admin:
            assert admin.stats().tiers


def test_tls_settings_are_checked_together():
    with pytest.raises(ConfigError, match="go together"):
        load_config({"tls_cert": "x.pem"}, env={})
    with pytest.raises(ConfigError, match="needs tls_cert"):
        load_config({"tls_client_ca": "ca.pem"}, env={})


def test_unreadable_certificate_stops_the_daemon(tmp_path):
    from kvstore.server.daemon import Daemon

    with pytest.raises(ConfigError, match="cannot read tls_key"):
        Daemon(make_config(tmp_path, tls_cert=str(tmp_path / "none.pem"), tls_key=str(tmp_path / "none.key")))

