"""Archive queries with geoswarm on a Redis Cluster (a real 3-primary cluster of the embedded
redis-server binary): the workers flush their windows to the archive, a query runner answers
the archived part (its jobs, heartbeats and replies in the cluster's slots) and the workers the
live one; every query type over both equals the oracle."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from app.core.redis import sync_client
from app.pipeline import names
from bench.redis_cluster import redis_cluster
from spark.session import java_available
from tests.conftest import start_server
from tests.spark.archive_oracle import (
    QUERIES,
    SLOW_QUERY_S,
    Archived,
    Oracle,
    got,
    publish,
    runner_ready,
)

pytestmark = [pytest.mark.slow, pytest.mark.spark]

# one query of each type (the Spark suite runs them all on one Redis)
BODIES = [next(q for q in QUERIES if q["type"] == t)
          for t in ("range", "keyword", "knn", "count", "topk_terms")]


def test_queries_over_live_and_archive_on_a_redis_cluster(tmp_path: Path) -> None:
    ok, detail = java_available()
    if not ok:
        pytest.skip(f"Java 17+ is not installed: {detail}")
    with redis_cluster(tmp_path / "redis") as url:
        server = start_server(tmp_path, url, workers=2, own_db=False, GEOSWARM_WINDOW_S="2",
                              GEOSWARM_BUCKET_S="1", GEOSWARM_SPARK_MASTER="local[2]",
                              GEOSWARM_QUERY_TIMEOUT_S=str(SLOW_QUERY_S))
        client = sync_client(url)
        try:
            server.wait_workers(2)
            archived = Archived(server, server.new_key("arch"), Oracle(), {"r0": {}})
            archived.spawn_runner("r0")
            publish(server, archived.key, archived.oracle, random.Random(5), 30, 0)
            last = int(time.time()) - 4
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                cuts = [int(v) for v in client.hgetall(names.ARCHIVE_CUT).values()]
                if len(cuts) == 2 and min(cuts) >= last:
                    break
                time.sleep(0.5)
            else:
                raise AssertionError("the workers did not flush their windows to the archive")
            runner_ready(server, "r0")
            for body in BODIES:
                full = {**body, "from": 1_700_000_000.0}
                out = archived.query(full)
                assert got(full, out["results"]) == archived.oracle.answer(full), (body, out)
                assert out["sources"]["archive"] > 0, out["sources"]
        finally:
            client.close()
            server.stop()
