"""AQWA's adaptive partitioning of the archive (`geoswarm archive compact`, and on a schedule in
the query runner): rewrite a tenant's archive into k-d partitions of the global grid's cells
whose splits follow the query workload.

1. The inputs: the current layout (`app.archive.layout.Manifest`, if any) and the visible
   bucket files it has not absorbed (the archive cut is read before the files are listed, so
   every file at or below it is there).
2. The count grid (AQWA §4.2.1): the layout's (`cells.npy`) plus the new files' per-cell
   counts. The query workload (§4.2.3-§4.2.4): the regions of the logged archive queries
   (`names.archive_query_log`) in an Euler histogram, each weighted by its age (halved every
   `archive_query_half_life_s`).
3. The layout: the first time, §4.1's balanced k-d layout (no partition under
   `archive_min_file_records`); then every partition is split where the cost it saves (queries
   overlapping x records, Equation 1) exceeds the cost of rewriting it
   (`archive_rewrite_cost` x its records, Equation 3), never below the minimum file size.
4. One Spark job writes the records that move: the new bucket files' records and those of the
   partitions that split, each to its partition, sorted along the Z-order curve, into
   `compact/<tenant>/v<N>/data/part=<i>/`. A partition that did not split keeps its files and
   gains one for its new records.
5. The switch: the manifest of v<N> is written, then CURRENT is replaced (a rename): a query
   reads the old layout or the new one, never both or neither (`read_layout`). The files the
   new layout replaced (but not those it kept) are deleted by a later compaction, once
   `archive_compact_grace_s` has passed (queries that started on the old layout finish first).

One compaction per tenant at a time (a Redis lock).
"""

from __future__ import annotations

import io
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import redis
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from app.archive.counts import add_cells, file_cells, layout_counts
from app.archive.layout import (
    ArchiveStore,
    Manifest,
    Partition,
    decode_cut,
    visible,
)
from app.core.config import Settings
from app.geo.aqwa import (
    EulerHistogram,
    kd_initial_partitions,
    layout_cost,
    refine_partitions,
)
from app.geo.grid import Grid
from app.pipeline import names
from app.pipeline.router import grid_of
from workers.lease import RELEASE_SCRIPT, RENEW_SCRIPT

log = logging.getLogger(__name__)

LOCK_TTL_S = 60.0  # renewed every 20 s while a compaction runs (CompactionLock)
QUERY_LOG_LEN = 100_000  # the regions of the last archive queries kept per tenant
Rect = tuple[int, int, int, int]


@dataclass
class Compacted:
    """What one compaction of one tenant did."""

    tenant: str
    version: int
    partitions: int
    records: int
    moved: int  # records written by this compaction
    split: int  # partitions that split
    cost_before: float
    cost_after: float
    seconds: float



def log_query(client: Any, tenant: str, cells: Rect, now: float) -> None:
    """Add an archive query's region (the grid cells it read) to the tenant's query log, the
    workload `query_workload` reads."""
    x0, y0, x1, y1 = cells
    client.xadd(names.archive_query_log(tenant), {b"r": f"{x0},{y0},{x1},{y1}".encode(),
                                                  b"t": repr(now).encode()},
                maxlen=QUERY_LOG_LEN, approximate=True)


def query_workload(client: Any, tenant: str, grid: Grid, now: float,
                   half_life_s: float) -> EulerHistogram:
    """The logged archive queries of a tenant, faded by age (AQWA §4.2.4)."""
    hist = EulerHistogram(grid.nx, grid.ny)
    rects: list[Rect] = []
    weights: list[float] = []
    start = "-"
    while True:
        rows = client.xrange(names.archive_query_log(tenant), min=start, count=10_000)
        for _eid, fields in rows:
            try:
                x0, y0, x1, y1 = (int(v) for v in fields[b"r"].decode().split(","))
                t = float(fields[b"t"])
            except (KeyError, ValueError):
                continue
            rects.append((max(0, x0), max(0, y0), min(grid.nx - 1, x1), min(grid.ny - 1, y1)))
            weights.append(0.5 ** (max(0.0, now - t) / half_life_s) if half_life_s > 0 else 1.0)
        if len(rows) < 10_000:
            break
        start = "(" + rows[-1][0].decode()
    if rects:
        hist.add_many(np.asarray(rects, dtype=np.int64), np.asarray(weights))
    return hist


def _contains(outer: Rect, inner: Rect) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and \
        inner[3] <= outer[3]


def part_of_cells(grid: Grid, rects: list[Rect]) -> Any:
    """Each cell's partition index (row-major cell ids)."""
    out = np.full((grid.ny, grid.nx), -1, dtype=np.int32)
    for i, (x0, y0, x1, y1) in enumerate(rects):
        out[y0:y1 + 1, x0:x1 + 1] = i
    return out.ravel()


def _versions(store: ArchiveStore, tenant: str) -> list[int]:
    sel = pafs.FileSelector(store.compact_dir(tenant), allow_not_found=True)
    return sorted(int(i.base_name[1:]) for i in store.fs.get_file_info(sel)
                  if i.type == pafs.FileType.Directory and i.base_name.startswith("v")
                  and i.base_name[1:].isdigit())


def clean(store: ArchiveStore, tenant: str, grace_s: float, now: float) -> int:
    """Delete what the current layout replaced once `grace_s` has passed since it became
    current: the bucket files it absorbed and the older layouts' files, except those it kept
    (a partition that did not split keeps its files where an older layout wrote them).
    Returns the files and directories deleted."""
    current = store.manifest(tenant)
    if current is None or now - current.created < grace_s:
        return 0
    deleted = 0
    for f in store.bucket_files(tenant):
        if current.covers(f):
            store.fs.delete_file(f.path)
            deleted += 1
    kept = current.kept()
    for v in _versions(store, tenant):
        if v == current.version:
            continue
        vdir = store.version_dir(tenant, v)
        files = [i.path for i in store.fs.get_file_info(pafs.FileSelector(vdir, recursive=True))
                 if i.type == pafs.FileType.File]
        if kept.isdisjoint(files):
            store.fs.delete_dir(vdir)
            deleted += 1
            continue
        for path in files:
            if path not in kept:
                store.fs.delete_file(path)
                deleted += 1
    return deleted


class CompactionLock:
    """One compaction per tenant at a time: a Redis key held with a short TTL and renewed
    every third of it while the compaction runs, so that a process that dies holding it
    (SIGKILL, a lost machine) blocks the tenant's compactions for at most LOCK_TTL_S."""

    def __init__(self, client: Any, tenant: str) -> None:
        self.client = client
        self.key = names.compact_lock(tenant)
        self.token = secrets.token_hex(8)
        self._done = threading.Event()
        self._renew = client.register_script(RENEW_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)

    def acquire(self) -> bool:
        if not self.client.set(self.key, self.token, nx=True, px=int(LOCK_TTL_S * 1000)):
            return False
        threading.Thread(target=self._keep, daemon=True).start()
        return True

    def _keep(self) -> None:
        while not self._done.wait(LOCK_TTL_S / 3):
            try:
                if int(self._renew(keys=[self.key],
                                   args=[self.token, int(LOCK_TTL_S * 1000)])) != 1:
                    log.warning("compaction lock %s lapsed; the switch may race another "
                                "compaction", self.key)
                    return
            except redis.RedisError as exc:  # the next renewal tries again, within the TTL
                log.warning("compaction lock %s not renewed: %s", self.key, exc)

    def release(self) -> None:
        self._done.set()
        self._release(keys=[self.key], args=[self.token])


def compact_tenant(spark: SparkSession, settings: Settings, client: Any, tenant: str,
                   min_records: int | None = None) -> Compacted | None:
    """Compact one tenant's archive (see the module docstring); None when another process is
    compacting it or there is nothing to do."""
    lock = CompactionLock(client, tenant)
    if not lock.acquire():
        log.info("compaction of %s: another process is compacting it", tenant)
        return None
    try:
        return _compact(spark, settings, client, tenant,
                        settings.archive_min_file_records if min_records is None else min_records)
    finally:
        lock.release()


def _compact(spark: SparkSession, settings: Settings, client: Any, tenant: str,
             min_records: int) -> Compacted | None:
    started = time.monotonic()
    now = time.time()
    store = ArchiveStore(settings.archive_path)
    grid = grid_of(settings)
    clean(store, tenant, settings.archive_compact_grace_s, now)
    old = store.manifest(tenant)
    if old is not None and old.grid != (grid.nx, grid.ny):
        raise RuntimeError(f"the archive of {tenant} was compacted on a {old.grid} grid, not "
                           f"{(grid.nx, grid.ny)}: compact it with the same GEOSWARM_GRID")
    # the cut before the listing: every file at or below it is there
    cut = decode_cut(client.hgetall(names.ARCHIVE_CUT))
    new_files = [f for f in visible(store.bucket_files(tenant), cut)
                 if old is None or not old.covers(f)]
    counts = layout_counts(store, old, grid)
    for f in new_files:
        add_cells(counts, file_cells(store, f.path))
    if counts.total == 0:
        return None
    queries = query_workload(client, tenant, grid, now, settings.archive_query_half_life_s)
    minimum = max(1, min_records)
    before = [p.rect for p in old.partitions] if old is not None else \
        kd_initial_partitions(counts, min_records=minimum)
    rects = refine_partitions(counts, queries, before, min_records=minimum,
                              rewrite_cost_per_record=settings.archive_rewrite_cost)
    # which old partition each new one comes from, and which old ones split
    parent: dict[int, Partition | None] = {}
    split: set[int] = set()
    for i, rect in enumerate(rects):
        p = None
        if old is not None:
            p = next((q for q in old.partitions if _contains(q.rect, rect)), None)
            if p is not None and p.rect != rect:
                split.add(id(p))
        parent[i] = p
    if not new_files and not split:
        log.info("compaction of %s: nothing new, no split pays (%d partitions)", tenant,
                 len(rects))
        return None
    version = max([old.version if old is not None else 0, *_versions(store, tenant)]) + 1
    vdir = store.version_dir(tenant, version)
    inputs = [f.path for f in new_files]
    if old is not None:
        inputs += [path for p in old.partitions if id(p) in split for path in p.files]
    moved = _write(spark, store, grid, rects, inputs, f"{vdir}/data")
    written = _written(store, f"{vdir}/data")
    partitions = []
    overlapping = queries.overlapping_many(np.asarray(rects, dtype=np.int64))
    for i, rect in enumerate(rects):
        p = parent[i]
        kept = p.files if p is not None and id(p) not in split else []
        files = kept + written.get(i, [])
        size = sum(store.fs.get_file_info(path).size or 0 for path in files)
        partitions.append(Partition(rect=rect, files=files, records=counts.count(*rect),
                                    bytes=size, queries=float(overlapping[i])))
    cells_path = f"{vdir}/cells.npy"
    buf = io.BytesIO()
    np.save(buf, counts.counts)
    store.write_bytes(cells_path, buf.getvalue())
    absorbed = dict(old.absorbed) if old is not None else {}
    for worker, bucket in cut.items():
        absorbed[worker] = max(bucket, absorbed.get(worker, bucket))
    manifest = Manifest(version=version, created=time.time(), grid=(grid.nx, grid.ny),
                        partitions=partitions, absorbed=absorbed, cells=cells_path)
    store.switch(tenant, manifest)
    done = Compacted(tenant=tenant, version=version, partitions=len(rects),
                     records=counts.total, moved=moved, split=len(split),
                     cost_before=layout_cost(counts, queries, before),
                     cost_after=layout_cost(counts, queries, rects),
                     seconds=time.monotonic() - started)
    log.info("compacted %s into v%d: %d partitions (%d split), %d records, %d written, cost "
             "%.3g -> %.3g, %.1f s", tenant, version, done.partitions, done.split,
             done.records, moved, done.cost_before, done.cost_after, done.seconds)
    return done


def _write(spark: SparkSession, store: ArchiveStore, grid: Grid, rects: list[Rect],
           inputs: list[str], out: str) -> int:
    """Write the records of `inputs` to their partitions under `out` (one file per
    partition, rows along the Z-order curve); the number of records written."""
    from spark.runner import SPARK_SCHEMA

    if not inputs:
        return 0
    df = spark.read.schema(SPARK_SCHEMA).parquet(*[store.uri(p) for p in inputs])
    cells = sorted(int(r["cell"]) for r in df.select("cell").distinct().collect())
    which = part_of_cells(grid, rects)
    mapping = spark.createDataFrame([(c, int(which[c])) for c in cells], "cell long, part int")
    if any(int(which[c]) < 0 for c in cells):
        raise RuntimeError("a record's cell lies in no partition of the new layout")
    rows = df.join(F.broadcast(mapping), "cell").select(*df.columns, "part")
    (rows.repartition("part").sortWithinPartitions("z", "id", "ts", "at")
     .write.partitionBy("part").mode("error").parquet(store.uri(out)))
    return int(sum(int(r) for r in _counted(store, out)))


def _counted(store: ArchiveStore, out: str) -> list[int]:
    return [pq.read_metadata(path, filesystem=store.fs).num_rows
            for paths in _written(store, out).values() for path in paths]


def _written(store: ArchiveStore, out: str) -> dict[int, list[str]]:
    """The Parquet files Spark wrote under `out`, per partition index."""
    sel = pafs.FileSelector(out, recursive=True, allow_not_found=True)
    got: dict[int, list[str]] = {}
    for info in store.fs.get_file_info(sel):
        if info.type != pafs.FileType.File or not info.base_name.endswith(".parquet"):
            continue
        parent = info.path.rsplit("/", 2)[-2]
        if parent.startswith("part="):
            got.setdefault(int(parent[5:]), []).append(info.path)
    return {k: sorted(v) for k, v in got.items()}


def compact_all(spark: SparkSession, settings: Settings, client: Any,
                tenants: list[str] | None = None, min_records: int | None = None
                ) -> list[Compacted]:
    """Compact every tenant's archive (or these)."""
    store = ArchiveStore(settings.archive_path)
    out = []
    for tenant in tenants or store.tenants():
        done = compact_tenant(spark, settings, client, tenant, min_records)
        if done is not None:
            out.append(done)
    return out

