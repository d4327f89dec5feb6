"""The query runner (`geoswarm query-runner`): one long-lived SparkSession that answers the
archive's share of snapshot queries.

The api sends a query's archive part (`wire.QueryPart` with the archive cut it read) to the
stream `names.ARCHIVE_JOBS`; runners read it in one consumer group, so each part is taken by
one runner, which pushes its `wire.QueryReply` (worker `names.ARCHIVE_WORKER`) to the part's
reply list, as a worker does. A runner beats in `names.RUNNERS_KEY`; the parts a runner took
and did not acknowledge when its heartbeat went stale are claimed by another runner and run
again (the api takes the first answer of each part). Parts past their deadline are dropped.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis
from pyspark.sql import DataFrame, SparkSession

from app.archive.counts import add_cells, file_cells, layout_counts
from app.archive.layout import ArchiveStore, Layout, read_layout
from app.core.config import Settings
from app.core.redis import sync_client
from app.geo.aqwa import CountGrid, knn_radius_m
from app.geo.geometry import circle_bbox
from app.pipeline import names, wire
from app.pipeline.cluster import heartbeat_fresh
from app.pipeline.router import grid_of
from spark.archive_query import Radius, evaluate
from spark.compact import log_query
from spark.scanmetrics import metered, scans_since

log = logging.getLogger(__name__)

READ_COUNT = 8
BLOCK_MS = 1000
CLAIM_EVERY_S = 2.0
REPLY_TTL_S = 120

SPARK_SCHEMA = ("id string, lon double, lat double, ts double, at double, moving boolean, "
                "keywords array<string>, text string, props string, cell long, z long, "
                "bucket long, worker string")



@dataclass
class TenantCounts:
    """The archive's count grid of one tenant (AQWA §4.2): the compacted layout's grid plus
    the per-cell counts its unabsorbed bucket files carry, added to as files appear, rebuilt
    when the layout changes or a file goes."""

    grid: CountGrid
    version: int | None
    files: set[str] = field(default_factory=set)


Cells = tuple[int, int, int, int]


class Archive:
    """What a runner reads: the store, each query's layout and files, the count grid."""

    def __init__(self, settings: Settings, spark: SparkSession) -> None:
        self.settings = settings
        self.spark = spark
        self.store = ArchiveStore(settings.archive_path)
        self.grid = grid_of(settings)
        self.grids: dict[str, TenantCounts] = {}
        self._cells: dict[str, dict[int, int]] = {}

    def frame(self, paths: list[str]) -> DataFrame | None:
        if not paths:
            return None
        return self.spark.read.schema(SPARK_SCHEMA).parquet(
            *[self.store.uri(p) for p in paths])

    def counts(self, tenant: str, layout: Layout) -> CountGrid:
        """The count grid of a layout of a tenant (each file's footer read once)."""
        held = self.grids.get(tenant)
        version = layout.manifest.version if layout.manifest is not None else None
        paths = {f.path for f in layout.buckets}
        if held is None or held.version != version or not held.files <= paths:
            held = self.grids[tenant] = TenantCounts(
                layout_counts(self.store, layout.manifest, self.grid), version)
        for path in sorted(paths - held.files):
            cells = self._cells.get(path)
            if cells is None:
                cells = self._cells[path] = file_cells(self.store, path)
            add_cells(held.grid, cells)
            held.files.add(path)
        return held.grid

    def region(self, q: wire.SnapshotQuery) -> Cells | None:
        """The global grid cells a query's region covers (None: no region)."""
        if q.bbox is not None:
            return self.grid.cell_range(q.bbox)
        if q.circle is not None:
            return self.grid.cell_range(circle_bbox(*q.circle))
        return None

    def answer(self, part: wire.QueryPart) -> tuple[wire.QueryReply, Cells | None]:
        """The archive's reply to a part, and the cells it read (None: all). A compaction
        deletes the files of the layout it replaced once its grace period has passed: a query
        that outlived it on the old layout finds a file gone, and runs again on the new one
        (the same records, laid out otherwise)."""
        layout = read_layout(self.store, part.tenant, part.cut or {})
        for attempt in range(1, LAYOUT_ATTEMPTS + 1):
            try:
                return self._answer_on(part, layout)
            except Exception as exc:
                if attempt == LAYOUT_ATTEMPTS or not _file_gone(exc):
                    raise
                newer = read_layout(self.store, part.tenant, part.cut or {})
                if _version(newer) == _version(layout):
                    raise
                log.info("archive query of %s read layout v%s, replaced by v%s meanwhile: "
                         "asked again", part.tenant, _version(layout), _version(newer))
                layout = newer
        raise AssertionError("unreachable")

    def _answer_on(self, part: wire.QueryPart, layout: Layout
                   ) -> tuple[wire.QueryReply, Cells | None]:
        read: list[Cells | None] = []

        def frames(cells: Cells | None) -> DataFrame | None:
            read.append(cells)
            return self.frame(layout.paths(cells))

        radius: Radius | None = None
        if part.query.type == "knn" and part.latest_of is None:
            counts = self.counts(part.tenant, layout)

            def radius(lon: float, lat: float, k: int) -> float | None:
                return knn_radius_m(counts, self.grid, lon, lat, k)

        reply = evaluate(self.spark, frames, part, radius, self.region)
        cells = None if not read or any(c is None for c in read) else read[-1]
        return reply, cells


LAYOUT_ATTEMPTS = 3


def _version(layout: Layout) -> int | None:
    return layout.manifest.version if layout.manifest is not None else None


def _file_gone(exc: BaseException) -> bool:
    """Whether Spark failed because a file it was to read no longer exists (classic Spark
    and Spark Connect word it the same): gone before the read started (FILE_NOT_EXIST), or
    during it, a data file or its checksum file deleted under the reader (a
    `java.nio.file.NoSuchFileException`, under FAILED_READ_FILE.NO_HINT)."""
    text = str(exc)
    return ("FILE_NOT_EXIST" in text or "FileNotFoundException" in text
            or "NoSuchFileException" in text)


class QueryRunner:
    """One query runner process (see the module docstring)."""

    def __init__(self, settings: Settings, runner_id: str, redis_url: str,
                 spark: Callable[[], SparkSession]) -> None:
        self.settings = settings
        self.id = runner_id
        self.redis: Any = sync_client(redis_url, socket_timeout=30)
        self.spark = spark
        self.archive: Archive | None = None
        self.stopping = False
        self.stopped = threading.Event()  # set with `stopping`: wakes the compaction loop
        self.started = time.time()
        self.done = 0
        self.failed = 0
        self.running = 0
        self.rows_read = 0
        self.bytes_read = 0
        self.last_execution = -1
        self.last_claim = 0.0

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.redis.xgroup_create(names.ARCHIVE_JOBS, names.RUNNER_GROUP, id="0",
                                     mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        # beating while Spark starts (seconds): the parts sent meanwhile wait in the stream
        self._heartbeat()
        threading.Thread(target=self._heartbeat_loop, daemon=True).start()
        self.archive = Archive(self.settings, self.spark())
        compactor = None
        if self.settings.archive_compact_s > 0:
            compactor = threading.Thread(target=self._compact_loop, daemon=True)
            compactor.start()
        log.info("query runner %s ready (pid %d), archive at %s", self.id, os.getpid(),
                 self.archive.store.url)
        # parts this runner took before a restart under the same id
        self._run_entries(self._pending_of([self.id]))
        while not self.stopping:
            try:
                if time.monotonic() - self.last_claim > CLAIM_EVERY_S:
                    self.last_claim = time.monotonic()
                    self._run_entries(self._orphans())
                got = self.redis.xreadgroup(names.RUNNER_GROUP, self.id,
                                            {names.ARCHIVE_JOBS: ">"}, count=READ_COUNT,
                                            block=BLOCK_MS)
                for _, entries in got or []:
                    self._run_entries(entries)
            except redis.ConnectionError as exc:
                log.warning("query runner %s: Redis unavailable (%s); retrying", self.id, exc)
                time.sleep(1)
        if compactor is not None and compactor.is_alive():
            # a compaction under way finishes (its switch and its lock) before the runner goes
            log.info("query runner %s: waiting for the compaction under way", self.id)
            compactor.join()
        self.redis.hdel(names.RUNNERS_KEY, self.id)

    def _compact_loop(self) -> None:
        """AQWA's compaction on a schedule (one runner at a time per tenant: a lock), beside
        the queries, which keep running on the old layout until the switch."""
        from spark.compact import compact_all

        while not self.stopped.wait(self.settings.archive_compact_s):
            if self.archive is None:
                return
            try:
                compact_all(self.archive.spark, self.settings, self.redis)
            except Exception:  # the next round tries again; queries go on
                log.exception("query runner %s: scheduled compaction failed", self.id)

    def _on_signal(self, *_: Any) -> None:
        self.stopping = True
        self.stopped.set()

    def _heartbeat(self) -> None:
        info = {"id": self.id, "pid": os.getpid(), "host": socket.gethostname(),
                "heartbeat": time.time(), "started": self.started, "done": self.done,
                "failed": self.failed, "running": self.running, "rows_read": self.rows_read,
                "bytes_read": self.bytes_read}
        self.redis.hset(names.RUNNERS_KEY, self.id, orjson.dumps(info))

    def _heartbeat_loop(self) -> None:
        while not self.stopping:
            try:
                self._heartbeat()
            except redis.RedisError:
                pass
            time.sleep(self.settings.worker_heartbeat_s)

    def _pending_of(self, consumers: list[str]) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Claim the parts these consumers took and did not acknowledge."""
        out: list[tuple[bytes, dict[bytes, bytes]]] = []
        for consumer in consumers:
            rows = self.redis.xpending_range(names.ARCHIVE_JOBS, names.RUNNER_GROUP, min="-",
                                             max="+", count=1000, consumername=consumer)
            ids = [r["message_id"] for r in rows]
            if ids:
                out += [e for e in self.redis.xclaim(names.ARCHIVE_JOBS, names.RUNNER_GROUP,
                                                     self.id, 0, ids) if e[1]]
        return out

    def _orphans(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Parts taken by runners whose heartbeat is stale (they died running them)."""
        summary = self.redis.xpending(names.ARCHIVE_JOBS, names.RUNNER_GROUP)
        consumers = [c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
                     for c in (summary or {}).get("consumers") or []]
        others = [c for c in consumers if c != self.id]
        if not others:
            return []
        beats = self.redis.hmget(names.RUNNERS_KEY, others)
        now = time.time()
        dead = [c for c, b in zip(others, beats, strict=True)
                if not heartbeat_fresh(b, now, self.settings.worker_dead_after_s)]
        if dead:
            log.info("query runner %s takes over the parts of %s", self.id, dead)
        return self._pending_of(dead)

    def _run_entries(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        for eid, fields in entries:
            try:
                part = wire.decode_query_part(fields)
            except ValueError as exc:
                log.error("query runner %s: undecodable part %s: %s", self.id, eid, exc)
                self.redis.xack(names.ARCHIVE_JOBS, names.RUNNER_GROUP, eid)
                continue
            if time.time() <= part.deadline:
                self._answer(part)
            pipe = self.redis.pipeline(transaction=False)
            pipe.xack(names.ARCHIVE_JOBS, names.RUNNER_GROUP, eid)
            pipe.xdel(names.ARCHIVE_JOBS, eid)
            pipe.execute()

    def _log_query(self, part: wire.QueryPart, cells: Cells | None) -> None:
        """AQWA's query log: the region (grid cells) each archive query read, for compaction
        (`spark.compact`)."""
        if self.archive is None:
            return
        grid = self.archive.grid
        log_query(self.redis, part.tenant,
                  cells if cells is not None else (0, 0, grid.nx - 1, grid.ny - 1), time.time())

    def _answer(self, part: wire.QueryPart) -> None:
        assert self.archive is not None
        self.running += 1
        started = time.monotonic()
        with metered() as connect_scans:
            try:
                reply, cells = self.archive.answer(part)
                self.done += 1
                if part.latest_of is None:
                    self._log_query(part, cells)
            except Exception as exc:  # a query must not take the runner down
                log.exception("query runner %s: archive query failed", self.id)
                self.failed += 1
                reply = wire.QueryReply(worker=names.ARCHIVE_WORKER,
                                        error=f"{type(exc).__name__}: {exc}")
            finally:
                self.running -= 1
        scans = scans_since(self.archive.spark, self.last_execution)
        if scans is None:  # a Spark Connect client: the figures came back with each action
            scans = connect_scans
        self.last_execution = scans.last
        self.rows_read += scans.rows
        self.bytes_read += scans.bytes
        log.info("archive part of %s (%s) answered in %.3f s: %d rows, %d bytes in %d files "
                 "read", part.tenant, part.query.type, time.monotonic() - started, scans.rows,
                 scans.bytes, scans.files)
        key = names.query_reply_key(part.reply)
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(key, wire.encode_query_reply(reply))
        pipe.expire(key, REPLY_TTL_S)
        pipe.execute()


def run_query_runner(settings: Settings, runner_id: str, redis_url: str) -> None:
    from spark.session import get_spark

    runner = QueryRunner(settings, runner_id, redis_url,
                         lambda: get_spark(settings, app_name=f"geoswarm-query-runner-{runner_id}"))
    try:
        runner.run()
    finally:
        if runner.archive is not None:
            runner.archive.spark.stop()
