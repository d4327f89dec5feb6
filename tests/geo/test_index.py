"""SWARM global index: initial layout (§4.1.1) and Algorithm 1 (query_overlap)."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.geo import balance
from app.geo.grid import Grid
from app.geo.index import GlobalIndex, Partition, Plan, initial_plan, split_rect


@pytest.mark.parametrize("k", range(1, 9))
def test_initial_plan_tiles(k: int) -> None:
    grid = Grid(nx=1000, ny=1000)
    workers = [f"w{i}" for i in range(k)]
    plan = initial_plan(grid, workers)
    plan.validate()
    assert [p.id for p in plan.partitions] == [f"p{i}" for i in range(k)]
    assert sorted(p.worker for p in plan.partitions) == sorted(workers)
    areas = sorted(p.area for p in plan.partitions)
    assert areas[-1] <= 2 * areas[0]  # halving keeps areas within a factor 2
    assert sum(areas) == grid.n_cells


def test_initial_plan_halves_longer_side() -> None:
    plan = initial_plan(Grid(nx=10, ny=4), ["a", "b", "c"])
    rects = [(p.x0, p.y0, p.x1, p.y1) for p in plan.partitions]
    assert rects == [(0, 0, 1, 3), (2, 0, 4, 3), (5, 0, 9, 3)]


def test_plan_json_round_trip_and_validation() -> None:
    plan = initial_plan(Grid(nx=20, ny=10), ["a", "b", "c"], version=7)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()
    plan.partitions[0].x1 += 1
    with pytest.raises(ValueError):
        plan.validate()


def test_point_routing() -> None:
    plan = initial_plan(Grid(), ["a", "b", "c", "d"])
    gi = GlobalIndex(plan)
    lon = np.array([-179.0, 179.0, -179.0, 179.0])
    lat = np.array([-89.0, -89.0, 89.0, 89.0])
    parts = gi.partition_of_points(lon, lat)
    assert len(set(parts.tolist())) == 4
    workers = [gi.workers[i] for i in gi.worker_of_points(lon, lat)]
    assert workers == [plan.partitions[p].worker for p in parts]


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), splits=st.integers(0, 40),
       points=st.lists(st.tuples(
           st.one_of(st.floats(-180, 180), st.sampled_from([-180.0, 180.0, 0.0, 179.99999])),
           st.one_of(st.floats(-90, 90), st.sampled_from([-90.0, 90.0, 0.0, -89.99999]))),
           min_size=1, max_size=30))
def test_one_point_is_routed_as_arrays_route_it(seed: int, splits: int,
                                                points: list[tuple[float, float]]) -> None:
    """`worker_of_point` (a knn's owner, without arrays) agrees with `worker_of_points` on any
    plan, cell borders and the world's edges included."""
    gi = GlobalIndex(random_plan(Grid(nx=37, ny=23), splits, seed))
    lon = np.array([p[0] for p in points])
    lat = np.array([p[1] for p in points])
    want = [gi.workers[i] for i in gi.worker_of_points(lon, lat)]
    assert [gi.worker_of_point(x, y) for x, y in points] == want


def random_plan(grid: Grid, n_splits: int, seed: int) -> Plan:
    """Random recursive splits at random positions (not only halves)."""
    rnd = random.Random(seed)
    rects = [(0, 0, grid.nx - 1, grid.ny - 1)]
    for _ in range(n_splits):
        splittable = [r for r in rects if r[2] > r[0] or r[3] > r[1]]
        if not splittable:
            break
        r = rnd.choice(splittable)
        rects.remove(r)
        x0, y0, x1, y1 = r
        if x1 > x0 and (y1 == y0 or rnd.random() < 0.5):
            m = rnd.randint(x0, x1 - 1)
            rects += [(x0, y0, m, y1), (m + 1, y0, x1, y1)]
        else:
            m = rnd.randint(y0, y1 - 1)
            rects += [(x0, y0, x1, m), (x0, m + 1, x1, y1)]
    rnd.shuffle(rects)
    parts = [
        Partition(f"p{i}", *r, worker=f"w{rnd.randrange(4)}") for i, r in enumerate(rects)
    ]
    return Plan(version=1, grid=grid, partitions=parts)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(0, 60),
    st.tuples(st.integers(-3, 25), st.integers(-3, 25), st.integers(-3, 25), st.integers(-3, 25)),
)
def test_query_overlap_equals_brute_force(
    seed: int, n_splits: int, r: tuple[int, int, int, int]
) -> None:
    grid = Grid(nx=23, ny=19)
    gi = GlobalIndex(random_plan(grid, n_splits, seed))
    x0, x1 = sorted((r[0], r[2]))
    y0, y1 = sorted((r[1], r[3]))
    got = gi.query_overlap(x0, y0, x1, y1)
    assert len(got) == len(set(got))
    cx0, cy0, cx1, cy1 = max(x0, 0), max(y0, 0), min(x1, 22), min(y1, 18)
    want = set() if cx0 > cx1 or cy0 > cy1 else set(
        np.unique(gi.cell_part[cy0 : cy1 + 1, cx0 : cx1 + 1]).tolist()
    )
    assert set(got) == want


def test_partitions_for_bbox_and_circle() -> None:
    gi = GlobalIndex(initial_plan(Grid(), ["a", "b", "c", "d"]))
    assert gi.workers_for_bbox((-180.0, -90.0, 180.0, 90.0)) == {"a", "b", "c", "d"}
    assert len(gi.partitions_for_bbox((10.0, 10.0, 10.1, 10.1))) == 1
    # A circle on the meridian that splits the world's halves touches two partitions.
    assert len(gi.partitions_for_circle(0.0, 45.0, 10_000)) == 2


def test_split_rect_single_cell() -> None:
    with pytest.raises(ValueError):
        split_rect(3, 3, 3, 3)


def test_ownership_changes_with_the_cells_of_a_worker_not_with_their_cutting() -> None:
    """A merge (one worker's cells cut differently) keeps the digest; a move, a split handed
    to another worker, or a renamed owner changes it; the version does not count."""
    grid = Grid(nx=20, ny=20)
    plan = initial_plan(grid, ["w0", "w1"])
    low, high = balance.split_partition(plan.partitions[0], "y", 9, ("p2", "p3"))
    cut = Plan(version=2, grid=grid, partitions=[low, high, plan.partitions[1]],
               members=plan.members)
    assert cut.ownership() == plan.ownership()
    merged = balance.apply_merges(cut, iter(["p4"]), worker="w0")
    assert merged.version > cut.version and merged.ownership() == plan.ownership()
    handed = balance.apply_split(plan, "p0", balance.Split("x", 4, "high", 0.0), "w1",
                                 iter(["p5", "p6"]))
    assert handed.ownership() != plan.ownership()
    moved = balance.apply_move(plan, ["p0"], "w1", iter(["p7"]))
    assert moved.ownership() not in (plan.ownership(), handed.ownership())
    renamed = Plan(version=1, grid=grid, partitions=[
        Partition(id=p.id, x0=p.x0, y0=p.y0, x1=p.x1, y1=p.y1,
                  worker={"w0": "w2"}.get(p.worker, p.worker)) for p in plan.partitions])
    assert renamed.ownership() != plan.ownership()
