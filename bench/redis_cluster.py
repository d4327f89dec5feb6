"""A real 3-primary Redis Cluster for tests and benchmarks, made of the embedded redis-server
binary with its redis-cli (`--cluster create`)."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from app.core.processes import stop_processes
from app.core.redis import redis_executable, sync_client


@contextmanager
def redis_cluster(tmp: Path, nodes: int = 3) -> Iterator[str]:
    """The URL of the first node of a running Redis Cluster of `nodes` primaries."""
    server = redis_executable()
    cli = str(Path(server).with_name("redis-cli"))
    ports = cluster_ports(nodes)
    procs = []
    for port in ports:
        d = tmp / f"node{port}"
        d.mkdir(parents=True, exist_ok=True)
        procs.append(subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--dir", str(d), "--save", "",
             "--appendonly", "no", "--logfile", str(d / "redis.log")],
            stdin=subprocess.DEVNULL))
    try:
        for port in ports:
            wait(lambda port=port: redis.Redis(host="127.0.0.1", port=port).ping())
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        for port in ports:
            node = redis.Redis(host="127.0.0.1", port=port)
            wait(lambda node=node: b"cluster_state:ok" in node.execute_command("CLUSTER", "INFO"))
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        stop_processes(procs)


def cluster_ports(n: int) -> list[int]:
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


def wait(ok: object, timeout: float = 30.0) -> None:
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


def node_pids(url: str) -> list[int]:
    """The process ids of a cluster's primaries (their CPU is counted by the benchmarks)."""
    client = sync_client(url)
    try:
        infos = client.info("server", target_nodes=redis.RedisCluster.PRIMARIES)
        return sorted(int(info["process_id"]) for info in infos.values())
    finally:
        client.close()
