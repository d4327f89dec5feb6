"""The vectorised SubscriptionIndex against the brute-force oracle (Tornado §3.2)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from app.geo import matcher
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
    """The same (object, key) pairs, each once, in any order."""
    got = list(zip(a[0].tolist(), a[1].tolist(), strict=True))
    assert sorted(got) == sorted(zip(b[0].tolist(), b[1].tolist(), strict=True))
    assert len(set(got)) == len(got)


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
    # The Bloom filter that large CSRs keep in front of the binary search, on every CSR.
    with mock.patch.object(matcher, "_BLOOM_MIN_KEYS", 1):
        filtered = SubscriptionIndex(GRID)
        filtered.add_many(subs)
    assert all(c.bloom is not None for c in filtered._main if c.ukeys.size)
    assert_same(filtered.match(lon, lat, kws), want)
    # Either way of sorting the textual pairs (`_CODE_SORT`, by the CPU's vector sort).
    for kind in ("quicksort", "stable"):
        with mock.patch.object(matcher, "_CODE_SORT", kind):
            assert_same(idx.match(lon, lat, kws), want)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 60), st.integers(1, 120), st.booleans())
def test_keyword_summary_lets_through_every_object_that_can_match(
        seed: int, n_subs: int, n_obj: int, with_removals: bool) -> None:
    """An object holding no word of the summary matches no subscription (Tornado §4); the
    summary is None exactly when a live subscription needs no keyword."""
    rng = np.random.default_rng(seed)
    subs = [random_sub(rng, k) for k in range(n_subs)]
    idx = SubscriptionIndex(GRID, rebuild_min=8)
    idx.add_many(subs)
    if with_removals:  # dead slots, in the frozen CSRs and in the delta
        for s in subs[::3]:
            idx.remove(s.key)
        subs = [s for s in subs if s.key % 3]
    summary = idx.keyword_summary()
    assert (summary is None) == any(not s.keywords for s in subs)
    if summary is None:
        return
    assert summary <= {w for s in subs for w in s.keywords}
    lon, lat, kws = random_objects(rng, n_obj, subs)
    o, _k = brute_force_match(subs, lon, lat, kws)
    assert all(not summary.isdisjoint(kws[i]) for i in set(o.tolist()))


def test_keyword_summary_takes_the_longest_word_of_a_match_all_subscription() -> None:
    idx = SubscriptionIndex(GRID)
    assert idx.keyword_summary() == frozenset()
    idx.add(Sub(0, "keyword", keywords=("the", "earthquake", "in"), match_all=True))
    idx.add(Sub(1, "bbox", bbox=(0, 0, 1, 1), keywords=("a", "bb"), match_all=False))
    assert idx.keyword_summary() == {"earthquake", "a", "bb"}
    idx.add(Sub(2, "bbox", bbox=(0, 0, 1, 1)))
    assert idx.keyword_summary() is None
    idx.remove(2)
    assert idx.keyword_summary() == {"earthquake", "a", "bb"}


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3000))
def test_bloom_filter_never_drops_a_present_key(seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    keys = (rng.integers(0, 2**31, n, dtype=np.int64) << 32) | rng.integers(0, 64, n)
    keys[n // 3 :: 7] = keys[0]  # one key with a longer list
    with mock.patch.object(matcher, "_BLOOM_MIN_KEYS", 1):
        csr = matcher._Csr(keys, np.arange(n, dtype=np.int32))
    assert csr.bloom is not None
    probes = np.concatenate((keys, keys[: n // 2] ^ 1, keys[: n // 4] + (1 << 32)))
    objs, slots = csr.lookup(probes, np.arange(probes.size, dtype=np.int64))
    got = sorted(zip(objs.tolist(), slots.tolist(), strict=True))
    by_key: dict[int, list[int]] = {}
    for j, k in enumerate(keys.tolist()):
        by_key.setdefault(k, []).append(j)
    want = sorted((i, j) for i, p in enumerate(probes.tolist()) for j in by_key.get(p, []))
    assert got == want


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
    assert sorted(zip(o.tolist(), k.tolist(), strict=True)) == [
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


@settings(max_examples=60, deadline=None)
@given(
    st.floats(-179.0, 179.0), st.floats(-85.0, 85.0),
    st.sampled_from([0.001, 0.5, 30.0, 5_000.0, 250_000.0, 9_000_000.0]),
    st.integers(0, 2**32 - 1),
)
# found by a CI run: haversine_m of one point differed in its last bit between the oracle's
# scalar call and the matcher's array call (`x ** 2` of a 0-d array goes through pow())
@example(6.516475612127948, -15.161250750076803, 9_000_000.0, 2527261143)
@example(118.97465181970722, 0.20265588276924973, 9_000_000.0, 12878300)
def test_points_on_a_circle_border_decided_as_the_oracle(
    lon: float, lat: float, radius: float, seed: int
) -> None:
    """The chord test agrees with haversine_m for points a hair inside, on and outside."""
    rng = np.random.default_rng(seed)
    scale = np.repeat([1 - 1e-6, 1 - 1e-9, 1 - 1e-13, 1.0, 1 + 1e-13, 1 + 1e-9, 1 + 1e-6], 8)
    bearing = rng.uniform(0, 2 * np.pi, scale.size)
    delta = radius * scale / 6_371_008.8
    phi1, lmb1 = np.radians(lat), np.radians(lon)
    phi2 = np.arcsin(np.sin(phi1) * np.cos(delta) + np.cos(phi1) * np.sin(delta) * np.cos(bearing))
    lmb2 = lmb1 + np.arctan2(np.sin(bearing) * np.sin(delta) * np.cos(phi1),
                             np.cos(delta) - np.sin(phi1) * np.sin(phi2))
    plon, plat = (np.degrees(lmb2) + 180.0) % 360.0 - 180.0, np.degrees(phi2)  # as the API
    subs = [Sub(0, "circle", circle=(lon, lat, radius)), Sub(1, "circle", circle=(lon, lat, 0.0))]
    grid = Grid()
    idx = SubscriptionIndex(grid)
    idx.add_many(subs)
    kws: list[list[str]] = [[] for _ in range(scale.size + 1)]
    plon, plat = np.append(plon, lon), np.append(plat, lat)
    assert_same(idx.match(plon, plat, kws), brute_force_match(subs, plon, plat, kws))
