"""Error translation: a failed call's gRPC status becomes the `kvstore.errors` exception
for it, whichever transport carried it (a gRPC call's `grpc.RpcError`, or a lane answer's
status code and message), so callers see one exception family."""

from __future__ import annotations

import grpc

from kvstore.errors import KVStoreError, error_for_status


def fetch_cut_short(exc: grpc.RpcError) -> bool:
    """Whether a Fetch stream's error only ended it early: DATA_LOSS, a block that failed
    verification on the daemon with no intact copy (it dropped it). The blocks received
    before it verified: they are the fetch's answer, a shorter prefix (a miss is a value)."""
    return exc.code() == grpc.StatusCode.DATA_LOSS


def translate(exc: grpc.RpcError) -> KVStoreError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return translate_status(code, details or "")


def translate_status(code: grpc.StatusCode, details: str) -> KVStoreError:
    """The exception for a failed call's status, whichever transport carried it."""
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"kvstore daemon unavailable: {details}; is it running, and is the target right?"
    return error_for_status(code, details)
