"""`AsyncClient`: the asyncio SDK. Same methods as `Client`, awaited. Shared-memory
copies run in a worker thread so they never stall the event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvstore.client._common import (
    CHANNEL_OPTIONS,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_TIMEOUT_S,
    FetchAssembler,
    HeldSlots,
    LaneState,
    LookupResult,
    PinResult,
    PrefetchResult,
    PreparedPut,
    PutResult,
    block_keys,
    check_control_plane,
    check_data_plane,
    check_reserve_ahead,
    device_put_header,
    fetch_cut_short,
    fetch_keys,
    host_blocks,
    keep_held,
    lookup_request,
    lookup_result,
    may_be_local,
    namespace_ref,
    out_buffers,
    prefetch_request,
    prefetch_result,
    prepare_put,
    put_requests,
    resolve_target,
    response_hashes,
    response_keys,
    reuse_hint,
    take_held,
    translate,
    upload_blocks,
    writable_view,
)
from kvstore.client._lane import AioLane, LaneUnavailable, lane_socket
from kvstore.client._local import LocalPlane
from kvstore.errors import FailedPrecondition, KVStoreError
from kvstore.laneproto import RESPONSE_TYPES, method_path
from kvstore.layout import KVLayout
from kvstore.wire import FETCH_METHOD, PUT_METHOD, fetch_response_deserializer, put_request_serializer
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from kvstore.client._auth import Security, aio_channel

logger = logging.getLogger(__name__)


class AsyncClient:
    """Talks to a kvstore daemon from asyncio code.

    `target` is `unix:PATH`, a socket path, or `HOST:PORT`; None reads `KVSTORE_TARGET`
    and then falls back to the daemon's default socket or 127.0.0.1:50051. Every call
    takes `timeout_s` (default `DEFAULT_TIMEOUT_S`); idempotent calls are retried on
    UNAVAILABLE. Failures raise `kvstore.errors` exceptions.

    `data_plane`: `auto` moves block bytes through the daemon's shared-memory segment
    when this process can map it (same host, same user) and through gRPC messages
    otherwise; `local` insists on shared memory; `grpc` never uses it. Both give
    byte-identical results. `data_plane_in_use` tells which one is active.

    `reserve_ahead` (shared-memory plane only): after each put, the daemon holds up to
    this many empty slots for this client's next put of the same block size, which then
    takes one round trip instead of two. The slots hold host-tier capacity while they
    wait (at most 30 s), so it is off (0) by default; a steady writer such as an engine
    saving its KV each step gains from `reserve_ahead` = its usual blocks per put.

    `control_plane`: `auto` sends the unary calls (lookup, the local data plane's
    put/commit/fetch, pin, delete...) over the daemon's local control lane when the target
    is a Unix socket and the lane answers, and over gRPC otherwise; `lane` insists on it;
    `grpc` never uses it. `control_plane_in_use()` tells which one is active.

    `token` (or `token_file`, else `KVSTORE_TOKEN` / `KVSTORE_TOKEN_FILE`) is sent as a
    bearer token on every call; `tls_ca` (else `KVSTORE_TLS_CA`) turns on TLS with those
    roots, and `tls_cert`/`tls_key` present a client certificate (mTLS).
    """

    def __init__(self, target: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, data_plane: str = "auto", token: str | None = None,
                 token_file: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, reserve_ahead: int = 0, control_plane: str = "auto") -> None:
        self.target = resolve_target(target)
        self.control_plane = check_control_plane(control_plane, self.target)
        self.reserve_ahead = check_reserve_ahead(reserve_ahead)
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.data_plane = check_data_plane(data_plane)
        self.security = Security.resolve(token, token_file, tls_ca, tls_cert, tls_key)
        self._plane: LocalPlane | None = None
        # Empty slots the daemon holds for this client's next put, by block size: that
        # put then takes one round trip instead of two.
        self._reserved: dict[int, HeldSlots] = {}
        # The device (CUDA IPC) plane: opened on the first put or fetch of CUDA tensors.
        self._device: Any = None
        self._device_tried = False
        # Leases of finished shared-memory fetches, ended by the next local call instead
        # of an Unpin each (they also expire on their own).
        self._releases: list[str] = []
        self._plane_tried = data_plane == "grpc" or (data_plane == "auto" and not may_be_local(self.target))
        self._channel = aio_channel(self.target, self.security, CHANNEL_OPTIONS)
        self._kv = kvstore_pb2_grpc.KVStoreStub(self._channel)
        # Put and Fetch carry block payloads: use the copy-saving chunk codec (kvstore.wire).
        self._put = self._channel.stream_unary(PUT_METHOD, request_serializer=put_request_serializer,
                                               response_deserializer=kvstore_pb2.PutResponse.FromString)
        self._fetch = self._channel.unary_stream(FETCH_METHOD,
                                                 request_serializer=kvstore_pb2.FetchRequest.SerializeToString,
                                                 response_deserializer=fetch_response_deserializer)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        # The local control lane (a Unix socket next to the daemon's): tried on the first
        # call; after a failure, gRPC until LANE_RETRY_S later.
        path = lane_socket(self.target) if self.control_plane != "grpc" else None
        self._lane = AioLane(path, self.security.token) if path else None
        self._lane_state = LaneState(self.control_plane == "lane")
        self._raw: dict[str, Any] = {}

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for held in self._reserved.values():
            try:
                await self._unary("LocalCommit", kvstore_pb2.LocalCommitRequest(reservation_id=held.reservation_id, abort=True),
                                      timeout=min(1.0, self.timeout_s))
            except KVStoreError:
                pass  # the reservation expires by itself
        self._reserved.clear()
        for lease_id in self._take_releases():
            try:
                await self._unary("Unpin", kvstore_pb2.UnpinRequest(lease_id=lease_id), timeout=min(1.0, self.timeout_s))
            except KVStoreError:
                pass  # the lease expires by itself
        if self._device is not None:
            self._device.close()
            self._device = None
        if self._plane is not None:
            self._plane.close()
            self._plane = None
        if self._lane is not None:
            self._lane.close()
        await self._channel.close()

    def _take_releases(self) -> list[str]:
        taken, self._releases = self._releases, []
        return taken

    def _t(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    # ------------------------------------------------------------------ control calls

    async def control_plane_in_use(self) -> str:
        """`lane` when unary calls go over the daemon's local control lane, else `grpc`."""
        lane = self._lane
        state = self._lane_state
        if lane is not None and not state.up and state.due():
            try:
                await lane.open(self.timeout_s)
                state.up = True
            except LaneUnavailable as exc:
                state.failed(exc)
        return "lane" if state.up else "grpc"

    async def _call(self, name: str, payload: bytes, timeout: float) -> bytes:
        """One unary KVStore call, serialized both ways: over the lane when it is up (or
        due for another try), else over gRPC. Failures raise `kvstore.errors` exceptions."""
        lane = self._lane
        state = self._lane_state
        if lane is not None and state.due():
            try:
                answer = await lane.call(name, payload, timeout)
                state.up = True
                return answer
            except LaneUnavailable as exc:
                state.failed(exc)
        stub = self._raw.get(name)
        if stub is None:
            stub = self._raw[name] = self._channel.unary_unary(method_path(name))
        try:
            return await stub(payload, timeout=timeout)  # type: ignore[no-any-return]
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def _unary(self, name: str, request: Any, *, timeout: float) -> Any:
        return RESPONSE_TYPES[name].FromString(await self._call(name, request.SerializeToString(), timeout))

    async def data_plane_in_use(self) -> str:
        await self._local()
        return "local" if self._plane is not None else "grpc"

    async def warm_up(self, timeout_s: float = 60.0) -> str:
        """Attach the data plane now and wait until the shared segment is mapped in, so
        the first puts and fetches run at full speed; returns the plane in use. Optional:
        without it the mapping is faulted in in the background after the first call."""
        plane = await self._local()
        if plane is not None:
            await asyncio.to_thread(plane.wait_ready, timeout_s)
        return "local" if plane is not None else "grpc"

    async def _local(self) -> LocalPlane | None:
        if self._plane_tried:
            return self._plane
        self._plane_tried = True
        try:
            resp = await self._unary("LocalSegment", kvstore_pb2.LocalSegmentRequest(), timeout=self.timeout_s)
            self._plane = LocalPlane.attach(resp)
        except (KVStoreError, OSError, ValueError) as exc:
            reason = exc
            if self.data_plane == "local":
                raise FailedPrecondition(f"cannot use the shared-memory data plane: {reason}") from None
            logger.info("shared-memory data plane unavailable (%s); block bytes go through gRPC", reason)
        return self._plane

    async def _device_plane(self, blocks: Sequence[Any] | None) -> Any:
        """The device plane when `blocks` are CUDA tensors and the daemon's HBM tier can be
        opened from this process (same host, same GPU, another process); else None."""
        if not blocks or not all(getattr(b, "is_cuda", False) for b in blocks):
            return None
        if self._device_tried:
            return self._device
        plane = await self._local()
        self._device_tried = True
        if plane is None:
            return None
        from kvstore.client._device import DevicePlane

        try:
            resp = await self._unary("DeviceSegment", kvstore_pb2.DeviceSegmentRequest(), timeout=self.timeout_s)
            self._device = DevicePlane.attach(resp, plane.token)
        except (KVStoreError, ValueError) as exc:
            reason = exc
            logger.info("device data plane unavailable (%s); CUDA blocks go through host memory", reason)
        return self._device

    @property
    def device_plane_in_use(self) -> bool:
        """Whether puts and fetches of CUDA tensors copy device-to-device (CUDA IPC); known
        after the first such call."""
        return self._device is not None

    async def _put_device(self, device: Any, layout: KVLayout, token_ids: Sequence[int] | None,
                          blocks: Sequence[Any], first_block: int, block_hashes: Sequence[bytes] | None,
                          hint: kvstore_pb2.ReuseHint | None, timeout: float) -> PutResult:
        header = device_put_header(layout, token_ids, block_hashes, blocks, first_block, hint)
        try:
            begun = await self._unary("DevicePut",
                kvstore_pb2.LocalPutRequest(header=header, release_lease_ids=self._take_releases()), timeout=timeout)
            return await self._copy_and_commit(
                begun.txn_id, lambda: device.copy_in(begun.offsets, blocks, begun.block_bytes), timeout)
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def _fetch_device(self, device: Any, layout: KVLayout, keys: kvstore_pb2.BlockKeys, out: Sequence[Any],
                            lease_id: str, timeout: float) -> list[Any]:
        resp = await self._unary("DeviceFetch",
            kvstore_pb2.LocalFetchRequest(namespace=namespace_ref(layout), keys=keys,
                                          release_lease_ids=self._take_releases() + ([lease_id] if lease_id else [])),
            timeout=timeout,
        )
        n_dev = len(resp.offsets)
        dsts = list(out[: resp.num_blocks])
        try:
            good = await asyncio.to_thread(device.copy_out, resp.offsets, resp.checksums, resp.block_bytes,
                                           dsts[:n_dev])
        finally:
            if resp.lease_id:
                self._releases.append(resp.lease_id)
        if good < n_dev:
            await self._unary("Verify", kvstore_pb2.VerifyRequest(namespace=namespace_ref(layout),
                                                            keys=response_keys(resp, good, n_dev)),
                                  timeout=timeout)
            return dsts[:good]
        if resp.num_blocks > n_dev:
            # The rest sits in host memory or on SSD: fetch it as host bytes, then upload.
            rest = await self.fetch(layout, block_hashes=response_hashes(resp)[n_dev:], timeout_s=timeout)
            upload_blocks(rest, dsts[n_dev:])
            return dsts[: n_dev + len(rest)]
        return dsts[:n_dev]

    async def lookup(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
               block_hashes: Sequence[bytes] | None = None, lease_ms: int = 0,
               session_id: str | None = None, expect_reuse_within_s: float | None = None,
               timeout_s: float | None = None) -> LookupResult:
        """Longest prefix of the blocks the daemon holds. `lease_ms` pins the hit until a fetch;
        `session_id` + `expect_reuse_within_s` hint that the session will be back for it."""
        req, mine = lookup_request(layout, token_ids, block_hashes, lease_ms,
                                   reuse_hint(session_id, expect_reuse_within_s))
        try:
            return lookup_result(await self._unary("Lookup", req, timeout=self._t(timeout_s)), mine)
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def put(self, layout: KVLayout, token_ids: Sequence[int] | None, blocks: Sequence[Any], *,
            first_block: int = 0, block_hashes: Sequence[bytes] | None = None,
            session_id: str | None = None, expect_reuse_within_s: float | None = None,
            timeout_s: float | None = None) -> PutResult:
        """Store `blocks` (all or nothing). With token_ids, block i is block first_block + i of the prefix."""
        device = await self._device_plane(blocks)
        if device is not None:
            return await self._put_device(device, layout, token_ids, blocks, first_block, block_hashes,
                                          reuse_hint(session_id, expect_reuse_within_s), self._t(timeout_s))
        blocks = host_blocks(blocks)
        prepared = prepare_put(layout, token_ids, block_hashes, blocks, first_block,
                               reuse_hint(session_id, expect_reuse_within_s))
        timeout = self._t(timeout_s)
        try:
            plane = await self._local()
            if plane is None:
                resp = await self._put(put_requests(prepared, self.chunk_bytes), timeout=timeout)
                return PutResult(resp.stored, resp.existing, response_hashes(resp))
            n = len(prepared.views)
            held, unfit = take_held(self._reserved, layout.bytes_per_block, n)
            if held is not None:
                try:
                    sums = await asyncio.to_thread(plane.copy_in, held.offsets[:n], prepared.views)
                except BaseException:
                    await self._unary("LocalCommit", kvstore_pb2.LocalCommitRequest(reservation_id=held.reservation_id,
                                                                              abort=True), timeout=timeout)
                    raise
                one_trip = await self._commit_reserved(prepared, held, sums, timeout)
                if one_trip is not None:
                    return one_trip
            begun = await self._unary("LocalPut",
                kvstore_pb2.LocalPutRequest(header=prepared.header, release_lease_ids=self._take_releases(),
                                            reserve_ahead=min(n, self.reserve_ahead),
                                            reuse_reservation_id=unfit),
                timeout=timeout,
            )
            keep_held(self._reserved, begun.reservation)
            return await self._copy_and_commit(
                begun.txn_id, lambda: plane.copy_in(begun.offsets, prepared.views), timeout)
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def _copy_and_commit(self, txn_id: str, copy_in: Callable[[], list[int]], timeout: float) -> PutResult:
        """Land a begun local or device put: copy into its slots (in a worker thread), then
        publish it; a failed copy aborts the put so its slots go back at once."""
        try:
            sums = await asyncio.to_thread(copy_in)
        except BaseException:
            await self._unary("LocalCommit", kvstore_pb2.LocalCommitRequest(txn_id=txn_id, abort=True), timeout=timeout)
            raise
        resp = await self._unary("LocalCommit", kvstore_pb2.LocalCommitRequest(txn_id=txn_id, checksums=sums),
                                          timeout=timeout)
        return PutResult(resp.stored, resp.existing, response_hashes(resp))

    async def _commit_reserved(self, prepared: PreparedPut, held: HeldSlots, sums: list[int],
                         timeout: float) -> PutResult | None:
        """Publish a put copied into reserved slots (one round trip); None when the daemon
        no longer holds the reservation, and the put must take the two-trip path."""
        try:
            resp = await self._unary("LocalCommit",
                kvstore_pb2.LocalCommitRequest(header=prepared.header, reservation_id=held.reservation_id,
                                               checksums=sums,
                                               reserve_ahead=min(len(prepared.views), self.reserve_ahead),
                                               release_lease_ids=self._take_releases()),
                timeout=timeout)
        except FailedPrecondition as exc:
            logger.info("slot reservation gone (%s); putting in two round trips", exc)
            return None
        keep_held(self._reserved, resp.reservation)
        return PutResult(resp.stored, resp.existing, response_hashes(resp))

    async def fetch(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
              block_hashes: Sequence[bytes] | None = None, out: Sequence[Any] | None = None,
              lease_id: str = "", timeout_s: float | None = None) -> list[Any]:
        """Verified blocks of the longest held prefix, in order; fills `out` buffers if given.

        Without `out`, blocks come back as `bytes` over gRPC and as `bytearray` over shared
        memory (equal content either way).
        """
        keys = fetch_keys(layout, token_ids, block_hashes, out)
        timeout = self._t(timeout_s)
        device = await self._device_plane(out)
        try:
            if device is not None:
                assert out is not None
                return await self._fetch_device(device, layout, keys, out, lease_id, timeout)
            if out is not None and any(getattr(o, "is_cuda", False) for o in out):
                # No device plane: stage through host buffers, then upload.
                staged = [bytearray(layout.bytes_per_block) for _ in out]
                got = await self.fetch(layout, token_ids, block_hashes=block_hashes, out=staged, lease_id=lease_id,
                                       timeout_s=timeout)
                upload_blocks(got, out)
                return list(out[: len(got)])
            plane = await self._local()
            if plane is None:
                return await self._fetch_grpc(layout, keys, out, lease_id, timeout)
            resp = await self._unary("LocalFetch",
                # The lookup lease (if any) ends here: this call takes its own on the slots.
                kvstore_pb2.LocalFetchRequest(namespace=namespace_ref(layout), keys=keys,
                                              release_lease_ids=self._take_releases() + ([lease_id] if lease_id else [])),
                timeout=timeout,
            )
            n_local = len(resp.offsets)
            dsts = out_buffers(out, resp.num_blocks, resp.block_bytes)
            try:
                views = [writable_view(d, i, resp.block_bytes) for i, d in enumerate(dsts[:n_local])]
                good = await asyncio.to_thread(plane.copy_out, resp.offsets, resp.checksums, resp.block_bytes, views)
            finally:
                if resp.lease_id:
                    self._releases.append(resp.lease_id)
            if good < n_local:
                await self._unary("Verify", kvstore_pb2.VerifyRequest(namespace=namespace_ref(layout),
                                                          keys=response_keys(resp, good, n_local)),
                                timeout=timeout)
                return dsts[:good]
            if resp.num_blocks > n_local:  # the rest sits in another tier: fetch it as bytes
                rest = await self._fetch_grpc(layout, response_keys(resp, n_local, resp.num_blocks),
                                        dsts[n_local:] if out is not None else None, "", timeout)
                return dsts[:n_local] + rest
            return dsts[:n_local]
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def _fetch_grpc(self, layout: KVLayout, keys: kvstore_pb2.BlockKeys, out: Sequence[Any] | None,
                    lease_id: str, timeout: float) -> list[Any]:
        req = kvstore_pb2.FetchRequest(namespace=namespace_ref(layout), keys=keys, lease_id=lease_id)
        assembler = FetchAssembler(out)
        try:
            async for msg in self._fetch(req, timeout=timeout):
                assembler.feed(msg)
        except grpc.RpcError as exc:
            if not fetch_cut_short(exc):
                raise
        return assembler.result()

    async def delete(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
               block_hashes: Sequence[bytes] | None = None, timeout_s: float | None = None) -> int:
        req = kvstore_pb2.DeleteRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes))
        try:
            return (await self._unary("Delete", req, timeout=self._t(timeout_s))).deleted
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def pin(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
            block_hashes: Sequence[bytes] | None = None, ttl_ms: int = 0,
            timeout_s: float | None = None) -> PinResult:
        req = kvstore_pb2.PinRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                     ttl_ms=ttl_ms)
        try:
            resp = await self._unary("Pin", req, timeout=self._t(timeout_s))
        except grpc.RpcError as exc:
            raise translate(exc) from None
        return PinResult(resp.lease_id, resp.pinned, resp.expires_in_ms)

    async def hint(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
             block_hashes: Sequence[bytes] | None = None, session_id: str, expect_reuse_within_s: float,
             timeout_s: float | None = None) -> int:
        """Protect the named blocks for `session_id` for about `expect_reuse_within_s`; returns
        how many were present. See docs/policies.md for when hints pay off."""
        req = kvstore_pb2.HintRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                      hint=reuse_hint(session_id, expect_reuse_within_s))
        try:
            return (await self._unary("Hint", req, timeout=self._t(timeout_s))).hinted
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def end_session(self, session_id: str, *, timeout_s: float | None = None) -> None:
        """The session is over: release whatever its hints protect."""
        try:
            await self._unary("EndSession", kvstore_pb2.EndSessionRequest(session_id=session_id), timeout=self._t(timeout_s))
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def unpin(self, lease_id: str, *, timeout_s: float | None = None) -> bool:
        try:
            resp = await self._unary("Unpin", kvstore_pb2.UnpinRequest(lease_id=lease_id), timeout=self._t(timeout_s))
        except grpc.RpcError as exc:
            raise translate(exc) from None
        return resp.released

    async def prefetch(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                    block_hashes: Sequence[bytes] | None = None, tier: str = "",
                    timeout_s: float | None = None) -> PrefetchResult:
        """Raise the named blocks into `tier` ("" = the daemon's top tier) ahead of a fetch."""
        req = prefetch_request(layout, token_ids, block_hashes, tier)
        try:
            return prefetch_result(await self._unary("Prefetch", req, timeout=self._t(timeout_s)))
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def verify(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
               block_hashes: Sequence[bytes] | None = None, timeout_s: float | None = None) -> int:
        """Ask the daemon to re-check the named blocks; returns how many it dropped."""
        req = kvstore_pb2.VerifyRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes))
        try:
            return (await self._unary("Verify", req, timeout=self._t(timeout_s))).dropped
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def stats(self, *, timeout_s: float | None = None) -> admin_pb2.StatsResponse:
        try:
            return await self._admin.Stats(admin_pb2.StatsRequest(), timeout=self._t(timeout_s))
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def info(self, section: str = "", *, timeout_s: float | None = None) -> str:
        try:
            return (await self._admin.Info(admin_pb2.InfoRequest(section=section), timeout=self._t(timeout_s))).text
        except grpc.RpcError as exc:
            raise translate(exc) from None
