"""`AsyncClient`: the asyncio SDK. Same methods as `Client`, awaited."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from kvstore.client._common import (
    CHANNEL_OPTIONS,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_TIMEOUT_S,
    FetchAssembler,
    LookupResult,
    PinResult,
    PrefetchResult,
    PutResult,
    block_keys,
    fetch_keys,
    lookup_result,
    namespace_ref,
    prefetch_request,
    prefetch_result,
    put_requests,
    resolve_target,
    translate,
)
from kvstore.layout import KVLayout
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc


class AsyncClient:
    """Talks to a kvstore daemon from asyncio code.

    `target` is `unix:PATH`, a socket path, or `HOST:PORT`; None reads `KVSTORE_TARGET`
    and then falls back to the daemon's default socket or 127.0.0.1:50051. Every call
    takes `timeout_s` (default `DEFAULT_TIMEOUT_S`); idempotent calls are retried on
    UNAVAILABLE. Failures raise `kvstore.errors` exceptions.
    """

    def __init__(self, target: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.target = resolve_target(target)
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._kv = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _t(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    async def lookup(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                     block_hashes: Sequence[bytes] | None = None, lease_ms: int = 0,
                     timeout_s: float | None = None) -> LookupResult:
        """Longest prefix of the blocks the daemon holds. `lease_ms` pins the hit until a fetch."""
        req = kvstore_pb2.LookupRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                        lease_ms=lease_ms)
        try:
            return lookup_result(await self._kv.Lookup(req, timeout=self._t(timeout_s)))
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def put(self, layout: KVLayout, token_ids: Sequence[int] | None, blocks: Sequence[Any], *,
                  first_block: int = 0, block_hashes: Sequence[bytes] | None = None,
                  timeout_s: float | None = None) -> PutResult:
        """Store `blocks` (all or nothing). With token_ids, block i is block first_block + i of the prefix."""
        requests = put_requests(layout, token_ids, block_hashes, blocks, first_block, self.chunk_bytes)
        try:
            resp = await self._kv.Put(requests, timeout=self._t(timeout_s))
        except grpc.RpcError as exc:
            raise translate(exc) from None
        return PutResult(resp.stored, resp.existing, list(resp.block_hashes))

    async def fetch(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                    block_hashes: Sequence[bytes] | None = None, out: Sequence[Any] | None = None,
                    lease_id: str = "", timeout_s: float | None = None) -> list[Any]:
        """Verified blocks of the longest held prefix, in order; fills `out` buffers if given."""
        req = kvstore_pb2.FetchRequest(namespace=namespace_ref(layout),
                                       keys=fetch_keys(layout, token_ids, block_hashes, out), lease_id=lease_id)
        assembler = FetchAssembler(out)
        try:
            async for msg in self._kv.Fetch(req, timeout=self._t(timeout_s)):
                assembler.feed(msg)
        except grpc.RpcError as exc:
            raise translate(exc) from None
        return assembler.result()

    async def delete(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                     block_hashes: Sequence[bytes] | None = None, timeout_s: float | None = None) -> int:
        req = kvstore_pb2.DeleteRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes))
        try:
            return (await self._kv.Delete(req, timeout=self._t(timeout_s))).deleted
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def pin(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                  block_hashes: Sequence[bytes] | None = None, ttl_ms: int = 0,
                  timeout_s: float | None = None) -> PinResult:
        req = kvstore_pb2.PinRequest(namespace=namespace_ref(layout), keys=block_keys(token_ids, block_hashes),
                                     ttl_ms=ttl_ms)
        try:
            resp = await self._kv.Pin(req, timeout=self._t(timeout_s))
        except grpc.RpcError as exc:
            raise translate(exc) from None
        return PinResult(resp.lease_id, resp.pinned, resp.expires_in_ms)

    async def unpin(self, lease_id: str, *, timeout_s: float | None = None) -> bool:
        try:
            resp = await self._kv.Unpin(kvstore_pb2.UnpinRequest(lease_id=lease_id), timeout=self._t(timeout_s))
        except grpc.RpcError as exc:
            raise translate(exc) from None
        return resp.released

    async def prefetch(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                    block_hashes: Sequence[bytes] | None = None, tier: str = "",
                    timeout_s: float | None = None) -> PrefetchResult:
        """Raise the named blocks into `tier` ("" = the daemon's top tier) ahead of a fetch."""
        req = prefetch_request(layout, token_ids, block_hashes, tier)
        try:
            return prefetch_result(await self._kv.Prefetch(req, timeout=self._t(timeout_s)))
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
