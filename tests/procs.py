"""The daemon as a real subprocess, for tests that kill it, corrupt its files, or run it
inside another mount namespace. In-process daemons come from conftest's fixtures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvstore.client import Client
from kvstore.errors import KVStoreError

START_TIMEOUT_S = 30.0


def daemon_args(sock: Path, *extra: str) -> list[str]:
    """`kvstore serve` on a Unix socket only, quiet, no metrics port, then `extra` flags."""
    return [sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix:{sock}", "--grace-s", "1",
            "--log-level", "warning", "--metrics-listen", "off", *extra]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


class DaemonProc:
    """A started daemon subprocess: `target`, `pid` (the daemon's own), signals, `stop`."""

    def __init__(self, popen: subprocess.Popen[bytes], target: str, log: Path, pid_file: Path | None = None) -> None:
        self.popen = popen
        self.target = target
        self.log = log
        self._pid_file = pid_file

    @property
    def pid(self) -> int:
        """The daemon's pid (differs from the Popen's when a wrapper script started it)."""
        if self._pid_file is not None:
            return int(self._pid_file.read_text().strip())
        return self.popen.pid

    def alive(self) -> bool:
        if self.popen.poll() is not None:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> int:
        return self.popen.wait(timeout_s)

    def stop(self) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time. The exit status."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                return self.popen.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
        return self.popen.wait(START_TIMEOUT_S)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(START_TIMEOUT_S)


def start(args: Sequence[str], sock: Path, log: Path, pid_file: Path | None = None, *,
          env: Mapping[str, str] | None = None) -> DaemonProc:
    """Run `args` (a daemon, or a wrapper that execs one) and wait until it answers on `sock`.
    `env` adds variables to the clean environment. (No preexec_fn: it makes Popen fork()
    rather than vfork(), and fork() in a process with gRPC threads can hang in the gRPC
    library's fork handlers; a wrapper that execs the daemon does the same job.)"""
    fh = open(log, "ab")
    try:
        popen = subprocess.Popen(list(args), env={**clean_env(), **(env or {})}, stdout=subprocess.DEVNULL, stderr=fh)
    finally:
        fh.close()
    proc = DaemonProc(popen, f"unix:{sock}", log, pid_file)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise AssertionError(f"daemon exited with {popen.returncode}: {log.read_text()[-2000:]}")
        if sock.exists() and (pid_file is None or pid_file.exists()):
            try:
                with Client(proc.target, timeout_s=2) as kv:
                    kv.stats()
                return proc
            except KVStoreError:
                pass
        time.sleep(0.05)
    popen.kill()
    popen.wait()
    raise AssertionError(f"daemon did not start in {START_TIMEOUT_S:.0f}s: {log.read_text()[-2000:]}")


def remove_segments(pid: int) -> None:
    """Shared-memory segments a SIGKILLed daemon could not unlink (named by its pid, if so)."""
    shm = Path("/dev/shm")
    for seg in shm.glob(f"kvstore-{pid}-*"):
        try:
            seg.unlink()
        except OSError:
            pass
