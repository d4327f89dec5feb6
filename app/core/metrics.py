"""Prometheus metrics of an api process (each api process serves its own /metrics), and the
cluster's dead letters and the workers' and runners' heartbeat figures, which it reads from
Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import orjson
import redis.asyncio as aioredis
import redis.exceptions
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from app.pipeline import names
from app.pipeline.hops import HopTimes, cumulative, read_doc

OBJECTS_ACCEPTED = Counter("geoswarm_objects_accepted_total", "Objects accepted (202)")
PUBLISH_SECONDS = Histogram("geoswarm_publish_seconds", "Time to validate and queue a batch",
                            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
SUBSCRIPTIONS_CREATED = Counter("geoswarm_subscriptions_created_total", "Subscriptions created")
SUBSCRIPTIONS_DELETED = Counter("geoswarm_subscriptions_deleted_total",
                                "Subscriptions deleted or expired", ["reason"])
WS_CONNECTIONS = Gauge("geoswarm_ws_connections", "Open WebSocket connections")
WS_MESSAGES = Counter("geoswarm_ws_messages_total", "Messages sent to WebSocket clients",
                      ["path"])
WS_CLOSED = Counter("geoswarm_ws_closed_total", "WebSockets closed by the server", ["code"])
COUNT_QUERIES = Counter("geoswarm_count_queries_total",
                        "Count queries, by how whole cells were counted: from the workers' "
                        "per-cell counts (metadata) or by the workers", ["path"])
ROUTED_ROWS = Counter("geoswarm_routed_rows_total",
                      "Rows routed to the workers, by whether the router marked them as matching "
                      "no subscription there by the workers' keyword summaries (no_match) or "
                      "not (to_match)", ["mark"])
QUOTA_REFUSED = Counter("geoswarm_quota_refused_total", "Requests refused by a tenant quota",
                        ["quota"])


# This api process's hops of the live path (app.pipeline.hops): validate and append for the
# objects it accepts, notify, send and total for the matches its hub pushes.
HOPS = HopTimes()


class Hops(Collector):
    """`geoswarm_hop_seconds{hop}`: this api process's hops (HOPS)."""

    def collect(self) -> Iterable[Metric]:
        m = HistogramMetricFamily("geoswarm_hop_seconds", "Seconds objects (or matches) took "
                                  "on a hop of the live path in this api process",
                                  labels=["hop"])
        for hop, (counts, total) in sorted(read_doc(HOPS.doc()).items()):
            m.add_metric([hop], cumulative(counts), total)
        yield m

    def describe(self) -> Iterable[Metric]:
        return []


REGISTRY.register(Hops())


class DeadLetters(Collector):
    """The cluster's dead letters as Redis counts them (workers serve no /metrics): how many
    entries were ever dead-lettered, and how many wait in the stream. Read from Redis before
    each scrape (`refresh`); left out of the scrape while Redis does not answer."""

    def __init__(self) -> None:
        self.total: float | None = None
        self.waiting: float | None = None

    async def refresh(self, client: aioredis.Redis, timeout: float = 2.0) -> None:
        pipe = client.pipeline(transaction=False)
        pipe.get(names.DEAD_LETTER_COUNT)
        pipe.xlen(names.DEAD_LETTER)
        try:
            total, waiting = await asyncio.wait_for(pipe.execute(), timeout)
            self.total, self.waiting = float(total or 0), float(waiting)
        except (redis.exceptions.RedisError, OSError, TimeoutError, ValueError):
            self.total = self.waiting = None

    def collect(self) -> Iterable[Metric]:
        if self.total is not None:
            yield CounterMetricFamily(
                "geoswarm_dead_letters", "Stream entries the workers dead-lettered (cluster-wide)",
                value=self.total)
        if self.waiting is not None:
            yield GaugeMetricFamily(
                "geoswarm_dead_letters_waiting",
                "Dead letters in the dead-letter stream (cluster-wide)", value=self.waiting)

    def describe(self) -> Iterable[Metric]:
        yield CounterMetricFamily("geoswarm_dead_letters", "", value=0)
        yield GaugeMetricFamily("geoswarm_dead_letters_waiting", "", value=0)


DEAD_LETTERS = DeadLetters()
REGISTRY.register(DEAD_LETTERS)


class HeartbeatFigures(Collector):
    """What the workers and query runners report in their heartbeats (neither serves
    /metrics): per worker, its hops of the live path (app.pipeline.hops), how long partition
    moves held its step, the buckets its process flushed to the archive, how late the last
    one was (seconds after its bucket left the window) and its archive cut, and the rows it
    did not match by the routers' marks from its keyword summaries; per runner, archive query
    parts answered, failed and running, and the rows and bytes its Spark scans read; the parts
    waiting in the job stream. Read before each scrape."""

    def __init__(self) -> None:
        self.workers: dict[str, dict[str, Any]] = {}
        self.hops: dict[str, dict[str, tuple[list[int], float]]] = {}
        self.moves: dict[str, dict[str, tuple[list[int], float]]] = {}
        self.runners: dict[str, dict[str, Any]] = {}
        self.queued: int | None = None

    async def refresh(self, client: aioredis.Redis, timeout: float = 2.0) -> None:
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(names.WORKERS_KEY)
        pipe.hgetall(names.RUNNERS_KEY)
        pipe.xlen(names.ARCHIVE_JOBS)
        try:
            workers, runners, queued = await asyncio.wait_for(pipe.execute(), timeout)
        except (redis.exceptions.RedisError, OSError, TimeoutError):
            self.workers, self.hops, self.moves, self.runners, self.queued = {}, {}, {}, {}, None
            return
        docs = _docs(workers)
        self.workers = {k: {**(doc.get("archive") or {}),
                            "skipped": doc.get("skipped_by_summary")} for k, doc in docs}
        self.hops = {k: read_doc(doc.get("hops")) for k, doc in docs}
        self.moves = {k: read_doc(doc.get("moves")) for k, doc in docs}
        self.runners = dict(_docs(runners))
        self.queued = int(queued)

    def collect(self) -> Iterable[Metric]:
        per_worker = [
            ("geoswarm_archive_buckets_flushed", "flushed", CounterMetricFamily,
             "Buckets a worker process wrote to the archive"),
            ("geoswarm_archive_flush_lag_seconds", "lag_s", GaugeMetricFamily,
             "How long the last bucket flushed had been out of the window"),
            ("geoswarm_archive_cut_bucket", "cut", GaugeMetricFamily,
             "A worker's archive cut: the last arrival bucket whose files are committed"),
            ("geoswarm_worker_rows_skipped", "skipped", CounterMetricFamily,
             "Rows a worker process stored without matching them: the router marked them by "
             "its keyword summary, which was still current")]
        for name, field, family, doc in per_worker:
            m = family(name, doc, labels=["worker"])
            for w, fig in sorted(self.workers.items()):
                if isinstance(fig.get(field), int | float):
                    m.add_metric([w], float(fig[field]))
            yield m
        per_runner = [
            ("geoswarm_archive_jobs_done", "done", CounterMetricFamily,
             "Archive query parts a runner answered"),
            ("geoswarm_archive_jobs_failed", "failed", CounterMetricFamily,
             "Archive query parts a runner failed"),
            ("geoswarm_archive_jobs_running", "running", GaugeMetricFamily,
             "Archive query parts a runner is running"),
            ("geoswarm_archive_rows_read", "rows_read", CounterMetricFamily,
             "Rows a runner's Spark scans of the archive read"),
            ("geoswarm_archive_bytes_read", "bytes_read", CounterMetricFamily,
             "Bytes of archive files a runner's Spark scans read")]
        for name, field, family, doc in per_runner:
            m = family(name, doc, labels=["runner"])
            for r, fig in sorted(self.runners.items()):
                if isinstance(fig.get(field), int | float):
                    m.add_metric([r], float(fig[field]))
            yield m
        histograms = [
            ("geoswarm_worker_hop_seconds", "hop", self.hops,
             "Seconds objects took on a worker's hops of the live path (queued, match, "
             "write), as its heartbeat reports them"),
            ("geoswarm_worker_move_seconds", "side", self.moves,
             "Seconds a worker's step spent on partitions changing hands, processing nothing "
             "else meanwhile: handing them off (give), taking a handoff (take) or a dead "
             "worker's partitions (takeover)")]
        for name, label, figures, doc in histograms:
            h = HistogramMetricFamily(name, doc, labels=[label, "worker"])
            for w, held in sorted(figures.items()):
                for part, (counts, total) in sorted(held.items()):
                    h.add_metric([part, w], cumulative(counts), total)
            yield h
        if self.queued is not None:
            yield GaugeMetricFamily("geoswarm_archive_jobs_queued",
                                    "Archive query parts in the job stream", value=self.queued)

    def describe(self) -> Iterable[Metric]:
        return []


def _docs(raw: dict[Any, Any]) -> list[tuple[Any, dict[str, Any]]]:
    out = []
    for key, value in raw.items():
        try:
            doc = orjson.loads(value)
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            out.append((key.decode() if isinstance(key, bytes) else key, doc))
    return out


HEARTBEAT_FIGURES = HeartbeatFigures()
REGISTRY.register(HEARTBEAT_FIGURES)
