"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from app.api.deps import StateDep
from app.api.openapi import RETRY_AFTER
from app.core.metrics import DEAD_LETTERS, HEARTBEAT_FIGURES
from app.schemas import Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz", response_model=None, responses={
    200: {"model": Readiness, "description": "Ready: every check is ok."},
    503: {"model": Readiness, "description": "Not ready: the checks say what is missing.",
          "headers": {"Retry-After": RETRY_AFTER}},
})
async def readyz(state: StateDep) -> Response:
    """Redis, the database and at least one live worker are reachable."""
    checks: dict[str, str] = {}
    try:
        await state.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["redis"] = f"unavailable: {type(exc).__name__}"

    def db_ping() -> None:
        with state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    try:
        await run_in_threadpool(db_ping)
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001
        checks["database"] = f"unavailable: {type(exc).__name__}"
    if state.router is not None and checks["redis"] == "ok":
        try:
            live = await state.router.live_workers(time.time())
            checks["workers"] = f"{len(live)} live" if live else "no live worker"
        except Exception as exc:  # noqa: BLE001
            checks["workers"] = f"unavailable: {type(exc).__name__}"
    ready = all(v == "ok" or v.endswith(" live") for v in checks.values())
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503,
                        headers=None if ready else {"Retry-After": "1"})


@router.get("/metrics", response_class=Response, responses={
    200: {"description": "Prometheus text exposition.",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
})
async def metrics(state: StateDep) -> Response:
    """Prometheus text exposition."""
    await DEAD_LETTERS.refresh(state.redis)
    await HEARTBEAT_FIGURES.refresh(state.redis)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
