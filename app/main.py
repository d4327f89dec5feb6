"""create_app() and the lifespan that opens and closes Redis, the DB engine and the hub."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api import direct
from app.api.deps import KeyCheck, authenticate_request, confirm_key_check, ride_key_check
from app.api.openapi import TENANT, errors, install_openapi
from app.api.routes import admin, dashboard, health, keys, objects, queries, stream, subscriptions
from app.core.collector import collector_loop
from app.core.config import Settings, get_settings
from app.core.db import make_engine, make_sessionmaker
from app.core.errors import ApiError, integrity_problem, is_redis_oom
from app.core.pipelines import RIDER, pipelines_for
from app.core.redis import async_client
from app.core.security import AuthFailures, KeyCache, install_log_redaction
from app.core.state import AppState
from app.pipeline.expiry import expiry_loop
from app.pipeline.hub import Hub
from app.pipeline.queries import QueryService
from app.pipeline.router import Router
from app.services.quotas import slot_renew_loop
from app.services.revocation import key_recheck_loop

try:
    from fastapi.routing import iter_route_contexts
except ImportError:  # FastAPI before included routers were kept whole: app.routes is flat
    def iter_route_contexts(routes: Sequence[Any]) -> Iterator[Any]:  # type: ignore[misc]
        return iter(routes)

log = logging.getLogger(__name__)

OPENAPI_DESCRIPTION = """\
The HTTP API of geoswarm; matches are received on the WebSocket `/v1/stream`, which is not
described here.

Rules the schemas below cannot state:
- a `bbox` is `[min_lon, min_lat, max_lon, max_lat]` with min ≤ max;
- an integer is a JSON integer: `5.0` is refused where an integer is expected;
- cursors are opaque: only a cursor this server issued is accepted;
- `props` is at most 4 KiB encoded;
- every error answers `{"detail": ...}`: a message, or for a 422 the list of findings.
"""

HTTP_ERRORS = Counter("geoswarm_http_errors_total", "HTTP error responses", ["status"])


class BodyLimit:
    """Reject request bodies over max_body_bytes with 413 before the app reads them, and
    authenticate a /v1 request that has a body before reading any of it: a missing or unknown
    key costs no upload of up to max_body_bytes (the route's dependency reuses the principal).
    The hot routes are answered here (`app.api.direct`); a read-only one's key check, for a
    key this process holds, rides on its first round trip instead (`_answer_checking`)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        has_body = False
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = 0
                if length > self.max_bytes:
                    await self._reject(send)
                    return
                has_body = has_body or length > 0
            elif name == b"transfer-encoding":
                has_body = True
        reading = None if has_body else direct.reader_of(scope["method"], scope["path"])
        if reading is not None:
            await (await direct.read(*reading, Request(scope)))(scope, receive, send)
            return
        authenticated = has_body and _authenticated_route(scope)
        endpoint = direct.endpoint_of(scope["method"], scope["path"]) if authenticated else None
        # a read-only endpoint's key check rides on its first round trip (`ride_key_check`)
        check = (ride_key_check(Request(scope), scope["app"].state.gs)
                 if endpoint is not None and direct.is_read_only(endpoint) else None)
        if authenticated and check is None:
            refusal = await _authenticate_first(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if endpoint is not None:
            request = Request(scope)
            request._body = body  # (Starlette's cache of the body read)
            if check is not None:
                response = await _answer_checking(endpoint, request, body, check)
            else:
                response = await direct.answer(endpoint, request, body)
            if response is not None:
                await response(scope, receive, send)
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        HTTP_ERRORS.labels("413").inc()
        payload = (b'{"detail":"request body is over max_body_bytes (%d bytes)"}' % self.max_bytes)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _authenticated_route(scope: Scope) -> bool:
    """A /v1 route serves this method on this path (else the router answers 404 or 405)."""
    app = scope.get("app")
    path = scope["path"]
    return (isinstance(app, FastAPI) and path.startswith("/v1/")
            and scope["method"] in allowed_methods(app, path))


async def _answer_checking(endpoint: direct.Endpoint, request: Request, body: bytes,
                           check: KeyCheck) -> Response | None:
    """A read-only endpoint's response, made as the principal the key is held with while the
    key check rides on its first round trip; given once the check confirms it, else the
    refusal of the full check (a check that cannot confirm it, a changed token: the request
    is checked in full, and made again if another principal comes of it). None, as from
    `direct.answer`: the route answers it (its principal checked)."""
    app: FastAPI = request.app
    request.state.principal = check.principal
    ridden = RIDER.set(check.rider)
    try:
        response = await direct.answer(endpoint, request, body)
    finally:
        RIDER.reset(ridden)
    try:
        if await confirm_key_check(app.state.gs, check):
            return response
    except Exception as exc:  # (past the rate limit)
        return await direct.handled(app, request, exc)
    del request.state.principal
    refusal = await _authenticate_first(request.scope)
    if refusal is not None:
        return refusal
    if request.state.principal != check.principal:
        return await direct.answer(endpoint, request, body)
    return response


async def _authenticate_first(scope: Scope) -> Response | None:
    """Authenticate (and rate-limit) a request before its body is read; the error response
    when refused, made by the app's own exception handlers."""
    app: FastAPI = scope["app"]
    request = Request(scope)
    try:
        await authenticate_request(request, app.state.gs)
    except Exception as exc:
        return await direct.handled(app, request, exc)
    return None


def _error(status: int, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    HTTP_ERRORS.labels(str(status)).inc()
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


_MAX_DETAIL_DEPTH = 32


def _json_safe(value: Any, depth: int = 0) -> Any:
    """An error detail that JSON can carry, whatever the input of a validation error was: NaN
    and ±Infinity become strings, bytes are decoded, lone surrogates replaced, and nesting is
    cut off (a body nested a thousand levels deep must not exhaust the stack here)."""
    if depth > _MAX_DETAIL_DEPTH:
        return "..."
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, dict):
        return {_json_safe(str(k), depth + 1): _json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v, depth + 1) for v in value]
    return _json_safe(str(value), depth + 1)


_REPLAY_ERRORS = errors(404, 422, *TENANT, descriptions={
    404: "No subscription with this id in the tenant."})


# allowed_methods per app and path: it matches the path against every route's regex, a quarter
# of a millisecond that every request with a body paid (`_authenticated_route`). Bounded: a
# client can make up any number of paths, and past this many they are all forgotten.
_ALLOWED: weakref.WeakKeyDictionary[FastAPI, dict[str, list[str]]] = weakref.WeakKeyDictionary()
_ALLOWED_PATHS = 4096


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method the routes of `path` serve. The router's 405 names only the methods of the
    first route whose path matched (`Allow: GET` on a path that also has a DELETE route). As in
    OpenAPI, a concrete path wins over a template that also matches it: /v1/subscriptions/batch
    is POST only, not also the GET and DELETE of /v1/subscriptions/{sub_id}."""
    known = _ALLOWED.setdefault(app, {})
    methods = known.get(path)
    if methods is None:
        if len(known) >= _ALLOWED_PATHS:
            known.clear()
        methods = known[path] = _route_methods(app, path)
    return methods


def _route_methods(app: FastAPI, path: str) -> list[str]:
    concrete: set[str] = set()
    templated: set[str] = set()
    for route in iter_route_contexts(app.routes):
        regex = getattr(route, "path_regex", None)
        methods = getattr(route, "methods", None)
        if regex is not None and methods and regex.match(path):
            params = getattr(route, "param_convertors", None)
            (templated if params else concrete).update(methods)
    return sorted(concrete or templated)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = exc.headers
        if exc.status in (429, 503) and "Retry-After" not in headers:
            headers = {**headers, "Retry-After": "1"}  # API.md, Errors: always with Retry-After
        return _error(exc.status, exc.message, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            path = request.scope["path"].removeprefix(request.scope.get("root_path", ""))
            methods = allowed_methods(request.app, path)
            if methods:
                exc = StarletteHTTPException(405, exc.detail,
                                             {**(exc.headers or {}), "Allow": ", ".join(methods)})
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        for err in errors:
            if err.get("type") == "json_invalid":
                ctx = err.get("ctx") or {}
                return _error(400, f"malformed JSON: {ctx.get('error', 'cannot be parsed')}")
        return _error(422, _json_safe(errors))

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    @app.exception_handler(redis.exceptions.BusyLoadingError)
    async def redis_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable: %s", exc)
        return _error(503, "Redis is unavailable; retry later", {"Retry-After": "1"})

    @app.exception_handler(redis.exceptions.ResponseError)
    async def redis_refused(_: Request, exc: redis.exceptions.ResponseError) -> JSONResponse:
        if not is_redis_oom(exc):
            raise exc  # a command we got wrong: a server error (500, logged)
        log.warning("redis is out of memory: %s", exc)
        return _error(503, "Redis is out of memory (maxmemory); retry later",
                      {"Retry-After": "5"})

    @app.exception_handler(IntegrityError)
    async def integrity_error(_: Request, exc: IntegrityError) -> JSONResponse:
        """A constraint the request broke: the client's conflict (409) or invalid data (422),
        not an unavailable database."""
        status, message = integrity_problem(exc)
        log.info("integrity error answered %d: %s", status, exc.orig)
        if status == 422:
            return _error(422, [{"type": "value_error", "loc": ["body"], "msg": message,
                                 "input": None}])
        return _error(status, message)

    @app.exception_handler(OperationalError)
    @app.exception_handler(DBAPIError)
    async def db_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", exc)
        return _error(503, "the database is unavailable; retry later", {"Retry-After": "1"})


def create_served_app() -> FastAPI:
    """The app of an api process of its own (`geoswarm api`): it also keeps garbage
    collection from walking its long-lived objects (`app.core.collector`), which an app
    inside another program (the tests) leaves to that program."""
    return create_app(own_process=True)


def create_app(settings: Settings | None = None, redis_url: str | None = None,
               own_process: bool = False) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = redis_url or settings.redis_url
        if url is None:
            from app.core.redis import resolve_redis_url

            url, server = resolve_redis_url(settings)
            if server is not None:
                app.state.embedded_redis = server
        engine = make_engine(settings)
        client = async_client(url)
        state = AppState(settings=settings, engine=engine, sessions=make_sessionmaker(engine),
                         redis=client, redis_url=url, keys=KeyCache(settings.key_recheck_s),
                         pipelines=pipelines_for(url, client))
        state.router = Router(settings, client, state.pipelines)
        state.queries = QueryService(settings, client, state.router, state.pipelines)
        state.hub = Hub(state)
        app.state.gs = state
        await state.router.refresh()
        await state.queries.open_inbox()
        await state.hub.start()
        expiry = asyncio.create_task(expiry_loop(state), name="expiry")
        recheck = asyncio.create_task(key_recheck_loop(state), name="key-recheck")
        renew = asyncio.create_task(slot_renew_loop(state), name="ws-slot-renew")
        loops = [recheck, renew]
        if own_process:
            loops.append(asyncio.create_task(collector_loop(), name="gc-freeze"))
        try:
            yield
        finally:
            # Every step is bounded: a stuck Redis or database must not hold the shutdown.
            expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(expiry, 5)
            for task in loops:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
                    await asyncio.wait_for(task, 5)
            await state.queries.stop()
            await state.hub.stop()
            await state.pipelines.aclose()
            try:
                await asyncio.wait_for(client.aclose(), 5)
            except TimeoutError:
                log.warning("shutdown: closing the Redis client timed out")
            engine.dispose()
            server = getattr(app.state, "embedded_redis", None)
            if server is not None:
                server.stop()

    app = FastAPI(
        title="geoswarm",
        version="1",
        summary="Real-time location publish/subscribe with SWARM load balancing",
        description=OPENAPI_DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.auth_failures = AuthFailures(settings.auth_fail_limit, settings.auth_fail_window_s)
    install_log_redaction()
    install_error_handlers(app)
    for module in (health, keys, subscriptions, objects, queries, stream, admin, dashboard):
        # stream.py's one HTTP route is the replay, GET /v1/subscriptions/{sub_id}/matches (the
        # WebSocket is not in the OpenAPI document).
        app.include_router(module.router, responses=_REPLAY_ERRORS if module is stream else None)
    install_openapi(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    return app
