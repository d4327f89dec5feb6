"""A worker's share of a snapshot query (workers/snapshot.py) against brute force, in process:
records on the coarse cells' borders, boxes whose edges pass through records (boundaries are
inclusive), circles and knn points near the poles and the antimeridian, where the cell ranges
and the knn radius grow to the whole world."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.geo.geometry import bbox_contains, haversine_m
from app.geo.grid import Grid
from app.pipeline import wire
from app.pipeline.queries import whole_cells
from workers import records, snapshot
from workers.records import CELL_DEG, RecordWindow
from workers.snapshot import evaluate

NOW = 1_800_000_000.0


MERGED = {"merged": False}


@pytest.fixture(autouse=True, scope="module", params=["cells", "scan", "merged-cells"])
def read_by(request: pytest.FixtureRequest) -> Iterator[None]:
    """Both ways a chunk finds a region's rows: its cell index (here for chunks of any size,
    merged as they are added) and the scan of every row (small chunks, tall regions; here one
    chunk per entry); and chunks merged as the window's maintenance merges them."""
    saved = (records.INDEXED_ROWS, records.MERGED_ON_ADD_ROWS, records.INDEX_AFTER,
             records.QUERY_INDEXES_AFTER)
    records.INDEXED_ROWS = 10**9 if request.param == "scan" else 0
    if request.param == "scan":
        records.MERGED_ON_ADD_ROWS = 0
    else:  # the stack's indexes (cells, keywords) hold every chunk of an older bucket
        records.INDEX_AFTER = records.QUERY_INDEXES_AFTER = 1
    MERGED["merged"] = request.param == "merged-cells"
    yield
    (records.INDEXED_ROWS, records.MERGED_ON_ADD_ROWS, records.INDEX_AFTER,
     records.QUERY_INDEXES_AFTER) = saved
    MERGED["merged"] = False


@pytest.fixture(autouse=True)
def stored_as_added(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch added is stored at once, one chunk each (a worker stores a step's batches
    when something reads them: `test_batches_stored_later_answer_as_stored_at_once`), so
    that these tests read as many chunks as they add batches."""
    monkeypatch.setattr(records, "PENDING_ROWS", 1)


# coordinates on the 0.1° cell borders, beside them, and at the world's edges
coord_lon = st.one_of(st.integers(-1800, 1800).map(lambda i: i * CELL_DEG),
                      st.floats(-180, 180, allow_nan=False),
                      st.sampled_from([-180.0, 180.0, 179.95, -179.95, 0.0]))
coord_lat = st.one_of(st.integers(-900, 900).map(lambda i: i * CELL_DEG),
                      st.floats(-90, 90, allow_nan=False),
                      st.sampled_from([-90.0, 90.0, 89.97, -89.97, 0.0]))
record_st = st.tuples(coord_lon, coord_lat, st.sets(st.sampled_from("abc"), max_size=2))


def window_of(rows: list[tuple[float, float, set[str]]], grid: Grid | None = None
              ) -> RecordWindow:
    w = RecordWindow(3600, 60, grid)
    for a in range(0, len(rows), 7):  # several chunks, of three buckets
        part = rows[a:a + 7]
        n = len(part)
        w.add(wire.ObjectBatch(
            tenant="t", sent_at=NOW + a / 1000,  # arrivals in order
            plan_version=1, ids=[f"o{a + i}" for i in range(n)],
            record_ids=[f"r{a + i}" for i in range(n)], moving=[False] * n,
            lon=[r[0] for r in part], lat=[r[1] for r in part], ts=[NOW] * n,
            keywords=[sorted(r[2]) for r in part], text=[None] * n, props=[None] * n,
            prev=[None] * n, late=[False] * n, exit_only=[False] * n, decide_exit=[False] * n),
            int(NOW // 60) - 2 + min(2, a // 14))
    if MERGED["merged"]:
        w.expire(NOW, -1)
        assert all(len(t.chunks) <= 3 for t in w.tenants.values())  # (one a bucket)
    return w


def ask(w: RecordWindow, q: wire.SnapshotQuery, limit: int = 0) -> wire.QueryReply:
    return evaluate(w.tenants.get("t"), wire.QueryPart(
        reply="x", tenant="t", query=q, as_of=NOW + 1, deadline=NOW + 60, limit=limit), "w0",
        w.grid)


# knn starts at a radius from the density of the point's cell (`first_radius`): coarse and
# fine grids, or none (the fixed first radius)
knn_grid = st.sampled_from([None, Grid(nx=360, ny=180), Grid(), Grid(nx=3600, ny=1800)])


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(record_st, max_size=40), data=st.data())
def test_bbox_and_circle_find_what_brute_force_finds(rows: list[Any], data: Any) -> None:
    w = window_of(rows)
    # edges through records' own coordinates, or anywhere
    lons = sorted(data.draw(st.lists(st.one_of(coord_lon, st.sampled_from(
        [r[0] for r in rows] or [0.0])), min_size=2, max_size=2)))
    lats = sorted(data.draw(st.lists(st.one_of(coord_lat, st.sampled_from(
        [r[1] for r in rows] or [0.0])), min_size=2, max_size=2)))
    bbox = (lons[0], lats[0], lons[1], lats[1])
    got = ask(w, wire.SnapshotQuery(type="count", bbox=bbox)).count
    assert got == sum(bbox[0] <= x <= bbox[2] and bbox[1] <= y <= bbox[3] for x, y, _ in rows)
    c = (data.draw(coord_lon), data.draw(coord_lat),
         data.draw(st.floats(1, 3_000_000, allow_nan=False)))
    got = ask(w, wire.SnapshotQuery(type="count", circle=c)).count
    assert got == sum(haversine_m(c[0], c[1], x, y) <= c[2] for x, y, _ in rows)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(record_st, max_size=40), px=coord_lon, py=coord_lat,
       k=st.integers(1, 6), kw=st.sampled_from([[], ["a"], ["a", "b"]]),
       match_all=st.booleans(), grid=knn_grid, at_once=st.booleans())
def test_knn_finds_the_nearest_anywhere(rows: list[Any], px: float, py: float, k: int,
                                        kw: list[str], match_all: bool, grid: Grid | None,
                                        at_once: bool) -> None:
    """With keywords both ways: the rows that hold them read at once, or by rounds from a
    first radius at their density (`snapshot.KEYWORD_ROWS_AT_ONCE` 0: never at once but
    when none does)."""
    w = window_of(rows, grid)
    with keyword_rows_at_once(1.0 if at_once else 0.0):
        reply = ask(w, wire.SnapshotQuery(type="knn", point=(px, py), k=k, keywords=kw,
                                          match_all=match_all), limit=k)

    ranked = sorted((haversine_m(px, py, x, y), f"o{i}") for i, (x, y, kws) in enumerate(rows)
                    if holds(kw, match_all, kws))
    # The worker computes distances over arrays, whose elements numpy may take through other
    # instructions than a scalar's (an ulp apart): ids agree but where distances tie so.
    dist = {i: d for d, i in ranked}
    got = [(r.id, r.distance_m) for r in reply.records]
    assert len(got) == min(k, len(ranked))
    assert len({i for i, _ in got}) == len(got)
    for (gi, gd), (wd, wi) in zip(got, ranked, strict=False):
        assert math.isclose(gd, wd, rel_tol=1e-12, abs_tol=1e-9), (gi, gd, wi, wd)
        assert gi == wi or math.isclose(dist[gi], wd, rel_tol=1e-12, abs_tol=1e-9)
    assert reply.truncated == (len(ranked) > k)
    assert all(math.isfinite(r.distance_m) for r in reply.records)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(record_st, max_size=40), data=st.data(),
       grid=st.sampled_from([Grid(nx=360, ny=180), Grid(nx=3600, ny=1800), Grid(),
                             Grid(bounds=(-10.0, -5.0, 10.0, 5.0), nx=40, ny=20)]))
def test_whole_cells_from_counts_plus_the_border_is_the_count(rows: list[Any], data: Any,
                                                              grid: Grid) -> None:
    """A count split as the api splits it: the whole cells inside the bbox from the window's
    per-cell counts, the rest by `skip_cells`; both sum to the brute-force count."""
    w = window_of(rows, grid)
    lons = sorted(data.draw(st.lists(st.one_of(coord_lon, st.sampled_from(
        [r[0] for r in rows] or [0.0])), min_size=2, max_size=2)))
    lats = sorted(data.draw(st.lists(st.one_of(coord_lat, st.sampled_from(
        [r[1] for r in rows] or [0.0])), min_size=2, max_size=2)))
    bbox = (lons[0], lats[0], lons[1], lats[1])
    want = sum(bbox[0] <= x <= bbox[2] and bbox[1] <= y <= bbox[3] for x, y, _ in rows)
    cells = whole_cells(grid, bbox)
    if cells is None:
        return
    held = w.tenants["t"].cell_counts if rows else {}
    whole = sum(n for counts in held.values() for c, n in counts.items()
                if cells[0] <= c % grid.nx <= cells[2] and cells[1] <= c // grid.nx <= cells[3])
    border = evaluate(w.tenants.get("t"), wire.QueryPart(
        reply="x", tenant="t", query=wire.SnapshotQuery(type="count", bbox=bbox,
                                                        skip_cells=cells),
        as_of=NOW + 1, deadline=NOW + 60), "w0", grid).count
    assert whole + border == want


@contextlib.contextmanager
def keyword_rows_at_once(factor: float) -> Iterator[None]:
    saved = snapshot.KEYWORD_ROWS_AT_ONCE
    snapshot.KEYWORD_ROWS_AT_ONCE = factor
    try:
        yield
    finally:
        snapshot.KEYWORD_ROWS_AT_ONCE = saved


def holds(kw: list[str], match_all: bool, kws: set[str]) -> bool:
    return not kw or (set(kw) <= kws if match_all else bool(set(kw) & kws))


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(record_st, max_size=40), px=coord_lon, py=coord_lat,
       k=st.integers(1, 6), cap=st.floats(0, 3_000_000, allow_nan=False), grid=knn_grid,
       kw=st.sampled_from([[], ["a"], ["a", "b"]]), match_all=st.booleans(),
       at_once=st.booleans(), latest=st.booleans())
def test_knn_within_a_distance_finds_the_nearest_within_it(
        rows: list[Any], px: float, py: float, k: int, cap: float, grid: Grid | None,
        kw: list[str], match_all: bool, at_once: bool, latest: bool) -> None:
    """The second step of a knn: only records within `max_distance_m`, the nearest first;
    with keywords, both ways (`test_knn_finds_the_nearest_anywhere`), and with `latest`
    (which takes the rows that hold the keywords whole first: here, of events, it leaves
    every one)."""
    w = window_of(rows, grid)
    with keyword_rows_at_once(1.0 if at_once else 0.0):
        reply = ask(w, wire.SnapshotQuery(type="knn", point=(px, py), k=k, max_distance_m=cap,
                                          keywords=kw, match_all=match_all, latest=latest),
                    limit=k)
    ranked = sorted((haversine_m(px, py, x, y), f"o{i}") for i, (x, y, kws) in enumerate(rows)
                    if haversine_m(px, py, x, y) <= cap and holds(kw, match_all, kws))
    assert [(r.id, r.distance_m) for r in reply.records] == [(i, d) for d, i in ranked[:k]]
    assert reply.truncated == (len(ranked) > k)


def test_a_border_count_over_many_records_around_the_hole() -> None:
    """Thousands of records on and beside the border of the whole cells (in chunks that use
    their cell index): the border plus the whole cells is the brute-force count."""
    rng = np.random.default_rng(7)
    grid = Grid(nx=360, ny=180)
    bbox = (-10.05, 20.02, 9.93, 29.98)
    cells = whole_cells(grid, bbox)
    assert cells is not None
    hole = (-9.0, 21.0, 9.0, 29.0)  # the whole cells' rectangle on this 1° grid
    edge_x = rng.choice([hole[0], hole[2], bbox[0], bbox[2]], 3000) + rng.normal(0, 0.08, 3000)
    edge_y = rng.choice([hole[1], hole[3], bbox[1], bbox[3]], 3000) + rng.normal(0, 0.08, 3000)
    lon = np.concatenate([edge_x, rng.uniform(-11, 11, 3000), np.round(edge_x, 1)])
    lat = np.concatenate([rng.uniform(19, 31, 3000), edge_y, np.round(edge_y, 1)])
    rows = [(float(x), float(y), set()) for x, y in zip(lon, lat, strict=True)]
    w = window_of(rows, grid)
    w.expire(NOW, -1)  # merged into one chunk of 9 000 rows
    want = int(((lon >= bbox[0]) & (lon <= bbox[2]) & (lat >= bbox[1]) & (lat <= bbox[3])).sum())
    held = w.tenants["t"].cell_counts
    whole = sum(n for counts in held.values() for c, n in counts.items()
                if cells[0] <= c % grid.nx <= cells[2] and cells[1] <= c // grid.nx <= cells[3])
    border = evaluate(w.tenants.get("t"), wire.QueryPart(
        reply="x", tenant="t", query=wire.SnapshotQuery(type="count", bbox=bbox,
                                                        skip_cells=cells),
        as_of=NOW + 60, deadline=NOW + 60), "w0", grid).count  # (arrivals up to NOW + 9)
    assert whole > 0 and border > 0
    assert whole + border == want


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4, unique=True),
       match_all=st.booleans(), unknown=st.booleans())
def test_a_querys_signature_masks_are_its_terms_bits(ids: list[int], match_all: bool,
                                                     unknown: bool) -> None:
    """`Terms.of` (Python ints) gives the bits `term_bits` gives the rows' signatures (numpy):
    each term's, or all of them or-ed with `match_all`; none when a term is unknown and all
    must be held."""
    vocab = records.Vocabulary(NOW)
    vocab.ids = {f"t{i}": i for i in ids}
    terms = [f"t{i}" for i in ids] + (["nobody"] if unknown else [])
    got = records.Terms.of(terms, match_all, vocab)
    bits = records.term_bits(ids).tolist()
    if match_all and unknown:
        assert got.masks == ()
    elif match_all:
        assert got.masks == (functools.reduce(operator.or_, bits),)
    else:
        assert got.masks == tuple(bits)


@settings(max_examples=200, deadline=None)
@given(keywords=st.lists(st.lists(st.sampled_from(["a", "b", "c", "dd", "é"]), max_size=4),
                         min_size=1, max_size=30),
       known=st.lists(st.sampled_from(["b", "dd", "zz"]), unique=True))
def test_a_chunks_keywords_are_listed_row_by_row_with_ids_in_order_of_first_sight(
        keywords: list[list[str]], known: list[str]) -> None:
    """`Chunk.occurrences`: every keyword of every row (repeats and rows without any too) as
    (id, row) in row order, a term new to the vocabulary given the next id as first seen;
    `term_rows` their distinct pairs by term, then row."""
    vocab = records.Vocabulary(NOW)
    for term in known:
        vocab.id(term)
    n = len(keywords)
    chunk = records.Chunk.of(wire.ObjectBatch(
        tenant="t", sent_at=NOW, plan_version=1, ids=[f"o{i}" for i in range(n)],
        record_ids=[f"r{i}" for i in range(n)], moving=[False] * n, lon=[0.0] * n,
        lat=[0.0] * n, ts=[NOW] * n, keywords=keywords, text=[None] * n, props=[None] * n,
        prev=[None] * n, late=[False] * n, exit_only=[False] * n, decide_exit=[False] * n), 1)
    ids, rows = chunk.occurrences(vocab)
    assert ids.dtype == rows.dtype == np.int32
    assert [(vocab.terms[t], r) for t, r in zip(ids.tolist(), rows.tolist(), strict=True)] == [
        (term, i) for i, kws in enumerate(keywords) for term in kws]
    order = list(known) + [t for t in dict.fromkeys(t for kws in keywords for t in kws)
                           if t not in known]
    assert vocab.terms == order and vocab.ids == {t: i for i, t in enumerate(order)}
    term_ids, term_rows = chunk.term_rows(vocab)
    assert list(zip(term_ids.tolist(), term_rows.tolist(), strict=True)) == sorted(
        {(vocab.ids[term], i) for i, kws in enumerate(keywords) for term in kws})


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 60), min_size=2, max_size=6), seed=st.integers(0, 2**32 - 1))
def test_merged_chunks_equal_one_built_from_the_joined_rows(sizes: list[int], seed: int) -> None:
    """`Chunk.merge` joins the chunks' sorted cells instead of sorting again: the same chunk,
    rows of one cell in row order (a coarse lattice makes many ties). The keywords the chunks
    had listed (`occurrences`, `signature`, `term_rows`) are joined too when every chunk had
    them for one vocabulary, and equal the merged rows' own; otherwise they are listed
    again."""
    rng = np.random.default_rng(seed)
    chunks = []
    vocab = records.Vocabulary(NOW)
    for c, n in enumerate(sizes):
        lon = (np.round(rng.uniform(-1, 1, n), 1)).tolist()
        lat = (np.round(rng.uniform(-1, 1, n), 1)).tolist()
        chunks.append(records.Chunk.of(wire.ObjectBatch(
            tenant="t", sent_at=NOW + c, plan_version=1, ids=[f"o{c}-{i}" for i in range(n)],
            record_ids=[f"r{c}-{i}" for i in range(n)], moving=[bool(i % 2) for i in range(n)],
            lon=lon, lat=lat, ts=[NOW + c] * n,
            # (a row may list a term twice: `term_rows` holds it once)
            keywords=[["abcdef"[int(k)] for k in rng.integers(0, 6, int(rng.integers(4)))]
                      for _ in range(n)], text=[None] * n,
            props=[None] * n, prev=[None] * n, late=[False] * n, exit_only=[False] * n,
            decide_exit=[False] * n), 1))
    listed = seed % 3  # 0: none listed, 1: all (signed), 2: all but the last
    for chunk in chunks[:len(chunks) - (listed == 2)] if listed else []:
        chunk.signature(vocab)
        chunk.term_rows(vocab)
    merged = records.Chunk.merge(chunks)
    built = records.Chunk.build(1, wire.ObjectBatch.concat([c.batch for c in chunks]),
                                np.concatenate([c.at for c in chunks]))
    for name in ("at", "lon", "lat", "ts", "moving", "order", "cells"):
        assert np.array_equal(getattr(merged, name), getattr(built, name)), name
    assert merged.batch.ids == built.batch.ids
    assert (merged.first_at, merged.last_at) == (built.first_at, built.last_at)
    joined = listed == 1 or (listed == 2 and len(chunks) == 1)
    assert (merged._signature is not None) == joined
    assert (merged._term_rows is not None) == joined
    for a, b in zip(merged.term_rows(vocab), built.term_rows(vocab), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    for a, b in zip(merged.occurrences(vocab), built.occurrences(vocab), strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(merged.signature(vocab), built.signature(vocab))
    for terms, match_all in [({"a"}, False), ({"a", "f"}, True), ({"b", "c"}, False)]:
        held = merged.with_keywords(frozenset(terms), match_all, vocab)
        assert held.tolist() == [terms <= set(k) if match_all else bool(terms & set(k))
                                 for k in merged.batch.keywords]
        assert np.array_equal(merged.rows_with(frozenset(terms), match_all, vocab),
                              np.flatnonzero(held))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=120),
       buckets=st.lists(st.integers(0, 2), min_size=1, max_size=120),
       seed=st.integers(0, 2**32 - 1))
def test_chunks_merged_as_added_stay_few_and_keep_every_row(sizes: list[int], buckets: list[int],
                                                             seed: int) -> None:
    """Entries added one by one are merged into a few chunks per bucket (tiers of MERGE_FAN),
    never across buckets, rows in arrival order: the same rows, a query the same answer."""
    rng = np.random.default_rng(seed)
    w = RecordWindow(3600, 60)
    bucket, added = 0, []
    for c, n in enumerate(sizes):
        bucket += buckets[c % len(buckets)]  # buckets only grow, as arrivals do
        lon = np.round(rng.uniform(-1, 1, n), 1).tolist()
        lat = np.round(rng.uniform(-1, 1, n), 1).tolist()
        w.add(wire.ObjectBatch(
            tenant="t", sent_at=NOW + c / 1000, plan_version=1,
            ids=[f"o{c}-{i}" for i in range(n)],
            record_ids=[f"r{c}-{i}" for i in range(n)], moving=[False] * n, lon=lon, lat=lat,
            ts=[NOW] * n, keywords=[["a"]] * n, text=[None] * n, props=[None] * n,
            prev=[None] * n, late=[False] * n, exit_only=[False] * n, decide_exit=[False] * n),
            bucket)
        added += [(bucket, f"o{c}-{i}", x, y)
                  for i, (x, y) in enumerate(zip(lon, lat, strict=True))]
    chunks = list(w.tenants["t"].chunks)
    assert [(c.bucket, i, float(c.lon[j]), float(c.lat[j])) for c in chunks
            for j, i in enumerate(c.batch.ids)] == added
    per_bucket: dict[int, list[int]] = {}
    for c in chunks:
        per_bucket.setdefault(c.bucket, []).append(c.order.size)
        assert np.array_equal(c.cells, np.sort(c.cells))
    if records.MERGED_ON_ADD_ROWS:
        for held in per_bucket.values():
            # at most MERGE_FAN - 1 chunks per tier of MERGE_FAN (entries of up to 300 rows)
            tiers = math.ceil(math.log(max(2, sum(held)), records.MERGE_FAN)) + 1
            assert len(held) <= (records.MERGE_FAN - 1) * tiers, held
    bbox = (-0.5, -0.5, 0.5, 0.5)
    got = ask(w, wire.SnapshotQuery(type="count", bbox=bbox)).count
    assert got == sum(-0.5 <= x <= 0.5 and -0.5 <= y <= 0.5 for _, _, x, y in added)


def test_knn_starts_as_far_as_the_density_of_its_cell_says() -> None:
    """The radius holding FIRST_EXPECTED x k records at the cell's density: 2 000 records in a
    cell of about 26 x 20 km put 40 within 1.8 km; one in 39 x 20 km, 40 within 100 km; an empty
    cell, or no counts: the fixed first radius."""
    from workers.snapshot import FIRST_RADIUS_M, first_radius

    grid = Grid()
    rng = np.random.default_rng(3)
    dense = [(float(x), float(y), set()) for x, y in zip(rng.normal(2.35, 0.01, 2000),
                                                         rng.normal(48.85, 0.01, 2000),
                                                         strict=True)]
    w = window_of(dense + [(100.0, 10.0, set())], grid)
    records_ = w.tenants["t"]
    dense_r = first_radius(records_, grid, 2.35, 48.85, 10)
    sparse_r = first_radius(records_, grid, 100.0, 10.0, 10)
    assert 1_700 < dense_r < 2_000
    assert 95_000 < sparse_r < 105_000
    assert first_radius(records_, grid, -40.0, -40.0, 10) == FIRST_RADIUS_M  # nothing there
    assert first_radius(records_, None, 2.35, 48.85, 10) == FIRST_RADIUS_M


# records for the newest-first lists: a few timestamps (ties), moving objects of a few ids
# (their records superseded by later ones) and events of their own ids
listed_st = st.tuples(coord_lon, coord_lat, st.sets(st.sampled_from("abc"), max_size=2),
                      st.integers(0, 3), st.one_of(st.none(), st.integers(0, 4)))


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(listed_st, max_size=60), data=st.data(), limit=st.integers(0, 5),
       kw=st.sampled_from([[], ["a"], ["a", "b"]]), match_all=st.booleans(),
       latest=st.booleans(), few=st.sampled_from([1, 64]))
def test_range_and_keyword_lists_are_the_newest_first(rows: list[Any], data: Any, limit: int,
                                                      kw: list[str], match_all: bool,
                                                      latest: bool, few: int) -> None:
    """range and keyword answers: the `limit` newest records satisfying the query, ordered as
    the aggregator merges them (newest first, then id, then latest arrival first), with
    `truncated` when more matched. Rows are read newest first from a partial sort (`few`:
    how many it sorts first, so that small windows also read past them)."""
    w = RecordWindow(3600, 60)
    for a in range(0, len(rows), 7):  # several chunks of three buckets, arrivals in order
        part = rows[a:a + 7]
        n = len(part)
        w.add(wire.ObjectBatch(
            tenant="t", sent_at=NOW + a / 1000, plan_version=1,
            ids=[f"o{a + i}" if r[4] is None else f"m{r[4]}" for i, r in enumerate(part)],
            record_ids=[f"r{a + i}" for i in range(n)], moving=[r[4] is not None for r in part],
            lon=[r[0] for r in part], lat=[r[1] for r in part], ts=[NOW - r[3] for r in part],
            keywords=[sorted(r[2]) for r in part], text=[None] * n, props=[None] * n,
            prev=[None] * n, late=[False] * n, exit_only=[False] * n, decide_exit=[False] * n),
            int(NOW // 60) - 2 + min(2, a // 14))
    # each moving object's latest record: the greatest (ts, arrival), the later row of ties
    last: dict[str, int] = {}
    for j, r in enumerate(rows):
        if r[4] is not None:
            at = NOW + (j - j % 7) / 1000
            prev = last.get(f"m{r[4]}")
            if prev is None or (NOW - r[3], at) >= (NOW - rows[prev][3],
                                                     NOW + (prev - prev % 7) / 1000):
                last[f"m{r[4]}"] = j
    region = data.draw(st.sampled_from(["keyword", "bbox"]))
    lons = sorted(data.draw(st.lists(coord_lon, min_size=2, max_size=2)))
    lats = sorted(data.draw(st.lists(coord_lat, min_size=2, max_size=2)))
    bbox = (lons[0], lats[0], lons[1], lats[1]) if region == "bbox" else None
    if bbox is None and not kw:
        kw = ["a"]

    def wanted(j: int, r: Any) -> bool:
        x, y, kws, _, moving = r
        return ((bbox is None or (bbox[0] <= x <= bbox[2] and bbox[1] <= y <= bbox[3]))
                and (not kw or (set(kw) <= kws if match_all else bool(set(kw) & kws)))
                and not (latest and moving is not None and last[f"m{moving}"] != j))

    ranked = sorted((-(NOW - r[3]), f"o{j}" if r[4] is None else f"m{r[4]}",
                     -(NOW + (j - j % 7) / 1000)) for j, r in enumerate(rows) if wanted(j, r))
    q = wire.SnapshotQuery(type="range" if bbox is not None else "keyword", bbox=bbox,
                           keywords=kw, match_all=match_all, latest=latest)
    saved = snapshot.FIRST_FEW
    snapshot.FIRST_FEW = few
    try:
        reply = ask(w, q, limit=limit)
    finally:
        snapshot.FIRST_FEW = saved
    assert [(-r.ts, r.id, -r.at) for r in reply.records] == (ranked[:limit] if limit
                                                              else ranked)
    assert reply.truncated == (bool(limit) and len(ranked) > limit)
    # count and topk_terms: the records counted, and their keywords; with `latest` the
    # moving objects' latest records are listed for the api's check instead
    chosen = [(j, r) for j, r in enumerate(rows) if wanted(j, r)]
    listed = sorted(f"m{r[4]}" for _, r in chosen if latest and r[4] is not None)
    counted = [r for _, r in chosen if not (latest and r[4] is not None)]
    for kind in ("count", "topk_terms"):
        got = ask(w, msgspec.structs.replace(q, type=kind, k=3))
        assert got.count == len(counted)
        assert sorted(r.id for r in got.records) == listed
        if kind == "topk_terms":
            assert got.terms == dict(Counter(t for r in counted for t in sorted(r[2])))


def test_a_large_old_vocabulary_is_renewed_and_terms_still_count() -> None:
    """A tenant's vocabulary past VOCAB_RENEW_TERMS and older than the window is made anew
    at the maintenance (the terms of records gone go with it); the chunks left list their
    keywords again, and the terms and keyword predicates still count right."""
    rows = [(0.5 + i / 1000, 0.5, {"abc"[i % 3], f"w{i}"}) for i in range(50)]
    w = window_of(rows)
    box = (0.0, 0.0, 1.0, 1.0)
    want = dict(Counter(t for r in rows for t in r[2]))
    q = wire.SnapshotQuery(type="topk_terms", bbox=box, k=3)
    assert ask(w, q).terms == want
    old = w.tenants["t"].vocab
    old.since = NOW  # made now (the tests' clock)
    saved = records.VOCAB_RENEW_TERMS
    records.VOCAB_RENEW_TERMS = 10
    try:
        w.expire(NOW + 10, -1)  # younger than the window: kept
        assert w.tenants["t"].vocab is old
        old.since = NOW - 7200
        w.expire(NOW + 10, -1)
    finally:
        records.VOCAB_RENEW_TERMS = saved
    assert w.tenants["t"].vocab is not old and not w.tenants["t"].vocab.terms
    assert ask(w, q).terms == want
    listed = ask(w, wire.SnapshotQuery(type="keyword", keywords=["a"]), limit=100)
    assert sorted(r.id for r in listed.records) == sorted(f"o{i}" for i in range(0, 50, 3))


@pytest.mark.parametrize("index_after", [1, records.INDEX_AFTER, 10**9])
def test_the_stack_reads_what_each_chunk_reads_as_the_window_changes(
        index_after: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`TenantRecords.read` (one search of the stack's cell-major index and of each chunk past
    it, or for a tall region one test of its rows, or its cell runs when those need fewer
    searches) gives, with their columns, every row of each chunk inside the region that
    arrived by `as_of`, and no row outside its cells; with keywords, every such row that holds
    them, and none whose signature cannot; as the window changes under it: entries added (the
    stack grows at its end), the newest chunks merged as they come (some of them stacked: it
    is cut back), a query's `as_of` before the last arrivals, the oldest bucket expired, the
    window compacted (and compacted again, with nothing left to merge), the vocabulary
    renewed, a query's view without the older buckets, chunks of an older bucket brought into
    the cell-major index and the keywords' index (as soon as one is settled, as configured, or
    never) and merged again by a compaction (the indexes are cut back to the chunks before
    them), the keywords' index made again under a renewed vocabulary, the oldest buckets
    dropped from the window (their rows left in the stack, left out of reads, until they are
    the most)."""
    monkeypatch.setattr(records, "INDEX_AFTER", index_after)
    rng = np.random.default_rng(5)
    w = RecordWindow(3600, 60)
    regions = [records.Region.of((x, y, x + dx, y + dy))
               for x, y, dx, dy in [(2.0, 48.5, 0.6, 0.5), (2.3, 48.8, 0.05, 0.05),
                                    (-1.0, 47.0, 5.0, 1.0), (2.0, 48.5, 0.0, 0.0),
                                    (1.0, 40.0, 3.0, 15.0), (2.05, 48.75, 0.5, 1.75)]]
    assert regions[-1].bounds is None and regions[-2].bounds is None  # (too tall for runs)
    vocabulary = [f"t{i}" for i in range(300)]
    askings = [None, (frozenset({"t1"}), False), (frozenset({"t2", "t299"}), False),
               (frozenset({"t1", "t2"}), False),
               (frozenset({"t1", "t7"}), True), (frozenset({"t1", "unknown"}), True),
               (frozenset({"unknown"}), False)]
    added = [0]

    def add(entries: int, bucket: int, size: int | None = None) -> None:
        for _ in range(entries):
            n = size or int(rng.integers(1, 3)) * 50
            a = added[0]
            added[0] += n
            w.add(wire.ObjectBatch(
                tenant="t", sent_at=NOW + a / 1000, plan_version=1,
                ids=[f"o{a + i}" for i in range(n)], record_ids=[f"r{a + i}" for i in range(n)],
                moving=[False] * n, lon=rng.normal(2.35, 0.3, n).tolist(),
                lat=rng.normal(48.85, 0.3, n).tolist(), ts=[NOW] * n,
                keywords=[sorted({vocabulary[int(v)] for v in rng.zipf(1.5, int(rng.integers(4)))
                                  if v < len(vocabulary)}) for _ in range(n)],
                text=[None] * n, props=[None] * n, prev=[None] * n, late=[False] * n,
                exit_only=[False] * n, decide_exit=[False] * n), bucket)

    def check(as_of: float = NOW + 3600, floor: int | None = None) -> None:
        t = w.tenants["t"] if floor is None else w.tenants["t"].after(floor)
        for region, asking, per_search in itertools.product(regions, askings, (30, 0)):
            # (a tall region read by its cell runs too: as if searches cost nothing)
            saved, records.ROWS_PER_SEARCH = records.ROWS_PER_SEARCH, per_search
            try:
                got = t.read(region, as_of, asking)
            finally:
                records.ROWS_PER_SEARCH = saved
            terms = None if asking is None else records.Terms.of(*asking, t.vocab)
            read = {id(c): rows for c, rows in got.groups()}
            assert list(read) == [id(c) for c in t.chunks if id(c) in read]  # chunk order
            for c in t.chunks:
                # at least the rows inside the bbox (that hold the keywords), at most those of
                # the region's cells (whose signature may hold them); sorted here
                inside = np.flatnonzero(bbox_contains(region.bbox, c.lon, c.lat))
                cells = c.rows_of_bounds(records.cell_runs(region.bbox))
                least = np.sort(inside[c.at[inside] <= as_of])
                most = np.sort(cells[c.at[cells] <= as_of])
                if asking is not None:
                    assert terms is not None
                    least = least[c.holds(least, *asking, t.vocab)]
                    most = most[terms.may_hold(c.signature(t.vocab)[most])]
                got_rows = np.sort(read.get(id(c), np.empty(0, dtype=np.int64)))
                assert np.isin(least, got_rows).all() and np.isin(got_rows, most).all()
                assert np.unique(got_rows).size == got_rows.size
            if got.pos is not None:  # (read from the stack) the keywords of those rows
                assert t._stack is not None
                assert t._terms_of(t._stack.term_counts(got.pos, t.vocab)) == t.term_counts(
                    list(got.groups()))
            ordered = got.by_chunk()
            pairs = [sorted(zip(f.which.tolist(), f.row.tolist(), strict=True))
                     for f in (got, ordered)]
            assert pairs[0] == pairs[1]
            for name in ("lon", "lat", "ts", "at"):
                column = [getattr(c, name)[rows] for c, rows in got.groups()]
                assert np.array_equal(getattr(ordered, name),
                                      np.concatenate(column) if column else np.empty(0))
        stack = t._stack
        if stack is not None:  # (not a view's)
            # every row of the indexed chunks once in the cell index, under its own cell
            cells = stack.cells
            held = stack.ends[cells.chunks - 1] if cells.chunks else 0
            assert cells.size == held
            by_cell, at_cell = folded(cells)
            assert np.array_equal(np.sort(at_cell), np.arange(held))
            assert np.array_equal(by_cell, stack.keys[at_cell] & records.CELL_MASK)
            terms = stack.terms
            if terms.chunks:  # every (term, row) of the indexed chunks once
                assert stack.terms_vocab is t.vocab
                want = sorted((int(term), int(stack.where[stack.ends[i] - c.order.size + r]))
                              for i, c in enumerate(stack.chunks[:terms.chunks]) if c is not None
                              for term, r in zip(*c.term_rows(t.vocab), strict=True))
                term_ids, positions = (column.tolist() for column in folded(terms))
                assert sorted((term, at) for term, at in zip(term_ids, positions, strict=True)
                              if at >= stack.live_from) == want  # (those of rows dropped: left)

    def folded(index: records.Folded) -> tuple[Any, Any]:
        """A `Folded` index's keys and positions, each run sorted by key, and its runs of
        chunks in order, each smaller than half the one before (merged while not)."""
        ups = [upto for _, _, upto in index.runs]
        assert ups == sorted(set(ups)) and (not ups or ups[-1] == index.chunks)
        sizes = [keys.size for keys, _, _ in index.runs]
        assert all(2 * b < a for a, b in zip(sizes, sizes[1:], strict=False))
        for keys, _, _ in index.runs:
            assert (np.diff(keys) >= 0).all()
        empty = np.empty(0, dtype=np.int64)
        return (np.concatenate([keys for keys, _, _ in index.runs] or [empty]),
                np.concatenate([at for _, at, _ in index.runs] or [empty]))

    add(20, 1)
    check()
    add(3, 1)
    check()
    add(1, 1, 10)
    check()
    stacked = len(w.tenants["t"].chunks)
    add(3, 1, 100)  # merged with the newest stacked chunk as they come: the stack is cut back
    assert w.tenants["t"]._stacked < stacked or not records.MERGED_ON_ADD_ROWS
    check()
    check(as_of=NOW + (added[0] - 120) / 1000)
    add(13, 2)
    check()
    w.tenants["t"].expire(w.horizon(NOW + 60 * 62), 1)  # the first bucket goes
    assert all(c.bucket == 2 for c in w.tenants["t"].chunks)
    check()
    w.tenants["t"].compact()
    check()
    w.tenants["t"].compact()
    check()
    w.tenants["t"].vocab = records.Vocabulary(NOW)  # renewed: other ids, other signatures
    check()
    add(6, 3)
    check()
    check(floor=2)  # a query's view without the older buckets
    assert w.tenants["t"].after(2).chunks
    add(5, 4)
    check()
    stack = w.tenants["t"]._stack
    assert stack is not None
    settled = sum(c.bucket < 4 for c in w.tenants["t"].chunks)
    assert settled > 2
    out = settled - stack.cells.chunks  # (a query indexes them once QUERY_INDEXES_AFTER x as many)
    assert out < index_after * records.QUERY_INDEXES_AFTER or index_after > settled
    before = stack.cells.chunks
    w.index_keywords(float("inf"))
    w.index_chunks()  # between steps: once `index_after` are out (keywords: once listed)
    assert stack.cells.chunks == (settled if out >= index_after else before)
    if index_after == 1:
        assert stack.terms.chunks == settled
    check()
    w.tenants["t"].compact()  # bucket 3's and 4's chunks merged: the index is cut back
    assert sum(c.bucket < 4 for c in w.tenants["t"].chunks) < settled
    check()  # (and brought up to date again)
    assert w.tenants["t"]._stack is stack
    add(1, 5)
    w.index_keywords(float("inf"))
    w.index_chunks()
    check()
    if index_after in (1, 10**9):
        assert stack.cells.chunks == (len(w.tenants["t"].chunks) - 1 if index_after == 1 else 0)
    w.tenants["t"].vocab = records.Vocabulary(NOW)  # renewed: the keywords' index made anew
    check()
    # the oldest buckets leave the window: the stack keeps their rows, left out of reads, until
    # they are more than those left (then it is made anew)
    add(30, 6)
    w.index_keywords(float("inf"))
    w.index_chunks()
    check()
    stack = w.tenants["t"]._stack
    w.tenants["t"].expire(w.horizon(NOW), 2)
    assert w.tenants["t"]._stack is stack and stack is not None and stack.dropped > 0
    check()
    check(floor=4)
    add(2, 6)
    check()
    w.tenants["t"].expire(w.horizon(NOW), 4)
    assert w.tenants["t"]._stack is stack and stack.dropped > 1
    check()
    w.tenants["t"].compact()  # (merges the newest bucket's chunks: cut back past those dropped)
    check()
    w.tenants["t"].expire(w.horizon(NOW), 5)
    assert w.tenants["t"]._stack is stack
    check()
    add(1, 7)
    check()
    w.tenants["t"].expire(w.horizon(NOW), 6)
    assert w.tenants["t"]._stack is None  # (most of its rows were dropped: made anew)
    check()


def test_knn_first_radius_reads_the_newest_buckets_scaled_to_the_window() -> None:
    """With records spread evenly over ten buckets, the count in the newest FIRST_BUCKETS
    scaled by their share of the window gives the radius the count of every bucket gives."""
    from workers.snapshot import FIRST_EXPECTED, first_radius

    grid = Grid()
    rng = np.random.default_rng(9)
    w = RecordWindow(3600, 60, grid)
    for b in range(10):
        n = 500
        w.add(wire.ObjectBatch(
            tenant="t", sent_at=NOW + b, plan_version=1, ids=[f"o{b}-{i}" for i in range(n)],
            record_ids=[f"r{b}-{i}" for i in range(n)], moving=[False] * n,
            lon=rng.normal(2.35, 0.01, n).tolist(), lat=rng.normal(48.85, 0.01, n).tolist(),
            ts=[NOW] * n, keywords=[[]] * n, text=[None] * n, props=[None] * n,
            prev=[None] * n, late=[False] * n, exit_only=[False] * n,
            decide_exit=[False] * n), b)
    t = w.tenants["t"]
    cell = grid.cell_of_point(2.35, 48.85)
    every = sum(c.get(cell, 0) for c in t.cell_counts.values())
    area = (grid.cell_width * math.pi * 6_371_008.8 / 180 * math.cos(math.radians(48.85))
            * grid.cell_height * math.pi * 6_371_008.8 / 180)
    want = math.sqrt(FIRST_EXPECTED * 10 * area / (math.pi * every))
    assert first_radius(t, grid, 2.35, 48.85, 10) == pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("n", [3_000, 40_000])
def test_the_rows_holding_keywords_are_found_exactly_as_the_window_changes(n: int) -> None:
    """`TenantRecords.keyword_positions`, which a knn with keywords reads at once when they
    are few, and whose number scales its first radius otherwise: exactly the rows that hold
    every one of the terms, or any, in the keywords' index and in the chunks after it; none
    for a keyword nobody has, and only the rows left in the window after a bucket left it
    (the stack keeps theirs, dropped, while fewer than those left). None for a view of
    `after` (no stack) or without terms."""
    rng = np.random.default_rng(4)
    w = RecordWindow(3600, 60)
    vocabulary = [f"w{i}" for i in range(200)]
    # w0 on every row, w1 on a tenth, w2 on a hundredth, w9 on the first quarter, the rest
    # spread
    kws = [["w0"] + (["w1"] if i % 10 == 0 else []) + (["w2"] if i % 100 == 0 else [])
           + (["w9"] if i < n // 4 else []) + [vocabulary[j] for j in rng.integers(10, 200, 3)]
           for i in range(n)]
    first = int(NOW // 60) - 3
    for b, a in enumerate(range(0, n, n // 4)):
        part = kws[a:a + n // 4]
        m = len(part)
        w.add(wire.ObjectBatch(
            tenant="t", sent_at=NOW + b, plan_version=1, ids=[f"o{a + i}" for i in range(m)],
            record_ids=[f"r{a + i}" for i in range(m)], moving=[False] * m,
            lon=rng.uniform(-10, 10, m).tolist(), lat=rng.uniform(-10, 10, m).tolist(),
            ts=[NOW] * m, keywords=part, text=[None] * m, props=[None] * m, prev=[None] * m,
            late=[False] * m, exit_only=[False] * m, decide_exit=[False] * m), first + b)
    t = w.tenants["t"]

    def found(terms: set[str], match_all: bool) -> list[str]:
        at = t.keyword_positions(frozenset(terms), match_all)
        assert at is not None
        flat = t.read_at(at, math.inf)
        return sorted(snapshot._ids(flat, np.arange(len(flat))))

    def want(terms: set[str], match_all: bool, since: int = 0) -> list[str]:
        return sorted(f"o{i}" for i, row in enumerate(kws)
                      if i >= since and holds(sorted(terms), match_all, set(row)))

    cases = [({"w0"}, False), ({"w1"}, False), ({"w2"}, False), ({"w1", "w2"}, False),
             ({"w1", "w2"}, True), ({"w9"}, False), ({"w9", "w2"}, True), ({"nobody"}, False),
             ({"w1", "nobody"}, True), ({"w1", "nobody"}, False)]
    for terms, match_all in cases:
        assert found(terms, match_all) == want(terms, match_all), (terms, match_all)
    assert t.keyword_positions(frozenset(), False) is None
    assert t.after(first).keyword_positions(frozenset({"w1"}), False) is None
    # the first bucket leaves the window: its rows are left out
    stack = t._stack
    t.expire(first + 1, first)
    assert t._stack is stack and stack.live_from > 0
    assert found({"w9"}, False) == []
    for terms, match_all in cases:
        assert found(terms, match_all) == want(terms, match_all, n // 4), (terms, match_all)


@settings(max_examples=300, deadline=None)
@given(px=st.floats(-179.9, 179.9), py=st.floats(-89.9, 89.9),
       radius=st.floats(1.0, 3e6), tall=st.booleans())
def test_a_knn_round_reads_every_point_as_far_as_its_reach(px: float, py: float, radius: float,
                                                           tall: bool) -> None:
    """`read_reach_m`: every point within the reach of a round (its radius, stretched to the
    area its region reads) lies in that area, its coarse cells' rectangle (or its bbox without
    cell runs); and the reach is that area's: a little farther, some point lies outside."""
    from app.geo.geometry import EARTH_RADIUS_M, circle_bbox
    from workers.snapshot import read_reach_m

    region = records.Region.of(circle_bbox(px, py, radius))
    if tall:
        region = records.Region(region.bbox, None)
    reach = read_reach_m(region, px, py)
    if reach == 0.0:
        return
    if region.bounds is None:
        west, south, east, north = region.bbox
    else:
        x0, y0, x1, y1 = records.cell_range(region.bbox)
        west, east = x0 * CELL_DEG - 180, (x1 + 1) * CELL_DEG - 180
        south, north = y0 * CELL_DEG - 90, (y1 + 1) * CELL_DEG - 90
    bearing = np.linspace(0, 2 * np.pi, 721)

    def at(d: float) -> tuple[Any, Any]:  # the points at distance d (the direct problem)
        a, p1, l1 = d / EARTH_RADIUS_M, math.radians(py), math.radians(px)
        p2 = np.arcsin(math.sin(p1) * math.cos(a) + math.cos(p1) * math.sin(a) * np.cos(bearing))
        l2 = l1 + np.arctan2(np.sin(bearing) * math.sin(a) * math.cos(p1),
                             math.cos(a) - math.sin(p1) * np.sin(p2))
        return (np.degrees(l2) + 180) % 360 - 180, np.degrees(p2)

    x, y = at(reach)
    assert ((x >= west) & (x <= east) & (y >= south) & (y <= north)).all()
    x, y = at(reach * 1.01 + 1.0)
    assert not ((x >= west) & (x <= east) & (y >= south) & (y <= north)).all()


def test_keywords_are_listed_between_queries_once_a_query_asked_about_them() -> None:
    """`index_keywords` lists nothing for a tenant no query asked about keywords; once one
    did, it lists the keywords of the chunks added since (as far as its deadline lets it), so
    that the next keyword query finds them listed; and it picks up again after merges."""
    w = window_of([(0.1 * i, 0.05 * i, {"abc"[i % 3]}) for i in range(60)])
    t = w.tenants["t"]
    assert t.index_keywords(float("inf"))
    assert all(c._signature is None for c in t.chunks)  # no query asked about keywords
    ask(w, wire.SnapshotQuery(type="keyword", keywords=["a"]), limit=5)
    assert t.keywords_asked
    batch = wire.ObjectBatch(
        tenant="t", sent_at=NOW + 1, plan_version=1, ids=["n0", "n1"], record_ids=["r0", "r1"],
        moving=[False] * 2, lon=[1.0, 2.0], lat=[1.0, 2.0], ts=[NOW] * 2,
        keywords=[["b"], ["zz"]], text=[None] * 2, props=[None] * 2, prev=[None] * 2,
        late=[False] * 2, exit_only=[False] * 2, decide_exit=[False] * 2)
    for _ in range(3):
        w.add(batch, int(NOW // 60))
    assert not t.index_keywords(0.0)  # past its deadline: nothing more is listed
    assert any(c._signature is None for c in t.chunks)
    assert t.index_keywords(float("inf"))
    assert all(c._signature is not None and c._signature[0] is t.vocab for c in t.chunks)
    assert "zz" in t.vocab.ids  # (listed, its term known)
    w.add(batch, int(NOW // 60))  # not listed yet, then merged with listed ones: the merge
    t.compact()                   # is listed anew
    assert len(t.chunks) == 3 and t.chunks[-1]._signature is None  # (a chunk a bucket)
    assert t.index_keywords(float("inf"))
    assert all(c._signature is not None for c in t.chunks)
    listed = ask(w, wire.SnapshotQuery(type="keyword", keywords=["zz"]), limit=10)
    assert [r.id for r in listed.records] == ["n1"] * 4  # (added four times)


@settings(max_examples=100, deadline=None)
@given(runs=st.lists(st.tuples(st.sampled_from(["t", "u"]), st.integers(0, 2),
                               st.lists(record_st, min_size=1, max_size=12)),
                     min_size=1, max_size=25),
       queries=st.lists(st.tuples(coord_lon, coord_lat, coord_lon, coord_lat), min_size=1,
                        max_size=4))
def test_batches_stored_later_answer_as_stored_at_once(
        runs: list[tuple[str, int, list[tuple[float, float, set[str]]]]],
        queries: list[tuple[float, float, float, float]]) -> None:
    """A worker's step adds its batches to the window, stored (consecutive ones of a tenant
    and bucket as one chunk) only when something reads the window: the same records in the
    same order, with their own arrival times, the same counts per cell, and the same answers
    as batches stored as added."""
    grid = Grid(nx=360, ny=180)
    eager, lazy = RecordWindow(3600, 60, grid), RecordWindow(3600, 60, grid)
    records.PENDING_ROWS = 10**9  # (the fixture's 1 for `eager` below, by hand)
    for c, (tenant, dbucket, rows) in enumerate(runs):
        n = len(rows)
        batch = wire.ObjectBatch(
            tenant=tenant, sent_at=NOW + c, plan_version=1, ids=[f"o{c}-{i}" for i in range(n)],
            record_ids=[f"r{c}-{i}" for i in range(n)], moving=[i % 2 == 0 for i in range(n)],
            lon=[r[0] for r in rows], lat=[r[1] for r in rows], ts=[NOW + c] * n,
            keywords=[sorted(r[2]) for r in rows], text=[None] * n, props=[None] * n,
            prev=[None] * n, late=[False] * n, exit_only=[False] * n, decide_exit=[False] * n)
        bucket = int(NOW // 60) - 2 + dbucket
        eager.add(batch, bucket)
        eager.store_pending()
        lazy.add(batch, bucket)
    assert lazy.has_changes() and lazy._pending  # nothing stored yet
    assert lazy.changed == eager.changed
    assert not lazy._pending

    def rows_of(w: RecordWindow) -> dict[str, list[tuple[int, str, float, float]]]:
        return {t: [(ch.bucket, oid, float(ch.at[j]), float(ch.lon[j])) for ch in r.chunks
                    for j, oid in enumerate(ch.batch.ids)] for t, r in w.tenants.items()}

    assert rows_of(lazy) == rows_of(eager)
    for t in eager.tenants:
        assert ({b: c.items() for b, c in lazy.tenants[t].cell_counts.items()}
                == {b: c.items() for b, c in eager.tenants[t].cell_counts.items()})
        assert dict(lazy.tenants[t].by_object) == dict(eager.tenants[t].by_object)
    for x0, y0, x1, y1 in queries:
        bbox = (min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))
        for t in eager.tenants:
            for q in (wire.SnapshotQuery(type="count", bbox=bbox),
                      wire.SnapshotQuery(type="range", bbox=bbox),
                      wire.SnapshotQuery(type="range", bbox=bbox, latest=True)):
                part = wire.QueryPart(reply="x", tenant=t, query=q, as_of=NOW + 100,
                                      deadline=NOW + 160, limit=0)
                got = evaluate(lazy.tenants[t], part, "w0", grid)
                want = evaluate(eager.tenants[t], part, "w0", grid)
                assert msgspec.to_builtins(got) == msgspec.to_builtins(want)


def test_the_maintenance_merges_the_chunks_of_settled_buckets_only() -> None:
    """The maintenance's merge (`settled_only`) leaves a tenant's newest bucket, still
    growing, as it is (its rows are not copied again every 5 s) and merges the older ones;
    both answer as the window merged whole."""
    rows = [(0.1 * (i % 13), 0.1 * (i % 7), {"a"} if i % 2 else set()) for i in range(70)]
    merged, MERGED["merged"] = MERGED["merged"], False  # (each bucket's chunks as added)
    try:
        settled, whole = window_of(rows), window_of(rows)
    finally:
        MERGED["merged"] = merged
    newest = max(c.bucket for c in settled.tenants["t"].chunks)
    before = [c for c in settled.tenants["t"].chunks if c.bucket == newest]
    settled.expire(NOW, -1, settled_only=True)
    whole.expire(NOW, -1)
    chunks = settled.tenants["t"].chunks
    assert [c for c in chunks if c.bucket == newest] == before and len(before) > 1
    assert sum(c.bucket < newest for c in chunks) == len({c.bucket for c in chunks}) - 1
    for q in (wire.SnapshotQuery(type="count", bbox=(0.0, 0.0, 0.6, 0.4)),
              wire.SnapshotQuery(type="range", bbox=(0.0, 0.0, 0.6, 0.4), keywords=["a"])):
        assert msgspec.to_builtins(ask(settled, q)) == msgspec.to_builtins(ask(whole, q))
