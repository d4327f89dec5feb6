"""Grid cell arithmetic: point cells and bbox cell ranges agree on every border."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from app.geo.grid import Grid


def test_world_grid_basics() -> None:
    g = Grid()
    assert (g.nx, g.ny) == (1000, 1000)
    cx, cy = g.cells_of(np.array([-180.0, 180.0, 0.0]), np.array([-90.0, 90.0, 0.0]))
    assert cx.dtype == np.int32
    assert cx.tolist() == [0, 999, 500] and cy.tolist() == [0, 999, 500]
    assert g.cell_id(3, 2) == 2 * 1000 + 3
    assert Grid.from_dict(g.to_dict()) == g


def test_outside_points_clip_to_edges() -> None:
    g = Grid(bounds=(0.0, 0.0, 10.0, 10.0), nx=10, ny=5)
    cx, cy = g.cells_of(np.array([-5.0, 15.0]), np.array([-1.0, 11.0]))
    assert cx.tolist() == [0, 9] and cy.tolist() == [0, 4]
    assert g.cell_range((-50.0, -50.0, 50.0, 50.0)) == (0, 0, 9, 4)


def test_points_on_cell_borders() -> None:
    g = Grid(bounds=(-180.0, -90.0, 180.0, 90.0), nx=360, ny=180)
    lon = np.arange(-180.0, 180.0, 1.0)
    cx, _ = g.cells_of(lon, np.zeros_like(lon))
    # The border point belongs to the cell on its right/top.
    assert cx.tolist() == list(range(360))
    for x in lon[::7]:
        x0, _, x1, _ = g.cell_range((float(x), 0.0, float(x), 0.0))
        assert x0 == x1 == int(g.cells_of(np.array([x]), np.array([0.0]))[0][0])


@given(
    st.lists(st.floats(-200, 200), min_size=2, max_size=2),
    st.lists(st.floats(-100, 100), min_size=2, max_size=2),
    st.floats(0, 1),
    st.floats(0, 1),
    st.sampled_from([(1000, 1000), (7, 3), (360, 180)]),
)
def test_points_in_bbox_fall_in_cell_range(
    xs: list[float], ys: list[float], fx: float, fy: float, shape: tuple[int, int]
) -> None:
    g = Grid(nx=shape[0], ny=shape[1])
    bbox = (min(xs), min(ys), max(xs), max(ys))
    x0, y0, x1, y1 = g.cell_range(bbox)
    # Corners, edges and an interior point of the bbox.
    px = np.array([bbox[0], bbox[2], bbox[0] + fx * (bbox[2] - bbox[0]), bbox[0], bbox[2]])
    py = np.array([bbox[1], bbox[3], bbox[1] + fy * (bbox[3] - bbox[1]), bbox[3], bbox[1]])
    px = np.clip(px, bbox[0], bbox[2])
    py = np.clip(py, bbox[1], bbox[3])
    cx, cy = g.cells_of(px, py)
    assert ((cx >= x0) & (cx <= x1) & (cy >= y0) & (cy <= y1)).all()
    assert (g.cell_ranges(np.array([bbox]))[0] == (x0, y0, x1, y1)).all()


def test_cell_bbox_of_cell() -> None:
    g = Grid(bounds=(0.0, 0.0, 10.0, 10.0), nx=10, ny=10)
    assert g.cell_bbox(2, 3) == (2.0, 3.0, 3.0, 4.0)


@given(st.lists(st.floats(-200, 200), min_size=40, max_size=40))
def test_scalar_cell_range_equals_vectorised(vals: list[float]) -> None:
    g = Grid(bounds=(-180.0, -90.0, 180.0, 90.0), nx=997, ny=991)
    b = np.sort(np.array(vals).reshape(10, 2, 2), axis=1).reshape(10, 4)
    b = b[:, [0, 2, 1, 3]]  # (min_lon, min_lat, max_lon, max_lat)
    vec = g.cell_ranges(b)
    for row, want in zip(b.tolist(), vec.tolist(), strict=True):
        assert g.cell_range((row[0], row[1], row[2], row[3])) == tuple(want)


@given(
    st.one_of(st.floats(-200, 200), st.sampled_from([-180.0, 180.0, 0.0, 0.36, -179.64])),
    st.one_of(st.floats(-100, 100), st.sampled_from([-90.0, 90.0, 0.0, 0.18, 45.0])),
    st.sampled_from([(1000, 1000), (7, 3), (360, 180)]),
)
def test_the_cell_of_one_point_is_the_cell_of_the_arrays(lon: float, lat: float,
                                                          shape: tuple[int, int]) -> None:
    """`cell_of_point` (scalar arithmetic) gives the cell `cells_of` and `cell_id` give, on
    borders and outside the bounds too."""
    g = Grid(nx=shape[0], ny=shape[1])
    cx, cy = g.cells_of([lon], [lat])
    assert g.cell_of_point(lon, lat) == int(g.cell_id(int(cx[0]), int(cy[0])))
