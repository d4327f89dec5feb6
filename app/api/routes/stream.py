"""WebSocket `/v1/stream` and the HTTP replay `/v1/subscriptions/{id}/matches` (API.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Annotated, Any

import orjson
import redis.exceptions
from fastapi import APIRouter, Query, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocketState

from app.api.deps import StateDep, TenantDep, websocket_principal
from app.core.errors import ApiError, NotFound
from app.core.state import AppState
from app.pipeline.hub import (
    WHOLE_ENTRY,
    Connection,
    ConnectionClosed,
    Hub,
    Position,
    gap_line,
    parse_cursor,
    position_cursor,
    read_history,
    resume_positions,
    start_position,
)
from app.services import quotas
from app.services import subscriptions as sub_service

log = logging.getLogger(__name__)
router = APIRouter(tags=["stream"])


class WebSocketTransport:
    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws

    async def send(self, frame: str) -> None:
        await self.ws.send_text(frame)

    async def close(self, code: int, reason: str) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(code=code, reason=reason), timeout=5)


def _error(code: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "code": code, "message": message})


@router.websocket("/v1/stream")
async def stream(websocket: WebSocket) -> None:
    """Receive matches: send `listen` / `unlisten` ops, receive newline-delimited messages."""
    state = websocket.app.state.gs
    hub: Hub = state.hub
    origins = state.settings.ws_allowed_origins
    origin = websocket.headers.get("origin")
    try:
        principal = await websocket_principal(websocket)
    except ApiError as exc:
        await websocket.accept()
        await websocket.close(code=1008, reason=exc.message)
        return
    if origins and origin is not None and origin not in origins:
        await websocket.accept()
        await websocket.close(code=1008, reason=f"origin {origin} is not allowed")
        return
    try:
        slot = await quotas.acquire_connection(state, principal.tenant)
    except ApiError as exc:
        await websocket.accept()
        await websocket.close(code=1008, reason=exc.message)
        return
    except (redis.exceptions.RedisError, OSError) as exc:
        log.warning("WebSocket refused: its slot could not be taken (%s)", exc)
        await websocket.accept()
        await websocket.close(code=1013, reason="Redis is unavailable; retry later")
        return
    conn = Connection(WebSocketTransport(websocket), principal, slot=slot)
    try:
        await websocket.accept()
        await _serve(websocket, state, hub, conn)
    finally:
        await _release_slot(state, conn)


async def _release_slot(state: AppState, conn: Connection) -> None:
    """Give the connection's quota slot back (once; bounded: a slot left behind expires)."""
    slot, conn.slot = conn.slot, None
    if slot is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(quotas.release_connection(state, conn.principal.tenant, slot),
                                   5)


async def _serve(websocket: WebSocket, state: AppState, hub: Hub, conn: Connection) -> None:
    hub.register(conn)
    pump = asyncio.create_task(_pump(hub, conn))
    reader = asyncio.create_task(_read(websocket, state, hub, conn))
    try:
        done, _ = await asyncio.wait({pump, reader}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pump, reader):
            task.cancel()
        for task in (pump, reader):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        hub.unregister(conn)
        # before the close frame: a client that reconnects at once finds its slot free
        await _release_slot(state, conn)
        if conn.closed is not None:
            await conn.transport.close(*conn.closed)


async def _pump(hub: Hub, conn: Connection) -> None:
    try:
        await hub.pump(conn)
    except ConnectionClosed:
        pass
    except WebSocketDisconnect:
        pass


async def _read(websocket: WebSocket, state: Any, hub: Hub, conn: Connection) -> None:
    while conn.closed is None:
        try:
            text = await websocket.receive_text()
        except WebSocketDisconnect:
            conn.closed = conn.closed or (1000, "")
            return
        except (KeyError, RuntimeError):
            conn.close_soon(1003, "send text frames holding JSON")
            return
        reply = await _handle_op(text, state, hub, conn)
        if reply:
            conn.outbox.append(reply)
            conn.wake.set()


async def _handle_op(text: str, state: Any, hub: Hub, conn: Connection) -> bytes | None:
    try:
        msg = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return _error("bad_request", f"malformed JSON: {exc}")
    if not isinstance(msg, dict):
        return _error("bad_request", "a message must be a JSON object with an 'op'")
    op = msg.get("op")
    if op not in ("listen", "unlisten"):
        return _error("bad_request", "op must be 'listen' or 'unlisten'")
    unknown_fields = set(msg) - {"op", "subscriptions", "since", "all"}
    if unknown_fields:
        return _error("bad_request", f"unknown field {sorted(unknown_fields)[0]!r}")
    subs = msg.get("subscriptions", [])
    if not isinstance(subs, list) or not all(isinstance(s, str) and 0 < len(s) <= 64
                                             for s in subs) or len(subs) > 10_000:
        return _error("bad_request", "subscriptions must be a list of subscription ids")
    if op == "unlisten":
        hub.unlisten(conn, subs)
        if conn.listen_all_from is not None:
            conn.excluded.update(subs)
        return _listening(conn)
    since = msg.get("since") or {}
    if not isinstance(since, dict) or not all(isinstance(v, str) for v in since.values()):
        return _error("bad_request", "since must map subscription ids to cursors")
    listen_all = msg.get("all", False)
    if not isinstance(listen_all, bool):
        return _error("bad_request", "all must be true or false")
    tenant = conn.principal.tenant
    wanted = list(dict.fromkeys([*subs, *since]))

    def owned() -> set[str]:
        with state.sessions() as session:
            return {r.id for r in sub_service.get_many(session, tenant, wanted)}

    found = await run_in_threadpool(owned) if wanted else set()
    missing = [s for s in wanted if s not in found]
    if missing:
        conn.outbox.append(_error("not_found", f"no subscription with id {missing[0]!r}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                     else "")))
    now_ms = await hub.server_ms()
    start = start_position(now_ms)
    positions: dict[str, Position] = {}
    cursors: dict[str, Position] = {}
    for sub in wanted:
        if sub not in found:
            continue
        cursor = since.get(sub)
        if cursor is None:
            positions[sub] = conn.positions.get(sub, start)
            continue
        pos = parse_cursor(cursor)
        if pos is None:
            conn.outbox.append(_error("bad_request", f"invalid cursor for {sub!r}"))
            continue
        cursors[sub] = pos
    inside: list[str] = []  # a cursor may stand inside its entry (WHOLE_ENTRY: after it)
    if cursors:
        resumed = await resume_positions(hub.redis, conn.principal.tenant, cursors,
                                         state.settings.history_max_age_s, time.time())
        for sub, (pos, trimmed) in resumed.items():
            if trimmed:
                conn.outbox.append(gap_line(sub, position_cursor(pos)))
            positions[sub] = pos
            if pos[2] != WHOLE_ENTRY:
                inside.append(sub)
    hub.listen(conn, positions, now_ms, inside=inside)
    if listen_all:
        hub.listen_all(conn, start)
    return _listening(conn)


def _listening(conn: Connection) -> bytes:
    out: dict[str, Any] = {"type": "listening", "subscriptions": sorted(conn.positions)}
    if conn.listen_all_from is not None:
        out["all"] = True
    return orjson.dumps(out)


@router.get("/v1/subscriptions/{sub_id}/matches", tags=["subscriptions"])
async def replay(
    sub_id: str,
    state: StateDep,
    principal: TenantDep,
    since: Annotated[str | None, Query(max_length=80)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Any:
    """The retained history after the cursor (from the oldest retained without one)."""

    def exists() -> bool:
        with state.sessions() as session:
            return sub_service.get(session, principal.tenant, sub_id) is not None

    if not await run_in_threadpool(exists):
        raise NotFound(f"no subscription with id {sub_id!r}")
    items: list[bytes] = []
    if since is None:
        pos: Position = start_position(0)  # before everything retained
    else:
        parsed = parse_cursor(since)
        if parsed is None:
            raise RequestValidationError([{"type": "value_error", "loc": ("query", "since"),
                                           "msg": "not a cursor this server issued",
                                           "input": since}])
        resumed = await resume_positions(state.redis, principal.tenant, {sub_id: parsed},
                                         state.settings.history_max_age_s, time.time())
        pos, trimmed = resumed[sub_id]
        if trimmed:
            items.append(gap_line(sub_id, position_cursor(pos)))
    while len(items) < limit:
        batch = await read_history(state.pipelines, sub_id, pos, 64, principal.tenant)
        items.extend(batch.lines)
        pos = batch.position
        if not batch.full:
            break
    items = items[:limit]
    next_cursor = None
    for line in reversed(items):
        msg = orjson.loads(line)
        if "cursor" in msg:
            next_cursor = msg["cursor"]
            break
    if next_cursor is None:
        next_cursor = since
    body = b'{"items":[' + b",".join(items) + b'],"next_cursor":' + orjson.dumps(next_cursor) + b"}"
    return Response(body, media_type="application/json")
