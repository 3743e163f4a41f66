"""The lean paths taken at scale behave exactly like the plain ones they replace.

Compact index entries (one Slot instead of a dict), the batch fast paths of ARC and the
hint wrapper (touch_many, insert_many), the C-level prefix probe, and the binary SSD
snapshot with its checksum (a damaged one falls back to the log scan).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstore.core.index import BlockEntry, BlockIndex, BlockState
from kvstore.core.policies import make_policy
from kvstore.core.policies.arc import ARCPolicy
from kvstore.core.tier import Slot
from kvstore.tiers.ssd import SNAPSHOT_NAME
from tests.tiers.test_ssd_tier import make, put_many


def key(i: int) -> bytes:
    return bytes(16) + i.to_bytes(16, "big")


def arc_state(p: ARCPolicy) -> tuple[list[bytes] | list[int], ...]:
    return p.state()


@pytest.mark.parametrize("seed", range(12))
def test_arc_batch_paths_match_one_key_at_a_time(seed: int) -> None:
    rng = random.Random(seed)
    batch, single = ARCPolicy(), ARCPolicy()
    universe = 60
    for _ in range(200):
        op = rng.random()
        if op < 0.35:
            start = rng.randrange(universe)
            keys = [key(j % universe) for j in range(start, start + rng.randrange(1, 12))]
            if rng.random() < 0.2:
                keys.append(keys[0])  # a duplicate in one batch
            batch.insert_many(keys, [None] * len(keys))
            for k in keys:
                single.insert(k)
        elif op < 0.75:
            start = rng.randrange(universe)
            keys = [key(j % universe) for j in range(start, start + rng.randrange(1, 15))]
            if rng.random() < 0.3:
                rng.shuffle(keys)
            batch.touch_many(keys)
            for k in keys:
                single.touch(k)
        elif op < 0.95:
            victim = single.victim(lambda k: True)
            assert batch.victim(lambda k: True) == victim
            if victim is not None:
                batch.remove(victim)
                single.remove(victim)
        else:
            k = key(rng.randrange(universe))
            batch.remove(k)
            single.remove(k)
        assert arc_state(batch) == arc_state(single)


def test_hint_wrapper_tracks_membership_through_its_base() -> None:
    for name in ("hint-arc", "hint-prefix-lru"):
        p = make_policy(name, clock=lambda: 0.0)
        p.insert_many([key(1), key(2), key(3)], [None, key(1), key(2)])
        assert len(p) == 3 and key(2) in p
        p.hint([key(2)], "s", 10.0)  # parked: out of the base order, still tracked
        assert len(p) == 3 and key(2) in p
        p.insert(key(2), key(1))  # inserting a tracked (parked) key is a touch
        assert len(p) == 3
        p.end_session("s")  # handed back to the base order, with its parent
        assert len(p) == 3 and key(2) in p
        if name == "hint-prefix-lru":
            assert p.parent_of(key(2)) == key(1)
            # key(1) still has a tracked child: the prefix base takes the leaf first.
            assert p.victim(lambda k: True) == key(3)
        p.remove(key(2))
        assert len(p) == 2 and key(2) not in p


def test_entry_keeps_one_slot_inline_and_more_as_a_tuple() -> None:
    host, ssd = Slot("host", 0, 256), Slot("ssd", 4096, 512)
    e = BlockEntry(key(1), None, 200, 7, {"host": host}, BlockState.READY)
    assert e.only_tier() == "host" and e.slots() == (host,) and e.retired is None
    e.locations["ssd"] = ssd
    assert e.only_tier() is None and e.tier_names() == ["host", "ssd"]
    assert dict(e.locations) == {"host": host, "ssd": ssd} and "ssd" in e.locations
    moved = Slot("host", 512, 256)
    e.add_slot(moved)  # replaces the copy in the same tier
    assert e.slot_in("host") == moved and len(e.locations) == 2
    assert e.locations.pop("host") == moved
    assert e.only_tier() == "ssd"
    e.retire(moved)
    assert e.retired == [moved]
    with pytest.raises(ValueError):
        e.locations["host"] = ssd  # a slot filed under another tier's name
    with pytest.raises(KeyError):
        e.pop_slot("hbm")
    e.clear_slots()
    assert e.slots() == () and not e.locations


def test_prefix_probe_stops_at_the_first_missing_block() -> None:
    index = BlockIndex()
    entries = [BlockEntry(key(i), None, 1, 0, {"host": Slot("host", i, 1)}, BlockState.READY) for i in range(5)]
    index.add_many([entries[0], entries[1], entries[3]])
    assert index.longest_ready_prefix([key(0), key(1), key(2), key(3)]) == entries[:2]
    assert index.longest_ready_prefix([key(0), key(1)]) == entries[:2]
    assert index.longest_ready_prefix([key(2), key(0)]) == []
    with pytest.raises(AssertionError):
        index.add_many([entries[1]])  # published twice


async def test_damaged_snapshot_falls_back_to_the_log(tmp_path: Path) -> None:
    tier = make(tmp_path)
    written = await put_many(tier, 12)
    tier.close()
    snap = tmp_path / SNAPSHOT_NAME
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit inside a record
    snap.write_bytes(bytes(data))
    again = make(tmp_path)
    try:
        report = await again.recover()
        assert not report.from_snapshot, "a snapshot that fails its checksum must not be used"
        assert {b.key for b in report.blocks} == set(written)
        assert not snap.exists()
        for b in report.blocks:
            assert await again.get_block(b.slot, b.nbytes) == written[b.key][1]
    finally:
        again.close()


async def test_snapshot_round_trip_keeps_parents_and_accounting(tmp_path: Path) -> None:
    tier = make(tmp_path)
    written = await put_many(tier, 9)
    used = tier.used_bytes
    tier.close()
    again = make(tmp_path)
    try:
        report = await again.recover()
        assert report.from_snapshot and again.used_bytes == used and again.blocks == 9
        offsets = [b.slot.offset for b in report.blocks]
        assert offsets == sorted(offsets)
        for b in report.blocks:
            i = int.from_bytes(b.key[16:], "big")
            assert b.parent == (key(i - 1) if i else None)
            assert b.slot == written[b.key][0]
    finally:
        again.close()


def test_gc_freezer_freezes_after_enough_new_blocks() -> None:
    import gc

    from kvstore.server.host_resources import GcFreezer

    gc.unfreeze()
    freezer = GcFreezer(min_blocks=100, growth=0.25)
    try:
        assert not freezer.maybe_freeze(99, 99)  # too few new blocks
        held = [[i] for i in range(1000)]  # long-lived containers, like index entries
        assert freezer.maybe_freeze(1000, 1000)
        assert gc.get_freeze_count() >= len(held) and freezer.freezes == 1
        assert not freezer.maybe_freeze(1150, 1150)  # 150 new: under a quarter of the index
        assert freezer.maybe_freeze(1300, 1200)  # 300 new, a quarter of 1200
        freezer.frozen_at(5000)
        assert not freezer.maybe_freeze(5050, 5050)
        # Frozen objects still go when their last reference does.
        import weakref

        class Entry:
            pass

        e = Entry()
        ref = weakref.ref(e)
        assert freezer.maybe_freeze(7000, 4000)
        del e
        assert ref() is None
    finally:
        gc.unfreeze()


def test_gc_freezer_freezes_what_a_full_collection_left_alive() -> None:
    import gc

    from kvstore.server.host_resources import GcFreezer

    gc.unfreeze()
    freezer = GcFreezer(min_blocks=10**9)  # never for new blocks here
    try:
        assert not freezer.maybe_freeze(0, 0)
        freezer.watch()
        held = [[i] for i in range(1000)]
        assert not freezer.maybe_freeze(0, 0)  # no full collection yet
        gc.collect()
        assert freezer.maybe_freeze(0, 0)
        assert gc.get_freeze_count() >= len(held) and freezer.freezes == 1
        assert not freezer.maybe_freeze(0, 0)  # once per full collection
        gc.collect(0)
        assert not freezer.maybe_freeze(0, 0)  # a young collection is not one
        freezer.unwatch()
        gc.collect()
        assert not freezer.maybe_freeze(0, 0)
    finally:
        freezer.unwatch()
        gc.unfreeze()


def test_gc_freezer_times_the_collections_it_watches() -> None:
    import gc

    from kvstore.server.host_resources import GcFreezer

    freezer = GcFreezer(min_blocks=10**9)
    try:
        freezer.watch()
        before = freezer.pauses()
        held = [[[i]] for i in range(20_000)]  # something for a full collection to walk
        gc.collect(0)
        gc.collect()
        gc.collect()
        after = freezer.pauses()
        ran = [a - b for a, b in zip(after.collections, before.collections)]
        assert ran[0] >= 1 and ran[2] >= 2, ran
        assert after.pause_s[2] > before.pause_s[2] and 0 < after.longest_s[2] <= after.pause_s[2]
        freezer.unwatch()
        gc.collect()
        assert freezer.pauses().collections[2] == after.collections[2]  # not watching: not counted
        del held
    finally:
        freezer.unwatch()


def test_top_tiers_refuses_rows_outside_the_table() -> None:
    import numpy as np

    from kvstore.native import native

    if native is None:
        pytest.skip("the compiled helpers were not built")
    lt = np.array([[2, 0], [2, 3], [3, 1]], np.uint8)
    out = np.empty(3, np.uint8)
    assert native.top_tiers(np.array([0, 1, 2], np.int64), lt, out) == 2
    assert out.tolist() == [2, 2, 1]
    for bad in (3, -1):
        with pytest.raises(IndexError, match="not a row of the table"):
            native.top_tiers(np.array([0, bad], np.int64), lt, out)
    with pytest.raises(ValueError, match="shorter"):
        native.top_tiers(np.array([0, 1], np.int64), lt, np.empty(1, np.uint8))


def _bench_module(name: str):  # type: ignore[no-untyped-def]
    import importlib
    import sys

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(name)


def test_metadata_only_tier_allocates_a_batch_as_one_by_one() -> None:
    """The scale bench's instrument tier hands out a batch exactly as single allocations."""
    tier_cls = _bench_module("scale_daemon").MetadataOnlyTier
    batch, single = tier_cls(50, 4), tier_cls(50, 4)
    rng = random.Random(1)
    held_b: list[Slot] = []
    held_s: list[Slot] = []
    for _ in range(400):
        if rng.random() < 0.5:
            k = rng.randrange(1, 8)
            got = batch.allocate_many(4, k)
            want: list[Slot] = []
            while len(want) < k and (slot := single.allocate(4)) is not None:
                want.append(slot)
            assert got == want
            held_b += got
            held_s += want
        elif held_b:
            i = rng.randrange(len(held_b))
            batch.free(held_b.pop(i))
            single.free(held_s.pop(i))
        assert (batch.used_bytes, batch.blocks) == (single.used_bytes, single.blocks)
    assert batch.allocate_many(5, 3) == []  # larger than a slot


def test_scale_bench_runs_end_to_end(tmp_path: Path) -> None:
    """`make bench-scale` at a tiny N: a real daemon, lookups, puts, evictions and an SSD
    rebuild, and every figure the issue names in its JSON."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "bench" / "scale.py"
    out = tmp_path / "scale.json"
    subprocess.run([sys.executable, str(script), "--n", "2000", "--ssd-records", "2000", "--lookups", "100",
                    "--evict-blocks", "1000", "--ssd-dir", str(tmp_path), "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    doc = json.loads(out.read_text())
    (row,) = doc["results"]
    assert row["n_blocks"] == 2000 and row["evictions"] >= 1000 and row["lookups"] > 0
    assert isinstance(row["rss_bytes_per_block"], float)  # at this N, within the noise of the heap
    for name in ("lookup_p50_us", "lookup_p99_us", "put_us_per_block", "evict_us_per_block", "rebuild_s_log",
                 "rebuild_s_snapshot", "store_lookup_p50_us", "store_lookup_scattered_p50_us"):
        assert isinstance(row[name], float) and row[name] > 0, name
    assert row["lookup_p50_us"] <= row["lookup_p99_us"] and 0 <= row["lookup_steal_pct"] <= 100


def test_gc_freezer_never_counts_the_frozen_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting frozen objects walks every one of them with the interpreter held (a stall
    of the event loop that grows with the index): neither a freeze nor the figures INFO
    and the metrics read do it."""
    import gc

    from kvstore.server.host_resources import GcFreezer

    def walks() -> int:
        raise AssertionError("gc.get_freeze_count() walks every frozen object")

    gc.unfreeze()
    freezer = GcFreezer(min_blocks=100, growth=0.25)
    monkeypatch.setattr(gc, "get_freeze_count", walks)
    try:
        freezer.watch()
        assert freezer.maybe_freeze(1000, 1000)
        gc.collect()  # a full collection: frozen after, at the next sweep
        assert freezer.maybe_freeze(1000, 1000)
        pauses = freezer.pauses()
        assert pauses.frozen_at_blocks == 1000 and pauses.freezes == 2 and pauses.collections[2] >= 1
    finally:
        freezer.unwatch()
        gc.unfreeze()
