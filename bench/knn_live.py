"""Continuous kNN end to end (`geoswarm bench knn --live`): the real system (embedded
redis-server, one api process, worker processes) with kNN subscriptions at city points and
moving objects near cities, position updates paced at a rate over HTTP, the new neighbour
lists received on a WebSocket.

Latency: with every batch of updates one probe object moves exactly onto the point of a random
subscription, so that it must head that subscription's next list; the time from its send to
the first list that shows it, split at the list's history entry (written by a worker: its id
is Redis's clock). CPU per update: of each process over the
paced phase; the path's breakdown per hop (`app.pipeline.hops`, as `bench pipeline` prints
it). At the end, the last list of every subscription is checked against brute force
over the final positions."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from typing import Any

import httpx
import numpy as np
import orjson
import redis

from app.geo.geometry import haversine_m
from app.pipeline import names
from bench.cluster import LiveServer, bench_cluster
from bench.pipeline import (
    Listener,
    cpu_seconds,
    hop_breakdown,
    hop_counts,
    observed,
    reset_redis_stats,
    subscribe,
    top_commands,
)
from bench.workload import city_points

# how long partition moves held the workers' steps, on /metrics (`hop_counts` reads them)
MOVE_SECONDS = ("geoswarm_worker_move_seconds",)


class KnnReceiver(Listener):
    """The last list of each subscription, and the probes' latencies."""

    def __init__(self, server: LiveServer, key: str) -> None:
        super().__init__(server, key)
        self.last: dict[str, list[dict[str, Any]]] = {}
        self.messages = 0
        self.probes: dict[str, tuple[str, float, float, float]] = {}  # sub -> probe sent
        self.latency_ms: list[float] = []
        self.written_ms: list[float] = []  # send -> history entry written

    async def quiet(self, for_s: float = 2.0) -> None:
        """Until no list has arrived for `for_s`."""
        since, seen = time.monotonic(), -1
        while time.monotonic() - since < for_s:
            await asyncio.sleep(0.2)
            if self.messages != seen:
                seen, since = self.messages, time.monotonic()

    def handle(self, line: str, now: float) -> None:
        if not line.startswith('{"type":"knn"'):
            return
        m = orjson.loads(line)
        self.messages += 1
        sub = m["subscription"]
        self.last[sub] = m["neighbors"]
        probe = self.probes.get(sub)
        if probe is not None and any(
                n["id"] == probe[0] and abs(n["lon"] - probe[1]) < 1e-7
                and abs(n["lat"] - probe[2]) < 1e-7 for n in m["neighbors"]):
            del self.probes[sub]
            self.latency_ms.append((now - probe[3]) * 1000)
            entry_s = int(m["cursor"].split("-", 1)[0]) / 1000
            self.written_ms.append((entry_s - probe[3]) * 1000)


def nearest_ids(qlon: Any, qlat: Any, lon: Any, lat: Any, ids: list[str], k: int,
                cell_deg: float = 0.25) -> list[list[str]]:
    """Brute force for many points at once: the ids of the k objects nearest to each point
    (distance rounded to the millimetre, ties by id, as the pushed lists). The objects are
    sorted by cell of a grid; a point's candidates are those of the cells around it, in
    rings grown until the k-th candidate is nearer than any object outside them can be."""
    nx = int(round(360 / cell_deg))
    cx = np.clip(((lon + 180) / cell_deg).astype(np.int64), 0, nx - 1)
    cy = np.clip(((lat + 90) / cell_deg).astype(np.int64), 0, int(180 / cell_deg) - 1)
    order = np.argsort(cy * nx + cx, kind="stable")
    keys = (cy * nx + cx)[order]
    metres = 111_194.9  # per degree of latitude (and of longitude at the equator)
    out = []
    for x, y in zip(qlon.tolist(), qlat.tolist(), strict=True):
        qx, qy = int((x + 180) // cell_deg), int((y + 90) // cell_deg)
        r = 1
        while True:
            rows = range(max(0, qy - r), min(int(180 / cell_deg), qy + r + 1))
            spans = [(np.searchsorted(keys, row * nx + max(0, qx - r)),
                      np.searchsorted(keys, row * nx + min(nx - 1, qx + r), side="right"))
                     for row in rows]
            c = order[np.concatenate([np.arange(a, b) for a, b in spans])]
            if c.size >= k:
                d = haversine_m(x, y, lon[c], lat[c])
                kth = float(np.partition(d, k - 1)[k - 1])
                # the nearest any object outside the rings can be (the box's nearest edge)
                lat0, lat1 = (qy - r) * cell_deg - 90, (qy + r + 1) * cell_deg - 90
                lon0, lon1 = (qx - r) * cell_deg - 180, (qx + r + 1) * cell_deg - 180
                coslat = math.cos(math.radians(min(89.9, max(abs(lat0), abs(lat1)))))
                edge = min(y - lat0, lat1 - y, (min(x - lon0, lon1 - x)) * coslat) * metres
                if lon0 < -180 or lon1 > 180:  # the rings do not wrap: nothing is certain
                    edge = 0.0
                if kth + 1.0 < edge or r >= nx:
                    break
            r *= 2
        best = sorted((round(dist, 3), ids[i]) for dist, i in zip(d.tolist(), c.tolist(),
                                                                strict=True))
        out.append([oid for _, oid in best[:k]])
    return out


async def drive(server: LiveServer, n_objects: int, n_subs: int, k: int, rate: float,
                seconds: float, batch: int, seed: int, check: int, warmup_s: float = 0.0,
                move_every: float = 0.0, subscribe_knn: bool = True) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    lon, lat = city_points(n_objects, rng)
    slon, slat = city_points(n_subs, rng, jitter_km=10.0)
    ids = [f"v{i}" for i in range(n_objects)]
    key = server.new_key("bench")
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        async def post(objs: list[dict[str, Any]]) -> None:
            r = await client.post("/v1/objects", headers=h,
                                  content=orjson.dumps({"objects": objs}))
            r.raise_for_status()

        now = time.time()
        for a in range(0, n_objects, 5000):
            await post([{"id": ids[i], "lon": float(lon[i]), "lat": float(lat[i]), "ts": now}
                        for i in range(a, min(a + 5000, n_objects))])
        # listening before subscribing: every list, the first ones included, is received
        receiver = KnnReceiver(server, key)
        task = asyncio.create_task(receiver.run())
        await asyncio.wait_for(receiver.ready.wait(), 60)
        specs = [{"type": "knn", "point": [float(slon[i]), float(slat[i])], "k": k}
                 for i in range(n_subs)]
        t0 = time.perf_counter()
        # without subscriptions (the baseline of what they cost): the same updates, probes
        # included, but nothing to time or check
        sub_ids = (await subscribe(client, h, specs, 5000) if subscribe_knn
                   else [f"none-{i}" for i in range(n_subs)])
        subscribe_s = time.perf_counter() - t0
        # the first lists of every subscription arrive (or are in the history already)
        await receiver.quiet()
        receiver.latency_ms.clear()
        receiver.written_ms.clear()
        messages0 = receiver.messages
        cpu0 = cpu_seconds(server)
        interval = batch / rate
        probes = max(1, min(500, n_objects // 10))  # objects 0..probes-1
        superseded = 0
        sends: list[asyncio.Task[None]] = []

        async def pace(duration: float, timed: bool) -> int:
            """Updates at the rate for `duration`, each batch with a probe if `timed`."""
            nonlocal superseded
            begin = time.perf_counter()
            done = 0
            while time.perf_counter() - begin < duration:
                pick = probes + rng.choice(n_objects - probes, size=batch - 1, replace=False)
                lon[pick] = np.clip(lon[pick] + rng.normal(0, 0.003, pick.size), -180, 180)
                lat[pick] = np.clip(lat[pick] + rng.normal(0, 0.003, pick.size), -85, 85)
                p, s = int(rng.integers(probes)), int(rng.integers(n_subs))
                lon[p], lat[p] = slon[s], slat[s]
                at = time.time()
                # a probe object moved again before its list arrived can no longer be timed
                stale = [q for q, v in receiver.probes.items() if v[0] == ids[p]]
                for q in stale:
                    del receiver.probes[q]
                superseded += len(stale) if timed else 0
                if timed and subscribe_knn:
                    receiver.probes[sub_ids[s]] = (ids[p], float(lon[p]), float(lat[p]), at)
                objs = [{"id": ids[i], "lon": float(lon[i]), "lat": float(lat[i]), "ts": at}
                        for i in [p, *pick.tolist()]]
                sends.append(asyncio.create_task(post(objs)))
                done += batch
                delay = begin + (done / batch) * interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            return done

        if warmup_s > 0:
            # the same load, not timed: with a coordinator, the balancing it makes happens
            # here; the timed part follows without a pause (a lull in the load is a change
            # the balancer would answer within the timed part)
            await pace(warmup_s, timed=False)
            receiver.latency_ms.clear()
            receiver.written_ms.clear()
            messages0 = receiver.messages
            cpu0 = cpu_seconds(server)
        plan0 = plan_version(server)
        reports0 = knn_reports(server)
        hops0 = hop_counts(server.base_url)
        moves0 = hop_counts(server.base_url, MOVE_SECONDS, "side")
        reset_redis_stats(server.redis_url)
        start = time.perf_counter()
        moves: list[float] = []
        refused: list[str] = []
        mover = (asyncio.create_task(move_back_and_forth(server, move_every, moves, refused))
                 if move_every > 0 else None)
        sent = await pace(seconds, timed=True)
        await asyncio.gather(*sends)
        paced_s = time.perf_counter() - start
        if mover is not None:
            if mover.done():
                mover.result()  # a move that failed stops the run
            mover.cancel()
        # the workers catch up (a backlog if they could not keep the pace): every pending
        # probe's list arrives, then nothing more for a while
        give_up = time.monotonic() + 300
        while receiver.probes and time.monotonic() < give_up:
            await asyncio.sleep(0.2)
        caught_up_s = time.perf_counter() - start - paced_s
        await receiver.quiet()
        reports = {n: v - reports0[n] for n, v in knn_reports(server).items()}
        cpu = {n: v - cpu0.get(n, 0.0) for n, v in cpu_seconds(server).items()}
        commands = top_commands(server.redis_url, 3)
        await asyncio.sleep(1.5)  # the workers' hops reach /metrics with their heartbeats (1 s)
        hops = {f"{k}_p50_p99": v for k, v in
                hop_breakdown(hops0, hop_counts(server.base_url), short=True).items()}
        # how long the moves held the workers' steps (their streams waited meanwhile): how
        # many, and their mean (a few moves: the histogram's buckets say little more)
        moves1 = hop_counts(server.base_url, MOVE_SECONDS, "side")
        for side in ("give", "take"):
            n, took = observed(moves0, moves1, side)
            if n:
                hops[f"move_{side}_ms"] = f"n {n}  mean {took / n * 1000:.0f}"
        task.cancel()
    if not subscribe_knn:
        sample: list[int] = []  # no list to check
    elif check <= 0 or check >= n_subs:
        sample = list(range(n_subs))
    else:
        sample = rng.choice(n_subs, size=check, replace=False).tolist()
    # on how many workers each subscription of the sample is registered (merged lists)
    r = redis.Redis.from_url(server.redis_url)
    pipe = r.pipeline(transaction=False)
    for s in sample:
        pipe.hkeys(names.knn_key(sub_ids[s]))
    held = [sum(not f.startswith(b"_") for f in fields) for fields in pipe.execute()]
    wrong = 0
    want = nearest_ids(slon[sample], slat[sample], lon, lat, ids, k)
    for s, w in zip(sample, want, strict=True):
        got = [n["id"] for n in receiver.last.get(sub_ids[s], [])]
        if got != w:
            wrong += 1
            if wrong <= 5:
                print(f"subscription {sub_ids[s]}: last list {got}, brute force {w}",
                      file=sys.stderr)
    def pct(p: float, values: list[float] | None = None) -> float:
        v = sorted(receiver.latency_ms if values is None else values)
        return round(v[min(len(v) - 1, int(p * len(v)))], 1) if v else 0.0

    workers_cpu = sum(v for n, v in cpu.items() if n.startswith("w"))
    return {
        "objects": n_objects, "subscriptions": n_subs, "k": k, "subscribe_s": round(subscribe_s, 1),
        "updates": sent, "target_rate": rate, "achieved_rate": round(sent / paced_s),
        "caught_up_after_s": round(caught_up_s, 1),
        "lists_pushed": receiver.messages - messages0,
        "probes_timed": len(receiver.latency_ms), "probes_superseded": superseded,
        "probes_lost": len(receiver.probes),
        "latency_ms_p50": pct(0.5), "latency_ms_p99": pct(0.99),
        "to_history_ms_p50": pct(0.5, receiver.written_ms),
        "to_history_ms_p99": pct(0.99, receiver.written_ms),
        "worker_cpu_us_per_update": round(workers_cpu / sent * 1e6, 1),
        "workers_per_subscription": round(sum(held) / max(1, len(held)), 2),
        "merge_reports_per_update": round(reports["sent"] / max(1, sent), 2),
        "held_alone_skipped_per_update": round(reports["skipped"] / max(1, sent), 2),
        "radius_grown_shrunk_left": f"{reports['grow']}/{reports['shrink']}/{reports['leave']}",
        "plan_changes_while_timed": plan_version(server) - plan0,
        "moves_made": len(moves),
        "move_ms_max": round(max(moves, default=0.0) * 1000),
        "moves_refused": len(refused),
        "cpu_seconds": {n: round(v, 1) for n, v in cpu.items()},
        **{f"redis_top_{i + 1}": f"{name} {usec / 1e6:.2f} s"
           for i, (name, _calls, usec) in enumerate(commands)},
        "last_lists_checked": len(sample), "last_lists_wrong": wrong,
        **hops,
    }


def run(n_objects: int = 100_000, n_subs: int = 10_000, k: int = 10, rate: float = 5_000,
        seconds: float = 20.0, batch: int = 250, workers: int = 2, seed: int = 1,
        check: int = 0, broadcast: bool = False, balance_s: float = 0.0,
        move_every: float = 0.0, subscribe_knn: bool = True) -> dict[str, Any]:
    """One run; `broadcast`: every subscription on every worker, unbounded (the baseline);
    `subscribe_knn` False: no subscription at all, the same updates (what the workers spend
    on the updates alone, which neither registration changes).
    `balance_s` > 0: a coordinator balances the load (SWARM) from the start, and the load is
    paced that long, untimed, before the timed part. `move_every` > 0: a partition moves
    between two workers that often during the timed part (the balancer's own rounds off
    unless `balance_s`)."""
    env = {"GEOSWARM_KNN_BROADCAST": "1"} if broadcast else {}
    with bench_cluster("geoswarm-bench-knn-", workers, **env) as server:
        if balance_s > 0 or move_every > 0:
            server.start_coordinator()
        if move_every > 0 and balance_s <= 0:
            httpx.put(server.base_url + "/v1/admin/balancer", json={"enabled": False},
                      headers=server.admin(), timeout=10).raise_for_status()
        return asyncio.run(drive(server, n_objects, n_subs, k, rate, seconds, batch, seed,
                                 check, balance_s, move_every, subscribe_knn))


def knn_reports(server: LiveServer) -> dict[str, int]:
    """The workers' local lists sent to the merge script and those held alone whose change
    was not sent, and the registrations grown, shrunk and left, so far (from their
    heartbeats)."""
    client = redis.Redis.from_url(server.redis_url)
    try:
        beats = [orjson.loads(v) for v in client.hvals(names.WORKERS_KEY)]
    finally:
        client.close()
    counts = {n: sum(int(b.get("knn_reports", {}).get(n, 0)) for b in beats)
              for n in ("sent", "skipped")}
    counts.update({n: sum(int(b.get("knn_resizes", {}).get(n, 0)) for b in beats)
                   for n in ("grow", "shrink", "leave")})
    return counts


async def move_back_and_forth(server: LiveServer, every: float, took: list[float],
                              refused: list[str]) -> None:
    """Every `every` seconds, move a partition of the first worker to the next one and back
    again (the admin API's move, carried out by the coordinator), whole, with its moving
    objects and kNN registrations; `took`: the time of each move made. A move the workers
    refuse (409: the plan changed meanwhile, or the giver reached the command after its
    deadline, busy with its backlog) is asked again after a second, on the plan then;
    `refused`: the reasons."""
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.admin(),
                                 timeout=60) as client:
        workers = (await client.get("/v1/admin/cluster")).json()["workers"]
        there, back = workers[0]["id"], workers[1]["id"]
        wait = every
        while True:
            await asyncio.sleep(wait)
            held = {w["id"]: w["partitions"]
                    for w in (await client.get("/v1/admin/cluster")).json()["workers"]}
            # a partition moved takes a new id: the newest of the worker is the one it got
            part = max(held[there], key=lambda pid: int(pid.lstrip("p")))
            t0 = time.perf_counter()
            r = await client.post("/v1/admin/rebalance", json={"partition": part, "to": back})
            if r.status_code == 409:
                refused.append(r.json().get("detail", r.text))
                wait = 1.0
                continue
            r.raise_for_status()
            took.append(time.perf_counter() - t0)
            there, back = back, there
            wait = every


def plan_version(server: LiveServer) -> int:
    client = redis.Redis.from_url(server.redis_url)
    try:
        raw = client.get(names.PLAN_KEY)
        return int(orjson.loads(raw)["version"]) if raw else 0
    finally:
        client.close()
