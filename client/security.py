"""Client-side credentials: a bearer token and TLS settings, and the channels built from them.

`Security.resolve(...)` takes what a caller passed and fills the rest from the
environment: `KVSTORE_TOKEN` (or `KVSTORE_TOKEN_FILE`, a file holding the token),
`KVSTORE_TLS_CA` (PEM roots; setting it turns TLS on), `KVSTORE_TLS_CERT` and
`KVSTORE_TLS_KEY` (a client certificate for mTLS); TLS settings apply to TCP targets
only (the daemon serves Unix sockets plain). The token travels as metadata
`authorization: Bearer <token>` on every call, added by a client interceptor only when a
token is set, so the default (no token) path has no interceptor at all.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from kvstore.addresses import is_loopback
from kvstore.client._peer import check_unix_target
from kvstore.errors import InvalidArgument

logger = logging.getLogger(__name__)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {path}: {exc.strerror}") from None


@dataclass(frozen=True, slots=True)
class Security:
    token: str = ""
    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None

    @classmethod
    def resolve(cls, token: str | None = None, token_file: str | None = None, tls_ca: str | None = None,
                tls_cert: str | None = None, tls_key: str | None = None) -> Security:
        env = os.environ
        if token is None and token_file:
            token = _read(token_file, "token file").decode("utf-8").strip()
        if token is None:
            token = env.get("KVSTORE_TOKEN") or None
        if token is None and env.get("KVSTORE_TOKEN_FILE"):
            token = _read(env["KVSTORE_TOKEN_FILE"], "token file").decode("utf-8").strip()
        tls_ca = tls_ca or env.get("KVSTORE_TLS_CA") or None
        tls_cert = tls_cert or env.get("KVSTORE_TLS_CERT") or None
        tls_key = tls_key or env.get("KVSTORE_TLS_KEY") or None
        if bool(tls_cert) != bool(tls_key):
            raise InvalidArgument("a client certificate needs both tls_cert and tls_key")
        if tls_cert and not tls_ca:
            raise InvalidArgument("a client certificate (mTLS) needs tls_ca, the roots that sign the daemon's cert")
        if token and "[[tenant]]" in token:
            raise InvalidArgument("the token file given is a daemon's token file (TOML, with hashes of tokens); a "
                                  "client's token file holds one plain token: the one `kvstore token new` printed")
        if token and any(c in token for c in "\r\n"):
            raise InvalidArgument("the token contains a line break; check the token file")
        return cls(
            token or "",
            _read(tls_ca, "TLS CA file") if tls_ca else None,
            _read(tls_cert, "TLS certificate") if tls_cert else None,
            _read(tls_key, "TLS key") if tls_key else None,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.tls_ca, self.tls_key, self.tls_cert)


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._pair = ("authorization", f"Bearer {token}")

    def _details(self, d: Any) -> Any:
        return _Details(d.method, d.timeout, [*(d.metadata or ()), self._pair], d.credentials, d.wait_for_ready,
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


def _aio_details(d: Any, pair: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()), pair)
    return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self._pair), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self._pair), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_aio_details(details, self._pair), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_aio_details(details, self._pair), request_iterator)


def _is_local(target: str) -> bool:
    return target.startswith("unix:") or is_loopback(target.rpartition(":")[0].strip("[]"))


def _warn_plaintext(target: str, security: Security) -> None:
    if security.token and not security.tls and not _is_local(target):
        logger.warning("sending a bearer token to %s without TLS: anyone on the network path can read it; "
                       "pass tls_ca (or KVSTORE_TLS_CA) for a TLS listener", target)


def sync_channel(target: str, security: Security, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    check_unix_target(target)
    _warn_plaintext(target, security)
    if security.tls and not target.startswith("unix:"):  # the daemon's sockets are plain
        channel = grpc.secure_channel(target, security.credentials(), options=list(options))
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    if security.token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(security.token))
    return channel


def aio_channel(target: str, security: Security, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    check_unix_target(target)
    _warn_plaintext(target, security)
    interceptors: list[grpc.aio.ClientInterceptor] | None = None
    if security.token:
        pair = ("authorization", f"Bearer {security.token}")
        interceptors = [_AioUnaryUnary(pair), _AioUnaryStream(pair), _AioStreamUnary(pair), _AioStreamStream(pair)]
    if security.tls and not target.startswith("unix:"):  # the daemon's sockets are plain
        return grpc.aio.secure_channel(target, security.credentials(), options=list(options),
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
