"""The shared handles of one api process (settings, SQL, Redis, router, hub), built by the
app's lifespan and read by the routes, the hub and the background loops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.core.config import Settings
from app.core.errors import Unavailable
from app.core.pipelines import Pipelines
from app.core.security import KeyCache

if TYPE_CHECKING:
    from app.pipeline.hub import Hub
    from app.pipeline.queries import QueryService
    from app.pipeline.router import Router


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    redis: aioredis.Redis
    redis_url: str
    pipelines: Pipelines  # the per-request hot path's Redis calls (`app.core.pipelines`)
    router: Router | None = None
    hub: Hub | None = None
    queries: QueryService | None = None
    keys: KeyCache | None = None  # keys checked in SQL (deps.authenticate), if caching


async def require_plan(state: AppState) -> None:
    """503 while there is no partition plan (no worker has started yet)."""
    if state.router is None:
        raise Unavailable("the live pipeline is not running", headers={"Retry-After": "1"})
    try:
        await state.router.current_index()
    except RuntimeError:
        raise Unavailable("no partition plan yet: no worker has started",
                          headers={"Retry-After": "1"}) from None
