"""The hot routes answered straight from the middleware that reads requests
(`app.main.BodyLimit`): publish (`POST /v1/objects`) and snapshot query (`POST /v1/queries`),
read and authenticated there, and the two reads a client polls, a moving object's latest
record (`GET /v1/objects/{id}`) and a query's outcome (`GET /v1/queries/{id}`). They run the
same endpoint functions as their FastAPI routes, without the framework's per-request work
around them: two scans of the routes, the dependency solver, the body's second parse and the
response model's pass (measured in the api process: about a third of its CPU for a publish of
one object or a small query).

Anything out of the ordinary is left to the routes, so that every error keeps the
framework's exact shape: a query body that does not validate, or is not JSON, goes through
FastAPI as if this module did not exist. Errors the endpoints raise are answered by the app's
own exception handlers, as the framework would."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

import orjson
from fastapi import FastAPI, Request
from pydantic import TypeAdapter, ValidationError
from starlette.responses import Response

from app.api.deps import authenticate_request
from app.api.routes import objects, queries
from app.core.security import Principal
from app.core.state import AppState
from app.schemas.queries import QueryIn

# (request with its body read, the process state, the authenticated principal) -> the
# response, or None to leave the request to its FastAPI route
Endpoint = Callable[[Request, AppState, Principal, bytes], Awaitable[Response | None]]

_query = TypeAdapter(QueryIn)


async def publish(request: Request, state: AppState, principal: Principal, body: bytes
                  ) -> Response:
    accepted = await objects.publish(request, state, principal)
    return Response(orjson.dumps({"accepted": accepted.accepted, "ids": accepted.ids}),
                    status_code=202, media_type="application/json")


async def submit_query(request: Request, state: AppState, principal: Principal, body: bytes
                       ) -> Response | None:
    try:
        query = _query.validate_python(orjson.loads(body))
    except (orjson.JSONDecodeError, ValidationError):
        return None  # the route's answer names the problem
    return await queries.submit_query(query, state, principal)


ENDPOINTS: dict[tuple[str, str], Endpoint] = {
    ("POST", "/v1/objects"): publish,
    ("POST", "/v1/queries"): submit_query,
}
# Those that change nothing (a query reads): their key check may ride on their first round
# trip, the answer given once it confirms the key (`app.api.deps.ride_key_check`). A write
# must not: it would be applied before its key is confirmed.
READ_ONLY = frozenset({submit_query})


# (request, the process state, the authenticated principal, the path's one parameter) -> the
# response
Reader = Callable[[Request, AppState, Principal, str], Awaitable[Response]]


async def get_object(request: Request, state: AppState, principal: Principal, object_id: str
                     ) -> Response:
    found = await objects.get_object(object_id, state, principal)
    return Response(orjson.dumps(found.model_dump(mode="json")), media_type="application/json")


async def get_query(request: Request, state: AppState, principal: Principal, query_id: str
                    ) -> Response:
    return await queries.get_query(query_id, state, principal)


# GET <prefix><the path's parameter>, as the routes match it: an object id is the rest of the
# path (`{object_id:path}`: object ids may hold a slash), a query id one segment
READERS: dict[str, Reader] = {
    "/v1/objects/": get_object,
    "/v1/queries/": get_query,
}
WHOLE_REST = frozenset({"/v1/objects/"})


def endpoint_of(method: str, path: str) -> Endpoint | None:
    return ENDPOINTS.get((method, path))


def is_read_only(endpoint: Endpoint) -> bool:
    return endpoint in READ_ONLY


def reader_of(method: str, path: str) -> tuple[Reader, str] | None:
    """The reader of a GET without a body, and its path parameter."""
    if method != "GET":
        return None
    for prefix, reader in READERS.items():
        if path.startswith(prefix):
            param = path[len(prefix):]
            whole = prefix in WHOLE_REST
            return (reader, param) if param and (whole or "/" not in param) else None
    return None


async def read(reader: Reader, param: str, request: Request) -> Response:
    """The reader's response once the request is authenticated (and counted against the
    key's rate limit), or the app's exception handler's."""
    app: FastAPI = request.app
    state: AppState = app.state.gs
    try:
        principal = await authenticate_request(request, state)
        return await reader(request, state, principal, param)
    except Exception as exc:
        return await handled(app, request, exc)


async def answer(endpoint: Endpoint, request: Request, body: bytes) -> Response | None:
    """The endpoint's response, or the app's exception handler's for what it raised (an
    exception no handler takes propagates, to the server error middleware, as from a route)."""
    app: FastAPI = request.app
    try:
        return await endpoint(request, app.state.gs, request.state.principal, body)
    except Exception as exc:
        return await handled(app, request, exc)


async def handled(app: FastAPI, request: Request, exc: Exception) -> Response:
    """The response of the app's exception handler for `exc` (the nearest class of its MRO,
    as the framework looks it up); `exc` is raised again when there is none."""
    for cls in type(exc).__mro__:
        handler = app.exception_handlers.get(cls)
        if handler is not None:
            response = handler(request, exc)
            return await response if inspect.isawaitable(response) else response
    raise exc
