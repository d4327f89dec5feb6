"""Subscription TTL expiry: one api process at a time (a Redis lock) deletes expired
subscriptions from SQL, removes them from the workers and tells listening clients."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import redis.asyncio as aioredis
import redis.exceptions
from starlette.concurrency import run_in_threadpool

from app.core.db import session_scope
from app.core.metrics import SUBSCRIPTIONS_DELETED
from app.core.state import AppState
from app.models import Subscription
from app.pipeline import names
from app.services import subscriptions as sub_service

log = logging.getLogger(__name__)

LOCK_TTL_MS = 5000  # a round that outlives its lock may overlap the next holder's round

# Delete the lock only while it still holds our token: a round that outlived its lock must not
# release the lock another api process has taken since (GET then DEL would, between the two).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


async def acquire_lock(client: aioredis.Redis, key: str, ttl_ms: int) -> bytes | None:
    """Take `key` for `ttl_ms` unless someone holds it; the token to release it with."""
    token = secrets.token_hex(16).encode()
    return token if await client.set(key, token, nx=True, px=ttl_ms) else None


async def release_lock(client: aioredis.Redis, key: str, token: bytes) -> bool:
    """Release `key` if it is still ours (compare-and-delete); False if it had expired."""
    return bool(await client.register_script(_RELEASE)(keys=[key], args=[token]))


async def expire_once(state: AppState) -> int:
    token = await acquire_lock(state.redis, names.EXPIRY_LOCK, LOCK_TTL_MS)
    if token is None:
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
        if not await release_lock(state.redis, names.EXPIRY_LOCK, token):
            log.warning("the expiry round outlived its lock (%d ms)", LOCK_TTL_MS)


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
