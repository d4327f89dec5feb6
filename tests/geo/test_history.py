"""The static grid based on history (SWARM §6 baseline): a valid tiling, one partition per
worker, costs balanced on the sample."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from app.geo.balance import best_split
from app.geo.grid import Grid
from app.geo.history import _region_stats, history_plan, sample_costs
from app.geo.index import initial_plan


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_valid_tiling_for_random_samples(data: st.DataObject) -> None:
    nx = data.draw(st.integers(1, 30), label="nx")
    ny = data.draw(st.integers(1, 30), label="ny")
    k = data.draw(st.integers(1, min(nx * ny, 13)), label="workers")
    n_obj = data.draw(st.integers(0, 300), label="objects")
    n_q = data.draw(st.integers(0, 60), label="queries")
    seed = data.draw(st.integers(0, 2**31), label="seed")
    rng = np.random.default_rng(seed)
    # Skewed samples too: half of the draws pile everything into a random small box.
    if data.draw(st.booleans(), label="skewed"):
        bx, by = int(rng.integers(0, nx)), int(rng.integers(0, ny))
        cx = np.clip(bx + rng.integers(0, 3, n_obj), 0, nx - 1)
        cy = np.clip(by + rng.integers(0, 3, n_obj), 0, ny - 1)
    else:
        cx, cy = rng.integers(0, nx, n_obj), rng.integers(0, ny, n_obj)
    x0, y0 = rng.integers(-2, nx, n_q), rng.integers(-2, ny, n_q)
    rects = np.stack([x0, y0, x0 + rng.integers(0, 6, n_q), y0 + rng.integers(0, 6, n_q)], 1)
    workers = [f"w{i}" for i in range(k)]
    plan = history_plan(Grid(nx=nx, ny=ny), workers, cx, cy, rects, version=3)
    plan.validate()
    assert plan.version == 3
    assert [p.id for p in plan.partitions] == [f"p{i}" for i in range(k)]
    assert [p.worker for p in plan.partitions] == workers


def test_empty_sample_gives_equal_areas() -> None:
    grid = Grid(nx=64, ny=64)
    plan = history_plan(grid, [f"w{i}" for i in range(8)], [], [], np.empty((0, 4)))
    assert {p.area for p in plan.partitions} == {512}
    # Not a power of two: areas as equal as whole cells allow (initial_plan gives 1/2, 1/4, 1/4).
    plan = history_plan(Grid(nx=30, ny=30), ["a", "b", "c"], [], [], np.empty((0, 4)))
    assert sorted(p.area for p in plan.partitions) == [300, 300, 300]


def _corner_sample(rng: np.random.Generator, n: int = 4000) -> tuple[
        np.ndarray, np.ndarray, np.ndarray]:
    """90 % of objects and queries in the south-west 15 % x 15 % corner of a 100 x 100 grid,
    the rest uniform."""
    hot = rng.random(n) < 0.9
    cx = np.where(hot, rng.integers(0, 15, n), rng.integers(0, 100, n))
    cy = np.where(hot, rng.integers(0, 15, n), rng.integers(0, 100, n))
    m = n // 2
    hq = rng.random(m) < 0.9
    qx = np.where(hq, rng.integers(0, 15, m), rng.integers(0, 100, m))
    qy = np.where(hq, rng.integers(0, 15, m), rng.integers(0, 100, m))
    rects = np.stack([qx, qy, qx + 1, qy + 1], 1)
    return cx, cy, rects


def test_corner_hotspot_costs_far_more_equal_than_initial_plan() -> None:
    rng = np.random.default_rng(5)
    cx, cy, rects = _corner_sample(rng)
    grid = Grid(nx=100, ny=100)
    for k in (2, 5, 8, 22):
        workers = [f"w{i}" for i in range(k)]
        hist = sample_costs(history_plan(grid, workers, cx, cy, rects), cx, cy, rects)
        init = sample_costs(initial_plan(grid, workers), cx, cy, rects)
        assert init.sum() > 0 and hist.max() > 0
        # The cheapest partition is within a small factor of the most costly one; on the
        # uniform grid the partitions off the corner cost next to nothing.
        assert hist.min() > 0.25 * hist.max(), (k, hist)
        assert init.min() < 0.001 * init.max(), (k, init)
        # And the bottleneck partition costs a fraction of the uniform grid's bottleneck.
        assert hist.max() < 0.2 * init.max(), (k, hist, init)


def test_two_workers_cut_is_swarms_best_split() -> None:
    """With k = 2 the cut minimises |C(low) - C(high)|: §4.3.2's search with C(mH) = C(p) and
    C(mL) = 0 finds the same minimum."""
    rng = np.random.default_rng(9)
    cx, cy, rects = _corner_sample(rng, 1000)
    grid = Grid(nx=100, ny=100)
    plan = history_plan(grid, ["a", "b"], cx, cy, rects)
    c = sample_costs(plan, cx, cy, rects)
    s = _region_stats((0, 0, 99, 99), cx, cy, rects)
    total = float(np.prod(s.totals()))
    split = best_split(s, total, 0.0, 1.0, require_improvement=False)
    assert split is not None
    assert abs(c[0] - c[1]) == abs(split.cdiff)
