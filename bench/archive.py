"""Archive benchmark (`geoswarm bench archive`): snapshot queries over N archived records read
through Spark, before and after AQWA's compaction, side by side in one run, with what Spark's
own metrics say each query read beside a full scan.

For each size: N records near real cities (weighted by population), with Zipf keywords, are
written as the workers write expired buckets (one Parquet file per bucket, rows along the
Z-order curve) and made visible by the archive cut; a query runner's reader (the same code,
in-process, on a warm SparkSession) answers range queries over boxes covering 0.1 % of the
records' area and knn queries (k = 10) at random records; each query's region goes to the
query log as a runner logs it. Then `compact` rewrites the archive into k-d partitions driven
by that log, and the same queries run again. Every range answer is checked against numpy.

Ingestion: `geoswarm ingest --to archive` of a Parquet file of `--ingest-records` rows (the
same workload), as a user runs it (a subprocess with its own SparkSession, every row validated
by the API's rules), timed from start to its final counts.

Printed as a table (one line per size, phase and query type) and drawn as a PNG."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from app.archive.layout import ArchiveStore
from app.archive.writer import columns_table, write_table
from app.core.config import Settings
from app.core.redis import start_embedded_redis, sync_client
from app.geo.geometry import bbox_contains
from app.pipeline import names, wire
from app.pipeline.router import grid_of
from bench.snapshot import pct
from bench.workload import make_objects

TENANT = "bench"
WORKER = "w0"
ROWS_PER_FILE = 250_000
BUCKET_S = 60.0


def write_archive(settings: Settings, n: int, rng: np.random.Generator) -> tuple[dict[str, Any],
                                                                                   float, int]:
    """N records as bucket files of worker w0; (the points, seconds, last bucket)."""
    store = ArchiveStore(settings.archive_path)
    grid = grid_of(settings)
    objs = make_objects(n, rng)
    kws = objs["keywords"]
    start = time.perf_counter()
    first = int((time.time() - 10 * 86_400) // BUCKET_S)
    bucket = first
    for a in range(0, n, ROWS_PER_FILE):
        b = min(n, a + ROWS_PER_FILE)
        m = b - a
        ts = (bucket * BUCKET_S + np.linspace(0, BUCKET_S, m, endpoint=False))
        offsets = np.zeros(m + 1, dtype=np.int32)
        offsets[1:] = np.cumsum([len(k) for k in kws[a:b]])
        flat = pa.array([w for k in kws[a:b] for w in k], pa.string())
        table = columns_table(
            pa.array([f"e{i}" for i in range(a, b)], pa.string()), objs["lon"][a:b],
            objs["lat"][a:b], ts, ts, pa.array(np.zeros(m, dtype=bool)),
            pa.ListArray.from_arrays(pa.array(offsets), flat),
            pa.nulls(m, pa.string()), pa.nulls(m, pa.string()), bucket, WORKER, grid)
        write_table(store, store.bucket_path(TENANT, bucket, BUCKET_S, WORKER), table)
        bucket += 1
    return objs, time.perf_counter() - start, bucket - 1


def boxes(objs: dict[str, Any], count: int, fraction: float, rng: np.random.Generator
          ) -> list[tuple[float, float, float, float]]:
    """Boxes of `fraction` of the records' bounding area, centred on random records."""
    lon, lat = objs["lon"], objs["lat"]
    w = (lon.max() - lon.min()) * math.sqrt(fraction)
    h = (lat.max() - lat.min()) * math.sqrt(fraction)
    out = []
    for i in rng.choice(lon.size, size=count, replace=False).tolist():
        cx, cy = float(lon[i]), float(lat[i])
        out.append((cx - w / 2, max(-90.0, cy - h / 2), cx + w / 2, min(90.0, cy + h / 2)))
    return out


def run_queries(archive: Any, spark: Any, client: Any, parts: list[wire.QueryPart],
                objs: dict[str, Any]) -> dict[str, Any]:
    """Latency (ms), rows and bytes read per query of each type; range answers checked."""
    from spark.compact import log_query
    from spark.scanmetrics import scans_since

    out: dict[str, Any] = {}
    mark = scans_since(spark, -1)
    last = mark.last if mark is not None else -1
    wrong = 0
    for part in parts:
        t0 = time.perf_counter()
        reply, cells = archive.answer(part)
        ms = (time.perf_counter() - t0) * 1000
        scans = scans_since(spark, last)
        if scans is not None:
            last = scans.last
        fig = out.setdefault(part.query.type, {"ms": [], "rows": [], "bytes": [], "files": []})
        fig["ms"].append(ms)
        fig["rows"].append(scans.rows if scans else 0)
        fig["bytes"].append(scans.bytes if scans else 0)
        fig["files"].append(scans.files if scans else 0)
        grid = archive.grid
        log_query(client, TENANT, cells if cells is not None else
                  (0, 0, grid.nx - 1, grid.ny - 1), time.time())
        if part.query.type == "count" and part.query.bbox is not None:
            want = int(bbox_contains(part.query.bbox, objs["lon"], objs["lat"]).sum())
            wrong += int(reply.count != want)
    out["wrong"] = wrong
    return out


def make_parts(objs: dict[str, Any], cut: int, queries: int, rng: np.random.Generator
               ) -> list[wire.QueryPart]:
    now = time.time()
    parts = []
    for box in boxes(objs, queries, 0.001, rng):
        parts.append(wire.QueryPart(
            reply="bench", tenant=TENANT, as_of=now, deadline=now + 3600, limit=0,
            cut={WORKER: cut}, query=wire.SnapshotQuery(type="count", bbox=box, t_from=0.0)))
    for i in rng.choice(objs["lon"].size, size=queries, replace=False).tolist():
        point = (float(objs["lon"][i]), float(objs["lat"][i]))
        parts.append(wire.QueryPart(
            reply="bench", tenant=TENANT, as_of=now, deadline=now + 3600, limit=10,
            cut={WORKER: cut}, query=wire.SnapshotQuery(type="knn", point=point, k=10,
                                                        t_from=0.0)))
    return parts


def ingest_rate(n: int, seed: int) -> dict[str, Any]:
    """`geoswarm ingest --to archive` of n rows from a Parquet file, timed end to end."""
    from bench.cluster import ROOT

    tmp = Path(tempfile.mkdtemp(prefix="geoswarm-bench-ingest-"))
    redis_server = start_embedded_redis(Settings(data_dir=tmp / "redis"), die_with_parent=True)
    try:
        objs = make_objects(n, np.random.default_rng(seed))
        src = tmp / "objects.parquet"
        pq.write_table(pa.table({
            "lon": objs["lon"], "lat": objs["lat"],
            "ts": 1_700_000_000.0 + np.arange(n, dtype=np.float64) * 0.01,
            "keywords": pa.array(objs["keywords"], pa.list_(pa.string()))}), src)
        env = {**os.environ, "GEOSWARM_DATA_DIR": str(tmp), "GEOSWARM_REDIS_URL": redis_server.url,
               "GEOSWARM_SPARK_MASTER": "local[*]"}
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "app.cli", "ingest", str(src), "--tenant",
                              "ingest", "--to", "archive"], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - t0
        if out.returncode != 0:
            raise RuntimeError(f"ingest failed: {out.stderr[-2000:]}")
        last = out.stdout.strip().splitlines()[-1]
        return {"records": n, "phase": "ingest", "query": "to archive",
                "rows_per_s": round(n / seconds), "seconds": round(seconds, 1),
                "counts": last.replace(" ", "")}
    finally:
        redis_server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def run(sizes: list[int], queries: int, min_records: int, seed: int, png: Path | None,
        ingest_records: int = 0) -> list[dict[str, Any]]:
    from spark.compact import compact_tenant
    from spark.runner import Archive
    from spark.session import get_spark

    rows: list[dict[str, Any]] = []
    if ingest_records:
        rows.append(ingest_rate(ingest_records, seed))
    for n in sizes:
        tmp = Path(tempfile.mkdtemp(prefix="geoswarm-bench-archive-"))
        settings = Settings(data_dir=tmp, spark_master="local[*]", bucket_s=BUCKET_S,
                            archive_min_file_records=min_records, environment="test")
        redis_server = start_embedded_redis(Settings(data_dir=tmp / "redis"), die_with_parent=True)
        client = sync_client(redis_server.url)
        spark = get_spark(settings, app_name="geoswarm-bench-archive")
        try:
            rng = np.random.default_rng(seed)
            objs, write_s, cut = write_archive(settings, n, rng)
            client.hset(names.ARCHIVE_CUT, WORKER, cut)
            rows.append({"records": n, "phase": "write", "query": "bulk write",
                         "rows_per_s": round(n / write_s)})
            archive = Archive(settings, spark)
            parts = make_parts(objs, cut, queries, rng)
            run_queries(archive, spark, client, parts[:2], objs)  # warm-up, untimed
            client.delete(names.archive_query_log(TENANT))
            for phase in ("before", "after"):
                if phase == "after":
                    t0 = time.perf_counter()
                    done = compact_tenant(spark, settings, client, TENANT)
                    rows.append({"records": n, "phase": "compact", "query": "compaction",
                                 "seconds": round(time.perf_counter() - t0, 1),
                                 "partitions": done.partitions if done else 0})
                    archive = Archive(settings, spark)
                figs = run_queries(archive, spark, client, parts, objs)
                for kind in ("count", "knn"):
                    f = figs[kind]
                    rows.append({
                        "records": n, "phase": phase,
                        "query": "range 0.1%" if kind == "count" else "knn k=10",
                        "p50_ms": pct(f["ms"], 0.5), "p99_ms": pct(f["ms"], 0.99),
                        "rows_read": round(float(np.mean(f["rows"]))),
                        "bytes_read": round(float(np.mean(f["bytes"]))),
                        "files_read": round(float(np.mean(f["files"])), 1),
                        "full_scan_rows": n,
                        "fewer_rows_x": round(n / max(1.0, float(np.mean(f["rows"]))), 1),
                        "wrong": figs["wrong"] if kind == "count" else 0})
        finally:
            spark.stop()
            client.close()
            redis_server.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        draw(rows, png)
    return rows


def draw(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r["phase"] in ("before", "after")]
    labels = sorted({(r["records"], r["query"]) for r in timed})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(labels))
    for i, phase in enumerate(("before", "after")):
        got = {(r["records"], r["query"]): r for r in timed if r["phase"] == phase}
        ax1.bar(x + (i - 0.5) * 0.4, [got[lb]["p50_ms"] for lb in labels], 0.4,
                label=f"{phase} compaction")
        ax2.bar(x + (i - 0.5) * 0.4, [got[lb]["rows_read"] for lb in labels], 0.4,
                label=f"{phase} compaction")
    names_ = [f"{q}\n{n / 1e6:g}M" for n, q in labels]
    ax1.set_xticks(x, names_)
    ax1.set_ylabel("p50 latency (ms)")
    ax1.legend()
    ax2.set_xticks(x, names_)
    ax2.set_ylabel("rows read (Spark scan metrics)")
    ax2.set_yscale("log")
    ax2.legend()
    fig.suptitle("geoswarm archive queries through Spark, before and after AQWA compaction")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="geoswarm bench archive", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", default="1000000,10000000",
                    help="comma-separated archive sizes (default 1000000,10000000)")
    ap.add_argument("--queries", type=int, default=20, help="queries of each type per phase")
    ap.add_argument("--min-records", type=int, default=50_000,
                    help="compaction's minimum partition size")
    ap.add_argument("--ingest-records", type=int, default=1_000_000,
                    help="rows loaded by `geoswarm ingest --to archive` (0: skip)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--png", type=Path, default=Path("bench-results/archive.png"),
                    help="where to draw the figures ('' for none)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.records.split(",") if s]
    rows = run(sizes, args.queries, args.min_records, args.seed,
               args.png if str(args.png) else None, args.ingest_records)
    for r in rows:
        rest = "  ".join(f"{k}={v}" for k, v in r.items() if k not in ("records", "phase",
                                                                        "query"))
        print(f"{r['records']:>9} {r['phase']:<7} {r['query']:<11} {rest}")
