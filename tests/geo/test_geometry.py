"""Haversine, circle bboxes and bbox containment."""

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from app.geo.geometry import EARTH_RADIUS_M, bbox_contains, circle_bbox, haversine_m


def test_haversine_known_values() -> None:
    assert haversine_m(0.0, 0.0, 0.0, 0.0) == 0.0
    quarter = haversine_m(0.0, 0.0, 90.0, 0.0)
    assert math.isclose(quarter, math.pi / 2 * EARTH_RADIUS_M, rel_tol=1e-12)
    paris_london = haversine_m(2.3522, 48.8566, -0.1276, 51.5072)
    assert 343_000 < paris_london < 345_000


def test_haversine_broadcasts() -> None:
    lon = np.array([0.0, 1.0, 2.0])
    d = haversine_m(0.0, 0.0, lon, np.zeros(3))
    assert d.shape == (3,)
    assert d[0] == 0.0 and d[1] < d[2]


def test_bbox_contains_inclusive() -> None:
    b = (0.0, 0.0, 1.0, 1.0)
    assert bbox_contains(b, 0.0, 1.0)
    assert not bbox_contains(b, 1.0000001, 0.5)
    m = bbox_contains(b, np.array([0.0, 1.0, 2.0]), np.array([0.0, 1.0, 0.5]))
    assert m.tolist() == [True, True, False]


def test_circle_bbox_wide_cases() -> None:
    assert circle_bbox(179.9, 0.0, 50_000)[0::2] == (-180.0, 180.0)
    b = circle_bbox(0.0, 89.9, 50_000)
    assert b[0] == -180.0 and b[2] == 180.0 and b[3] == 90.0


@given(
    st.floats(-180, 180),
    st.floats(-89, 89),
    st.floats(0, 2_000_000),
    st.floats(0, 2 * math.pi),
    st.floats(0, 1),
)
def test_circle_bbox_is_conservative(
    lon: float, lat: float, r: float, bearing: float, frac: float
) -> None:
    # A point at distance frac * r along a bearing (spherical destination formula).
    d = r * frac / EARTH_RADIUS_M
    p1, l1 = math.radians(lat), math.radians(lon)
    p2 = math.asin(math.sin(p1) * math.cos(d) + math.cos(p1) * math.sin(d) * math.cos(bearing))
    l2 = l1 + math.atan2(
        math.sin(bearing) * math.sin(d) * math.cos(p1), math.cos(d) - math.sin(p1) * math.sin(p2)
    )
    plon = (math.degrees(l2) + 180.0) % 360.0 - 180.0
    plat = math.degrees(p2)
    if haversine_m(lon, lat, plon, plat) <= r:
        assert bbox_contains(circle_bbox(lon, lat, r), plon, plat)


def test_haversine_of_a_scalar_and_of_an_array_agree_to_the_last_bit() -> None:
    """The matcher decides circles with arrays, the oracle with scalars: a point on a border
    must get the same distance both ways (it did not while squares were `** 2`)."""
    centre = (6.516475612127948, -15.161250750076803)
    point = (-88.7517820442859, -53.491390977501815)
    one = haversine_m(*centre, *point)
    many = haversine_m(np.full(5, centre[0]), np.full(5, centre[1]), np.full(5, point[0]),
                       np.full(5, point[1]))
    assert all(d == one for d in many.tolist()), (one, many)
