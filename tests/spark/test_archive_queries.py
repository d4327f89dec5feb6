"""Snapshot queries over the live window and the archive together, with real processes: two
workers flushing expired buckets to Parquet, query runners (each a real SparkSession), the api.
Every query type equals a brute-force oracle over every record ever accepted, each record
found once across the boundary, with `sources` saying which side gave what; a query whose
runner is SIGKILLed while it runs is taken by another runner and answered exactly."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pyspark.sql import SparkSession

from app.pipeline import names
from tests.conftest import ROOT, LiveServer, auth, start_server
from tests.spark.archive_oracle import (
    BBOX,
    QUERIES,
    SLOW_QUERY_S,
    Archived,
    Asking,
    Oracle,
    got,
    publish,
    runner_ready,
    wait_archived,
)
from tests.spark.conftest import ConnectServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def archived(tmp_path_factory: pytest.TempPathFactory, embedded_redis: Any,  # type: ignore[no-untyped-def]
             connect_server: ConnectServer):
    """Two runners: r0 with a SparkSession of its own, r1 a client of a Spark Connect server
    (GEOSWARM_SPARK_REMOTE), which starts no JVM of its own."""
    tmp: Path = tmp_path_factory.mktemp("archived")
    server = start_server(tmp, embedded_redis.url, workers=2, GEOSWARM_WINDOW_S="2",
                          GEOSWARM_BUCKET_S="1", GEOSWARM_SPARK_MASTER="local[2]",
                          GEOSWARM_QUERY_TIMEOUT_S=str(SLOW_QUERY_S))
    try:
        server.wait_workers(2)
        runners: dict[str, dict[str, str]] = {"r0": {}, "r1": {}}
        key = server.new_key("arch")
        archived = Archived(server, key, Oracle(), runners)
        archived.spawn_runner("r0")
        publish(server, key, archived.oracle, random.Random(5), 40, 0)
        # its URL once it is up: a start that lost its port to another process starts again
        runners["r1"]["GEOSWARM_SPARK_REMOTE"] = connect_server.wait_ready()
        archived.spawn_runner("r1")
        wait_archived(server, 2)
        for name in runners:
            runner_ready(server, name)
        yield archived
    finally:
        server.stop()


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
    # no part of an earlier query still pending (answered, not yet acknowledged): the runner
    # holding one would pass for the holder of this query's part
    deadline = time.monotonic() + 10
    while client.xpending(names.ARCHIVE_JOBS, names.RUNNER_GROUP)["pending"]:
        assert time.monotonic() < deadline, "parts of earlier queries still pending"
        time.sleep(0.05)
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
    archived.spawn_runner(holder)  # for the tests after


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


def replaced(store: Any, tenant: str) -> list[str]:
    """The files the current layout no longer reads: bucket files it absorbed, and files of
    older layouts it did not keep."""
    import pyarrow.fs as pafs

    current = store.manifest(tenant)
    assert current is not None
    kept = current.kept()
    own = store.version_dir(tenant, current.version) + "/"
    top = store.compact_dir(tenant)
    older = [i.path for i in store.fs.get_file_info(pafs.FileSelector(top, recursive=True))
             if i.type == pafs.FileType.File and i.path.rsplit("/", 1)[0] != top  # CURRENT
             and not i.path.startswith(own) and i.path not in kept]
    return sorted([f.path for f in store.bucket_files(tenant) if current.covers(f)] + older)


def test_compaction_while_queries_run_changes_no_answer(archived: Archived,
                                                        spark: SparkSession) -> None:
    """AQWA's compaction runs (twice, in this process's Spark session: the first layout, then
    splits where the logged queries are) while a thread keeps
    asking queries of every kind: every answer equals the oracle, before, during and after
    each switch. A small query then reads fewer rows."""

    import pyarrow.fs as pafs

    from app.archive.layout import ArchiveStore
    from app.core.config import Settings
    from spark.compact import clean, compact_tenant

    server = archived.server
    for _ in range(6):  # the workload: a hot region
        archived.query({"type": "count", "bbox": HOT, "from": 0.0})
    bodies = [{"type": "range", "bbox": list(BBOX), "from": 0.0, "limit": 10_000},
              {"type": "count", "bbox": HOT, "from": 0.0},
              {"type": "knn", "point": [-5.0, -2.0], "k": 9, "from": 0.0},
              {"type": "range", "bbox": list(BBOX), "latest": True, "from": 0.0,
               "limit": 10_000}]
    before_small = rows_read(server)
    archived.query({"type": "range", "bbox": HOT, "from": 0.0, "limit": 10_000})
    small_before = rows_read(server) - before_small
    with Asking(archived, bodies) as asking:
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
    assert not asking.wrong, asking.wrong[:2]
    assert asking.asked >= 8, asking.asked
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
    for body, want in zip(bodies, asking.expected, strict=True):
        assert got(body, archived.query(body)["results"]) == want
    # what v2 replaced (v1's files it did not keep, the bucket files it absorbed) stays for
    # the grace period, then goes
    gone = replaced(store, "arch")
    assert gone
    assert clean(store, "arch", grace_s=3600, now=time.time()) == 0
    assert replaced(store, "arch") == gone
    assert clean(store, "arch", grace_s=0, now=time.time()) > 0
    assert replaced(store, "arch") == []
    assert all(store.fs.get_file_info(path).type == pafs.FileType.File
               for p in manifest.partitions for path in p.files)
    for body, want in zip(bodies, asking.expected, strict=True):
        assert got(body, archived.query(body)["results"]) == want


def test_a_connect_runner_alone_answers_and_compacts_on_its_schedule(
        archived: Archived) -> None:
    """The last test (it stops r0 and r1): a runner that is a Spark Connect client (no JVM of
    its own) answers every query alone, reports what its scans read (the metrics the server
    sends back with each action), and compacts the archive on its schedule while a thread
    keeps asking; what a layout replaced goes only after the grace period."""

    import pyarrow.fs as pafs

    from app.archive.layout import ArchiveStore

    server = archived.server
    grace_s = 4.0
    store = ArchiveStore(server.env["GEOSWARM_DATA_DIR"] + "/archive")
    before = store.manifest("arch")
    assert before is not None
    for name in list(archived.runners):
        server.kill(name, signal.SIGTERM)
    archived.runners["r2"] = {**archived.runners["r1"], "GEOSWARM_ARCHIVE_COMPACT_S": "1",
                              "GEOSWARM_ARCHIVE_COMPACT_GRACE_S": str(grace_s),
                              "GEOSWARM_ARCHIVE_MIN_FILE_RECORDS": "200"}
    archived.spawn_runner("r2")
    runner_ready(server, "r2")
    log = (server.log_dir / "r2.log").read_text()
    assert "connecting to Spark Connect" in log and "starting Spark on" not in log, log

    # queries over what is published so far (`to`), which the records to come cannot change
    settled = max(r.ts for r in archived.oracle.records)
    bodies: list[dict[str, Any]] = [
        {"type": "range", "bbox": list(BBOX), "from": 0.0, "to": settled, "limit": 10_000},
        {"type": "count", "bbox": HOT, "from": 0.0, "to": settled},
        {"type": "knn", "point": [-5.0, -2.0], "k": 9, "from": 0.0, "to": settled}]

    def wait_for(what: str, check: Any, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (value := check()):
                return value
            time.sleep(0.3)
        raise TimeoutError(f"{what}:\n{(server.log_dir / 'r2.log').read_text()[-3000:]}")

    with Asking(archived, bodies) as asking:
        first = int((settled - 1_700_000_000.0) // 100) + 10
        publish(server, archived.key, archived.oracle, random.Random(8), 15, first)
        wait_archived(server, 2)
        newer = wait_for("a scheduled compaction", lambda: (
            m := store.manifest("arch")) is not None and m.version > before.version and m)
    assert not asking.wrong, asking.wrong[:2]
    assert asking.asked >= 3, asking.asked

    def cleaned() -> bool:
        return replaced(store, "arch") == []

    wait_for("the files the layout replaced deleted", cleaned)
    current = store.manifest("arch")
    assert current is not None and current.version >= newer.version
    assert time.time() - current.created >= grace_s
    assert all(store.fs.get_file_info(path).type == pafs.FileType.File
               for p in current.partitions for path in p.files)
    assert f"compacted arch into v{newer.version}" in (server.log_dir / "r2.log").read_text()

    for body in QUERIES:
        full = {**body, "from": 0.0}
        assert got(full, archived.query(full)["results"]) == archived.oracle.answer(full), full
    time.sleep(1.5)  # a heartbeat carries the figures
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for name in ("geoswarm_archive_rows_read_total", "geoswarm_archive_bytes_read_total"):
        line = next(ln for ln in text.splitlines() if ln.startswith(name + '{runner="r2"}'))
        assert float(line.rsplit(" ", 1)[1]) > 0, line

    # `geoswarm archive compact`, as an operator runs it (a Connect client too): it absorbs
    # what was archived since, and a new runner answers from that layout
    server.kill("r2", signal.SIGTERM)
    publish(server, archived.key, archived.oracle, random.Random(9), 5, first + 100)
    wait_archived(server, 2, through=time.time())
    out = subprocess.run([sys.executable, "-m", "app.cli", "archive", "compact", "--tenant",
                          "arch", "--min-records", "200"],
                         env={**server.env, **archived.runners["r1"]}, cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    latest = store.manifest("arch")
    assert latest is not None and latest.version > current.version
    assert out.stdout.startswith(f"arch: layout v{latest.version}, "), out.stdout
    archived.runners["r3"] = archived.runners["r1"]
    archived.spawn_runner("r3")
    runner_ready(server, "r3")
    for body in QUERIES[:3]:
        full = {**body, "from": 0.0}
        assert got(full, archived.query(full)["results"]) == archived.oracle.answer(full), full
