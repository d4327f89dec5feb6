"""The SWARM experiments on a real cluster: embedded Redis, api, workers and a coordinator, one
partitioning mode after another, measuring units of work per second and end-to-end latency
through WebSocket delivery."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from app.geo.grid import Grid
from bench.swarm.model import CoverCount
from bench.swarm.report import report_real
from bench.swarm.workload import US_BOUNDS, Workload, make_workload

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]

# -- the real cluster --------------------------------------------------------------------------


@dataclass
class RealConfig:
    workers: int = 2
    grid: int = 1000
    rounds: int = 24
    round_s: float = 5.0
    rate: float = 4000.0  # objects offered per second (this 2-vCPU box's api tops out ~5-6k)
    subs: int = 10_000
    hot_subs: int = 2000
    history_objects: int = 20_000
    batch: int = 500  # objects per publish request
    seed: int = 1
    drain_s: float = 60.0  # after the last round: wait this long at most for the backlog


def write_history_sample(path: Path, wl: Workload) -> None:
    """The history sample as GEOSWARM_HISTORY_SAMPLE wants it (NDJSON objects and bboxes)."""
    lines = [json.dumps({"lon": float(x), "lat": float(y)})
             for x, y in zip(wl.sample_lon.tolist(), wl.sample_lat.tolist(), strict=True)]
    lines += [json.dumps({"bbox": [float(v) for v in wl.boxes[i]]})
              for i in wl.sample_subs.tolist()]
    path.write_text("\n".join(lines) + "\n")


@dataclass
class RealTimeline:
    """One mode's probe deliveries: per object (arrival time, latency, units)."""

    mode: str
    t0: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    units: list[float] = field(default_factory=list)
    published: int = 0
    duplicates: int = 0  # probe matches delivered twice (must stay 0)
    units_published: float = 0.0
    rounds: list[dict[str, Any]] = field(default_factory=list)  # POST /rebalance answers
    balancer: dict[str, Any] = field(default_factory=dict)
    partitions: int = 0
    errors: list[str] = field(default_factory=list)


async def _drive_real(server: Any, wl: Workload, mode: str, cfg: RealConfig) -> RealTimeline:
    """Push the workload through a running cluster: subscriptions (and a probe subscription
    over the whole space, so that every object's processing is observed once), objects paced
    at the round's rate, a balancing round through POST /v1/admin/rebalance at every round
    end; the probe's matches give each object's end-to-end latency and when it was done."""
    import asyncio

    import httpx
    import orjson
    import websockets

    out = RealTimeline(mode)
    key = server.new_key("swarmbench")
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    admin = server.admin()
    n_subs = wl.boxes.shape[0]
    sub_ids: list[str | None] = [None] * n_subs
    units_of: dict[str, float] = {}
    cover = CoverCount(wl.grid)

    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        r = await client.put("/v1/admin/balancer", headers=admin, json={"enabled": False})
        if r.status_code != 200:
            out.errors.append(f"PUT /v1/admin/balancer: {r.status_code} {r.text[:200]}")

        async def create(idx: list[int]) -> None:
            for a in range(0, len(idx), 5000):
                chunk = idx[a:a + 5000]
                specs = [{"type": "range", "bbox": [float(v) for v in wl.boxes[i]]}
                         for i in chunk]
                rr = await client.post("/v1/subscriptions/batch", headers=h,
                                       content=orjson.dumps({"subscriptions": specs}))
                rr.raise_for_status()
                for i, sid in zip(chunk, rr.json()["ids"], strict=True):
                    sub_ids[i] = sid
            cover.add(wl.rects[idx])

        async def delete(idx: list[int]) -> None:
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem:
                    await client.delete(f"/v1/subscriptions/{sub_ids[i]}", headers=h)

            cover.add(wl.rects[idx], -1)
            await asyncio.gather(*(one(i) for i in idx))

        await create(np.flatnonzero(wl.preloaded).tolist())
        rr = await client.post("/v1/subscriptions/batch", headers=h, content=orjson.dumps(
            {"subscriptions": [{"type": "range", "bbox": list(wl.grid.bounds)}]}))
        rr.raise_for_status()
        probe = rr.json()["ids"][0]

        ready = asyncio.Event()
        seen: set[str] = set()

        async def listen() -> None:
            url = f"{server.ws_url}/v1/stream?token={key}"
            async with websockets.connect(url, max_size=None, max_queue=None) as ws:
                await ws.send(orjson.dumps({"op": "listen", "subscriptions": [probe]}).decode())
                async for frame in ws:
                    now = time.time()
                    for line in str(frame).split("\n"):
                        if line.startswith('{"type":"match"'):
                            m = orjson.loads(line)
                            oid = m["object"]["id"]
                            if oid in seen:
                                out.duplicates += 1
                                continue
                            seen.add(oid)
                            out.arrivals.append(now)
                            out.latency.append(now - m["object"]["ts"])
                            out.units.append(units_of.pop(oid, 0.0))
                        elif '"listening"' in line:
                            ready.set()

        listener = asyncio.create_task(listen())
        await asyncio.wait_for(ready.wait(), 30)
        rounds_tasks: list[asyncio.Task[None]] = []

        async def balance_round(n: int) -> None:
            try:
                resp = await client.post("/v1/admin/rebalance", headers=admin, json={})
                body = resp.json() if resp.headers.get("content-type", "").startswith(
                    "application/json") else {"text": resp.text[:200]}
                out.rounds.append({"round": n, "status": resp.status_code, **body})
            except httpx.HTTPError as exc:
                out.rounds.append({"round": n, "status": None, "error": str(exc)})

        sem = asyncio.Semaphore(8)
        pubs: list[asyncio.Task[None]] = []
        churn: list[asyncio.Task[None]] = []

        async def publish(lon: list[float], lat: list[float], units: list[float]) -> None:
            async with sem:
                now = time.time()
                body = orjson.dumps({"objects": [{"lon": x, "lat": y, "ts": now}
                                                 for x, y in zip(lon, lat, strict=True)]})
                resp = await client.post("/v1/objects", headers=h, content=body)
                if resp.status_code != 202:  # refused: not accepted, so never expected
                    out.errors.append(f"publish: {resp.status_code} {resp.text[:200]}")
                    return
                out.published += len(lon)
                out.units_published += float(sum(units))
                for oid, u in zip(resp.json()["ids"], units, strict=True):
                    units_of[oid] = u

        out.t0 = time.time()
        t_start = time.perf_counter()
        for rnd in range(wl.rounds):
            gone = np.flatnonzero((wl.sub_end == rnd) & ~wl.preloaded).tolist()
            new = np.flatnonzero((wl.sub_start == rnd) & ~wl.preloaded).tolist()
            if gone:  # in the background: hundreds of DELETEs must not stall the objects
                churn.append(asyncio.create_task(delete(gone)))
            if new:
                await create(new)  # one batch request
            cx, cy = wl.cells(rnd)
            units = cover.q[cy, cx].astype(np.float64)
            lon, lat = wl.lon[rnd].tolist(), wl.lat[rnd].tolist()
            n = len(lon)
            per = max(1, cfg.batch)
            steps = list(range(0, n, per))
            for j, a in enumerate(steps):
                due = t_start + (rnd + j / len(steps)) * wl.round_s
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                b = min(a + per, n)
                pubs.append(asyncio.create_task(
                    publish(lon[a:b], lat[a:b], units[a:b].tolist())))
            due = t_start + (rnd + 1) * wl.round_s
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rounds_tasks.append(asyncio.create_task(balance_round(rnd)))
        await asyncio.gather(*pubs, *churn)
        deadline = time.monotonic() + cfg.drain_s
        while len(out.arrivals) < out.published and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if len(out.arrivals) < out.published:
            out.errors.append(f"{out.published - len(out.arrivals)} objects not delivered "
                              f"{cfg.drain_s:g} s after the last round")
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await asyncio.gather(*rounds_tasks, return_exceptions=True)
        rb = await client.get("/v1/admin/balancer", headers=admin)
        out.balancer = rb.json() if rb.status_code == 200 else {"status": rb.status_code}
        rc = await client.get("/v1/admin/cluster", headers=admin)
        if rc.status_code == 200:
            out.partitions = sum(len(w.get("partitions", [])) for w in rc.json()["workers"])
    return out


def run_real(scenario: str, modes: Sequence[str], cfg: RealConfig, out_dir: Path
             ) -> dict[str, Any]:
    """The four modes one after another on one embedded Redis, each with its own api, workers
    and coordinator started with GEOSWARM_PARTITIONING set."""
    import asyncio
    import tempfile

    from app.core.config import Settings
    from app.core.redis import start_embedded_redis
    from bench.cluster import start_server

    grid = Grid(bounds=US_BOUNDS, nx=cfg.grid, ny=cfg.grid)
    wl = make_workload(scenario, rounds=cfg.rounds, round_s=cfg.round_s,
                       objects_per_round=int(cfg.rate * cfg.round_s), subs=cfg.subs,
                       hot_subs=cfg.hot_subs, grid=grid, history_objects=cfg.history_objects,
                       seed=cfg.seed, hot_subs_s=cfg.round_s)
    tmp = Path(tempfile.mkdtemp(prefix="geoswarm-swarmbench-"))
    sample = tmp / "history-sample.ndjson"
    write_history_sample(sample, wl)
    redis_server = start_embedded_redis(Settings(data_dir=tmp / "redis"), die_with_parent=True)
    timelines: dict[str, RealTimeline] = {}
    try:
        for mode in modes:
            env = {"GEOSWARM_PARTITIONING": mode, "GEOSWARM_RATE_LIMIT_PER_S": "0",
                   "GEOSWARM_MAX_BATCH": "10000", "GEOSWARM_WINDOW_S": "600",
                   "GEOSWARM_BOUNDS": ",".join(str(v) for v in US_BOUNDS),
                   "GEOSWARM_GRID": f"{cfg.grid}x{cfg.grid}",
                   "GEOSWARM_BALANCE_PERIOD_S": str(cfg.round_s),
                   "GEOSWARM_HISTORY_SAMPLE": str(sample)}
            print(f"-- {mode}: starting api, {cfg.workers} workers and a coordinator", flush=True)
            server = start_server(tmp / mode, redis_server.url, die_with_parent=True,
                                  workers=cfg.workers, **env)  # type: ignore[arg-type]  # GEOSWARM_* strings
            try:
                if hasattr(server, "start_coordinator"):
                    server.start_coordinator()
                else:
                    server.spawn("coord", ["coordinator"])
                server.wait_workers(cfg.workers)
                timelines[mode] = asyncio.run(_drive_real(server, wl, mode, cfg))
            finally:
                server.stop()
            tl = timelines[mode]
            print(f"   published {tl.published}, delivered {len(tl.arrivals)} "
                  f"({tl.duplicates} twice), "
                  f"{len(tl.rounds)} rounds, partitions at the end {tl.partitions}"
                  + (f", errors: {tl.errors[:3]}" if tl.errors else ""), flush=True)
    finally:
        redis_server.stop()
        shutil.rmtree(tmp / "redis", ignore_errors=True)  # keep the logs, not the AOF
    return report_real(wl, cfg, timelines, out_dir, tmp)
