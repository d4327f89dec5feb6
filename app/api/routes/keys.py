"""Admin: API keys (`POST/DELETE /v1/admin/keys`)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from app.api.deps import AdminDep, StateDep, StrictJSONRoute, new_keys_token
from app.api.openapi import ADMIN, BODY, errors
from app.core.db import session_scope
from app.core.errors import NotFound
from app.schemas import KeyCreate, KeyCreated
from app.services import keys as key_service

router = APIRouter(prefix="/v1/admin/keys", tags=["admin"], route_class=StrictJSONRoute)


@router.post("", status_code=201, response_model=KeyCreated, responses=errors(
    *BODY, *ADMIN, 409, descriptions={409: "A key with this id exists already."}))
async def create_key(body: KeyCreate, state: StateDep, _admin: AdminDep) -> KeyCreated:
    """Create an API key; the key is shown only once."""

    def work() -> KeyCreated:
        with session_scope(state.sessions) as session:
            row, key = key_service.create_key(session, body.tenant, body.admin)
            return KeyCreated(id=row.id, key=key, tenant=row.tenant, admin=row.admin)

    return await run_in_threadpool(work)


@router.delete("/{key_id}", status_code=204, responses=errors(404, *ADMIN, descriptions={
    404: "No API key with this id."}))
async def revoke_key(key_id: str, state: StateDep, _admin: AdminDep) -> Response:
    """Revoke a key: it stops working at once, also for open WebSockets."""

    def work() -> bool:
        with session_scope(state.sessions) as session:
            return key_service.revoke_key(session, key_id)

    if not await run_in_threadpool(work):
        raise NotFound(f"no API key with id {key_id!r}")
    await new_keys_token(state)
    if state.hub is not None:
        await state.hub.key_revoked(key_id)
    return Response(status_code=204)
