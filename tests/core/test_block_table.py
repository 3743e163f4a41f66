"""The columnar block table against a dict model: keys to rows, batch probes, growth,
row recycling and stale handles."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.core.index import BlockEntry, BlockIndex, BlockState
from kvstore.core.table import PROBE_COMPILED, BlockTable
from kvstore.core.tier import Slot

NS_A = bytes(range(16))
NS_B = bytes(range(16, 32))


def h(i: int) -> bytes:
    """A block hash with structure in its high bytes only (a weak hash must still spread)."""
    return bytes(8) + i.to_bytes(8, "big")


def key(ns: bytes, i: int) -> bytes:
    return ns + h(i)


def ready(index: BlockIndex, k: bytes, tier: str = "host", offset: int = 0) -> BlockEntry:
    e = index.new_entry(k, None, 64, 7)
    e.add_slot(Slot(tier, offset, 64))
    e.state = BlockState.READY
    index.add(e)
    return e


ops = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "probe"]), st.sampled_from([NS_A, NS_B]),
              st.integers(0, 300)),
    max_size=400,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_table_matches_a_dict(trace: list[tuple[str, bytes, int]]) -> None:
    index = BlockIndex(BlockTable(16))  # small, so that the trace grows it several times
    model: dict[bytes, BlockEntry] = {}
    for op, ns, i in trace:
        k = key(ns, i)
        if op == "add":
            if k in model:
                continue
            model[k] = ready(index, k, offset=i)
        elif op == "remove":
            got = index.remove(k)
            want = model.pop(k, None)
            assert (got is None) == (want is None)
            if want is not None:
                assert want.removed and got is not None and got.key == k
        else:
            assert (index.get(k) is not None) == (k in model)
        assert len(index) == len(model)
    # Every present key maps to its own row, with its own fields.
    for k, e in model.items():
        got = index.get(k)
        assert got == e and got.key == k and got.slots() == (Slot("host", int.from_bytes(k[24:], "big"), 64),)
    # A batch probe agrees with one probe per key, for each namespace.
    for ns in (NS_A, NS_B):
        hashes = [h(i) for i in range(301)]
        q = np.frombuffer(b"".join(hashes), "<u8")
        nsid = index.table.known_ns(ns)
        if nsid is None:
            continue
        rows = index.table.find_rows(nsid, q[0::2].copy(), q[1::2].copy())
        assert rows.tolist() == index.table.find_rows(nsid, q[0::2], q[1::2], compiled=False).tolist()
        for i, row in enumerate(rows.tolist()):
            e = model.get(key(ns, i))
            assert row == (e.row if e is not None else -1)
        # The compiled chain probe agrees with the numpy one on every prefix start.
        for start in (0, 1, 17, 150, 299):
            packed = b"".join(hashes[start:])
            want = index.table.prefix_rows(nsid, packed, compiled=False).tolist()
            assert index.table.prefix_rows(nsid, packed).tolist() == want
            assert want == [model[key(ns, i)].row for i in range(start, start + len(want))]
            assert start + len(want) == 301 or key(ns, start + len(want)) not in model
    assert sorted(e.key for e in index) == sorted(model)


def test_the_chain_probe_is_compiled() -> None:
    # `pip install -e .` builds kvstore/_native/; without it every lookup takes the
    # slower numpy probe, which is correct but would quietly cost latency.
    assert PROBE_COMPILED, "kvstore._native was not built: is a C compiler with Python's headers installed?"


def test_the_compiled_probe_refuses_arrays_that_are_not_a_key_table() -> None:
    from kvstore.native import native as _native

    if _native is None:
        pytest.skip("the compiled helpers were not built")
    table = BlockTable(16)
    table.ns_id(NS_A)
    out = np.empty(4, np.int64)
    cols = table.key_columns
    slots, shift, h0, h1, ns, ns_fp, flags = cols
    assert _native.prefix_rows(h(1), cols, 0, out) == 0  # an empty table: nothing found
    with pytest.raises(ValueError, match="whole number"):
        _native.prefix_rows(b"x" * 17, cols, 0, out)
    with pytest.raises(ValueError, match="shorter"):
        _native.prefix_rows(h(1) * 5, cols, 0, out)
    with pytest.raises(ValueError, match="one key table"):
        _native.prefix_rows(h(1), (slots[:48], *cols[1:]), 0, out)
    with pytest.raises(ValueError, match="one key table"):
        _native.prefix_rows(h(1), (slots, shift + 1, *cols[2:]), 0, out)
    with pytest.raises(TypeError, match="tuple"):
        _native.prefix_rows(h(1), cols[:6], 0, out)
    with pytest.raises(TypeError, match="tuple"):
        _native.prefix_rows(h(1), list(cols), 0, out)
    with pytest.raises(BufferError):
        _native.prefix_rows(h(1), cols, 0, bytes(32))  # not writable
    with pytest.raises(ValueError, match="not interned"):
        _native.prefix_rows(h(1), cols, 1, out)  # a namespace id with no fingerprint
    # The row flags, for the walk in row order: one per row, and a flag to look for.
    assert _native.prefix_rows(h(1), cols, 0, out, False, 32) == 0
    with pytest.raises(ValueError, match="one key table"):
        _native.prefix_rows(h(1), (*cols[:6], flags[:1]), 0, out, False, 32)
    with pytest.raises(ValueError, match="row flag"):
        _native.prefix_rows(h(1), cols, 0, out, False, 256)


def test_the_key_columns_follow_growth_rehash_and_new_namespaces() -> None:
    """The compiled calls' one argument names the arrays the table holds now: it is
    rebuilt when they are replaced, and left alone otherwise."""
    index = BlockIndex(BlockTable(16))
    t = index.table
    entries = [ready(index, key(NS_A, 0))]
    cols = t.key_columns
    entries.append(ready(index, key(NS_A, 1)))
    assert t.key_columns is cols  # no new tuple per call or per block
    entries += [ready(index, key(NS_A, i)) for i in range(2, 200)]  # grows the columns, rehashes
    assert t.key_columns is not cols
    slots, shift, h0, h1, ns, ns_fp, flags = t.key_columns
    assert h0 is t.h0 and h1 is t.h1 and ns is t.ns and flags is t.flags and ns_fp is t.ns_fp
    assert len(slots) >= 2 * len(index) and 1 << (64 - shift) == len(slots)
    ready(index, key(NS_B, 0))  # a new namespace: a new fingerprint array
    assert t.key_columns[5] is t.ns_fp and len(t.ns_fp) == 2
    chain = b"".join(h(i) for i in range(200))
    assert index.prefix_rows(NS_A, chain).tolist() == [e.row for e in entries]


def test_prefix_rows_stop_at_the_first_missing_block() -> None:
    index = BlockIndex()
    entries = [ready(index, key(NS_A, i)) for i in range(6)]
    index.remove(key(NS_A, 3))
    rows = index.prefix_rows(NS_A, b"".join(h(i) for i in range(6)))
    assert rows.tolist() == [e.row for e in entries[:3]]
    assert index.prefix_rows(NS_B, h(0)).tolist() == []  # another namespace: same hashes, other keys
    assert index.prefix_rows(NS_A, b"").tolist() == []


def test_a_chain_is_found_in_row_order_only_where_those_rows_are_indexed() -> None:
    """The compiled probe looks for each key first in the row after the previous key's
    (a chain put in one call fills consecutive rows). It must give what the key table
    gives wherever that next row holds the key without being its indexed row: a removed
    block (its columns still hold the key), a pending one, another namespace's."""
    index = BlockIndex()
    t = index.table
    rows = [ready(index, key(NS_A, i)).row for i in range(6)]
    assert rows == list(range(6))  # rows 0-5, in chain order
    pending = index.new_entry(key(NS_A, 6), None, 64, 7)  # row 6: the key, not published
    other = ready(index, key(NS_B, 7))  # row 7: the next hash, in another namespace
    a7 = ready(index, key(NS_A, 7))  # row 8
    index.remove(key(NS_A, 3))  # row 3 keeps its columns but leaves the key table
    a3 = ready(index, key(NS_A, 3))  # republished in a row of its own
    assert (pending.row, other.row, a7.row) == (6, 7, 8) and a3.row not in rows
    ns_a, ns_b = t.known_ns(NS_A), t.known_ns(NS_B)

    def both(ns: int, hashes: list[bytes]) -> list[int]:
        packed = b"".join(hashes)
        want = t.prefix_rows(ns, packed, compiled=False).tolist()
        assert t.prefix_rows(ns, packed).tolist() == want
        q = np.frombuffer(packed, "<u8")
        every = t.find_rows(ns, q[0::2].copy(), q[1::2].copy()).tolist()
        assert every == t.find_rows(ns, q[0::2], q[1::2], compiled=False).tolist()
        return want

    assert both(ns_a, [h(i) for i in range(8)]) == [0, 1, 2, a3.row, 4, 5]  # stops at the pending block
    pending.state = BlockState.READY
    index.add(pending)
    assert both(ns_a, [h(i) for i in range(8)]) == [0, 1, 2, a3.row, 4, 5, 6, 8]  # row 7 is NS_B's
    assert both(ns_b, [h(7)]) == [7]
    assert both(ns_b, [h(6), h(7)]) == []


def test_rows_are_recycled_only_when_nothing_holds_them() -> None:
    table = BlockTable(16)
    index = BlockIndex(table)
    held = ready(index, key(NS_A, 1))
    free = [ready(index, key(NS_A, 2 + i)) for i in range(600)]
    held.readers += 1
    held.pins += 1
    index.remove_entry(held)
    for e in free:
        index.remove_entry(e)
    assert held.removed and all(e.removed for e in free) and len(index) == 0
    rows = {ready(index, key(NS_A, 1000 + i)).row for i in range(1200)}
    # Removed rows nothing holds are reused (in batches); the held one never is.
    assert rows & {e.row for e in free} and held.row not in rows
    reused = next(e for e in free if e.row in rows)
    assert reused.stale and reused.removed and reused.pins == 0 and reused.slots() == ()
    assert not held.stale and held.pins == 1 and held.slots() != ()
    with pytest.raises(AssertionError):
        reused.pins += 1  # a write through a stale handle is a bug, never a silent change
    held.pins -= 1
    held.readers -= 1
    held.clear_slots()
    for e in [index.get(key(NS_A, 1000 + i)) for i in range(1200)]:
        assert e is not None
        index.remove_entry(e)
    again = {ready(index, key(NS_A, 5000 + i)).row for i in range(2400)}
    assert held.row in again and held.stale


def test_generation_tells_a_recycled_row_from_its_new_block() -> None:
    index = BlockIndex(BlockTable(16))
    olds = [ready(index, key(NS_A, i)) for i in range(300)]
    for e in olds:
        index.remove_entry(e)
    new = ready(index, key(NS_A, 1000))
    old = next(e for e in olds if e.row == new.row)
    assert new != old and old.stale and not new.stale
    assert index.get(key(NS_A, 1000)) == new and index.get(old.key if not old.stale else key(NS_A, 0)) is None


def test_growth_keeps_every_field() -> None:
    table = BlockTable(16)
    index = BlockIndex(table)
    entries = []
    for i in range(1000):
        e = index.new_entry(key(NS_A, i), key(NS_A, i - 1) if i else None, 100 + i, i * 3, itemsize=2)
        e.add_slot(Slot("host", i * 4096, 4096))
        if i % 7 == 0:
            e.add_slot(Slot("ssd", i, 5000))
        e.state = BlockState.READY
        entries.append(e)
    index.add_many(entries)
    assert table.cap >= 1000 and len(index) == 1000
    for i, e in enumerate(entries):
        got = index.get(key(NS_A, i))
        assert got == e and got.nbytes == 100 + i and got.checksum == i * 3
        assert got.parent == (key(NS_A, i - 1) if i else None)
        assert got.slot_in("host") == Slot("host", i * 4096, 4096)
        assert (got.slot_in("ssd") is not None) == (i % 7 == 0)


def test_a_third_copy_is_kept_while_a_move_is_under_way() -> None:
    index = BlockIndex()
    e = ready(index, key(NS_A, 1), tier="host")
    e.add_slot(Slot("ssd", 8, 64))
    e.add_slot(Slot("hbm", 16, 64))
    assert e.tier_names() == ["host", "ssd", "hbm"]
    e.pop_slot("host")
    assert e.tier_names() == ["ssd", "hbm"] and e.slot_in("hbm") == Slot("hbm", 16, 64)


def test_detached_entries_move_into_the_index_that_publishes_them() -> None:
    e = BlockEntry(key(NS_A, 5), key(NS_A, 4), 10, 99, {"host": Slot("host", 0, 16)}, BlockState.READY, pins=2)
    index = BlockIndex()
    index.add(e)
    assert e.table is index.table and index.get(key(NS_A, 5)) == e
    assert e.pins == 2 and e.checksum == 99 and e.parent == key(NS_A, 4) and e.only_tier() == "host"


def test_keys_of_the_wrong_size_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockEntry(b"short", None, 1, 0)
    index = BlockIndex()
    assert index.get(b"short") is None and b"short" not in index


def test_a_duplicate_key_is_never_published() -> None:
    index = BlockIndex()
    ready(index, key(NS_A, 1))
    dup = index.new_entry(key(NS_A, 1), None, 1, 0)
    dup.state = BlockState.READY
    with pytest.raises(AssertionError):
        index.add_many([dup])
    twice = [index.new_entry(key(NS_A, 2), None, 1, 0) for _ in range(2)]
    for e in twice:
        e.state = BlockState.READY
    with pytest.raises(AssertionError):
        index.add_many(twice)


def test_weak_hashes_are_found() -> None:
    # Hashes that differ only in a few high bytes must not pile into one probe run.
    index = BlockIndex(BlockTable(16))
    entries = [ready(index, NS_A + struct.pack("<QQ", 0, i << 40)) for i in range(4096)]
    rows = index.prefix_rows(NS_A, b"".join(struct.pack("<QQ", 0, i << 40) for i in range(4096)))
    assert rows.tolist() == [e.row for e in entries]


def _ready_entry(index: BlockIndex, k: bytes) -> BlockEntry:
    e = index.new_entry(k, None, 64, 7)
    e.add_slot(Slot("host", 0, 64))
    e.state = BlockState.READY
    return e


@pytest.mark.parametrize("compiled", [True, False])
def test_batches_placed_compiled_or_in_numpy_are_all_found(compiled: bool, monkeypatch) -> None:
    """Puts publish their blocks in batches (`add_many` -> `_place`), removals one at a
    time and in batches punch holes (backward-shift deletion), growth re-places
    everything: compiled or not, every key is found at its own row and removed keys are
    not."""
    import random

    import kvstore.core.table

    monkeypatch.setattr(kvstore.core.table, "PLACE_COMPILED", compiled)
    rng = random.Random(5)
    index = BlockIndex(BlockTable(16))
    model: dict[bytes, BlockEntry] = {}
    for _step in range(60):
        ns = rng.choice([NS_A, NS_B])
        batch = [key(ns, i) for i in rng.sample(range(5000), 40)]
        batch = [k for k in dict.fromkeys(batch) if k not in model]
        entries = [_ready_entry(index, k) for k in batch]
        index.add_many(entries)
        model.update(zip(batch, entries))
        for k in rng.sample(list(model), min(len(model), 8)):
            assert index.remove(k) is not None
            del model[k]
        # Evictions take many rows out at once (`unindex_rows`).
        gone = rng.sample(list(model), min(len(model), 8))
        index.table.unindex_rows(np.array([model.pop(k).row for k in gone], np.int64))
    for ns in (NS_A, NS_B):
        hashes = [h(i) for i in range(5000)]
        q = np.frombuffer(b"".join(hashes), "<u8")
        nsid = index.table.known_ns(ns)
        rows = index.table.find_rows(nsid, q[0::2].copy(), q[1::2].copy()).tolist()
        want = [model[key(ns, i)].row if key(ns, i) in model else -1 for i in range(5000)]
        assert rows == want
        assert rows == index.table.find_rows(nsid, q[0::2], q[1::2], compiled=False).tolist()
    assert len(index) == len(model)


def test_compiled_placement_refuses_rows_outside_the_table() -> None:
    from kvstore.native import native

    if native is None:
        pytest.skip("the compiled helpers were not built")
    index = BlockIndex(BlockTable(16))
    entry = ready(index, key(NS_A, 1))
    t = index.table
    slots, shift = t.key_columns[:2]
    before = slots.copy()
    for bad in ([entry.row, -1], [entry.row, len(t.h0)]):
        for compiled in (native.place_rows, native.unindex_rows):
            with pytest.raises(ValueError, match="not a row of this table"):
                compiled(np.array(bad, np.int64), t.key_columns)
            assert np.array_equal(slots, before)  # nothing written
    with pytest.raises(ValueError, match="not indexed"):
        native.unindex_rows(np.array([entry.row + 1], np.int64), t.key_columns)
    with pytest.raises(ValueError, match="one key table"):
        native.place_rows(np.zeros(1, np.int64), (slots, shift + 1, *t.key_columns[2:]))


def test_reaping_frees_rows_as_free_row_does_and_keeps_retired_ones() -> None:
    """Rows reaped in one step end as `free_row` leaves each (generation bumped, fields
    cleared, back on the free list), except one still keeping a retired copy for a reader."""
    index = BlockIndex(BlockTable(16))
    entries = [ready(index, key(NS_A, i)) for i in range(300)]
    keeper = entries[7]
    index.table.retired[keeper.row] = [Slot("host", 0, 64)]
    gens = index.table.gen.copy()
    for e in entries:
        index.remove_entry(e)
    t = index.table
    t._reap()
    freed = [e.row for e in entries if e is not keeper]
    assert sorted(t._free[: t._nfree].tolist()) == sorted(freed)
    assert t._dead[: t._ndead].tolist() == [keeper.row]
    assert np.array_equal(t.gen[freed], gens[freed] + 1) and t.gen[keeper.row] == gens[keeper.row]
    assert not np.any(t.flags[freed]) and not np.any(t.lt[freed]) and not np.any(t.pins[freed])
    assert t.flags[keeper.row] != 0 and keeper.row in t.retired
