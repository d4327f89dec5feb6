"""A Redis Cluster is not supported yet: geoswarm's processes pointed at a node of one (a real
3-node cluster of the embedded redis-server binary, made with its redis-cli) stop at once with
a message that names the problem, instead of failing on the first key of another node's slots
with a MOVED error. A standalone Redis, or one that does not answer, is not refused."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.core.processes import stop_processes
from app.core.redis import (
    ClusterNotSupported,
    EmbeddedRedis,
    free_port,
    redis_executable,
    refuse_cluster,
)
from tests.conftest import ROOT

MESSAGE = "Redis Cluster is not supported yet"


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of the first node of a running 3-primary Redis Cluster."""
    server = redis_executable()
    cli = str(Path(server).with_name("redis-cli"))
    ports = _cluster_ports(3)
    procs = []
    for port in ports:
        d = tmp_path_factory.mktemp(f"node{port}")
        procs.append(subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--dir", str(d), "--save", "",
             "--appendonly", "no", "--logfile", str(d / "redis.log")],
            stdin=subprocess.DEVNULL))
    try:
        for port in ports:
            _wait(lambda port=port: redis.Redis(port=port).ping())
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        first = redis.Redis(port=ports[0])
        _wait(lambda: first.info("cluster")["cluster_enabled"] == 1
              and b"cluster_state:ok" in first.execute_command("CLUSTER", "INFO"))
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        stop_processes(procs)


def _cluster_ports(n: int) -> list[int]:
    """Free ports for cluster nodes: at most 55535, each with its cluster bus port (10 000
    higher) free too (ephemeral ports from the OS are often above that)."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(20_000, 45_000)
        if port in ports:
            continue
        try:
            for p in (port, port + 10_000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        ports.append(port)
    return ports


def _wait(ok: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ok():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not come up")
        time.sleep(0.1)


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
