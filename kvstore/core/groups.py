"""Grouped namespaces: layouts with several KV groups, stored and hit as one.

Representation. Group g of a grouped namespace is a namespace of its own, filed under
`group_namespace_id(namespace_id, g)` (kvstore.hashing), with the group's bytes per
block; part g of block i is the block (group id g, h_i) there, h_i being the layout's
chain hash. Every group record is a `NamespaceInfo` with `group_of` set to the layout's
record, so the block table, tiers, SSD records, leases, policies, tenancy and the
verified fetch path work on parts unchanged, each part with its own checksum. What makes
the parts of one block one unit is here, in one place:

- Publish together (`GroupedPutTxn`): a put opens one transaction per group over the
  parts the hit rules store (`kvstore.groups.needed`), seals them all (bytes complete,
  checksums taken: the only awaits), then publishes them all in one synchronous step.
  A put that fails anywhere publishes no part.
- Hit together (`GroupBook.probe`): Lookup answers the longest prefix every group can
  serve (full attention: every block; sliding window: the blocks inside its window
  before the prefix end; state: the block at the end), from one probe per group.
- Leave together (`GroupBook.blocks_removed`): the book listens to the copy book's
  removals, as the daemon's event bus does; when any part of a block leaves the store
  (evicted from the last tier, dropped after failing verification, deleted), its
  sibling parts are dropped in the same step, so no block is ever half present. It is
  installed only once a grouped namespace exists, so other stores pay nothing for it.
- Recover together (`GroupBook.adopted`): parts recovered from SSD are adopted when
  the layout is first named; a block whose every-block parts did not all survive (a
  crash between the writes of its parts) is dropped whole then. Parts a window or state
  group had at a prefix end that did not survive make that end a miss by the hit rules.

A corrupted part is dropped by the verified fetch path like any block, which takes its
siblings with it: the block is a miss from then on, never a partial hit. A fetch that
ends early (a part that failed verification or was deleted meanwhile) is a miss of the
whole fetch for the client: the parts it got belong to a prefix end it did not reach.

Primitives: `GroupBook` (`probe`, `lookup`, `lease_prefix`, `begin_put`, `open_fetch`,
`open_group_fetch`, `part_masks`, `delete`, `part_ids`, `adopted`, `blocks_removed`),
`GroupedPutTxn`, `GroupedFetchStream`, `check_spans`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

import numpy as np

from kvstore.core.fetch import FetchPath, FetchStream, FramedBlock
from kvstore.core.index import BlockIndex, make_key
from kvstore.core.put import PutPath, PutTxn
from kvstore.core.store_tier import StoreTier
from kvstore.core.table import I64
from kvstore.core.tier import Slot
from kvstore.core.types import NamespaceInfo, PrefixLookup, PutOutcome, StoreCounters, StoreObserver
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.groups import GroupNeed, Rule, full_bytes, needed, rule_of, window_blocks
from kvstore.hashing import HASH_BYTES

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=FramedBlock)

_NO_ROWS = np.zeros(0, np.int64)


class GroupBook:
    """The grouped namespaces of one store: their lookups, puts, fetches, and the rule
    that a block's parts come and go together."""

    def __init__(self, index: BlockIndex, puts: PutPath, fetches: FetchPath, counters: StoreCounters,
                 tiers: Sequence[StoreTier], acquire_lease: Callable[[I64, int, str], str],
                 unpin: Callable[[str], bool], install: Callable[[StoreObserver | None], None]) -> None:
        self._index = index
        self._puts = puts
        self._fetches = fetches
        self._counters = counters
        self._tiers = list(tiers)
        self._acquire_lease = acquire_lease
        self._unpin = unpin
        self._install = install
        self._tier_names = tuple(index.table.tier_names)
        # The observer the store was given (the daemon's event bus), which this book
        # forwards every event to once it listens in its place.
        self.inner: StoreObserver | None = None
        self.active = False
        self._dropping: set[bytes] = set()

    def activate(self) -> None:
        """Listen to removals (from the first grouped namespace on)."""
        if not self.active:
            self.active = True
            self._install(self)

    # ----------------------------------------------------------------- lookup

    def probe(self, info: NamespaceInfo, packed: bytes) -> tuple[int, list[I64]]:
        """The longest prefix of a chain that every group of `info` can serve, and for
        each group the rows of the parts that prefix needs (block order)."""
        t = self._index.table
        n_asked = len(packed) // HASH_BYTES
        groups = info.groups
        layout = info.layout
        limit = n_asked
        every: dict[int, I64] = {}
        for g, rec in enumerate(groups):
            if rule_of(layout.groups[g]) is Rule.EVERY:
                rows = self._index.prefix_rows(rec.namespace_id, packed[: limit * HASH_BYTES])
                every[g] = rows
                limit = min(limit, len(rows))
        ok = np.ones(limit + 1, np.bool_)  # ok[m]: every window and state group serves a prefix of m
        found: dict[int, I64] = {}
        if limit and len(every) < len(groups):
            q = np.frombuffer(packed, "<u8", count=2 * limit)
            q0, q1 = q[0::2], q[1::2]
            ends = np.arange(1, limit + 1)
            for g, rec in enumerate(groups):
                if g in every:
                    continue
                ns = t.known_ns(rec.namespace_id)
                rows = t.find_rows(ns, q0, q1) if ns is not None else np.full(limit, -1, np.int64)
                found[g] = rows
                present = rows >= 0
                if rule_of(layout.groups[g]) is Rule.END:
                    ok[1:] &= present
                    continue
                # Each block's run of present parts ending there; a prefix of m needs a run
                # of min(window, m) at block m - 1.
                idx = np.arange(limit)
                last_gap = np.maximum.accumulate(np.where(present, -1, idx))
                ok[1:] &= (idx - last_gap) >= np.minimum(window_blocks(layout.groups[g], layout.block_size_tokens),
                                                         ends)
        m = int(np.flatnonzero(ok)[-1])
        out: list[I64] = []
        for need in needed(layout, m):
            g = need.group
            rows = every[g] if g in every else found.get(g, _NO_ROWS)
            out.append(rows[need.start : need.stop])
        return m, out

    def lookup(self, info: NamespaceInfo, packed: bytes, lease_ms: int, count: bool = True) -> PrefixLookup:
        """`Store.lookup` of a grouped namespace: blocks of the longest prefix every group
        serves, each reported in the lowest tier any of its needed parts is in."""
        n_asked = len(packed) // HASH_BYTES
        m, rows = self.probe(info, packed)
        all_rows = np.concatenate(rows) if rows else _NO_ROWS
        lease_id = self._acquire_lease(all_rows, lease_ms, info.tenant) if m and lease_ms > 0 else ""
        tops = np.zeros(m, np.uint8)
        for need, group_rows in zip(needed(info.layout, m), rows):
            if len(group_rows):
                np.maximum(tops[need.start : need.stop], self._index.top_ids(group_rows),
                           out=tops[need.start : need.stop])
        if count:
            self._counters.count_lookup(info, n_asked, m)
        tier_ids = tops.tobytes()
        self._counters.count_tiers(tier_ids, n_asked)
        if len(all_rows):
            part_tops = self._index.top_ids(all_rows)
            for tid, st in enumerate(self._tiers, start=1):
                mine = all_rows[part_tops == tid]
                if len(mine):
                    st.defer_touch(mine[::-1])
        return PrefixLookup(
            namespace_id=info.namespace_id,
            num_blocks=m,
            block_size_tokens=info.layout.block_size_tokens,
            tier_ids=tier_ids,
            tier_names=self._tier_names,
            hashes_packed=packed[: m * HASH_BYTES],
            lease_id=lease_id,
        )

    def lease_prefix(self, info: NamespaceInfo, packed: bytes, ttl_ms: int,
                     tier: str) -> tuple[PrefixLookup, list[int], list[int]]:
        """`Store.lease_prefix` of a grouped namespace: the longest prefix every group
        serves and, when every part it needs sits in `tier`, a bytes-holding lease on
        them all with their offsets and checksums, group-major (`part_order`). When any
        part sits elsewhere, no offset: the reader fetches the prefix as a stream (which
        reads lower tiers verified), since a grouped block is served whole or not at all."""
        m, rows = self.probe(info, packed)
        all_rows = np.concatenate(rows) if rows else _NO_ROWS
        tops = np.zeros(m, np.uint8)
        for need, group_rows in zip(needed(info.layout, m), rows):
            if len(group_rows):
                np.maximum(tops[need.start : need.stop], self._index.top_ids(group_rows),
                           out=tops[need.start : need.stop])
        leased = self._fetches.lease_rows(all_rows, ttl_ms, tier, info.tenant) if m else None
        lease_id, offsets, checksums = leased if leased is not None else ("", [], [])
        c = self._counters
        c.fetches += 1
        if leased is not None:
            c.blocks_fetched += m
        result = PrefixLookup(namespace_id=info.namespace_id, num_blocks=m,
                              block_size_tokens=info.layout.block_size_tokens, tier_ids=tops.tobytes(),
                              tier_names=self._tier_names, hashes_packed=packed[: m * HASH_BYTES], lease_id=lease_id)
        return result, offsets, checksums

    # ----------------------------------------------------------------- put, fetch

    def begin_put(self, info: NamespaceInfo, hashes: Sequence[bytes], parent_hash: bytes | None,
                  tier: str | None, window_bytes: int | None,
                  spans: Sequence[tuple[int, int, int]] = ()) -> GroupedPutTxn:
        """A put of parts, group-major: those the hit rules keep for a put of `hashes`, or
        with `spans` ((group, start, stop) per group, in group order: an import's) those
        named, where a group whose rule needs every block must span them all."""
        needs = check_spans(info, len(hashes), spans) if spans else None
        self.activate()
        return GroupedPutTxn(self, info, list(hashes), parent_hash, tier, window_bytes, needs)

    def open_group_fetch(self, info: NamespaceInfo, group: str, hashes: Sequence[bytes],
                         lease_id: str) -> FetchStream:
        """Group `group`'s parts of the leading run of `hashes` that hold one, as plain
        blocks of the group's size, verified as any fetch (what an export reads)."""
        names = [g.name for g in info.layout.groups]
        if group not in names:
            raise InvalidArgument(f"the layout has no KV group {group!r}; its groups: {', '.join(names)}")
        return self._fetches.open(info.groups[names.index(group)], hashes, lease_id)

    def part_masks(self, info: NamespaceInfo, hashes: Sequence[bytes]) -> list[int]:
        """For each block, a mask of the groups that hold a part of it (bit g: group g)."""
        ids = self.part_ids(info)
        index = self._index
        return [sum(1 << g for g, i in enumerate(ids) if make_key(i, h) in index) for h in hashes]

    def open_fetch(self, info: NamespaceInfo, hashes: Sequence[bytes], lease_id: str) -> GroupedFetchStream:
        """Plan a fetch of the longest prefix of `hashes` every group serves: its parts,
        group-major (`kvstore.groups.part_order`)."""
        m, _ = self.probe(info, b"".join(hashes))
        streams = [self._fetches.open(info.groups[need.group], hashes[need.start : need.stop])
                   for need in needed(info.layout, m) if len(need)]
        self._counters.fetches -= max(0, len(streams) - 1)  # one fetch, whatever its groups
        return GroupedFetchStream(streams, m, max(g.bytes_per_block for g in info.layout.groups), lease_id,
                                  self._unpin)

    @staticmethod
    def part_ids(info: NamespaceInfo) -> list[bytes]:
        """The ids the namespace's blocks are filed under: its groups', or its own."""
        return [g.namespace_id for g in info.groups] if info.groups else [info.namespace_id]

    # ----------------------------------------------------------------- parts leave together

    def blocks_removed(self, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str) -> None:
        if self.inner is not None:
            self.inner.blocks_removed(namespace_id, block_hashes, tier)
        rec = self._puts.registry.get(namespace_id)
        if rec is None or rec.group_of is None:
            return
        self.drop_blocks(rec.group_of, block_hashes)

    def delete(self, info: NamespaceInfo, block_hashes: Sequence[bytes]) -> int:
        """`Store.delete` of blocks of grouped namespace `info`: every part dropped; how
        many of the blocks were present (any part of them)."""
        part_ids = self.part_ids(info)
        present = sum(1 for h in block_hashes if any(make_key(i, h) in self._index for i in part_ids))
        self.drop_blocks(info, block_hashes)
        return present

    def drop_blocks(self, info: NamespaceInfo, block_hashes: Sequence[bytes]) -> int:
        """Drop every part of the named blocks of grouped namespace `info`; how many parts."""
        ids = [g.namespace_id for g in info.groups]
        dropping = self._dropping
        index = self._index
        copies = self._puts.copies
        gone = 0
        for h in block_hashes:
            keys = [make_key(i, h) for i in ids]
            if keys[0] in dropping:
                continue  # this block's parts are being dropped further up the stack
            dropping.update(keys)
            try:
                for key in keys:
                    entry = index.get(key)
                    if entry is not None and not entry.removed:
                        copies.drop(entry)
                        gone += 1
            finally:
                dropping.difference_update(keys)
        self._counters.group_parts_dropped += gone
        return gone

    def blocks_stored(self, namespace_id: bytes, block_hashes: Sequence[bytes], tier: str) -> None:
        if self.inner is not None:
            self.inner.blocks_stored(namespace_id, block_hashes, tier)

    def blocks_moved(self, namespace_id: bytes, block_hashes: Sequence[bytes], from_tier: str, to_tier: str) -> None:
        if self.inner is not None:
            self.inner.blocks_moved(namespace_id, block_hashes, from_tier, to_tier)

    def adopted(self, info: NamespaceInfo) -> int:
        """Blocks recovered from SSD were just adopted into grouped namespace `info`: drop
        every block whose every-block parts did not all survive; how many blocks."""
        self.activate()
        layout = info.layout
        every = [rec.namespace_id for g, rec in enumerate(info.groups) if rule_of(layout.groups[g]) is Rule.EVERY]
        if not every:
            return 0
        ids = set(self.part_ids(info))
        held: dict[bytes, set[bytes]] = {}
        for entry in self._index:
            ns = entry.key[:HASH_BYTES]
            if ns in ids:
                held.setdefault(entry.key[HASH_BYTES:], set()).add(ns)
        torn = [h for h, where in held.items() if not all(i in where for i in every)]
        if torn:
            self.drop_blocks(info, torn)
            logger.warning("namespace %s: %d blocks recovered from SSD without all their parts were dropped",
                           info.namespace_id.hex(), len(torn))
        return len(torn)


class GroupedPutTxn:
    """A put of a grouped namespace: one `PutTxn` per group over the parts the put stores,
    published together or not at all. Its wire blocks are the parts, group-major
    (`kvstore.groups.part_order`): `write(part, data)` takes part `part`'s bytes."""

    def __init__(self, book: GroupBook, info: NamespaceInfo, hashes: list[bytes], parent_hash: bytes | None,
                 tier: str | None, window_bytes: int | None, needs: list[GroupNeed] | None = None) -> None:
        self._book = book
        self._info = info
        self._hashes = hashes
        n = len(hashes)
        layout = info.layout
        self.block_bytes = layout.bytes_per_block
        self._needs: list[GroupNeed] = [need for need in (needed(layout, n) if needs is None else needs) if len(need)]
        puts = book._puts
        self._subs: list[PutTxn] = []
        for need in self._needs:
            parent = hashes[need.start - 1] if need.start else parent_hash
            self._subs.append(puts.begin(info.groups[need.group], hashes[need.start : need.stop], parent, tier,
                                         window_bytes))
        # Part k of the wire belongs to sub-transaction s where starts[s] <= k < starts[s + 1].
        self._starts = np.cumsum([0] + [len(need) for need in self._needs]).tolist()
        self.num_parts = self._starts[-1]
        self._sub = 0
        self._stored_bytes = sum(len(need) * layout.groups[need.group].bytes_per_block for need in self._needs)
        self._skipped_bytes = full_bytes(layout, n) - self._stored_bytes
        self._done = False

    async def __aenter__(self) -> GroupedPutTxn:
        await self.reserve()
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._done:
            self.abort()

    async def reserve(self) -> None:
        try:
            for sub in self._subs:
                await sub.reserve()
        except BaseException:
            self.abort()
            raise

    @property
    def groups(self) -> list[PutTxn]:
        """The groups' transactions, in wire order (those of a group with no part to store
        left out): what a plane that moves each group's parts as a run of its own fills."""
        return list(self._subs)

    def slots(self) -> list[Slot | None]:
        """Where each part's bytes must land, in wire order; None for parts already present."""
        return [slot for sub in self._subs for slot in sub.slots()]

    def mark_written(self) -> None:
        """Every part was written into its slot by a co-located client (the
        shared-memory or device plane); `commit` then takes the client's checksums."""
        for sub in self._subs:
            sub.mark_written()

    async def write(self, part: int, data: bytes | memoryview) -> None:
        """Append `data` to part `part` (a wire block of this put, group-major)."""
        starts = self._starts
        s = self._sub
        if not starts[s] <= part < starts[s + 1]:
            if not 0 <= part < self.num_parts:
                raise InvalidArgument(
                    f"a chunk for part {part}, but this put of a grouped layout has {self.num_parts} parts "
                    f"(0 to {self.num_parts - 1}): every group's parts the hit rules keep, group-major"
                )
            if part < starts[s]:
                raise InvalidArgument(f"a chunk for part {part} arrived after part {starts[s]} began: chunks out of "
                                      "order; send each part whole, in order")
            while not starts[s] <= part < starts[s + 1]:
                s += 1
            self._sub = s
        await self._subs[s].write(part - starts[s], data)

    async def commit(self, checksums: Sequence[int] | None = None,
                     check: Callable[[], None] | None = None) -> PutOutcome:
        """Seal every group's transaction, then publish them all in one synchronous step
        (`check` first, as `PutTxn.commit` does). `checksums`: one per part, in wire order."""
        if checksums is not None and len(checksums) != self.num_parts:
            raise InvalidArgument(f"{len(checksums)} checksums for a put of {self.num_parts} parts")
        try:
            for s, sub in enumerate(self._subs):
                sub.seal(None if checksums is None else checksums[self._starts[s] : self._starts[s + 1]])
            if self._done:
                raise FailedPrecondition("this put was aborted")
            if check is not None:
                check()
        except BaseException:
            self.abort()
            raise
        # No await from here on: every part is published in this step, or none.
        results = []
        try:
            for sub in self._subs:
                results.append(sub.publish_sealed())
        except BaseException:
            # Only the first can fail (filing the namespace), before anything is published.
            self.abort()
            raise
        self._done = True
        stored_at: set[int] = set()
        for need, sub in zip(self._needs, self._subs):
            stored_at.update(need.start + i for i in sub.stored_positions())
        n = len(self._hashes)
        c = self._book._counters
        stored_parts = sum(r.stored for r in results)
        c.puts -= len(results) - 1  # one put, whatever its groups
        c.blocks_stored += len(stored_at) - stored_parts
        c.blocks_existing += (n - len(stored_at)) - sum(r.existing for r in results)
        c.group_parts_stored += stored_parts
        c.group_bytes_skipped += self._skipped_bytes
        filed = self._book._puts.registry.get(self._info.namespace_id) or self._info
        return PutOutcome(filed.namespace_id, len(stored_at), n - len(stored_at), list(self._hashes))

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        for sub in self._subs:
            sub.abort()
        # Each sub-transaction counted a failure; a grouped put is one.
        self._book._counters.put_failures -= len(self._subs) - 1


class GroupedFetchStream:
    """The parts of a grouped prefix, group-major, each verified as it leaves (the
    groups' `FetchStream`s one after another). `num_blocks` counts the parts (wire
    blocks), `prefix_blocks` the blocks of the prefix; any part that cannot be sent ends
    the stream (`ended_early`), and the client then treats the whole fetch as a miss."""

    def __init__(self, streams: list[FetchStream], prefix_blocks: int, block_bytes: int, lease_id: str,
                 unpin: Callable[[str], bool]) -> None:
        self._streams = streams
        self.prefix_blocks = prefix_blocks
        self.num_blocks = sum(s.num_blocks for s in streams)
        self.block_bytes = block_bytes
        self._lease_id = lease_id
        self._unpin = unpin
        self.sent = 0
        self.ended_early = ""
        self.verification_failed = False
        self._closed = False

    async def __aenter__(self) -> GroupedFetchStream:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    @property
    def groups(self) -> list[FetchStream]:
        """The groups' streams, in wire order: what a plane that moves each group's parts
        as a run of its own sends. Closing this stream closes them and ends the lease."""
        return list(self._streams)

    @property
    def checksums(self) -> list[int]:
        """The put-time checksum of each planned part, in wire order."""
        return [c for stream in self._streams for c in stream.checksums]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in self._streams:
            stream.close()
        if self._lease_id:
            self._unpin(self._lease_id)

    async def frames(self, frame: Callable[[int, memoryview], F]) -> AsyncIterator[F]:
        base = 0
        for stream in self._streams:
            async for framed in stream.frames(functools.partial(_shifted, frame, base)):
                self.sent += 1
                yield framed
            if stream.ended_early:
                self.ended_early = f"part {base + stream.sent} of the grouped prefix: {stream.ended_early}"
                self.verification_failed = stream.verification_failed
                return
            base += stream.num_blocks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Each part as one verified copy."""
        for stream in self._streams:
            async for data in stream:
                self.sent += 1
                yield data
            if stream.ended_early:
                self.ended_early = stream.ended_early
                self.verification_failed = stream.verification_failed
                return


def check_spans(info: NamespaceInfo, n: int, spans: Sequence[tuple[int, int, int]]) -> list[GroupNeed]:
    """The parts a put of `n` blocks names (`PutHeader.group_spans`), checked: one span per
    group in group order, inside the put, every block for a group whose rule needs it."""
    layout = info.layout
    if [g for g, _, _ in spans] != list(range(len(layout.groups))):
        raise InvalidArgument(f"group_spans must name each of the layout's {len(layout.groups)} groups once, in "
                              f"order; got groups {[g for g, _, _ in spans]}")
    out = []
    for g, start, stop in spans:
        group = layout.groups[g]
        if not 0 <= start <= stop <= n:
            raise InvalidArgument(f"group {group.name!r} spans blocks [{start}, {stop}) of a put of {n}")
        if rule_of(group) is Rule.EVERY and (start, stop) != (0, n):
            raise InvalidArgument(f"group {group.name!r} ({group.kind.value}) has a part in every block: its span "
                                  f"must be [0, {n}), got [{start}, {stop})")
        out.append(GroupNeed(g, start, stop))
    return out


def _shifted(frame: Callable[[int, memoryview], F], base: int, position: int, data: memoryview) -> F:
    return frame(base + position, data)
