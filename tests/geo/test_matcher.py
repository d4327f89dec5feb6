"""The vectorised SubscriptionIndex against the brute-force oracle (Tornado §3.2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.geo.grid import Grid
from app.geo.matcher import (
    Sub,
    SubscriptionIndex,
    brute_force_match,
    numpy_brute_force_match,
)

VOCAB = ["a", "b", "c", "d", "e", "f"]
GRID = Grid(bounds=(0.0, 0.0, 10.0, 10.0), nx=20, ny=20)  # cells of 0.5 degrees


def random_sub(rng: np.random.Generator, key: int) -> Sub:
    kind = str(rng.choice(["bbox", "circle", "keyword"], p=[0.5, 0.3, 0.2]))
    lo = 1 if kind == "keyword" else 0
    kws = tuple(str(w) for w in rng.choice(VOCAB, size=int(rng.integers(lo, 4))))
    match_all = bool(rng.integers(2))
    if kind == "bbox":
        # Snap to the half-degree lattice so edges sit exactly on cell borders and on objects.
        x, y = np.round(rng.uniform(-1, 11, 2) * 4) / 4
        w, h = np.round(rng.uniform(0, 4, 2) * 4) / 4
        if rng.random() < 0.05:
            w, h = 12.0, 12.0  # large: exercises the coarse / global levels
        return Sub(key, "bbox", bbox=(x, y, x + w, y + h), keywords=kws, match_all=match_all)
    if kind == "circle":
        lon, lat = rng.uniform(-1, 11, 2)
        r = float(rng.choice([0.0, rng.uniform(0, 150_000), rng.uniform(0, 3_000_000)]))
        return Sub(key, "circle", circle=(lon, lat, r), keywords=kws, match_all=match_all)
    return Sub(key, "keyword", keywords=kws, match_all=match_all)


def random_objects(
    rng: np.random.Generator, n: int, subs: list[Sub]
) -> tuple[np.ndarray, np.ndarray, list[list[str]]]:
    lon = rng.uniform(-1.5, 11.5, n)
    lat = rng.uniform(-1.5, 11.5, n)
    # A third on the quarter-degree lattice: on cell borders and bbox edges.
    snap = rng.random(n) < 0.33
    lon[snap] = np.round(lon[snap] * 4) / 4
    lat[snap] = np.round(lat[snap] * 4) / 4
    # Some exactly on circle centres.
    circles = [s.circle for s in subs if s.circle is not None]
    for i in range(0, n, 17):
        if circles:
            c = circles[i % len(circles)]
            lon[i], lat[i] = c[0], c[1]
    kws = [
        [str(w) for w in rng.choice(VOCAB + ["zz"], size=int(rng.integers(0, 5)))]
        for _ in range(n)
    ]  # duplicates and empty lists on purpose
    return lon, lat, kws


def assert_same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> None:
    assert a[0].tolist() == b[0].tolist()
    assert a[1].tolist() == b[1].tolist()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 120), st.integers(0, 120))
def test_match_equals_brute_force(seed: int, n_subs: int, n_obj: int) -> None:
    rng = np.random.default_rng(seed)
    subs = [random_sub(rng, k) for k in range(n_subs)]
    idx = SubscriptionIndex(GRID)
    for s in subs:
        idx.add(s)
    lon, lat, kws = random_objects(rng, n_obj, subs)
    want = brute_force_match(subs, lon, lat, kws)
    assert_same(idx.match(lon, lat, kws), want)
    assert_same(numpy_brute_force_match(subs, lon, lat, kws), want)
    got_o, got_k = idx.match(lon, lat, kws)
    codes = list(zip(got_o.tolist(), got_k.tolist(), strict=True))
    assert codes == sorted(set(codes))


@pytest.mark.parametrize("seed", range(6))
def test_interleaved_add_remove_and_rebuilds(seed: int) -> None:
    rng = np.random.default_rng(seed)
    idx = SubscriptionIndex(GRID, rebuild_min=20, rebuild_fraction=0.1)
    live: dict[int, Sub] = {}
    next_key = 0
    for step in range(30):
        for _ in range(int(rng.integers(0, 25))):
            if live and rng.random() < 0.1:
                key = int(rng.choice(list(live)))  # replace an existing key
            else:
                key, next_key = next_key, next_key + 1
            live[key] = random_sub(rng, key)
            idx.add(live[key])
        for _ in range(int(rng.integers(0, 15))):
            if live:
                key = int(rng.choice(list(live)))
                assert idx.remove(key)
                del live[key]
        assert not idx.remove(10**6)
        assert len(idx) == len(live)
        lon, lat, kws = random_objects(rng, 60, list(live.values()))
        assert_same(idx.match(lon, lat, kws), brute_force_match(live.values(), lon, lat, kws))
        if step == 15:
            idx.rebuild()
    assert idx.rebuilds > 2
    assert idx.memory_bytes() > 0


def test_add_many_and_spatial_only_on_borders() -> None:
    idx = SubscriptionIndex(GRID)
    subs = [
        Sub(0, "bbox", bbox=(1.0, 1.0, 2.0, 2.0)),
        Sub(1, "bbox", bbox=(1.0, 1.0, 1.0, 1.0), keywords=("x",)),
        Sub(2, "keyword", keywords=("x", "y"), match_all=True),
        Sub(3, "circle", circle=(5.0, 5.0, 0.0)),
    ]
    idx.add_many(subs)
    lon = np.array([1.0, 2.0, 2.0000001, 1.0, 5.0])
    lat = np.array([1.0, 2.0, 2.0, 1.0, 5.0])
    kws = [["x", "x"], ["y", "x"], [], ["y"], []]
    o, k = idx.match(lon, lat, kws)
    assert list(zip(o.tolist(), k.tolist(), strict=True)) == [
        (0, 0), (0, 1), (1, 0), (1, 2), (3, 0), (4, 3)
    ]


def test_empty_batches_and_bad_subs() -> None:
    idx = SubscriptionIndex(GRID)
    o, k = idx.match(np.empty(0), np.empty(0), [])
    assert o.size == 0 and k.size == 0
    with pytest.raises(ValueError):
        Sub(1, "keyword", keywords=())
    with pytest.raises(ValueError):
        Sub(1, "bbox", bbox=(2.0, 0.0, 1.0, 1.0))
    with pytest.raises(ValueError):
        Sub(-1, "bbox", bbox=(0.0, 0.0, 1.0, 1.0))
