"""Fixtures that start the real thing: redis-server (embedded, and the machine's Redis 7 when
reachable), SQLite (and PostgreSQL when reachable), api and worker processes."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.core.config import Settings
from app.core.redis import EmbeddedRedis, start_embedded_redis
from bench.cluster import BOOTSTRAP, ROOT, LiveServer, start_server  # noqa: F401 - re-exported

REDIS7_URL = os.environ.get("GEOSWARM_TEST_REDIS7_URL", "redis://127.0.0.1:6379/9")
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


@pytest.fixture
def tenant_key(server: LiveServer) -> str:
    return server.new_key()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
