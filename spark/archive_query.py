"""Snapshot queries over the archive (AQWA; SSTD's snapshot range-keyword, kNN-keyword and
top-k terms; CheetahGIS's count): the archive's share of a `wire.QueryPart`, answered as a
worker answers its share of the live window (`workers.snapshot`), so that the aggregator
merges both the same way.

Spark reads the committed files below the cut the query read (`app.archive.layout`), with
the region, time and keyword predicates pushed down as filters (Parquet's row-group
statistics prune by lon/lat/ts), and hands the candidates to the driver as Arrow. The last
word on a region's border is numpy's (`app.geo.geometry`, as the workers): Spark's filters are
a hair wider, and the exact test runs on the few rows they let through.

`latest`: a moving object's record counts only if it is the object's latest archived record
within the time range (before the region and keyword predicates); the aggregator checks it
against the live side (`QueryPart.latest_of`).

knn, in one round (AQWA §5): the archive's count grid (the per-cell counts each file carries)
gives a radius whose circle surely holds k records; one scan of that circle answers, unless
the predicates (keywords, time, `latest`) refuse so many that fewer than k are left, and the
radius grows then.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from app.geo.geometry import EARTH_RADIUS_M, bbox_contains, circle_bbox, haversine_m
from app.pipeline import names, wire
from spark.scanmetrics import to_arrow

# Spark's filters let through rows this much beyond a region (metres, degrees): the exact test
# is numpy's, on the driver.
SLACK_M = 1e-3
SLACK_DEG = 1e-9
EXTRA_ROWS = 64  # candidates fetched beyond a limit (those the exact test may refuse)
WORLD_M = 2.1e7  # beyond half the circumference every point is within reach
FIRST_RADIUS_M = 1_000.0  # knn without a count grid (or past it): then 4x as far

Radius = Callable[[float, float, int], float | None]
Cells = tuple[int, int, int, int]
Frames = Callable[[Cells | None], DataFrame | None]
Region = Callable[[wire.SnapshotQuery], Cells | None]


def spark_haversine(lon: float, lat: float) -> Column:
    """The haversine distance (metres) of each row to (lon, lat), as Spark computes it."""
    phi1 = math.radians(lat)
    phi2 = F.radians(F.col("lat"))
    dphi = phi2 - F.lit(phi1)
    dlmb = F.radians(F.col("lon") - F.lit(lon))
    a = F.pow(F.sin(dphi * 0.5), 2) + F.lit(math.cos(phi1)) * F.cos(phi2) * F.pow(
        F.sin(dlmb * 0.5), 2)
    return F.lit(2.0 * EARTH_RADIUS_M) * F.asin(F.sqrt(F.least(a, F.lit(1.0))))


def transform_time(df: DataFrame, q: wire.SnapshotQuery, as_of: float) -> DataFrame:
    """Rows within the query's time range that arrived by `as_of`."""
    df = df.filter(F.col("at") <= as_of)
    if q.t_from is not None:
        df = df.filter(F.col("ts") >= q.t_from)
    if q.t_to is not None:
        df = df.filter(F.col("ts") <= q.t_to)
    return df


def transform_latest(df: DataFrame) -> DataFrame:
    """Events, and each moving object's latest record (greatest ts, then arrival)."""
    newest = Window.partitionBy("id").orderBy(F.col("ts").desc(), F.col("at").desc())
    moving = (df.filter(F.col("moving"))
              .withColumn("_rank", F.row_number().over(newest))
              .filter(F.col("_rank") == 1).drop("_rank"))
    return df.filter(~F.col("moving")).unionByName(moving)


def transform_region(df: DataFrame, q: wire.SnapshotQuery) -> DataFrame:
    """Rows in the query's region, a hair wide (see SLACK_M)."""
    if q.bbox is not None:
        x0, y0, x1, y1 = q.bbox
        return df.filter(F.col("lon").between(x0 - SLACK_DEG, x1 + SLACK_DEG)
                         & F.col("lat").between(y0 - SLACK_DEG, y1 + SLACK_DEG))
    if q.circle is not None:
        lon, lat, radius = q.circle
        return within(df, lon, lat, radius)
    return df


def within(df: DataFrame, lon: float, lat: float, radius: float) -> DataFrame:
    """Rows within `radius` of a point, a hair wide: a bbox first (pushed down), then the
    distance."""
    x0, y0, x1, y1 = circle_bbox(lon, lat, min(radius, WORLD_M))
    df = df.filter(F.col("lon").between(x0 - SLACK_DEG, x1 + SLACK_DEG)
                   & F.col("lat").between(y0 - SLACK_DEG, y1 + SLACK_DEG))
    if radius >= WORLD_M:
        return df
    return df.filter(spark_haversine(lon, lat) <= radius * (1 + 1e-9) + SLACK_M)


def transform_keywords(df: DataFrame, q: wire.SnapshotQuery) -> DataFrame:
    """Rows whose keywords hold any (or all, `match_all`) of the query's."""
    if not q.keywords:
        return df
    wanted = F.array(*[F.lit(k) for k in sorted(set(q.keywords))])
    if q.match_all:
        return df.filter(F.size(F.array_except(wanted, F.col("keywords"))) == 0)
    return df.filter(F.arrays_overlap(F.col("keywords"), wanted))


class Rows:
    """Candidate rows on the driver (an Arrow table's columns), tested exactly."""

    def __init__(self, table: pa.Table) -> None:
        self.n = table.num_rows
        self.cols = {name: table.column(name) for name in table.column_names}
        self.lon = self.cols["lon"].to_numpy() if self.n else np.empty(0)
        self.lat = self.cols["lat"].to_numpy() if self.n else np.empty(0)

    def exact(self, q: wire.SnapshotQuery) -> Any:
        """Positions of the rows inside the query's region by the workers' arithmetic."""
        if not self.n:
            return np.empty(0, dtype=np.int64)
        if q.bbox is not None:
            return np.flatnonzero(bbox_contains(q.bbox, self.lon, self.lat))
        if q.circle is not None:
            lon, lat, radius = q.circle
            return np.flatnonzero(haversine_m(lon, lat, self.lon, self.lat) <= radius)
        return np.arange(self.n)

    def found(self, i: int, light: bool = False) -> wire.FoundRecord:
        c = self.cols
        props = c["props"][i].as_py() if not light else None
        return wire.FoundRecord(
            id=c["id"][i].as_py(), lon=float(self.lon[i]), lat=float(self.lat[i]),
            ts=c["ts"][i].as_py(), keywords=list(c["keywords"][i].as_py() or []),
            text=None if light else c["text"][i].as_py(),
            props=props,
            moving=c["moving"][i].as_py(), at=c["at"][i].as_py())


def fetch(df: DataFrame, order: list[Column], n: int | None, light: bool = False) -> Rows:
    """The first `n` rows in `order` (all with None) on the driver."""
    cols = ["id", "lon", "lat", "ts", "at", "moving", "keywords"] + (
        [] if light else ["text", "props"])
    df = df.select(*cols)
    if order:
        df = df.orderBy(*order)
    if n is not None:
        df = df.limit(n)
    return Rows(to_arrow(df))


def newest_first() -> list[Column]:
    return [F.col("ts").desc(), F.col("id").asc(), F.col("at").desc()]


def evaluate(spark: SparkSession, frames: Frames, part: wire.QueryPart,
             radius: Radius | None = None, region: Region | None = None) -> wire.QueryReply:
    """The archive's reply to `part`. `frames(cells)`: the rows of the files that may hold
    records in these grid cells (None: every file; None back: no file); `region(query)`: the
    cells a query's region covers; `radius`: a knn's first radius (AQWA §5)."""
    worker = names.ARCHIVE_WORKER
    q = part.query
    # `latest` ranks an object's records wherever they are: every file
    cells = None if (q.latest or region is None or part.latest_of is not None
                     or q.type == "knn") else region(q)
    if q.type == "knn" and not q.latest:
        return _nearest(spark, frames, part, radius, region)
    frame = frames(cells)
    if frame is None:
        return wire.QueryReply(worker=worker)
    df = transform_time(frame, q, part.as_of)
    if part.latest_of is not None:
        if not part.latest_of:
            return wire.QueryReply(worker=worker)
        ids = spark.createDataFrame([(i,) for i in part.latest_of], "id string")
        got = to_arrow(df.filter(F.col("moving")).join(F.broadcast(ids), "id")
                       .groupBy("id").agg(F.max("ts").alias("ts")))
        return wire.QueryReply(worker=worker, latest=dict(zip(
            got.column("id").to_pylist(), got.column("ts").to_pylist(), strict=True)))
    if q.latest:
        df = transform_latest(df)
    df = transform_keywords(df, q)
    if q.type == "knn":
        return _nearest(spark, lambda _cells: df, part, radius, None, prepared=True)
    if q.type in ("range", "keyword"):
        return _listed(transform_region(df, q), part)
    return _counted(df, part)


def _counted(df: DataFrame, part: wire.QueryPart) -> wire.QueryReply:
    """count and topk_terms, aggregated by Spark over the rows surely inside the region; the
    rows of a circle's border band are tested on the driver. With `latest`, moving objects'
    records are listed (light) for the aggregator's check instead of counted."""
    q = part.query
    region = transform_region(df, q)
    band: DataFrame | None = None
    if q.bbox is not None:
        sure = region.filter(_inside_bbox(q.bbox))
    elif q.circle is not None:
        lon, lat, radius = q.circle
        inner = spark_haversine(lon, lat) <= radius * (1 - 1e-9) - SLACK_M
        sure, band = region.filter(inner), region.filter(~inner)
    else:
        sure = region
    reply = wire.QueryReply(worker=names.ARCHIVE_WORKER)
    counted = sure
    if q.latest:
        counted = sure.filter(~F.col("moving"))
        listed = fetch(sure.filter(F.col("moving")), [], None, light=True)
        reply.records = [listed.found(i, light=True) for i in range(listed.n)]
    terms: Counter[str] = Counter()
    if q.type == "topk_terms":
        got = to_arrow(counted.select(F.explode("keywords").alias("term"))
                       .groupBy("term").count())
        terms.update(dict(zip(got.column("term").to_pylist(), got.column("count").to_pylist(),
                              strict=True)))
    reply.count = int(to_arrow(counted.groupBy().count()).column(0)[0].as_py())
    if band is not None:
        rows = fetch(band, [], None, light=True)
        kws = rows.cols["keywords"].to_pylist() if rows.n else []
        for i in rows.exact(q).tolist():
            rec = rows.found(i, light=True)
            if q.latest and rec.moving:
                reply.records.append(rec)
                continue
            reply.count += 1
            if q.type == "topk_terms":
                terms.update(kws[i] or [])
    reply.terms = dict(terms)
    return reply


def _inside_bbox(bbox: tuple[float, float, float, float]) -> Column:
    """A bbox's test in Spark: exact (comparisons of doubles are the same everywhere)."""
    x0, y0, x1, y1 = bbox
    return (F.col("lon") >= x0) & (F.col("lon") <= x1) & (F.col("lat") >= y0) & (
        F.col("lat") <= y1)


def _listed(df: DataFrame, part: wire.QueryPart) -> wire.QueryReply:
    """range and keyword: the newest `limit` rows (all with limit 0), `truncated` when more."""
    q = part.query
    limit = part.limit
    want = None if not limit else limit + 1 + EXTRA_ROWS
    rows = fetch(df, newest_first(), want)
    kept = rows.exact(q).tolist()
    if want is not None and rows.n == want and len(kept) <= limit:
        # the exact test refused so many of the first rows that the rest may matter
        rows = fetch(df, newest_first(), None)
        kept = rows.exact(q).tolist()
    out = [rows.found(i) for i in kept]
    out.sort(key=lambda r: (-r.ts, r.id, -r.at))
    return wire.QueryReply(worker=names.ARCHIVE_WORKER, records=out[:limit] if limit else out,
                           truncated=bool(limit) and len(out) > limit)


def _nearest(spark: SparkSession, frames: Frames, part: wire.QueryPart, radius: Radius | None,
             region: Region | None, prepared: bool = False) -> wire.QueryReply:
    """knn: the `limit` nearest rows by (distance, id, newest, latest arrival), `truncated`
    when one more lies beyond (as `workers.snapshot._nearest`). Each radius reads the files
    of the cells its circle covers (`prepared`: `frames` gives rows already filtered)."""
    q = part.query
    assert q.point is not None
    px, py = q.point
    limit = part.limit or q.k
    cap = q.max_distance_m
    reach = radius(px, py, limit) if radius is not None else None
    r = FIRST_RADIUS_M if reach is None else max(reach, 1.0)
    if cap is not None:
        r = min(r, cap)
    while True:
        world = r >= WORLD_M
        last = world or (cap is not None and r >= cap)
        cells = None if world or region is None else region(
            wire.SnapshotQuery(type="range", circle=(px, py, r)))
        frame = frames(cells)
        if frame is None:
            if last:
                found: list[wire.FoundRecord] = []
                break
            r = r * 4 if cap is None else min(r * 4, cap)
            continue
        df = frame if prepared else transform_keywords(transform_time(frame, q, part.as_of), q)
        scan = within(df, px, py, r).withColumn("_d", spark_haversine(px, py))
        rows = fetch(scan, [F.col("_d").asc(), F.col("id").asc(), F.col("ts").desc(),
                            F.col("at").desc()], limit + 1 + EXTRA_ROWS)
        d = haversine_m(px, py, rows.lon, rows.lat) if rows.n else np.empty(0)
        keep = np.arange(rows.n) if world else np.flatnonzero(d <= r)
        found = []
        for i in keep.tolist():
            rec = rows.found(i)
            rec.distance_m = float(d[i])
            found.append(rec)
        found.sort(key=lambda x: (x.distance_m, x.id, -x.ts, -x.at))
        if len(found) > limit or last:
            break
        r = r * 4 if cap is None else min(r * 4, cap)
    return wire.QueryReply(worker=names.ARCHIVE_WORKER, records=found[:limit],
                           truncated=len(found) > limit)
