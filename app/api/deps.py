"""Annotated dependencies: settings, DB session, Redis, the authenticated tenant or admin."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import redis.asyncio as aioredis
from fastapi import Depends, Request, WebSocket
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from app.core.config import Settings
from app.core.errors import Forbidden, RateLimited, Unauthorized
from app.core.security import Principal, bootstrap_principal
from app.services import keys as key_service

if TYPE_CHECKING:
    from app.pipeline.hub import Hub
    from app.pipeline.router import Router


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    redis: aioredis.Redis
    redis_url: str
    router: Router | None = None
    hub: Hub | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def get_state(request: Request) -> AppState:
    return request.app.state.gs  # type: ignore[no-any-return]


StateDep = Annotated[AppState, Depends(get_state)]


def get_settings_dep(state: StateDep) -> Settings:
    return state.settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def get_session(state: StateDep) -> Iterator[Session]:
    session = state.sessions()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]


def get_redis(state: StateDep) -> aioredis.Redis:
    return state.redis


RedisDep = Annotated[aioredis.Redis, Depends(get_redis)]


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _lookup(state: AppState, key: str) -> Principal | None:
    principal = bootstrap_principal(key, state.settings.bootstrap_admin_key)
    if principal is not None:
        return principal
    with state.sessions() as session:
        return key_service.lookup(session, key)


async def authenticate(state: AppState, key: str | None) -> Principal:
    if key is None:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if len(key) > 256:
        raise Unauthorized("unknown or revoked API key")
    principal = await run_in_threadpool(_lookup, state, key)
    if principal is None:
        raise Unauthorized("unknown or revoked API key")
    return principal


async def rate_limit(state: AppState, principal: Principal) -> None:
    limit = state.settings.rate_limit_per_s
    if limit <= 0:
        return
    now = time.time()
    window = int(now)
    counter = f"gs:rl:{principal.key_id}:{window}"
    pipe = state.redis.pipeline(transaction=False)
    pipe.incr(counter)
    pipe.expire(counter, 2)
    count, _ = await pipe.execute()
    if int(count) > limit:
        retry = max(1, int(window + 1 - now + 0.999))
        raise RateLimited(f"rate limit of {limit} requests/s per key exceeded",
                          headers={"Retry-After": str(retry)})


async def get_principal(request: Request, state: StateDep) -> Principal:
    principal = await authenticate(state, bearer_token(request.headers.get("authorization")))
    await rate_limit(state, principal)
    request.state.principal = principal
    return principal


TenantDep = Annotated[Principal, Depends(get_principal)]


async def get_admin(principal: TenantDep) -> Principal:
    if not principal.admin:
        raise Forbidden("this endpoint needs an admin key")
    return principal


AdminDep = Annotated[Principal, Depends(get_admin)]


async def websocket_principal(websocket: WebSocket) -> Principal:
    state: AppState = websocket.app.state.gs
    key = bearer_token(websocket.headers.get("authorization")) or websocket.query_params.get("token")
    return await authenticate(state, key)
