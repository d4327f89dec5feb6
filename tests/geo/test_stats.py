"""SWARM statistics (§4.2): collectors, Algorithm 2, and §4.2.3's correctness claim, by brute
force."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.geo.index import Partition
from app.geo.stats import Axis, Counts, PartitionStats


def test_figure_6_collectors() -> None:
    """Figure 6: p11 has 4 rows x 2 columns; DA, DB in Row2 (Col0, Col1); QA in cell (Col0,
    Row1); QB starts in Row0 at Col1 and spans Row1 and Row2."""
    s = PartitionStats(Partition("p11", 0, 0, 1, 3, "m1"))
    s.add_objects([0, 1], [2, 2])
    s.add_query(0, 1, 0, 1)  # QA
    s.add_query(1, 0, 1, 2)  # QB
    assert s.rows.N_new.tolist() == [0, 0, 2, 0]
    assert s.cols.N_new.tolist() == [1, 1]
    assert s.rows.Q_new.tolist() == [1, 1, 0, 0]  # QB in Row0, QA in Row1
    assert s.cols.Q_new.tolist() == [1, 1]  # QA in Col0, QB in Col1
    assert s.rows.spanQ_new.tolist() == [0, 1, 1, 0]  # QB spans into Row1 and Row2
    assert s.cols.spanQ_new.tolist() == [0, 0]
    assert s.totals() == Counts(0.0, 0, 0)  # nothing counts before the fold
    s.fold()
    assert s.rows.N.tolist() == [0, 0, 2, 2]
    assert s.rows.Q.tolist() == [1, 2, 2, 2]
    assert s.rows.R.tolist() == [1, 2, 4, 4]
    assert s.rows.spanQ.tolist() == [0, 1, 1, 0]
    assert s.rows.preSpanQ.tolist() == [0, 1, 1, 0]
    assert s.totals() == Counts(2.0, 2, 4)
    assert not s.rows.N_new.any() and not s.rows.Q_new.any() and not s.rows.spanQ_new.any()
    # Row 2 alone (split at 1 then the high side at 2): QB spans into it, QA does not.
    assert s.split_counts("y", 1) == (Counts(0.0, 2, 2), Counts(2.0, 1, 3))
    assert s.split_counts("y", 2) == (Counts(2.0, 2, 4), Counts(0.0, 0, 0))
    assert s.split_counts("x", 0) == (Counts(1.0, 1, 2), Counts(1.0, 1, 2))


def test_fading_halves_n_and_r_is_last_round_only() -> None:
    s = PartitionStats(Partition("p", 3, 5, 4, 6, "w"))
    s.add_objects([3, 4, 4, 3], [5, 6, 6, 6])
    s.add_query(0, 0, 10, 10)
    s.fold()
    assert s.totals() == Counts(4.0, 1, 5)
    s.fold()
    assert s.totals() == Counts(2.0, 1, 0)
    s.add_objects([4], [5])
    s.fold()
    assert s.totals() == Counts(2.0, 1, 1)
    assert s.cols.N.tolist() == [0.5, 2.0]


def test_inputs_outside_the_partition_are_refused() -> None:
    s = PartitionStats(Partition("p", 2, 2, 4, 4, "w"))
    with pytest.raises(ValueError):
        s.add_objects([1], [3])
    with pytest.raises(ValueError):
        s.add_query(5, 0, 9, 9)
    with pytest.raises(ValueError):
        s.split_counts("y", 4)
    with pytest.raises(ValueError):
        s.expire_objects([2], [2], arrived_round=1)


def test_remove_query_in_its_own_round_cancels_it() -> None:
    s = PartitionStats(Partition("p", 0, 0, 3, 3, "w"))
    s.add_query(1, 1, 2, 3)
    s.remove_query(1, 1, 2, 3, arrived_round=0)
    s.fold()
    assert s.totals() == Counts(0.0, 0, 0)
    assert not s.rows.spanQ.any() and not s.rows.preSpanQ.any()


# -- the correctness claim of §4.2.3, by brute force --------------------------------------------


@dataclass
class Obj:
    x: int
    y: int
    arrived: int
    gone: int | None = None  # round in which it expired


@dataclass
class Query:
    rect: tuple[int, int, int, int]
    arrived: int
    gone: int | None = None  # round in which it was removed


def _overlaps(r: tuple[int, int, int, int], s: tuple[int, int, int, int]) -> bool:
    return r[0] <= s[2] and s[0] <= r[2] and r[1] <= s[3] and s[1] <= r[3]


def brute_counts(
    objs: list[Obj], queries: list[Query], t: int, side: tuple[int, int, int, int]
) -> Counts:
    """What PartitionStats promises to count, after `t` folds, for the cell rectangle `side`."""
    n = sum(
        0.5 ** (t - o.arrived - 1)
        for o in objs
        if o.arrived < t and o.gone is None and _overlaps((o.x, o.y, o.x, o.y), side)
    )
    q = sum(1 for c in queries if c.arrived < t and c.gone is None and _overlaps(c.rect, side))
    r = sum(
        1
        for o in objs
        if o.arrived == t - 1 and o.gone != o.arrived and _overlaps((o.x, o.y, o.x, o.y), side)
    ) + sum(
        1 for c in queries if c.arrived == t - 1 and c.gone != c.arrived and _overlaps(c.rect, side)
    )
    return Counts(n, q, r)


def check_all_splits(s: PartitionStats, objs: list[Obj], queries: list[Query]) -> None:
    p = s.partition
    whole = (p.x0, p.y0, p.x1, p.y1)
    assert s.totals() == pytest.approx(brute_counts(objs, queries, s.round, whole))
    for a in (s.rows, s.cols):  # rows and columns agree on the totals
        assert (a.N[-1], a.Q[-1], a.R[-1]) == pytest.approx(s.totals())
    axis: Axis
    for axis in ("y", "x"):
        lo, hi = (p.y0, p.y1) if axis == "y" else (p.x0, p.x1)
        n1, q1, r1, n2, q2, r2 = s.axis(axis).split_all()
        for at in range(lo, hi):
            if axis == "y":
                low, high = (p.x0, p.y0, p.x1, at), (p.x0, at + 1, p.x1, p.y1)
            else:
                low, high = (p.x0, p.y0, at, p.y1), (at + 1, p.y0, p.x1, p.y1)
            got_low, got_high = s.split_counts(axis, at)
            assert got_low == pytest.approx(brute_counts(objs, queries, s.round, low))
            assert got_high == pytest.approx(brute_counts(objs, queries, s.round, high))
            i = at - lo
            assert (n1[i], q1[i], r1[i]) == pytest.approx(got_low)
            assert (n2[i], q2[i], r2[i]) == pytest.approx(got_high)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_split_counts_equal_brute_force(data: st.DataObject) -> None:
    x0, y0 = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 4))
    w, h = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    p = Partition("p", x0, y0, x0 + w - 1, y0 + h - 1, "w")
    s = PartitionStats(p)
    objs: list[Obj] = []
    queries: list[Query] = []
    cell = st.tuples(st.integers(p.x0, p.x1), st.integers(p.y0, p.y1))
    reach = st.integers(0, 5)
    for _ in range(data.draw(st.integers(1, 4))):
        t = s.round
        new = data.draw(st.lists(cell, max_size=15))
        if new:
            s.add_objects([c[0] for c in new], [c[1] for c in new])
        objs += [Obj(x, y, t) for x, y in new]
        # Queries overlap the partition (they were routed here) and may stick out of it.
        for (cx, cy), (dl, db, dr, du) in data.draw(
            st.lists(st.tuples(cell, st.tuples(reach, reach, reach, reach)), max_size=6)
        ):
            rect = (cx - dl, cy - db, cx + dr, cy + du)
            s.add_query(*rect)
            queries.append(Query(rect, t))
        alive_o = [o for o in objs if o.gone is None]
        if alive_o:
            gone = data.draw(st.lists(st.sampled_from(alive_o), unique_by=id, max_size=6))
            if gone:
                s.expire_objects(
                    [o.x for o in gone], [o.y for o in gone],
                    arrived_round=[o.arrived for o in gone],
                )
            for o in gone:
                o.gone = t
        alive_q = [c for c in queries if c.gone is None]
        if alive_q:
            for c in data.draw(st.lists(st.sampled_from(alive_q), unique_by=id, max_size=3)):
                s.remove_query(*c.rect, arrived_round=c.arrived)
                c.gone = t
        check_all_splits(s, objs, queries)  # mid-round: what the last fold says, minus removals
        s.fold()
        check_all_splits(s, objs, queries)


def test_add_objects_vectorised_equals_one_by_one() -> None:
    rng = np.random.default_rng(7)
    p = Partition("p", 10, 20, 29, 34, "w")
    cx, cy = rng.integers(10, 30, 500), rng.integers(20, 35, 500)
    a, b = PartitionStats(p), PartitionStats(p)
    a.add_objects(cx, cy)
    for x, y in zip(cx.tolist(), cy.tolist(), strict=True):
        b.add_objects(x, y)
    assert (a.rows.N_new == b.rows.N_new).all() and (a.cols.N_new == b.cols.N_new).all()
    assert int(a.rows.N_new.sum()) == int(a.cols.N_new.sum()) == 500


def test_add_queries_vectorised_equals_one_by_one() -> None:
    rng = np.random.default_rng(8)
    p = Partition("p", 10, 20, 29, 34, "w")
    x0, y0 = rng.integers(0, 30, 400), rng.integers(5, 35, 400)
    x1, y1 = x0 + rng.integers(0, 15, 400), y0 + rng.integers(0, 12, 400)
    keep = (x1 >= 10) & (y1 >= 20)  # overlapping the partition
    x0, y0, x1, y1 = x0[keep], y0[keep], x1[keep], y1[keep]
    a, b = PartitionStats(p), PartitionStats(p)
    a.add_queries(x0, y0, x1, y1)
    for r in zip(x0.tolist(), y0.tolist(), x1.tolist(), y1.tolist(), strict=True):
        b.add_query(*r)
    for name in ("Q_new", "spanQ_new"):
        for axis in ("x", "y"):
            assert (getattr(a.axis(axis), name) == getattr(b.axis(axis), name)).all()
    a.add_queries([], [], [], [])  # nothing: a no-op
    with pytest.raises(ValueError):
        a.add_queries([0], [0], [9], [9])


@given(st.integers(0, 2**32 - 1), st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_seeded_partition_equals_one_that_saw_the_objects(seed: int, rounds: int) -> None:
    """A partition created later (split, move) and seeded with the window's objects, as
    per-cell counts, has the statistics of one that received them; expiring them (counts)
    takes back exactly the same from both."""
    rng = np.random.default_rng(seed)
    p = Partition("p", 3, 5, 12, 11, "w")
    lived = PartitionStats(p)
    log: list[tuple[int, np.ndarray, np.ndarray]] = []
    for r in range(rounds + 1):
        x = rng.integers(p.x0, p.x1 + 1, 40)
        y = rng.integers(p.y0, p.y1 + 1, 40)
        lived.add_objects(x, y)
        log.append((r, x, y))
        if r < rounds:
            lived.fold()
    seeded = PartitionStats(p, round=lived.round)
    for r, x, y in log:
        cells, count = np.unique(np.stack([x, y]), axis=1, return_counts=True)
        seeded.seed_objects(cells[0], cells[1], arrived_round=r, count=count)
    for a in ("rows", "cols"):
        np.testing.assert_allclose(getattr(seeded, a).N, getattr(lived, a).N)
        assert (getattr(seeded, a).N_new == getattr(lived, a).N_new).all()
    for r, x, y in log[::2]:
        lived.expire_objects(x, y, arrived_round=r)
        cells, count = np.unique(np.stack([x, y]), axis=1, return_counts=True)
        seeded.expire_objects(cells[0], cells[1], arrived_round=r, count=count)
    for a in ("rows", "cols"):
        np.testing.assert_allclose(getattr(seeded, a).N, getattr(lived, a).N, atol=1e-9)
        assert (getattr(seeded, a).N_new == getattr(lived, a).N_new).all()


def test_export_restore_round_trip() -> None:
    """A partition moved whole keeps its statistics on the new worker, whatever that worker's
    fold count; a mismatched shape is refused."""
    rng = np.random.default_rng(4)
    p = Partition("p", 0, 0, 9, 6, "w")
    a = PartitionStats(p)
    for _ in range(3):
        a.add_objects(rng.integers(0, 10, 50), rng.integers(0, 7, 50))
        a.add_query(1, 1, 5, 4)
        a.fold()
    a.add_objects([3], [2])
    b = PartitionStats.restore(Partition("q", 0, 0, 9, 6, "v"), 17, a.export())
    assert b.round == 17 and b.totals() == a.totals()
    for axis in ("x", "y"):
        for at in range(b.offset(axis), b.offset(axis) + b.axis(axis).k - 1):
            assert b.split_counts(axis, at) == a.split_counts(axis, at)
    assert int(b.rows.N_new.sum()) == 1
    with pytest.raises(ValueError):
        PartitionStats.restore(Partition("r", 0, 0, 3, 6, "v"), 0, a.export())
