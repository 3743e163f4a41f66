"""Integrity and isolation of the shared-memory plane, against the real daemon: no
tenant, and no stray client of the same tenant, can change what another is served, and
no tenant can read another's blocks through any mapping it can obtain.

- A block's checksum comes only from bytes its writer owned (a gRPC put's messages, a
  local put's source): a write into its slot by anyone else, before or after the commit,
  turns the block into a miss, never into wrong bytes.
- With auth on, each tenant's blocks live in a segment of its own that cannot be opened
  by path: its clients get it as a file descriptor over the control lane, and the
  daemon's /proc entries are closed to other processes of its uid.

The attacker here is a client that maps whatever the daemon lets it map and writes
where it likes: the raw protocol (gRPC stubs, lane frames), not the SDK.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.client import AsyncClient, Client
from kvstore.control_lane_wire import HEADER, HELLO, MAGIC, METHOD_IDS, frame, lane_path
from kvstore.convert import layout_to_proto
from kvstore.layout import KVLayout
from kvstore.server.auth import new_token
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.conftest import daemon_in_thread, make_config
from tests.procs import clean_env

WAIT_S = 20.0


# ------------------------------------------------------------------ the attacker's tools


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def put_header(layout: KVLayout, tokens: list[int]) -> kvstore_pb2.PutHeader:
    return kvstore_pb2.PutHeader(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(layout)),
                                 keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens)))


def _read_answer(sock: socket.socket) -> tuple[int, bytes, list[int]]:
    """One lane answer frame, with any file descriptors that came along with it."""
    buf = b""
    fds: list[int] = []
    while len(buf) < HEADER.size or len(buf) < HEADER.size + HEADER.unpack_from(buf)[0]:
        data, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, 8)
        fds += got
        if not data:
            raise ConnectionError("the daemon closed the lane connection")
        buf += data
    length, code = HEADER.unpack_from(buf)
    return code, buf[HEADER.size:HEADER.size + length], fds


def lane_call(unix_target: str, token: str | None, method: str, request: object) -> tuple[int, bytes, list[int]]:
    """One call over the control lane on a connection of its own: (status, payload, fds)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(lane_path(unix_target[len("unix:"):]))
        sock.sendall(frame(HELLO, MAGIC + (token or "").encode()))
        code, payload, fds = _read_answer(sock)
        assert code == 0 and not fds, payload
        sock.sendall(frame(METHOD_IDS[method], request.SerializeToString()))  # type: ignore[attr-defined]
        return _read_answer(sock)


class Mappings:
    """Every mapping of daemon memory a client holding `token` can get, each mapped
    read-write: the LocalSegment answer over the control lane (a path, or the file
    descriptors passed with it) and over gRPC (a path), and every kvstore segment file in
    the daemon's segment directory and in /dev/shm."""

    def __init__(self, unix_target: str, token: str | None, shm_dirs: list[Path]) -> None:
        self.maps: list[tuple[str, mmap.mmap]] = []
        code, payload, fds = lane_call(unix_target, token, "LocalSegment", kvstore_pb2.LocalSegmentRequest())
        paths: list[tuple[str, str]] = []
        for fd in fds:
            self._map_fd(fd, "a descriptor passed over the lane")
            os.close(fd)
        if code == 0:
            resp = kvstore_pb2.LocalSegmentResponse.FromString(payload)
            if resp.path:
                paths.append(("the lane's LocalSegment path", resp.path))
        with grpc.insecure_channel(unix_target) as channel:
            try:
                resp = kvstore_pb2_grpc.KVStoreStub(channel).LocalSegment(
                    kvstore_pb2.LocalSegmentRequest(), metadata=bearer(token), timeout=10)
                if resp.path:
                    paths.append(("gRPC's LocalSegment path", resp.path))
            except grpc.RpcError:
                pass
        for directory in shm_dirs:
            for name in sorted(os.listdir(directory)) if directory.is_dir() else []:
                if name.startswith("kvstore-"):
                    paths.append((f"a segment file in {directory}", str(directory / name)))
        for what, path in paths:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue
            try:
                self._map_fd(fd, f"{what} ({path})")
            finally:
                os.close(fd)

    def _map_fd(self, fd: int, what: str) -> None:
        size = os.fstat(fd).st_size
        if size:
            self.maps.append((what, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)))

    def holding(self, data: bytes) -> list[str]:
        """Which mappings hold `data` somewhere."""
        return [what for what, m in self.maps if m.find(data) >= 0]

    def overwrite(self, data: bytes, other: bytes) -> int:
        """Write `other` over every copy of `data` found; how many copies were found."""
        hits = 0
        for _, m in self.maps:
            at = m.find(data)
            while at >= 0:
                m[at:at + len(other)] = other
                hits += 1
                at = m.find(data, at + len(other))
        return hits

    def close(self) -> None:
        for _, m in self.maps:
            m.close()
        self.maps.clear()

    def __enter__(self) -> Mappings:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PausedPut:
    """A gRPC Put whose stream stays open after its last chunk until `finish()`: the
    daemon has every byte, and has not committed yet."""

    def __init__(self, target: str, token: str | None, layout: KVLayout, tokens: list[int],
                 blocks: list[bytes]) -> None:
        self._release = threading.Event()
        self._sent = threading.Event()
        self._channel = grpc.insecure_channel(target)
        stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        header = put_header(layout, tokens)

        def requests() -> Iterator[kvstore_pb2.PutRequest]:
            yield kvstore_pb2.PutRequest(header=header)
            for i, block in enumerate(blocks):
                yield kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=i, data=block))
            self._sent.set()
            self._release.wait(WAIT_S * 3)

        self._outcome: list[object] = []

        def run() -> None:
            try:
                self._outcome.append(stub.Put(requests(), metadata=bearer(token), timeout=WAIT_S * 3))
            except grpc.RpcError as exc:
                self._outcome.append(exc)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert self._sent.wait(WAIT_S), "the put's chunks were not sent"

    def finish(self) -> object:
        self._release.set()
        self._thread.join(WAIT_S * 3)
        self._channel.close()
        return self._outcome[0]


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def fetched(target: str, token: str | None, layout: KVLayout, tokens: list[int], plane: str = "grpc") -> list[bytes]:
    with Client(target, token=token, data_plane=plane) as kv:
        return [bytes(b) for b in kv.fetch(layout, tokens)]


def named(blocks: list[bytes], **names: bytes) -> list[str]:
    """Which of `names` each block is (short enough for an assertion message)."""
    return [next((name for name, data in names.items() if data == b), "unknown bytes") for b in blocks]


# ------------------------------------------------------------------ fixtures


class Tenants:
    """A token file of an admin and two tenants that may both use the shared-memory plane."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tokens: dict[str, str] = {}
        entries = []
        for name, role, extra in (("ops", "admin", ""), ("alpha", "client", "local_plane = true\n"),
                                  ("gamma", "client", "local_plane = true\n")):
            token, token_hash = new_token()
            self.tokens[name] = token
            entries.append(f'[[tenant]]\nname = "{name}"\nrole = "{role}"\ntokens = ["{token_hash}"]\n{extra}')
        path.write_text("\n".join(entries))
        os.chmod(path, 0o600)


@pytest.fixture
def tenants(tmp_path: Path) -> Tenants:
    return Tenants(tmp_path / "tokens.toml")


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    return d


def segment_dirs(shm_dir: Path) -> list[Path]:
    return [shm_dir, Path("/dev/shm")]


@pytest.fixture
def auth_daemon(tmp_path: Path, tenants: Tenants, shm_dir: Path) -> Iterator[object]:
    with daemon_in_thread(make_config(tmp_path, auth_token_file=str(tenants.path), shm_dir=str(shm_dir))) as running:
        yield running


@pytest.fixture
def open_daemon(tmp_path: Path, shm_dir: Path) -> Iterator[object]:
    """Auth off: one tenant; its clients map the one segment by path, as always."""
    with daemon_in_thread(make_config(tmp_path, shm_dir=str(shm_dir))) as running:
        yield running


# ------------------------------------------------------------------ (1) across tenants


def test_another_tenant_cannot_change_a_grpc_put_before_it_commits(auth_daemon, layout, tenants, shm_dir):
    """Tenant gamma maps everything it can and overwrites alpha's block while alpha's gRPC
    put has sent every byte but not committed: alpha's fetch returns alpha's bytes or a
    miss, never gamma's."""
    target, alpha, gamma = auth_daemon.unix_target, tenants.tokens["alpha"], tenants.tokens["gamma"]
    mine, theirs = os.urandom(layout.bytes_per_block), os.urandom(layout.bytes_per_block)
    tokens = list(range(4))
    put = PausedPut(target, alpha, layout, tokens, [mine])
    try:
        with Mappings(target, alpha, segment_dirs(shm_dir)) as own:
            wait_until(lambda: bool(own.holding(mine)), "alpha's pending block never appeared in its own segment")
        with Mappings(target, gamma, segment_dirs(shm_dir)) as attacker:
            attacker.overwrite(mine, theirs)
    finally:
        outcome = put.finish()
    assert isinstance(outcome, kvstore_pb2.PutResponse), outcome
    for plane in ("grpc", "local"):
        got = named(fetched(target, alpha, layout, tokens, plane), alpha=mine, gamma=theirs)
        assert got in (["alpha"], []), f"alpha's fetch over the {plane} plane returned {got}"


def test_another_tenant_cannot_read_committed_blocks(auth_daemon, layout, tenants, shm_dir):
    """Blocks alpha put (through shared memory and through gRPC) are in no mapping gamma
    can get; they are in alpha's own."""
    target, alpha, gamma = auth_daemon.unix_target, tenants.tokens["alpha"], tenants.tokens["gamma"]
    local_blocks = [os.urandom(layout.bytes_per_block) for _ in range(3)]
    grpc_blocks = [os.urandom(layout.bytes_per_block) for _ in range(3)]
    with Client(target, token=alpha, data_plane="local") as kv:
        assert kv.put(layout, list(range(12)), local_blocks).stored == 3
    with Client(target, token=alpha, data_plane="grpc") as kv:
        assert kv.put(layout, list(range(100, 112)), grpc_blocks).stored == 3
    with Client(target, token=gamma, data_plane="local") as kv:  # gamma has a segment too
        assert kv.put(layout, list(range(12)), [os.urandom(layout.bytes_per_block)]).stored == 1
    with Mappings(target, alpha, segment_dirs(shm_dir)) as own:
        assert all(own.holding(b) for b in local_blocks + grpc_blocks)
    with Mappings(target, gamma, segment_dirs(shm_dir)) as attacker:
        assert attacker.maps, "gamma may use the shared-memory plane: it maps a segment"
        leaked = {what for b in local_blocks + grpc_blocks for what in attacker.holding(b)}
        assert not leaked, f"gamma read alpha's blocks through {sorted(leaked)}"


# Run as the daemon's user without privileges. The tests may run as root, whom no file
# mode and no /proc check stops; then the daemon and the attacker both run as uid 0
# with every capability given up (the bounding set too, so that exec does not give
# them back): two ordinary processes of one uid.
UNPRIVILEGED = r"""
import ctypes, os, sys
if os.getuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last capability
    header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # capset(2), version 3
    if libc.capset(header, data) != 0:
        sys.exit(f"capset failed: {os.strerror(ctypes.get_errno())}")
os.execv(sys.argv[1], sys.argv[1:])
"""


def unprivileged(args: list[str]) -> list[str]:
    return [sys.executable, "-c", UNPRIVILEGED, *args]


# Looks for `pattern` through the open files and mappings of the daemon (`daemon:PID`)
# and of another tenant's client (`client:PID`), the daemon's memory, and segment files
# by name (`dir:PATH`). A client's memory is left alone: processes that may ptrace each
# other can read each other's memory whatever kvstore does.
ATTACK = r"""
import json, mmap, os, stat, sys
pattern, targets = bytes.fromhex(sys.argv[1]), [a.split(":", 1) for a in sys.argv[2:]]
found, refused = [], []

def scan(path, what):
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        refused.append(f"{what}: {exc.strerror}")
        return
    try:
        size = os.fstat(fd).st_size
        if size and mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ).find(pattern) >= 0:
            found.append(what)
    except (OSError, ValueError) as exc:
        refused.append(f"{what}: {exc}")
    finally:
        os.close(fd)

def scan_process(pid, memory):
    for sub in ("fd", "map_files"):
        try:
            names = os.listdir(f"/proc/{pid}/{sub}")
        except OSError as exc:
            refused.append(f"/proc/{pid}/{sub}: {exc.strerror}")
            names = []
        for name in names:
            scan(f"/proc/{pid}/{sub}/{name}", f"/proc/{pid}/{sub}/{name}")
    if not memory:
        return
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                start, end = (int(x, 16) for x in span.split("-"))
                if "r" not in perms or end - start > 1 << 30:
                    continue
                try:
                    mem.seek(start)
                    if mem.read(end - start).find(pattern) >= 0:
                        found.append(f"/proc/{pid}/mem")
                        break
                except OSError:
                    continue
    except OSError as exc:
        refused.append(f"/proc/{pid}/mem: {exc.strerror}")

for kind, arg in targets:
    if kind == "dir":
        for name in os.listdir(arg):
            if name.startswith("kvstore-"):
                scan(os.path.join(arg, name), os.path.join(arg, name))
    else:
        scan_process(int(arg), memory=kind == "daemon")
print(json.dumps({"found": found, "refused": refused}))
"""


# A tenant's engine: puts a block through shared memory, says so, and holds its mapping
# until its stdin closes.
TENANT_CLIENT = r"""
import sys
from kvstore.client import Client, KVLayout
target, token, block = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
layout = KVLayout(model="test/tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=4)
with Client(target, token=token, data_plane="local") as kv:
    assert kv.put(layout, list(range(100, 104)), [block]).stored == 1
    print("ready", flush=True)
    sys.stdin.read()
"""


@pytest.mark.e2e
def test_a_process_of_the_daemons_uid_cannot_open_a_tenants_segment(layout):
    """A real daemon with auth on, and tenants putting through shared memory (one of them
    an engine process of its own); another process of the daemon's uid, without
    privileges, tries the daemon's /proc (open files, mappings, memory), the engine's open
    files and mappings, and the segment files by name: none yields a tenant's bytes."""
    work = Path(tempfile.mkdtemp(prefix="kvstore-iso-"))
    try:
        tokens = Tenants(work / "tokens.toml")
        shm = work / "shm"
        shm.mkdir()
        sock = work / "kv.sock"
        log = open(work / "daemon.log", "wb")
        env = {**clean_env(), "HOME": str(work)}
        daemon = subprocess.Popen(unprivileged(
            [sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix:{sock}", "--auth-token-file",
             str(tokens.path), "--shm-dir", str(shm), "--host-capacity", "16MiB", "--metrics-listen", "off",
             "--log-level", "warning", "--grace-s", "1"]),
            env=env, cwd=str(Path(__file__).resolve().parents[2]), stdout=subprocess.DEVNULL, stderr=log)
        try:
            target = f"unix:{sock}"
            deadline = time.monotonic() + 60
            while True:
                assert daemon.poll() is None, (work / "daemon.log").read_text()
                try:
                    with Client(target, token=tokens.tokens["ops"], timeout_s=2) as kv:
                        kv.stats()
                    break
                except Exception:
                    assert time.monotonic() < deadline, "the daemon did not start"
                    time.sleep(0.1)
            secret, theirs = os.urandom(layout.bytes_per_block), os.urandom(layout.bytes_per_block)
            engine = subprocess.Popen(unprivileged([sys.executable, "-c", TENANT_CLIENT, target, tokens.tokens["gamma"],
                                                    theirs.hex()]), env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            try:
                assert engine.stdout is not None and engine.stdout.readline().strip() == "ready"
                with Client(target, token=tokens.tokens["alpha"], data_plane="local") as kv:
                    assert kv.data_plane_in_use == "local"
                    assert kv.put(layout, list(range(8)), [secret, secret[::-1]]).stored == 2
                    for pattern in (secret, theirs):
                        attack = subprocess.run(
                            unprivileged([sys.executable, "-c", ATTACK, pattern.hex(), f"daemon:{daemon.pid}",
                                          f"client:{engine.pid}", f"dir:{shm}", "dir:/dev/shm"]),
                            env=env, capture_output=True, text=True, timeout=120)
                        assert attack.returncode == 0, attack.stderr
                        found = json.loads(attack.stdout)["found"]
                        assert found == [], f"another process of the daemon's uid read a tenant's block through {found}"
                    assert [bytes(b) for b in kv.fetch(layout, list(range(8)))] == [secret, secret[::-1]]
            finally:
                engine.communicate(timeout=60)
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(30)
            log.close()
            for seg in Path("/dev/shm").glob(f"kvstore-{daemon.pid}-*"):
                seg.unlink(missing_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ (2) late copies, one tenant


def test_a_late_copy_into_an_aborted_puts_slot_never_changes_what_is_served(open_daemon, layout, shm_dir):
    """A client begins a local put, aborts it, and copies into the slot anyway, after the
    daemon has given that slot to a gRPC put that has every byte but has not committed:
    the gRPC put's block is served as it was sent, or not at all."""
    target = open_daemon.unix_target
    with grpc.insecure_channel(target) as channel, Mappings(target, None, segment_dirs(shm_dir)) as seg:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        data_offset = stub.LocalSegment(kvstore_pb2.LocalSegmentRequest()).data_offset
        m = seg.maps[0][1]  # the one segment, by whichever path
        begun = stub.LocalPut(kvstore_pb2.LocalPutRequest(header=put_header(layout, list(range(4)))))
        at = data_offset + begun.offsets[0]
        stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True))
        sent, late = os.urandom(layout.bytes_per_block), os.urandom(layout.bytes_per_block)
        tokens = list(range(100, 104))
        put = PausedPut(target, None, layout, tokens, [sent])
        try:
            wait_until(lambda: m[at:at + len(sent)] == sent, "the gRPC put did not land in the aborted put's slot")
            m[at:at + len(late)] = late  # the late copy
        finally:
            outcome = put.finish()
        assert isinstance(outcome, kvstore_pb2.PutResponse), outcome
    for plane in ("grpc", "local"):
        got = named(fetched(target, None, layout, tokens, plane), sent=sent, late=late)
        assert got in (["sent"], []), f"the fetch over the {plane} plane returned {got}"


def host_used(target: str) -> int:
    with Client(target) as kv:
        return next(t for t in kv.stats().tiers if t.name == "host").used_bytes


@pytest.mark.parametrize("how", ["handed back", "expired"])
def test_a_late_copy_into_a_reservation_no_longer_held_never_changes_what_is_served(tmp_path, layout, shm_dir, how):
    """The same for the slots of a reservation (`reserve_ahead`) the client no longer
    holds, given back or expired (`put_idle_timeout_s`), when it copies into them."""
    with daemon_in_thread(make_config(tmp_path, shm_dir=str(shm_dir), put_idle_timeout_s=2.0)) as running:
        target = running.unix_target
        with grpc.insecure_channel(target) as channel, Mappings(target, None, segment_dirs(shm_dir)) as seg:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            data_offset = stub.LocalSegment(kvstore_pb2.LocalSegmentRequest()).data_offset
            m = seg.maps[0][1]  # the one segment, by whichever path
            begun = stub.LocalPut(kvstore_pb2.LocalPutRequest(header=put_header(layout, list(range(4))),
                                                              reserve_ahead=1))
            assert begun.reservation.reservation_id
            reserved = [data_offset + off for off in begun.reservation.offsets]
            stub.LocalCommit(kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True))
            if how == "handed back":
                stub.LocalCommit(kvstore_pb2.LocalCommitRequest(reservation_id=begun.reservation.reservation_id,
                                                                abort=True))
            else:  # the daemon's sweep takes the slots back once the reservation's time is up
                wait_until(lambda: host_used(target) == 0, "the reservation did not expire")
            sent = [os.urandom(layout.bytes_per_block) for _ in range(2)]
            late = os.urandom(layout.bytes_per_block)
            tokens = list(range(200, 208))
            put = PausedPut(target, None, layout, tokens, sent)
            try:
                wait_until(lambda: m[reserved[0]:reserved[0] + len(late)] in sent,
                           "the gRPC put did not land in the reservation's slot")
                m[reserved[0]:reserved[0] + len(late)] = late
            finally:
                outcome = put.finish()
            assert isinstance(outcome, kvstore_pb2.PutResponse), outcome
        for plane in ("grpc", "local"):
            got = named(fetched(target, None, layout, tokens, plane), sent0=sent[0], sent1=sent[1], late=late)
            assert got == ["sent0", "sent1"][: len(got)], f"the fetch over the {plane} plane returned {got}"


async def test_a_cancelled_put_returns_only_after_its_copy_stopped(daemon_thread, layout, monkeypatch):
    """AsyncClient: a put cancelled while its blocks are being copied into its slots raises
    only once the copy has finished (and after the slots were handed back), so nothing
    of it can still be writing into slots the daemon has given to someone else."""
    from kvstore.client._local import LocalPlane

    real_copy_in = LocalPlane.copy_in
    entered, finished = threading.Event(), threading.Event()

    def slow_copy_in(self, offsets, blocks):  # type: ignore[no-untyped-def]
        entered.set()
        time.sleep(0.5)  # the window in which the caller's put is cancelled
        try:
            return real_copy_in(self, offsets, blocks)
        finally:
            finished.set()

    tokens = list(range(300, 308))
    async with AsyncClient(daemon_thread.unix_target, data_plane="local") as kv:
        assert await kv.data_plane_in_use() == "local"
        monkeypatch.setattr(LocalPlane, "copy_in", slow_copy_in)
        task = asyncio.ensure_future(kv.put(layout, tokens, [os.urandom(layout.bytes_per_block)] * 2))
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set(), "the put's error surfaced while its copy was still writing into the slots"
        monkeypatch.undo()
        assert (await kv.lookup(layout, tokens)).num_blocks == 0


# ------------------------------------------------------------------ (4) auth on, end to end


def memfd_resident_bytes() -> tuple[int, int]:
    """(how many memfd segments this process holds, the bytes of memory they hold)."""
    seen: dict[tuple[int, int], int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:kvstore"):
                continue
            st = os.fstat(int(name))
        except OSError:
            continue
        seen[st.st_dev, st.st_ino] = st.st_blocks * 512  # a mapping holds a descriptor of its own
    return len(seen), sum(seen.values())


def test_tenants_put_and_fetch_through_their_own_segments_across_tiers(tmp_path, tenants, shm_dir):
    """Auth on, two tenants with the shared-memory plane, a host tier far smaller than what
    they put and an SSD tier below: every block comes back intact through the SDK (from
    host memory, and from SSD with promotion), neither tenant's mapping holds the other's
    blocks, and the segments together never hold more memory than the host tier's
    capacity (plus a header page each)."""
    layout = KVLayout(model="test/iso", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=256,
                      block_size_tokens=4)  # 16 KiB blocks
    host_capacity = 1 << 20
    cfg = make_config(tmp_path, auth_token_file=str(tenants.path), shm_dir=str(shm_dir), host_capacity=host_capacity,
                      ssd_path=str(tmp_path / "ssd"), ssd_capacity=64 << 20, ssd_region_size=1 << 20)
    names = ("alpha", "gamma")
    with daemon_in_thread(cfg) as running:
        target = running.unix_target
        data = {name: [[os.urandom(layout.bytes_per_block) for _ in range(8)] for _ in range(12)] for name in names}
        prompts = [list(range(1000 * i, 1000 * i + 32)) for i in range(12)]
        clients = {name: Client(target, token=tenants.tokens[name]) for name in names}
        try:
            for kv in clients.values():
                assert kv.data_plane_in_use == "local"
                assert kv.control_plane_in_use == "lane"
            for i, prompt in enumerate(prompts):  # 2 x 12 x 8 blocks of 16 KiB: 3 MiB into 1 MiB of host
                for name, kv in clients.items():
                    assert kv.put(layout, prompt, data[name][i]).stored == 8
            with Client(target, token=tenants.tokens["ops"]) as ops:
                host = next(t for t in ops.stats().tiers if t.name == "host")
                assert host.demotions > 0
            for round_ in range(2):  # the second round is served from where the first promoted to
                for i, prompt in enumerate(prompts):
                    for name, kv in clients.items():
                        got = [bytes(b) for b in kv.fetch(layout, prompt)]
                        assert got == data[name][i], f"{name} prompt {i} round {round_}"
            with Client(target, token=tenants.tokens["ops"]) as ops:
                host = next(t for t in ops.stats().tiers if t.name == "host")
                assert host.promotions > 0
            count, resident = memfd_resident_bytes()
            assert resident <= host_capacity + count * 4096, (count, resident)
        finally:
            for kv in clients.values():
                kv.close()
        for name, other in (("alpha", "gamma"), ("gamma", "alpha")):
            with Mappings(target, tenants.tokens[name], segment_dirs(shm_dir)) as mine:
                assert mine.maps
                seen = {what for blocks in data[other] for b in blocks for what in mine.holding(b)}
                assert not seen, f"{name} could read {other}'s blocks through {sorted(seen)}"


# ------------------------------------------------------------------ the device plane


async def test_the_device_plane_is_refused_while_several_tenants_may_use_the_local_planes():
    """A CUDA IPC handle opens the whole HBM slab, every tenant's blocks: with two tenants
    granted local_plane, the device plane's calls are FAILED_PRECONDITION (the SDK then
    moves CUDA tensors through host memory). An HBM-named memory tier stands in for the
    slab: the refusal comes before any CUDA call."""
    from kvstore.core.policies import LRUPolicy
    from kvstore.core.store import Store, StoreTier
    from kvstore.errors import FailedPrecondition
    from kvstore.server.device_plane import DevicePlane
    from kvstore.tiers.memory import MemoryTier

    store = Store([StoreTier(MemoryTier(1 << 20, name="hbm"), LRUPolicy())])
    try:
        tenants = [2]
        plane = DevicePlane(store, None, lambda: tenants[0])  # type: ignore[arg-type]  # never reached
        for call in (plane.segment, lambda: plane.fetch(kvstore_pb2.LocalFetchRequest()),
                     lambda: plane.put(kvstore_pb2.LocalPutRequest())):
            with pytest.raises(FailedPrecondition, match="every tenant's blocks"):
                outcome = call()
                if asyncio.iscoroutine(outcome):
                    await outcome
    finally:
        store.close()
