"""AQWA building blocks (app.geo.aqwa) against brute force: the count grid's prefix sums
(§4.2.1), the Euler histogram (§4.2.3) with time fading (§4.2.4), the cost model and the k-d
split-queue (§3.1, §4.1, §4.2.2), MINDIST / MAXDIST on the sphere and the kNN radius (§5)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.geo.aqwa import (
    CellRect,
    CountGrid,
    EulerHistogram,
    TimeFadedEulerHistogram,
    best_split,
    kd_initial_partitions,
    kd_partitions,
    knn_radius_m,
    layout_cost,
    partition_costs,
    rect_maxdist_m,
    rect_mindist_m,
    refine_partitions,
)
from app.geo.geometry import EARTH_RADIUS_M, haversine_m
from app.geo.grid import Grid

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

# -- brute-force oracles ---------------------------------------------------------------------


def all_rects(nx: int, ny: int) -> I64:
    """Every inclusive cell rectangle of an nx x ny grid, (n, 4)."""
    xs = [(a, b) for a in range(nx) for b in range(a, nx)]
    ys = [(a, b) for a in range(ny) for b in range(a, ny)]
    return np.array([(x0, y0, x1, y1) for (x0, x1) in xs for (y0, y1) in ys], dtype=np.int64)


def brute_count(counts: I64, r: CellRect | I64) -> int:
    x0, y0, x1, y1 = (int(v) for v in r)
    return int(counts[y0 : y1 + 1, x0 : x1 + 1].sum())


def brute_overlapping(queries: list[tuple[CellRect, float]], r: CellRect | I64) -> float:
    """Sum of the weights of the recorded rectangles that intersect r (each counted once)."""
    x0, y0, x1, y1 = (int(v) for v in r)
    return sum(
        w for (qx0, qy0, qx1, qy1), w in queries
        if qx0 <= x1 and x0 <= qx1 and qy0 <= y1 and y0 <= qy1
    )


def brute_cost(counts: I64, queries: list[tuple[CellRect, float]], r: CellRect | I64) -> float:
    return brute_overlapping(queries, r) * brute_count(counts, r)


def assert_tiles(parts: list[CellRect], bounds: CellRect, nx: int, ny: int) -> None:
    """The partitions cover every cell of bounds exactly once and nothing else."""
    cover = np.zeros((ny, nx), dtype=np.int64)
    for x0, y0, x1, y1 in parts:
        assert 0 <= x0 <= x1 < nx and 0 <= y0 <= y1 < ny
        cover[y0 : y1 + 1, x0 : x1 + 1] += 1
    expect = np.zeros((ny, nx), dtype=np.int64)
    bx0, by0, bx1, by1 = bounds
    expect[by0 : by1 + 1, bx0 : bx1 + 1] = 1
    assert (cover == expect).all()


@st.composite
def rect_in(draw: st.DrawFn, nx: int, ny: int) -> CellRect:
    x0 = draw(st.integers(0, nx - 1))
    x1 = draw(st.integers(x0, nx - 1))
    y0 = draw(st.integers(0, ny - 1))
    y1 = draw(st.integers(y0, ny - 1))
    return (x0, y0, x1, y1)


@st.composite
def workload(
    draw: st.DrawFn, max_side: int = 8, max_queries: int = 12
) -> tuple[I64, list[tuple[CellRect, float]]]:
    """A random count grid and a list of weighted query rectangles on it."""
    nx = draw(st.integers(1, max_side))
    ny = draw(st.integers(1, max_side))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    density = draw(st.sampled_from([0.2, 0.6, 1.0]))
    counts = rng.integers(0, 6, size=(ny, nx)) * (rng.random((ny, nx)) < density)
    queries = draw(
        st.lists(
            st.tuples(rect_in(nx, ny), st.sampled_from([1.0, 1.0, 2.0, 0.5, 3.25])),
            max_size=max_queries,
        )
    )
    return counts.astype(np.int64), queries


def histogram_of(nx: int, ny: int, queries: list[tuple[CellRect, float]]) -> EulerHistogram:
    h = EulerHistogram(nx, ny)
    for r, w in queries:
        h.add(r, w)
    return h


# -- §4.2.1: the count grid ------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(workload(max_side=9, max_queries=0))
def test_count_grid_prefix_sums_match_brute_force(wl: tuple[I64, object]) -> None:
    counts, _ = wl
    ny, nx = counts.shape
    g = CountGrid.from_array(counts)
    rects = all_rects(nx, ny)
    got = g.count_many(rects)
    expect = [brute_count(counts, r) for r in rects]
    assert got.tolist() == expect
    assert g.total == int(counts.sum())
    assert g.count(0, 0, nx - 1, ny - 1) == int(counts.sum())


def test_count_grid_incremental_adds_rebuild_lazily() -> None:
    g = CountGrid(4, 3)
    assert g.count(0, 0, 3, 2) == 0
    g.add([0, 5, 5, 11])  # cells (0,0), (1,1) twice, (3,2)
    assert g.counts.tolist() == [[1, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1]]
    assert g.count(0, 0, 1, 1) == 3 and g.count(1, 1, 3, 2) == 3
    g.add([6, 11], [10, 4])
    assert g.count(0, 0, 3, 2) == 18
    assert g.count(2, 1, 3, 2) == 15
    assert g.count(3, 2, 3, 2) == 5
    with pytest.raises(ValueError):
        g.counts[0, 0] = 7  # read-only view
    h = CountGrid.from_cells(4, 3, [0, 5, 5, 11, 6, 11], [1, 1, 1, 1, 10, 4])
    assert h.counts.tolist() == g.counts.tolist()


def test_count_grid_from_points_uses_grid_cells() -> None:
    grid = Grid(bounds=(0.0, 0.0, 10.0, 5.0), nx=10, ny=5)
    rng = np.random.default_rng(7)
    lon = rng.uniform(0, 10, 500)
    lat = rng.uniform(0, 5, 500)
    g = CountGrid.from_points(grid, lon, lat)
    cx, cy = grid.cells_of(lon, lat)
    expect = np.zeros((5, 10), dtype=np.int64)
    for x, y in zip(cx.tolist(), cy.tolist(), strict=True):
        expect[y, x] += 1
    assert (g.counts == expect).all()


def test_count_grid_rejects_bad_input() -> None:
    g = CountGrid(3, 2)
    with pytest.raises(ValueError):
        g.add([6])
    with pytest.raises(ValueError):
        g.add([1], [-1])
    with pytest.raises(TypeError):
        g.add([1.5])
    with pytest.raises(ValueError):
        g.count(0, 0, 3, 0)  # x1 outside
    with pytest.raises(ValueError):
        g.count(2, 0, 1, 0)  # empty
    with pytest.raises(ValueError):
        CountGrid(0, 1)


# -- §4.2.3 / §4.2.4: the Euler histogram ----------------------------------------------------


def test_figure_5_counters() -> None:
    """Figure 5: two 4x4 queries on a 6x6 grid, the second starting at the first's (2, 2)."""
    h = EulerHistogram(6, 6)
    h.add((0, 0, 3, 3))
    h.add((2, 2, 5, 5))
    c1, c2, c3, c4 = h.counters()
    cells = [
        [f"{int(c1[y, x])},{int(c2[y, x])},{int(c3[y, x])},{int(c4[y, x])}" for x in range(6)]
        for y in range(6)
    ]
    z = "0,0,0,0"
    assert cells == [
        ["1,1,1,1", "1,0,1,0", "1,0,1,0", "1,0,1,0", z, z],
        ["1,1,0,0", "1,0,0,0", "1,0,0,0", "1,0,0,0", z, z],
        ["1,1,0,0", "1,0,0,0", "2,1,1,1", "2,0,1,0", "1,0,1,0", "1,0,1,0"],
        ["1,1,0,0", "1,0,0,0", "2,1,0,0", "2,0,0,0", "1,0,0,0", "1,0,0,0"],
        [z, z, "1,1,0,0", "1,0,0,0", "1,0,0,0", "1,0,0,0"],
        [z, z, "1,1,0,0", "1,0,0,0", "1,0,0,0", "1,0,0,0"],
    ]
    # Both queries overlap the centre 2x2, and each is counted once.
    assert h.overlapping((2, 2, 3, 3)) == 2.0
    assert h.overlapping((0, 0, 5, 5)) == 2.0
    assert h.overlapping((4, 0, 5, 1)) == 0.0
    assert h.overlapping((3, 0, 4, 5)) == 2.0


@settings(max_examples=80, deadline=None)
@given(workload(max_side=8, max_queries=14))
def test_euler_histogram_counters_match_their_definitions(
    wl: tuple[I64, list[tuple[CellRect, float]]],
) -> None:
    counts, queries = wl
    ny, nx = counts.shape
    c1, c2, c3, c4 = histogram_of(nx, ny, queries).counters()
    e1, e2, e3, e4 = (np.zeros((ny, nx)) for _ in range(4))
    for (qx0, qy0, qx1, qy1), w in queries:
        for y in range(qy0, qy1 + 1):
            for x in range(qx0, qx1 + 1):
                e1[y, x] += w  # overlaps the cell
                e2[y, x] += w * (x == qx0)  # ... but not the cell on its left
                e3[y, x] += w * (y == qy0)  # ... but not the cell above
                e4[y, x] += w * (x == qx0 and y == qy0)  # ... neither
    for got, expect in ((c1, e1), (c2, e2), (c3, e3), (c4, e4)):
        np.testing.assert_allclose(got, expect, atol=1e-9)


@settings(max_examples=80, deadline=None)
@given(workload(max_side=8, max_queries=14))
def test_euler_histogram_overlaps_match_brute_force(
    wl: tuple[I64, list[tuple[CellRect, float]]],
) -> None:
    counts, queries = wl
    ny, nx = counts.shape
    h = histogram_of(nx, ny, queries)
    rects = all_rects(nx, ny)
    got = h.overlapping_many(rects)
    expect = [brute_overlapping(queries, r) for r in rects]
    np.testing.assert_allclose(got, expect, atol=1e-9)
    assert h.weight == pytest.approx(sum(w for _, w in queries))


@settings(max_examples=40, deadline=None)
@given(
    workload(max_side=7, max_queries=6),
    st.lists(st.sampled_from(["fade", "add", "look"]), max_size=8),
    st.integers(0, 2**16),
)
def test_euler_histogram_fading_and_incremental_adds(
    wl: tuple[I64, list[tuple[CellRect, float]]], ops: list[str], seed: int
) -> None:
    """Interleaved adds, fades and lookups (the lazy rebuild) against a weighted brute force."""
    counts, queries = wl
    ny, nx = counts.shape
    rng = np.random.default_rng(seed)
    h = histogram_of(nx, ny, queries)
    live = list(queries)
    rects = all_rects(nx, ny)
    for op in ops:
        if op == "fade":
            f = float(rng.choice([0.5, 0.25, 0.9]))
            h.fade(f)
            live = [(r, w * f) for r, w in live]
        elif op == "add":
            x0, x1 = sorted(rng.integers(0, nx, 2).tolist())
            y0, y1 = sorted(rng.integers(0, ny, 2).tolist())
            h.add((x0, y0, x1, y1), 1.5)
            live.append(((x0, y0, x1, y1), 1.5))
        got = h.overlapping_many(rects)
        np.testing.assert_allclose(got, [brute_overlapping(live, r) for r in rects], atol=1e-9)


def test_euler_histogram_batch_add_equals_single_adds() -> None:
    rng = np.random.default_rng(3)
    x = np.sort(rng.integers(0, 20, (50, 2)), axis=1)
    y = np.sort(rng.integers(0, 15, (50, 2)), axis=1)
    rects = np.stack((x[:, 0], y[:, 0], x[:, 1], y[:, 1]), axis=1)
    w = rng.uniform(0, 3, 50)
    a = EulerHistogram(20, 15)
    a.add_many(rects, w)
    b = EulerHistogram(20, 15)
    for r, wi in zip(rects.tolist(), w.tolist(), strict=True):
        b.add((r[0], r[1], r[2], r[3]), wi)
    probe = all_rects(20, 15)[::37]
    np.testing.assert_allclose(a.overlapping_many(probe), b.overlapping_many(probe))
    queries = [((r[0], r[1], r[2], r[3]), wi) for r, wi in zip(rects.tolist(), w, strict=True)]
    np.testing.assert_allclose(
        a.overlapping_many(probe), [brute_overlapping(queries, r) for r in probe], atol=1e-9
    )


def test_euler_histogram_rejects_bad_input() -> None:
    h = EulerHistogram(4, 4)
    with pytest.raises(ValueError):
        h.add((0, 0, 4, 0))
    with pytest.raises(ValueError):
        h.add((0, 0, 1, 1), -1.0)
    with pytest.raises(ValueError):
        h.fade(0.0)
    with pytest.raises(ValueError):
        h.merge(EulerHistogram(4, 5))


def test_time_faded_histogram_cycles() -> None:
    """§4.2.4: C_old is divided by c every cycle T, then C_new joins it."""
    t = TimeFadedEulerHistogram(5, 5, decay=4.0)
    rng = np.random.default_rng(11)
    log: list[tuple[CellRect, int]] = []  # (rect, cycle it was recorded in)
    rects = all_rects(5, 5)
    for cycle in range(5):
        for _ in range(int(rng.integers(0, 4))):
            x0, x1 = sorted(rng.integers(0, 5, 2).tolist())
            y0, y1 = sorted(rng.integers(0, 5, 2).tolist())
            t.add((x0, y0, x1, y1))
            log.append(((x0, y0, x1, y1), cycle))
        # Weight of a query recorded in cycle i, seen during cycle `cycle`: 1 while current,
        # 1 in the cycle after (just moved to C_old), then divided by c per further cycle.
        live = [(r, 4.0 ** -max(0, cycle - i - 1)) for r, i in log]
        expect = [brute_overlapping(live, r) for r in rects]
        np.testing.assert_allclose(t.overlapping_many(rects), expect, atol=1e-12)
        t.end_cycle()
    assert t.current.weight == 0.0
    with pytest.raises(ValueError):
        TimeFadedEulerHistogram(3, 3, decay=1.0)


# -- §3.1 / §4.2.2: the cost model and the best split ----------------------------------------


@settings(max_examples=60, deadline=None)
@given(workload(max_side=8, max_queries=10), st.data())
def test_layout_cost_is_equation_1(
    wl: tuple[I64, list[tuple[CellRect, float]]], data: st.DataObject
) -> None:
    counts, queries = wl
    ny, nx = counts.shape
    cg, h = CountGrid.from_array(counts), histogram_of(nx, ny, queries)
    parts = data.draw(st.lists(rect_in(nx, ny), min_size=1, max_size=6))
    expect = [brute_cost(counts, queries, p) for p in parts]
    np.testing.assert_allclose(partition_costs(cg, h, parts), expect, atol=1e-9)
    assert layout_cost(cg, h, parts) == pytest.approx(sum(expect), abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(workload(max_side=8, max_queries=10), st.data(), st.integers(0, 12))
def test_best_split_is_optimal_among_all_candidates(
    wl: tuple[I64, list[tuple[CellRect, float]]], data: st.DataObject, min_records: int
) -> None:
    counts, queries = wl
    ny, nx = counts.shape
    cg, h = CountGrid.from_array(counts), histogram_of(nx, ny, queries)
    rect = data.draw(rect_in(nx, ny))
    x0, y0, x1, y1 = rect
    feasible: list[tuple[float, CellRect, CellRect]] = []
    halves = [((x0, y0, x1, s), (x0, s + 1, x1, y1)) for s in range(y0, y1)]
    halves += [((x0, y0, s, y1), (s + 1, y0, x1, y1)) for s in range(x0, x1)]
    for lo, hi in halves:
        if min(brute_count(counts, lo), brute_count(counts, hi)) >= min_records:
            feasible.append((brute_cost(counts, queries, lo) + brute_cost(counts, queries, hi),
                             lo, hi))
    s = best_split(cg, h, rect, min_records=min_records)
    if not feasible:
        assert s is None
        return
    assert s is not None
    best = min(c for c, _, _ in feasible)
    assert s.cost == pytest.approx(best, abs=1e-9)
    # The reported split is a real candidate with the reported cost and gain.
    assert (s.low, s.high) in [(lo, hi) for _, lo, hi in feasible]
    lo_c, hi_c = brute_cost(counts, queries, s.low), brute_cost(counts, queries, s.high)
    assert s.cost == pytest.approx(lo_c + hi_c, abs=1e-9)
    assert s.gain == pytest.approx(brute_cost(counts, queries, rect) - s.cost, abs=1e-9)
    if s.axis == "x":
        assert s.low == (x0, y0, s.at, y1) and s.high == (s.at + 1, y0, x1, y1)
    else:
        assert s.low == (x0, y0, x1, s.at) and s.high == (x0, s.at + 1, x1, y1)


def test_single_cell_cannot_split() -> None:
    cg = CountGrid.from_array(np.array([[5]]))
    h = EulerHistogram(1, 1)
    h.add((0, 0, 0, 0))
    assert best_split(cg, h, (0, 0, 0, 0)) is None
    assert kd_partitions(cg, h, min_records=0) == [(0, 0, 0, 0)]


# -- §4.2.2: the split-queue -----------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    workload(max_side=9, max_queries=12),
    st.integers(0, 10),
    st.sampled_from([0.0, 0.5, 2.0, 5.0]),
    st.data(),
)
def test_kd_partitions_tile_respect_min_records_and_are_stable(
    wl: tuple[I64, list[tuple[CellRect, float]]],
    min_records: int,
    rewrite: float,
    data: st.DataObject,
) -> None:
    counts, queries = wl
    ny, nx = counts.shape
    cg, h = CountGrid.from_array(counts), histogram_of(nx, ny, queries)
    bounds = data.draw(rect_in(nx, ny))
    parts = kd_partitions(
        cg, h, bounds, min_records=min_records, rewrite_cost_per_record=rewrite
    )
    assert_tiles(parts, bounds, nx, ny)
    if parts != [bounds]:
        assert all(brute_count(counts, p) >= min_records for p in parts)
    for p in parts:
        # No leaf has a split that satisfies Inequality 4 (brute force over all candidates).
        x0, y0, x1, y1 = p
        cands = [((x0, y0, x1, s), (x0, s + 1, x1, y1)) for s in range(y0, y1)]
        cands += [((x0, y0, s, y1), (s + 1, y0, x1, y1)) for s in range(x0, x1)]
        whole = brute_cost(counts, queries, p)
        for lo, hi in cands:
            if min(brute_count(counts, lo), brute_count(counts, hi)) < min_records:
                continue
            gain = whole - brute_cost(counts, queries, lo) - brute_cost(counts, queries, hi)
            assert gain <= rewrite * brute_count(counts, p) + 1e-9
    # Every split made paid for its rewrite, so the layout is no more expensive than `bounds`.
    assert layout_cost(cg, h, parts) <= layout_cost(cg, h, [bounds]) + 1e-9


def test_no_queries_no_splits() -> None:
    rng = np.random.default_rng(5)
    cg = CountGrid.from_array(rng.integers(0, 100, (30, 40)))
    h = EulerHistogram(40, 30)
    assert kd_partitions(cg, h, min_records=1, rewrite_cost_per_record=0.0) == [(0, 0, 39, 29)]
    # A query workload that was entirely faded away does not split either.
    h.add((3, 3, 5, 5), 1.0)
    h.fade(1e-12)
    assert kd_partitions(cg, h, min_records=1) == [(0, 0, 39, 29)]


def test_rewrite_cost_threshold_is_two_reads_per_record() -> None:
    """Two cells of 1 record; q queries on the left one. C(p) = 2q, best split costs q, so
    Cd = q against Crw = 2 x N(p) = 4: q = 4 does not split, q = 5 does (Inequality 4)."""
    cg = CountGrid.from_array(np.array([[1, 1]]))
    h = EulerHistogram(2, 1)
    h.add((0, 0, 0, 0), 4.0)
    assert kd_partitions(cg, h, min_records=1) == [(0, 0, 1, 0)]
    h.add((0, 0, 0, 0), 1.0)
    assert kd_partitions(cg, h, min_records=1) == [(0, 0, 0, 0), (1, 0, 1, 0)]
    # ... unless a half would fall under min_records.
    assert kd_partitions(cg, h, min_records=2) == [(0, 0, 1, 0)]


def test_hot_query_region_gets_small_partitions() -> None:
    nx, ny = 64, 48
    cg = CountGrid.from_array(np.full((ny, nx), 10, dtype=np.int64))
    h = EulerHistogram(nx, ny)
    hot = (20, 30, 23, 33)
    h.add_many([hot] * 50)
    h.add((0, 0, 63, 47))  # one query over everything: touches every partition equally
    parts = kd_partitions(cg, h, min_records=10)
    assert_tiles(parts, (0, 0, nx - 1, ny - 1), nx, ny)

    def overlaps(p: CellRect, q: CellRect) -> bool:
        return p[0] <= q[2] and q[0] <= p[2] and p[1] <= q[3] and q[1] <= p[3]

    def area(p: CellRect) -> int:
        return (p[2] - p[0] + 1) * (p[3] - p[1] + 1)

    # The hot region is cut out exactly, as one partition (splitting it further gains nothing:
    # its queries read all of it anyway) ...
    assert [p for p in parts if overlaps(p, hot)] == [hot]
    # ... by four cuts; away from it nothing is worth rewriting: four large partitions.
    far = [p for p in parts if not overlaps(p, hot)]
    assert len(far) == 4
    assert min(area(p) for p in far) > 4 * area(hot)
    assert layout_cost(cg, h, parts) < 0.1 * layout_cost(cg, h, [(0, 0, nx - 1, ny - 1)])


def test_split_queue_takes_the_most_profitable_split_first() -> None:
    rng = np.random.default_rng(9)
    nx, ny = 24, 20
    counts = rng.integers(0, 20, (ny, nx))
    cg = CountGrid.from_array(counts)
    h = EulerHistogram(nx, ny)
    for _ in range(40):
        x0, x1 = sorted(rng.integers(0, nx, 2).tolist())
        y0, y1 = sorted(rng.integers(0, ny, 2).tolist())
        h.add((x0, y0, x1, y1))
    full = (0, 0, nx - 1, ny - 1)
    assert kd_partitions(cg, h, min_records=5, max_splits=0) == [full]
    s = best_split(cg, h, full, min_records=5)
    assert s is not None
    assert kd_partitions(cg, h, min_records=5, max_splits=1) == sorted(
        [s.low, s.high], key=lambda p: (p[1], p[0], p[3], p[2])
    )
    unlimited = kd_partitions(cg, h, min_records=5)
    costs = [
        layout_cost(cg, h, kd_partitions(cg, h, min_records=5, max_splits=n))
        for n in range(len(unlimited))
    ]
    assert all(b < a for a, b in itertools.pairwise(costs))  # every split pays off
    assert kd_partitions(cg, h, min_records=5, max_splits=len(unlimited) - 1) == unlimited
    # Refining an existing layout is the same as refining each of its partitions.
    layout = kd_initial_partitions(cg, min_records=400)
    refined = refine_partitions(cg, h, layout, min_records=5)
    each = sorted(
        (p for q in layout for p in kd_partitions(cg, h, q, min_records=5)),
        key=lambda p: (p[1], p[0], p[3], p[2]),
    )
    assert refined == each
    assert_tiles(refined, full, nx, ny)


# -- §4.1: the initial, workload-agnostic k-d layout ------------------------------------------


@settings(max_examples=60, deadline=None)
@given(workload(max_side=10, max_queries=0), st.integers(1, 40))
def test_kd_initial_partitions_balance_and_stop_at_min_records(
    wl: tuple[I64, object], min_records: int
) -> None:
    counts, _ = wl
    ny, nx = counts.shape
    cg = CountGrid.from_array(counts)
    full = (0, 0, nx - 1, ny - 1)
    parts = kd_initial_partitions(cg, min_records=min_records)
    assert_tiles(parts, full, nx, ny)
    if parts != [full]:
        assert all(brute_count(counts, p) >= min_records for p in parts)
    for x0, y0, x1, y1 in parts:
        # No split of a leaf keeps both halves at min_records.
        cands = [((x0, y0, x1, s), (x0, s + 1, x1, y1)) for s in range(y0, y1)]
        cands += [((x0, y0, s, y1), (s + 1, y0, x1, y1)) for s in range(x0, x1)]
        for lo, hi in cands:
            assert min(brute_count(counts, lo), brute_count(counts, hi)) < min_records


def test_kd_initial_first_split_is_the_most_balanced() -> None:
    counts = np.zeros((6, 9), dtype=np.int64)
    counts[:, 0] = 10  # 60 records in column 0
    counts[5, 8] = 60  # 60 in the top-right cell
    cg = CountGrid.from_array(counts)
    # The only even split is between columns 0 and 1 (60 | 60); every row split is uneven.
    parts = kd_initial_partitions(cg, min_records=60)
    assert parts == [(0, 0, 0, 5), (1, 0, 8, 5)]


# -- §5: MINDIST / MAXDIST on the sphere -----------------------------------------------------


def sample_rect(rect: tuple[float, float, float, float], n: int) -> tuple[F64, F64, float]:
    """An n x n lattice over the rectangle (edges included) and the distance within which every
    point of the rectangle has a lattice point."""
    a, lo, b, hi = rect
    lons, lats = np.meshgrid(np.linspace(a, b, n), np.linspace(lo, hi, n))
    step = math.radians((b - a) / (n - 1) / 2 + (hi - lo) / (n - 1) / 2)
    return lons.ravel(), lats.ravel(), EARTH_RADIUS_M * step


@st.composite
def sphere_rect(draw: st.DrawFn) -> tuple[float, float, float, float]:
    a = draw(st.floats(-180, 180))
    width = draw(st.one_of(st.floats(0, 5), st.floats(0, 360), st.just(360.0)))
    lo = draw(st.floats(-90, 90))
    height = draw(st.one_of(st.floats(0, 5), st.floats(0, 180)))
    return (a, lo, a + width, min(90.0, lo + height))


@settings(max_examples=200, deadline=None)
@given(st.floats(-180, 180), st.floats(-90, 90), sphere_rect())
def test_mindist_maxdist_are_exact_bounds(
    lon: float, lat: float, rect: tuple[float, float, float, float]
) -> None:
    lons, lats, slack = sample_rect(rect, 201)
    d = haversine_m(lon, lat, lons, lats)
    mind = float(rect_mindist_m(lon, lat, [rect])[0])
    maxd = float(rect_maxdist_m(lon, lat, [rect])[0])
    tol = 1.0  # haversine rounding (ill-conditioned near antipodes)
    # Bounds: no point of the rectangle is nearer than MINDIST or farther than MAXDIST ...
    assert d.min() >= mind - tol
    assert d.max() <= maxd + tol
    # ... and they are tight: the lattice gets within its resolution of both.
    assert d.min() <= mind + slack + tol
    assert d.max() >= maxd - slack - tol
    assert 0.0 <= mind <= maxd <= math.pi * EARTH_RADIUS_M + tol


def test_mindist_nearest_point_on_an_edge() -> None:
    # Equator: the nearest point of [10, 20] x [-5, 5] to (0, 0) is (10, 0), not a corner.
    mind = float(rect_mindist_m(0.0, 0.0, [(10.0, -5.0, 20.0, 5.0)])[0])
    assert mind == pytest.approx(haversine_m(0.0, 0.0, 10.0, 0.0))
    assert mind < haversine_m(0.0, 0.0, 10.0, 5.0)
    # At 60N the perpendicular foot on the meridian 30E is at atan(tan 60 / cos 30) = 63.43N.
    mind = float(rect_mindist_m(0.0, 60.0, [(30.0, 50.0, 40.0, 80.0)])[0])
    foot = math.degrees(math.atan(math.tan(math.radians(60)) / math.cos(math.radians(30))))
    assert mind == pytest.approx(haversine_m(0.0, 60.0, 30.0, foot))
    corners = [haversine_m(0.0, 60.0, x, y) for x in (30.0, 40.0) for y in (50.0, 80.0)]
    assert mind < min(corners) - 1000.0
    # Inside the rectangle: 0; across the antimeridian: the short way round.
    assert rect_mindist_m(5.0, 5.0, [(0.0, 0.0, 10.0, 10.0)])[0] == 0.0
    across = float(rect_mindist_m(179.5, 0.0, [(-180.0, -1.0, -179.0, 1.0)])[0])
    assert across == pytest.approx(haversine_m(179.5, 0.0, 180.0, 0.0))


def test_maxdist_farthest_point_is_not_a_corner_at_high_latitude() -> None:
    # From (0, 80N), the farthest point of [100, 260] x [60, 70] is (180, 60): the far side of
    # the parallel, beyond every corner.
    rect = (100.0, 60.0, 260.0, 70.0)
    maxd = float(rect_maxdist_m(0.0, 80.0, [rect])[0])
    assert maxd == pytest.approx(haversine_m(0.0, 80.0, 180.0, 60.0))
    corners = [haversine_m(0.0, 80.0, x, y) for x in (100.0, 260.0) for y in (60.0, 70.0)]
    assert maxd > max(corners) + 100_000.0
    # The antipode inside: half the circumference.
    assert rect_maxdist_m(10.0, 20.0, [(180.0, -30.0, 200.0, -10.0)])[0] == pytest.approx(
        math.pi * EARTH_RADIUS_M
    )
    # From a pole every meridian is a straight way down: the lowest parallel is the farthest.
    assert rect_maxdist_m(0.0, 90.0, [(-10.0, 10.0, 10.0, 20.0)])[0] == pytest.approx(
        haversine_m(0.0, 90.0, 0.0, 10.0)
    )


# -- §5: the kNN radius ----------------------------------------------------------------------


def brute_knn_radii(
    grid: Grid, counts: I64, lon: float, lat: float, k: int
) -> tuple[float, float]:
    """(r*, M) over every non-empty cell: r* = the smallest r whose cells of MAXDIST <= r hold
    k records; M = AQWA's largest MAXDIST of the cells scanned by MINDIST until k records."""
    ys, xs = np.nonzero(counts)
    pad = 1e-9
    rects = np.array([
        (grid.bounds[0] + x * grid.cell_width - pad, grid.bounds[1] + y * grid.cell_height - pad,
         grid.bounds[0] + (x + 1) * grid.cell_width + pad,
         grid.bounds[1] + (y + 1) * grid.cell_height + pad)
        for y, x in zip(ys.tolist(), xs.tolist(), strict=True)
    ])
    c = counts[ys, xs]
    maxd = rect_maxdist_m(lon, lat, rects)
    mind = rect_mindist_m(lon, lat, rects)
    order = np.argsort(maxd)
    enough = np.cumsum(c[order]) >= k
    r_star = float(maxd[order][np.argmax(enough)]) if enough.any() else math.inf
    acc, m = 0, 0.0
    for i in np.argsort(mind, kind="stable").tolist():
        acc += int(c[i])
        m = max(m, float(maxd[i]))
        if acc >= k:
            break
    return r_star, m


@st.composite
def knn_case(draw: st.DrawFn) -> tuple[Grid, F64, F64, float, float, int]:
    world = draw(st.booleans())
    if world:
        bounds = (-180.0, -90.0, 180.0, 90.0)
    else:
        x0 = draw(st.floats(-180, 170))
        y0 = draw(st.floats(-90, 80))
        bounds = (x0, y0, draw(st.floats(x0 + 0.01, 180)), draw(st.floats(y0 + 0.01, 90)))
    grid = Grid(bounds=bounds, nx=draw(st.integers(1, 24)), ny=draw(st.integers(1, 24)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(0, 60))
    lon = rng.uniform(bounds[0], bounds[2], n)
    lat = rng.uniform(bounds[1], bounds[3], n)
    corner = rng.random(n) < 0.3  # some records exactly on cell corners (the MAXDIST points)
    lon[corner] = bounds[0] + rng.integers(0, grid.nx + 1, corner.sum()) * grid.cell_width
    lat[corner] = bounds[1] + rng.integers(0, grid.ny + 1, corner.sum()) * grid.cell_height
    lon, lat = np.minimum(lon, bounds[2]), np.minimum(lat, bounds[3])
    if draw(st.booleans()):
        plon, plat = draw(st.floats(-180, 180)), draw(st.floats(-90, 90))
    else:
        plon = draw(st.floats(bounds[0], bounds[2]))
        plat = draw(st.floats(bounds[1], bounds[3]))
    k = draw(st.integers(1, n + 2))
    return grid, lon, lat, plon, plat, k


@settings(max_examples=200, deadline=None)
@given(knn_case())
def test_knn_radius_holds_k_records_and_is_the_tightest_certified(
    case: tuple[Grid, F64, F64, float, float, int],
) -> None:
    grid, lon, lat, plon, plat, k = case
    cg = CountGrid.from_points(grid, lon, lat)
    r = knn_radius_m(cg, grid, plon, plat, k)
    if lon.size < k:
        assert r is None
        return
    assert r is not None
    # The circle holds at least k of the actual records.
    assert int((haversine_m(plon, plat, lon, lat) <= r).sum()) >= k
    r_star, m = brute_knn_radii(grid, cg.counts, plon, plat, k)
    # It is the tightest radius the grid certifies (the window search misses no cell), and
    # never above AQWA's MAXDIST of the cells scanned in MINDIST order.
    assert r == pytest.approx(r_star * (1 + 1e-9) + 1.0, rel=1e-12, abs=1e-6)
    assert r <= m * (1 + 1e-9) + 1.0 + 1e-6


def test_knn_radius_edge_cases() -> None:
    grid = Grid(nx=36, ny=18)
    cg = CountGrid.from_points(grid, [10.5, 10.6], [20.5, 20.6])
    assert knn_radius_m(cg, grid, 0.0, 0.0, 3) is None
    with pytest.raises(ValueError):
        knn_radius_m(cg, grid, 0.0, 0.0, 0)
    with pytest.raises(ValueError):
        knn_radius_m(cg, grid, 0.0, 91.0, 1)
    with pytest.raises(ValueError):
        knn_radius_m(cg, Grid(nx=10, ny=10), 0.0, 0.0, 1)
    # Both records are in the cell [10, 20] x [20, 30]: its farthest point from the query.
    r = knn_radius_m(cg, grid, 15.0, 25.0, 2)
    assert r is not None
    far = max(haversine_m(15.0, 25.0, x, y) for x in (10.0, 20.0) for y in (20.0, 30.0))
    assert far <= r <= far + 2.0


def test_knn_radius_wraps_at_the_antimeridian() -> None:
    grid = Grid(nx=3600, ny=1800)
    cg = CountGrid.from_points(grid, [-179.95] * 5 + [170.0] * 100, [0.05] * 5 + [0.0] * 100)
    r = knn_radius_m(cg, grid, 179.95, 0.05, 5)
    assert r is not None and r < 50_000.0  # across the antimeridian, not the 170E cluster


def test_knn_radius_on_a_1000_by_1000_grid_is_correct() -> None:
    grid = Grid()
    rng = np.random.default_rng(42)
    n = 20_000
    # Sparse and clustered: half uniform on the sphere, half around a few hot spots.
    lon = np.concatenate((rng.uniform(-180, 180, n // 2),
                          rng.normal(0, 2, n // 2) + rng.choice([-120.0, 10.0, 140.0], n // 2)))
    lat = np.concatenate((np.degrees(np.arcsin(rng.uniform(-1, 1, n // 2))),
                          np.clip(rng.normal(0, 2, n // 2) + 45.0, -90, 90)))
    lon = ((lon + 180.0) % 360.0) - 180.0
    cg = CountGrid.from_points(grid, lon, lat)
    points = [(0.0, 0.0), (10.0, 45.0), (179.99, -0.01), (-60.0, 89.99), (0.0, -90.0),
              (140.0, 44.0), (-30.0, -60.0)]
    ks = [1, 10, 100, 1000]
    radii = [knn_radius_m(cg, grid, plon, plat, k) for plon, plat in points for k in ks]
    for (plon, plat), k, r in zip([p for p in points for _ in ks], ks * len(points), radii,
                                  strict=True):
        assert r is not None
        d = haversine_m(plon, plat, lon, lat)
        assert int((d <= r).sum()) >= k
        r_star, m = brute_knn_radii(grid, cg.counts, plon, plat, k)
        assert r == pytest.approx(r_star * (1 + 1e-9) + 1.0, rel=1e-12, abs=1e-6)
        assert r <= m * (1 + 1e-9) + 1.0 + 1e-6
