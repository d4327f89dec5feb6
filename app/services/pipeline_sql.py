"""Apply a subscription change to SQL and to the live pipeline together, all or nothing.

Creating: the rows are flushed, the control messages appended to the worker streams, and only
then is the transaction committed; a failed append rolls SQL back, a failed commit is undone in
the pipeline (the new ids are never used again, so the workers' tombstones are harmless).

Deleting goes the other way round, because a removal cannot be undone in the pipeline: the
workers tombstone a removed id and ignore it if it is added back. So the SQL commit comes first
(a failure leaves the subscription whole), then the workers are told (retried, as the removal is
idempotent); if they cannot be told, the row is restored as it was and the subscription stays
whole: alive in SQL and still matching.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis.exceptions
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from app.core.db import session_scope
from app.core.metrics import SUBSCRIPTIONS_CREATED, SUBSCRIPTIONS_DELETED
from app.core.state import AppState, require_plan
from app.models import Subscription
from app.services import subscriptions as sub_service

log = logging.getLogger(__name__)

# Pauses between the attempts to tell the workers of a deletion (a Redis failover or a lost
# reply): about a second in all before the deletion is given up and undone.
REMOVE_RETRIES_S = (0.1, 0.3, 0.6)


async def add_with_pipeline(
    state: AppState, change: Callable[[Any], list[Subscription]]
) -> list[Subscription]:
    """Create subscriptions: `change` adds the rows to the session (and flushes them)."""
    await require_plan(state)
    session = state.sessions()
    try:
        rows = await run_in_threadpool(change, session)
        if rows and state.router is not None:
            await state.router.add_subscriptions(rows)
        try:
            await run_in_threadpool(session.commit)
        except BaseException:
            if rows and state.router is not None:
                await state.router.remove_subscriptions(rows)
            raise
        SUBSCRIPTIONS_CREATED.inc(len(rows))
        return rows
    except BaseException:
        await run_in_threadpool(session.rollback)
        raise
    finally:
        await run_in_threadpool(session.close)


def _copy(row: Subscription) -> Subscription:
    """A transient copy of a row's values (to restore it, or to name it to the workers)."""
    return Subscription(seq=row.seq, id=row.id, tenant=row.tenant, type=row.type,
                        spec=dict(row.spec), created_at=row.created_at,
                        expires_at=row.expires_at)


async def delete_with_pipeline(state: AppState, tenant: str, sub_id: str) -> bool:
    """Delete one subscription of `tenant` from SQL and from the pipeline, all or nothing;
    False when there is no such subscription. See the module's docstring for the order."""
    await require_plan(state)
    deleted: list[Subscription] = []

    def delete() -> bool:
        with session_scope(state.sessions) as session:
            row = sub_service.delete_one(session, tenant, sub_id)
            if row is None:
                return False
            deleted.append(_copy(row))
        return True

    def still_there() -> bool:
        with state.sessions() as session:
            return sub_service.get(session, tenant, sub_id) is not None

    try:
        if not await run_in_threadpool(delete):
            return False
    except Exception:
        # A commit may fail after the database applied it (the connection died with COMMIT
        # sent): then the row is gone and the workers must be told, or it would go on matching
        # unseen. Otherwise nothing changed, and the failure is the answer.
        if not deleted:
            raise
        try:
            gone = not await run_in_threadpool(still_there)
        except Exception:
            gone = False
        if not gone:
            raise
        log.warning("the commit deleting subscription %s failed but took effect", sub_id)
    row = deleted[0]
    # Shielded: once the row is deleted, a cancelled request must not stop halfway between
    # telling the workers and restoring it.
    await asyncio.shield(_remove_or_restore(state, row))
    SUBSCRIPTIONS_DELETED.labels("deleted").inc()
    return True


async def _remove_or_restore(state: AppState, row: Subscription) -> None:
    router = state.router
    if router is None:
        return
    for pause in (*REMOVE_RETRIES_S, None):
        try:
            await router.remove_subscriptions([row])
            return
        except Exception as exc:
            if pause is None or not isinstance(exc, redis.exceptions.RedisError | OSError):
                await _restore(state, row, exc)
                raise
            log.warning("telling the workers of the deletion of %s failed (%s); retrying",
                        row.id, exc)
            await asyncio.sleep(pause)


async def _restore(state: AppState, row: Subscription, cause: BaseException) -> None:
    """Put a deleted row back as it was, because the workers could not be told of its deletion
    (they still match it). With the same seq, so it keeps its place in the listing, unless
    that seq was taken meanwhile (SQLite reuses the largest)."""

    def insert(keep_seq: bool) -> None:
        copy = _copy(row)
        if not keep_seq:
            copy.seq = None  # type: ignore[assignment]
        with session_scope(state.sessions) as session:
            session.add(copy)

    try:
        try:
            await run_in_threadpool(insert, True)
        except IntegrityError:
            await run_in_threadpool(insert, False)
    except Exception as exc:
        log.error("subscription %s is deleted in SQL but the workers could not be told (%s), "
                  "and restoring it failed (%s): it matches unseen until the workers restart",
                  row.id, cause, exc)
        return
    log.error("subscription %s restored: the workers could not be told of its deletion (%s). "
              "Should the removal have reached them after all, they no longer match it: "
              "restarting them rebuilds their subscriptions from SQL", row.id, cause)
