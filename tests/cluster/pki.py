"""For the cluster's lane tests: `make_pki`, a CA with a certificate for 127.0.0.1 that
serves both as a daemon's server and as its client certificate (the proxy that makes
faults in flight is tests/lane_proxy.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def make_pki(d: Path) -> Path:
    """ca.pem, and node.pem / node.key for 127.0.0.1 signed by it, in `d` (skips the
    test without the openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make certificates")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=pool test CA")
    (d / "node.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=node")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "node.pem", "-days", "1", "-extfile", "node.ext")
    for key in d.glob("*.key"):
        os.chmod(key, 0o600)
    return d
