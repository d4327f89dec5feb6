"""Annotated dependencies: the process state, the authenticated tenant or admin; the strict
JSON route class. Authentication is throttled per client address (failed key checks), and may
have happened before the body was read (`main.BodyLimit`), which leaves the principal in the
request's state."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, NamedTuple

import orjson
import redis.exceptions
from fastapi import Depends, FastAPI, Request, Response, WebSocket
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection

from app.core.errors import BadRequest, Forbidden, RateLimited, Unauthorized, is_redis_oom
from app.core.pipelines import Rider
from app.core.security import AuthFailures, Principal, bootstrap_principal
from app.core.state import AppState
from app.pipeline import names
from app.services import keys as key_service

log = logging.getLogger(__name__)


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


async def get_state(request: Request) -> AppState:
    """The process's state. A coroutine: FastAPI runs a plain function dependency in its
    thread pool, a thread hop on every request."""
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


async def keys_token(state: AppState, counter: str | None = None
                     ) -> tuple[bytes | None, int | None]:
    """The current revocation token (`names.KEYS_TOKEN`), made if missing (a new or flushed
    Redis); None when Redis cannot say (the key is then looked up in SQL). With `counter`,
    that rate counter (`names.rate_key`) is counted in the same round trip: its count, 0 when
    Redis is out of memory (not counted, see `_counted`)."""
    commands: list[tuple[Any, ...]] = [("GET", names.KEYS_TOKEN)]
    if counter is not None:
        commands += [("INCR", counter), ("EXPIRE", counter, 2)]
    try:
        results = await state.pipelines.execute(commands, raise_on_error=False)
    except redis.exceptions.RedisError:  # the connection itself
        return None, None
    token = results[0]
    count = _counted(results[1]) if counter is not None else None
    if isinstance(token, Exception):
        return None, count
    if token is None:
        try:
            await state.redis.set(names.KEYS_TOKEN, secrets.token_hex(16), nx=True)
        except redis.exceptions.RedisError:
            pass
        return None, count  # this once in SQL: the token another process may have set wins
    return (token if isinstance(token, bytes) else str(token).encode()), count


def _counted(result: Any) -> int:
    """A rate counter's INCR result as a count. Out of memory it is 0: the limit protects the
    server, and a full Redis must not also refuse every read."""
    if isinstance(result, redis.exceptions.ResponseError) and is_redis_oom(result):
        log.warning("rate limit not counted: Redis is out of memory")
        return 0
    if isinstance(result, Exception):
        raise result
    return int(result)


async def check_key(state: AppState, key: str, window: int | None = None
                    ) -> tuple[Principal | None, int | None]:
    """The principal of a valid key: from this process's cache while the revocation token
    is unchanged, else from SQL (the token read first: a revocation committed after the
    lookup changes it, so the entry is not used again). With `window` (a second of the
    clock), a key found in the cache is also counted against the rate limit in the same
    round trip as the token: the count, or None if it was not counted."""
    cache = state.keys
    if cache is None:
        return await run_in_threadpool(_lookup, state, key), None
    held = cache.held(key)
    counter = (names.rate_key(held.key_id, window)
               if held is not None and window is not None else None)
    token, count = await keys_token(state, counter)
    if token is not None:
        principal = cache.get(key, token)
        if principal is not None:
            return principal, count
    principal = await run_in_threadpool(_lookup, state, key)
    if principal is not None and token is not None:
        cache.put(key, principal, token)
    if principal is None or held is None or principal.key_id != held.key_id:
        count = None  # counted for another key id, or for no valid key
    return principal, count


async def new_keys_token(state: AppState) -> None:
    """After a revocation's commit: every process's cached keys are checked again."""
    await state.redis.set(names.KEYS_TOKEN, secrets.token_hex(16))


def auth_failures(app: FastAPI) -> AuthFailures:
    """The process's throttle of failed key checks (made by create_app)."""
    return app.state.auth_failures  # type: ignore[no-any-return]


def client_address(conn: HTTPConnection) -> str:
    return conn.client.host if conn.client is not None else "unknown"


async def authenticate(state: AppState, key: str | None,
                       failures: AuthFailures | None = None, address: str = "unknown",
                       window: int | None = None) -> tuple[Principal, int | None]:
    """The principal of `key`. An address with too many failed checks in the current window is
    refused (429) before its key is looked up; only checks that looked a key up count. With
    `window` (a second of the clock), also the key's requests in it if they were counted on
    the way (`check_key`), else None."""
    principal, count = await check_key(state, refuse_early(key, failures, address), window)
    if principal is None:
        if failures is not None:
            failures.failed(address)
        raise Unauthorized("unknown or revoked API key")
    return principal, count


def refuse_early(key: str | None, failures: AuthFailures | None, address: str) -> str:
    """`key`, unless it is refused before any lookup: missing, too long, or from an address
    with too many failed checks."""
    if key is None:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if len(key) > 256:
        raise Unauthorized("unknown or revoked API key")
    if failures is not None:
        retry = failures.retry_after(address)
        if retry is not None:
            # short: it is also a WebSocket close reason (at most 123 bytes)
            raise RateLimited(
                f"too many failed authentications from this address (over {failures.limit} "
                f"in {failures.window_s:g} s); retry in {retry} s",
                headers={"Retry-After": str(retry)})
    return key


async def rate_limit(state: AppState, principal: Principal, now: float,
                     count: int | None = None) -> None:
    """Refuse (429) the request past `rate_limit_per_s` of its key in the second of `now`;
    `count`: the key's requests in that second if already counted (`check_key`)."""
    limit = state.settings.rate_limit_per_s
    if limit <= 0:
        return
    window = int(now)
    if count is None:
        counter = names.rate_key(principal.key_id, window)
        count = _counted((await state.pipelines.execute(
            [("INCR", counter), ("EXPIRE", counter, 2)], raise_on_error=False))[0])
    if count > limit:
        retry = max(1, int(window + 1 - now + 0.999))
        raise RateLimited(f"rate limit of {limit} requests/s per key exceeded",
                          headers={"Retry-After": str(retry)})


async def authenticate_request(request: Request, state: AppState) -> Principal:
    """Authenticate and rate-limit an HTTP request (once: BodyLimit may have done it before the
    body was read)."""
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is not None:
        return principal
    now = time.time()
    # A key this process knows is counted in the round trip that reads the revocation token.
    window = int(now) if state.settings.rate_limit_per_s > 0 else None
    principal, count = await authenticate(
        state, bearer_token(request.headers.get("authorization")), auth_failures(request.app),
        client_address(request), window)
    if count is not None and window is not None and state.keys is not None:
        state.keys.counted(principal.key_id, window, count)
    await rate_limit(state, principal, now, count)
    request.state.principal = principal
    return principal


class KeyCheck(NamedTuple):
    """A key check riding on a read-only request's first round trip (`ride_key_check`)."""

    key: str
    principal: Principal  # as the key is held: valid if the token read is its token
    now: float
    window: int | None  # the rate limit's second, if counted
    rider: Rider


def ride_key_check(request: Request, state: AppState) -> KeyCheck | None:
    """The key check of a read-only request (a snapshot query), to ride on the request's first
    round trip to Redis instead of one of its own before it (`app.core.pipelines.Rider`): the
    revocation token and the rate counter, read as `check_key` reads them. The request is then
    served as the principal the key is held with, and its answer given only once the check
    confirms it (`confirm_key_check`); a refused one was evaluated for nothing, and answers
    as if checked first. None (checked first) for a key this process does not hold (or holds
    past its age), an address refused for failed checks, pipelines without riders, or a key
    past half its rate limit in this second: a flood of requests past the limit must not be
    evaluated (those are refused before any work)."""
    cache = state.keys
    if cache is None or not state.pipelines.rides:
        return None
    try:
        key = refuse_early(bearer_token(request.headers.get("authorization")),
                           auth_failures(request.app), client_address(request))
    except (Unauthorized, RateLimited):
        return None  # (the check first answers it)
    principal = cache.fresh(key)
    if principal is None:
        return None
    now = time.time()
    limit = state.settings.rate_limit_per_s
    window = int(now) if limit > 0 else None
    commands: list[tuple[Any, ...]] = [("GET", names.KEYS_TOKEN)]
    if window is not None:
        if cache.count(principal.key_id, window) >= limit // 2:
            return None
        counter = names.rate_key(principal.key_id, window)
        commands += [("INCR", counter), ("EXPIRE", counter, 2)]
    return KeyCheck(key, principal, now, window, Rider(commands))


async def confirm_key_check(state: AppState, check: KeyCheck) -> bool:
    """Whether the key check that rode confirms the request (the token still the one the key
    is held with); RateLimited past the rate limit. False when it cannot tell (the token
    changed, Redis failed): the request is then checked in full, as if it had not ridden
    (`authenticate_request`: refused, or accepted when another key's revocation changed the
    token), and counted again."""
    try:
        replies = await check.rider.replies(state.pipelines)
    except (redis.exceptions.RedisError, OSError):
        return False
    token = replies[0]
    if isinstance(token, Exception) or token is None:
        return False
    assert state.keys is not None
    held = state.keys.get(check.key, token if isinstance(token, bytes) else str(token).encode())
    if held is None or held.key_id != check.principal.key_id:
        return False
    if check.window is not None:
        count = _counted(replies[1])
        state.keys.counted(held.key_id, check.window, count)
        await rate_limit(state, held, check.now, count)
    return True


async def get_principal(request: Request, state: StateDep) -> Principal:
    return await authenticate_request(request, state)


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
    principal, _ = await authenticate(state, key, auth_failures(websocket.app),
                                      client_address(websocket))
    return principal
