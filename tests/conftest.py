"""Shared fixtures: a real daemon in-process (port 0 and a temp Unix socket), real clients.

`daemon` runs on the test's own event loop (for AsyncClient tests). `daemon_thread`
runs the daemon on a loop in a background thread, for tests that use the blocking
`Client` or the CLI in-process. Both bind only loopback and a socket under tmp_path.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from kvstore.layout import KVLayout
from kvstore.server.config import Config, load_config
from kvstore.server.daemon import Daemon

SMALL_LAYOUT = KVLayout(
    model="test/tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=4
)  # 2 * 2 * 4 * 2 * 16 * 2 = 1024 bytes per block


def make_config(tmp_path: Path, **overrides: Any) -> Config:
    base = load_config(
        {"listen": f"unix:{tmp_path / 'kv.sock'},127.0.0.1:0", "host_capacity": "16MiB", "grace_s": "1",
         "metrics_listen": "127.0.0.1:0"},
        env={},
    )
    return replace(base, **overrides)


@dataclass
class RunningDaemon:
    daemon: Daemon
    unix_target: str
    tcp_target: str

    @property
    def store(self) -> Any:
        return self.daemon.store


@pytest.fixture(autouse=True, scope="session")
def metrics_port_zero() -> Iterator[None]:
    """Daemons started as subprocesses inherit this: never the default metrics port, which
    a daemon from `make run` or a parallel test run may hold."""
    patch = pytest.MonkeyPatch()
    patch.setenv("KVSTORE_METRICS_LISTEN", "127.0.0.1:0")
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def keep_sigpipe_ignored() -> Iterator[None]:
    """The CLI gives SIGPIPE its default action (so `kvstore ... | head` ends quietly);
    tests that run it in-process must not leave that to the daemons and clients of the
    tests after them."""
    before = signal.getsignal(signal.SIGPIPE)
    yield
    signal.signal(signal.SIGPIPE, before)


@pytest.fixture
def layout() -> KVLayout:
    return SMALL_LAYOUT


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path)


@pytest.fixture
async def daemon(config: Config) -> AsyncIterator[RunningDaemon]:
    d = Daemon(config)
    await d.start()
    try:
        yield RunningDaemon(d, d.bound[0], d.bound[1])
    finally:
        await d.stop(grace_s=0)


@pytest.fixture
def daemon_thread(config: Config) -> Iterator[RunningDaemon]:
    """A daemon on its own loop in a thread, for blocking clients."""
    with daemon_in_thread(config) as running:
        yield running


@contextlib.contextmanager
def daemon_in_thread(config: Config) -> Iterator[RunningDaemon]:
    """Run a daemon with `config` on its own loop in a thread; stop it on exit."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        d = Daemon(config)
        try:
            await d.start()
        except BaseException as exc:
            box["error"] = exc
            started.set()
            return
        box["daemon"] = d
        started.set()
        await d.wait_stopped()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    started.wait(30)
    if "error" in box:
        raise box["error"]
    d = box["daemon"]
    try:
        yield RunningDaemon(d, d.bound[0], d.bound[1])
    finally:
        asyncio.run_coroutine_threadsafe(d.stop(grace_s=0), loop).result(30)
        thread.join(30)
        loop.close()
