"""`geoswarm ingest --to live`: valid rows published from the driver as `POST /v1/objects`
publishes them, through the api's `Router` (SWARM's routing by the current partition plan, the
publish script's last-writer-wins, quota check and once-only guard), LIVE_BATCH rows at a time.

What pushes the api's clients back makes ingest wait instead: a worker behind (`Overloaded`,
max_backlog), other publishes moving the same objects (`PublishContention`), Redis away for a
while. The tenant's quota of stored moving objects refuses a batch (its rows are rejected); the
api's rate limits (per key, tenant_publish_per_s) are the api's and do not apply.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import redis
from pyspark.sql import Row

from app.core.config import Settings
from app.core.redis import async_client
from app.pipeline.records import RecordBatch
from app.pipeline.router import ObjectQuotaExceeded, Overloaded, PublishContention, Router

LIVE_BATCH = 2_000  # rows per publish
RETRY_S = 1.0  # between publishes the system pushed back
REDIS_PATIENCE_S = 120.0  # how long publishing waits for an unreachable Redis


class NoPlan(Exception):
    """No partition plan: no worker has ever started against this Redis."""


def record_batch(tenant: str, rows: list[Row]) -> RecordBatch:
    """Validated rows (records, props as JSON text) as the api's batch."""
    ttl = [r["ttl_s"] for r in rows]
    return RecordBatch(
        tenant=tenant, ids=[r["id"] for r in rows], moving=[r["moving"] for r in rows],
        lon=[r["lon"] for r in rows], lat=[r["lat"] for r in rows], ts=[r["ts"] for r in rows],
        keywords=[list(r["keywords"]) for r in rows], text=[r["text"] for r in rows],
        props=[r["props"] for r in rows],
        size=len(rows), ttl_s=ttl if any(t is not None for t in ttl) else None)


class LivePublisher:
    """The `Router` on an event loop of its own (its callers are the driver's threads: the main
    one, and Spark's for a watch's micro-batches)."""

    def __init__(self, settings: Settings, redis_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="ingest-publish")
        self.thread.start()
        self.client = async_client(redis_url)
        self.router = Router(settings, self.client)
        self.waiting = ""  # why publishing waits now (for the progress line)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def check(self) -> None:
        """NoPlan unless a partition plan is there to route by."""
        try:
            self._run(self.router.current_index())
        except RuntimeError:
            raise NoPlan("no partition plan in Redis: no geoswarm worker has started against "
                         "it") from None

    def publish(self, batch: RecordBatch) -> str | None:
        """Publish one batch, waiting while the system pushes back; the reason when the
        tenant's quota refuses it. Redis errors beyond REDIS_PATIENCE_S are raised."""
        reason: str | None = self._run(self._publish(batch))
        return reason

    async def _publish(self, batch: RecordBatch) -> str | None:
        away_since: float | None = None
        while True:
            try:
                await self.router.publish(batch)
                self.waiting = ""
                return None
            except ObjectQuotaExceeded as exc:
                return f"not published: {exc}"
            except (Overloaded, PublishContention) as exc:
                self.waiting = str(exc)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self.waiting = f"Redis: {exc}"
                away_since = away_since or time.monotonic()
                if time.monotonic() - away_since > REDIS_PATIENCE_S:
                    raise
            await asyncio.sleep(RETRY_S)

    def close(self) -> None:
        try:
            self._run(self.client.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
