"""`AdminClient`: the blocking operator SDK behind the `kvstore` CLI.

Thin wrappers over `kvstore.v1.Admin` (plus `Pin`/`Unpin` by namespace id and block
hashes, which operators use without knowing a layout). Returns protobuf messages; every
failure raises the `kvstore.errors` exception for its status.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from kvstore.client._common import CHANNEL_OPTIONS, resolve_target, translate
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

DEFAULT_ADMIN_TIMEOUT_S = 5.0


class AdminClient:
    def __init__(self, target: str | None = None, *, timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S) -> None:
        self.target = resolve_target(target)
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        self._kv = kvstore_pb2_grpc.KVStoreStub(self._channel)

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object) -> object:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise translate(exc) from None

    def stats(self) -> admin_pb2.StatsResponse:
        return self._call(self._admin.Stats, admin_pb2.StatsRequest())  # type: ignore[return-value]

    def info(self, section: str = "") -> str:
        return self._call(self._admin.Info, admin_pb2.InfoRequest(section=section)).text  # type: ignore[attr-defined]

    def list_namespaces(self) -> list[admin_pb2.NamespaceStats]:
        resp = self._call(self._admin.ListNamespaces, admin_pb2.ListNamespacesRequest())
        return list(resp.namespaces)  # type: ignore[attr-defined]

    def evict(self, tier: str, nbytes: int) -> admin_pb2.RemovalResponse:
        return self._call(self._admin.Evict, admin_pb2.EvictRequest(tier=tier, bytes=nbytes))  # type: ignore[return-value]

    def flush(self, namespace_id: bytes = b"") -> admin_pb2.RemovalResponse:
        return self._call(self._admin.Flush, admin_pb2.FlushRequest(namespace_id=namespace_id))  # type: ignore[return-value]

    def get_config(self, name: str = "") -> list[admin_pb2.ConfigField]:
        return list(self._call(self._admin.GetConfig, admin_pb2.GetConfigRequest(name=name)).fields)  # type: ignore[attr-defined]

    def set_config(self, name: str, value: str) -> admin_pb2.SetConfigResponse:
        return self._call(self._admin.SetConfig, admin_pb2.SetConfigRequest(name=name, value=value))  # type: ignore[return-value]

    def pin(self, namespace_id: bytes, block_hashes: Sequence[bytes], ttl_ms: int = 0) -> kvstore_pb2.PinResponse:
        req = kvstore_pb2.PinRequest(
            namespace=kvstore_pb2.Namespace(id=namespace_id),
            keys=kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=list(block_hashes))),
            ttl_ms=ttl_ms,
        )
        return self._call(self._kv.Pin, req)  # type: ignore[return-value]

    def unpin(self, lease_id: str) -> bool:
        return bool(self._call(self._kv.Unpin, kvstore_pb2.UnpinRequest(lease_id=lease_id)).released)  # type: ignore[attr-defined]

    def watch_events(
        self, namespace_id: bytes = b"", *, snapshot: bool = False, queue_size: int = 0, timeout_s: float | None = None
    ) -> Iterator[admin_pb2.Event]:
        """Block events until the stream ends, `timeout_s` passes, or the caller stops iterating."""
        req = admin_pb2.WatchEventsRequest(namespace_id=namespace_id, snapshot=snapshot, queue_size=queue_size)
        call = self._admin.WatchEvents(req, timeout=timeout_s)
        try:
            yield from call
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise translate(exc) from None
        finally:
            call.cancel()
