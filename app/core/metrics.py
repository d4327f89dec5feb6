"""Prometheus metrics of an api process (each api process serves its own /metrics), and the
cluster's dead letters, which it reads from Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import redis.asyncio as aioredis
import redis.exceptions
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from app.pipeline import names

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
QUOTA_REFUSED = Counter("geoswarm_quota_refused_total", "Requests refused by a tenant quota",
                        ["quota"])


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
