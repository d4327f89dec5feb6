"""Fixtures that start the real thing: redis-server (embedded, and the machine's Redis 7 when
reachable), SQLite (and PostgreSQL when reachable), api and worker processes."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from app.core.config import Settings
from app.core.redis import EmbeddedRedis, free_port, start_embedded_redis

ROOT = Path(__file__).resolve().parents[1]
REDIS7_URL = os.environ.get("GEOSWARM_TEST_REDIS7_URL", "redis://127.0.0.1:6379/9")
PG_URL = os.environ.get("GEOSWARM_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
BOOTSTRAP = "test-bootstrap-admin-key-" + secrets.token_hex(8)


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


@dataclass
class LiveServer:
    """A running api (and workers) against one Redis and one database."""

    base_url: str
    ws_url: str
    redis_url: str
    env: dict[str, str]
    admin_key: str = BOOTSTRAP
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: Path = Path(".")

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def new_key(self, tenant: str | None = None, admin: bool = False) -> str:
        tenant = tenant or "t" + secrets.token_hex(4)
        r = httpx.post(self.base_url + "/v1/admin/keys", json={"tenant": tenant, "admin": admin},
                       headers=self.admin(), timeout=10)
        r.raise_for_status()
        return str(r.json()["key"])

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs[name] = proc
        return proc

    def start_worker(self, wid: str) -> subprocess.Popen[bytes]:
        return self.spawn(wid, ["worker", "--id", wid])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.wait(15)

    def wait_workers(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.get(self.base_url + "/v1/admin/cluster", headers=self.admin(), timeout=5)
            if r.status_code == 200 and sum(w["alive"] for w in r.json()["workers"]) >= n:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{n} live workers did not appear")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_next_db = iter(range(10**9))


def own_database(redis_url: str) -> str:
    """The same Redis server, another database index, so that servers of different tests
    (which flush their database on start) never touch each other's keys."""
    base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url
    return f"{base}/{1 + next(_next_db) % 15}"


def start_server(tmp: Path, redis_url: str, database_url: str | None = None, workers: int = 2,
                 **env_overrides: str) -> LiveServer:
    redis_url = own_database(redis_url)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    port = free_port()
    env = dict(os.environ)
    env.update({
        "GEOSWARM_REDIS_URL": redis_url,
        "GEOSWARM_DATA_DIR": str(tmp),
        "GEOSWARM_DATABASE_URL": database_url or f"sqlite:///{tmp / 'geoswarm.db'}",
        "GEOSWARM_BOOTSTRAP_ADMIN_KEY": BOOTSTRAP,
        "GEOSWARM_ENVIRONMENT": "test",
        "GEOSWARM_WORKERS": ",".join(f"w{i}" for i in range(workers)),
        "GEOSWARM_BALANCE_PERIOD_S": "2",
    })
    env.update(env_overrides)
    server = LiveServer(base_url=f"http://127.0.0.1:{port}", ws_url=f"ws://127.0.0.1:{port}",
                        redis_url=redis_url, env=env, log_dir=tmp)
    subprocess.run([sys.executable, "-m", "app.cli", "migrate"], env=env, cwd=ROOT, check=True,
                   capture_output=True)
    for i in range(workers):
        server.start_worker(f"w{i}")
    server.spawn("api", ["api", "--port", str(port), "--no-migrate"])
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(server.base_url + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.procs["api"].poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("api did not become ready:\n" + (tmp / "api.log").read_text())
        time.sleep(0.1)
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, embedded_redis: EmbeddedRedis
           ) -> Iterator[LiveServer]:
    """api + 2 workers on the embedded Redis and SQLite, shared by a module's tests."""
    s = start_server(tmp_path_factory.mktemp("server"), embedded_redis.url)
    yield s
    s.stop()


@pytest.fixture
def tenant_key(server: LiveServer) -> str:
    return server.new_key()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
