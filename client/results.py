"""The SDK's result types (`LookupResult`, `PutResult`, `PinResult`, `PrefetchResult`),
and how each is read from the daemon's answer.

A lookup's block hashes come back packed (`block_hashes_packed`, N x 16 bytes) for the
SDK's requests, or not at all when the request named them itself and asked the daemon to
leave them out (`lookup_result` then hands the caller's own objects back); its tiers come
packed too, one Tier value per byte, and usually name one tier for every block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from kvstore.answers import PinResult, PrefetchResult
from kvstore.convert import TIER_NAMES
from kvstore.errors import Internal
from kvstore.hashing import split_hashes
from kvstore.native import native as _native
from kvstore.v1 import kvstore_pb2

__all__ = ["LookupResult", "PinResult", "PrefetchResult", "PutResult"]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How much of a prefix the daemon holds."""

    num_blocks: int
    num_tokens: int
    tiers: list[str]
    block_hashes: list[bytes]
    namespace_id: bytes
    lease_id: str
    # In a pool: how many of the hits are held by other daemons ("remote" in `tiers`);
    # they are being copied here, and a fetch serves them once they landed (or returns
    # the shorter verified prefix).
    remote_blocks: int = 0


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int
    existing: int
    block_hashes: list[bytes]
    # In a pool: blocks sent on to the owners of their units, and (with wait_for_owners)
    # how many of those every owner committed before the answer.
    forwarded_blocks: int = 0
    owner_committed_blocks: int = 0


def response_hashes(resp: Any) -> list[bytes]:
    """The block hashes of a response that has them (LookupResponse, PutResponse,
    LocalPutResponse, LocalFetchResponse): the packed field, which the daemon fills for
    the SDK's requests, else the repeated one."""
    if resp.block_hashes_packed:
        return split_hashes(resp.block_hashes_packed)
    return list(resp.block_hashes)


def put_result(resp: kvstore_pb2.PutResponse) -> PutResult:
    """The result of a Put or of a LocalCommit (both answer a PutResponse)."""
    return PutResult(resp.stored, resp.existing, response_hashes(resp), resp.forwarded_blocks,
                     resp.owner_committed_blocks)


def pin_result(resp: kvstore_pb2.PinResponse) -> PinResult:
    return PinResult(resp.lease_id, resp.pinned, resp.expires_in_ms)


def prefetch_result(resp: kvstore_pb2.PrefetchResponse) -> PrefetchResult:
    return PrefetchResult(TIER_NAMES.get(resp.tier, "unknown"), resp.requested, resp.raised, resp.already,
                          resp.missing, resp.skipped)


# A lookup's tiers: the daemon's, and "remote" for blocks other daemons of a pool hold.
LOOKUP_TIER_NAMES: dict[int, str] = {**{int(v): n for v, n in TIER_NAMES.items()}, kvstore_pb2.TIER_REMOTE: "remote"}


def tier_names(tiers: Sequence[Any]) -> list[str]:
    """Tier names of a lookup's blocks. Usually every block sits in one tier: then one
    name repeated, without a dictionary step per block."""
    values: list[Any] = list(tiers)
    if values and values.count(values[0]) == len(values):
        return [LOOKUP_TIER_NAMES.get(values[0], "unknown")] * len(values)
    return list(map(LOOKUP_TIER_NAMES.get, values, repeat("unknown", len(values))))


_TIER_NAME_BY_VALUE: dict[int, str] = LOOKUP_TIER_NAMES


def packed_tier_names(packed: bytes) -> list[str]:
    """Tier names from LookupResponse.tiers_packed (one Tier value per byte): one name
    repeated when every block sits in one tier, found by one C-level count."""
    n = len(packed)
    if n and packed.count(packed[:1]) == n:
        return [_TIER_NAME_BY_VALUE.get(packed[0], "unknown")] * n
    return list(map(_TIER_NAME_BY_VALUE.get, packed, repeat("unknown", n)))


def lookup_result(resp: kvstore_pb2.LookupResponse, mine: list[bytes] | None = None) -> LookupResult:
    """The result of a Lookup. `mine`: the caller's hashes (`lookup_request`), of which the
    hits are the first ones; those very objects are handed back. A daemon that honours
    `omit_hashes` sends none; one that predates it sends them, and they are checked
    against the caller's (one C pass that packs them, one compare)."""
    got = resp.block_hashes_packed
    hashes: list[bytes] | None = None
    if mine is not None:
        n = resp.num_blocks
        if n > len(mine):
            raise Internal(f"the daemon answered {n} hits for a {len(mine)}-block chain")
        # `mine` exists only where the compiled helpers do (`lookup_request`).
        if (not got and not resp.block_hashes) or _native.join_hashes(mine[:n]) == got:
            hashes = mine[:n]
    if hashes is None:
        hashes = response_hashes(resp)
    return LookupResult(
        num_blocks=resp.num_blocks,
        num_tokens=resp.num_tokens,
        tiers=packed_tier_names(resp.tiers_packed) if resp.tiers_packed else tier_names(resp.tiers),
        block_hashes=hashes,
        namespace_id=resp.namespace_id,
        lease_id=resp.lease_id,
        remote_blocks=resp.remote_blocks,
    )
