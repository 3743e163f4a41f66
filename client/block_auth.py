"""End-to-end block authentication: a tenant's blocks bound to their keys by a MAC under a
key only the tenant's clients hold (SECURITY.md, *End-to-end block authentication*).

The daemons of a pool trust each member for the bytes it holds and forwards: a member
that is compromised (or a stolen node credential) can store bytes of its own choosing
under a tenant's chain, with checksums of those bytes, and every other node then serves
them as hits. This module takes the daemons out of the trust for a tenant that opts in,
with no change to any daemon:

* **Sealed blocks.** Each block is stored as `payload || nonce || tag`: the tag is
  AES-256-GMAC (AES-GCM with the payload as associated data and nothing encrypted) under
  a key of the block's own, `HMAC-SHA256(tenant key, DOMAIN || public namespace id ||
  block hash)`, with a random 96-bit nonce. The namespace id and the block hash bind the
  bytes to their place (their model, layout and the whole token prefix before them); the
  tenant key, which never leaves its clients, makes the tag unforgeable.
* **Its own namespace.** The layout the daemons see is the caller's with the trailer's
  bytes added to `block_bytes` and `+mac=gmac/<key id>` appended to `kv_layout`, both part
  of the namespace fingerprint: authenticated and plain namespaces (and namespaces under
  two keys) never share a block.
* **Checked on every fetch.** A fetch verifies each block's tag before it hands the
  payload back (a view, no copy); the first block that does not verify ends the result
  there, as a miss from that block on (counted in `AuthStats.rejected_blocks`). Wrong
  bytes never reach the caller.

Why GMAC, and why this way. Measured here (bench/block_auth.py, one block, one thread)
GMAC ran at 4 to 29 GB/s, keyed BLAKE3 at 2 to 7, HMAC-SHA256 at 0.3 to 1.6 and keyed
BLAKE2b at 0.1 to 0.7: GMAC is AES and carry-less multiplication, both in hardware. A
MAC pass is the whole cost of authentication on the shared-memory plane, whose own put
is one copy, so its speed decides the ratio. GMAC fails badly when one key and one nonce
tag two different messages (the hash key can then be solved for, and tags forged), and
the same block is put more than once, with bytes that may differ (GPU kernels are not
bit-exact run to run). So each block has its own key, and each sealing a random nonce
stored with the tag: a nonce would have to repeat for one block's key, about 2^-96 per
pair of puts of that block.

Primitives: `BlockKey` (`generate`, `from_file`), `TAG_BYTES`, `SCHEME`, `sealed_layout`,
`seal`, `opened`, `AuthStats`, `SealingBatch`, `AuthenticatedClient` and
`AsyncAuthenticatedClient` (`put`, `lookup`, `fetch`, `batch` over a `Client` /
`AsyncClient`).

A put copies each payload next to its trailer (the daemons take a block as one buffer):
a pass over the bytes that a plain put does not make. A caller that can write its
payloads where they will be sealed (`batch`) saves that copy; the tag's own pass stays.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import re
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.hashing import HASH_BYTES, block_hashes, namespace_id
from kvstore.layout import KVLayout

SCHEME = "gmac"
NONCE_BYTES = 12
MAC_BYTES = 16
TAG_BYTES = NONCE_BYTES + MAC_BYTES  # the trailer after each payload: nonce || GMAC tag
KEY_BYTES = 32
DOMAIN = b"kvstore.blockauth.v1\x00"
# A batch is sealed and checked on this many threads, blocks split between them (AES-GCM
# and the copies let go of the GIL).
WORKERS = max(1, min(4, os.cpu_count() or 1))
# Sealing buffers kept for the next put (per client): no page faults, no zero-filling.
ARENAS_KEPT = 4
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,32}")


def _aesgcm() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise InvalidArgument("end-to-end block authentication needs the cryptography package: "
                              "pip install 'kvstore[blockauth]'") from None
    return AESGCM


@dataclasses.dataclass(frozen=True, slots=True)
class BlockKey:
    """A tenant's block key (32 random bytes) and its id. The id is part of the namespace
    fingerprint: rotating to a new key under a new id starts a new namespace (the old
    blocks are misses for it, and age out)."""

    key: bytes = dataclasses.field(repr=False)
    key_id: str = "k1"

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise InvalidArgument(f"a block key is {KEY_BYTES} bytes (BlockKey.generate() makes one)")
        if not isinstance(self.key_id, str) or not _KEY_ID.fullmatch(self.key_id):
            raise InvalidArgument(f"a block key id is 1-32 letters, digits, '.', '_' or '-', got {self.key_id!r}")

    @classmethod
    def generate(cls, key_id: str = "k1") -> BlockKey:
        return cls(secrets.token_bytes(KEY_BYTES), key_id)

    @classmethod
    def from_file(cls, path: str, key_id: str = "k1") -> BlockKey:
        """A key kept as 64 hex digits in a file only its owner may read (0600)."""
        st = os.stat(path)
        if st.st_mode & 0o077:
            raise InvalidArgument(f"block key file {path} is accessible to other users; run `chmod 600 {path}`")
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
        try:
            return cls(bytes.fromhex(text), key_id)
        except ValueError:
            raise InvalidArgument(f"block key file {path} must hold {KEY_BYTES * 2} hex digits") from None


def sealed_layout(layout: KVLayout, key: BlockKey) -> KVLayout:
    """The layout the daemons see for `layout` under `key` (see the module docstring)."""
    if layout.groups:
        raise InvalidArgument("end-to-end block authentication does not cover layouts with KV groups yet")
    return dataclasses.replace(layout, kv_layout=f"{layout.kv_layout}+mac={SCHEME}/{key.key_id}",
                               block_bytes=layout.bytes_per_block + TAG_BYTES)


def _block_mac(key: BlockKey, ns: bytes, block_hash: bytes) -> Any:
    """The GMAC of one block's place: AES-GCM under HMAC-SHA256(key, DOMAIN || ns || hash)."""
    return _aesgcm()(hmac.digest(key.key, DOMAIN + ns + block_hash, "sha256"))


def _tag(key: BlockKey, ns: bytes, block_hash: bytes, payload: memoryview) -> bytes:
    """`nonce || tag` for `payload` at its place, with a fresh random nonce."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + _block_mac(key, ns, block_hash).encrypt(nonce, b"", payload)


def _verifies(key: BlockKey, ns: bytes, block_hash: bytes, payload: memoryview, trailer: memoryview) -> bool:
    try:
        _block_mac(key, ns, block_hash).decrypt(bytes(trailer[:NONCE_BYTES]), bytes(trailer[NONCE_BYTES:]), payload)
    except Exception as exc:  # cryptography's InvalidTag (not imported: the package loads lazily)
        if type(exc).__name__ != "InvalidTag":
            raise
        return False
    return True


def _bytes_of(block: Any) -> memoryview:
    view = memoryview(block)
    if not view.contiguous:
        raise InvalidArgument("a block to seal must be one contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def seal(key: BlockKey, ns: bytes, block_hash: bytes, payload: Any) -> bytearray:
    """`payload || tag`: one block as the daemons store it."""
    view = _bytes_of(payload)
    out = bytearray(len(view) + TAG_BYTES)
    out[: len(view)] = view
    out[len(view):] = _tag(key, ns, block_hash, view)
    return out


def opened(key: BlockKey, ns: bytes, block_hash: bytes, sealed: Any, payload_bytes: int) -> memoryview | None:
    """The payload of a sealed block (a view into it), or None if its tag does not verify."""
    view = _bytes_of(sealed)
    if len(view) != payload_bytes + TAG_BYTES:
        return None
    payload = view[:payload_bytes]
    return payload if _verifies(key, ns, block_hash, payload, view[payload_bytes:]) else None


@dataclasses.dataclass
class AuthStats:
    """What a client's authentication saw: blocks sealed, verified, and rejected (a
    rejected block ended its fetch's result: a miss from there on)."""

    sealed_blocks: int = 0
    verified_blocks: int = 0
    rejected_blocks: int = 0


class SealingBatch:
    """The buffers a put of `n` blocks is sealed in, for a caller that can write its
    blocks' bytes where they will be sealed (an engine copying KV out of the GPU, say):
    write block i's payload into `payloads[i]`, then give the batch to `put` in place of
    the blocks. The put then tags them in place, with no copy. A batch serves one put."""

    def __init__(self, layout: KVLayout, arena: np.ndarray, n: int) -> None:
        self.layout = layout
        self.arena = arena
        width = layout.bytes_per_block + TAG_BYTES
        rows = memoryview(arena.reshape(-1).data).cast("B")
        self.rows = [rows[i * width : (i + 1) * width] for i in range(n)]
        self.payloads = [row[: layout.bytes_per_block] for row in self.rows]
        self.used = False

    def __len__(self) -> int:
        return len(self.rows)


class _Sealer:
    """What the sync and asyncio wrappers share: the layouts, hashes and the checks.

    A put seals its batch into an arena (one buffer of `n x (payload + tag)` bytes, kept
    for the next put: a fresh one costs a zero-fill and a page fault per page, as much as
    the copy), each block copied in and tagged on a pool of `WORKERS` threads."""

    def __init__(self, key: BlockKey) -> None:
        self.key = key
        self.stats = AuthStats()
        self._layouts: dict[KVLayout, tuple[KVLayout, bytes]] = {}
        self._lock = threading.Lock()
        self._arenas: list[np.ndarray] = []
        self._pool: ThreadPoolExecutor | None = None

    def layout(self, layout: KVLayout) -> tuple[KVLayout, bytes]:
        """(the sealed layout, its public namespace id), made once per layout."""
        got = self._layouts.get(layout)
        if got is None:
            wire = sealed_layout(layout, self.key)
            got = self._layouts[layout] = (wire, namespace_id(wire))
        return got

    @staticmethod
    def hashes(wire: KVLayout, ns: bytes, token_ids: Sequence[int] | None, block_hashes_: Sequence[bytes] | None,
               first: int, n: int) -> list[bytes]:
        if block_hashes_ is not None:
            if any(len(h) != HASH_BYTES for h in block_hashes_):
                raise InvalidArgument(f"block hashes are {HASH_BYTES} bytes each")
            return list(block_hashes_)[:n]
        if token_ids is None:
            raise InvalidArgument("name the blocks by token_ids or block_hashes")
        return block_hashes(ns, token_ids, wire.block_size_tokens)[first : first + n]

    def _map(self, fn: Any, n: int) -> list[Any]:
        """`fn(i)` for i < n, the indices split into one contiguous share per worker."""
        if n < 2 or WORKERS < 2:
            return [fn(i) for i in range(n)]
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvstore-blockauth")
        step = -(-n // WORKERS)
        parts = list(self._pool.map(lambda lo: [fn(i) for i in range(lo, min(n, lo + step))], range(0, n, step)))
        return [x for part in parts for x in part]

    def _arena(self, n: int, sealed_bytes: int) -> np.ndarray:
        with self._lock:
            for i, arena in enumerate(self._arenas):
                if arena.shape[0] >= n and arena.shape[1] == sealed_bytes:
                    return self._arenas.pop(i)
        return np.empty((n, sealed_bytes), dtype=np.uint8)

    def give_back(self, arena: np.ndarray) -> None:
        """A put is done with its arena (the daemon copied what it needed)."""
        with self._lock:
            if len(self._arenas) < ARENAS_KEPT:
                self._arenas.append(arena)

    def batch(self, layout: KVLayout, n: int) -> SealingBatch:
        self.layout(layout)  # (checks the layout)
        return SealingBatch(layout, self._arena(n, layout.bytes_per_block + TAG_BYTES), n)

    def seal_all(self, layout: KVLayout, token_ids: Sequence[int] | None, blocks: Sequence[Any] | SealingBatch,
                 first_block: int, block_hashes_: Sequence[bytes] | None
                 ) -> tuple[KVLayout, list[memoryview], np.ndarray]:
        """(the sealed layout, each sealed block as a view of the arena, the arena)."""
        wire, ns = self.layout(layout)
        hashes = self.hashes(wire, ns, token_ids, block_hashes_, first_block, len(blocks))
        if len(hashes) < len(blocks):
            raise InvalidArgument(f"{len(blocks)} blocks, but the keys name {len(hashes)}")
        payload = layout.bytes_per_block
        key = self.key
        if isinstance(blocks, SealingBatch):
            if blocks.layout != layout or blocks.used:
                raise InvalidArgument("a SealingBatch serves one put, of the layout it was made for")
            blocks.used = True
            rows, arena = blocks.rows, blocks.arena

            def tag_one(i: int) -> memoryview:  # the payload is in place already
                row = rows[i]
                row[payload:] = _tag(key, ns, hashes[i], row[:payload])
                return row

            out = self._map(tag_one, len(rows))
        else:
            views = [_bytes_of(b) for b in blocks]
            for v in views:
                if len(v) != payload:
                    raise InvalidArgument(f"a block is {len(v)} bytes; the layout says {payload}")
            arena = self._arena(len(views), payload + TAG_BYTES)
            flat = memoryview(arena.reshape(-1).data).cast("B")
            width = payload + TAG_BYTES

            def seal_one(i: int) -> memoryview:
                row = flat[i * width : (i + 1) * width]
                row[:payload] = views[i]
                row[payload:] = _tag(key, ns, hashes[i], row[:payload])
                return row

            out = self._map(seal_one, len(views))
        with self._lock:
            self.stats.sealed_blocks += len(out)
        return wire, out, arena

    def open_all(self, layout: KVLayout, token_ids: Sequence[int] | None, block_hashes_: Sequence[bytes] | None,
                 got: Sequence[Any]) -> list[memoryview]:
        """The payloads of the fetched blocks up to the first that does not verify."""
        wire, ns = self.layout(layout)
        hashes = self.hashes(wire, ns, token_ids, block_hashes_, 0, len(got))
        payload, key = layout.bytes_per_block, self.key

        def open_one(i: int) -> memoryview | None:
            view = _bytes_of(got[i])
            if len(view) != payload + TAG_BYTES:
                return None
            body = view[:payload]
            return body if _verifies(key, ns, hashes[i], body, view[payload:]) else None

        checked = self._map(open_one, min(len(got), len(hashes)))
        out: list[memoryview] = []
        for body in checked:
            if body is None:
                break
            out.append(body)
        rejected = int(len(out) < len(checked))
        with self._lock:
            self.stats.verified_blocks += len(out)
            self.stats.rejected_blocks += rejected
        return out


class AuthenticatedClient:
    """A `Client` whose puts are sealed and whose fetches are verified under `key`
    (lookups go to the sealed namespace). Fetches return views of the payloads; `out`
    buffers are not taken (the sealed block is larger than the payload)."""

    def __init__(self, client: Any, key: BlockKey) -> None:
        self.client = client
        self._sealer = _Sealer(key)

    @property
    def stats(self) -> AuthStats:
        return self._sealer.stats

    def batch(self, layout: KVLayout, n: int) -> SealingBatch:
        """Buffers to write `n` blocks' payloads into, sealed in place by `put` (no copy)."""
        return self._sealer.batch(layout, n)

    def sealed_layout(self, layout: KVLayout) -> KVLayout:
        return self._sealer.layout(layout)[0]

    def put(self, layout: KVLayout, token_ids: Sequence[int] | None, blocks: Sequence[Any] | SealingBatch, *,
            first_block: int = 0, block_hashes: Sequence[bytes] | None = None, **kw: Any) -> Any:
        wire, sealed, arena = self._sealer.seal_all(layout, token_ids, blocks, first_block, block_hashes)
        try:
            return self.client.put(wire, token_ids, sealed, first_block=first_block, block_hashes=block_hashes, **kw)
        finally:
            del sealed
            self._sealer.give_back(arena)

    def lookup(self, layout: KVLayout, token_ids: Sequence[int] | None = None, **kw: Any) -> Any:
        return self.client.lookup(self._sealer.layout(layout)[0], token_ids, **kw)

    def fetch(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
              block_hashes: Sequence[bytes] | None = None, **kw: Any) -> list[memoryview]:
        if kw.get("out") is not None:
            raise InvalidArgument("an authenticated fetch returns views of the payloads; it takes no out buffers")
        got = self.client.fetch(self._sealer.layout(layout)[0], token_ids, block_hashes=block_hashes, **kw)
        return self._sealer.open_all(layout, token_ids, block_hashes, got)


class AsyncAuthenticatedClient:
    """`AuthenticatedClient` over an `AsyncClient`. Sealing and checking run on the
    caller's thread pool (`asyncio.to_thread`): AES-GCM lets go of the GIL."""

    def __init__(self, client: Any, key: BlockKey) -> None:
        self.client = client
        self._sealer = _Sealer(key)

    @property
    def stats(self) -> AuthStats:
        return self._sealer.stats

    def batch(self, layout: KVLayout, n: int) -> SealingBatch:
        """Buffers to write `n` blocks' payloads into, sealed in place by `put` (no copy)."""
        return self._sealer.batch(layout, n)

    def sealed_layout(self, layout: KVLayout) -> KVLayout:
        return self._sealer.layout(layout)[0]

    async def put(self, layout: KVLayout, token_ids: Sequence[int] | None, blocks: Sequence[Any] | SealingBatch,
                  *, first_block: int = 0, block_hashes: Sequence[bytes] | None = None, **kw: Any) -> Any:
        import asyncio

        wire, sealed, arena = await asyncio.to_thread(self._sealer.seal_all, layout, token_ids, blocks, first_block,
                                                      block_hashes)
        try:
            return await self.client.put(wire, token_ids, sealed, first_block=first_block,
                                         block_hashes=block_hashes, **kw)
        finally:
            del sealed
            self._sealer.give_back(arena)

    async def lookup(self, layout: KVLayout, token_ids: Sequence[int] | None = None, **kw: Any) -> Any:
        return await self.client.lookup(self._sealer.layout(layout)[0], token_ids, **kw)

    async def fetch(self, layout: KVLayout, token_ids: Sequence[int] | None = None, *,
                    block_hashes: Sequence[bytes] | None = None, **kw: Any) -> list[memoryview]:
        import asyncio

        if kw.get("out") is not None:
            raise InvalidArgument("an authenticated fetch returns views of the payloads; it takes no out buffers")
        got = await self.client.fetch(self._sealer.layout(layout)[0], token_ids, block_hashes=block_hashes, **kw)
        return await asyncio.to_thread(self._sealer.open_all, layout, token_ids, block_hashes, got)
