"""TTL expiry, one api process at a time (a Redis lock): expired subscriptions are deleted from
SQL, removed from the workers and listening clients are told; moving objects not updated
within their TTL leave the latest-position store and the workers' kNN state."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
from starlette.concurrency import run_in_threadpool

from app.core.db import session_scope
from app.core.metrics import SUBSCRIPTIONS_DELETED
from app.core.state import AppState
from app.models import Subscription
from app.pipeline import names
from app.pipeline.outbox import ENCODE_OPS_LUA
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


# Moving objects whose TTL passed leave the latest-position store, and every worker is told
# (wire.ObjectsGone, msgpack map {t, tn, ids}) in the same step, so none keeps them in a kNN
# list. An object updated meanwhile has a later expiry and is not among them.
# KEYS: positions hash, expiry zset, then either the tenants with expiries and the worker
# streams, or (with outboxes, `app.pipeline.outbox`) the tenant's outbox. ARGV: now, most
# objects per call, tenant, then with the outbox the worker streams. Returns how many left.
# (Through an outbox the tenant stays in the set: its removal would race with a publish
# adding it, in another slot.)
OBJECTS_GONE_SCRIPT = ENCODE_OPS_LUA + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
local outbox = #ARGV > 3
if #ids == 0 then
  if not outbox and redis.call('ZCARD', KEYS[2]) == 0 then
    redis.call('SREM', KEYS[3], ARGV[3])
  end
  return 0
end
for _, id in ipairs(ids) do redis.call('HDEL', KEYS[1], id) end
redis.call('ZREM', KEYS[2], unpack(ids))
local msg = cmsgpack.pack({t = 'gone', tn = ARGV[3], ids = ids})
if outbox then
  local ops = {}
  for s = 4, #ARGV do ops[#ops + 1] = encode_op({'XADD', ARGV[s], '*', 'm', msg}) end
  redis.call('XADD', KEYS[3], '*', 'm', table.concat(ops))
  return #ids
end
for s = 4, #KEYS do redis.call('XADD', KEYS[s], '*', 'm', msg) end
return #ids
"""
OBJECTS_PER_CALL = 1000


async def expire_objects(state: AppState, now: float) -> int:
    """Moving objects past their TTL, of every tenant: out of the store and the workers."""
    if state.router is None:
        return 0
    index = await state.router.current_index()
    streams = [names.worker_stream(w) for w in index.workers]
    script = state.redis.register_script(OBJECTS_GONE_SCRIPT)
    total = 0
    outbox = state.router.outbox is not None
    for raw in await state.redis.smembers(names.OBJECT_EXPIRY_TENANTS):
        tenant = raw.decode() if isinstance(raw, bytes) else str(raw)
        keys = [names.positions_key(tenant), names.object_expiry_key(tenant)]
        args: list[Any] = [now, OBJECTS_PER_CALL, tenant]
        if outbox:
            keys.append(names.tenant_outbox(tenant))
            args += streams
        else:
            keys += [names.OBJECT_EXPIRY_TENANTS, *streams]
        while True:
            n = int(await script(keys=keys, args=args))
            total += n
            if n < OBJECTS_PER_CALL:
                break
        if outbox:
            await state.router.relay_tenant(tenant)
    return total


async def relay_outboxes(state: AppState) -> None:
    """Relay what tenants' outboxes still hold (an api process died between a write and its
    relay; a relay failed): everything queued reaches the workers."""
    if state.router is None or state.router.outbox is None:
        return
    for raw in await state.redis.smembers(names.OUTBOX_TENANTS):
        await state.router.relay_tenant(raw.decode() if isinstance(raw, bytes) else str(raw))


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
        await relay_outboxes(state)
        gone = await expire_objects(state, time.time())
        if gone:
            log.info("%d moving objects outlived their TTL", gone)
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
