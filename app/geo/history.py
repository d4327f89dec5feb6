"""SWARM §6's "Static Grid Based on History" baseline: a fixed k-d partitioning of the grid
computed offline from a sample of past objects and queries with SWARM's cost model (§3), so that
every worker starts with about the same cost C = N·Q·R. It never changes afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.geo.geometry import circle_bbox
from app.geo.grid import Grid
from app.geo.index import Partition, Plan, check_workers
from app.geo.stats import Axis, PartitionStats

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
Rect = tuple[int, int, int, int]


@dataclass(frozen=True)
class _Cut:
    axis: Axis
    at: int  # the low side is coordinate <= at
    k_low: int  # workers that will share the low side


def _region_stats(rect: Rect, cx: I64, cy: I64, q: I64) -> PartitionStats:
    """PartitionStats of one region over the sample: its objects and the queries overlapping it
    (clipped) received in one round, then folded (Algorithm 2): N, Q, R = the sample's counts."""
    s = PartitionStats(Partition("sample", *rect, worker="-"))
    s.add_objects(cx, cy)
    s.add_queries(q[:, 0], q[:, 1], q[:, 2], q[:, 3])
    s.fold()
    return s


def _k_low_options(k: int) -> list[list[int]]:
    """Worker counts for the low side, best first: k//2 (and its mirror for odd k), then the
    others by distance from k/2 (needed only when a thin region cannot be halved by count)."""
    by_dist: dict[float, list[int]] = {}
    for k1 in range(1, k):
        by_dist.setdefault(abs(k1 - k / 2), []).append(k1)
    return [by_dist[d] for d in sorted(by_dist)]


def _best_cut(s: PartitionStats, k: int) -> _Cut:
    """The cut of a region into a side for k1 workers and a side for k - k1 that balances the
    cost per worker: minimise |C(low)/k1³ - C(high)/k2³|.

    N, Q and R all grow about linearly with the share of the load a region holds, so a region
    that k workers will share ends up as partitions of cost about C/k³ each; with k1 = k2 this
    is SWARM's own split criterion (|Cdiff| of §4.3.2 with C(mL) = 0: equal halves). Every split
    position of both axes is scored at once from the statistics (`split_all`, the same counts
    the paper's binary searches read). Ties (a region with no cost at all, as with an empty
    sample) go to the most equal areas per worker, then to cutting the longer side: without
    any sample this gives equal areas, like the initial plan.
    """
    p = s.partition
    for group in _k_low_options(k):
        best: tuple[float, float, int] | None = None
        cut: _Cut | None = None
        total = float(np.prod(s.totals()))
        for k1 in group:
            k2 = k - k1
            for axis in ("y", "x"):
                if not s.can_split(axis):
                    continue
                a = s.axis(axis)
                length, other = (p.height, p.width) if axis == "y" else (p.width, p.height)
                n1, q1, r1, n2, q2, r2 = a.split_all()
                c1 = n1 * q1.astype(np.float64) * r1
                c2 = n2 * q2.astype(np.float64) * r2
                low_cells = (np.arange(1, length) * other).astype(np.float64)
                high_cells = length * other - low_cells
                valid = (low_cells >= k1) & (high_cells >= k2)
                if not valid.any():
                    continue
                diff = np.abs(c1 / k1**3 - c2 / k2**3)
                # Equal within rounding: only the area can break the tie.
                diff = np.round(diff / (total / k**3 + 1e-300), 9)
                area = np.abs(low_cells / k1 - high_cells / k2) / (length * other)
                diff[~valid] = np.inf
                order = np.lexsort((area, diff))
                i = int(order[0])
                key = (float(diff[i]), float(area[i]), -length)
                if best is None or key < best:
                    best = key
                    cut = _Cut(axis, s.offset(axis) + i, k1)
        if cut is not None:
            return cut
    raise ValueError(f"region {p!r} cannot be cut into {k} partitions")


def _split(rect: Rect, cut: _Cut) -> tuple[Rect, Rect]:
    x0, y0, x1, y1 = rect
    if cut.axis == "y":
        return (x0, y0, x1, cut.at), (x0, cut.at + 1, x1, y1)
    return (x0, y0, cut.at, y1), (cut.at + 1, y0, x1, y1)


def _inside(rect: Rect, cx: I64, cy: I64) -> npt.NDArray[np.bool_]:
    return (cx >= rect[0]) & (cx <= rect[2]) & (cy >= rect[1]) & (cy <= rect[3])


def _overlapping(rect: Rect, q: I64) -> npt.NDArray[np.bool_]:
    return (q[:, 0] <= rect[2]) & (q[:, 2] >= rect[0]) & (q[:, 1] <= rect[3]) & (q[:, 3] >= rect[1])


def history_plan(
    grid: Grid,
    workers: list[str],
    obj_cx: npt.ArrayLike,
    obj_cy: npt.ArrayLike,
    query_rects: npt.ArrayLike,
    version: int = 1,
) -> Plan:
    """One partition per worker (ids p0.., workers in order), cut k-d style so that the sample's
    costs N·Q·R per partition are about equal (SWARM §6's static grid based on history).

    `obj_cx`, `obj_cy`: the sample objects' cells; `query_rects`: (n, 4) inclusive cell
    rectangles (x0, y0, x1, y1) of the sample queries (clipped to the grid here). The region of
    k workers is cut in two sides for k1 = k//2 and k - k1 workers (`_best_cut`), recursively.
    """
    check_workers(grid, workers)
    cx = np.clip(np.atleast_1d(np.asarray(obj_cx, dtype=np.int64)), 0, grid.nx - 1)
    cy = np.clip(np.atleast_1d(np.asarray(obj_cy, dtype=np.int64)), 0, grid.ny - 1)
    if cx.shape != cy.shape:
        raise ValueError("obj_cx and obj_cy differ in length")
    q = np.asarray(query_rects, dtype=np.int64).reshape(-1, 4).copy()
    q[:, [0, 2]] = np.clip(q[:, [0, 2]], 0, grid.nx - 1)
    q[:, [1, 3]] = np.clip(q[:, [1, 3]], 0, grid.ny - 1)
    q = q[(q[:, 0] <= q[:, 2]) & (q[:, 1] <= q[:, 3])]

    leaves: list[Rect] = []

    def cut(rect: Rect, k: int, cx: I64, cy: I64, q: I64) -> None:
        if k == 1:
            leaves.append(rect)
            return
        c = _best_cut(_region_stats(rect, cx, cy, q), k)
        for side, kk in zip(_split(rect, c), (c.k_low, k - c.k_low), strict=True):
            m = _inside(side, cx, cy)
            cut(side, kk, cx[m], cy[m], q[_overlapping(side, q)])

    cut((0, 0, grid.nx - 1, grid.ny - 1), len(workers), cx, cy, q)
    parts = [
        Partition(id=f"p{i}", x0=r[0], y0=r[1], x1=r[2], y1=r[3], worker=w)
        for i, (r, w) in enumerate(zip(leaves, workers, strict=True))
    ]
    plan = Plan(version=version, grid=grid, partitions=parts)
    plan.validate()
    return plan


def sample_costs(plan: Plan, obj_cx: npt.ArrayLike, obj_cy: npt.ArrayLike,
                 query_rects: npt.ArrayLike) -> F64:
    """Each partition's cost numerator N·Q·R over a sample (one round, as `history_plan` sees
    it), in plan order: to compare partitionings on the same sample."""
    cx = np.atleast_1d(np.asarray(obj_cx, dtype=np.int64))
    cy = np.atleast_1d(np.asarray(obj_cy, dtype=np.int64))
    q = np.asarray(query_rects, dtype=np.int64).reshape(-1, 4)
    out = np.zeros(len(plan.partitions))
    for i, p in enumerate(plan.partitions):
        rect = (p.x0, p.y0, p.x1, p.y1)
        m = _inside(rect, cx, cy)
        s = _region_stats(rect, cx[m], cy[m], q[_overlapping(rect, q)])
        out[i] = float(np.prod(s.totals()))
    return out


def sample_cells(grid: Grid, records: Iterable[dict[str, Any]]) -> tuple[I64, I64, I64]:
    """(obj_cx, obj_cy, query_rects) for `history_plan` from sample records: objects
    `{"lon", "lat", ...}` and subscriptions `{"bbox": [min_lon, min_lat, max_lon, max_lat]}` or
    `{"circle": {"lon", "lat", "radius_m"}}` (API-shaped specs work as they are). Records with
    neither a position nor a region (keyword or kNN subscriptions) are skipped: they load every
    worker alike."""
    lon: list[float] = []
    lat: list[float] = []
    rects: list[tuple[int, int, int, int]] = []
    for r in records:
        if "bbox" in r:
            b = r["bbox"]
            rects.append(grid.cell_range((float(b[0]), float(b[1]), float(b[2]), float(b[3]))))
        elif "circle" in r:
            c = r["circle"]
            rects.append(grid.cell_range(circle_bbox(float(c["lon"]), float(c["lat"]),
                                                     float(c["radius_m"]))))
        elif "lon" in r and "lat" in r:
            lon.append(float(r["lon"]))
            lat.append(float(r["lat"]))
    cx, cy = grid.cells_of(np.asarray(lon, dtype=np.float64), np.asarray(lat, dtype=np.float64))
    q = np.asarray(rects, dtype=np.int64).reshape(-1, 4)
    return cx.astype(np.int64), cy.astype(np.int64), q
