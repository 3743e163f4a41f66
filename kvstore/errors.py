"""The one public exception family, each class bound to its gRPC status code.

The server maps a `KVStoreError` to its status once (in an interceptor); the client maps
a status back to the same class once. Messages say what was wrong and what to do.
A miss is never an exception: lookups and fetches return what they have.
"""

from __future__ import annotations

import re
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


class DaemonRestarted(FailedPrecondition):
    """The call named something of a daemon that has restarted since the client attached
    (a segment's slots, a reservation, a lease, a data lane transfer): it is gone with
    that daemon. The client must attach anew (new segment, new lanes) before calling
    again; the SDK does so by itself and calls once more where that is safe.

    FAILED_PRECONDITION, not UNAVAILABLE: the daemon is up, and the same call sent again
    as it is would meet the same refusal (UNAVAILABLE tells a client to resend as is;
    for a shared-memory put that would mean copying into the old daemon's memory). The
    message starts with `RESTARTED_PREFIX`, which is how the client tells this refusal
    from the other FAILED_PRECONDITIONs, over gRPC and the lanes alike; it names the
    daemon's current generation (`boot_id`) as `now <16 hex digits>`."""

    @property
    def boot_id(self) -> int:
        """The daemon's current boot id, as the refusal names it (0: it names none)."""
        found = re.search(r"now ([0-9a-f]{16})", str(self))
        return int(found.group(1), 16) if found else 0


RESTARTED_PREFIX = "the daemon restarted"


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
    if cls is FailedPrecondition and details.startswith(RESTARTED_PREFIX):
        cls = DaemonRestarted
    return cls(details or code.name)
