"""Fixtures that start the real thing: redis-server (embedded, and the machine's Redis 7 when
reachable), SQLite (and PostgreSQL when reachable), worker processes, and the api either
in-process (`inprocess`: route-level tests) or as a uvicorn process (`server`: end-to-end)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.from_thread
import httpx
import pytest
import redis
from fastapi import FastAPI

from app.core.config import Settings, get_settings
from app.core.migrate import upgrade_head
from app.core.processes import stop_processes
from app.core.redis import EmbeddedRedis, async_client, start_embedded_redis
from app.main import create_app
from app.pipeline import names
from app.pipeline.router import ensure_plan
from bench.cluster import (  # noqa: F401 - re-exported
    BOOTSTRAP,
    ROOT,
    LiveServer,
    cluster_env,
    database_slots,
    own_database,
    start_server,
)

# Every JVM the tests start (their SparkSessions, the query runners, a Spark Connect server, the
# archive benchmark) compiles with the quick JIT only and collects on one thread: the tests'
# Spark jobs are short, and the optimising compiler's threads took CPU from everything else on
# two cores (the archive-query tests alone: 120 CPU-seconds against 73 with these options).
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")

# a database of its own for each parallel test process (see bench.cluster.database_slots)
REDIS7_URL = os.environ.get("GEOSWARM_TEST_REDIS7_URL",
                            f"redis://127.0.0.1:6379/{database_slots()[-1]}")
PG_URL = os.environ.get("GEOSWARM_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def redis7_available() -> bool:
    if not _reachable("127.0.0.1", 6379):
        return False
    try:
        return bool(redis.Redis.from_url(REDIS7_URL, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def postgres_available() -> bool:
    if not _reachable("127.0.0.1", 5432):
        return False
    try:
        import psycopg

        with psycopg.connect(PG_URL, connect_timeout=2):
            return True
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(scope="session")
def embedded_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("redis"))
    server = start_embedded_redis(settings)
    yield server
    server.stop()


@pytest.fixture(scope="session", params=["embedded", "redis7"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """The Redis of a test: the embedded redis-server 6.2, and Redis 7 when reachable."""
    if request.param == "redis7":
        if not redis7_available():
            pytest.skip("Redis 7 on 127.0.0.1:6379 is not reachable")
        return REDIS7_URL
    server: EmbeddedRedis = request.getfixturevalue("embedded_redis")
    return server.url


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for this session (dropped after) when one is reachable."""
    if not postgres_available():
        pytest.skip("PostgreSQL on 127.0.0.1:5432 is not reachable")
    import psycopg

    name = "geoswarm_test_" + secrets.token_hex(4)
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_URL.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        base: str = request.getfixturevalue("pg_database")
        import psycopg

        # A clean schema per test on the shared session database.
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute("DROP SCHEMA public CASCADE")
            conn.execute("CREATE SCHEMA public")
        return base
    return f"sqlite:///{tmp_path / 'test.db'}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, embedded_redis: EmbeddedRedis
           ) -> Iterator[LiveServer]:
    """api + 2 workers on the embedded Redis and SQLite, shared by a module's tests."""
    s = start_server(tmp_path_factory.mktemp("server"), embedded_redis.url)
    yield s
    s.stop()


# --- the api in-process --------------------------------------------------------------------

class PortalTransport(httpx.BaseTransport):
    """httpx's ASGITransport for synchronous clients. Every request runs on the event loop of
    `portal`, where the app's lifespan ran (its Redis client and hub live there), so any number
    of clients and threads share one app as they would share one uvicorn."""

    def __init__(self, app: FastAPI, portal: anyio.from_thread.BlockingPortal) -> None:
        self._asgi = httpx.ASGITransport(app)
        self._portal = portal

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()  # a streamed (chunked) body becomes bytes; its headers stay as sent
        return self._portal.call(self._send, request)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        response = await self._asgi.handle_async_request(request)
        body = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=httpx.ByteStream(body), extensions=response.extensions)


@dataclass
class InProcessServer:
    """create_app() with its lifespan, in this process, on the settings an api process would
    read from `env`, against a real Redis and a real database: every route, dependency,
    middleware and error handler as under uvicorn, without the sockets. Matching needs a
    worker: `start_worker()` starts a real worker process on the same environment."""

    app: FastAPI
    portal: anyio.from_thread.BlockingPortal
    settings: Settings
    redis_url: str
    env: dict[str, str]
    log_dir: Path
    admin_key: str = BOOTSTRAP
    base_url: str = "http://testserver"
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def http(self, headers: dict[str, str] | None = None) -> httpx.Client:
        """A client of the app (close it, or use it in a `with`)."""
        return httpx.Client(transport=PortalTransport(self.app, self.portal),
                            base_url=self.base_url, headers=headers, timeout=30)

    def admin(self) -> dict[str, str]:
        return auth(self.admin_key)

    def new_key(self, tenant: str | None = None, admin: bool = False) -> str:
        tenant = tenant or "t" + secrets.token_hex(4)
        with self.http(self.admin()) as c:
            r = c.post("/v1/admin/keys", json={"tenant": tenant, "admin": admin})
        r.raise_for_status()
        return str(r.json()["key"])

    def start_worker(self, wid: str = "w0", timeout: float = 60) -> None:
        """Start worker `wid` unless it runs, and wait for its first heartbeat."""
        proc = self.procs.get(wid)
        if proc is not None and proc.poll() is None:
            return
        log_path = self.log_dir / f"{wid}.log"
        with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen([sys.executable, "-m", "app.cli", "worker", "--id", wid],
                                    env={**os.environ, **self.env}, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs[wid] = proc
        client = redis.Redis.from_url(self.redis_url)
        try:
            deadline = time.monotonic() + timeout
            while not client.hexists(names.WORKERS_KEY, wid):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {wid} did not start:\n{log_path.read_text()}")
                time.sleep(0.05)
        finally:
            client.close()

    def stop_workers(self) -> None:
        stop_processes(self.procs.values())


Server = LiveServer | InProcessServer


def http_client(server: Server, headers: dict[str, str] | None = None) -> httpx.Client:
    """A client of either kind of api: in-process, or over the network."""
    if isinstance(server, InProcessServer):
        return server.http(headers)
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=30)


async def _seed_plan(settings: Settings, url: str) -> None:
    client = async_client(url)
    try:
        await ensure_plan(client, settings, settings.workers)
    finally:
        await client.aclose()


@contextmanager
def start_inprocess(tmp: Path, redis_url: str, database_url: str | None = None,
                    migrate: bool = True, plan: bool = True, redis_db: int | None = None,
                    **env_overrides: str) -> Iterator[InProcessServer]:
    """The in-process counterpart of start_server: the same environment (a Redis database of
    its own, flushed: `redis_db` or one of own_database's; SQLite under `tmp` unless
    `database_url`; one worker id, w0), the database migrated unless `migrate` is false, and,
    unless `plan` is false, the first partition plan written as the worker would write it, so
    that subscribing and publishing work before any worker runs."""
    if redis_db is None:
        redis_url = own_database(redis_url)
    else:
        base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url
        redis_url = f"{base}/{redis_db}"
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    env = cluster_env(tmp, redis_url, database_url, workers=1, **env_overrides)
    # An api process reads its settings from the environment once (get_settings is cached):
    # read them under this app's environment, and leave no cached copy for the next one.
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        get_settings.cache_clear()
        settings = get_settings()
        app = create_app()
    get_settings.cache_clear()
    if migrate:
        upgrade_head(settings)
    with anyio.from_thread.start_blocking_portal() as portal:
        if plan:
            portal.call(_seed_plan, settings, redis_url)
        with portal.wrap_async_context_manager(app.router.lifespan_context(app)):
            server = InProcessServer(app=app, portal=portal, settings=settings,
                                     redis_url=redis_url, env=env, log_dir=tmp)
            try:
                yield server
            finally:
                server.stop_workers()


@pytest.fixture(scope="session")
def inprocess(tmp_path_factory: pytest.TempPathFactory, embedded_redis: EmbeddedRedis
              ) -> Iterator[InProcessServer]:
    """The api in-process on the embedded Redis and a fresh SQLite, with the partition plan and
    the bootstrap admin key, shared by every test that needs no settings of its own (each uses
    its own tenant). Its Redis database is 0, which own_database never hands out, so that no
    server started later flushes it."""
    with start_inprocess(tmp_path_factory.mktemp("inprocess"), embedded_redis.url,
                         redis_db=0) as s:
        yield s


@pytest.fixture(scope="session")
def inprocess_worker(inprocess: InProcessServer) -> InProcessServer:
    """`inprocess` with its worker process running: for tests that wait for matches."""
    inprocess.start_worker()
    return inprocess


# The test files whose tests use the session-scoped `spark` fixture (a JVM started in the test
# process, then warmed up by its first jobs): run by one process of a parallel run, they share
# one session instead of starting one each (`pytest_xdist_make_scheduler`).
ONE_SPARK_SESSION = ("tests/spark/test_archive_queries.py", "tests/spark/test_ingest.py",
                     "tests/spark/test_session.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A SparkSession is a JVM process: the tests that start one are slow as well as spark
    (and their file must be one of ONE_SPARK_SESSION)."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
            path = item.nodeid.split("::", 1)[0]
            if path not in ONE_SPARK_SESSION:
                raise pytest.UsageError(f"{path} uses the `spark` fixture: add it to "
                                        "ONE_SPARK_SESSION in tests/conftest.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` (scripts/test.sh), except that the files of ONE_SPARK_SESSION go to
    one process together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SparkFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return ONE_SPARK_SESSION[0] if path in ONE_SPARK_SESSION else path

    return SparkFilesTogether(config, log)


@pytest.fixture
def tenant_key(server: LiveServer) -> str:
    return server.new_key()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
