"""Subscription TTL expiry: one api process at a time (a Redis lock) deletes expired
subscriptions from SQL, removes them from the workers and tells listening clients."""

from __future__ import annotations

import asyncio
import logging
import time

import redis.exceptions
from starlette.concurrency import run_in_threadpool

from app.core.db import session_scope
from app.core.metrics import SUBSCRIPTIONS_DELETED
from app.core.state import AppState
from app.models import Subscription
from app.services import subscriptions as sub_service

log = logging.getLogger(__name__)
LOCK = "gs:lock:expiry"


async def expire_once(state: AppState) -> int:
    if not await state.redis.set(LOCK, b"1", nx=True, px=5000):
        return 0
    try:
        def pop() -> list[Subscription]:
            with session_scope(state.sessions) as session:
                return sub_service.pop_expired(session, time.time())

        rows = await run_in_threadpool(pop)
        if rows and state.router is not None:
            await state.router.remove_subscriptions(rows, reason="expired")
            SUBSCRIPTIONS_DELETED.labels("expired").inc(len(rows))
        return len(rows)
    finally:
        await state.redis.delete(LOCK)


async def expiry_loop(state: AppState, period_s: float = 1.0) -> None:
    while True:
        try:
            n = await expire_once(state)
            if n:
                log.info("expired %d subscriptions", n)
        except asyncio.CancelledError:
            raise
        except (redis.exceptions.RedisError, OSError, Exception) as exc:  # noqa: BLE001
            log.warning("expiry round failed: %s", exc)
        await asyncio.sleep(period_s)
