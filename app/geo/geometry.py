"""Spherical geometry on WGS84 lon/lat degrees: haversine distance and conservative circle bboxes.

Used by the router (SWARM §4.1.1, range routing) and the executor's verification step.
"""

from __future__ import annotations

import math
from typing import Any, overload

import numpy as np
import numpy.typing as npt

EARTH_RADIUS_M = 6371008.8

BBox = tuple[float, float, float, float]
"""(min_lon, min_lat, max_lon, max_lat) in degrees, boundaries inclusive."""

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

WORLD: BBox = (-180.0, -90.0, 180.0, 90.0)

# Relative + absolute padding (degrees) that keeps circle_bbox conservative under rounding.
_PAD_REL = 1e-9
_PAD_ABS = 1e-9


@overload
def haversine_m(lon1: float, lat1: float, lon2: float, lat2: float) -> float: ...


@overload
def haversine_m(
    lon1: FloatArray | float, lat1: FloatArray | float, lon2: FloatArray, lat2: FloatArray | float
) -> FloatArray: ...


@overload
def haversine_m(
    lon1: FloatArray, lat1: FloatArray | float, lon2: FloatArray | float, lat2: FloatArray | float
) -> FloatArray: ...


def haversine_m(lon1: Any, lat1: Any, lon2: Any, lat2: Any) -> Any:
    """Great-circle distance in metres; broadcasts over numpy arrays.

    Always evaluated with numpy ufuncs (also for scalars) so the vectorised matcher and the
    scalar test oracle agree to the last bit at the radius boundary.
    """
    scalar = all(type(v) is float or np.ndim(v) == 0 for v in (lon1, lat1, lon2, lat2))
    phi1 = np.radians(np.asarray(lat1, dtype=np.float64))
    phi2 = np.radians(np.asarray(lat2, dtype=np.float64))
    dphi = phi2 - phi1
    dlmb = np.radians(np.asarray(lon2, dtype=np.float64) - np.asarray(lon1, dtype=np.float64))
    # Squares as products: numpy computes `x ** 2` of a 0-d array with pow(), one ulp off the
    # product it computes for arrays; a point on a circle's border was then inside by the
    # oracle's scalar call and outside by the matcher's array call (or the other way round).
    s1, s2 = np.sin(dphi * 0.5), np.sin(dlmb * 0.5)
    a = s1 * s1 + np.cos(phi1) * np.cos(phi2) * (s2 * s2)
    d = 2.0 * EARTH_RADIUS_M * np.arcsin(np.sqrt(np.minimum(a, 1.0)))
    if scalar:
        return float(d)
    return d


def circle_bbox(lon: float, lat: float, radius_m: float) -> BBox:
    """Conservative (min_lon, min_lat, max_lon, max_lat) of a spherical circle, in degrees.

    Clipped to the world; widened to the full longitude range when the circle reaches a pole
    or crosses the antimeridian (callers verify with haversine, so over-covering is harmless).
    """
    if radius_m < 0 or not math.isfinite(radius_m):
        raise ValueError(f"radius_m must be a finite non-negative number, got {radius_m!r}")
    ang = radius_m / EARTH_RADIUS_M
    dlat = math.degrees(ang)
    dlat = dlat * (1 + _PAD_REL) + _PAD_ABS
    min_lat = lat - dlat
    max_lat = lat + dlat
    if min_lat <= -90.0 or max_lat >= 90.0 or ang >= math.pi / 2:
        return (-180.0, max(min_lat, -90.0), 180.0, min(max_lat, 90.0))
    # Exact longitude half-extent of a small circle: asin(sin(r) / cos(lat)).
    s = math.sin(ang) / math.cos(math.radians(lat))
    if s >= 1.0:
        return (-180.0, min_lat, 180.0, max_lat)
    dlon = math.degrees(math.asin(s)) * (1 + _PAD_REL) + _PAD_ABS
    min_lon = lon - dlon
    max_lon = lon + dlon
    if min_lon < -180.0 or max_lon > 180.0:
        return (-180.0, min_lat, 180.0, max_lat)
    return (min_lon, min_lat, max_lon, max_lat)


@overload
def bbox_contains(bbox: BBox, lon: float, lat: float) -> bool: ...


@overload
def bbox_contains(bbox: BBox, lon: FloatArray, lat: FloatArray | float) -> BoolArray: ...


@overload
def bbox_contains(bbox: BBox, lon: FloatArray | float, lat: FloatArray) -> BoolArray: ...


def bbox_contains(bbox: BBox, lon: Any, lat: Any) -> Any:
    """Whether points lie in the bbox, boundaries inclusive; vectorised over numpy arrays."""
    min_lon, min_lat, max_lon, max_lat = bbox
    res = (lon >= min_lon) & (lon <= max_lon) & (lat >= min_lat) & (lat <= max_lat)
    if isinstance(res, np.ndarray):
        return res
    return bool(res)
