"""Annotated dependencies: the process state, the authenticated tenant or admin; the strict
JSON route class."""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import orjson
from fastapi import Depends, Request, Response, WebSocket
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from app.core.errors import BadRequest, Forbidden, RateLimited, Unauthorized
from app.core.security import Principal, bootstrap_principal
from app.core.state import AppState
from app.services import keys as key_service


class StrictJSONRequest(Request):
    """A request whose JSON body is parsed by orjson: strict RFC 8259, so `NaN`, `Infinity`,
    numbers that overflow a double (`1e999`) and lone surrogates are malformed JSON (400)
    rather than values that validation would have to reject (and could not report)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """The route class of every router with a JSON body (the same parser as `/v1/objects`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None

        async def strict_handler(request: Request) -> Response:
            request = StrictJSONRequest(request.scope, request.receive)
            if takes_body and not await request.body():
                # An empty document is not JSON (as on /v1/objects), not a missing field.
                raise BadRequest("malformed JSON: the request body is empty")
            return await handler(request)

        return strict_handler


def get_state(request: Request) -> AppState:
    return request.app.state.gs  # type: ignore[no-any-return]


StateDep = Annotated[AppState, Depends(get_state)]


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
    key = (bearer_token(websocket.headers.get("authorization"))
           or websocket.query_params.get("token"))
    return await authenticate(state, key)
