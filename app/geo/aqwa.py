"""AQWA's building blocks: adaptive, query-workload-aware partitioning over a fine count grid.

AQWA (Aly et al., "AQWA: Adaptive Query-Workload-Aware Partitioning of Big Spatial Data")
keeps main-memory aggregates over a fine grid G of n rows by m columns and uses them to decide,
with O(1) work per candidate, how the archived records are cut into rectangular partitions
(the leaves of a k-d tree):

* `CountGrid` (§4.1, §4.2.1, Figure 3): the number of records per grid cell, with prefix sums
  (a summed-area table) so that the count N(p) of any cell rectangle p is four lookups.
* `EulerHistogram` (§4.2.3, Figures 5 and 6): the four query counters C1..C4 per cell, with
  prefix sums, so that Oq(p), the number of recorded queries that overlap p (each counted once,
  however many cells of p it covers), is O(1). Query weights make the counters floats, so that
  `fade` implements §4.2.4's time-fading weights; `TimeFadedEulerHistogram` is §4.2.4's
  C_old / C_new scheme with its time-fading cycle T.
* The cost model (§3.1, Equation 1): C(p) = Oq(p) x N(p), summed over a layout
  (`layout_cost`); the best split of a partition (§4.2.2-§4.2.3, `best_split`); the split-queue
  driven repartitioning with the read/write cost of Equation 3 and the minimum partition size
  of Inequality 4 (`kd_partitions`, `refine_partitions`); the workload-agnostic initial k-d
  decomposition of §4.1 (`kd_initial_partitions`).
* kNN support (§5, Figure 8): MINDIST / MAXDIST from a point to a longitude/latitude rectangle
  on the sphere (`rect_mindist_m`, `rect_maxdist_m`) and `knn_radius_m`, a radius whose circle
  surely holds k records counted in the grid, which turns a kNN query into a range query.

Conventions: arrays are (ny, nx) indexed [y, x], so a flat index is `Grid.cell_id(x, y)`.
Cell rectangles are inclusive (x0, y0, x1, y1) of integer cell coordinates. The paper's
top-to-bottom row order is our increasing y and its left-to-right column order our increasing
x, so its "top-left cell" of a rectangle is our (x0, y0), "not in left" means "not in column
x - 1" and "not in top" means "not in row y - 1".

Pure: numpy only, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from app.geo.geometry import haversine_m
from app.geo.grid import Grid

CellRect = tuple[int, int, int, int]
"""Inclusive (x0, y0, x1, y1) of grid cells."""

Axis = Literal["x", "y"]
"""Split axis: "x" cuts between columns `at` and `at + 1`, "y" between rows `at` and `at + 1`."""

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def _as_rects(rects: npt.ArrayLike, nx: int, ny: int) -> I64:
    """(n, 4) int64 copy of cell rectangles, checked to lie inside an nx x ny grid."""
    raw = np.asarray(rects)
    if raw.size and raw.dtype.kind not in "iu":
        raise TypeError(f"cell rectangles must be integers, got dtype {raw.dtype}")
    r = raw.astype(np.int64).reshape(-1, 4)
    x0, y0, x1, y1 = r[:, 0], r[:, 1], r[:, 2], r[:, 3]
    bad = (x0 < 0) | (x1 < x0) | (x1 >= nx) | (y0 < 0) | (y1 < y0) | (y1 >= ny)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"cell rectangle {tuple(r[i].tolist())} is empty or outside {nx}x{ny}")
    return r


def _check_shape(nx: int, ny: int) -> None:
    if nx < 1 or ny < 1:
        raise ValueError(f"a grid needs at least one cell, got {nx}x{ny}")


# -- §4.1 / §4.2.1: the count grid -------------------------------------------------------------


class CountGrid:
    """The fine grid G of record counts (AQWA §4.1, §4.2.1) with its prefix sums (Figure 3).

    G[y, x] is the number of archived records in cell (x, y). The summed-area table S, with
    S[y, x] = sum of G over rows < y and columns < x, is built by one horizontal and one vertical
    aggregation pass as in the paper, so N(p) of a cell rectangle is four lookups (Figure 3(b)).
    Data acquisition (§4.2.1) adds counts incrementally; S is rebuilt lazily, on the first
    count after a change.
    """

    __slots__ = ("nx", "ny", "_counts", "_sat")

    def __init__(self, nx: int, ny: int) -> None:
        _check_shape(nx, ny)
        self.nx = nx
        self.ny = ny
        self._counts: I64 = np.zeros((ny, nx), dtype=np.int64)
        self._sat: I64 | None = None

    @classmethod
    def from_array(cls, counts: npt.ArrayLike) -> CountGrid:
        """A count grid holding a copy of an (ny, nx) array of non-negative integer counts."""
        a = np.asarray(counts)
        if a.ndim != 2 or (a.size and a.dtype.kind not in "iu"):
            raise ValueError("counts must be a 2-d array of integers")
        if (a < 0).any():
            raise ValueError("counts must be non-negative")
        g = cls(a.shape[1], a.shape[0])
        g._counts[...] = a
        return g

    @classmethod
    def from_cells(
        cls, nx: int, ny: int, cell_ids: npt.ArrayLike, counts: npt.ArrayLike | None = None
    ) -> CountGrid:
        """A count grid from (cell id, count) pairs; ids may repeat (their counts add up)."""
        g = cls(nx, ny)
        g.add(cell_ids, counts)
        return g

    @classmethod
    def from_points(cls, grid: Grid, lon: npt.ArrayLike, lat: npt.ArrayLike) -> CountGrid:
        """A count grid of `grid`'s shape counting one record per (lon, lat) point."""
        g = cls(grid.nx, grid.ny)
        g.add_points(grid, lon, lat)
        return g

    @property
    def shape(self) -> tuple[int, int]:
        """(ny, nx)."""
        return (self.ny, self.nx)

    @property
    def counts(self) -> I64:
        """Read-only (ny, nx) view of the per-cell counts."""
        v = self._counts.view()
        v.flags.writeable = False
        return v

    @property
    def total(self) -> int:
        """Number of records in the whole grid."""
        return int(self._counts.sum())

    def add(self, cell_ids: npt.ArrayLike, counts: npt.ArrayLike | None = None) -> None:
        """Add `counts` (default: 1 each) records to the cells `cell_ids` (row-major ids)."""
        ids_raw = np.asarray(cell_ids)
        if ids_raw.size and ids_raw.dtype.kind not in "iu":
            raise TypeError(f"cell ids must be integers, got dtype {ids_raw.dtype}")
        ids = ids_raw.astype(np.int64).ravel()
        if counts is None:
            c = np.ones(ids.shape, dtype=np.int64)
        else:
            c_raw = np.asarray(counts)
            if c_raw.size and c_raw.dtype.kind not in "iu":
                raise TypeError(f"counts must be integers, got dtype {c_raw.dtype}")
            c = np.broadcast_to(c_raw.astype(np.int64).ravel(), ids.shape)
        if ids.size == 0:
            return
        if ids.min() < 0 or ids.max() >= self.nx * self.ny:
            raise ValueError(f"cell id outside 0..{self.nx * self.ny - 1}")
        if c.min() < 0:
            raise ValueError("counts must be non-negative")
        np.add.at(self._counts.reshape(-1), ids, c)
        self._sat = None

    def add_points(self, grid: Grid, lon: npt.ArrayLike, lat: npt.ArrayLike) -> None:
        """Count one record per point, in the cell `grid.cells_of` assigns it to."""
        if (grid.ny, grid.nx) != self.shape:
            raise ValueError(f"grid is {grid.nx}x{grid.ny}, counts are {self.nx}x{self.ny}")
        cx, cy = grid.cells_of(lon, lat)
        self.add(grid.cell_id(cx.astype(np.int64), cy.astype(np.int64)))

    def _table(self) -> I64:
        if self._sat is None:
            sat = np.zeros((self.ny + 1, self.nx + 1), dtype=np.int64)
            # Horizontal aggregation along each row, then vertical along each column (§4.2.1).
            np.cumsum(self._counts, axis=1, out=sat[1:, 1:])
            np.cumsum(sat[1:, 1:], axis=0, out=sat[1:, 1:])
            self._sat = sat
        return self._sat

    def count(self, x0: int, y0: int, x1: int, y1: int) -> int:
        """N(p): records in the inclusive cell rectangle, in O(1)."""
        return int(self.count_many(((x0, y0, x1, y1),))[0])

    def count_many(self, rects: npt.ArrayLike) -> I64:
        """N(p) for each row of an (n, 4) array of inclusive cell rectangles (vectorised)."""
        r = _as_rects(rects, self.nx, self.ny)
        s = self._table()
        x0, y0, x1, y1 = r[:, 0], r[:, 1], r[:, 2] + 1, r[:, 3] + 1
        out: I64 = s[y1, x1] - s[y0, x1] - s[y1, x0] + s[y0, x0]
        return out


# -- §4.2.3 / §4.2.4: the Euler histogram of the query workload --------------------------------


class QueryOverlaps(Protocol):
    """Anything that answers Oq(p), the (weighted) number of queries overlapping cell rectangles."""

    @property
    def shape(self) -> tuple[int, int]: ...

    def overlapping_many(self, rects: npt.ArrayLike) -> F64: ...


@dataclass(frozen=True)
class _EulerTables:
    c1: F64  # (ny, nx): C1 itself (only single cells are read)
    p2: F64  # (ny, nx + 1): prefix sums of C2 along each row
    p3: F64  # (ny + 1, nx): prefix sums of C3 along each column
    p4: F64  # (ny + 1, nx + 1): summed-area table of C4


class EulerHistogram:
    """AQWA's variant of the Euler histogram (§4.2.3, Figures 5 and 6) over an nx x ny grid.

    For each cell (x, y) it keeps the four counters of Figure 5, over the recorded query
    rectangles q (in cells), each weighted by its weight:

    * C1: queries that overlap the cell (the histogram's faces);
    * C2: queries that overlap it but not the cell to its left, (x - 1, y) (first column of q:
      vertical edges);
    * C3: queries that overlap it but not the cell above, (x, y - 1) (first row of q:
      horizontal edges);
    * C4: queries that overlap it but neither of those (the first cell of q: its vertex).

    Prefix sums as in the paper: C2 along each row, C3 along each column, C4 in both
    directions. Oq(p) for a rectangle p = (x0, y0, x1, y1) is then, as in Figure 6,
    R1 + R2 + R3 + R4 = C1 at (x0, y0) + C2 over the first row except (x0, y0) + C3 over the
    first column except (x0, y0) + C4 over the rest of p: four O(1) lookups. A query that
    intersects p is counted exactly once, in the region holding the first cell of q ∩ p, so
    overlapping queries are never counted twice (the point of the Euler histogram).

    Updates go into difference arrays (a query rectangle adds O(1) entries, so there is no
    per-cell update work); the counters and their prefix sums are rebuilt lazily, in O(nx ny)
    vectorised work, on the first lookup after a change. Weights are floats: `fade(factor)`
    multiplies every counter, which is how §4.2.4's time-fading weights age old queries.
    """

    __slots__ = ("nx", "ny", "_d1", "_d2", "_d3", "_c4", "_tables")

    def __init__(self, nx: int, ny: int) -> None:
        _check_shape(nx, ny)
        self.nx = nx
        self.ny = ny
        self._d1: F64 = np.zeros((ny + 1, nx + 1))  # 2-d difference array of C1
        self._d2: F64 = np.zeros((ny + 1, nx))  # per-column difference array of C2
        self._d3: F64 = np.zeros((ny, nx + 1))  # per-row difference array of C3
        self._c4: F64 = np.zeros((ny, nx))  # C4 itself: one entry per query
        self._tables: _EulerTables | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(ny, nx)."""
        return (self.ny, self.nx)

    @property
    def weight(self) -> float:
        """Total (faded) weight of the recorded queries."""
        return float(self._c4.sum())

    def add(self, rect: CellRect, weight: float = 1.0) -> None:
        """Record one query rectangle (inclusive cells) with `weight` (AQWA: 1 per query)."""
        self.add_many((rect,), (weight,))

    def add_many(self, rects: npt.ArrayLike, weights: npt.ArrayLike | None = None) -> None:
        """Record an (n, 4) array of query rectangles, with weights (default 1 each)."""
        r = _as_rects(rects, self.nx, self.ny)
        if weights is None:
            w = np.ones(r.shape[0])
        else:
            w = np.broadcast_to(np.asarray(weights, dtype=np.float64).ravel(), (r.shape[0],))
        if not np.isfinite(w).all() or (w < 0).any():
            raise ValueError("query weights must be finite and non-negative")
        if r.shape[0] == 0:
            return
        x0, y0, x1, y1 = r[:, 0], r[:, 1], r[:, 2] + 1, r[:, 3] + 1
        np.add.at(self._d1, (y0, x0), w)
        np.add.at(self._d1, (y0, x1), -w)
        np.add.at(self._d1, (y1, x0), -w)
        np.add.at(self._d1, (y1, x1), w)
        np.add.at(self._d2, (y0, x0), w)  # C2: column x0, rows y0..y1
        np.add.at(self._d2, (y1, x0), -w)
        np.add.at(self._d3, (y0, x0), w)  # C3: row y0, columns x0..x1
        np.add.at(self._d3, (y0, x1), -w)
        np.add.at(self._c4, (y0, x0), w)  # C4: cell (x0, y0)
        self._tables = None

    def fade(self, factor: float) -> None:
        """Multiply every counter by `factor` > 0 (§4.2.4: old queries weigh less)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"fade factor must be finite and positive, got {factor!r}")
        for a in (self._d1, self._d2, self._d3, self._c4):
            a *= factor
        if self._tables is not None:
            for a in (self._tables.c1, self._tables.p2, self._tables.p3, self._tables.p4):
                a *= factor

    def merge(self, other: EulerHistogram) -> None:
        """Add another histogram's counters to this one (same shape)."""
        if other.shape != self.shape:
            raise ValueError(f"shapes differ: {other.shape} vs {self.shape}")
        self._d1 += other._d1
        self._d2 += other._d2
        self._d3 += other._d3
        self._c4 += other._c4
        self._tables = None

    def clear(self) -> None:
        """Forget every recorded query."""
        for a in (self._d1, self._d2, self._d3, self._c4):
            a[...] = 0.0
        self._tables = None

    def _build(self) -> _EulerTables:
        if self._tables is None:
            ny, nx = self.ny, self.nx
            c1 = np.cumsum(np.cumsum(self._d1, axis=0), axis=1)[:ny, :nx]
            c2 = np.cumsum(self._d2, axis=0)[:ny]
            c3 = np.cumsum(self._d3, axis=1)[:, :nx]
            p2 = np.zeros((ny, nx + 1))
            np.cumsum(c2, axis=1, out=p2[:, 1:])
            p3 = np.zeros((ny + 1, nx))
            np.cumsum(c3, axis=0, out=p3[1:])
            p4 = np.zeros((ny + 1, nx + 1))
            np.cumsum(self._c4, axis=1, out=p4[1:, 1:])
            np.cumsum(p4[1:, 1:], axis=0, out=p4[1:, 1:])
            self._tables = _EulerTables(np.ascontiguousarray(c1), p2, p3, p4)
        return self._tables

    def counters(self) -> tuple[F64, F64, F64, F64]:
        """Copies of the (ny, nx) counters C1, C2, C3, C4 of Figure 5."""
        t = self._build()
        c2 = np.diff(t.p2, axis=1)
        c3 = np.diff(t.p3, axis=0)
        c4 = self._c4.copy()
        return t.c1.copy(), c2, c3, c4

    def overlapping(self, rect: CellRect) -> float:
        """Oq(p): weighted number of recorded queries that intersect the cell rectangle, O(1)."""
        return float(self.overlapping_many((rect,))[0])

    def overlapping_many(self, rects: npt.ArrayLike) -> F64:
        """Oq(p) for each row of an (n, 4) array of cell rectangles (Figure 6, vectorised)."""
        r = _as_rects(rects, self.nx, self.ny)
        t = self._build()
        x0, y0, x1, y1 = r[:, 0], r[:, 1], r[:, 2], r[:, 3]
        r1 = t.c1[y0, x0]
        r2 = t.p2[y0, x1 + 1] - t.p2[y0, x0 + 1]  # C2 on row y0, columns x0+1..x1
        r3 = t.p3[y1 + 1, x0] - t.p3[y0 + 1, x0]  # C3 on column x0, rows y0+1..y1
        p4 = t.p4
        r4 = p4[y1 + 1, x1 + 1] - p4[y0 + 1, x1 + 1] - p4[y1 + 1, x0 + 1] + p4[y0 + 1, x0 + 1]
        out: F64 = np.maximum(r1 + r2 + r3 + r4, 0.0)  # clamp rounding noise of faded sums
        return out


class TimeFadedEulerHistogram:
    """§4.2.4's time-fading weights: an Euler histogram of current and one of old queries.

    Queries are recorded in C_new. At the end of every time-fading cycle T (`end_cycle`),
    C_old is divided by the decay constant c > 1 and then C_new is added to it and reset, so a
    query recorded i full cycles ago weighs c**-(i - 1) (1 during its own cycle and the next).
    Oq(p) is C_new + C_old.
    """

    __slots__ = ("current", "old", "decay")

    def __init__(self, nx: int, ny: int, decay: float = 2.0) -> None:
        if not (math.isfinite(decay) and decay > 1.0):
            raise ValueError(f"decay constant c must be finite and > 1, got {decay!r}")
        self.current = EulerHistogram(nx, ny)
        self.old = EulerHistogram(nx, ny)
        self.decay = decay

    @property
    def shape(self) -> tuple[int, int]:
        """(ny, nx)."""
        return self.current.shape

    def add(self, rect: CellRect, weight: float = 1.0) -> None:
        """Record a query of the current cycle."""
        self.current.add(rect, weight)

    def add_many(self, rects: npt.ArrayLike, weights: npt.ArrayLike | None = None) -> None:
        """Record queries of the current cycle."""
        self.current.add_many(rects, weights)

    def end_cycle(self) -> None:
        """Close a time-fading cycle: C_old = C_old / c + C_new; C_new = 0."""
        self.old.fade(1.0 / self.decay)
        self.old.merge(self.current)
        self.current.clear()

    def overlapping(self, rect: CellRect) -> float:
        """Oq(p) = C_new + C_old for one cell rectangle."""
        return float(self.overlapping_many((rect,))[0])

    def overlapping_many(self, rects: npt.ArrayLike) -> F64:
        """Oq(p) = C_new + C_old for an (n, 4) array of cell rectangles."""
        out: F64 = self.current.overlapping_many(rects) + self.old.overlapping_many(rects)
        return out


# -- §3.1, §4.1, §4.2.2, §4.2.3: the cost model and k-d partitioning ---------------------------


def _check_pair(counts: CountGrid, queries: QueryOverlaps) -> None:
    if counts.shape != queries.shape:
        raise ValueError(f"count grid {counts.shape} and query histogram {queries.shape} differ")


def partition_costs(
    counts: CountGrid, queries: QueryOverlaps, partitions: npt.ArrayLike
) -> F64:
    """Equation 1 per partition: C(p) = Oq(p) x N(p), for an (n, 4) array of cell rectangles."""
    _check_pair(counts, queries)
    r = _as_rects(partitions, counts.nx, counts.ny)
    out: F64 = queries.overlapping_many(r) * counts.count_many(r).astype(np.float64)
    return out


def layout_cost(
    counts: CountGrid, queries: QueryOverlaps, partitions: Sequence[CellRect] | npt.ArrayLike
) -> float:
    """Equation 1: Cost(L) = sum over p in L of Oq(p) x N(p) (records the workload reads)."""
    return float(partition_costs(counts, queries, partitions).sum())


@dataclass(frozen=True)
class Split:
    """A split of a partition p into `low` and `high` (§4.2.2).

    `cost` = C(low) + C(high) and `gain` = Cd(Split, p, low, high) = C(p) - cost (Equation 2).
    """

    axis: Axis
    at: int
    low: CellRect
    high: CellRect
    cost: float
    gain: float


def _candidates(rect: CellRect) -> tuple[BoolArray, I64, I64, I64]:
    """Every split of rect: (is_x_axis, at, low halves (n, 4), high halves (n, 4)).

    "y" splits (between rows, the paper's horizontal lines, tried first in §4.1) come first,
    then "x" splits (between columns), each by increasing position.
    """
    x0, y0, x1, y1 = rect
    ys = np.arange(y0, y1, dtype=np.int64)
    xs = np.arange(x0, x1, dtype=np.int64)
    ny_, nx_ = ys.size, xs.size
    n = ny_ + nx_
    low = np.empty((n, 4), dtype=np.int64)
    high = np.empty((n, 4), dtype=np.int64)
    low[:] = (x0, y0, x1, y1)
    high[:] = (x0, y0, x1, y1)
    low[:ny_, 3] = ys
    high[:ny_, 1] = ys + 1
    low[ny_:, 2] = xs
    high[ny_:, 0] = xs + 1
    is_x = np.zeros(n, dtype=np.bool_)
    is_x[ny_:] = True
    return is_x, np.concatenate((ys, xs)), low, high


def _rect_tuple(a: I64) -> CellRect:
    return (int(a[0]), int(a[1]), int(a[2]), int(a[3]))


def best_split(
    counts: CountGrid, queries: QueryOverlaps, rect: CellRect, *, min_records: int = 0
) -> Split | None:
    """The split of `rect` with the lowest C(p1) + C(p2) = largest Cd (§4.2.2-§4.2.3).

    Every candidate position on both axes is evaluated, each in O(1) with the prefix sums of
    the count grid and the Euler histogram (vectorised). Only candidates that leave both halves
    with at least `min_records` records are eligible (Inequality 4); ties are broken by the most
    balanced record counts, then by the candidate order of `_candidates`. None if no candidate
    is eligible (e.g. a single cell). The caller decides whether the gain is worth the rewrite.
    """
    _check_pair(counts, queries)
    r = _as_rects((rect,), counts.nx, counts.ny)[0]
    is_x, at, low, high = _candidates(_rect_tuple(r))
    if at.size == 0:
        return None
    both = np.concatenate((low, high, r[None, :]))
    n_all = counts.count_many(both)
    q_all = queries.overlapping_many(both)
    m = at.size
    n_low, n_high = n_all[:m], n_all[m : 2 * m]
    cost = q_all[:m] * n_low + q_all[m : 2 * m] * n_high
    ok = (n_low >= min_records) & (n_high >= min_records)
    if not ok.any():
        return None
    idx = np.flatnonzero(ok)
    order = np.lexsort((idx, np.abs(n_low[idx] - n_high[idx]), cost[idx]))
    i = int(idx[order[0]])
    c_p = float(q_all[2 * m] * n_all[2 * m])
    return Split(
        axis="x" if bool(is_x[i]) else "y",
        at=int(at[i]),
        low=_rect_tuple(low[i]),
        high=_rect_tuple(high[i]),
        cost=float(cost[i]),
        gain=c_p - float(cost[i]),
    )


def refine_partitions(
    counts: CountGrid,
    queries: QueryOverlaps,
    layout: Sequence[CellRect],
    *,
    min_records: int,
    rewrite_cost_per_record: float = 2.0,
    max_splits: int | None = None,
) -> list[CellRect]:
    """AQWA's repartitioning (§4.2.2): split partitions of `layout` while it pays off.

    The split-queue is a max-heap of partitions keyed by Cd - Crw, where Cd is the gain of the
    partition's best split (`best_split`) and Crw = rewrite_cost_per_record x N(p) the cost of
    reading and rewriting its records (Equation 3: the paper's factor is 2, one read and one
    write per record). A partition enters the queue only if its split satisfies Inequality 4:
    Cd > Crw and both halves hold at least `min_records` records (the paper's "> minCount",
    i.e. min_records = minCount + 1; it keeps partitions at least a file-system block). The
    best entry is split and its halves are re-examined, until the queue is empty or
    `max_splits` splits were made (then the most profitable splits are the ones made).

    Without a budget the result does not depend on the order (a split changes no other
    partition's cost), so it equals the recursive k-d decomposition. With no recorded queries
    Cd is 0 and nothing is split: the workload-agnostic layout is §4.1's
    `kd_initial_partitions`. Returns the leaves, sorted by (y0, x0).
    """
    _check_pair(counts, queries)
    if min_records < 0:
        raise ValueError(f"min_records must be >= 0, got {min_records}")
    if not (math.isfinite(rewrite_cost_per_record) and rewrite_cost_per_record >= 0):
        raise ValueError("rewrite_cost_per_record must be finite and non-negative")
    if max_splits is not None and max_splits < 0:
        raise ValueError(f"max_splits must be >= 0, got {max_splits}")
    rects = _as_rects(layout, counts.nx, counts.ny)

    leaves: list[CellRect] = []
    heap: list[tuple[float, int, CellRect, Split]] = []
    seq = 0

    def consider(p: CellRect) -> None:
        nonlocal seq
        s = best_split(counts, queries, p, min_records=min_records)
        if s is not None:
            net = s.gain - rewrite_cost_per_record * counts.count(*p)
            if net > 0:
                heapq.heappush(heap, (-net, seq, p, s))
                seq += 1
                return
        leaves.append(p)

    for row in rects:
        consider(_rect_tuple(row))
    splits = 0
    while heap and (max_splits is None or splits < max_splits):
        _, _, _, s = heapq.heappop(heap)
        splits += 1
        consider(s.low)
        consider(s.high)
    leaves.extend(p for _, _, p, _ in heap)
    leaves.sort(key=lambda p: (p[1], p[0], p[3], p[2]))
    return leaves


def kd_partitions(
    counts: CountGrid,
    queries: QueryOverlaps,
    bounds: CellRect | None = None,
    *,
    min_records: int,
    rewrite_cost_per_record: float = 2.0,
    max_splits: int | None = None,
) -> list[CellRect]:
    """Workload-aware k-d partitions tiling `bounds` (default: the whole grid), §4.2.2.

    `refine_partitions` started from the single partition `bounds`; see there for the rule.
    """
    b = bounds if bounds is not None else (0, 0, counts.nx - 1, counts.ny - 1)
    return refine_partitions(
        counts,
        queries,
        [b],
        min_records=min_records,
        rewrite_cost_per_record=rewrite_cost_per_record,
        max_splits=max_splits,
    )


def kd_initial_partitions(
    counts: CountGrid, bounds: CellRect | None = None, *, min_records: int
) -> list[CellRect]:
    """§4.1's initial layout: recursive k-d splits that balance the record counts.

    Each partition is cut at the candidate (over both axes) minimising |N(p1) - N(p2)|, found
    exactly with the prefix sums rather than by the paper's binary search (same result when an
    even split exists); ties prefer "y" splits, as the paper tries horizontal lines first.
    Splitting stops when the most balanced split would leave a half under `min_records` (>= 1)
    records, which also means no other split could keep both halves at that size.
    """
    if min_records < 1:
        raise ValueError(f"min_records must be >= 1, got {min_records}")
    b = bounds if bounds is not None else (0, 0, counts.nx - 1, counts.ny - 1)
    stack = [_rect_tuple(_as_rects((b,), counts.nx, counts.ny)[0])]
    leaves: list[CellRect] = []
    while stack:
        p = stack.pop()
        _, _, low, high = _candidates(p)
        if low.shape[0] == 0:
            leaves.append(p)
            continue
        n = counts.count_many(np.concatenate((low, high)))
        m = low.shape[0]
        i = int(np.argmin(np.abs(n[:m] - n[m:])))
        if min(int(n[i]), int(n[m + i])) < min_records:
            leaves.append(p)
            continue
        stack.append(_rect_tuple(high[i]))
        stack.append(_rect_tuple(low[i]))
    leaves.sort(key=lambda p: (p[1], p[0], p[3], p[2]))
    return leaves


# -- §5: kNN queries over the count grid -------------------------------------------------------

_PAD_DEG = 1e-9
"""Cells are widened by this many degrees: a record whose floor() lands in a cell may lie an
ulp outside its nominal extent."""

_RADIUS_REL = 1e-9
_RADIUS_ABS_M = 1.0
"""knn_radius_m's slack: haversine is ill-conditioned near antipodal distances (an ulp of its
argument is ~0.1 m there), so a record at a cell's farthest point may evaluate slightly past
the exact MAXDIST."""


def _rect_arrays(rects: npt.ArrayLike) -> tuple[F64, F64, F64, F64]:
    r = np.asarray(rects, dtype=np.float64).reshape(-1, 4)
    a, b = r[:, 0], r[:, 2]
    lo, hi = np.clip(r[:, 1], -90.0, 90.0), np.clip(r[:, 3], -90.0, 90.0)
    if not (np.isfinite(r).all() and (b >= a).all() and (hi >= lo).all()):
        raise ValueError("rectangles must be finite with min <= max")
    return a, lo, b, hi


def _lon_within(lon: float | F64, a: F64, b: F64) -> BoolArray:
    """Whether longitude `lon` lies in the eastward interval [a, b] (modulo 360)."""
    out: BoolArray = ((b - a) >= 360.0) | (np.mod(lon - a, 360.0) <= (b - a))
    return out


def _meridian_extreme_lat(lon: float, lat: float, edge_lon: F64, far: bool) -> F64:
    """Latitude of the point of meridian `edge_lon` nearest to (far: farthest from) the point.

    Along a meridian, cos d = sin(phi) sin(t) + cos(phi) cos(dlon) cos(t) = rho cos(t - theta)
    with theta = atan2(sin(phi), cos(phi) cos(dlon)): nearest at t = theta, farthest at
    t = theta +- 180 degrees. Clipped to a latitude range, the extreme is the clipped value or
    an endpoint (the callers also try the corners).
    """
    phi = math.radians(lat)
    dl = np.radians(edge_lon - lon)
    theta = np.degrees(np.arctan2(math.sin(phi), math.cos(phi) * np.cos(dl)))
    if far:
        theta = np.where(theta > 0.0, theta - 180.0, theta + 180.0)
    out: F64 = theta
    return out


def rect_mindist_m(lon: float, lat: float, rects: npt.ArrayLike) -> F64:
    """MINDIST (§5): exact great-circle distance from a point to each lon/lat rectangle.

    `rects` is (n, 4) of (min_lon, min_lat, max_lon, max_lat) degrees, the longitude range read
    eastwards from min_lon (max_lon may exceed 180; at most 360 wide). On the sphere:
    if the point's meridian crosses the rectangle, the nearest point is on that meridian at the
    clipped latitude (great-circle distance >= latitude difference); otherwise it is on a
    meridian edge (on a parallel edge the distance grows with the longitude gap, so the parallel
    edges' minima are corners), at the foot of the perpendicular clipped to the edge, or at a
    corner. The minimum over these candidates, all inside the rectangle, is exact (up to
    rounding) and so a lower bound on the distance to anything in the rectangle.
    """
    a, lo, b, hi = _rect_arrays(rects)
    if a.size == 0:
        return np.empty(0)
    ta = np.clip(_meridian_extreme_lat(lon, lat, a, far=False), lo, hi)
    tb = np.clip(_meridian_extreme_lat(lon, lat, b, far=False), lo, hi)
    inside = np.broadcast_to(np.float64(lon), a.shape)
    clat = np.clip(lat, lo, hi)
    c_lon = np.stack((a, a, b, b, a, b, inside))
    c_lat = np.stack((lo, hi, lo, hi, ta, tb, clat))
    d = haversine_m(lon, lat, c_lon, c_lat)
    d[6] = np.where(_lon_within(lon, a, b), d[6], np.inf)
    out: F64 = d.min(axis=0)
    return out


def rect_maxdist_m(lon: float, lat: float, rects: npt.ArrayLike) -> F64:
    """MAXDIST (§5): exact largest great-circle distance from a point to each lon/lat rectangle.

    The farthest point of a spherical region is the antipode if the region holds it, otherwise
    on the boundary: on a meridian edge at the clipped antipodal foot (theta + 180 degrees) or
    at an end, or on a parallel edge where the longitude gap is largest, which is the antipodal
    meridian lon + 180 when the rectangle spans it (not a corner: at high latitudes the far side
    of a wide cell beats its corners) and a corner otherwise. The maximum over these candidates
    (all inside the rectangle) is exact up to rounding, an upper bound on every distance.
    """
    a, lo, b, hi = _rect_arrays(rects)
    if a.size == 0:
        return np.empty(0)
    ta = np.clip(_meridian_extreme_lat(lon, lat, a, far=True), lo, hi)
    tb = np.clip(_meridian_extreme_lat(lon, lat, b, far=True), lo, hi)
    anti = np.broadcast_to(np.float64(lon + 180.0), a.shape)
    c_lon = np.stack((a, a, b, b, a, b, anti, anti, anti))
    c_lat = np.stack((lo, hi, lo, hi, ta, tb, lo, hi, np.clip(-lat, lo, hi)))
    d = haversine_m(lon, lat, c_lon, c_lat)
    d[6:] = np.where(_lon_within(lon + 180.0, a, b), d[6:], -np.inf)
    out: F64 = d.max(axis=0)
    return out


def _kth_maxdist(
    lon: float, lat: float, grid: Grid, counts: I64, x0: int, y0: int, x1: int, y1: int, k: int
) -> float:
    """Smallest r with >= k records in window cells whose MAXDIST <= r (inf if too few)."""
    nx = grid.nx
    cols = np.arange(x0, x1 + 1, dtype=np.int64)  # unwrapped columns (may exceed nx - 1)
    sub = counts[y0 : y1 + 1][:, cols % nx]
    if int(sub.sum()) < k:
        return math.inf
    iy, ix = np.nonzero(sub)
    c = cols[ix].astype(np.float64)
    r = (iy + y0).astype(np.float64)
    b0, b1 = grid.bounds[0], grid.bounds[1]
    w, h = grid.cell_width, grid.cell_height
    rects = np.stack(
        (b0 + c * w - _PAD_DEG, b1 + r * h - _PAD_DEG,
         b0 + (c + 1) * w + _PAD_DEG, b1 + (r + 1) * h + _PAD_DEG),
        axis=1,
    )
    md = rect_maxdist_m(lon, lat, rects)
    order = np.argsort(md, kind="stable")
    cum = np.cumsum(sub[iy, ix][order])
    return float(md[order[int(np.searchsorted(cum, k))]])


def knn_radius_m(counts: CountGrid, grid: Grid, lon: float, lat: float, k: int) -> float | None:
    """A radius (m) whose circle around (lon, lat) surely holds >= k records of the grid (§5).

    AQWA scans cells in increasing MINDIST, accumulates their counts until k is reached and
    answers the largest MAXDIST M of the scanned cells. This returns the tightest radius the
    grid can certify, r* = the smallest r such that the cells with MAXDIST <= r hold >= k
    records (those cells lie entirely in the circle); r* <= M, since M's cells qualify.

    Efficient on large grids: a window of cells around the point's cell grows side by side
    (doubling steps) while the MINDIST of the rest of the grid beyond that side (a lon/lat
    strip, whose exact MINDIST bounds every cell in it from below) is below the window's
    current r*; a cell with MINDIST >= r* has MAXDIST >= r* and cannot lower it. Only non-empty
    window cells get a MAXDIST. Grids spanning 360 degrees of longitude wrap at the
    antimeridian. Cells are padded by 1e-9 degrees and the radius by 1e-9 relative + 1 m for
    rounding. Assumes the counted records lie inside the grid's bounds (`Grid.cells_of` clips
    outside points into border cells, whose nominal extent would not contain them).

    Returns None when the grid holds fewer than k records (the answer is then "everything").
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if counts.shape != (grid.ny, grid.nx):
        raise ValueError(f"grid is {grid.nx}x{grid.ny}, counts are {counts.nx}x{counts.ny}")
    if not (math.isfinite(lon) and math.isfinite(lat) and -90.0 <= lat <= 90.0):
        raise ValueError(f"invalid point ({lon!r}, {lat!r})")
    if counts.total < k:
        return None
    nx, ny = grid.nx, grid.ny
    b0, b1, b2, b3 = grid.bounds
    w, h = grid.cell_width, grid.cell_height
    wraps = b2 - b0 >= 360.0
    start_lon = ((lon + 180.0) % 360.0) - 180.0 if wraps else lon
    cxa, cya = grid.cells_of(start_lon, lat)
    x0 = x1 = int(cxa)
    y0 = y1 = int(cya)
    arr = counts.counts
    step = 1
    pad = _PAD_DEG
    while True:
        radius = _kth_maxdist(lon, lat, grid, arr, x0, y0, x1, y1, k)
        # The rest of the grid as up to four strips, each tagged with the side it grows.
        sides: list[str] = []
        strips: list[tuple[float, float, float, float]] = []
        lat_lo, lat_hi = b1 + y0 * h - pad, b1 + (y1 + 1) * h + pad
        if y0 > 0:
            sides.append("bottom")
            strips.append((b0 - pad, b1 - pad, b2 + pad, b1 + y0 * h + pad))
        if y1 < ny - 1:
            sides.append("top")
            strips.append((b0 - pad, b1 + (y1 + 1) * h - pad, b2 + pad, b3 + pad))
        rest = nx - (x1 - x0 + 1)
        right_room = left_room = 0
        if wraps:
            right_room = (rest + 1) // 2
            left_room = rest - right_room
        else:
            right_room, left_room = nx - 1 - x1, x0
        if right_room > 0:
            sides.append("right")
            strips.append(
                (b0 + (x1 + 1) * w - pad, lat_lo, b0 + (x1 + 1 + right_room) * w + pad, lat_hi)
            )
        if left_room > 0:
            sides.append("left")
            strips.append((b0 + (x0 - left_room) * w - pad, lat_lo, b0 + x0 * w + pad, lat_hi))
        if not strips:
            return None if math.isinf(radius) else radius * (1 + _RADIUS_REL) + _RADIUS_ABS_M
        lower = rect_mindist_m(lon, lat, strips)
        grow = {side for side, lb in zip(sides, lower.tolist(), strict=True) if lb < radius}
        if not grow:
            return radius * (1 + _RADIUS_REL) + _RADIUS_ABS_M
        if "bottom" in grow:
            y0 = max(0, y0 - step)
        if "top" in grow:
            y1 = min(ny - 1, y1 + step)
        if "right" in grow:
            x1 += min(step, right_room)
        if "left" in grow:
            x0 -= min(step, left_room)
        step *= 2
