"""`AdminClient`: the blocking operator SDK behind the `kvstore` CLI.

Thin wrappers over `kvstore.v1.Admin` (plus `Pin`/`Unpin` by namespace id and block
hashes, which operators use without knowing a layout). Returns protobuf messages; every
failure raises the `kvstore.errors` exception for its status.

Primitives: `AdminClient`, and `resolve_target` (what a person typed, or KVSTORE_TARGET, as
a gRPC target; the CLI's commands that make their own channel use it too).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from kvstore.client._assembler import FetchAssembler
from kvstore.client._errors import fetch_cut_short, translate
from kvstore.client._options import CHANNEL_OPTIONS, DEFAULT_CHUNK_BYTES, resolve_target
from kvstore.client.security import Security, sync_channel
from kvstore.v1 import admin_pb2, admin_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

DEFAULT_ADMIN_TIMEOUT_S = 5.0

__all__ = ["DEFAULT_ADMIN_TIMEOUT_S", "AdminClient", "resolve_target"]


class AdminClient:
    def __init__(self, target: str | None = None, *, timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S,
                 token: str | None = None, token_file: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None) -> None:
        """Credentials as for `Client` (arguments, else KVSTORE_TOKEN / KVSTORE_TLS_* env)."""
        self.target = resolve_target(target)
        self.timeout_s = timeout_s
        self.security = Security.resolve(token, token_file, tls_ca, tls_cert, tls_key)
        self._channel = sync_channel(self.target, self.security, CHANNEL_OPTIONS)
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

    def list_blocks(self, namespace_id: bytes) -> list[admin_pb2.BlockRef]:
        """Every block of a namespace, parents before children."""
        try:
            return [ref for msg in self._admin.ListBlocks(admin_pb2.ListBlocksRequest(namespace_id=namespace_id),
                                                          timeout=self.timeout_s) for ref in msg.blocks]
        except grpc.RpcError as exc:
            raise translate(exc) from None

    def fetch_blocks(self, namespace_id: bytes, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Verified payloads of the longest present prefix of `block_hashes` (any blocks of
        the namespace, not necessarily a chain)."""
        req = kvstore_pb2.FetchRequest(
            namespace=kvstore_pb2.Namespace(id=namespace_id),
            keys=kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=list(block_hashes))),
        )
        assembler = FetchAssembler(None)
        try:
            for msg in self._kv.Fetch(req, timeout=self.timeout_s):
                assembler.feed(msg)
        except grpc.RpcError as exc:
            if not fetch_cut_short(exc):
                raise translate(exc) from None
        return assembler.result()

    def fetch_parts(self, namespace_id: bytes, group: str, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Verified parts of KV group `group` of the leading run of `block_hashes` that
        hold one (a grouped namespace's: `FetchRequest.group`)."""
        req = kvstore_pb2.FetchRequest(
            namespace=kvstore_pb2.Namespace(id=namespace_id),
            keys=kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=list(block_hashes))), group=group,
        )
        assembler = FetchAssembler(None)
        try:
            for msg in self._kv.Fetch(req, timeout=self.timeout_s):
                assembler.feed(msg)
        except grpc.RpcError as exc:
            if not fetch_cut_short(exc):
                raise translate(exc) from None
        return [bytes(b) for b in assembler.result()]

    def put_parts(self, layout: kvstore_pb2.Layout, block_hashes: Sequence[bytes], parent_hash: bytes,
                  spans: Sequence[tuple[int, int, int]], parts: Sequence[bytes],
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> kvstore_pb2.PutResponse:
        """Store a chain of a grouped layout's blocks with exactly the parts named: `spans`
        ((group, start, stop) per group, in order), `parts` group-major (`PutHeader.group_spans`)."""
        header = kvstore_pb2.PutHeader(
            namespace=kvstore_pb2.Namespace(layout=layout),
            keys=kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=list(block_hashes))),
            num_blocks=len(block_hashes), parent_hash=parent_hash, explicit_end=True,
            group_spans=[kvstore_pb2.GroupSpan(group=g, start=a, stop=b) for g, a, b in spans],
        )

        def messages() -> Iterator[kvstore_pb2.PutRequest]:
            yield kvstore_pb2.PutRequest(header=header)
            for i, data in enumerate(parts):
                for start in range(0, len(data), chunk_bytes):
                    yield kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=i, data=data[start:start + chunk_bytes]))
            yield kvstore_pb2.PutRequest(end=kvstore_pb2.PutEnd())

        try:
            return self._kv.Put(messages(), timeout=self.timeout_s)  # type: ignore[no-any-return]
        except grpc.RpcError as exc:
            raise translate(exc) from None

    def put_chain(self, layout: kvstore_pb2.Layout, block_hashes: Sequence[bytes], parent_hash: bytes,
                  blocks: Sequence[bytes], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> kvstore_pb2.PutResponse:
        """Store a chain of blocks (block i's parent is block i-1; the first's is `parent_hash`)."""
        header = kvstore_pb2.PutHeader(
            namespace=kvstore_pb2.Namespace(layout=layout),
            keys=kvstore_pb2.BlockKeys(hashes=kvstore_pb2.BlockHashes(hashes=list(block_hashes))),
            num_blocks=len(block_hashes), parent_hash=parent_hash, explicit_end=True,
        )

        def messages() -> Iterator[kvstore_pb2.PutRequest]:
            yield kvstore_pb2.PutRequest(header=header)
            for i, data in enumerate(blocks):
                for start in range(0, len(data), chunk_bytes):
                    yield kvstore_pb2.PutRequest(chunk=kvstore_pb2.BlockChunk(block=i, data=data[start:start + chunk_bytes]))
            yield kvstore_pb2.PutRequest(end=kvstore_pb2.PutEnd())

        try:
            return self._kv.Put(messages(), timeout=self.timeout_s)  # type: ignore[no-any-return]
        except grpc.RpcError as exc:
            raise translate(exc) from None

    def evict(self, tier: str, nbytes: int) -> admin_pb2.RemovalResponse:
        return self._call(self._admin.Evict, admin_pb2.EvictRequest(tier=tier, target_bytes=nbytes))  # type: ignore[return-value]

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

    def cluster_status(self) -> admin_pb2.ClusterStatusResponse:
        """The pool as the daemon sees it (`enabled` is false on a single daemon)."""
        return self._call(self._admin.ClusterStatus, admin_pb2.ClusterStatusRequest())  # type: ignore[return-value]

    def cluster_where(self, namespace: kvstore_pb2.Namespace, keys: kvstore_pb2.BlockKeys
                      ) -> admin_pb2.ClusterWhereResponse:
        """Which daemons own each placement unit of a chain (named from its first block)."""
        return self._call(self._admin.ClusterWhere,  # type: ignore[return-value]
                          admin_pb2.ClusterWhereRequest(namespace=namespace, keys=keys))

    def cluster_drain(self, timeout_s: float = 0.0) -> admin_pb2.ClusterDrainResponse:
        """Hand the daemon's units off and leave the pool (the call waits up to `timeout_s`
        for the hand-off, 0: the daemon's default, so give the client a longer deadline)."""
        try:
            return self._admin.ClusterDrain(admin_pb2.ClusterDrainRequest(timeout_s=timeout_s),  # type: ignore[no-any-return]
                                            timeout=max(self.timeout_s, (timeout_s or 60.0) + 10.0))
        except grpc.RpcError as exc:
            raise translate(exc) from None

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
