"""One worker's share of a snapshot query (SSTD §4: snapshot range-keyword, kNN-keyword and
top-k frequent terms; CheetahGIS's range count): the records of its window that satisfy the
query, chunk by chunk: the rows of the coarse cells the region covers (each chunk keeps its
rows sorted by cell), filtered with numpy by region and time, then by keywords. Pure: the
window and the query in, a `wire.QueryReply` out.

With `latest`, a moving object's record counts only if it is the object's latest record here
within the time range (taken before the region and keyword predicates: a taxi whose latest
record left the box is not in it). Whether it is also the latest of all workers' records is
the aggregator's check (`QueryPart.latest_of`), so those records are always listed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from app.archive.layout import NO_CUT
from app.geo.geometry import EARTH_RADIUS_M, bbox_contains, circle_bbox, haversine_m
from app.geo.grid import Grid
from app.pipeline import wire
from workers.records import (
    CELL_DEG,
    I64,
    Chunk,
    Flat,
    Region,
    TenantRecords,
    cell_range,
    run_bounds,
)


def evaluate(records: TenantRecords | None, part: wire.QueryPart, worker: str,
             grid: Grid | None = None, dropped: int = NO_CUT) -> wire.QueryReply:
    """The reply of this worker to `part` over the records `worker` stored (`grid`: the
    global grid, for `skip_cells`; `dropped`: the last bucket of them that left memory)."""
    q = part.query
    if part.cut is not None:
        after = part.cut.get(worker, NO_CUT)
        if dropped > after:
            # archived records that left memory after the query read the cut: it reads the
            # cut again (`app.pipeline.queries`)
            return wire.QueryReply(worker=worker, error=wire.STALE_CUT)
    else:
        after = NO_CUT if part.first_bucket is None else part.first_bucket - 1
    if records is not None:
        records = records.after(after)
    if q.skip_cells is not None:
        if grid is None:
            raise ValueError("a count that skips cells needs the global grid")
        return wire.QueryReply(worker=worker, count=_count_border(records, part, grid))
    if part.latest_of is not None:
        latest: dict[str, float] = {}
        if records is not None:
            for oid in part.latest_of:
                best = records.latest_ts(oid, q.t_from, q.t_to, part.as_of)
                if best is not None:
                    latest[oid] = best[0]
        return wire.QueryReply(worker=worker, latest=latest)
    if q.type == "knn":
        return _nearest(records, part, worker, grid)
    if q.type == "count" and not q.latest:
        # nothing to check row by row: the rows' numbers
        return wire.QueryReply(worker=worker, count=sum(
            int(rows.size) for _, rows in _wanted_rows(records, part)))
    if q.type in ("range", "keyword"):
        return _newest(records, part, worker)
    if q.type == "topk_terms" and not q.latest and records is not None and (
            q.bbox is not None or q.circle is not None):
        found = _wanted(records, part)
        if found.pos is not None:  # read from the stack: the keywords of those rows alone
            return wire.QueryReply(worker=worker, count=len(found),
                                   terms=records.term_counts_at(found.pos))
    # count and topk_terms: with `latest`, moving objects' records that are the latest here
    # are listed for the api's check, the others counted (and their keywords)
    reply = wire.QueryReply(worker=worker)
    if records is None:
        return reply
    counted: list[tuple[Chunk, Any]] = []
    for chunk, rows in _wanted_rows(records, part):
        if q.latest:
            moving = chunk.moving[rows]
            reply.records += [_found(chunk, i, light=True) for i in rows[moving].tolist()
                              if _accepts(records, part, NO_TERMS, chunk, i)]
            rows = rows[~moving]
        reply.count += int(rows.size)
        counted.append((chunk, rows))
    if q.type == "topk_terms":
        reply.terms = records.term_counts(counted)
    return reply


def _count_border(records: TenantRecords | None, part: wire.QueryPart, grid: Grid) -> int:
    """The records inside the query's bbox but outside its `skip_cells`: read from the
    coarse cells of the bbox less those surely inside the skipped rectangle (a coarse cell
    of margin on each side of its border), then tested exactly."""
    q = part.query
    if records is None or q.bbox is None or q.skip_cells is None:
        return 0
    x0, y0, x1, y1 = q.skip_cells
    b0, b1, b2, b3 = q.bbox
    w, h = grid.cell_width, grid.cell_height
    rx0, rx1 = grid.bounds[0] + x0 * w, grid.bounds[0] + (x1 + 1) * w
    ry0, ry1 = grid.bounds[1] + y0 * h, grid.bounds[1] + (y1 + 1) * h
    region = Region(q.bbox, run_bounds(*border_runs((b0, b1, b2, b3), (rx0, ry0, rx1, ry1))))
    flat = _candidates(records, part, region)
    x, y = flat.lon, flat.lat
    return int(np.count_nonzero(bbox_contains(q.bbox, x, y)
                                & ~_in_cells(grid, q.skip_cells, x, y)))


def border_runs(bbox: tuple[float, float, float, float],
                inner: tuple[float, float, float, float]) -> tuple[I64, I64, I64]:
    """Runs of coarse cells (y, first x, last x), not overlapping, covering every point of
    `bbox` outside `inner` (a rectangle inside it): every row of cells of the bbox, less,
    in the rows surely within `inner`'s height, the cells surely within its width. "Surely"
    keeps a coarse cell of margin, so that rounding at the rectangle's border loses no point."""
    m = CELL_DEG
    bx0, by0, bx1, by1 = cell_range((bbox[0] - m, bbox[1] - m, bbox[2] + m, bbox[3] + m))
    ix0, iy0, ix1, iy1 = cell_range((inner[0] + m, inner[1] + m, inner[2] - m, inner[3] - m))
    # cells strictly between the margin cells are inside `inner`
    ix0, iy0, ix1, iy1 = ix0 + 1, iy0 + 1, ix1 - 1, iy1 - 1
    ys = np.arange(by0, by1 + 1, dtype=np.int64)
    xa = np.full(ys.size, bx0, dtype=np.int64)
    xb = np.full(ys.size, bx1, dtype=np.int64)
    if ix0 > ix1 or iy0 > iy1:
        return ys, xa, xb
    cut = (ys >= iy0) & (ys <= iy1)
    # a cut row is two runs: the cells left of the hole, those right of it
    left = ys[cut], xa[cut], np.full(int(cut.sum()), ix0 - 1, dtype=np.int64)
    right = ys[cut], np.full(int(cut.sum()), ix1 + 1, dtype=np.int64), xb[cut]
    keep = ~cut
    parts = [(ys[keep], xa[keep], xb[keep]), left, right]
    ys, xa, xb = (np.concatenate([p[i] for p in parts]) for i in range(3))
    order = np.lexsort((xa, ys))  # in cell order: the chunks' searches walk forward
    return ys[order], xa[order], xb[order]


def _in_cells(grid: Grid, cells: tuple[int, int, int, int], lon: Any, lat: Any) -> Any:
    cx, cy = grid.cells_of(lon, lat)
    return (cx >= cells[0]) & (cx <= cells[2]) & (cy >= cells[1]) & (cy <= cells[3])


FIRST_FEW = 64  # `_ascending` sorts at least this many first


def _ascending(values: Any, limit: int) -> Iterator[int]:
    """Positions in ascending order of `values`: the smallest few first from a partial sort
    (O(n)), all of them only if the predicates refuse so many that the loop gets that far."""
    n = values.size
    first = min(n, max(FIRST_FEW, 8 * limit))
    if first < n:
        near = np.argpartition(values, first - 1)[:first]
        near = near[np.argsort(values[near], kind="stable")]
        yield from near.tolist()
        rest = np.ones(n, dtype=bool)
        rest[near] = False
        # ties with the last of the first few may lie in the rest: the rest starts at its
        # value, and positions already given are skipped
        far = np.flatnonzero(rest)
        yield from far[np.argsort(values[far], kind="stable")].tolist()
    else:
        yield from np.argsort(values, kind="stable").tolist()


def _up_to_kth(values: Any, limit: int) -> I64:
    """The positions of the values up to the `limit`-th smallest, ties with it included (every
    position if there are no more than `limit`), in ascending order of value (so that the
    caller's sort of their rows is a pass over sorted runs): what `_ascending` gives until
    the first value past the limit-th, when every value is accepted."""
    if values.size > limit:
        kth = np.partition(values, limit - 1)[limit - 1]
        near = np.flatnonzero(values <= kth)
        return near[np.argsort(values[near], kind="stable")]
    return np.argsort(values, kind="stable")


def _newest(records: TenantRecords | None, part: wire.QueryPart, worker: str
            ) -> wire.QueryReply:
    """range and keyword: the `part.limit` newest rows that satisfy the query (every one
    without a limit), by (-ts, id, -arrival) as the aggregator merges them, and whether more
    matched (`truncated`). Rows are examined newest first (`_ascending` of -ts), so that the
    predicates run on the newest only and a query with a limit over a large region or a
    common keyword reads a few rows of Python, not every row of the region."""
    if records is None:
        return wire.QueryReply(worker=worker)
    found = _wanted(records, part)
    if not len(found):
        return wire.QueryReply(worker=worker)
    chunks, which, row = found.chunks, found.which, found.row
    age = -found.ts
    limit = part.limit
    # sorted as the aggregator merges: (newest first, id, latest arrival first), with the
    # row's place in `found`
    taken: list[tuple[float, str, float, int]] = []
    more = False
    if not part.query.latest:
        # every row is accepted: those up to the limit-th age, ties included
        sel = _up_to_kth(age, limit if limit else age.size)
        taken = list(zip(age[sel].tolist(), _ids(found, sel), (-found.at[sel]).tolist(),
                         sel.tolist(), strict=True))
        more = bool(limit) and age.size > limit
    else:
        for j in _ascending(age, limit):
            chunk, i = chunks[which[j]], int(row[j])
            if not _accepts(records, part, NO_TERMS, chunk, i):
                continue
            a = float(age[j])
            if limit and len(taken) >= limit and a > taken[limit - 1][0]:
                # older than the list's last (rows come in order of age: so is every row
                # left)
                more = True
                break
            taken.append((a, chunk.batch.ids[i], -float(found.at[j]), j))
        more = more or (bool(limit) and len(taken) > limit)
    taken.sort(key=lambda t: t[:3])
    out = _records(found, [t[3] for t in (taken[:limit] if limit else taken)])
    return wire.QueryReply(worker=worker, records=out, truncated=more)


def _ids(flat: Flat, sel: I64) -> list[str]:
    """The object ids of these rows of `flat`."""
    chunks = flat.chunks
    return [chunks[w].batch.ids[i] for w, i in zip(flat.which[sel].tolist(),
                                                    flat.row[sel].tolist(), strict=True)]


def _records(flat: Flat, sel: list[int], dist: list[float] | None = None
             ) -> list[wire.FoundRecord]:
    """These rows of `flat` as reply records (with `dist`: their distances). The columns
    read come from `flat`'s arrays, as lists at once, the rest from each chunk's batch (a
    lookup in a chunk's Python lists is a cache miss or more a field, on a worker that
    slept: a record's coordinates and times are taken where they already are)."""
    at = np.asarray(sel, dtype=np.int64)
    chunks = flat.chunks
    out = []
    for w, i, x, y, t, a in zip(flat.which[at].tolist(), flat.row[at].tolist(),
                                flat.lon[at].tolist(), flat.lat[at].tolist(),
                                flat.ts[at].tolist(), flat.at[at].tolist(), strict=True):
        b = chunks[w].batch
        out.append(wire.FoundRecord(id=b.ids[i], lon=x, lat=y, ts=t, keywords=b.keywords[i],
                                    text=b.text[i], props=b.props[i], moving=b.moving[i],
                                    at=a))
    if dist is not None:
        for r, d in zip(out, dist, strict=True):
            r.distance_m = d
    return out


def _found(chunk: Chunk, i: int, light: bool = False) -> wire.FoundRecord:
    b = chunk.batch
    return wire.FoundRecord(id=b.ids[i], lon=b.lon[i], lat=b.lat[i], ts=b.ts[i],
                            keywords=b.keywords[i], text=None if light else b.text[i],
                            props=None if light else b.props[i], moving=b.moving[i],
                            at=float(chunk.at[i]))


def _in_time(chunk: Chunk, part: wire.QueryPart, rows: Any) -> Any:
    """The rows (indices) of a chunk within the query's time range that arrived by `as_of`
    (a later arrival is seen by no round of the query)."""
    q = part.query
    if chunk.last_at > part.as_of:
        rows = rows[chunk.at[rows] <= part.as_of]
    if q.t_from is not None:
        rows = rows[chunk.ts[rows] >= q.t_from]
    if q.t_to is not None:
        rows = rows[chunk.ts[rows] <= q.t_to]
    return rows


NO_TERMS: frozenset[str] = frozenset()


def _accepts(records: TenantRecords, part: wire.QueryPart, wanted: frozenset[str],
             chunk: Chunk, i: int) -> bool:
    """The keyword predicate and, with `latest`, this worker's part of it."""
    q = part.query
    if wanted and not _keywords_hold(wanted, q.match_all, chunk.batch.keywords[i]):
        return False
    return not (q.latest and chunk.moving[i] and not _latest_here(records, chunk, i, part))


WORLD = Region((-180.0, -90.0, 180.0, 90.0), None)


def _region(q: wire.SnapshotQuery) -> Region | None:
    """The region of a query's bbox or circle (None without one)."""
    if q.bbox is not None:
        return Region.of(q.bbox)
    if q.circle is not None:
        return Region.of(circle_bbox(*q.circle))
    return None


def _inside(q: wire.SnapshotQuery, flat: Flat) -> Any:
    """Which rows lie in the query's bbox or circle."""
    if q.bbox is not None:
        return bbox_contains(q.bbox, flat.lon, flat.lat)
    assert q.circle is not None
    return haversine_m(q.circle[0], q.circle[1], flat.lon, flat.lat) <= q.circle[2]


def _candidates(records: TenantRecords, part: wire.QueryPart, region: Region,
                keywords: bool = False) -> Flat:
    """The rows each chunk seen by the query (arrived by `as_of`) reads for `region`
    (`TenantRecords.read`: every row of the cells it covers, in one array per column, less,
    with `keywords`, those whose keywords' signature cannot hold the query's) within its
    time range: the caller tests them in one vectorised call (a window holds a chunk or more
    per bucket, sixty buckets an hour: a call per chunk cost more than the test)."""
    q = part.query
    return _in_time_range(part, records.read(
        region, part.as_of, (frozenset(q.keywords), q.match_all) if keywords else None))


def _in_time_range(part: wire.QueryPart, flat: Flat) -> Flat:
    """The rows of `flat` within the query's time range."""
    q = part.query
    if q.t_from is None and q.t_to is None:
        return flat
    keep = np.ones(len(flat), dtype=bool)
    if q.t_from is not None:
        keep &= flat.ts >= q.t_from
    if q.t_to is not None:
        keep &= flat.ts <= q.t_to
    return flat.take(keep)


def _wanted(records: TenantRecords, part: wire.QueryPart) -> Flat:
    """The rows that satisfy the query's region, time range and keywords (not yet checked for
    `latest`), in one `Flat`."""
    q = part.query
    region = _region(q)
    if region is None and q.keywords:
        # the rows of the keywords anywhere (`TenantRecords.read` of the world: exactly those)
        return _candidates(records, part, WORLD, keywords=True)
    if region is None:
        chunks = list(records.chunks)
        return Flat.of_rows(chunks, list(_whole_chunks(records, part, chunks)))
    flat = _candidates(records, part, region, bool(q.keywords))
    flat = flat.take(_inside(q, flat))
    return _holding(records, flat, frozenset(q.keywords), q.match_all) if q.keywords else flat


def _whole_chunks(records: TenantRecords, part: wire.QueryPart, chunks: list[Chunk]
                  ) -> Iterator[tuple[int, I64]]:
    """Without a region: the rows of each chunk seen by the query (by position) within its
    time range that hold its keywords."""
    q = part.query
    terms = frozenset(q.keywords)
    records.keywords_asked = records.keywords_asked or bool(terms)
    for i, chunk in enumerate(chunks):
        if chunk.first_at <= part.as_of:
            rows = _in_time(chunk, part, np.arange(chunk.ts.size, dtype=np.int64))
            if terms and rows.size:
                rows = rows[chunk.with_keywords(terms, q.match_all, records.vocab)[rows]]
            yield i, rows


def _holding(records: TenantRecords, flat: Flat, terms: frozenset[str], match_all: bool
             ) -> Flat:
    """The rows of `flat` that hold the keywords (`Chunk.holds`, chunk by chunk), in chunk
    order."""
    flat = flat.by_chunk()
    keep = [chunk.holds(rows, terms, match_all, records.vocab) for chunk, rows in flat.groups()]
    return flat.take(np.concatenate(keep)) if keep else flat


def _wanted_rows(records: TenantRecords | None, part: wire.QueryPart
                 ) -> Iterator[tuple[Chunk, Any]]:
    """`_wanted`'s rows chunk by chunk (without a region, straight from each chunk's)."""
    if records is None:
        return
    q = part.query
    if q.bbox is None and q.circle is None:
        chunks = list(records.chunks)
        for i, rows in _whole_chunks(records, part, chunks):
            yield chunks[i], rows
        return
    yield from _wanted(records, part).groups()


FIRST_RADIUS_M = 1_000.0  # knn looks this far first, then 4x as far until it is sure
FIRST_EXPECTED = 4  # or as far as the density of its grid cell puts this many times k records
FIRST_BUCKETS = 4  # the density is read in the newest buckets' counts, scaled to the window
WORLD_M = 2.1e7  # beyond half the circumference every point is within reach
# A knn with keywords held by n of the N rows reads those n at once, rather than by rounds
# from a first radius at their density, when n is no more than about what that first round
# reads (FIRST_EXPECTED k N / n rows, tested against the keywords' signatures): n^2 at most
# this times FIRST_EXPECTED k N. Over 500 000 records with real words, a knn with a record's
# own first keyword took 335 us by rounds and 196 us so (p50, in one process).
KEYWORD_ROWS_AT_ONCE = 1.0


def first_radius(records: TenantRecords, grid: Grid | None, px: float, py: float,
                 k: float) -> float:
    """Where a knn starts looking: the radius of a circle holding FIRST_EXPECTED x k records
    at the density of the point's cell of the global grid (the window's per-cell counts),
    so that one or two reads usually suffice, dense city or empty plain; FIRST_RADIUS_M
    without counts or records in that cell. Any radius gives the same answer (the search
    grows until it is sure), only sooner. The cell's records are counted in the newest
    FIRST_BUCKETS buckets (those last added) and scaled by the share of the records held that
    they count: a window of an hour has sixty buckets or more, and a lookup in each (or a sum
    of their totals) cost more than the rest of a small knn query."""
    buckets = records.cell_counts
    if grid is None or not buckets:
        return FIRST_RADIUS_M
    cell = grid.cell_of_point(px, py)
    # (the buckets last added: the newest but for a late entry's, which would do as well)
    newest = [buckets[b] for b in itertools.islice(reversed(buckets), FIRST_BUCKETS)]
    seen = sum(counts.total for counts in newest)
    found = sum(counts.get(cell, 0) for counts in newest)
    if not found:
        return FIRST_RADIUS_M
    n = found * records.size / seen
    m_per_deg = math.pi * EARTH_RADIUS_M / 180
    area = (grid.cell_width * m_per_deg * max(0.01, math.cos(math.radians(py)))
            * grid.cell_height * m_per_deg)
    return max(1.0, math.sqrt(FIRST_EXPECTED * k * area / (math.pi * n)))


def read_reach_m(region: Region, px: float, py: float) -> float:
    """How far from (px, py) every point is within the area `region` reads (`Region.of`: the
    rectangle of its coarse cells, or its bbox without cell runs), less a millimetre for
    rounding; 0 where that area meets the world's edges (or leaves the point out)."""
    if region.bounds is None:
        west, south, east, north = region.bbox
    else:
        x0, y0, x1, y1 = cell_range(region.bbox)
        west, east = x0 * CELL_DEG - 180, (x1 + 1) * CELL_DEG - 180
        south, north = y0 * CELL_DEG - 90, (y1 + 1) * CELL_DEG - 90
    if (west <= -180 or east >= 180 or south <= -90 or north >= 90
            or not (west <= px <= east and south <= py <= north)):
        return 0.0
    # the nearest parallel of the two lies along the point's meridian; the distance to a
    # meridian is asin(sin(dlon) cos(lat)) (its nearer pole, past 90 degrees of longitude)
    to_parallel = math.radians(min(py - south, north - py))
    dlon = min(math.radians(min(px - west, east - px)), math.pi / 2)
    to_meridian = math.asin(min(1.0, math.sin(dlon) * math.cos(math.radians(py))))
    return max(0.0, min(to_parallel, to_meridian) * EARTH_RADIUS_M - 1e-3)


def _nearest(records: TenantRecords | None, part: wire.QueryPart, worker: str,
             grid: Grid | None = None) -> wire.QueryReply:
    """knn: the `part.limit` nearest rows that satisfy the query, by (distance, id). It reads
    the rows of the cells within a radius (a circle's rows are all there), growing the radius
    until the list is full and one more accepted row beyond its last distance (`truncated`)
    is found, or the radius covers the world. Rows are examined in order of distance, so the
    predicates run on the nearest only."""
    if records is None:
        return wire.QueryReply(worker=worker)
    q = part.query
    assert q.point is not None
    px, py = q.point
    limit = part.limit or q.k
    wanted = frozenset(q.keywords)
    cap = q.max_distance_m
    # with keywords, as far as the density of the rows that hold them puts FIRST_EXPECTED
    # times k of them (a rare keyword's nearest lie far: reads that grow ring by ring from
    # where k records of any keyword lie read the same rows again and again); or, when they
    # are few, all of them at once (KEYWORD_ROWS_AT_ONCE)
    held = records.keyword_positions(wanted, q.match_all) if wanted else None
    if held is not None and (held.size * held.size
                             <= KEYWORD_ROWS_AT_ONCE * FIRST_EXPECTED * limit * records.size):
        if q.latest or q.t_from is not None or q.t_to is not None:
            near = _in_time_range(part, records.read_at(held, part.as_of))
            dist = haversine_m(px, py, near.lon, near.lat)
            if cap is not None:
                inside = dist <= cap
                near, dist = near.take(inside), dist[inside]
        else:
            # their points first, then the rows up to the (limit + 1)-th whole (a gather per
            # column from the whole window, cold in the caches: a third of the time at once)
            held = records.arrived_by(held, part.as_of)
            lon, lat = records.points_at(held)
            dist = haversine_m(px, py, lon, lat)
            if cap is not None:
                inside = dist <= cap
                held, dist = held[inside], dist[inside]
            ahead = _up_to_kth(dist, limit + 1)
            near, dist = records.read_at(held[ahead], part.as_of), dist[ahead]
        # (every one of them holds the keywords: only `latest` is left to test)
        taken, more = _take_nearest(records, part, frozenset(), limit, near, dist)
        return _nearest_reply(worker, near, taken[:limit], more)
    share = 1.0 if held is None else max(held.size, 0.5) / max(records.size, 1)
    radius = first_radius(records, grid, px, py, limit / min(share, 1.0))
    radius = radius if cap is None else min(radius, cap)
    while True:
        world = radius >= WORLD_M
        last = world or (cap is not None and radius >= cap)
        region = Region.of(circle_bbox(px, py, min(radius, WORLD_M)))
        if wanted and region.bounds is None and not last:
            # a tall region's rows are those of the keywords in every chunk (`read`): as
            # many as the world's or the cap's, read once
            radius = WORLD_M if cap is None else cap
            continue
        # (rows whose keywords' signature cannot hold the keywords are left out as read)
        near = _candidates(records, part, region, bool(wanted))
        dist = haversine_m(px, py, near.lon, near.lat)
        if not world:
            # every row this near was read: the radius, or as far as the area read reaches
            # (its cells stretch past the circle: a first round in a town reads enough)
            radius = max(radius, read_reach_m(region, px, py))
            radius = radius if cap is None else min(radius, cap)
            keep = dist <= radius
            near, dist = near.take(keep), dist[keep]
        taken, more = _take_nearest(records, part, wanted, limit, near, dist)
        if last or more:
            break
        radius = radius * 4 if cap is None else min(radius * 4, cap)
    return _nearest_reply(worker, near, taken[:limit], more)


def _nearest_reply(worker: str, near: Flat, taken: list[tuple[float, str, float, float, int]],
                   more: bool) -> wire.QueryReply:
    """A knn part's reply: the rows `taken` of `near` (`_take_nearest`), with distances."""
    out = _records(near, [t[4] for t in taken], [t[0] for t in taken])
    return wire.QueryReply(worker=worker, records=out, truncated=more)


def _take_nearest(records: TenantRecords, part: wire.QueryPart, wanted: frozenset[str],
                  limit: int, near: Flat, dist: Any
                  ) -> tuple[list[tuple[float, str, float, float, int]], bool]:
    """The accepted rows up to the limit-th distance (ties included), sorted as the
    aggregator merges them, with each one's place in `near`, and whether one more accepted
    row lies beyond (candidates: the rows of `near`, at `dist`)."""
    chunks, which, row = near.chunks, near.which, near.row
    # sorted as the aggregator merges: (distance, id, newest record first, latest arrival)
    taken: list[tuple[float, str, float, float, int]] = []
    if not wanted and not part.query.latest:
        # every candidate is accepted: those up to the limit-th distance, ties included, and
        # more lie beyond (or among the ties) when there are more candidates than the limit
        sel = _up_to_kth(dist, limit)
        taken = list(zip(dist[sel].tolist(), _ids(near, sel), (-near.ts[sel]).tolist(),
                         (-near.at[sel]).tolist(), sel.tolist(), strict=True))
        taken.sort(key=lambda t: t[:4])
        return taken, dist.size > limit
    more = False
    for j in _ascending(dist, limit):
        d = float(dist[j])
        chunk, i = chunks[which[j]], int(row[j])
        if not _accepts(records, part, wanted, chunk, i):
            continue
        if len(taken) >= limit and d > taken[limit - 1][0]:
            more = True  # past the list's last distance
            break
        taken.append((d, chunk.batch.ids[i], -float(near.ts[j]), -float(near.at[j]), j))
        if len(taken) >= limit:
            taken.sort(key=lambda t: t[:4])
    taken.sort(key=lambda t: t[:4])
    return taken, more or len(taken) > limit


def _keywords_hold(wanted: frozenset[str], match_all: bool, kws: list[str]) -> bool:
    if match_all:
        return wanted.issubset(kws)
    return not wanted.isdisjoint(kws)


def _latest_here(records: TenantRecords, chunk: Chunk, i: int, part: wire.QueryPart) -> bool:
    """Whether row i is the object's latest record on this worker (within the query's time
    range, arrived by `as_of`); of two with the same ts and arrival, the later row wins."""
    b = chunk.batch
    best = records.latest_ts(b.ids[i], part.query.t_from, part.query.t_to, part.as_of)
    return best == (b.ts[i], float(chunk.at[i])) and chunk.last_row()[(b.ids[i], b.ts[i])] == i
