"""Per-tenant quotas (settings `tenant_*`, 0: unlimited): live subscriptions, counted in SQL
inside the creating transaction under a lock on the tenant, so concurrent creates cannot
overshoot; open WebSockets over every api process, as slots in Redis that expire unless their
process renews them, so a crashed process frees its slots; objects published per second, a
bucket in Redis shared by every api process. Over a quota: 429 (a WebSocket closes with 1008),
with a message naming the quota and its value."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time

import redis.exceptions
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.core.errors import RateLimited, is_redis_oom
from app.core.metrics import QUOTA_REFUSED
from app.core.pipelines import eval_script
from app.core.state import AppState
from app.models import Subscription, Tenant
from app.pipeline import names
from app.services.keys import ensure_tenant

log = logging.getLogger(__name__)

# When no subscription of the tenant has a TTL, a slot frees only when the client deletes one:
# a retry within a minute is pointless.
SUBSCRIPTIONS_RETRY_S = 60

# --- live subscriptions ---------------------------------------------------------------------


def check_subscriptions(session: Session, tenant: str, adding: int, limit: int) -> None:
    """Refuse (429) `adding` more subscriptions when they would take the tenant's live ones
    over `limit`. Call in the transaction that creates them, before adding the rows: the lock
    it takes on the tenant is held until that transaction ends, so the creates of one tenant
    count one after the other (exactly, also across api processes)."""
    if limit <= 0:
        return
    ensure_tenant(session, tenant)
    _lock_tenant(session, tenant)
    now = time.time()
    live = session.scalar(
        select(func.count()).select_from(Subscription)
        .where(Subscription.tenant == tenant)
        .where(Subscription.expires_at.is_(None) | (Subscription.expires_at > now))) or 0
    if live + adding <= limit:
        return
    first_expiry = session.scalar(
        select(func.min(Subscription.expires_at))
        .where(Subscription.tenant == tenant, Subscription.expires_at > now))
    retry = (SUBSCRIPTIONS_RETRY_S if first_expiry is None
             else max(1, math.ceil(first_expiry - now)))
    QUOTA_REFUSED.labels("subscriptions").inc()
    raise RateLimited(f"tenant quota of {limit} subscriptions reached ({live} live, "
                      f"{adding} more asked for)", headers={"Retry-After": str(retry)})


def _lock_tenant(session: Session, tenant: str) -> None:
    """Make concurrent creators of one tenant wait for each other until commit. PostgreSQL:
    lock the tenant's row (FOR NO KEY UPDATE, which the foreign-key checks of inserted rows,
    KEY SHARE, do not wait for). SQLite has one writer at a time: a write that changes nothing
    makes this transaction the writer before it counts (pysqlite begins the transaction at
    the first write, so the count that follows cannot read an older snapshot); it writes a
    column no foreign key refers to, so SQLite checks no referencing rows."""
    if session.get_bind().dialect.name == "sqlite":
        session.execute(update(Tenant).where(Tenant.name == tenant)
                        .values(created_at=Tenant.created_at)
                        .execution_options(synchronize_session=False))
    else:
        session.execute(select(Tenant.name).where(Tenant.name == tenant)
                        .with_for_update(key_share=True))


# --- WebSocket connections ------------------------------------------------------------------

# KEYS[1] the tenant's slots; ARGV slot id, limit, ttl (ms). Drops expired slots, then takes
# one unless `limit` are taken: {1, count} taken, {0, count} refused.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[2]) then
    return {0, n}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, n + 1}
"""


def slot_ttl_ms(state: AppState) -> int:
    return max(1, round(state.settings.ws_slot_ttl_s * 1000))


async def acquire_connection(state: AppState, tenant: str) -> str | None:
    """Take one of the tenant's WebSocket slots: its id (release it when the connection
    ends), or None when the quota is off or Redis is out of memory (the connection is then
    not counted). 429 when every slot is taken."""
    limit = state.settings.tenant_max_connections
    if limit <= 0:
        return None
    slot = secrets.token_hex(12)
    try:
        taken, _count = await state.redis.register_script(_ACQUIRE)(
            keys=[names.ws_slots_key(tenant)], args=[slot, limit, slot_ttl_ms(state)])
    except redis.exceptions.ResponseError as exc:
        if not is_redis_oom(exc):
            raise
        # The quota protects the server; a full Redis must not also refuse every client.
        log.warning("WebSocket of tenant %s not counted: Redis is out of memory", tenant)
        return None
    if not int(taken):
        QUOTA_REFUSED.labels("connections").inc()
        # short: it is a WebSocket close reason (at most 123 bytes)
        raise RateLimited(f"tenant quota of {limit} WebSocket connections reached")
    return slot


async def release_connection(state: AppState, tenant: str, slot: str) -> None:
    await state.redis.zrem(names.ws_slots_key(tenant), slot)


async def renew_connections(state: AppState) -> int:
    """Extend the slots of this process's open WebSockets by the TTL; the number renewed. A
    slot that expired meanwhile (renewals late while Redis was unreachable) is taken again,
    over the quota if need be: the connection is open, so it counts."""
    hub = state.hub
    if hub is None:
        return 0
    held = [(c.principal.tenant, c.slot) for c in hub.conns if c.slot is not None]
    if not held:
        return 0
    ttl = slot_ttl_ms(state)
    sec, usec = await state.redis.time()
    expires = int(sec) * 1000 + int(usec) // 1000 + ttl
    # XX: a slot released while this round runs is not brought back
    pipe = state.redis.pipeline(transaction=False)
    for tenant, slot in held:
        pipe.zadd(names.ws_slots_key(tenant), {slot: expires}, xx=True, ch=True)
    for tenant in {t for t, _ in held}:
        pipe.pexpire(names.ws_slots_key(tenant), ttl)
    changed = (await pipe.execute())[:len(held)]
    still_open = {c.slot for c in hub.conns}
    lost = [(t, s) for (t, s), n in zip(held, changed, strict=True) if not n and s in still_open]
    if lost:
        pipe = state.redis.pipeline(transaction=False)
        for tenant, slot in lost:
            pipe.zadd(names.ws_slots_key(tenant), {slot: expires})
            pipe.pexpire(names.ws_slots_key(tenant), ttl)
        await pipe.execute()
    return len(held)


async def slot_renew_loop(state: AppState) -> None:
    while True:
        await asyncio.sleep(state.settings.ws_slot_ttl_s / 3)
        try:
            await renew_connections(state)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried next period, well within the TTL
            log.warning("renewing the WebSocket slots failed: %s", exc)


# --- publish rate ---------------------------------------------------------------------------

# A generic cell rate algorithm: KEYS[1] holds when everything the tenant published so far is
# paid for at ARGV[2] objects per second (ms of Redis time). A batch of ARGV[1] objects is
# admitted while that stays within one second from now (or, for a batch larger than one
# second's worth, when nothing is owed), and the debt carries over: over any stretch of time
# the tenant publishes at most one second's worth beyond the rate, however it batches.
# Returns 0 when admitted (and charged), else the ms to wait. A refused batch costs nothing.
_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local cost = tonumber(ARGV[1]) * 1000 / tonumber(ARGV[2])
local burst = math.max(1000, cost)
local paid = tonumber(redis.call('GET', KEYS[1]) or '0')
if paid < now then
    paid = now
end
local after = paid + cost
if after - now > burst then
    return math.max(1, math.ceil(after - now - burst))
end
redis.call('SET', KEYS[1], string.format('%.3f', after), 'PX', math.ceil(after - now) + 1000)
return 0
"""


async def charge_publish(state: AppState, tenant: str, n_objects: int) -> None:
    """Charge a publish of `n_objects` to the tenant's rate (`tenant_publish_per_s`, shared by
    every api process); 429 with Retry-After when over it, and then nothing is charged. Call
    it once the batch is validated, right before queueing it."""
    limit = state.settings.tenant_publish_per_s
    if limit <= 0 or n_objects <= 0:
        return
    try:
        wait_ms = int(await eval_script(state.pipelines, _CHARGE,
                                        [names.publish_bucket_key(tenant)], [n_objects, limit]))
    except redis.exceptions.ResponseError as exc:
        if not is_redis_oom(exc):
            raise
        log.warning("publish of tenant %s not charged: Redis is out of memory", tenant)
        return
    if wait_ms > 0:
        QUOTA_REFUSED.labels("publish").inc()
        retry = max(1, math.ceil(wait_ms / 1000))
        raise RateLimited(f"tenant quota of {limit} published objects per second reached; "
                          f"retry in {retry} s", headers={"Retry-After": str(retry)})
