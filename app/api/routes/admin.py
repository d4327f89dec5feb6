"""Admin: the cluster view, the partitions as GeoJSON and the load balancer (SWARM §4.3): its
configuration and state, and manual rounds, moves and splits sent to the leader coordinator
(the protocol of app/pipeline/control.py); the dead letters of the workers' streams."""

from __future__ import annotations

import logging
import math
import re
import secrets
import time
from typing import Annotated, Any

import msgspec
import orjson
from fastapi import APIRouter, Body, Query, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from redis.exceptions import WatchError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from app.api.deps import AdminDep, StateDep, StrictJSONRoute
from app.api.openapi import ADMIN, BODY, errors
from app.archive.layout import ArchiveStore, decode_cut, read_layout
from app.core.errors import ApiError, Conflict, NotFound, Unavailable
from app.core.redis import async_blocking_client
from app.core.state import AppState, require_plan
from app.geo.index import GlobalIndex, Partition
from app.models import BalancerRound
from app.pipeline import names, wire
from app.pipeline.cluster import heartbeat_fresh
from app.pipeline.router import grid_of
from app.schemas import (
    BalancerConfigIn,
    RebalanceIn,
    RebalanceMove,
    RebalanceRound,
    RebalanceSplit,
)

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/admin", tags=["admin"], route_class=StrictJSONRoute)

RECENT_ROUNDS = 20


def _json_object(raw: bytes | str | None) -> dict[str, Any]:
    """A JSON object kept in Redis by another process; anything else reads as empty."""
    if raw is None:
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) else 0.0


def _decode(value: bytes | str | None) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


@router.get("/cluster", responses=errors(*ADMIN))
async def cluster(state: StateDep, _admin: AdminDep) -> dict[str, Any]:
    """Plan version, partitioning mode and every worker with its partitions, cost and backlog."""
    assert state.router is not None
    await state.router.refresh()
    index = state.router.index
    raw = await state.redis.hgetall(names.WORKERS_KEY)
    costs = _json_object(await state.redis.get(names.BALANCER_STATE)).get("costs")
    costs = costs if isinstance(costs, dict) else {}
    now = time.time()
    infos = {str(_decode(k)): orjson.loads(v) for k, v in raw.items()}
    worker_ids = sorted(set(infos) | set(index.workers if index else []))
    pipe = state.redis.pipeline(transaction=False)
    for w in worker_ids:
        pipe.xlen(names.worker_stream(w))
    lengths = await pipe.execute()
    workers = []
    for w, length in zip(worker_ids, lengths, strict=True):
        info = infos.get(w, {})
        parts = [p.id for p in index.partitions if p.worker == w] if index else []
        workers.append({
            "id": w, "pid": info.get("pid"), "host": info.get("host"),
            "alive": heartbeat_fresh(info, now, state.settings.worker_dead_after_s),
            "partitions": parts, "cost": _number(costs.get(w)),
            "received": info.get("received", 0), "backlog": length,
            "subscriptions": info.get("subscriptions", 0),
            "knn_registrations": info.get("knn_registrations", 0),
            "knn_resizes": {k: int((info.get("knn_resizes") or {}).get(k, 0))
                            for k in ("grow", "shrink", "leave")},
        })
    return {"plan_version": index.plan.version if index else None,
            "partitioning": state.settings.partitioning, "workers": workers}


# --- partitions ------------------------------------------------------------------------------

async def _reports(state: AppState) -> tuple[int | None, float, dict[str, dict[str, Any]]]:
    """The latest round among the workers' latest reports, R(S) over that round's reports, and
    each partition's statistics from the newest report that has it."""
    raw = await state.redis.hgetall(names.STATS_KEY)
    reports = [r for r in (wire.decode_report(v) for v in raw.values()) if r is not None]
    if not reports:
        return None, 0.0, {}
    current = max(r.round for r in reports)
    r_s = sum(r.r_m for r in reports if r.round == current)
    stats: dict[str, dict[str, Any]] = {}
    for report in sorted(reports, key=lambda r: r.round):  # newer reports overwrite
        for p in report.partitions:
            stats[p.id] = msgspec.structs.asdict(p)
    return current, r_s, stats


def _feature(index: GlobalIndex, p: Partition, stats: dict[str, Any] | None,
             r_s: float) -> dict[str, Any]:
    min_lon, min_lat, _, _ = index.grid.cell_bbox(p.x0, p.y0)
    _, _, max_lon, max_lat = index.grid.cell_bbox(p.x1, p.y1)
    ring = [[min_lon, min_lat], [max_lon, min_lat], [max_lon, max_lat], [min_lon, max_lat],
            [min_lon, min_lat]]  # counter-clockwise (RFC 7946 §3.1.6)
    s = stats or {}
    num = _number(s.get("num"))
    return {
        "type": "Feature",
        "id": p.id,
        "bbox": [min_lon, min_lat, max_lon, max_lat],
        "geometry": {"type": "Polygon", "coordinates": [ring]},
        "properties": {
            "id": p.id, "worker": p.worker, "parent": p.parent, "prev_owner": p.prev_owner,
            "cells": p.area, "x0": p.x0, "y0": p.y0, "x1": p.x1, "y1": p.y1,
            "N": _number(s.get("N")), "Q": _number(s.get("Q")), "R": _number(s.get("R")),
            "num": num, "cost": num / r_s if r_s > 0 else 0.0,
        },
    }


@router.get("/partitions", responses=errors(*ADMIN))
async def partitions(state: StateDep, _admin: AdminDep) -> dict[str, Any]:
    """The partitions of the current plan as a GeoJSON FeatureCollection, with their last
    reported statistics and cost C(p) = Num(p) / R(S)."""
    assert state.router is not None
    await state.router.refresh()
    index = state.router.index
    current, r_s, stats = await _reports(state)
    if index is None:
        return {"type": "FeatureCollection", "features": [], "plan_version": None,
                "round": current, "r_s": r_s}
    return {
        "type": "FeatureCollection",
        "bbox": list(index.grid.bounds),
        "plan_version": index.plan.version,
        "grid": {"nx": index.grid.nx, "ny": index.grid.ny},
        "round": current,
        "r_s": r_s,
        "features": [_feature(index, p, stats.get(p.id), r_s) for p in index.partitions],
    }


@router.get("/archive/partitions", responses=errors(*ADMIN, 422))
async def archive_partitions(state: StateDep, _admin: AdminDep,
                             tenant: Annotated[str, Query(min_length=1, max_length=64)]
                             ) -> dict[str, Any]:
    """A tenant's archive as a GeoJSON FeatureCollection: the k-d partitions of its current
    compacted layout (AQWA) with their records, bytes, files and the logged queries that
    overlapped each when it was laid out; and the bucket files not compacted yet."""

    cut = decode_cut(await state.redis.hgetall(names.ARCHIVE_CUT))

    def read() -> dict[str, Any]:
        layout = read_layout(ArchiveStore(state.settings.archive_path), tenant, cut)
        grid = grid_of(state.settings)
        m = layout.manifest
        features = []
        for i, p in enumerate(m.partitions if m is not None else []):
            min_lon, min_lat, _, _ = grid.cell_bbox(p.rect[0], p.rect[1])
            _, _, max_lon, max_lat = grid.cell_bbox(p.rect[2], p.rect[3])
            ring = [[min_lon, min_lat], [max_lon, min_lat], [max_lon, max_lat],
                    [min_lon, max_lat], [min_lon, min_lat]]
            features.append({
                "type": "Feature", "id": f"a{i}",
                "bbox": [min_lon, min_lat, max_lon, max_lat],
                "geometry": {"type": "Polygon", "coordinates": [ring]},
                "properties": {"id": f"a{i}", "records": p.records, "bytes": p.bytes,
                               "files": len(p.files), "queries": p.queries,
                               "x0": p.rect[0], "y0": p.rect[1], "x1": p.rect[2],
                               "y1": p.rect[3]}})
        return {"type": "FeatureCollection", "tenant": tenant,
                "layout_version": m.version if m is not None else None,
                "compacted_at": m.created if m is not None else None,
                "bucket_files": len(layout.buckets),
                "bucket_bytes": sum(f.size for f in layout.buckets),
                "features": features}

    return await run_in_threadpool(read)


# --- the balancer ------------------------------------------------------------------------------

def _config(state: AppState, stored: dict[str, Any]) -> dict[str, Any]:
    """The balancer configuration: what is stored in Redis over the defaults of Settings."""
    s = state.settings
    config = {"enabled": s.partitioning == "swarm", "period_s": s.balance_period_s,
              "beta": s.balance_beta}
    for key in config:
        if key in stored:
            config[key] = stored[key]
    return config


def _round_row(row: BalancerRound) -> dict[str, Any]:
    return {"round": row.round, "time": row.started_at, "kind": row.kind, "r_s": row.r_s,
            "costs": row.costs, "stage": row.stage, "decision": row.decision, "mh": row.mh,
            "ml": row.ml, "action": row.action, "details": row.details,
            "plan_version": row.plan_version, "duration_ms": row.duration_ms}


async def _balancer(state: AppState) -> dict[str, Any]:
    pipe = state.redis.pipeline(transaction=False)
    pipe.get(names.BALANCER_CONFIG)
    pipe.get(names.BALANCER_STATE)
    pipe.get(names.LEASE_KEY)
    raw_config, raw_state, leader = await pipe.execute()
    balancer = _json_object(raw_state)
    pointer = balancer.get("pointer")
    pointer = pointer if isinstance(pointer, dict) else None

    def recent() -> list[dict[str, Any]]:
        with state.sessions() as session:
            rows = session.scalars(select(BalancerRound).order_by(
                BalancerRound.started_at.desc(), BalancerRound.seq.desc()).limit(RECENT_ROUNDS))
            return [_round_row(r) for r in rows]

    stage = (pointer or {}).get("stage") or balancer.get("stage") or "START"
    return {
        **_config(state, _json_object(raw_config)),
        "stage": stage,
        "last_decision": balancer.get("last_decision"),
        "pointer": pointer,
        "leader": _decode(leader),
        "round": balancer.get("round"),
        "r_s": balancer.get("r_s"),
        "costs": balancer.get("costs") or {},
        "last_round_at": balancer.get("last_round_at"),
        "rounds": await run_in_threadpool(recent),
    }


@router.get("/balancer", responses=errors(*ADMIN))
async def get_balancer(state: StateDep, _admin: AdminDep) -> dict[str, Any]:
    """The balancer's configuration, decision pointer, leader and its last rounds."""
    return await _balancer(state)


@router.put("/balancer", responses=errors(*BODY, *ADMIN))
async def put_balancer(body: BalancerConfigIn, state: StateDep, _admin: AdminDep
                       ) -> dict[str, Any]:
    """Change any of enabled, period_s and beta; the coordinator picks them up next round."""
    changes = body.model_dump(exclude_unset=True)
    pipe: Any  # (redis-py's multi is untyped)
    async with state.redis.pipeline(transaction=True) as pipe:
        while True:  # optimistic: a concurrent PUT is merged, not overwritten
            try:
                await pipe.watch(names.BALANCER_CONFIG)
                config = _config(state, _json_object(await pipe.get(names.BALANCER_CONFIG)))
                config.update(changes)
                pipe.multi()
                pipe.set(names.BALANCER_CONFIG, orjson.dumps(config))
                await pipe.execute()
                break
            except WatchError:
                continue
    log.info("balancer configuration changed: %s", changes)
    return await _balancer(state)


# --- manual rebalancing ----------------------------------------------------------------------

def _field_error(field: str, message: str, value: Any) -> RequestValidationError:
    return RequestValidationError([{"type": "value_error", "loc": ("body", field),
                                    "msg": message, "input": value}])


def _partition(index: GlobalIndex, pid: str) -> Partition:
    i = index.part_index.get(pid)
    if i is None:
        raise NotFound(f"no partition {pid!r} in plan version {index.plan.version}")
    return index.partitions[i]


async def _request(state: AppState, body: RebalanceRound | RebalanceMove | RebalanceSplit,
                   token: str) -> wire.AdminRequest:
    """Check the request against the current plan and the live workers; the coordinator
    checks again against the plan it acts on."""
    if isinstance(body, RebalanceRound):
        return wire.AdminRequest(id=token, kind="round")
    await require_plan(state)
    assert state.router is not None
    await state.router.refresh()
    index = state.router.index
    assert index is not None
    if isinstance(body, RebalanceMove):
        p = _partition(index, body.partition)
        if body.to not in await state.router.live_workers(time.time()):
            raise NotFound(f"no live worker {body.to!r} in the cluster")
        if p.worker == body.to:
            raise Conflict(f"partition {p.id!r} is already owned by {body.to!r}")
        return wire.AdminRequest(id=token, kind="move", partition=p.id, to=body.to)
    p = _partition(index, body.split)
    lo, hi = (p.x0, p.x1) if body.axis == "x" else (p.y0, p.y1)
    if lo == hi:
        raise _field_error("axis", f"partition {p.id!r} is one cell wide along {body.axis}: "
                           "it cannot be split on that axis", body.axis)
    if not lo <= body.at < hi:
        raise _field_error("at", f"a split of {p.id!r} along {body.axis} must be at a cell "
                           f"{lo} ≤ at < {hi} (the low half keeps cells up to at)", body.at)
    return wire.AdminRequest(id=token, kind="split", partition=p.id, axis=body.axis, at=body.at)


def _reply_response(reply: wire.AdminReply | None) -> JSONResponse:
    """The coordinator's answer as the API's answer: 202 with the result or its error."""
    if reply is None:
        raise Unavailable("the coordinator's answer could not be read",
                          headers={"Retry-After": "1"})
    status = reply.status
    if status == 202:
        return JSONResponse({"round": reply.round, "action": reply.action,
                             "details": reply.details}, status_code=202)
    message = reply.error or "the coordinator refused the request"
    if status == 422:
        raise RequestValidationError([{"type": "value_error", "loc": ("body",),
                                       "msg": message, "input": None}])
    if 400 <= status < 500:
        error = ApiError(message)
        error.status = status
        raise error
    raise Unavailable(message, headers={"Retry-After": "1"})


@router.post("/rebalance", status_code=202, responses={
    202: {"description": "the coordinator ran the round, move or split"},
    **errors(*BODY, *ADMIN, 404, 409, descriptions={
        404: "unknown partition or worker",
        409: "the partition is already there, or the plan changed meanwhile",
        422: "not a round, move or split, or a split outside the partition",
        503: "no coordinator is running, or it did not answer in time",
    }),
})
async def rebalance(body: Annotated[RebalanceIn, Body(openapi_examples={
    "round": {"summary": "a balancing round now", "value": {}},
    "move": {"summary": "move a partition", "value": {"partition": "p7", "to": "w2"}},
    "split": {"summary": "split a partition", "value": {"split": "p7", "axis": "x", "at": 120}},
})], state: StateDep, _admin: AdminDep) -> JSONResponse:
    """Run one balancing round now, move one partition or split one, through the coordinator."""
    token = secrets.token_hex(16)
    request = await _request(state, body, token)
    if await state.redis.get(names.LEASE_KEY) is None:
        raise Unavailable("no coordinator is running (nobody holds the balancer lease); "
                          "start one and retry", headers={"Retry-After": "5"})
    payload = wire.encode_json(request)
    timeout = state.settings.admin_rebalance_timeout_s
    # A connection of its own: the shared pool's socket timeout is shorter than the BLPOP, and
    # a 30 s wait must not hold one of its connections.
    conn = async_blocking_client(state.redis_url, timeout + 10)
    try:
        await conn.rpush(names.REQUESTS_KEY, payload)
        answer = await conn.blpop([names.reply_key(token)], timeout=timeout)
        if answer is None:
            withdrawn = await conn.lrem(names.REQUESTS_KEY, 1, payload)
            log.warning("rebalance request %s: no answer within %.1f s (%s)", token, timeout,
                        "withdrawn" if withdrawn else "taken by the coordinator")
            raise Unavailable(
                f"the coordinator did not answer within {timeout:g} s; "
                + ("the request was withdrawn" if withdrawn
                   else "it took the request and may still carry it out"),
                headers={"Retry-After": "5"})
    finally:
        await conn.aclose()
    reply = wire.decode_list_message(answer[1], wire.AdminReply)
    log.info("rebalance request %s (%s): %s", token, request.kind, reply)
    return _reply_response(reply)


# --- dead letters ----------------------------------------------------------------------------
# Entries a worker could not process (undecodable, or delivered more than max_deliveries
# times) are moved to the stream names.DEAD_LETTER with the fields `stream` and `id` (where
# they came from) and `why`, beside their own fields. The response models live here rather
# than in app.schemas: only these routes use them.

# A stream entry id as Redis writes it; 19 digits each stay below 2^64, so Redis never refuses
# one as out of range (that would be its error, a 500, rather than the client's).
_ENTRY_ID = re.compile(r"[0-9]{1,19}-[0-9]{1,19}")
_OWN_FIELDS = (b"stream", b"id", b"why")
# Replayed only to a worker's stream (a dead letter names its stream itself; workers never
# dead-letter commands, which would be stale anyway).
_WORKER_STREAMS = names.WORKER_STREAM_PREFIX

# KEYS[1] the dead-letter stream, KEYS[2] the stream the entry came from, KEYS[3] the replay's
# outcome (names.dead_letter_replayed_key); ARGV[1] the dead letter's id, ARGV[2] how long the
# outcome is kept. In one step: the entry's own fields appended to its stream as a new entry,
# the dead letter deleted and the outcome kept, so that the same replay sent again answers the
# same. Answers {status} or {200, "<stream>\n<new id>"}.
_REPLAY = """
local done = redis.call('GET', KEYS[3])
if done then return {200, done} end
local found = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #found == 0 then return {404} end
local fields, out, stream = found[1][2], {}, nil
for i = 1, #fields, 2 do
    local k = fields[i]
    if k == 'stream' then stream = fields[i + 1]
    elseif k ~= 'id' and k ~= 'why' then
        out[#out + 1] = k
        out[#out + 1] = fields[i + 1]
    end
end
if stream ~= KEYS[2] or #out == 0 then return {409} end
if redis.call('EXISTS', KEYS[2]) == 0 then return {410} end
local new = redis.call('XADD', KEYS[2], '*', unpack(out))
redis.call('XDEL', KEYS[1], ARGV[1])
local outcome = KEYS[2] .. '\\n' .. new
redis.call('SET', KEYS[3], outcome, 'EX', ARGV[2])
return {200, outcome}
"""


# With outboxes (a Redis Cluster, where the dead letters and a worker's stream are in
# different hash slots) the same replay goes in steps, each safe to run again: the entry
# appended to its stream once (its new id kept in the stream's slot, `_APPEND_ONCE`), then the
# outcome kept beside the dead letters, then the dead letter deleted. KEYS[1] the stream,
# KEYS[2] the outcome in its slot; ARGV[1] how long it is kept, ARGV[2..] the entry's fields.
_APPEND_ONCE = """
local done = redis.call('GET', KEYS[2])
if done then return {200, done} end
if redis.call('EXISTS', KEYS[1]) == 0 then return {410} end
local new = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('SET', KEYS[2], new, 'EX', ARGV[1])
return {200, new}
"""


async def replay_in_steps(client: Any, did: str, stream: str, fields: dict[bytes, bytes]
                          ) -> tuple[int, str]:
    """`_REPLAY` in steps (see `_APPEND_ONCE`): (status, "<stream>\n<new id>")."""
    entry = [x for k, v in fields.items() if k not in _OWN_FIELDS for x in (k, v)]
    if not entry:
        return 409, ""
    ttl = names.DEAD_LETTER_REPLAY_TTL_S
    reply = await client.register_script(_APPEND_ONCE)(
        keys=[stream, names.dead_letter_appended_key(stream, did)], args=[ttl, *entry])
    if int(reply[0]) != 200:
        return int(reply[0]), ""
    outcome = f"{stream}\n{_decode(reply[1])}"
    await client.set(names.dead_letter_replayed_key(did), outcome, ex=ttl)
    await client.xdel(names.DEAD_LETTER, did)
    return 200, outcome


class DeadLetter(BaseModel):
    id: str = Field(description="The dead letter's id (an entry id of the dead-letter stream).")
    stream: str | None = Field(description="The stream the entry was read from.")
    original_id: str | None = Field(description="The entry's id in that stream.")
    why: str | None = Field(description="Why the worker gave up on it.")
    time: float = Field(description="When it was dead-lettered (Unix seconds).")
    size: int = Field(description="Bytes of the original entry: its field names and values.")


class DeadLetterPage(BaseModel):
    items: list[DeadLetter]
    next_after: str | None = Field(
        description="Pass as `after` for the next page; null when this page is the last.")
    total: int = Field(description="Dead letters waiting, over all pages.")


class DeadLetterReplayed(BaseModel):
    id: str = Field(description="The dead letter, now deleted.")
    stream: str = Field(description="The stream the entry was appended to again.")
    entry_id: str = Field(description="The id of the new entry in that stream.")


def _dead_letter(eid: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    ms = int(eid.split(b"-", 1)[0])
    return DeadLetter(
        id=eid.decode(), stream=_decode(fields.get(b"stream")),
        original_id=_decode(fields.get(b"id")), why=_decode(fields.get(b"why")),
        time=ms / 1000,
        size=sum(len(k) + len(v) for k, v in fields.items() if k not in _OWN_FIELDS))


def _known_id(dead_letter_id: str) -> str:
    """The id, if it can be one; any other string names no dead letter (404)."""
    if _ENTRY_ID.fullmatch(dead_letter_id) is None:
        raise NotFound(f"no dead letter {dead_letter_id!r}")
    return dead_letter_id


@router.get("/dead-letters", response_model=DeadLetterPage, responses=errors(422, *ADMIN))
async def list_dead_letters(
    state: StateDep, _admin: AdminDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[str | None, Query(
        pattern=f"^{_ENTRY_ID.pattern}$",
        description="List the dead letters after this id (`next_after` of the last page).",
    )] = None,
) -> DeadLetterPage:
    """The entries workers gave up on, oldest first: where they came from, why, when and
    their size."""
    pipe = state.redis.pipeline(transaction=False)
    pipe.xrange(names.DEAD_LETTER, min=f"({after}" if after else "-", max="+", count=limit)
    pipe.xlen(names.DEAD_LETTER)
    entries, total = await pipe.execute()
    items = [_dead_letter(eid, fields) for eid, fields in entries]
    return DeadLetterPage(items=items, total=total,
                          next_after=items[-1].id if len(items) == limit else None)


@router.post("/dead-letters/{dead_letter_id}/replay", response_model=DeadLetterReplayed,
             responses=errors(404, 409, *ADMIN, descriptions={
                 404: "No dead letter with this id, and none replayed with it within a day.",
                 409: "The dead letter cannot be replayed: its stream is not a worker's, no "
                      "longer exists, or it carries no entry fields.",
             }))
async def replay_dead_letter(dead_letter_id: str, state: StateDep, _admin: AdminDep
                             ) -> DeadLetterReplayed:
    """Append the entry to the stream it came from again, and delete the dead letter, in one
    step. An entry that fails again comes back here with a new id. The same replay sent again
    (within a day) answers the same, and appends nothing."""
    did = _known_id(dead_letter_id)
    done_key = names.dead_letter_replayed_key(did)
    found = await state.redis.xrange(names.DEAD_LETTER, min=did, max=did)
    if not found:
        done = _decode(await state.redis.get(done_key))
        if done is None:
            raise NotFound(f"no dead letter {did!r}")
        to, new_id = done.split("\n", 1)
        return DeadLetterReplayed(id=did, stream=to, entry_id=new_id)
    stream = _decode((found[0][1] or {}).get(b"stream"))
    if stream is None or not stream.startswith(_WORKER_STREAMS):
        raise Conflict(f"dead letter {did!r} came from {stream!r}, not a worker's stream")
    if state.router is None or state.router.outbox is None:
        reply = await state.redis.register_script(_REPLAY)(
            keys=[names.DEAD_LETTER, stream, done_key],
            args=[did, names.DEAD_LETTER_REPLAY_TTL_S])
        status, outcome = int(reply[0]), _decode(reply[1]) if len(reply) > 1 else None
    else:
        fields: dict[bytes, bytes] = dict(found[0][1] or {})  # type: ignore[arg-type]
        status, outcome = await replay_in_steps(state.redis, did, stream, fields)
    if status == 404:
        raise NotFound(f"no dead letter {did!r}")  # replayed or deleted meanwhile
    if status == 409:
        raise Conflict(f"dead letter {did!r} carries no entry to replay")
    if status == 410:
        raise Conflict(f"the stream {stream!r} of dead letter {did!r} no longer exists")
    stream, new_id = (outcome or "").split("\n", 1)
    log.info("dead letter %s replayed to %s as %s", did, stream, new_id)
    return DeadLetterReplayed(id=did, stream=stream, entry_id=new_id)


@router.delete("/dead-letters/{dead_letter_id}", status_code=204,
               responses=errors(404, *ADMIN, descriptions={404: "No dead letter with this id."}))
async def delete_dead_letter(dead_letter_id: str, state: StateDep, _admin: AdminDep
                             ) -> Response:
    """Drop a dead letter for good."""
    did = _known_id(dead_letter_id)
    if not await state.redis.xdel(names.DEAD_LETTER, did):
        raise NotFound(f"no dead letter {did!r}")
    log.info("dead letter %s deleted", did)
    return Response(status_code=204)
