"""Subscriptions: create (one or a batch), list, get, delete (API.md, subscriptions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Response
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.api.deps import StateDep, StrictJSONRoute, TenantDep
from app.api.openapi import BODY, TENANT, errors
from app.core.errors import NotFound, PayloadTooLarge
from app.core.security import Principal
from app.core.state import AppState
from app.models import Subscription
from app.schemas import (
    SubscriptionBatch,
    SubscriptionIds,
    SubscriptionIn,
    SubscriptionOut,
    SubscriptionPage,
    subscription_spec,
)
from app.services import quotas
from app.services import subscriptions as sub_service
from app.services.pipeline_sql import add_with_pipeline, delete_with_pipeline

router = APIRouter(prefix="/v1/subscriptions", tags=["subscriptions"], route_class=StrictJSONRoute)

NOT_FOUND = {404: "No subscription with this id in the tenant."}
DUPLICATE = {409: "A subscription with this id exists already (the message names it)."}
QUOTA = {429: "Rate limit of the key exceeded, or the tenant's quota of live subscriptions "
         "(tenant_max_subscriptions) would be exceeded; retry after `Retry-After` seconds."}
# The routes return the stored dicts as they are; the models only document them.
STORED = {"model": SubscriptionOut, "description": "The stored subscription."}


@router.post("", status_code=201, response_model=None,
             responses={201: STORED, **errors(*BODY, *TENANT, 409,
                                              descriptions={**DUPLICATE, **QUOTA})})
async def create_subscription(
    body: Annotated[SubscriptionIn, Body()], state: StateDep, principal: TenantDep
) -> dict[str, Any]:
    """Register one continuous query."""
    rows = await add_with_pipeline(state, _creator(state, principal, [subscription_spec(body)]))
    return sub_service.to_public(rows[0])


@router.post("/batch", status_code=201, response_model=SubscriptionIds,
             responses=errors(*BODY, *TENANT, 409, descriptions={
                 **DUPLICATE, **QUOTA,
                 413: "Body over max_body_bytes, or more than max_batch subscriptions."}))
async def create_subscriptions(
    body: SubscriptionBatch, state: StateDep, principal: TenantDep
) -> SubscriptionIds:
    """Register many continuous queries at once; all or none."""
    if len(body.subscriptions) > state.settings.max_batch:
        raise PayloadTooLarge(
            f"batch of {len(body.subscriptions)} subscriptions is over max_batch "
            f"({state.settings.max_batch})")
    specs = [subscription_spec(s) for s in body.subscriptions]
    rows = await add_with_pipeline(state, _creator(state, principal, specs))
    return SubscriptionIds(ids=[r.id for r in rows])


def _creator(state: AppState, principal: Principal, specs: list[dict[str, Any]]
             ) -> Callable[[Session], list[Subscription]]:
    """The SQL part of a create: the tenant's quota checked, then the rows, in one
    transaction (the quota's lock is held until it commits)."""

    def create(session: Session) -> list[Subscription]:
        quotas.check_subscriptions(session, principal.tenant, len(specs),
                                   state.settings.tenant_max_subscriptions)
        return sub_service.create_many(session, principal.tenant, specs)

    return create


@router.get("", response_model=None, responses={
    200: {"model": SubscriptionPage, "description": "One page, oldest first; next_cursor is "
          "null on the last."},
    **errors(422, *TENANT)})
async def list_subscriptions(
    state: StateDep,
    principal: TenantDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    """List this tenant's subscriptions, oldest first, with cursor pagination."""
    after = 0
    if cursor:
        decoded = sub_service.decode_cursor(cursor)
        if decoded is None:
            from fastapi.exceptions import RequestValidationError

            raise RequestValidationError([{
                "type": "value_error", "loc": ("query", "cursor"),
                "msg": "cursor is not one this server issued", "input": cursor}])
        after = decoded

    def work() -> dict[str, Any]:
        with state.sessions() as session:
            rows, nxt = sub_service.list_page(session, principal.tenant, limit, after)
            return {"items": [sub_service.to_public(r) for r in rows], "next_cursor": nxt}

    return await run_in_threadpool(work)


@router.get("/{sub_id}", response_model=None,
            responses={200: STORED, **errors(404, *TENANT, descriptions=NOT_FOUND)})
async def get_subscription(sub_id: str, state: StateDep, principal: TenantDep) -> dict[str, Any]:
    """One subscription of this tenant."""

    def work() -> dict[str, Any] | None:
        with state.sessions() as session:
            row = sub_service.get(session, principal.tenant, sub_id)
            return None if row is None else sub_service.to_public(row)

    out = await run_in_threadpool(work)
    if out is None:
        raise NotFound(f"no subscription with id {sub_id!r}")
    return out


@router.delete("/{sub_id}", status_code=204,
               responses=errors(404, *TENANT, descriptions=NOT_FOUND))
async def delete_subscription(sub_id: str, state: StateDep, principal: TenantDep) -> Response:
    """Delete a subscription; nothing is delivered for objects accepted after the 204."""
    if not await delete_with_pipeline(state, principal.tenant, sub_id):
        raise NotFound(f"no subscription with id {sub_id!r}")
    return Response(status_code=204)
