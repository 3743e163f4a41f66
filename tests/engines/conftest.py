"""Fixtures for the engine tests: a tiny local Llama, a real daemon process, and a helper
that runs one vLLM engine per process (see `vllm_runner.py`).

These tests need vLLM (CPU build) and transformers; they run in their own venv through
`make test-engines` and are not collected by the plain `make test`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.errors import KVStoreError
from tests.procs import remove_segments

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from tinyllama import VOCAB_SIZE, build_tiny_llama  # noqa: E402

ENGINE_TIMEOUT_S = 600
DAEMON_START_TIMEOUT_S = 60


@dataclass
class DaemonProcess:
    """`server.py` as a child process on a Unix socket under a temp dir."""

    proc: subprocess.Popen[bytes]
    target: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stats(self) -> Any:
        with Client(self.target, timeout_s=10) as kv:
            return kv.stats()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        # A daemon that was SIGKILLed (a crash test) could not unlink its host-tier segment.
        remove_segments(self.proc.pid)


def start_daemon(directory: Path, *extra: str) -> DaemonProcess:
    directory.mkdir(parents=True, exist_ok=True)
    sock = directory / "kv.sock"
    log_path = directory / "daemon.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "server.py"), "--listen", f"unix:{sock}", "--host-capacity", "256MiB",
             *extra],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )
    daemon = DaemonProcess(proc, f"unix:{sock}", log_path)
    deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode}:\n{log_path.read_text()}")
        if sock.exists():
            try:
                daemon.stats()
                return daemon
            except KVStoreError:
                pass
        if time.monotonic() > deadline:
            daemon.stop()
            raise RuntimeError(f"the daemon did not answer within {DAEMON_START_TIMEOUT_S} s:\n{log_path.read_text()}")
        time.sleep(0.1)


@dataclass
class EngineRun:
    steps: list[dict[str, Any]]
    log: str

    def outputs(self, step: int) -> list[dict[str, Any]]:
        return self.steps[step]["outputs"]


def run_engine(workdir: Path, name: str, spec: dict[str, Any]) -> EngineRun:
    """Run one engine in a fresh process; fail with its log if it fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    # The engine core runs in this process: the scheduler and worker halves of the
    # connector then share it, as they do in a single-process CPU deployment.
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CONFIGURE_LOGGING="1")
    with open(log_path, "wb") as log:
        proc = subprocess.run([sys.executable, str(HERE / "vllm_runner.py"), str(spec_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                              timeout=ENGINE_TIMEOUT_S)
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise AssertionError(f"engine {name} exited with {proc.returncode}; its log ends:\n{text[-6000:]}")
    return EngineRun(json.loads(out_path.read_text())["steps"], text)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[int]]:
    """Fixed random prompts: P1 (300 tokens), P2 (200), a 50-token suffix S, and P3 (260)."""
    rng = random.Random(20261129)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    return {"P1": draw(300), "P2": draw(200), "S": draw(50), "P3": draw(260)}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("daemon"))
    try:
        yield d
    finally:
        d.stop()
