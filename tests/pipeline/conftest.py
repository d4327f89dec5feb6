"""Fixtures of the pipeline tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from app.core.redis import EmbeddedRedis
from bench.cluster import own_database


@pytest.fixture
def redis_db(embedded_redis: EmbeddedRedis) -> Iterator[str]:
    """A Redis database of the embedded server of its own, empty before and after."""
    url = own_database(embedded_redis.url)
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()
