"""Apply a subscription change to SQL and to the live pipeline together, all or nothing.

The SQL change is flushed, the control messages are appended to the worker streams, and only
then is the transaction committed; a failed append rolls SQL back, a failed commit is undone in
the pipeline, so a rejected request changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool

from app.core.metrics import SUBSCRIPTIONS_CREATED, SUBSCRIPTIONS_DELETED
from app.core.state import AppState, require_plan
from app.models import Subscription


async def apply_with_pipeline(
    state: AppState, change: Callable[[Any], list[Subscription]], *, added: bool
) -> list[Subscription]:
    await require_plan(state)
    session = state.sessions()
    try:
        rows = await run_in_threadpool(change, session)
        if rows and state.router is not None:
            if added:
                await state.router.add_subscriptions(rows)
            else:
                await state.router.remove_subscriptions(rows)
        try:
            await run_in_threadpool(session.commit)
        except BaseException:
            if rows and state.router is not None:
                router = state.router
                undo = router.remove_subscriptions if added else router.add_subscriptions
                await undo(rows)
            raise
        if added:
            SUBSCRIPTIONS_CREATED.inc(len(rows))
        else:
            SUBSCRIPTIONS_DELETED.labels("deleted").inc(len(rows))
        return rows
    except BaseException:
        await run_in_threadpool(session.rollback)
        raise
    finally:
        await run_in_threadpool(session.close)
