"""Geofencing benchmark: the workload a user would otherwise run on Tile38, end to end.

Moving objects (vehicles, phones) around US cities weighted by population send position
updates; fences (bbox and circle, a few kilometres across) sit where the objects are, placed
the same way; a fence is notified of every update inside it (`detect: inside`). The updates
are published in batches over HTTP, the notifications arrive on a WebSocket, and the run ends
when the last one has arrived. Every notification is checked against a brute-force oracle
(every update tested against every fence with the geometry's own predicates): none missing,
none twice, none extra.

For each fence count the report gives updates/s and notifications/s end to end (from the first
publish to the last notification) beside Tile38's figures on the same workload. Tile38 is not
packaged where this project installs from, so its figures are the reference measured with
Tile38 1.26.1 on a 2-core machine like the one this runs on (`TILE38_UPDATES_PER_S`). That
reference run's placement was denser than this one's default (about 111 notifications per
update at 10 000 fences; `--spread-km` packs objects tighter): compare notifications per
update before comparing rates.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from app.core.config import Settings
from app.core.redis import start_embedded_redis
from app.geo.geometry import bbox_contains, haversine_m
from bench.cluster import LiveServer, start_server
from bench.pipeline import Listener, cpu_seconds, subscribe, until_quiet
from bench.workload import KM_PER_DEG_LAT, _jitter, cities

# Tile38 1.26.1, same workload and machine, end to end: fences -> updates/s
TILE38_UPDATES_PER_S = {100: 22_800, 1_000: 4_300, 10_000: 318}
TS0 = 1_700_000_000  # update k carries ts TS0 + k: it names the update in its notifications


def start_positions(n_objects: int, spread_km: float, rng: np.random.Generator
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Where the objects start: near US cities picked by population (gaussian, `spread_km`)."""
    c = cities("US")
    pick = rng.choice(c.lon.size, size=n_objects, p=c.weight)
    return _jitter(rng, c.lon[pick], c.lat[pick], spread_km)


def make_fences(n: int, lon: np.ndarray, lat: np.ndarray, rng: np.random.Generator
                ) -> list[dict[str, Any]]:
    """n fences where the objects are (each centred on a random object's start): half boxes
    1-6 km wide, half circles of 0.5-3 km radius (API subscription specs)."""
    at = rng.integers(0, lon.size, n)
    out: list[dict[str, Any]] = []
    for i in range(n):
        x, y = round(float(lon[at[i]]), 6), round(float(lat[at[i]]), 6)
        if i % 2:
            out.append({"type": "range", "circle": {
                "lon": x, "lat": y, "radius_m": round(float(rng.uniform(500, 3_000)), 1)}})
            continue
        half_h = float(rng.uniform(0.5, 3.0)) / KM_PER_DEG_LAT
        half_w = half_h / max(float(np.cos(np.radians(y))), 0.01)
        out.append({"type": "range", "bbox": [round(x - half_w, 6), round(y - half_h, 6),
                                              round(x + half_w, 6), round(y + half_h, 6)]})
    return out


def make_updates(lon: np.ndarray, lat: np.ndarray, n_updates: int, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(object index, lon, lat) of each update: the objects move round-robin from their
    starts in steps of up to ~300 m."""
    lon, lat = lon.copy(), lat.copy()
    n_objects = lon.size
    obj = np.arange(n_updates) % n_objects
    ulon = np.empty(n_updates)
    ulat = np.empty(n_updates)
    for start in range(0, n_updates, n_objects):
        k = min(n_objects, n_updates - start)
        lat[:k] = np.clip(lat[:k] + rng.uniform(-0.3, 0.3, k) / KM_PER_DEG_LAT, -89.9, 89.9)
        lon[:k] += rng.uniform(-0.3, 0.3, k) / (KM_PER_DEG_LAT * np.cos(np.radians(lat[:k])))
        ulon[start:start + k], ulat[start:start + k] = lon[:k], lat[:k]
    return obj, ulon, ulat


def oracle(fences: list[dict[str, Any]], lon: np.ndarray, lat: np.ndarray
           ) -> Counter[tuple[int, int]]:
    """Every (fence, update) where the update is inside the fence: each fence tested against
    every update, nothing indexed."""
    out: Counter[tuple[int, int]] = Counter()
    for f, spec in enumerate(fences):
        if "bbox" in spec:
            inside = bbox_contains(tuple(spec["bbox"]), lon, lat)
        else:
            c = spec["circle"]
            inside = haversine_m(c["lon"], c["lat"], lon, lat) <= c["radius_m"]
        for k in np.flatnonzero(inside).tolist():
            out[(f, k)] += 1
    return out


class Notifications(Listener):
    """(subscription, update) of each notification received, and when the last came."""

    def __init__(self, server: LiveServer, key: str) -> None:
        super().__init__(server, key)
        self.got: Counter[tuple[str, int]] = Counter()
        self.last = 0.0

    def handle(self, line: str, now: float) -> None:
        if line.startswith('{"type":"match"'):
            m = orjson.loads(line)
            self.got[(m["subscription"], int(m["object"]["ts"]) - TS0)] += 1
            self.last = now


async def drive(server: LiveServer, fences: list[dict[str, Any]], n_objects: int,
                obj: np.ndarray, lon: np.ndarray, lat: np.ndarray, batch: int, concurrency: int,
                expected: Counter[tuple[int, int]]) -> dict[str, Any]:
    key = server.new_key()
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        sub_ids = await subscribe(client, h, fences)
        listener = Notifications(server, key)
        listener.task = asyncio.create_task(listener.run())
        await asyncio.wait_for(listener.ready.wait(), 30)
        await asyncio.sleep(0.5)
        n = obj.size
        ids, xs, ys = [f"v{i}" for i in obj.tolist()], lon.tolist(), lat.tolist()
        bodies = [orjson.dumps({"objects": [
            {"id": ids[k], "lon": xs[k], "lat": ys[k], "ts": TS0 + k}
            for k in range(start, min(start + batch, n))]}) for start in range(0, n, batch)]
        sem = asyncio.Semaphore(concurrency)
        # in order per object: a batch waits until the last one holding the same objects
        # (objects // batch before it, updates go round-robin) was accepted
        accepted = [asyncio.Event() for _ in bodies]
        lag = max(1, n_objects // batch)

        async def send(j: int) -> None:
            if j >= lag:
                await accepted[j - lag].wait()
            async with sem:
                r = await client.post("/v1/objects", headers=h, content=bodies[j])
                r.raise_for_status()
                accepted[j].set()

        cpu0 = cpu_seconds(server)
        t0 = time.time()
        await asyncio.gather(*(send(j) for j in range(len(bodies))))
        publish_s = time.time() - t0
        want = sum(expected.values())
        await until_quiet(lambda: sum(listener.got.values()), want)
        end = listener.last if want else time.time()
        cpu = {k: round(v - cpu0.get(k, 0.0), 1) for k, v in cpu_seconds(server).items()}
        await asyncio.sleep(1.0)  # a duplicate or an extra would have come by now
        listener.task.cancel()
    got = listener.got
    exp = Counter({(sub_ids[f], k): c for (f, k), c in expected.items()})
    wall = max(end - t0, publish_s)
    return {
        "fences": len(fences), "updates": n, "notifications_expected": want,
        "missing": sum((exp - got).values()), "extra": sum((got - exp).values()),
        "updates_per_s": round(n / wall), "notifications_per_s": round(want / wall),
        "publish_updates_per_s": round(n / publish_s), "cpu_seconds": cpu,
    }


def run_one(n_fences: int, n_objects: int, n_updates: int, spread_km: float, batch: int,
            concurrency: int, workers: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    x0, y0 = start_positions(n_objects, spread_km, rng)
    fences = make_fences(n_fences, x0, y0, rng)
    obj, lon, lat = make_updates(x0, y0, n_updates, rng)
    expected = oracle(fences, lon, lat)
    tmp = Path(tempfile.mkdtemp(prefix="geoswarm-geofence-"))
    redis_server = start_embedded_redis(Settings(data_dir=tmp / "redis"), die_with_parent=True)
    server = start_server(tmp, redis_server.url, die_with_parent=True, workers=workers,
                          GEOSWARM_RATE_LIMIT_PER_S="0", GEOSWARM_MAX_BATCH="10000")
    try:
        server.wait_workers(workers)
        server.redis_pid = redis_server.process.pid
        return asyncio.run(drive(server, fences, n_objects, obj, lon, lat, batch, concurrency,
                                 expected))
    finally:
        server.stop()
        redis_server.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="geoswarm bench geofence", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fences", default="100,1000,10000",
                    help="comma-separated fence counts, one run each")
    ap.add_argument("--objects", type=int, default=20_000, help="moving objects")
    ap.add_argument("--updates", type=int, default=50_000, help="position updates per run")
    ap.add_argument("--spread-km", type=float, default=1.0,
                    help="how far objects start from their city's centre (gaussian sigma)")
    ap.add_argument("--batch", type=int, default=1_000, help="updates per publish request")
    ap.add_argument("--concurrency", type=int, default=4, help="publish requests in flight")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.fences.split(",") if x.strip()]
    rows = [run_one(n, a.objects, a.updates, a.spread_km, a.batch, a.concurrency, a.workers,
                    a.seed) for n in counts]
    print(f"{'fences':>7} {'updates/s':>10} {'notif/s':>10} {'notif/update':>12} "
          f"{'tile38 upd/s':>13} {'vs tile38':>9} {'notifications':>13} {'missing':>7} "
          f"{'extra':>5}  cpu seconds")
    for r in rows:
        ref = TILE38_UPDATES_PER_S.get(r["fences"])
        vs = f"{r['updates_per_s'] / ref:.1f}x" if ref else "-"
        per = r["notifications_expected"] / max(1, r["updates"])
        print(f"{r['fences']:>7} {r['updates_per_s']:>10} {r['notifications_per_s']:>10} "
              f"{per:>12.2f} {ref if ref else '-':>13} {vs:>9} "
              f"{r['notifications_expected']:>13} {r['missing']:>7} {r['extra']:>5}  "
              f"{r['cpu_seconds']}")
    if any(r["missing"] or r["extra"] for r in rows):
        raise SystemExit("notifications differ from the oracle")


if __name__ == "__main__":
    main()
