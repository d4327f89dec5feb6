"""The brute-force oracle of the archive tests and what they share: publishing records the
oracle remembers, waiting for the archive cuts and for query runners."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import redis

from app.geo.geometry import bbox_contains, haversine_m
from app.pipeline import names
from tests.conftest import LiveServer, auth

# How long an archive query may take in these tests (the server's query_timeout_s): Spark on a
# loaded 2-core machine took more than the default 30 s. A query still running after the
# longest wait_s (60 s) is polled by its id (`ask`).
SLOW_QUERY_S = 100


def ask(server: LiveServer, key: str, body: dict[str, Any], wait_s: float = 60
        ) -> dict[str, Any]:
    """POST /v1/queries, then GET /v1/queries/{id} while it runs: the answer once done."""
    r = httpx.post(server.base_url + "/v1/queries", json={**body, "wait_s": wait_s},
                   headers=auth(key), timeout=wait_s + 30)
    deadline = time.monotonic() + SLOW_QUERY_S + 10
    while r.status_code == 202 and time.monotonic() < deadline:
        time.sleep(0.5)
        r = httpx.get(server.base_url + f"/v1/queries/{r.json()['id']}", headers=auth(key),
                      timeout=30)
        if r.json().get("status") != "running":
            break
    assert r.status_code == 200 and r.json().get("status", "done") == "done", r.text
    return dict(r.json())

WORDS = ["taxi", "bus", "rain", "jam", "park"]
BBOX = (-10.0, -8.0, 12.0, 9.0)


@dataclass
class Rec:
    id: str
    lon: float
    lat: float
    ts: float
    keywords: list[str]
    moving: bool


class Oracle:
    def __init__(self) -> None:
        self.records: list[Rec] = []

    def rows(self, body: dict[str, Any]) -> list[Rec]:
        """The records a query ranges over: time range, `latest`, then region and keywords."""
        t0, t1 = body.get("from"), body.get("to")
        rows = [r for r in self.records if (t0 is None or r.ts >= t0) and (
            t1 is None or r.ts <= t1)]
        if body.get("latest"):
            best: dict[str, Rec] = {}
            for r in rows:
                if r.moving and (r.id not in best or r.ts > best[r.id].ts):
                    best[r.id] = r
            rows = [r for r in rows if not r.moving or best[r.id] is r]
        if "bbox" in body:
            rows = [r for r in rows if bbox_contains(tuple(body["bbox"]), r.lon, r.lat)]
        if "circle" in body:
            c = body["circle"]
            rows = [r for r in rows
                    if haversine_m(c["lon"], c["lat"], r.lon, r.lat) <= c["radius_m"]]
        wanted = set(body.get("keywords") or [])
        if wanted:
            if body.get("match") == "all":
                rows = [r for r in rows if wanted <= set(r.keywords)]
            else:
                rows = [r for r in rows if wanted & set(r.keywords)]
        return rows

    def answer(self, body: dict[str, Any]) -> list[Any]:
        rows = self.rows(body)
        kind = body["type"]
        if kind in ("range", "keyword"):
            rows.sort(key=lambda r: (-r.ts, r.id))
            return [(r.id, r.ts) for r in rows[:body.get("limit", 1000)]]
        if kind == "knn":
            px, py = body["point"]
            rows.sort(key=lambda r: (haversine_m(px, py, r.lon, r.lat), r.id, -r.ts))
            return [(r.id, r.ts) for r in rows[:body["k"]]]
        if kind == "count":
            return [len(rows)]
        terms: Counter[str] = Counter()
        for r in rows:
            terms.update(r.keywords)
        return sorted(terms.items(), key=lambda t: (-t[1], t[0]))[:body["k"]]


def got(body: dict[str, Any], results: list[dict[str, Any]]) -> list[Any]:
    if body["type"] == "count":
        return [results[0]["count"]]
    if body["type"] == "topk_terms":
        return [(r["term"], r["count"]) for r in results]
    return [(r["id"], r["ts"]) for r in results]


@dataclass
class Archived:
    server: LiveServer
    key: str
    oracle: Oracle
    runners: dict[str, dict[str, str]]  # name -> its environment over the cluster's

    def spawn_runner(self, name: str) -> None:
        self.server.spawn(name, ["query-runner", "--id", name], env=self.runners[name])

    def query(self, body: dict[str, Any]) -> dict[str, Any]:
        return ask(self.server, self.key, body)


def publish(server: LiveServer, key: str, oracle: Oracle, rng: random.Random, batches: int,
            first: int) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for i in range(first, first + batches):
            objs = []
            for j in range(50):
                obj: dict[str, Any] = {
                    "lon": rng.uniform(-20, 20), "lat": rng.uniform(-15, 15),
                    "ts": 1_700_000_000.0 + i * 100 + j,
                    "keywords": rng.sample(WORDS, rng.randint(0, 2))}
                if j % 4 == 0:
                    obj["id"] = f"car-{rng.randrange(30)}"
                objs.append(obj)
            r = client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
            assert r.status_code == 202, r.text
            for obj, oid in zip(objs, r.json()["ids"], strict=True):
                oracle.records.append(Rec(oid, obj["lon"], obj["lat"], obj["ts"],
                                          obj["keywords"], "id" in obj))
            time.sleep(0.1)


def cuts(server: LiveServer) -> dict[str, int]:
    client = redis.Redis.from_url(server.redis_url)
    try:
        return {k.decode(): int(v) for k, v in client.hgetall(names.ARCHIVE_CUT).items()}
    finally:
        client.close()


def runner_ready(server: LiveServer, name: str, timeout: float = 120) -> None:
    log = server.log_dir / f"{name}.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and "ready" in log.read_text():
            return
        assert server.procs[name].poll() is None, log.read_text()
        time.sleep(0.2)
    raise TimeoutError(f"{name} not ready:\n{log.read_text()}")


def wait_archived(server: LiveServer, workers: int, timeout: float = 60,
                  through: float | None = None) -> None:
    """Until every worker's archive cut is within a few buckets of now (1 s buckets): what
    was published before is in the archive, except the last few seconds; with `through` (a
    time), until the cuts have passed its bucket: everything that arrived by then is."""
    last_bucket = int(time.time() // 1) - 4 if through is None else int(through // 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = cuts(server)
        if len(c) == workers and min(c.values()) >= last_bucket:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the archive cuts did not reach bucket {last_bucket}: {cuts(server)}")


QUERIES: list[dict[str, Any]] = [
    {"type": "range", "bbox": list(BBOX), "limit": 10_000},
    {"type": "range", "bbox": list(BBOX), "keywords": ["taxi", "rain"], "match": "any",
     "limit": 10_000},
    {"type": "range", "bbox": list(BBOX), "limit": 25},
    {"type": "range", "circle": {"lon": 3.0, "lat": 2.0, "radius_m": 900_000},
     "keywords": ["bus"], "limit": 10_000},
    {"type": "range", "bbox": list(BBOX), "latest": True, "limit": 10_000},
    {"type": "keyword", "keywords": ["jam", "park"], "match": "all", "limit": 10_000},
    {"type": "knn", "point": [1.5, -2.5], "k": 15},
    {"type": "knn", "point": [-18.0, 14.0], "k": 7, "keywords": ["taxi"]},
    {"type": "knn", "point": [4.0, 4.0], "k": 5, "latest": True},
    {"type": "count", "bbox": list(BBOX)},
    {"type": "count", "circle": {"lon": -5.0, "lat": 0.0, "radius_m": 950_000}},
    {"type": "count", "bbox": list(BBOX), "latest": True},
    {"type": "topk_terms", "bbox": list(BBOX), "k": 3},
]


class Asking:
    """A thread that keeps asking `bodies` (each must equal its oracle answer of the start)
    until the block ends: `asked` counts the answers, `wrong` keeps those that differ."""

    def __init__(self, archived: Archived, bodies: list[dict[str, Any]]) -> None:
        self.archived = archived
        self.bodies = bodies
        self.expected = [archived.oracle.answer(b) for b in bodies]
        self.asked = 0
        self.wrong: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ask, daemon=True)

    def _ask(self) -> None:
        while not self._stop.is_set():
            for body, want in zip(self.bodies, self.expected, strict=True):
                out = self.archived.query(body)
                self.asked += 1
                if got(body, out["results"]) != want:
                    self.wrong.append((body, out))

    def __enter__(self) -> Asking:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(120)
