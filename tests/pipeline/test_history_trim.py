"""Subscription histories are trimmed by age as they are appended to: the workers' history
script (matches) and the kNN merge script (neighbour lists) drop entries older than
`history_max_age_s` with each append, so no pass over every stream written is needed. Real
Redis, the scripts as the workers call them (trimming is approximate: whole stream nodes of
100 entries go)."""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson
import redis

from app.pipeline import knnreg, names
from app.pipeline.histories import HISTORY_CHUNK, history_chunks, history_housekeeping_ms
from workers.executor import HISTORY_SCRIPT, by_history_group, history_call

AGE_MS = 1000  # far above the time the appends take, even on a loaded machine


def test_match_histories_lose_their_old_entries_as_they_grow(redis_db: str) -> None:
    store = redis.Redis.from_url(redis_db)
    script = store.register_script(HISTORY_SCRIPT)
    keys, args = history_call(["s1"], [b"refs"])

    def append(n: int) -> None:
        pipe = store.pipeline(transaction=False)  # one round trip: well within AGE_MS
        for _ in range(n):
            script(keys=keys, args=[7, "t", 10_000, 3600, AGE_MS,
                                    history_housekeeping_ms(AGE_MS / 1000), *args],
                   client=pipe)
        pipe.execute()

    append(500)
    assert store.xlen(keys[1]) == 500  # all younger than the max age
    time.sleep(AGE_MS / 1000 * 2)
    append(1)
    left = store.xlen(keys[1])
    assert left <= 101, left  # the old entries went, but those of the newest node
    oldest = int(store.xrange(keys[1], count=1)[0][0].split(b"-")[0])
    newest = int(store.xrevrange(keys[1], count=1)[0][0].split(b"-")[0])
    assert left == 1 or newest - oldest > AGE_MS  # what is left spans the gap, no more


def test_knn_histories_lose_their_old_entries_as_they_grow(redis_db: str) -> None:
    store = redis.Redis.from_url(redis_db)
    merge = store.register_script(knnreg.MERGE_SCRIPT)
    sid = "k1"
    store.hset(names.knn_key(sid), mapping={"_e": "1", "_r": "-1"})
    history = names.history_key(sid)

    def report(i: int) -> bool:
        """Whether a new list was pushed (1; 3: pushed, and the radius could shrink)."""
        local = orjson.dumps([[float(i), f"o{i}", 0.0, 0.0, 0]])
        keys, args = knnreg.merge_call(
            "w0", "t", (10_000, 3600, AGE_MS, history_housekeeping_ms(AGE_MS / 1000)),
            [knnreg.Report(sid, 1, local, 1, b"refresh", knnreg.NO_SOLE_RENDERING)], False)
        ((status, _, _),) = merge(keys=keys, args=args)
        return int(status) in (1, 3)

    assert all(report(i) for i in range(300))  # each a new list
    assert store.xlen(history) == 300
    time.sleep(AGE_MS / 1000 * 2)
    assert report(300)
    assert store.xlen(history) <= 101, store.xlen(history)


def _history_appender(store: redis.Redis, tenant: str, period_ms: int = 10_000,
                      ttl_s: int = 3600) -> Callable[[list[str]], list[str]]:
    """Appends one entry to each subscription's history in one call; returns the previous
    ids and new ids, alternating, as the script does."""
    script = store.register_script(HISTORY_SCRIPT)

    def append(subs: list[str]) -> list[str]:
        keys, args = history_call(subs, [b"refs"] * len(subs))
        out = script(keys=keys, args=[7, tenant, 10_000, ttl_s, 60_000, period_ms, *args])
        return [x.decode() for x in out]

    return append


def test_each_entry_names_the_one_before_it_across_calls_and_subscriptions(
        redis_db: str) -> None:
    store = redis.Redis.from_url(redis_db)
    append = _history_appender(store, "t")
    first = append(["a", "b"])
    assert first[0] == first[2] == "0-0"  # new subscriptions: nothing before
    second = append(["b", "a", "c"])
    assert second[0] == first[3] and second[2] == first[1] and second[4] == "0-0"
    for sub, eid, prev in (("a", second[3], first[1]), ("b", second[1], first[3])):
        (got_id, fields), = store.xrange(names.history_key(sub), min=eid, max=eid)
        assert fields[b"p"].decode() == prev
    # the hash holds each stream's last id, and outlives the stream
    assert store.hget(names.history_last_key("a"), names.history_key("a")).decode() \
        == second[3]
    store.delete(names.history_key("a"))  # as when a quiet history expires
    third = append(["a"])
    assert third[0] == second[3]  # a reader can still tell what it missed


def test_a_stream_written_before_the_hash_continues_from_its_last_entry(
        redis_db: str) -> None:
    store = redis.Redis.from_url(redis_db)
    old = store.xadd(names.history_key("u"), {"p": "0-0", "m": b"x"}).decode()
    (prev, _new) = _history_appender(store, "t")(["u"])
    assert prev == old


def test_a_stream_appended_to_keeps_its_expiry_renewed(redis_db: str) -> None:
    store = redis.Redis.from_url(redis_db)
    append = _history_appender(store, "t", period_ms=200, ttl_s=3600)
    append(["s"])
    assert store.ttl(names.history_key("s")) > 3500
    store.expire(names.history_key("s"), 5)  # as if the last renewal was long ago
    time.sleep(0.25)  # the next append is in a later period
    append(["s"])
    assert store.ttl(names.history_key("s")) > 3500


def test_one_slot_calls_hold_one_history_group_each() -> None:
    """On a Redis Cluster a script's keys share a slot: each call's subscriptions are of one
    history group (after sorting by group), and no call holds more than HISTORY_CHUNK."""
    subs = [f"s{i}" for i in range(3000)] + ["x"] * 5000
    refs = [b"r"] * len(subs)
    sorted_subs, _ = by_history_group(subs, refs)
    calls = history_chunks(sorted_subs, one_slot=True)
    assert calls[0][0] == 0 and calls[-1][1] == len(subs)
    assert all(a < b <= a + HISTORY_CHUNK for a, b in calls)
    for a, b in calls:
        keys, args = history_call(sorted_subs[a:b], refs[a:b])
        assert args[0] == 1  # one hash of last ids
        assert len({names.history_tag(s) for s in sorted_subs[a:b]}) == 1
    assert len(history_chunks(subs, one_slot=False)) == 2  # one server: by size alone
