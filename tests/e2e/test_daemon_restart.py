"""A client kept open across its daemon's restart (kill -9, and a clean stop) loses
nothing in silence, on every plane: the shared-memory plane (auth off: a segment by
path; auth on: the tenant's memfd segment passed over the control lane), the control
lane, and the data lane (its port kept, and a new one after the restart).

The daemon is a real subprocess (`kvstore serve`); the client is the engine that keeps
its `Client`. After the restart its next put is stored on the new daemon and fetched
byte-exact, what it had put before is a miss (the daemon keeps no SSD here), no call
raises, no block fails verification on the daemon (its checksum failure counters stay
0: before daemon generations, such a client's puts were acknowledged and then dropped
at their first read), and the client is back on the plane it used. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client, GroupKind, KVGroup
from kvstore.control_lane_wire import (
    HEADER,
    HELLO,
    HELLO_ANSWER,
    HELLO_ANSWER_GENERATION,
    MAGIC,
    MAGIC_GENERATION,
    frame,
    lane_path,
)
from kvstore.errors import Unavailable
from kvstore.layout import KVLayout
from kvstore.server.auth import new_token
from tests import procs

pytestmark = pytest.mark.e2e

LAYOUT = KVLayout(model="test/restart", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64,
                  block_size_tokens=4)  # 4 KiB blocks
HOW = ("kill-9", "clean")
PUTS_AFTER = 25  # new puts of 4 blocks each thread makes after the restart (1.6 MiB in all)
CYCLE = 8  # until then each thread puts the same few chains again (0.5 MiB in all): nothing is evicted


def chain(n: int, salt: int) -> tuple[list[int], list[bytes]]:
    tokens = [salt * 1_000_000 + i for i in range(n * LAYOUT.block_size_tokens)]
    return tokens, [os.urandom(LAYOUT.bytes_per_block) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """One daemon's command line, started, restarted (kill -9 or SIGTERM), stopped."""

    def __init__(self, tmp_path: Path, *extra: str, listen: str = "") -> None:
        self.sock = tmp_path / "kv.sock"
        self.log = tmp_path / "daemon.log"
        args = procs.daemon_args(self.sock, "--host-capacity", "8MiB", "--shm-dir", str(tmp_path), *extra)
        if listen:
            args[args.index("--listen") + 1] += f",{listen}"
        self.args = args
        self.shm_dir = tmp_path
        self.proc = procs.start(self.args, self.sock, self.log)

    @property
    def target(self) -> str:
        return f"unix:{self.sock}"

    def restart(self, how: str) -> None:
        if how == "kill-9":
            pid = self.proc.pid
            self.proc.kill9()
            for seg in self.shm_dir.glob(f"kvstore-{pid}-*"):
                seg.unlink()
        else:
            assert self.proc.stop() == 0
        self.proc = procs.start(self.args, self.sock, self.log)

    def stop(self) -> None:
        pid = self.proc.pid
        if self.proc.alive():
            self.proc.signal(signal.SIGKILL)
        self.proc.wait()
        procs.remove_segments(pid)


@pytest.fixture
def started() -> Iterator[list[Daemon]]:
    daemons: list[Daemon] = []
    yield daemons
    for d in daemons:
        d.stop()


def checksum_failures(kv: Client) -> int:
    stats = kv.stats()
    return sum(t.checksum_failures for t in stats.tiers)


def evictions(kv: Client) -> int:
    return int(kv.stats().counters.evictions)


def read_by_another(target: str, chains: list[tuple[list[int], list[bytes]]], **options: object) -> None:
    """Another client (gRPC bytes: the daemon reads its own memory) gets every block exact.
    The client that put them can read back its own copy; this one reads what the daemon
    holds."""
    with Client(target, data_plane="grpc", **options) as other:  # type: ignore[arg-type]
        for tokens, blocks in chains:
            assert [bytes(b) for b in other.fetch(LAYOUT, tokens)] == blocks


def across_a_restart(kv: Client, daemon: Daemon, how: str, plane: str) -> None:
    """What an engine that keeps `kv` sees across its daemon's restart (module docstring)."""
    before = [chain(3, salt) for salt in range(1, 4)]
    for tokens, blocks in before:
        assert kv.put(LAYOUT, tokens, blocks).stored == 3
        assert [bytes(b) for b in kv.fetch(LAYOUT, tokens)] == blocks
    assert kv.data_plane_in_use == plane
    daemon.restart(how)
    # The first call after the restart is a put: the case that used to be lost in silence.
    after = [chain(3, salt) for salt in range(10, 16)]
    for tokens, blocks in after:
        put = kv.put(LAYOUT, tokens, blocks)
        assert put.stored == 3
    for tokens, blocks in after:
        assert kv.lookup(LAYOUT, tokens).num_blocks == 3
        assert [bytes(b) for b in kv.fetch(LAYOUT, tokens)] == blocks
    read_by_another(kv.target, after)
    for tokens, _ in before:
        assert kv.fetch(LAYOUT, tokens) == []  # gone with the old daemon: a miss, not an error
    assert kv.data_plane_in_use == plane
    assert checksum_failures(kv) == 0


@pytest.mark.parametrize("how", HOW)
def test_shared_memory_without_auth(tmp_path: Path, started: list[Daemon], how: str) -> None:
    daemon = Daemon(tmp_path)
    started.append(daemon)
    # reserve_ahead: the one-trip put too, whose slots the client holds across the restart.
    with Client(daemon.target, reserve_ahead=3) as kv:
        across_a_restart(kv, daemon, how, "local")
        assert kv.control_plane_in_use == "lane"


@pytest.mark.parametrize("how", HOW)
def test_shared_memory_with_auth_memfd_segments(tmp_path: Path, started: list[Daemon], how: str) -> None:
    token, token_hash = new_token()
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[tenant]]\nname = "engine"\nrole = "client"\ntokens = ["{token_hash}"]\n'
                      "local_plane = true\n")
    os.chmod(tokens, 0o600)
    admin, admin_hash = new_token()
    with open(tokens, "a") as fh:
        fh.write(f'\n[[tenant]]\nname = "ops"\nrole = "admin"\ntokens = ["{admin_hash}"]\n')
    # (the Unix socket's calls without a token act as ops: the start-up probe's)
    daemon = Daemon(tmp_path, "--auth-token-file", str(tokens), "--unix-socket-tenant", "ops")
    started.append(daemon)
    with Client(daemon.target, token=token, reserve_ahead=3) as kv:
        before = [chain(3, salt) for salt in range(1, 3)]
        for tok, blocks in before:
            kv.put(LAYOUT, tok, blocks)
        assert kv.data_plane_in_use == "local"
        daemon.restart(how)
        after = [chain(3, salt) for salt in range(10, 14)]
        for tok, blocks in after:
            assert kv.put(LAYOUT, tok, blocks).stored == 3
        for tok, blocks in after:
            assert [bytes(b) for b in kv.fetch(LAYOUT, tok)] == blocks
        read_by_another(daemon.target, after, token=token)
        for tok, _ in before:
            assert kv.fetch(LAYOUT, tok) == []
        assert kv.data_plane_in_use == "local"
    with Client(daemon.target, token=admin) as ops:
        assert checksum_failures(ops) == 0


@pytest.mark.parametrize("how", HOW)
def test_the_control_lane_tells_the_new_start_and_the_client_follows(tmp_path: Path, started: list[Daemon],
                                                                     how: str) -> None:
    daemon = Daemon(tmp_path)
    started.append(daemon)

    def hello(magic: bytes) -> bytes:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(lane_path(str(daemon.sock)))
            s.sendall(frame(HELLO, magic))
            head = s.recv(HEADER.size, socket.MSG_WAITALL)
            length, code = HEADER.unpack(head)
            assert code == 0
            return s.recv(length, socket.MSG_WAITALL)

    first = HELLO_ANSWER_GENERATION.unpack(hello(MAGIC_GENERATION))
    assert first[0] == MAGIC_GENERATION and first[2] != 0
    assert HELLO_ANSWER.unpack(hello(MAGIC))[0] == MAGIC  # the first hello is answered as before
    # Unary calls on the lane, block bytes in gRPC messages: the lane alone carries the
    # daemon's start to this client (no segment is mapped).
    with Client(daemon.target, control_plane="lane", data_plane="grpc") as kv:
        tokens, blocks = chain(4, 1)
        kv.put(LAYOUT, tokens, blocks)
        hit = kv.lookup(LAYOUT, tokens, lease_ms=30_000)
        assert hit.num_blocks == 4 and hit.lease_id
        daemon.restart(how)
        assert HELLO_ANSWER_GENERATION.unpack(hello(MAGIC_GENERATION))[2] not in (0, first[2])
        # The lease went with the old start: ending it is a no-op, and a fetch naming it is
        # answered by the new one (a miss here), never an error.
        assert kv.fetch(LAYOUT, tokens, lease_id=hit.lease_id) == []
        assert kv.unpin(hit.lease_id) is False
        again = chain(4, 2)
        assert kv.put(LAYOUT, *again).stored == 4
        assert [bytes(b) for b in kv.fetch(LAYOUT, again[0])] == again[1]
        assert kv.control_plane_in_use == "lane"


@pytest.mark.parametrize("lane_port", ["kept", "new"])
@pytest.mark.parametrize("how", HOW)
def test_the_data_lane(tmp_path: Path, started: list[Daemon], how: str, lane_port: str) -> None:
    grpc_port = free_port()
    extra = ("--data-lane-listen", f"127.0.0.1:{free_port()}") if lane_port == "kept" else ()
    daemon = Daemon(tmp_path, *extra, listen=f"127.0.0.1:{grpc_port}")
    started.append(daemon)
    with Client(f"127.0.0.1:{grpc_port}", data_plane="lane") as kv:
        across_a_restart(kv, daemon, how, "lane")
        stats = kv.data_lane_stats
        assert stats is not None and stats.blocks_rejected == 0


GROUPED = KVLayout(
    model="test/restart-groups", dtype="bfloat16", num_layers=3, num_kv_heads=1, head_dim=8, block_size_tokens=4,
    groups=(
        KVGroup("full", GroupKind.FULL, "bfloat16", (2, 1, 4, 1, 8)),
        KVGroup("swa", GroupKind.SLIDING_WINDOW, "bfloat16", (2, 1, 4, 1, 8), window_tokens=9),
        KVGroup("ssm", GroupKind.STATE, "float32", (32,)),
    ),
)


@pytest.mark.parametrize("plane", ["local", "lane"])
def test_a_layout_with_kv_groups(tmp_path: Path, started: list[Daemon], plane: str) -> None:
    """A grouped layout's parts across a kill -9, on shared memory and on the data lane:
    the put after the restart is stored on the new daemon (another client reads the same
    parts), what the old one held is a miss."""
    grpc_port = free_port()
    daemon = Daemon(tmp_path, listen=f"127.0.0.1:{grpc_port}")
    started.append(daemon)

    def parts(n: int) -> list[dict[str, bytes]]:
        return [{g.name: os.urandom(g.bytes_per_block) for g in GROUPED.groups} for _ in range(n)]

    target = daemon.target if plane == "local" else f"127.0.0.1:{grpc_port}"
    before, after = list(range(24)), list(range(1000, 1024))
    with Client(target, data_plane=plane) as kv:
        assert kv.put(GROUPED, before, parts(6)).stored == 6
        assert kv.fetch(GROUPED, before)
        daemon.restart("kill-9")
        assert kv.put(GROUPED, after, parts(6)).stored == 6
        got = kv.fetch(GROUPED, after)
        assert len(got) == 6
        assert kv.fetch(GROUPED, before) == []
        assert kv.data_plane_in_use == plane
    with Client(daemon.target, data_plane="grpc") as other:
        assert other.fetch(GROUPED, after) == got
        assert checksum_failures(other) == 0


def test_a_client_shared_by_threads_across_a_kill_9(tmp_path: Path, started: list[Daemon]) -> None:
    """An engine's client used by several threads at once while its daemon is killed and
    restarted: its mapping of the old segment is let go only once the copies running in
    it are done (no thread copies into unmapped memory), calls fail only while no daemon
    is there (UNAVAILABLE), and every put acknowledged by the new daemon is exact for
    another client. The daemon evicts nothing (until the threads know of the restart
    they put the same few chains again), so a block missing at the end was lost."""
    daemon = Daemon(tmp_path)
    started.append(daemon)
    restarted = threading.Event()
    acked: list[tuple[list[int], list[bytes]]] = []
    unexpected: list[str] = []
    lock = threading.Lock()

    def work(kv: Client, seed: int) -> None:
        n = 0
        since = 0  # puts begun after the restart: bounded, so none is evicted before it is read
        cycled: dict[int, list[bytes]] = {}  # each chain's bytes: put again, the same
        while since < PUTS_AFTER:
            since += restarted.is_set()
            # Until the restart, a cycle of a few chains: the time the daemon takes to come
            # back varies, and the bytes put meanwhile must not fill its host tier.
            n = CYCLE + since if since else (n + 1) % CYCLE
            tokens = [(seed << 28) + (n << 4) + i for i in range(4 * LAYOUT.block_size_tokens)]
            blocks = cycled.setdefault(n, [os.urandom(LAYOUT.bytes_per_block) for _ in range(4)])
            after = restarted.is_set()  # read first: a put begun before the restart may land on either daemon
            try:
                put = kv.put(LAYOUT, tokens, blocks)
                got = [bytes(b) for b in kv.fetch(LAYOUT, tokens)]
            except Unavailable:
                continue  # no daemon there for a moment
            except Exception as exc:  # noqa: BLE001 - any other failure is what the test looks for
                with lock:
                    unexpected.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                if got != blocks[: len(got)]:
                    unexpected.append(f"fetched {len(got)} blocks, not a prefix of those put")
                if after and put.stored + put.existing == 4:
                    acked.append((tokens, blocks))

    with Client(daemon.target, reserve_ahead=4) as kv:
        threads = [threading.Thread(target=work, args=(kv, k), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        daemon.restart("kill-9")
        restarted.set()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert kv.data_plane_in_use == "local"
    assert unexpected == []
    assert len(acked) >= 2 * PUTS_AFTER  # most of the threads' puts since the restart
    with Client(daemon.target) as kv:
        assert evictions(kv) == 0  # (else the check below could fail on what was evicted)
    read_by_another(daemon.target, acked)
    with Client(daemon.target) as kv:
        assert checksum_failures(kv) == 0
