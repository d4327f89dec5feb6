"""A Redis Cluster is not supported yet: geoswarm's processes pointed at a node of one (a real
3-node cluster of the embedded redis-server binary, made with its redis-cli) stop at once with
a message that names the problem, instead of failing on the first key of another node's slots
with a MOVED error. A standalone Redis, or one that does not answer, is not refused."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.core.redis import (
    ClusterNotSupported,
    EmbeddedRedis,
    free_port,
    refuse_cluster,
)
from tests.conftest import ROOT
from tests.redis_cluster import redis_cluster

MESSAGE = "Redis Cluster is not supported yet"


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of the first node of a running 3-primary Redis Cluster."""
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as url:
        yield url


def _run(args: list[str], url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GEOSWARM_REDIS_URL": url, "GEOSWARM_DATA_DIR": str(tmp_path),
           "GEOSWARM_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}",
           "GEOSWARM_ENVIRONMENT": "test"}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", [["worker", "--id", "w0"], ["coordinator"]])
def test_a_process_pointed_at_a_cluster_node_stops_with_the_reason(
        cluster_url: str, tmp_path: Path, command: list[str]) -> None:
    r = _run(command, cluster_url, tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    port = cluster_url.rsplit(":", 1)[1].split("/")[0]
    assert MESSAGE in r.stderr and f"127.0.0.1:{port}" in r.stderr, r.stderr[-2000:]
    assert "MOVED" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_the_api_pointed_at_a_cluster_node_does_not_start(cluster_url: str,
                                                           tmp_path: Path) -> None:
    migrated = _run(["migrate"], cluster_url, tmp_path)
    assert migrated.returncode == 0, migrated.stderr[-2000:]
    r = _run(["api", "--port", str(free_port()), "--no-migrate"], cluster_url, tmp_path)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert MESSAGE in out and "MOVED" not in out, out[-2000:]


def test_a_standalone_redis_or_one_that_does_not_answer_is_not_refused(
        cluster_url: str, embedded_redis: EmbeddedRedis) -> None:
    refuse_cluster(embedded_redis.url)  # a standalone server
    refuse_cluster(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    with pytest.raises(ClusterNotSupported, match=MESSAGE):
        refuse_cluster(cluster_url)
