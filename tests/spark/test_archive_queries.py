"""Snapshot queries over the live window and the archive together, with real processes: two
workers flushing expired buckets to Parquet, query runners (each a real SparkSession), the api.
Every query type equals a brute-force oracle over every record ever accepted, each record
found once across the boundary, with `sources` saying which side gave what; a query whose
runner is SIGKILLed while it runs is taken by another runner and answered exactly."""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pyspark.sql import SparkSession

from app.geo.geometry import bbox_contains, haversine_m
from app.pipeline import names
from spark.session import java_available
from tests.conftest import LiveServer, auth, start_server

pytestmark = pytest.mark.slow

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
    runners: list[str]

    def query(self, body: dict[str, Any], wait_s: float = 60) -> dict[str, Any]:
        r = httpx.post(self.server.base_url + "/v1/queries", json={**body, "wait_s": wait_s},
                       headers=auth(self.key), timeout=wait_s + 30)
        assert r.status_code == 200, r.text
        return dict(r.json())


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


@pytest.fixture(scope="module")
def archived(tmp_path_factory: pytest.TempPathFactory, embedded_redis: Any):  # type: ignore[no-untyped-def]
    ok, detail = java_available()
    if not ok:
        pytest.skip(f"Java 17+ is not installed: {detail}")
    tmp: Path = tmp_path_factory.mktemp("archived")
    server = start_server(tmp, embedded_redis.url, workers=2, GEOSWARM_WINDOW_S="2",
                          GEOSWARM_BUCKET_S="1", GEOSWARM_SPARK_MASTER="local[2]")
    try:
        server.wait_workers(2)
        runners = ["r0", "r1"]
        for name in runners:
            server.spawn(name, ["query-runner", "--id", name])
        key = server.new_key("arch")
        oracle = Oracle()
        rng = random.Random(5)
        publish(server, key, oracle, rng, 40, 0)
        # the first batches are archived, then more arrive that are not
        last_bucket = int(time.time() // 1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            c = cuts(server)
            if len(c) == 2 and min(c.values()) >= last_bucket - 4:
                break
            time.sleep(0.5)
        for name in runners:
            runner_ready(server, name)
        yield Archived(server, key, oracle, runners)
    finally:
        server.stop()


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


@pytest.mark.parametrize("body", QUERIES, ids=lambda b: b["type"] + "-" + "-".join(
    k for k in ("bbox", "circle", "keywords", "latest", "point") if k in b))
def test_queries_over_live_and_archive_equal_the_oracle(archived: Archived,
                                                        body: dict[str, Any]) -> None:
    rng = random.Random(str(body))
    # a few records more, which stay in the live window while the query runs
    publish(archived.server, archived.key, archived.oracle, rng, 2, 1000 + rng.randrange(10**6))
    t0 = 1_700_000_000.0 + rng.choice([0, 150])
    full = {**body, "from": t0}
    out = archived.query(full)
    assert got(full, out["results"]) == archived.oracle.answer(full), out
    sources = out["sources"]
    assert set(sources) == {"live", "archive"}
    if body["type"] in ("range", "keyword", "count") and body.get("limit", 0) > 1000:
        assert sources["archive"] > 0 and sources["live"] > 0, sources
    if body["type"] != "topk_terms":
        n = out["results"][0]["count"] if body["type"] == "count" else len(out["results"])
        assert sources["live"] + sources["archive"] == n


def test_a_time_range_inside_the_archive_only(archived: Archived) -> None:
    body = {"type": "range", "bbox": list(BBOX), "from": 1_700_000_000.0 + 500,
            "to": 1_700_000_000.0 + 1500, "limit": 10_000}
    out = archived.query(body)
    assert got(body, out["results"]) == archived.oracle.answer(body)
    assert out["sources"]["live"] == 0 and out["sources"]["archive"] > 0


def test_a_runner_killed_while_it_runs_a_query_is_replaced(archived: Archived) -> None:
    """Both runners are paused inside their blocking reads: Redis hands the part to one of
    them, where it is pending; that one is SIGKILLed holding it; the other, resumed, claims it
    once the dead one's heartbeat is stale, and the query (polled) is exact."""
    server = archived.server
    client = redis.Redis.from_url(server.redis_url)
    body = {"type": "range", "bbox": list(BBOX), "keywords": ["park"], "from": 0.0,
            "limit": 10_000}
    holder: str | None = None
    try:
        for name in archived.runners:
            server.kill(name, signal.SIGSTOP)
        r = httpx.post(server.base_url + "/v1/queries", json={**body, "wait_s": 0},
                       headers=auth(archived.key), timeout=30)
        assert r.status_code == 202, r.text
        qid = r.json()["id"]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and holder is None:
            pending = client.xpending(names.ARCHIVE_JOBS, names.RUNNER_GROUP)
            holder = next((c["name"].decode() for c in pending.get("consumers") or []
                           if c["pending"]), None)
            time.sleep(0.01)
        if holder is not None:
            server.kill(holder, signal.SIGKILL)
    finally:
        for name in archived.runners:
            if name != holder:
                server.kill(name, signal.SIGCONT)
        client.close()
    assert holder is not None, "no runner was blocked in its read when the part came"
    other = next(n for n in archived.runners if n != holder)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = httpx.get(server.base_url + f"/v1/queries/{qid}", headers=auth(archived.key),
                        timeout=10).json()
        if out["status"] != "running":
            break
        time.sleep(0.3)
    assert out["status"] == "done", out
    assert got(body, out["results"]) == archived.oracle.answer(body)
    assert f"takes over the parts of ['{holder}']" in (
        server.log_dir / f"{other}.log").read_text()
    server.spawn(holder, ["query-runner", "--id", holder])  # for the tests after


def test_metrics_show_the_flush_and_the_runners(archived: Archived) -> None:
    archived.query({"type": "count", "bbox": list(BBOX), "from": 0.0})
    time.sleep(1.5)  # a heartbeat carries the figures
    text = httpx.get(archived.server.base_url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
        assert lines, f"{name} missing"
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)

    assert total("geoswarm_archive_buckets_flushed_total") > 0
    assert total("geoswarm_archive_cut_bucket") > 0
    assert total("geoswarm_archive_jobs_done_total") > 0
    assert total("geoswarm_archive_rows_read_total") > 0
    assert total("geoswarm_archive_bytes_read_total") > 0
    assert "geoswarm_archive_jobs_queued " in text


HOT = [-6.0, -4.0, -3.0, -1.0]  # a small region queried often: AQWA splits around it


def rows_read(server: LiveServer) -> float:
    time.sleep(1.5)  # the runners' heartbeats carry the figures
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("geoswarm_archive_rows_read_total{"))


def test_compaction_while_queries_run_changes_no_answer(archived: Archived,
                                                        spark: SparkSession) -> None:
    """AQWA's compaction runs (twice, in this process's Spark session: the first layout, then
    splits where the logged queries are) while a thread keeps
    asking queries of every kind: every answer equals the oracle, before, during and after
    each switch. A small query then reads fewer rows."""
    import threading

    from app.archive.layout import ArchiveStore
    from app.core.config import Settings
    from spark.compact import compact_tenant

    server = archived.server
    for _ in range(6):  # the workload: a hot region
        archived.query({"type": "count", "bbox": HOT, "from": 0.0})
    bodies = [{"type": "range", "bbox": list(BBOX), "from": 0.0, "limit": 10_000},
              {"type": "count", "bbox": HOT, "from": 0.0},
              {"type": "knn", "point": [-5.0, -2.0], "k": 9, "from": 0.0},
              {"type": "range", "bbox": list(BBOX), "latest": True, "from": 0.0,
               "limit": 10_000}]
    expected = [archived.oracle.answer(b) for b in bodies]
    wrong: list[Any] = []
    asked = [0]
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            for body, want in zip(bodies, expected, strict=True):
                out = archived.query(body)
                asked[0] += 1
                if got(body, out["results"]) != want:
                    wrong.append((body, out))

    before_small = rows_read(server)
    archived.query({"type": "range", "bbox": HOT, "from": 0.0, "limit": 10_000})
    small_before = rows_read(server) - before_small
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    try:
        # a coarse first layout, then a finer minimum: AQWA splits where the queries are
        settings = Settings(environment="test", data_dir=Path(server.env["GEOSWARM_DATA_DIR"]),
                            spark_master="local[2]")
        client = redis.Redis.from_url(server.redis_url)
        try:
            first = compact_tenant(spark, settings, client, "arch", 1000)
            done = compact_tenant(spark, settings, client, "arch", 60)
        finally:
            client.close()
        time.sleep(1)
    finally:
        stop.set()
        thread.join(120)
    assert not wrong, wrong[:2]
    assert asked[0] >= 8, asked
    assert first is not None and first.version == 1, first
    assert done is not None and done.version == 2 and done.split >= 1, done
    assert done.cost_after < done.cost_before
    store = ArchiveStore(server.env["GEOSWARM_DATA_DIR"] + "/archive")
    manifest = store.manifest("arch")
    assert manifest is not None and manifest.version == 2
    assert len(manifest.partitions) > 1
    assert sum(p.records for p in manifest.partitions) <= len(archived.oracle.records)
    geo = httpx.get(server.base_url + "/v1/admin/archive/partitions",
                    params={"tenant": "arch"}, headers=server.admin(), timeout=10).json()
    assert geo["type"] == "FeatureCollection" and geo["layout_version"] == 2
    assert len(geo["features"]) == len(manifest.partitions)
    assert sum(f["properties"]["records"] for f in geo["features"]) == sum(
        p.records for p in manifest.partitions)
    assert max(f["properties"]["queries"] for f in geo["features"]) > 0
    mark = rows_read(server)
    archived.query({"type": "range", "bbox": HOT, "from": 0.0, "limit": 10_000})
    small_after = rows_read(server) - mark
    assert small_after * 2 < small_before, (small_before, small_after)
    for body, want in zip(bodies, expected, strict=True):
        assert got(body, archived.query(body)["results"]) == want
