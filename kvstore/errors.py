"""The one public exception family, each class bound to its gRPC status code.

The server maps a `KVStoreError` to its status once (in an interceptor); the client maps
a status back to the same class once. Messages say what was wrong and what to do.
A miss is never an exception: lookups and fetches return what they have.
"""

from __future__ import annotations

from typing import ClassVar

import grpc


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL


class InvalidArgument(KVStoreError):
    """The request is malformed: fix the request."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVStoreError):
    """A named thing (namespace, lease) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(KVStoreError):
    """The request is well formed but conflicts with the store's state."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KVStoreError):
    """A capacity or limit is reached; retry later or with less."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KVStoreError):
    """The daemon cannot be reached or is shutting down; retry."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KVStoreError):
    """The call did not finish within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PermissionDenied(KVStoreError):
    """The caller is not allowed to do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(KVStoreError):
    """The caller presented no valid credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Cancelled(KVStoreError):
    """The call was cancelled before it finished."""

    code = grpc.StatusCode.CANCELLED


class Internal(KVStoreError):
    """A bug or an unexpected failure inside the daemon."""

    code = grpc.StatusCode.INTERNAL


class ConfigError(KVStoreError):
    """The daemon's configuration is invalid; it refuses to start."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DataLoss(KVStoreError):
    """Stored bytes failed verification (checksum, header, codec); the block is dropped."""

    code = grpc.StatusCode.DATA_LOSS


_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        PermissionDenied,
        Unauthenticated,
        Cancelled,
        Internal,
        DataLoss,
    )
}


def error_for_status(code: grpc.StatusCode, details: str) -> KVStoreError:
    """The exception a client raises for a failed call with this status."""
    cls = _BY_CODE.get(code, KVStoreError)
    return cls(details or code.name)
