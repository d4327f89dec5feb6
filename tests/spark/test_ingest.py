"""`geoswarm ingest` with real processes: an api and two workers, a query runner, and the ingest
command itself (a SparkSession of its own) run as the operator runs it, with the cluster's
environment (the archive loads run its code in the tests' Spark session, which spares a JVM
start each). Rows loaded to the archive are then found exactly once by snapshot queries (a
brute-force oracle over the good rows); rows loaded live reach a WebSocket subscriber exactly
once; the rejects folder holds exactly the bad rows, each with the reason naming its field."""

from __future__ import annotations

import asyncio
import csv
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from app.core.config import Settings
from app.geo.geometry import bbox_contains, haversine_m
from spark.ingest import Counts, Options, parse_mapping
from spark.ingest import main as ingest_main
from spark.session import java_available
from tests.conftest import ROOT, LiveServer, start_server
from tests.spark.archive_oracle import SLOW_QUERY_S, ask, runner_ready
from tests.workers.harness import subscribe_listening, wait_for
from tests.workers.oracle import Oracle, record_keywords

pytestmark = pytest.mark.slow

TS0 = 1_600_000_000.0
BBOX = [-30.0, -20.0, 30.0, 20.0]
WORDS = ["taxi", "bus", "rain", "jam"]


@dataclass
class Cluster:
    server: LiveServer
    tmp: Path

    def ingest(self, *args: str, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "app.cli", "ingest", *args],
                              env=env or self.server.env, cwd=ROOT, capture_output=True,
                              text=True, timeout=180)

    def ingest_here(self, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
                    options: Options) -> Counts:
        """The command's own code (`spark.ingest.main`) with the cluster's environment, in this
        process's Spark session: no JVM start. The CLI itself is run by the other tests."""
        for name, value in self.server.env.items():
            if name.startswith("GEOSWARM_"):
                monkeypatch.setenv(name, value)
        return ingest_main(Settings(), options, spark)

    def query(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        runner_ready(self.server, "r0")
        return ask(self.server, self.server.new_key(tenant), body)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, embedded_redis: Any) -> Iterator[Cluster]:
    ok, detail = java_available()
    if not ok:
        pytest.skip(f"Java 17+ is not installed: {detail}")
    tmp = tmp_path_factory.mktemp("ingest")
    server = start_server(tmp, embedded_redis.url, workers=2, GEOSWARM_SPARK_MASTER="local[2]",
                          GEOSWARM_QUERY_TIMEOUT_S=str(SLOW_QUERY_S))
    try:
        server.spawn("r0", ["query-runner", "--id", "r0"])
        server.wait_workers(2)
        yield Cluster(server, tmp)
    finally:
        server.stop()


def good_objects(rng: random.Random, n: int, first: int) -> list[dict[str, Any]]:
    """API objects with a unique ts and text each: moving objects (id) and events."""
    out = []
    for i in range(first, first + n):
        obj: dict[str, Any] = {"lon": round(rng.uniform(-25, 25), 6),
                               "lat": round(rng.uniform(-15, 15), 6), "ts": TS0 + i * 37.5,
                               "text": f"row {i}"}
        kws = rng.sample(WORDS, rng.randint(0, 2))
        if kws:
            obj["keywords"] = [k.upper() if i % 2 else k for k in kws]
        if i % 3 == 0:
            obj["id"] = f"car-{i}"
        if i % 4 == 0:
            obj["props"] = {"n": i, "note": 'a, "quoted" b'}
        out.append(obj)
    return out


def write_csv(path: Path, objs: list[dict[str, Any]], extra: dict[str, str] | None = None) -> None:
    """Objects as a CSV table (keywords separated by `;`, props as JSON), with more columns."""
    columns = ["id", "lon", "lat", "ts", "text", "keywords", "props", *(extra or {})]
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(columns)
        for obj in objs:
            cells = {**obj, **(extra or {})}
            if isinstance(cells.get("keywords"), list):
                cells["keywords"] = ";".join(cells["keywords"])
            if isinstance(cells.get("props"), dict):
                cells["props"] = orjson.dumps(cells["props"]).decode()
            out.writerow(["" if cells.get(c) is None else str(cells[c]) for c in columns])


def write_lines(path: Path, lines: list[Any]) -> None:
    """JSON lines (strings are written as they are); renamed into place, as a watched directory
    needs."""
    tmp = path.with_name("." + path.name)
    tmp.write_text("".join((x if isinstance(x, str) else orjson.dumps(x).decode()) + "\n"
                           for x in lines))
    os.replace(tmp, path)


def record_key(obj: dict[str, Any]) -> tuple[Any, ...]:
    """A record as queries return it, without the ids the server gives events."""
    return (obj["id"] if "id" in obj and not obj.get("event") else None, obj["lon"], obj["lat"],
            obj["ts"], tuple(sorted(obj["keywords"])), obj.get("text"),
            orjson.dumps(obj.get("props"), option=orjson.OPT_SORT_KEYS))


def stored(obj: dict[str, Any]) -> dict[str, Any]:
    return {**obj, "keywords": record_keywords(obj), "event": "id" not in obj}


def oracle(objs: list[dict[str, Any]], body: dict[str, Any]) -> Counter[tuple[Any, ...]]:
    """The records a range or keyword query over the archive returns (no limit reached)."""
    rows = [stored(o) for o in objs if body["from"] <= o["ts"] <= body.get("to", 1e11)]
    if "bbox" in body:
        rows = [r for r in rows if bbox_contains(tuple(body["bbox"]), r["lon"], r["lat"])]
    if "circle" in body:
        c = body["circle"]
        rows = [r for r in rows
                if haversine_m(c["lon"], c["lat"], r["lon"], r["lat"]) <= c["radius_m"]]
    wanted = set(body.get("keywords") or [])
    if wanted:
        rows = [r for r in rows if wanted & set(r["keywords"])]
    return Counter(record_key(r) for r in rows)


def got(results: list[dict[str, Any]], moving: set[str]) -> Counter[tuple[Any, ...]]:
    return Counter(record_key({**r, "event": r["id"] not in moving}) for r in results)


QUERIES: list[dict[str, Any]] = [
    {"type": "range", "bbox": BBOX},
    {"type": "range", "circle": {"lon": 3.0, "lat": 2.0, "radius_m": 900_000},
     "keywords": ["taxi", "jam"]},
    {"type": "keyword", "keywords": ["bus"]},
    {"type": "range", "bbox": [-10.0, -10.0, 10.0, 10.0], "to": TS0 + 40 * 37.5},
]


def assert_found_once(cluster: Cluster, tenant: str, objs: list[dict[str, Any]],
                      bodies: list[dict[str, Any]] = QUERIES) -> None:
    """Snapshot queries reaching before the window equal the oracle, and count all: every
    record once, all from the archive."""
    moving = {o["id"] for o in objs if "id" in o}
    for body in bodies:
        body = {**body, "from": TS0 - 1, "limit": 10_000}
        out = cluster.query(tenant, body)
        assert got(out["results"], moving) == oracle(objs, body), body
        assert out["sources"] == {"live": 0, "archive": len(out["results"])}, out["sources"]
    out = cluster.query(tenant, {"type": "count", "bbox": BBOX, "from": TS0 - 1})
    assert out["results"] == [{"count": len(objs)}]


def read_rejects(folder: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for f in sorted(folder.rglob("*.json"))
            for line in f.read_text().splitlines() if line.strip()]


def final_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_csv_and_json_lines_to_the_archive(cluster: Cluster, spark: SparkSession,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(1)
    csv_good, json_good = good_objects(rng, 40, 0), good_objects(rng, 40, 40)
    row = {"lon": 1.0, "lat": 2.0, "ts": TS0 + 5}
    csv_bad = {  # label (the row's text) -> the field its reason names
        "bad-csv-lat": ({**row, "lat": 95}, "lat: Input should be less than or equal to 90"),
        "bad-csv-nan": ({**row, "lon": "NaN"}, "lon: Input should be a finite number"),
        "bad-csv-nolon": ({**row, "lon": None}, "lon: Field required"),
        "bad-csv-ts": ({**row, "ts": "yesterday"}, "ts: Input should be a valid number"),
        "bad-csv-kws": ({**row, "keywords": [f"k{i}" for i in range(65)]},
                        "keywords: List should have at most 64 items"),
        "bad-csv-id": ({**row, "id": "x" * 129}, "id: String should have at most 128"),
        "bad-csv-props": ({**row, "props": "{not json"}, "props: not valid JSON"),
    }
    json_bad = {
        "bad-json-lat": ({**row, "lat": 95.5}, "lat: Input should be less than or equal to 90"),
        "bad-json-nolon": ({"lat": 1.0}, "lon: Field required"),
        "bad-json-ts": ({**row, "ts": "yesterday"}, "ts: Input should be a valid number"),
        "bad-json-kws": ({**row, "keywords": [f"k{i}" for i in range(65)]},
                         "keywords: List should have at most 64 items"),
        "bad-json-id": ({**row, "id": "x" * 129}, "id: String should have at most 128"),
        "bad-json-props": ({**row, "props": "not json"},
                           "props: Input should be a valid dictionary"),
        "bad-json-extra": ({**row, "color": "red"}, "color: Extra inputs are not permitted"),
    }
    src = cluster.tmp / "src1"
    src.mkdir()
    csv_rows = [*csv_good[:20], *({**o, "text": k} for k, (o, _) in csv_bad.items()),
                *csv_good[20:]]
    write_csv(src / "a.csv", csv_rows, extra={"color": "red"})  # a column of no field: ignored
    lines: list[Any] = [*({**o, "text": k} for k, (o, _) in json_bad.items()), *json_good]
    lines[10:10] = ["{bad", "   "]  # a malformed line, and a blank one (skipped, not read)
    write_lines(src / "b.jsonl", lines)
    rejects = cluster.tmp / "rejects1"

    counts = cluster.ingest_here(spark, monkeypatch, Options(
        paths=[str(src / "a.csv"), str(src / "b.jsonl")], tenant="tcsv", to="archive",
        rejects=str(rejects)))
    err = capsys.readouterr().err
    assert str(counts) == "read 95, accepted 80, rejected 15", err
    assert "ignoring columns color" in err

    found = {(r.get("text") or r.get("line")): r for r in read_rejects(rejects)}
    want = {**{k: v[1] for k, v in csv_bad.items()}, **{k: v[1] for k, v in json_bad.items()},
            "{bad": "malformed JSON"}
    assert sorted(found) == sorted(want)
    for label, reason in want.items():
        assert reason in found[label]["reason"], (label, found[label])
    assert found["bad-csv-lat"]["lat"] == "95" and found["bad-csv-lat"]["color"] == "red"
    assert found["bad-csv-lat"]["file"].endswith("/a.csv")
    assert found["bad-json-lat"]["lat"] == "95.5"
    assert found["bad-json-kws"]["keywords"].startswith('["k0","k1"')
    assert all(isinstance(v, str) for r in found.values() for v in r.values())

    assert_found_once(cluster, "tcsv", [*csv_good, *json_good])


def test_parquet_with_mapped_columns(cluster: Cluster, spark: SparkSession,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(2)
    good = good_objects(rng, 60, 100)
    bad = [{"lon": 3.0, "lat": 95.0, "ts": TS0, "text": "bad-lat"},
           {"lon": None, "lat": 5.0, "ts": TS0, "text": "bad-lon"}]
    rows = good[:30] + bad + good[30:]
    table = pa.table({
        "ident": pa.array([o.get("id") for o in rows], pa.string()),
        "x": pa.array([o["lon"] for o in rows], pa.float64()),
        "y": pa.array([o["lat"] for o in rows], pa.float64()),
        "time": pa.array([o["ts"] for o in rows], pa.float64()),
        "tags": pa.array([o.get("keywords") for o in rows], pa.list_(pa.string())),
        "attrs": pa.array([None if o.get("props") is None else orjson.dumps(o["props"]).decode()
                           for o in rows], pa.string()),
        "note": pa.array([o["text"] for o in rows], pa.string()),
    })
    path = cluster.tmp / "objects.parquet"
    pq.write_table(table, path)
    rejects = cluster.tmp / "rejects2"
    mapping = parse_mapping(["id=ident", "lon=x", "lat=y", "ts=time", "keywords=tags",
                             "props=attrs", "text=note"])
    counts = cluster.ingest_here(spark, monkeypatch, Options(
        paths=[str(path)], tenant="tpq", to="archive", rejects=str(rejects), mapping=mapping))
    assert str(counts) == "read 62, accepted 60, rejected 2"
    found = {r["note"]: r["reason"] for r in read_rejects(rejects)}
    assert found == {"bad-lat": "lat (column y): Input should be less than or equal to 90",
                     "bad-lon": "lon (column x): Field required"}
    assert_found_once(cluster, "tpq", good, QUERIES[:1])


def test_live_rows_reach_a_subscriber_once(cluster: Cluster) -> None:
    rng = random.Random(3)
    # more than one publish batch (LIVE_BATCH), moving objects and events, and two bad rows
    good = good_objects(rng, 2_500, 1_000)
    lines: list[Any] = [*good[:700], {"lon": 1.0, "lat": 91.0}, {"lat": 0.0}, *good[700:]]
    path = cluster.tmp / "live.ndjson"
    write_lines(path, lines)
    specs: list[dict[str, Any]] = [
        {"type": "range", "bbox": [-10.0, -10.0, 10.0, 10.0]},
        {"type": "range", "circle": {"lon": -12.0, "lat": 4.0, "radius_m": 900_000},
         "keywords": ["taxi"]},
        {"type": "keyword", "keywords": ["rain", "jam"], "match": "all"},
        {"type": "range", "bbox": [40.0, 40.0, 50.0, 50.0]},  # nothing there
    ]
    server = cluster.server
    key = server.new_key("tlive")

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            ids, listener = await subscribe_listening(server, client, key, specs)
            expected = Oracle(subs=dict(zip(ids, specs, strict=True)))
            # ts is unique per row: it names the record (events' ids are the server's)
            expected.publish(good, [o.get("id", f"event-{o['ts']}") for o in good])
            want = Counter({(s, ts, d): n for (s, _, ts, d), n in expected.expected.items()})
            assert expected.total() > 500
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.cli", "ingest", str(path), "--tenant", "tlive",
                "--to", "live", env=server.env, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 180)
            assert proc.returncode == 0, (out + err).decode()
            assert out.decode().strip().splitlines()[-1] == \
                "read 2502, accepted 2500, rejected 2", err.decode()
            await wait_for(lambda: len(listener.matches()) >= expected.total(), 60)
            await asyncio.sleep(1.0)  # anything extra would arrive now
            received = Counter((m["subscription"], m["object"]["ts"], m["detect"])
                               for m in listener.matches())
            await listener.close()
            missing, extra = want - received, received - want
            assert not missing and not extra, (list(missing)[:3], list(extra)[:3])

    asyncio.run(scenario())


def test_watch_ingests_files_as_they_come_until_sigint(cluster: Cluster) -> None:
    """Started as an operator would on the machine of `geoswarm dev`: no GEOSWARM_REDIS_URL,
    the embedded Redis found through the data directory."""
    rng = random.Random(4)
    env = {k: v for k, v in cluster.server.env.items() if k != "GEOSWARM_REDIS_URL"}
    (cluster.tmp / "redis").mkdir(exist_ok=True)
    (cluster.tmp / "redis" / "redis.url").write_text(cluster.server.redis_url)
    drop = cluster.tmp / "drop"
    drop.mkdir()
    out_path, err_path = cluster.tmp / "watch.out", cluster.tmp / "watch.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "ingest", "--watch", str(drop),
                                 "--tenant", "twatch", "--to", "archive", "--rejects",
                                 str(cluster.tmp / "rejects4")],
                                env=env, cwd=ROOT, stdout=out, stderr=err)

    def wait_line(text: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while text not in out_path.read_text():
            assert proc.poll() is None, out_path.read_text() + err_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text() + err_path.read_text()
            time.sleep(0.2)

    first, second = good_objects(rng, 20, 5_000), good_objects(rng, 15, 6_000)
    try:
        write_lines(drop / "f1.json", [*first[:5], {"lon": 200.0, "lat": 0.0}, *first[5:],
                                       {"lon": 1.0}])
        wait_line("batch 0: read 22, accepted 20, rejected 2")
        write_lines(drop / "f2.json", [*second, {"lon": "east", "lat": 1.0}])
        wait_line("batch 1: read 16, accepted 15, rejected 1")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, err_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out_path.read_text().strip().splitlines()[-1] == "read 38, accepted 35, rejected 3"
    reasons = [r["reason"] for r in read_rejects(cluster.tmp / "rejects4")]
    assert sorted(reasons) == ["lat: Field required", "lon: Input should be a valid number",
                               "lon: Input should be less than or equal to 180"]
    assert_found_once(cluster, "twatch", [*first, *second], QUERIES[:1])


def test_refused_before_spark_starts(cluster: Cluster, tmp_path: Path) -> None:
    """A missing input, an invalid tenant, no system to be found: a clear message, non-zero."""
    data = tmp_path / "in.jsonl"
    data.write_text('{"lon": 1, "lat": 2}\n')
    cases = [
        (["/no/such/file.csv", "--tenant", "t", "--to", "archive"], None, 2,
         "no such file or directory: /no/such/file.csv"),
        ([str(data), "--tenant", "not a tenant", "--to", "archive"], None, 2,
         "invalid tenant 'not a tenant'"),
        ([str(data), "--tenant", "t", "--to", "elsewhere"], None, 2, "choose archive or live"),
        ([str(data), "--tenant", "t", "--to", "live", "--map", "where=lon"], None, 2,
         "--map 'where=lon'"),
        ([str(data), "--tenant", "t", "--to", "archive"],
         {**{k: v for k, v in cluster.server.env.items() if k != "GEOSWARM_REDIS_URL"},
          "GEOSWARM_DATA_DIR": str(tmp_path)}, 1, "no running geoswarm found"),
    ]
    for args, env, code, message in cases:
        proc = cluster.ingest(*args, env=env)
        assert proc.returncode == code, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
