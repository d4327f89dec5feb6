"""Admin: the cluster view (`GET /v1/admin/cluster`)."""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter

from app.api.deps import AdminDep, StateDep, StrictJSONRoute
from app.pipeline import records as R

router = APIRouter(prefix="/v1/admin", tags=["admin"], route_class=StrictJSONRoute)


@router.get("/cluster")
async def cluster(state: StateDep, _admin: AdminDep) -> dict[str, Any]:
    """Plan version, partitioning mode and every worker with its partitions and backlog."""
    assert state.router is not None
    await state.router.refresh()
    index = state.router.index
    raw = await state.redis.hgetall(R.WORKERS_KEY)
    now = time.time()
    infos = {k.decode(): orjson.loads(v) for k, v in raw.items()}
    names = sorted(set(infos) | set(index.workers if index else []))
    pipe = state.redis.pipeline(transaction=False)
    for w in names:
        pipe.xlen(R.worker_stream(w))
    lengths = await pipe.execute()
    workers = []
    for w, length in zip(names, lengths, strict=True):
        info = infos.get(w, {})
        parts = [p.id for p in index.partitions if p.worker == w] if index else []
        workers.append({
            "id": w, "pid": info.get("pid"), "host": info.get("host"),
            "alive": now - info.get("heartbeat", 0) <= state.settings.worker_dead_after_s,
            "partitions": parts, "cost": info.get("cost", 0.0),
            "received": info.get("received", 0), "backlog": length,
            "subscriptions": info.get("subscriptions", 0),
        })
    return {"plan_version": index.plan.version if index else None,
            "partitioning": state.settings.partitioning, "workers": workers}
