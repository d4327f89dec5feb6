"""Subscription histories are trimmed by age as they are appended to: the workers' history
script (matches) and the kNN merge script (neighbour lists) drop entries older than
`history_max_age_s` with each append, so no pass over every stream written is needed. Real
Redis, the scripts as the workers call them (trimming is approximate: whole stream nodes of
100 entries go)."""

from __future__ import annotations

import time

import orjson
import redis

from app.pipeline import knnreg, names
from workers.executor import HISTORY_SCRIPT

AGE_MS = 1000  # far above the time the appends take, even on a loaded machine


def test_match_histories_lose_their_old_entries_as_they_grow(redis_db: str) -> None:
    store = redis.Redis.from_url(redis_db)
    script = store.register_script(HISTORY_SCRIPT)
    keys = [names.history_key("s1"), names.history_last_key("s1")]

    def append(n: int) -> None:
        pipe = store.pipeline(transaction=False)  # one round trip: well within AGE_MS
        for _ in range(n):
            script(keys=keys, args=[7, "t", 10_000, 3600, 3600, AGE_MS, b"refs"], client=pipe)
        pipe.execute()

    append(500)
    assert store.xlen(keys[0]) == 500  # all younger than the max age
    time.sleep(AGE_MS / 1000 * 2)
    append(1)
    left = store.xlen(keys[0])
    assert left <= 101, left  # the old entries went, but those of the newest node
    oldest = int(store.xrange(keys[0], count=1)[0][0].split(b"-")[0])
    newest = int(store.xrevrange(keys[0], count=1)[0][0].split(b"-")[0])
    assert left == 1 or newest - oldest > AGE_MS  # what is left spans the gap, no more


def test_knn_histories_lose_their_old_entries_as_they_grow(redis_db: str) -> None:
    store = redis.Redis.from_url(redis_db)
    merge = store.register_script(knnreg.MERGE_SCRIPT)
    sid = "k1"
    store.hset(names.knn_key(sid), mapping={"_e": "1", "_r": "-1"})
    keys = [names.knn_key(sid), names.history_key(sid), names.history_last_key(sid)]

    def report(i: int) -> bool:
        """Whether a new list was pushed (1; 3: pushed, and the radius could shrink)."""
        local = orjson.dumps([[float(i), f"o{i}", 0.0, 0.0, 0]])
        status, _ = merge(keys=keys, args=["w0", 1, local, 1, 10_000, 3600, "t", 3600,
                                           AGE_MS])
        return int(status) in (1, 3)

    assert all(report(i) for i in range(300))  # each a new list
    assert store.xlen(keys[1]) == 300
    time.sleep(AGE_MS / 1000 * 2)
    assert report(300)
    assert store.xlen(keys[1]) <= 101, store.xlen(keys[1])
