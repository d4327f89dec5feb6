"""The archive compaction's lock (spark.compact.CompactionLock) on a real Redis: one holder
per tenant; renewed while held; released at the end; and a holder that dies without releasing
(SIGKILL: it stops renewing) blocks the tenant only until the TTL runs out."""

from __future__ import annotations

import time

import pytest
import redis

from spark import compact
from spark.compact import CompactionLock


def test_one_holder_renewed_while_held_and_gone_when_its_holder_dies(
        redis_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compact, "LOCK_TTL_S", 0.3)
    client = redis.Redis.from_url(redis_db)
    first = CompactionLock(client, "acme")
    assert first.acquire()
    assert not CompactionLock(client, "acme").acquire()  # one at a time per tenant
    assert CompactionLock(client, "globex").acquire()  # other tenants go on
    time.sleep(1.0)  # three TTLs: renewed all along
    assert not CompactionLock(client, "acme").acquire()
    first.release()
    second = CompactionLock(client, "acme")
    assert second.acquire()
    second._done.set()  # dies holding it: no renewal, no release
    time.sleep(0.5)
    third = CompactionLock(client, "acme")
    assert third.acquire()
    second.release()  # a late release by the dead holder's token takes nothing
    assert client.get(third.key) == third.token.encode()
    third.release()
    assert client.get(third.key) is None
