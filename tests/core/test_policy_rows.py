"""The array-backed ARC and LRU keep exactly the order of their OrderedDict form.

The references below are the OrderedDict policies these replace (keys in ordered dicts,
ghosts as keys). Random traces of inserts, touches, removals and evictions (with
pinned blocks skipped) run against both, by key and, bound to a block table, by row;
every victim and the final lists must agree.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import pytest

from kvstore.core.index import BlockIndex, BlockState
from kvstore.core.policies import make_policy
from kvstore.core.policies.arc import ARCPolicy
from kvstore.core.policies.base import EvictionPolicy
from kvstore.core.policies.lru import LRUPolicy
from kvstore.core.policies.rows import GhostList
from kvstore.core.tier import Slot

NS = bytes(16)


def key(i: int) -> bytes:
    return NS + i.to_bytes(16, "little")


class RefARC:
    def __init__(self) -> None:
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.p = 0.0
        self.c = 0

    def insert(self, k: bytes) -> None:
        if k in self.t1 or k in self.t2:
            self.touch(k)
        elif k in self.b1:
            self.p = min(float(self.c), self.p + max(1.0, len(self.b2) / len(self.b1)))
            del self.b1[k]
            self.t2[k] = None
        elif k in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            del self.b2[k]
            self.t2[k] = None
        else:
            self.t1[k] = None

    def touch(self, k: bytes) -> None:
        if k in self.t1:
            del self.t1[k]
            self.t2[k] = None
        elif k in self.t2:
            self.t2.move_to_end(k)

    def remove(self, k: bytes) -> None:
        if k in self.t1:
            del self.t1[k]
            self.b1[k] = None
        elif k in self.t2:
            del self.t2[k]
            self.b2[k] = None
        else:
            return
        c = max(self.c, len(self.t1) + len(self.t2))
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def victim(self, ok: Callable[[bytes], bool]) -> bytes | None:
        self.c = max(self.c, len(self.t1) + len(self.t2))
        first, second = (self.t1, self.t2) if len(self.t1) > self.p else (self.t2, self.t1)
        for side in (first, second):
            for k in side:
                if ok(k):
                    return k
        return None

    def lists(self) -> tuple[list[bytes], list[bytes]]:
        return list(self.t1), list(self.t2)


class RefLRU:
    def __init__(self) -> None:
        self.order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, k: bytes) -> None:
        self.order[k] = None
        self.order.move_to_end(k)

    def touch(self, k: bytes) -> None:
        if k in self.order:
            self.order.move_to_end(k)

    def remove(self, k: bytes) -> None:
        self.order.pop(k, None)

    def victim(self, ok: Callable[[bytes], bool]) -> bytes | None:
        return next((k for k in self.order if ok(k)), None)

    def lists(self) -> tuple[list[bytes]]:
        return (list(self.order),)


def lists_of(p: EvictionPolicy) -> tuple[list[bytes], ...]:
    if isinstance(p, ARCPolicy):
        t1, t2, _, _ = p.state()
        return t1, t2
    assert isinstance(p, LRUPolicy)
    return (p.order(),)


def run_trace(seed: int, policy: EvictionPolicy, ref: RefARC | RefLRU, by_row: BlockIndex | None) -> None:
    rng = random.Random(seed)
    universe = rng.choice([20, 80, 300])
    pinned = {key(i) for i in rng.sample(range(universe), universe // 10)}

    def ok(k: bytes) -> bool:
        return k not in pinned

    def row_of(k: bytes) -> int:
        assert by_row is not None
        e = by_row.get(k)
        if e is None:  # a bound policy tracks indexed blocks: publish on first sight
            e = by_row.new_entry(k, None, 1, 0)
            e.add_slot(Slot("host", 0, 1))
            e.state = BlockState.READY
            by_row.add(e)
        return e.row

    for step in range(1500):
        op = rng.random()
        if op < 0.3:
            ks = [key(rng.randrange(universe)) for _ in range(rng.randrange(1, 8))]
            if by_row is not None:
                rows = np.array([row_of(k) for k in ks], np.int64)
                if len(set(ks)) == len(ks):
                    policy.insert_rows(rows)
                else:
                    for k in ks:
                        policy.insert(k)
            else:
                policy.insert_many(ks, [None] * len(ks))
            for k in ks:
                ref.insert(k)
        elif op < 0.65:
            start = rng.randrange(universe)
            ks = [key((start + j) % universe) for j in range(rng.randrange(1, 20))]
            if rng.random() < 0.2:
                ks.append(ks[0])  # a chain that names a block twice
            if by_row is not None:
                present = [by_row.get(k) for k in ks]
                policy.touch_rows(np.array([e.row for e in present if e is not None], np.int64))
                ks = [k for k, e in zip(ks, present) if e is not None]
            else:
                policy.touch_many(ks)
            for k in ks:
                ref.touch(k)
        elif op < 0.9:
            want = ref.victim(ok)
            if by_row is not None:
                table = by_row.table
                row = policy.victim_row(lambda r: ok(table.key(r)))
                got = None if row is None else table.key(row)
            else:
                got = policy.victim(ok)
            assert got == want, f"step {step}"
            if want is not None:
                if by_row is not None:
                    policy.remove_row(by_row.table.find_key(want))
                else:
                    policy.remove(want)
                ref.remove(want)
        else:
            k = key(rng.randrange(universe))
            if by_row is not None:
                row = by_row.table.find_key(k)
                if row >= 0:
                    policy.remove_row(row)
            else:
                policy.remove(k)
            ref.remove(k)
        if step % 100 == 0:
            assert lists_of(policy) == ref.lists()
    assert lists_of(policy) == ref.lists()
    assert len(policy) == sum(len(x) for x in ref.lists())


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("bound", [False, True])
def test_arc_matches_the_ordered_dict_reference(seed: int, bound: bool) -> None:
    policy = ARCPolicy()
    index = None
    if bound:
        index = BlockIndex()
        policy.bind(index.table)
    run_trace(seed, policy, RefARC(), index)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("bound", [False, True])
def test_lru_matches_the_ordered_dict_reference(seed: int, bound: bool) -> None:
    policy = LRUPolicy()
    index = None
    if bound:
        index = BlockIndex()
        policy.bind(index.table)
    run_trace(seed, policy, RefLRU(), index)


def test_hinted_arc_bound_to_a_table_takes_rows_straight_to_its_base() -> None:
    index = BlockIndex()
    policy = make_policy("hint-arc", clock=lambda: 0.0)
    policy.bind(index.table)
    entries = []
    for i in range(5):
        e = index.new_entry(key(i), None, 1, 0)
        e.add_slot(Slot("host", i, 1))
        e.state = BlockState.READY
        entries.append(e)
    index.add_many(entries)
    policy.insert_rows(np.array([e.row for e in entries], np.int64))
    assert len(policy) == 5 and key(3) in policy
    policy.hint([key(0)], "s", 10.0)  # parked: the base skips it
    assert policy.victim_row(lambda r: True) == entries[1].row
    policy.touch_rows(np.array([entries[1].row], np.int64))
    assert policy.victim_row(lambda r: True) == entries[2].row
    policy.remove_row(entries[0].row)  # parked and removed
    assert key(0) not in policy and len(policy) == 4


def test_ghost_list_is_a_fifo_set() -> None:
    g = GhostList()
    model: OrderedDict[int, None] = OrderedDict()
    rng = random.Random(3)
    for _ in range(5000):
        op = rng.random()
        fp = rng.randrange(2000) * 0x9E3779B97F4A7C15 % (1 << 64)
        if op < 0.5:
            if fp not in model:
                g.push(fp)
                model[fp] = None
        elif op < 0.75:
            assert g.delete(fp) == (fp in model)
            model.pop(fp, None)
        elif model:
            assert g.pop_oldest() == model.popitem(last=False)[0]
        assert len(g) == len(model)
    assert list(g) == list(model)
    probe = np.array(list(model)[:50] + [12345], np.uint64)
    assert g.contains_many(probe).tolist() == [True] * min(50, len(model)) + [False]


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_row_lists_compact_step_by_step_and_keep_their_order(seed: int, compiled: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Small logs compact (or grow) incrementally here (the daemon's start at 4096
    entries): every list must read exactly as an OrderedDict after the same steps, while a
    compaction or growth copy runs and after it, and no append may do more than its share.
    Batches and compaction steps run compiled (`kvstore._native`) and in array steps."""
    from kvstore.core.policies import rows as rows_mod

    if compiled and rows_mod._native is None:
        pytest.skip("the compiled helpers were not built")
    if not compiled:
        monkeypatch.setattr(rows_mod, "_native", None)
    monkeypatch.setattr(rows_mod, "COMPACT_FROM", 64)
    monkeypatch.setattr(rows_mod, "COMPACT_MIN", 3)
    lists = rows_mod.RowLists(2)
    ref: list[OrderedDict[int, None]] = [OrderedDict(), OrderedDict(), OrderedDict()]
    def budgets_of(name: str) -> list[int]:
        """Record the budget of every call of RowLists.`name` (a compaction or growth step)."""
        seen: list[int] = []
        real = getattr(rows_mod.RowLists, name)

        def counted(self: rows_mod.RowLists, which: int, budget: int) -> None:
            seen.append(budget)
            real(self, which, budget)

        monkeypatch.setattr(rows_mod.RowLists, name, counted)
        return seen

    steps, grows = budgets_of("_compact_step"), budgets_of("_grow_step")
    rng = random.Random(seed)
    universe = 300
    lists.ensure(universe)
    running = 0
    for step in range(4000):
        op = rng.random()
        which = rng.choice((1, 2))
        if op < 0.45:
            rs = [rng.randrange(universe) for _ in range(rng.randrange(1, 40))]
            lists.append_many(which, np.array(rs, np.int64))
            for r in rs:
                for other in (1, 2):
                    ref[other].pop(r, None)
                ref[which][r] = None
        elif op < 0.55:
            # A touch: rows in no list stay out.
            rs = [rng.randrange(universe) for _ in range(rng.randrange(1, 40))]
            lists.touch_many(which, np.array(rs, np.int64))
            for r in rs:
                if any(r in ref[w] for w in (1, 2)):
                    for other in (1, 2):
                        ref[other].pop(r, None)
                    ref[which][r] = None
        elif op < 0.7:
            r = rng.randrange(universe)
            lists.append(which, r)
            for other in (1, 2):
                ref[other].pop(r, None)
            ref[which][r] = None
        elif op < 0.85:
            r = rng.randrange(universe)
            assert lists.discard(r) == next((w for w in (1, 2) if r in ref[w]), 0)
            for other in (1, 2):
                ref[other].pop(r, None)
        else:
            banned = rng.randrange(universe)
            want = next((r for r in ref[which] if r != banned), None)
            assert lists.first(which, lambda r: r != banned) == want, f"step {step}"
        busy = any(cr >= 0 for cr in lists._cr) or any(gc >= 0 for gc in lists._gc)
        running += busy
        if step % 50 == 0 or busy:
            for w in (1, 2):
                assert lists.rows(w) == list(ref[w]), f"step {step}, list {w}"
                assert lists.size[w] == len(ref[w])
    assert running > 100, "the trace never ran an incremental compaction or growth"
    assert steps and grows, "both the compaction and the growth copy must have run"
    assert max(steps + grows) <= rows_mod.COMPACT_RATE * 40 + 3


def test_compiled_row_steps_refuse_what_would_write_out_of_bounds() -> None:
    from kvstore.native import native

    if native is None:
        pytest.skip("the compiled helpers were not built")
    log, lst, pos = np.zeros(4, np.int32), np.zeros(8, np.uint8), np.zeros(8, np.int32)
    moved = np.zeros(3, np.int64)
    assert native.rows_append(log, lst, pos, 1, 0, np.array([5, 6], np.int64), False, moved) == 2
    assert log[:2].tolist() == [5, 6] and lst[5] == lst[6] == 1 and pos[6] == 1
    # A touch moves tracked rows only; each leaves the list it was in.
    assert native.rows_append(log, lst, pos, 2, 2, np.array([3, 5], np.int64), True, moved) == 3
    assert moved.tolist() == [0, 1, 0] and lst[5] == 2 and pos[5] == 2 and lst[3] == 0
    with pytest.raises(IndexError, match="past the lists' rows"):
        native.rows_append(log, lst, pos, 1, 0, np.array([8], np.int64), False, moved)
    with pytest.raises(ValueError, match="no room"):
        native.rows_append(log, lst, pos, 1, 3, np.array([1, 2], np.int64), False, moved)
    with pytest.raises(ValueError, match="bad list id"):
        native.rows_append(log, lst, pos, 3, 0, np.array([1], np.int64), False, moved)
    # Compaction keeps the valid entries in order: row 6 (list 1, at 1); row 5 moved on.
    assert native.rows_compact(log, lst, pos, 1, 0, 0, 3, None) == 1
    assert log[0] == 6 and pos[6] == 0
    with pytest.raises(ValueError, match="cursors"):
        native.rows_compact(log, lst, pos, 1, 2, 1, 3, None)
    with pytest.raises(ValueError, match="cursors"):
        native.rows_compact(log, lst, pos, 1, 0, 0, 5, None)
