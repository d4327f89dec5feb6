"""The expiry lock (app/pipeline/expiry.py) on a real redis-server, contended by a real second
process: a holder whose lock expired and was taken by another cannot delete the other's lock
(compare-and-delete), and a round that outlives its lock leaves the new holder's lock alone."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from app.core.config import Settings
from app.core.db import make_engine, make_sessionmaker
from app.core.migrate import upgrade_head
from app.core.pipelines import ClientPipelines
from app.core.redis import async_client
from app.core.state import AppState
from app.models import Subscription
from app.pipeline import expiry, names
from app.services import subscriptions as sub_service

# Another process takes the lock, as another api process's expiry loop would.
TAKE = """
import sys, redis
client = redis.Redis.from_url(sys.argv[1])
sys.exit(0 if client.set(sys.argv[2], sys.argv[3], nx=True, px=60_000) else 1)
"""


def take_in_another_process(url: str, key: str, token: str) -> bool:
    return subprocess.run([sys.executable, "-c", TAKE, url, key, token],
                          timeout=30).returncode == 0


def test_an_expired_holder_cannot_release_the_next_holders_lock(redis_db: str) -> None:
    key = names.EXPIRY_LOCK

    async def run() -> None:
        client = async_client(redis_db)
        try:
            token = await expiry.acquire_lock(client, key, ttl_ms=100)
            assert token is not None
            assert await expiry.acquire_lock(client, key, ttl_ms=100) is None  # held
            await asyncio.sleep(0.3)  # ... until it expires
            assert take_in_another_process(redis_db, key, "other")
            assert not await expiry.release_lock(client, key, token)
            assert await client.get(key) == b"other"
            assert await client.pttl(key) > 50_000  # untouched, expiry included
            # the holder releases its own lock
            await client.delete(key)
            token = await expiry.acquire_lock(client, key, ttl_ms=10_000)
            assert token is not None
            assert await expiry.release_lock(client, key, token)
            assert await client.exists(key) == 0
        finally:
            await client.aclose()

    asyncio.run(run())


def test_a_round_that_outlives_its_lock_leaves_the_next_holders_lock(
        redis_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(data_dir=tmp_path, redis_url=redis_db, environment="test",
                        database_url=f"sqlite:///{tmp_path / 'geoswarm.db'}")
    upgrade_head(settings)
    engine = make_engine(settings)
    rounds: list[str] = []

    real_pop = sub_service.pop_expired

    def slow_pop(session: Session, now: float, limit: int = 1000) -> list[Subscription]:
        if str(session.get_bind().url) != str(engine.url):
            # another app of this test process (an in-process app's expiry loop) shares the
            # patched module: its rounds are not this test's
            return real_pop(session, now, limit)
        # The round takes longer than its lock; meanwhile another process takes the lock.
        time.sleep(0.5)
        rounds.append("taken" if take_in_another_process(redis_db, names.EXPIRY_LOCK, "other")
                      else "not taken")
        return []

    async def run() -> tuple[int, int, object]:
        client = async_client(redis_db)
        state = AppState(settings=settings, engine=engine, sessions=make_sessionmaker(engine),
                         redis=client, redis_url=redis_db,
                         pipelines=ClientPipelines(client))
        try:
            first = await expiry.expire_once(state)  # a round within its lock releases it
            assert await client.exists(names.EXPIRY_LOCK) == 0
            monkeypatch.setattr(expiry, "LOCK_TTL_MS", 200)
            monkeypatch.setattr(sub_service, "pop_expired", slow_pop)
            second = await expiry.expire_once(state)
            return first, second, await client.get(names.EXPIRY_LOCK)
        finally:
            await client.aclose()

    try:
        with caplog.at_level(logging.WARNING, logger=expiry.__name__):
            first, second, holder = asyncio.run(run())
    finally:
        engine.dispose()
    assert (first, second) == (0, 0)
    assert rounds == ["taken"]
    assert holder == b"other"  # a GET-then-DEL release would have deleted it
    assert "outlived its lock" in caplog.text
