"""The SDK's verbs, each described once and without I/O (the h11 / httpcore pattern):
`Client` and `AsyncClient` drive the same plans, one inline, one awaiting.

A plan is what a verb does, as data. Most verbs are one unary call: their plan is a
single `Unary` step, which a driver runs without a generator (the lookup path pays
for no more than that). A verb of several steps is a generator that yields steps,
receives each one's outcome, and returns the verb's result.

Steps:
- `Unary(name, request, timeout_s, answer)`: one unary KVStore call, over the control
  lane or gRPC; the plan receives `answer(response)` (the response itself by default).
- `StreamFetch(request, assembler, timeout_s)`: the Fetch server stream (block bytes in
  gRPC messages); the driver feeds each message to `assembler` and sends back None.
- `StreamPut(prepared, timeout_s)`: the Put client stream (a header, then each block in
  chunks, as gRPC bytes); the plan receives the PutResponse.
- `Blocking(fn, *args)`: work that holds the thread (a shared-memory or device copy,
  waiting for the segment's mapping, a data lane transfer): the blocking driver runs it
  inline, the asyncio one in a worker thread so the event loop never stalls (and calls
  its `cancel`, if any, when the awaiting task is cancelled). The plan receives its return.

A step that fails is thrown into the plan where it yielded it, so a plan's own
`try`/`except` sees the same exception the caller would (a put aborts its slots there).

`ClientState` is what a client keeps between calls (its options, the attached data
planes, held slots, leases to end) and what plans read and update; `Client` and
`AsyncClient` add only their I/O: the channel and its stubs, the lane, the driver.

Across a daemon restart. Whatever a client attached to belongs to one start of the
daemon (its boot id: `kvstore.server.generation`), which every plane tells (the
`LocalSegment`, `DeviceSegment` and `DataLane` answers, the control lane's hello, the
data lane's WELCOME). The calls that name what a start handed out (slots of its
segment, a reservation, a lease, a transfer) carry the boot id of the attachment they
use, and a daemon started since refuses them (`DaemonRestarted`) before it hands out or
publishes anything. A new boot id, learned from a refusal or from a plane (`learn`),
makes the client let go of what it held of the old start: the planes are retired
(a mapping is unmapped once the copies in it have finished), held slots and leases to
end are dropped, and the next call attaches anew. `put` and `fetch` are then run once
more (`_again`): a put is idempotent (a block stored already is not stored again), a
fetch a read. An engine that keeps its client across a restart so sees at most a miss.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from kvstore.client._assembler import FetchAssembler
from kvstore.client._buffers import (
    all_cuda,
    any_cuda,
    host_blocks,
    is_cuda,
    out_buffers,
    upload_blocks,
    writable_view,
)
from kvstore.client._groups import (
    GroupedFetchAssembler,
    grouped_fetch_request,
    grouped_header,
    host_blocks_of_parts,
    part_sizes,
    parts_result,
    prepare_grouped_put,
    wire_parts,
)
from kvstore.client._held import HeldReservations, check_reserve_ahead
from kvstore.client._local import LocalPlane
from kvstore.client._options import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_TIMEOUT_S,
    check_control_plane,
    check_data_plane,
    may_be_local,
    resolve_target,
)
from kvstore.client._quantized import dequantize_blocks, quantize_blocks
from kvstore.client._requests import (
    EngineNames,
    PreparedPut,
    block_keys,
    device_put_header,
    fetch_keys,
    lookup_request,
    namespace_ref,
    prefetch_request,
    prepare_put,
    response_keys,
    reuse_hint,
)
from kvstore.client.control_lane import lane_socket, segment_over_lane
from kvstore.client.data_lane import (
    DEFAULT_CONNECTIONS,
    DataLane,
    DataLaneStats,
    LaneCall,
    LaneMove,
    TransferPlan,
    check_codec_mode,
    choose_endpoint,
    fetch_transfer,
    grouped_fetch_transfer,
    grouped_put_transfer,
    put_transfer,
)
from kvstore.client.results import (
    LookupResult,
    PinResult,
    PrefetchResult,
    PutResult,
    lookup_result,
    pin_result,
    prefetch_result,
    put_result,
    response_hashes,
)
from kvstore.client.security import Security
from kvstore.codec_chooser import Choice, CodecChooser
from kvstore.errors import (
    RESTARTED_PREFIX,
    DaemonRestarted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _same(resp: Any) -> Any:
    return resp


class Unary(Generic[T]):
    """One unary KVStore call (over the lane, else gRPC); the plan gets `answer(response)`."""

    # A plain slotted class, not a frozen dataclass: one is made per lookup, and a
    # frozen dataclass's __init__ costs several times as much.
    __slots__ = ("name", "request", "timeout_s", "answer")

    def __init__(self, name: str, request: Any, timeout_s: float, answer: Callable[[Any], T] = _same) -> None:
        self.name = name
        self.request = request
        self.timeout_s = timeout_s
        self.answer = answer


class Blocking:
    """Work that holds the thread: inline when blocking, in a worker thread under asyncio.
    `cancel`, if set, makes the work end at once (the asyncio driver calls it when the
    awaiting task is cancelled, so the worker thread does not run on to its deadline)."""

    __slots__ = ("fn", "args", "cancel")

    def __init__(self, fn: Callable[..., Any], *args: Any, cancel: Callable[[], None] | None = None) -> None:
        self.fn = fn
        self.args = args
        self.cancel = cancel


class StreamFetch:
    """The Fetch server stream: the driver feeds each message to `assembler`."""

    __slots__ = ("request", "assembler", "timeout_s")

    def __init__(self, request: kvstore_pb2.FetchRequest, assembler: FetchAssembler | GroupedFetchAssembler, timeout_s: float) -> None:
        self.request = request
        self.assembler = assembler
        self.timeout_s = timeout_s


class StreamPut:
    """The Put client stream: a header, then each block in chunks (see `put_requests`)."""

    __slots__ = ("prepared", "timeout_s")

    def __init__(self, prepared: PreparedPut, timeout_s: float) -> None:
        self.prepared = prepared
        self.timeout_s = timeout_s


Step = Unary[Any] | Blocking | StreamFetch | StreamPut
Plan = Generator[Step, Any, T]


class ClientState:
    """What a client keeps between calls, whichever I/O style drives it; no I/O here."""

    def __init__(self, target: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, data_plane: str = "auto", token: str | None = None,
                 token_file: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, reserve_ahead: int = 0, control_plane: str = "auto",
                 data_lane_connections: int = DEFAULT_CONNECTIONS, lane_codec: str = "auto") -> None:
        """Connect to a kvstore daemon (lazily: nothing is sent before the first call).

        `target` is `unix:PATH`, a socket path, or `HOST:PORT`; None reads `KVSTORE_TARGET`
        and then falls back to the daemon's default socket or 127.0.0.1:50051. Every call
        takes `timeout_s` (default `DEFAULT_TIMEOUT_S`); idempotent calls are retried on
        UNAVAILABLE. Failures raise `kvstore.errors` exceptions. Put streams carry block
        bytes in messages of `chunk_bytes`.

        `data_plane`: `auto` moves block bytes through the daemon's shared-memory segment
        when this process can map it (same host, same user), else, for a TCP target, on
        the daemon's data lane when it offers one (sockets of its own, one large frame per
        block: docs/net.md), else through gRPC messages; `local` insists on shared
        memory, `lane` on the data lane; `grpc` uses neither. All give byte-identical
        results. `data_plane_in_use` tells which one is active. A transfer on the data
        lane uses up to `data_lane_connections` sockets at once (fewer if the daemon
        allows fewer). `lane_codec`: the lossless codec of those transfers, `auto`
        (chosen per transfer from what this client measured of the link and of the codecs
        on each namespace's blocks: docs/codecs.md; `codec_stats` shows it), `raw`, or one
        codec always (`shuffle-lz4`, `shuffle-zstd`), where the daemon offers it.

        `reserve_ahead` (shared-memory plane only): after each put, the daemon holds up to
        this many empty slots for this client's next put of the same block size, which then
        takes one round trip instead of two. The slots hold host-tier capacity while they
        wait (at most 30 s), so it is off (0) by default; a steady writer such as an engine
        saving its KV each step gains from `reserve_ahead` = its usual blocks per put.

        `control_plane`: `auto` sends the unary calls (lookup, the local data plane's
        put/commit/fetch, pin, delete...) over the daemon's local control lane when the target
        is a Unix socket and the lane answers, and over gRPC otherwise; `lane` insists on it;
        `grpc` never uses it. `control_plane_in_use` tells which one is active.

        `token` (or `token_file`, else `KVSTORE_TOKEN` / `KVSTORE_TOKEN_FILE`) is sent as a
        bearer token on every call; `tls_ca` (else `KVSTORE_TLS_CA`) turns on TLS with those
        roots, and `tls_cert`/`tls_key` present a client certificate (mTLS).
        """
        self.target = resolve_target(target)
        self.control_plane = check_control_plane(control_plane, self.target)
        self.reserve_ahead = check_reserve_ahead(reserve_ahead)
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.data_plane = check_data_plane(data_plane)
        if not 1 <= data_lane_connections <= 64:
            raise InvalidArgument(f"data_lane_connections must be in [1, 64], got {data_lane_connections}")
        self.data_lane_connections = data_lane_connections
        self.lane_codec = check_codec_mode(lane_codec)
        self.codecs = CodecChooser()
        self.security = Security.resolve(token, token_file, tls_ca, tls_cert, tls_key)
        self._plane: LocalPlane | None = None
        # (Whether a plane is never tried, kept to try it again after a restart.)
        self._plane_never = data_plane in ("grpc", "lane") or (data_plane == "auto" and not may_be_local(self.target))
        self._plane_tried = self._plane_never
        # The data lane: offered by the daemon (a DataLane call), tried when shared memory
        # is not in use; in `auto`, only for TCP targets (a Unix socket's client is local).
        self._datalane: DataLane | None = None
        self._datalane_never = data_plane in ("grpc", "local") or (data_plane == "auto"
                                                                   and self.target.startswith("unix:"))
        self._datalane_tried = self._datalane_never
        # The device (CUDA IPC) plane: opened on the first put or fetch of CUDA tensors.
        self._device: Any = None
        self._device_tried = False
        # Empty slots the daemon holds for this client's next puts, by block size: such a
        # put takes one round trip instead of two.
        self._reserved = HeldReservations()
        # Leases of finished shared-memory fetches, ended by the next local call instead
        # of an Unpin each (they also expire on their own): (lease id, boot id of the
        # daemon's start that granted it).
        self._releases: list[tuple[str, int]] = []
        # The start of the daemon this client's attachments belong to (its boot id; 0
        # until a plane tells it), and how many times it changed (`learn`). See the
        # module docstring.
        self._generation = 0
        self._epoch = 0
        self._learning = threading.Lock()
        # The local control lane (a Unix socket next to the daemon's gRPC one).
        self._open(lane_socket(self.target) if self.control_plane != "grpc" else None)

    def _open(self, lane_path: str | None) -> None:
        """Make the channel, its stubs and the lane (at `lane_path`, if any): the driver's I/O."""
        raise NotImplementedError

    @property
    def device_plane_in_use(self) -> bool:
        """Whether puts and fetches of CUDA tensors copy device-to-device (CUDA IPC); known
        after the first such call."""
        return self._device is not None

    def _t(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    def _take_releases(self, boot_id: int) -> list[str]:
        """The leases to end with a call to the daemon's start `boot_id` (those of other
        starts went with them)."""
        taken, self._releases = self._releases, []
        return [lease_id for lease_id, granted_by in taken if granted_by == boot_id]

    @property
    def codec_stats(self) -> list[Choice]:
        """What this client's codec chooser knows, per link and namespace: the codec its
        next data lane transfer uses, the measured link rate, each codec's ratio and
        speed on the namespace's blocks, the bytes moved with each (docs/codecs.md)."""
        return self.codecs.snapshot()

    @property
    def data_lane_stats(self) -> DataLaneStats | None:
        """What the data lane moved for this client (None until it is in use): bytes each
        way, and blocks that failed their checksum on arrival (dropped, never returned)."""
        return self._datalane.stats() if self._datalane is not None else None

    def _detach(self) -> None:
        """Let go of the data planes (after `release_all`)."""
        if self._datalane is not None:
            self._datalane.close()
            self._datalane = None
        if self._device is not None:
            self._device.close()
            self._device = None
        if self._plane is not None:
            self._plane.close()
            self._plane = None


# ------------------------------------------------------------------ planes and close


def local_plane(c: ClientState) -> Plan[LocalPlane | None]:
    """The shared-memory plane, attached on first use; None when this process cannot map
    the daemon's segment (an error when the caller insisted on it).

    The segment is asked for over the control lane first, on a connection of its own:
    with auth on the daemon hands it out only there, as a file descriptor (the caller's
    own tenant's segment). Without a lane, over gRPC, which names a path (auth off) or
    refuses (auth on: block bytes then go through Put and Fetch)."""
    if c._plane_tried:
        return c._plane
    c._plane_tried = True
    epoch = c._epoch
    try:
        lane = lane_socket(c.target) if c.control_plane != "grpc" else None
        got = None
        if lane is not None:
            got = yield Blocking(segment_over_lane, lane, c.security.token, c.timeout_s)
        if got is None:
            got = (yield Unary("LocalSegment", kvstore_pb2.LocalSegmentRequest(), c.timeout_s)), None
        learn(c, got[0].boot_id, epoch)
        plane = LocalPlane.attach(*got)
        if plane.boot_id != c._generation and c._generation:
            # Another thread learned another start while this one attached: this segment
            # may be the old start's. Not kept; the next call attaches again.
            plane.close()
            c._plane_tried = c._plane_never
            raise DaemonRestarted(f"{RESTARTED_PREFIX} while this client attached (now {c._generation:016x})")
        c._plane = plane
    except DaemonRestarted:
        c._plane_tried = c._plane_never
        raise
    except (KVStoreError, OSError, ValueError) as exc:
        if c.data_plane == "local":
            raise FailedPrecondition(f"cannot use the shared-memory data plane: {exc}") from None
        if isinstance(exc, PermissionDenied):
            # A co-located engine whose tenant lacks the grant: a setting to fix, not a
            # property of the host, so said where an operator looks.
            logger.warning("shared-memory data plane refused (%s); block bytes go through gRPC. Grant it with "
                           "`local_plane = true` in this tenant's token-file entry (kvstore token new "
                           "--local-plane)", exc)
        else:
            logger.info("shared-memory data plane unavailable (%s); block bytes go through gRPC", exc)
    return c._plane


def device_plane(c: ClientState) -> Plan[Any]:
    """The device plane, opened on the first put or fetch of CUDA tensors; None unless the
    daemon's HBM tier can be opened from this process (same host, same GPU, another
    process)."""
    if c._device_tried:
        return c._device
    plane = yield from local_plane(c)
    c._device_tried = True
    if plane is None:
        return None
    from kvstore.client._device import DevicePlane

    try:
        resp = yield Unary("DeviceSegment", kvstore_pb2.DeviceSegmentRequest(), c.timeout_s)
        if resp.boot_id != plane.boot_id:
            # Another start than the host segment's: the daemon restarted in between.
            c._device_tried = False
            raise DaemonRestarted(f"{RESTARTED_PREFIX} while this client attached (now {resp.boot_id:016x})")
        c._device = DevicePlane.attach(resp, plane.token, resp.boot_id)
    except (KVStoreError, ValueError) as exc:
        logger.info("device data plane unavailable (%s); CUDA blocks go through host memory", exc)
    return c._device


def data_lane(c: ClientState) -> Plan[DataLane | None]:
    """The daemon's data lane, set up on first use from its DataLane offer; None when it
    offers none (or predates it), or, in `auto`, while it cannot be reached."""
    if not c._datalane_tried:
        forced = c.data_plane == "lane"
        epoch = c._epoch
        try:
            offer = yield Unary("DataLane", kvstore_pb2.DataLaneRequest(), c.timeout_s)
        except (Unauthenticated, PermissionDenied, Unavailable, DeadlineExceeded):
            raise  # what the call itself would meet over gRPC; asked again next time
        except KVStoreError as exc:  # UNIMPLEMENTED: a daemon that predates the lane
            c._datalane_tried = True
            if forced:
                raise FailedPrecondition(f"cannot use the data lane: {exc}") from None
            logger.info("no data lane (%s); block bytes go through gRPC", exc)
            return None
        c._datalane_tried = True
        try:
            endpoint = choose_endpoint(offer, c.target)
            if endpoint is None:
                raise FailedPrecondition("the daemon offers no data lane for this target (data_lane_listen)")
            learn(c, offer.boot_id, epoch)
            if offer.boot_id and c._generation and offer.boot_id != c._generation:
                raise DaemonRestarted(f"{RESTARTED_PREFIX} while this client attached (now {c._generation:016x})")
            c._datalane = DataLane(endpoint, c.security, max_connections=min(offer.max_connections or 1,
                                                                         c.data_lane_connections),
                                   codec=c.lane_codec, chooser=c.codecs, boot_id=offer.boot_id)
        except KVStoreError as exc:
            if forced:
                raise FailedPrecondition(f"cannot use the data lane: {exc}") from None
            logger.info("no data lane (%s); block bytes go through gRPC", exc)
    lane = c._datalane
    if lane is not None and c.data_plane == "auto" and not lane.usable():
        return None
    return lane


def data_plane_in_use(c: ClientState) -> Plan[str]:
    if (yield from local_plane(c)) is not None:
        return "local"
    return "lane" if (yield from data_lane(c)) is not None else "grpc"


def warm_up(c: ClientState, timeout_s: float) -> Plan[str]:
    plane = yield from local_plane(c)
    if plane is None:
        lane = yield from data_lane(c)
        if lane is None:
            return "grpc"
        lane.checkin((yield Blocking(lane.checkout, 1, timeout_s)))
        return "lane"
    yield Blocking(plane.wait_ready, timeout_s)
    return "local"


def release_all(c: ClientState) -> Plan[None]:
    """Hand back what the daemon holds for this client (held slots, leases of finished
    fetches) on close; whatever cannot be handed back expires by itself."""
    timeout = min(1.0, c.timeout_s)
    for held in c._reserved.take_all():
        try:
            yield Unary("LocalCommit", kvstore_pb2.LocalCommitRequest(
                reservation_id=held.reservation_id, abort=True, boot_id=held.boot_id), timeout)
        except KVStoreError:
            pass
    releases, c._releases = c._releases, []
    for lease_id, boot_id in releases:
        try:
            yield Unary("Unpin", kvstore_pb2.UnpinRequest(lease_id=lease_id, boot_id=boot_id), timeout)
        except KVStoreError:
            pass


# ------------------------------------------------------------------ daemon restarts


def learn(c: ClientState, boot_id: int, epoch: int) -> None:
    """An answer to a call sent at `epoch` (`c._epoch` then) told the daemon's boot id
    (0: it told none). A new one means the daemon restarted since this client attached:
    what the client holds of the old start is let go, and the next call attaches anew
    (module docstring). An answer to a call sent before the client last learned a start
    may be the old start's, read late (another thread's): it teaches nothing."""
    if not boot_id or boot_id == c._generation:
        return
    with c._learning:
        if epoch != c._epoch or boot_id == c._generation:
            return
        if c._generation:
            logger.warning("the kvstore daemon at %s restarted (generation %016x, now %016x): attaching to it again",
                           c.target, c._generation, boot_id)
        c._generation = boot_id
        c._epoch += 1
        _let_go(c, boot_id)


def _let_go(c: ClientState, boot_id: int) -> None:
    """Retire every attachment of another start than `boot_id`: a mapping is unmapped
    once the copies running in it finish (another thread's call may be in one; the
    daemon refuses what it then sends), the lanes are closed; held slots and leases of
    those starts are dropped (they went with them)."""
    plane = c._plane
    if plane is not None and plane.boot_id != boot_id:
        c._plane, c._plane_tried = None, c._plane_never
        plane.retire()
    device = c._device
    if device is not None and device.boot_id != boot_id:
        c._device = None
        device.close()
    if c._device is None:
        c._device_tried = False
    lane = c._datalane
    if lane is not None and lane.boot_id != boot_id:
        c._datalane, c._datalane_tried = None, c._datalane_never
        lane.close()
    c._reserved.keep_only(boot_id)
    c._releases = [(lease_id, b) for lease_id, b in c._releases if b == boot_id]


def _again(c: ClientState, make: Callable[[], Plan[T]]) -> Plan[T]:
    """Run the plan `make()` makes; once more if the daemon refused it as a call of
    another start of its (`DaemonRestarted`), after letting go of what the client held
    of other starts than the current one. Only for idempotent verbs (a put, a fetch)."""
    epoch = c._epoch
    try:
        return (yield from make())
    except DaemonRestarted as exc:
        logger.info("%s; attaching again and calling once more", exc)
        learn(c, exc.boot_id, epoch)
        with c._learning:
            _let_go(c, c._generation)  # (also what the refused plan attached of a start read late)
    return (yield from make())


# ------------------------------------------------------------------ one-call verbs


def lookup(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None, lease_ms: int,
           session_id: str | None, expect_reuse_within_s: float | None, timeout_s: float) -> Unary[LookupResult]:
    # The packed-hash request is built in C (`lookup_request`); the caller's own hash
    # objects come back in the result when the daemon leaves them out of its answer.
    req, mine = lookup_request(layout, token_ids, block_hashes, lease_ms, reuse_hint(session_id, expect_reuse_within_s))
    return Unary("Lookup", req, timeout_s, lambda resp: lookup_result(resp, mine))


def delete(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
           timeout_s: float) -> Unary[int]:
    req = kvstore_pb2.DeleteRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes))
    return Unary("Delete", req, timeout_s, lambda resp: resp.deleted)


def pin(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None, ttl_ms: int,
        timeout_s: float) -> Unary[PinResult]:
    req = kvstore_pb2.PinRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                 ttl_ms=ttl_ms)
    return Unary("Pin", req, timeout_s, pin_result)


def unpin(c: ClientState, lease_id: str, timeout_s: float) -> Plan[bool]:
    epoch = c._epoch
    try:
        resp = yield Unary("Unpin", kvstore_pb2.UnpinRequest(lease_id=lease_id, boot_id=c._generation), timeout_s)
    except DaemonRestarted as exc:
        learn(c, exc.boot_id, epoch)
        return False  # the lease was an earlier start's, and went with it: nothing to release
    return bool(resp.released)


def hint(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
         session_id: str, expect_reuse_within_s: float, timeout_s: float) -> Unary[int]:
    req = kvstore_pb2.HintRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                  hint=reuse_hint(session_id, expect_reuse_within_s))
    return Unary("Hint", req, timeout_s, lambda resp: resp.hinted)


def end_session(session_id: str, timeout_s: float) -> Unary[None]:
    return Unary("EndSession", kvstore_pb2.EndSessionRequest(session_id=session_id), timeout_s, lambda resp: None)


def prefetch(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None, tier: str,
             timeout_s: float) -> Unary[PrefetchResult]:
    return Unary("Prefetch", prefetch_request(layout, token_ids, block_hashes, tier), timeout_s, prefetch_result)


def verify(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
           timeout_s: float) -> Unary[int]:
    req = kvstore_pb2.VerifyRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes))
    return Unary("Verify", req, timeout_s, lambda resp: resp.dropped)


# ------------------------------------------------------------------ fetch


def fetch(c: ClientState, layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
          out: Sequence[Any] | None, lease_id: str, timeout_s: float, quantized: bool = False) -> Plan[list[Any]]:
    """Verified blocks of the longest held prefix, into `out` if given: through shared
    memory when the plane is attached, else as gRPC bytes. A layout with KV groups:
    each block as a dict of its parts (`_fetch_parts`). A quantized layout: dequantized
    into the engine's dtype, unless `quantized`. Once more after a daemon restart (`_again`)."""
    if layout.kv_codec and not quantized:
        if out is not None:
            token_ids, block_hashes = _cut(layout, token_ids, block_hashes, len(out))
        stored = yield from fetch(c, layout, token_ids, block_hashes, None, lease_id, timeout_s, True)
        return list((yield Blocking(dequantize_blocks, layout, stored, out)))
    return (yield from _again(c, lambda: _fetch(c, layout, token_ids, block_hashes, out, lease_id, timeout_s)))


def _fetch(c: ClientState, layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
           out: Sequence[Any] | None, lease_id: str, timeout_s: float) -> Plan[list[Any]]:
    if layout.groups:
        return (yield from _fetch_parts(c, layout, token_ids, block_hashes, out, lease_id, timeout_s))
    keys = fetch_keys(layout, token_ids, block_hashes, out)
    if out is not None and any_cuda(out):
        return (yield from _fetch_to_cuda(c, layout, token_ids, block_hashes, keys, out, lease_id, timeout_s))
    plane = c._plane if c._plane_tried else (yield from local_plane(c))
    if plane is None:
        lane = None if c._datalane_tried and c._datalane is None else (yield from data_lane(c))
        if lane is not None:
            return (yield from fetch_lane(c, lane, layout, keys, out, lease_id, timeout_s))
        return (yield from fetch_stream(layout, keys, out, lease_id, timeout_s, c._generation))
    resp = yield Unary("LocalFetch", _slots_request(c, layout, keys, lease_id, plane.boot_id), timeout_s)
    n = len(resp.offsets)
    dsts = out_buffers(out, resp.num_blocks, resp.block_bytes)
    try:
        views = [writable_view(d, i, resp.block_bytes) for i, d in enumerate(dsts[:n])]
        good = yield Blocking(plane.copy_out, resp.offsets, resp.checksums, resp.block_bytes, views)
    finally:
        _lease_taken(c, resp, plane.boot_id)
    if good < n:
        yield _recheck(layout, resp, good, n, timeout_s)
        return dsts[:good]
    if resp.num_blocks > n:  # the rest sits in another tier: fetch it as bytes
        rest = yield from fetch_stream(layout, response_keys(resp, n, resp.num_blocks),
                                       dsts[n:] if out is not None else None, "", timeout_s)
        return dsts[:n] + rest
    return dsts[:n]


def _cut(layout: KVLayout, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
         blocks: int) -> tuple[Sequence[int] | None, Sequence[bytes] | None]:
    """The keys of at most `blocks` blocks (a fetch into that many buffers)."""
    if token_ids is not None:
        return token_ids[: blocks * layout.block_size_tokens], block_hashes
    return token_ids, (list(block_hashes)[:blocks] if block_hashes is not None else None)


def _fetch_parts(c: ClientState, layout: KVLayout, token_ids: Sequence[int] | None,
                 block_hashes: Sequence[bytes] | None, out: Sequence[Any] | None, lease_id: str,
                 timeout_s: float) -> Plan[list[Any]]:
    """A grouped fetch: the parts of the longest prefix every group serves, on the plane a
    plain fetch would take (shared memory, else the data lane, else gRPC bytes), all of
    them or none: a part that fails verification makes the whole fetch a miss. `out`:
    one mapping per block (group name to a buffer or CUDA tensor) filled in place,
    device to device when every one is a CUDA tensor and the device plane opens."""
    if out is not None:
        return (yield from _fetch_parts_into(c, layout, token_ids, block_hashes, out, lease_id, timeout_s))
    request = grouped_fetch_request(layout, token_ids, block_hashes, lease_id)
    if lease_id:
        request.boot_id = c._generation  # the start the lease is of (0: not told yet, not checked)
    plane = c._plane if c._plane_tried else (yield from local_plane(c))
    if plane is not None:
        resp = yield Unary("LocalFetch", _slots_request(c, layout, request.keys, lease_id, plane.boot_id), timeout_s)
        m = resp.num_blocks
        sizes = part_sizes(layout, m)
        if m and len(resp.offsets) == len(sizes):
            dsts = [bytearray(n) for n in sizes]
            try:
                good = yield Blocking(plane.copy_out, resp.offsets, resp.checksums, 0, [memoryview(d) for d in dsts])
            finally:
                _lease_taken(c, resp, plane.boot_id)
            if good < len(sizes):
                yield _recheck(layout, resp, 0, m, timeout_s)  # the daemon drops the bad part's block whole
                return []
            return parts_result(layout, m, dsts)
        _lease_taken(c, resp, plane.boot_id)
        if not m:
            return []
        # A part outside host memory: the prefix as a stream (the lookup's lease ended above).
        request = grouped_fetch_request(layout, token_ids, block_hashes, "")
    else:
        lane = None if c._datalane_tried and c._datalane is None else (yield from data_lane(c))
        if lane is not None:
            got = yield from _fetch_parts_lane(c, lane, layout, request, timeout_s)
            if got is not None:
                return got
            request = grouped_fetch_request(layout, token_ids, block_hashes, "")
    assembler = GroupedFetchAssembler(layout)
    yield StreamFetch(request, assembler, timeout_s)
    return assembler.result()


def _fetch_parts_into(c: ClientState, layout: KVLayout, token_ids: Sequence[int] | None,
                      block_hashes: Sequence[bytes] | None, out: Sequence[Any], lease_id: str,
                      timeout_s: float) -> Plan[list[Any]]:
    named = len(block_hashes) if block_hashes is not None else len(token_ids or ()) // layout.block_size_tokens
    if len(out) < named:
        raise InvalidArgument(f"out has {len(out)} mappings of parts for a fetch of {named} blocks; give one per block")
    if all(isinstance(o, Mapping) and o and all_cuda(list(o.values())) for o in out[:named]):
        device = yield from device_plane(c)
        if device is not None:
            keys = grouped_fetch_request(layout, token_ids, block_hashes, lease_id).keys
            resp = yield Unary("DeviceFetch", _slots_request(c, layout, keys, lease_id, device.boot_id), timeout_s)
            m = resp.num_blocks
            sizes = part_sizes(layout, m)
            if not m or len(resp.offsets) == len(sizes):
                dsts = wire_parts(layout, out[:m], "out") if m else []
                try:
                    good = (yield Blocking(device.copy_out, resp.offsets, resp.checksums, sizes, dsts)) if m else 0
                finally:
                    _lease_taken(c, resp, device.boot_id)
                if good < len(sizes):
                    yield _recheck(layout, resp, 0, m, timeout_s)
                    return []
                return list(out[:m])
            _lease_taken(c, resp, device.boot_id)  # a part outside the HBM tier: through host memory below
            lease_id = ""
    got = yield from _fetch_parts(c, layout, token_ids, block_hashes, None, lease_id, timeout_s)
    for j, block in enumerate(got):
        dst = out[j]
        if not isinstance(dst, Mapping):
            raise InvalidArgument(f"out[{j}] must map group names to buffers, got {type(dst).__name__}")
        for name, data in block.items():
            if name not in dst:
                raise InvalidArgument(f"out[{j}] lacks a buffer for group {name!r}, which the prefix needs")
            if is_cuda(dst[name]):
                upload_blocks([data], [dst[name]])
            else:
                writable_view(dst[name], j, len(data))[:] = data
    return list(out[: len(got)])


def _fetch_parts_lane(c: ClientState, lane: DataLane, layout: KVLayout, request: kvstore_pb2.FetchRequest,
                      timeout_s: float) -> Plan[list[Any] | None]:
    """A grouped fetch on the data lane (`kvstore.client.data_lane.grouped_fetch_transfer`):
    each group's parts land in buffers of that group's size, verified; None when the lane
    failed and the fetch goes through gRPC (in `auto`)."""
    try:
        conns = yield Blocking(lane.checkout, lane.connections_for(_blocks_named(request.keys, layout)), timeout_s)
    except Unavailable as exc:
        yield from _offered_again(c, lane)
        if not _set_aside(c, lane, exc):
            raise
        return None
    bufs: list[bytearray] = []

    def views(grant: kvstore_pb2.LaneFetchResponse) -> list[memoryview]:
        bufs.extend(bytearray(n) for n in part_sizes(layout, grant.prefix_blocks))
        return [memoryview(b) for b in bufs]

    got = yield from _on_lane(grouped_fetch_transfer(lane, conns, request, views, lambda: timeout_s,
                                                     fall_back=functools.partial(_set_aside, c, lane)))
    if got is None:
        return None
    m, landed = got
    return parts_result(layout, m, bufs) if landed == len(bufs) else []


def _fetch_to_cuda(c: ClientState, layout: KVLayout, token_ids: Sequence[int] | None,
                   block_hashes: Sequence[bytes] | None, keys: kvstore_pb2.BlockKeys, out: Sequence[Any],
                   lease_id: str, timeout_s: float) -> Plan[list[Any]]:
    """A fetch into CUDA tensors: device to device from the daemon's HBM tier when the
    device plane opens (every `out` on CUDA), else staged through host buffers."""
    device = (yield from device_plane(c)) if all_cuda(out) else None
    if device is None:
        staged = [bytearray(layout.bytes_per_block) for _ in out]
        got = yield from _fetch(c, layout, token_ids, block_hashes, staged, lease_id, timeout_s)
        upload_blocks(got, out)
        return list(out[: len(got)])
    resp = yield Unary("DeviceFetch", _slots_request(c, layout, keys, lease_id, device.boot_id), timeout_s)
    n = len(resp.offsets)
    dsts = list(out[: resp.num_blocks])
    try:
        good = yield Blocking(device.copy_out, resp.offsets, resp.checksums, resp.block_bytes, dsts[:n])
    finally:
        _lease_taken(c, resp, device.boot_id)
    if good < n:
        yield _recheck(layout, resp, good, n, timeout_s)
        return dsts[:good]
    if resp.num_blocks > n:
        # The rest sits in host memory or on SSD: fetch it as host bytes, then upload.
        rest = yield from _fetch(c, layout, None, response_hashes(resp)[n:], None, "", timeout_s)
        upload_blocks(rest, dsts[n:])
        return dsts[: n + len(rest)]
    return dsts[:n]


def fetch_stream(layout: KVLayout, keys: kvstore_pb2.BlockKeys, out: Sequence[Any] | None, lease_id: str,
                 timeout_s: float, boot_id: int = 0) -> Plan[list[Any]]:
    """A fetch as gRPC bytes (the Fetch stream), assembled into blocks or into `out`;
    `boot_id`: the daemon's start `lease_id` is of."""
    assembler = FetchAssembler(out)
    request = kvstore_pb2.FetchRequest(namespace=namespace_ref(layout), keys=keys, lease_id=lease_id,
                                       boot_id=boot_id if lease_id else 0)
    yield StreamFetch(request, assembler, timeout_s)
    return assembler.result()


def fetch_lane(c: ClientState, lane: DataLane, layout: KVLayout, keys: kvstore_pb2.BlockKeys,
               out: Sequence[Any] | None, lease_id: str, timeout_s: float) -> Plan[list[Any]]:
    """A fetch on the data lane (`kvstore.client.data_lane.fetch_transfer`): connections
    first (a lane that cannot be reached is found before the daemon holds anything), then
    LaneFetch opens the transfer, then the blocks land straight in their buffers,
    verified. In `auto`, a lane that fails is set aside for a while and the fetch goes
    through gRPC."""
    request = kvstore_pb2.FetchRequest(namespace=namespace_ref(layout), keys=keys, lease_id=lease_id)
    try:
        conns = yield Blocking(lane.checkout, lane.connections_for(_blocks_named(keys, layout)), timeout_s)
    except Unavailable as exc:
        yield from _offered_again(c, lane)
        if not _set_aside(c, lane, exc):
            raise
        return (yield from fetch_stream(layout, keys, out, lease_id, timeout_s, c._generation))
    dsts: list[Any] = []

    def views(grant: kvstore_pb2.LaneFetchResponse) -> list[memoryview]:
        dsts.extend(out_buffers(out, grant.num_blocks, grant.block_bytes))
        return [writable_view(d, i, grant.block_bytes) for i, d in enumerate(dsts)]

    got = yield from _on_lane(fetch_transfer(lane, conns, request, views, lambda: timeout_s,
                                             fall_back=functools.partial(_set_aside, c, lane)))
    if got is None:
        return (yield from fetch_stream(layout, keys, out, "", timeout_s))
    return dsts[:got]


def _blocks_named(keys: kvstore_pb2.BlockKeys, layout: KVLayout) -> int:
    """How many blocks a request's keys name (for how many connections to use)."""
    which = keys.WhichOneof("keys")
    if which == "packed_hashes":
        return len(keys.packed_hashes) // 16
    if which == "hashes":
        return len(keys.hashes.hashes)
    tokens = len(keys.tokens.packed_u32le) // 4 + len(keys.tokens.token_ids)
    return tokens // max(1, layout.block_size_tokens)


def _slots_request(c: ClientState, layout: KVLayout, keys: kvstore_pb2.BlockKeys, lease_id: str,
                   boot_id: int) -> kvstore_pb2.LocalFetchRequest:
    """A LocalFetch / DeviceFetch to the daemon's start `boot_id` (the plane's): the
    lookup lease (if any) ends here, as do the leases of this client's earlier fetches;
    the call takes its own lease on the slots."""
    return kvstore_pb2.LocalFetchRequest(
        namespace=namespace_ref(layout), keys=keys, boot_id=boot_id,
        release_lease_ids=c._take_releases(boot_id) + ([lease_id] if lease_id else []))


def _lease_taken(c: ClientState, resp: kvstore_pb2.LocalFetchResponse, boot_id: int) -> None:
    """The slots' lease ends with this client's next call (or by itself), not with an Unpin."""
    if resp.lease_id:
        c._releases.append((resp.lease_id, boot_id))


def _recheck(layout: KVLayout, resp: kvstore_pb2.LocalFetchResponse, good: int, n: int,
             timeout_s: float) -> Unary[Any]:
    """Blocks [good, n) failed verification after the copy: the daemon checks (and drops) them."""
    return Unary("Verify", kvstore_pb2.VerifyRequest(namespace=namespace_ref(layout),
                                                     keys=response_keys(resp, good, n)), timeout_s)


# ------------------------------------------------------------------ put


def put(c: ClientState, layout: KVLayout, token_ids: Sequence[int] | None, blocks: Sequence[Any], first_block: int,
        block_hashes: Sequence[bytes] | None, session_id: str | None, expect_reuse_within_s: float | None,
        timeout_s: float, wait_for_owners: bool = False, engine_names: EngineNames | None = None,
        quantized: bool = False) -> Plan[PutResult]:
    """Store `blocks`, all or nothing: device to device when they are CUDA tensors and the
    device plane opens; through shared memory (in one round trip when the daemon holds
    slots for this client, else two) when the plane is attached; else as gRPC bytes.
    `wait_for_owners`: in a pool, answer once the owners of the blocks' units committed them.
    `engine_names`: the engine's names for the blocks, for the daemon's KV events.
    A layout with KV groups: each block a mapping of group name to part (`_put_parts`).
    A quantized layout: the blocks are quantized here first, unless `quantized` (they are
    already). Once more after a daemon restart (`_again`: a re-put of a stored block is a
    no-op)."""
    if layout.kv_codec and not quantized:
        blocks = yield Blocking(quantize_blocks, layout, blocks)
    return (yield from _again(c, lambda: _put(c, layout, token_ids, blocks, first_block, block_hashes, session_id,
                                              expect_reuse_within_s, timeout_s, wait_for_owners, engine_names)))


def _put(c: ClientState, layout: KVLayout, token_ids: Sequence[int] | None, blocks: Sequence[Any], first_block: int,
         block_hashes: Sequence[bytes] | None, session_id: str | None, expect_reuse_within_s: float | None,
         timeout_s: float, wait_for_owners: bool, engine_names: EngineNames | None) -> Plan[PutResult]:
    hint = reuse_hint(session_id, expect_reuse_within_s)
    if layout.groups:
        return (yield from _put_parts(c, layout, token_ids, blocks, first_block, block_hashes, hint, timeout_s,
                                      wait_for_owners, engine_names))
    if all_cuda(blocks):
        device = yield from device_plane(c)
        if device is not None:
            header = device_put_header(layout, token_ids, block_hashes, blocks, first_block, hint, engine_names)
            header.wait_for_owners = wait_for_owners
            boot_id = device.boot_id
            begun = yield Unary("DevicePut", kvstore_pb2.LocalPutRequest(
                header=header, release_lease_ids=c._take_releases(boot_id), boot_id=boot_id), timeout_s)
            sums = yield from _copy_in(Blocking(device.copy_in, begun.offsets, blocks, begun.block_bytes),
                                       kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True, boot_id=boot_id),
                                       timeout_s)
            return (yield _commit(begun.txn_id, sums, timeout_s, boot_id))
    prepared = prepare_put(layout, token_ids, block_hashes, host_blocks(blocks), first_block, hint, engine_names)
    if wait_for_owners:
        prepared.header.wait_for_owners = True
    plane = c._plane if c._plane_tried else (yield from local_plane(c))
    if plane is None:
        lane = None if c._datalane_tried and c._datalane is None else (yield from data_lane(c))
        if lane is not None:
            return (yield from put_lane(c, lane, prepared, timeout_s))
        return put_result((yield StreamPut(prepared, timeout_s)))
    n = len(prepared.views)
    boot_id = plane.boot_id  # every call below names this start's slots
    held, unfit = c._reserved.take(layout.bytes_per_block, n, boot_id)
    ahead = min(n, c.reserve_ahead) if c._reserved.room(layout.bytes_per_block) else 0
    if held is not None:
        sums = yield from _copy_in(Blocking(plane.copy_in, held.offsets[:n], prepared.views),
                                   kvstore_pb2.LocalCommitRequest(reservation_id=held.reservation_id, abort=True,
                                                                  boot_id=boot_id), timeout_s)
        try:
            resp = yield Unary("LocalCommit", kvstore_pb2.LocalCommitRequest(
                header=prepared.header, reservation_id=held.reservation_id, checksums=sums,
                reserve_ahead=ahead, release_lease_ids=c._take_releases(boot_id), boot_id=boot_id), timeout_s)
        except DaemonRestarted:
            raise  # not a lost reservation: the plane itself is the old start's (`_again`)
        except FailedPrecondition as exc:
            logger.info("slot reservation gone (%s); putting in two round trips", exc)
        else:
            yield from _keep_held(c, resp.reservation, boot_id, timeout_s)
            return put_result(resp)
    begun = yield Unary("LocalPut", kvstore_pb2.LocalPutRequest(
        header=prepared.header, release_lease_ids=c._take_releases(boot_id), reserve_ahead=ahead,
        reuse_reservation_id=unfit, boot_id=boot_id), timeout_s)
    yield from _keep_held(c, begun.reservation, boot_id, timeout_s)
    sums = yield from _copy_in(Blocking(plane.copy_in, begun.offsets, prepared.views),
                               kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True, boot_id=boot_id),
                               timeout_s)
    return (yield _commit(begun.txn_id, sums, timeout_s, boot_id))


def _put_parts(c: ClientState, layout: KVLayout, token_ids: Sequence[int] | None, blocks: Sequence[Any],
               first_block: int, block_hashes: Sequence[bytes] | None, hint: kvstore_pb2.ReuseHint | None,
               timeout_s: float, wait_for_owners: bool, engine_names: EngineNames | None = None) -> Plan[PutResult]:
    """A grouped put: the parts its hit rules keep, in wire order, on the plane a plain
    put would take (shared memory in two round trips, else the data lane, else gRPC
    bytes), published all together or not at all."""
    parts = wire_parts(layout, blocks)
    if parts and all_cuda(parts):
        device = yield from device_plane(c)
        if device is not None:
            header = grouped_header(layout, token_ids, block_hashes, len(blocks), first_block, hint,
                                    engine_names)
            header.wait_for_owners = wait_for_owners
            boot_id = device.boot_id
            begun = yield Unary("DevicePut", kvstore_pb2.LocalPutRequest(
                header=header, release_lease_ids=c._take_releases(boot_id), boot_id=boot_id), timeout_s)
            sums = yield from _copy_in(Blocking(device.copy_in, begun.offsets, parts, part_sizes(layout, len(blocks))),
                                       kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True, boot_id=boot_id),
                                       timeout_s)
            return (yield _commit(begun.txn_id, sums, timeout_s, boot_id))
    prepared = prepare_grouped_put(layout, token_ids, block_hashes, host_blocks_of_parts(blocks), first_block, hint,
                                   engine_names)
    if wait_for_owners:
        prepared.header.wait_for_owners = True
    plane = c._plane if c._plane_tried else (yield from local_plane(c))
    if plane is None:
        lane = None if c._datalane_tried and c._datalane is None else (yield from data_lane(c))
        if lane is not None:
            return (yield from put_lane(c, lane, prepared, timeout_s, grouped=True))
        return put_result((yield StreamPut(prepared, timeout_s)))
    boot_id = plane.boot_id  # every call below names this start's slots
    begun = yield Unary("LocalPut", kvstore_pb2.LocalPutRequest(
        header=prepared.header, release_lease_ids=c._take_releases(boot_id), boot_id=boot_id), timeout_s)
    abort = kvstore_pb2.LocalCommitRequest(txn_id=begun.txn_id, abort=True, boot_id=boot_id)
    if len(begun.offsets) != len(prepared.views):
        yield Unary("LocalCommit", abort, timeout_s)
        raise KVStoreError(f"the daemon answered {len(begun.offsets)} slots for a put of {len(prepared.views)} parts")
    sums = yield from _copy_in(Blocking(plane.copy_in, begun.offsets, prepared.views), abort, timeout_s)
    return (yield _commit(begun.txn_id, sums, timeout_s, boot_id))


def _keep_held(c: ClientState, reservation: kvstore_pb2.SlotReservation, boot_id: int,
               timeout_s: float) -> Plan[None]:
    """Hold the reservation an answer handed out for a later put; hand it back at once
    when the client holds as many as it may (kvstore.client._held)."""
    extra = c._reserved.keep(reservation, boot_id)
    if extra is not None:
        try:
            yield Unary("LocalCommit", kvstore_pb2.LocalCommitRequest(reservation_id=extra.reservation_id,
                                                                      abort=True, boot_id=boot_id), timeout_s)
        except KVStoreError:
            pass  # its slots come back when it expires (put_idle_timeout_s); the put itself is done


def put_lane(c: ClientState, lane: DataLane, prepared: PreparedPut, timeout_s: float,
             grouped: bool = False) -> Plan[PutResult]:
    """A put on the data lane (`kvstore.client.data_lane.put_transfer`): connections
    first, then LanePut opens it (its slots are reserved a window at a time) and says
    which blocks the daemon needs, those go on the lane as its credit allows (each
    verified as it lands), and LaneCommit publishes, all or nothing. A failure aborts the
    transfer; in `auto`, a lane that broke is set aside for a while and the put goes
    through gRPC instead. `grouped`: a layout with KV groups, each group's parts a
    transfer of their own under one LaneCommit (`grouped_put_transfer`)."""
    try:
        conns = yield Blocking(lane.checkout, lane.connections_for(len(prepared.views)), timeout_s)
    except Unavailable as exc:
        yield from _offered_again(c, lane)
        if not _set_aside(c, lane, exc):
            raise
        return put_result((yield StreamPut(prepared, timeout_s)))
    fall_back = functools.partial(_set_aside, c, lane)
    if grouped:
        done = yield from _on_lane(grouped_put_transfer(lane, conns, prepared.header, prepared.views,
                                                        lambda: timeout_s, fall_back=fall_back))
    else:
        plain = yield from _on_lane(put_transfer(lane, conns, prepared.header, prepared.views, lambda: timeout_s,
                                                 fall_back=fall_back))
        done = None if plain is None else plain[1]
    if done is None:
        return put_result((yield StreamPut(prepared, timeout_s)))
    return put_result(done)


def _offered_again(c: ClientState, lane: DataLane) -> Plan[None]:
    """A data lane that cannot be reached may be the lane of a daemon that restarted (on
    another port): its offer, asked for again, says so by another boot id, and then the
    lane is asked for anew (`DaemonRestarted`, `_again`). Else nothing changes."""
    if not lane.boot_id:
        return
    epoch = c._epoch
    try:
        offer = yield Unary("DataLane", kvstore_pb2.DataLaneRequest(), c.timeout_s)
    except KVStoreError:
        return  # the daemon itself cannot be reached: the lane's error stands
    if offer.boot_id and offer.boot_id != lane.boot_id:
        learn(c, offer.boot_id, epoch)
        raise DaemonRestarted(f"{RESTARTED_PREFIX} since its data lane was offered (generation {lane.boot_id:016x}, "
                              f"now {offer.boot_id:016x})")


def _set_aside(c: ClientState, lane: DataLane, error: Exception) -> bool:
    """Whether the call goes through gRPC after the lane failed it with `error`: in
    `auto`, a lane that cannot be reached or broke is set aside for a while."""
    if not isinstance(error, Unavailable) or c.data_plane == "lane":
        return False
    lane.mark_down(error)
    return True


def _on_lane(transfer: TransferPlan[T]) -> Plan[T]:
    """A data-lane transfer's plan run as steps of this one: its control calls as `Unary`
    steps, its move as a `Blocking` one (which the asyncio client cancels by shutting
    the transfer's connections). A failed step is thrown into the transfer, so it aborts."""
    send: Callable[[Any], LaneCall | LaneMove] = transfer.send
    value: Any = None
    while True:
        try:
            step = send(value)
        except StopIteration as stop:
            return stop.value
        except BaseException:
            del value  # maybe the very error on its way out: no cycle through this frame
            raise
        try:
            if isinstance(step, LaneMove):
                value = yield Blocking(step.run, cancel=step.cancel)
            else:
                value = yield Unary(step.name, step.request, step.timeout_s)
            send = transfer.send
        except GeneratorExit:
            transfer.close()
            raise
        except BaseException as exc:
            value, send = exc, transfer.throw


def _copy_in(copy: Blocking, abort: kvstore_pb2.LocalCommitRequest, timeout_s: float) -> Plan[list[int]]:
    """Copy a put's blocks into its slots; the checksums of what landed. A failed (or
    interrupted) copy hands the slots back at once, then raises."""
    try:
        return (yield copy)
    except GeneratorExit:
        raise
    except BaseException:
        yield Unary("LocalCommit", abort, timeout_s)
        raise


def _commit(txn_id: str, sums: list[int], timeout_s: float, boot_id: int) -> Unary[PutResult]:
    """Publish a begun put (of the daemon's start `boot_id`) whose blocks landed with these checksums."""
    return Unary("LocalCommit", kvstore_pb2.LocalCommitRequest(txn_id=txn_id, checksums=sums, boot_id=boot_id),
                 timeout_s, put_result)
