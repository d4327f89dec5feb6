"""Snapshot queries over the live window: submit one, wait for it or poll it (API.md, Snapshot
queries). The aggregator behind them is `app.pipeline.queries.QueryService`."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Body, Response
from fastapi.exceptions import RequestValidationError
from starlette.background import BackgroundTask

from app.api.deps import StateDep, StrictJSONRoute, TenantDep
from app.api.openapi import BODY, TENANT, errors
from app.core.errors import NotFound, Unavailable
from app.core.state import AppState, require_plan
from app.pipeline.queries import QueryService
from app.schemas.queries import AnyQuery, QueryIn, QueryResultBody, snapshot_query

router = APIRouter(prefix="/v1/queries", tags=["queries"], route_class=StrictJSONRoute)

UNAVAILABLE = {503: "Redis or the database unavailable, no partition plan yet (no worker has "
               "started), a worker did not answer the query (the message names it), or the "
               "time range reaches before the live window and no query runner is running."}


def check_time_range(query: AnyQuery) -> None:
    """422 for a time range that holds nothing: `to` before `from`. (A `from` before the live
    window is answered with the archive's records too.)"""
    if query.t_from is not None and query.t_to is not None and query.t_to < query.t_from:
        raise RequestValidationError([{
            "type": "value_error", "loc": ("body", "to"), "input": query.t_to,
            "msg": f"to ({query.t_to}) is before from ({query.t_from})"}])


def query_service(state: AppState) -> QueryService:
    if state.queries is None:
        raise Unavailable("snapshot queries are not running", headers={"Retry-After": "1"})
    return state.queries


@router.post("", response_model=None, responses={
    200: {"model": QueryResultBody, "description": "Done within `wait_s`: the results."},
    202: {"model": QueryResultBody, "description": "Not done within `wait_s`: `{\"id\", "
          "\"status\": \"running\"}`; poll GET /v1/queries/{id}."},
    **errors(*BODY, *TENANT, descriptions={
        422: "Validation error (each entry of `detail` names the field in `loc`), or `to` "
             "before `from`.",
        **UNAVAILABLE})})
async def submit_query(body: Annotated[QueryIn, Body()], state: StateDep,
                       principal: TenantDep) -> Response:
    """Run a snapshot query; its results if done within `wait_s`, else 202 to poll."""
    # The time range is the request's own business: checked before any Redis round trip, so that
    # its 422 does not depend on the cluster's state.
    check_time_range(body)
    await require_plan(state)
    queries = query_service(state)
    out, keep = await queries.submit(principal.tenant, snapshot_query(body), body.wait_s)
    if out["status"] == "failed":
        raise Unavailable(out["error"], headers={"Retry-After": "1"})
    response = json_response(out, 202 if out["status"] == "running" else 200)
    if keep is not None:  # kept for GET /v1/queries/{id} once the answer is sent
        response.background = BackgroundTask(keep)
    return response


@router.get("/{query_id}", response_model=None, responses={
    200: {"model": QueryResultBody, "description": "The query: running, done with its results, "
          "or failed with `error`."},
    **errors(404, *TENANT, descriptions={
        404: "No query with this id in the tenant (queries are kept an hour after they end).",
        503: "Redis or the database unavailable."})})
async def get_query(query_id: str, state: StateDep, principal: TenantDep) -> Response:
    """A snapshot query of this tenant: running, done or failed."""
    out = await query_service(state).status(principal.tenant, query_id)
    if out is None:
        raise NotFound(f"no query with id {query_id!r}")
    return json_response(out)


def json_response(body: dict[str, Any], status: int = 200) -> Response:
    """A body encoded at once (thousands of records: no per-value pass of FastAPI's encoder)."""
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
