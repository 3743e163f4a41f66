"""Real components for the cluster tests: an etcd server, and hosts in network namespaces.

* `EtcdServer`: Debian's etcd (scripts/install-etcd.sh; `make test` runs it) on free
  ports, its data under the test's tmp dir; stop, kill -9 and restart it (with or without
  its data). The `etcd` fixture starts one per test module on 127.0.0.1 and stops and
  removes it at the end; tests that stop it start it again before they finish.
* `NetworkHosts`: N "hosts", each a network namespace with one veth link to a bridge in a
  switch namespace (addresses 10.213.0.1..N/24; the switch itself is 10.213.0.254, where
  shared services such as etcd run). Nothing is added to the root namespace. Commands run
  inside a host with `run`/`popen`; `link_down`/`link_up` cut and restore a host's link.
  Teardown ends the processes it started, then any process left in its namespaces (by
  pid), then deletes the namespaces, whatever the test did. The `netns_hosts` fixture
  makes three; tests that need namespaces skip with the reason where they cannot be made
  (not root, no `ip`, no permission).
* `MemberProcess`: `tests/cluster/cluster_member.py` (an EtcdMembership in a process of its own)
  started on the loopback or inside a host, its view read back from a status file.

Test modules import the fixtures they use from here (pytest finds fixtures in a module's
namespace). Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

ETCD_START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
MEMBER_SCRIPT = Path(__file__).with_name("cluster_member.py")
SUBNET = "10.213.0"
SWITCH_ADDRESS = f"{SUBNET}.254"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        pytest.skip("etcd is not installed: run scripts/install-etcd.sh (make test runs it)")
    return path


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(STOP_TIMEOUT_S)


class EtcdServer:
    """One etcd member on `host`, optionally inside a network namespace (`netns`)."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", client_port: int = 0, peer_port: int = 0,
                 netns: str = "") -> None:
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.netns = netns
        self.log = data_dir.with_name(data_dir.name + ".log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def _args(self) -> list[str]:
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        return [*prefix, self.binary, "--name", "kvtest", "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kvtest={peer}", "--initial-cluster-state", "new",
                "--logger", "zap", "--log-level", "warn"]

    def start(self, wipe: bool = False) -> None:
        """Start it (again) on the same ports; `wipe` first removes its data (a fresh etcd)."""
        assert self.proc is None or self.proc.poll() is not None, "etcd is already running"
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        env = dict(os.environ)
        if os.uname().machine in ("aarch64", "arm64"):
            env["ETCD_UNSUPPORTED_ARCH"] = "arm64"  # etcd 3.4 asks for this on arm64
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self._args(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        self._wait_healthy()

    def _healthy(self) -> bool:
        url = f"http://{self.host}:{self.client_port}/health"
        if self.netns:
            code = f"import urllib.request; urllib.request.urlopen({url!r}, timeout=1).read()"
            probe = subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-c", code],
                                   capture_output=True, timeout=10)
            return probe.returncode == 0
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + ETCD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self._healthy():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy in {ETCD_START_TIMEOUT_S:g}s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def kill9(self) -> None:
        if self.proc is not None:
            _stop(self.proc, signal.SIGKILL)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A real etcd on 127.0.0.1 (free ports) for the test module; each test uses its own
    key prefix. A test that stops it starts it again before it ends."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


# -- network namespaces --------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class NetworkHosts:
    """`count` hosts in network namespaces around one bridge (see the module docstring)."""

    def __init__(self, count: int) -> None:
        tag = f"kvt{os.getpid()}{secrets.token_hex(2)}"
        self.switch = f"{tag}-sw"
        self.hosts = [f"{tag}-h{i}" for i in range(count)]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def create(self) -> None:
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "addr", "add", f"{SWITCH_ADDRESS}/24", "dev", "br0")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.hosts):
                self._add(ns)
                _ip("-n", self.switch, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.switch, "link", "set", f"v{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def command(self, i: int, args: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[i], *args]

    def run(self, i: int, args: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(i, args), capture_output=True, text=True, timeout=timeout_s)

    def popen(self, i: int, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(self.command(i, args), **kwargs)
        self._procs.append(proc)
        return proc

    def link_down(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"v{i}", "down")

    def link_up(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"v{i}", "up")

    def destroy(self) -> None:
        for proc in self._procs:
            _stop(proc)
        for ns in reversed(self._made):
            # Whatever still runs inside (started by this test, e.g. a grandchild): by pid.
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while pids and time.monotonic() < deadline:
                pids = _ip("netns", "pids", ns, check=False).stdout.split()
                time.sleep(0.05)
            _ip("netns", "del", ns, check=False)
        self._made.clear()


def netns_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need the ip command (iproute2)"
    return None


@pytest.fixture
def netns_hosts() -> Iterator[NetworkHosts]:
    reason = netns_skip_reason()
    if reason:
        pytest.skip(reason)
    hosts = NetworkHosts(3)
    try:
        hosts.create()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make network namespaces here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    try:
        yield hosts
    finally:
        hosts.destroy()


# -- member processes ----------------------------------------------------------------


class MemberProcess:
    """An EtcdMembership in its own process (tests/cluster/cluster_member.py); its latest view and
    status land in `status_file` as JSON after every change."""

    def __init__(self, proc: subprocess.Popen[bytes], status_file: Path, node_id: str) -> None:
        self.proc = proc
        self.status_file = status_file
        self.node_id = node_id

    def state(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.status_file.read_text()))
        except (OSError, ValueError):
            return None

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state()
            if st is not None and predicate(st):
                return st
            if self.proc.poll() is not None:
                raise RuntimeError(f"member {self.node_id} exited with {self.proc.returncode}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"member {self.node_id}: condition not met in {timeout_s:g}s; last state {st}")
            time.sleep(0.05)

    def kill9(self) -> None:
        _stop(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        _stop(self.proc)


def member_args(node_id: str, endpoint: str, prefix: str, status_file: Path, *, address: str = "",
                ttl_s: int = 2) -> list[str]:
    return [sys.executable, str(MEMBER_SCRIPT), "--node-id", node_id, "--endpoint", endpoint, "--prefix", prefix,
            "--status-file", str(status_file), "--address", address or f"{node_id}:5000", "--lease-ttl-s", str(ttl_s)]


@contextlib.contextmanager
def member_process(args: list[str], status_file: Path, node_id: str,
                   spawn: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen) -> Iterator[MemberProcess]:
    """Start a member process with `spawn` (Popen, or NetworkHosts.popen bound to a host);
    stop it at the end whatever happened."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    log = open(status_file.with_suffix(".log"), "wb")
    try:
        proc = spawn(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        member = MemberProcess(proc, status_file, node_id)
        try:
            yield member
        finally:
            member.stop()
    finally:
        log.close()
