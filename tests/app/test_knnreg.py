"""The first radius of a kNN registration (app.pipeline.knnreg.CountGrid, AQWA §5): the
cells entirely within it hold at least k records by the counts, and it is no larger than the
radius the scan over every cell gives (the nearby cells tried first change nothing)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from app.geo.geometry import haversine_m
from app.geo.grid import Grid
from app.pipeline.knnreg import CountGrid

GRID = Grid(nx=360, ny=180)


def farthest(grid: Grid, cid: int, lon: float, lat: float) -> float:
    x0 = grid.bounds[0] + (cid % grid.nx) * grid.cell_width
    y0 = grid.bounds[1] + (cid // grid.nx) * grid.cell_height
    return max(float(haversine_m(lon, lat, x0 + dx * grid.cell_width,
                                 y0 + dy * grid.cell_height))
               for dx in (0.0, 1.0) for dy in (0.0, 0.5, 1.0))


@settings(max_examples=200, deadline=None)
@given(cells=st.dictionaries(st.integers(0, GRID.n_cells - 1), st.integers(1, 20),
                             min_size=1, max_size=60),
       near=st.lists(st.tuples(st.floats(-3, 3), st.floats(-3, 3), st.integers(1, 9)),
                     max_size=20),
       lon=st.floats(-170, 170), lat=st.floats(-80, 80), k=st.integers(1, 40))
def test_first_radius_holds_k(cells: dict[int, int], near: list[tuple[float, float, int]],
                              lon: float, lat: float, k: int) -> None:
    counts = dict(cells)
    for dx, dy, n in near:  # some cells around the point, so the nearby pass matters
        cx, cy = GRID.cells_of([lon + dx], [lat + dy])
        c = int(cy[0]) * GRID.nx + int(cx[0])
        counts[c] = counts.get(c, 0) + n
    r = CountGrid(GRID, counts).radius(lon, lat, k)
    if sum(counts.values()) < k:
        assert r == math.inf
        return
    far = {c: farthest(GRID, c, lon, lat) for c in counts}
    order = sorted(counts, key=lambda c: far[c])
    total, best = 0, math.inf
    for c in order:
        total += counts[c]
        if total >= k:
            best = far[c] * 1.05 + 1.0
            break
    assert r == (best if best < 2.1e7 else math.inf)
    if math.isfinite(r):
        assert sum(n for c, n in counts.items() if far[c] <= r) >= k


def test_no_counts_is_unbounded() -> None:
    assert CountGrid(GRID, {}).radius(0.0, 0.0, 1) == math.inf
    assert np.isinf(CountGrid(GRID, {5: 2}).radius(0.0, 0.0, 3))
