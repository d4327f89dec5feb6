"""The publish step without processes: last writer wins computed from the positions read, and
the script that applies a publish all or nothing on a real Redis (a position changed since it
was read: nothing written; a call sent twice: applied once; over the objects quota: nothing)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from app.core.redis import EmbeddedRedis
from app.pipeline import names, records
from app.pipeline.outbox import decode_ops, encode_ops, op, slot_of
from app.pipeline.router import PUBLISH_SCRIPT, last_writer_wins


def batch(rows: list[tuple[str, float, float]]) -> records.RecordBatch:
    """Moving records (id, ts, lon) at lat 0."""
    n = len(rows)
    return records.RecordBatch(
        tenant="t", ids=[r[0] for r in rows], moving=[True] * n, lon=[r[2] for r in rows],
        lat=[0.0] * n, ts=[r[1] for r in rows], keywords=[[] for _ in rows], text=[None] * n,
        props=[None] * n, size=n)


def test_last_writer_wins_in_row_order() -> None:
    old = records.pack_position(10.0, 1.0, 0.0, [], None)
    b = batch([("a", 5.0, 2.0), ("a", 11.0, 3.0), ("a", 10.5, 4.0), ("b", 1.0, 5.0),
               ("b", 2.0, 6.0)])
    prev, late, checks = last_writer_wins(b, list(range(5)), {"a": old, "b": None})
    assert late == [True, False, True, False, False]  # older than the latest at its turn
    assert prev == [(1.0, 0.0), (1.0, 0.0), (3.0, 0.0), None, (5.0, 0.0)]
    by_id = {c[0]: c for c in checks}
    assert by_id["a"][1] == old and by_id["a"][3] == 1  # row 1 wrote a's position
    assert records.unpack_position(by_id["a"][2])[:3] == (11.0, 3.0, 0.0)
    assert by_id["b"][1] == b"" and by_id["b"][3] == 4
    # nothing newer: nothing to store
    _p, _l, checks = last_writer_wins(batch([("a", 1.0, 9.0)]), [0], {"a": old})
    assert checks == [("a", old, b"", -1)]


@pytest.fixture
def rdb(embedded_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(embedded_redis.url.rsplit("/", 1)[0] + "/14")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def run(rdb: redis.Redis, guard: str, checks: list[tuple[str, bytes, bytes, float]],
        quota: int = 0, events_ttl: int = 0) -> int:
    keys = [names.publish_guard_key("t", guard), names.positions_key("t"),
            names.object_expiry_key("t"), names.events_key("t"), names.OBJECT_EXPIRY_TENANTS,
            "gs:w:x"]
    args: list[object] = [60, len(checks), quota, "t", events_ttl, ""]
    for c in checks:
        args += list(c)
    return int(rdb.eval(PUBLISH_SCRIPT, len(keys), *keys, *args, b"entry"))  # type: ignore[arg-type]


def test_publish_script_is_all_or_nothing_and_once(rdb: redis.Redis) -> None:
    p1, p2 = b"pos-1", b"pos-2"
    assert run(rdb, "g1", [("a", b"", p1, 100.0)]) == 1
    assert run(rdb, "g1", [("a", b"", p1, 100.0)]) == 1  # sent again: a no-op
    assert rdb.xlen("gs:w:x") == 1 and rdb.hget(names.positions_key("t"), "a") == p1
    # read before another publish changed it: nothing written, and it may be retried
    assert run(rdb, "g2", [("a", b"", p2, 200.0)]) == 0
    assert rdb.xlen("gs:w:x") == 1 and not rdb.exists(names.publish_guard_key("t", "g2"))
    assert run(rdb, "g2", [("a", p1, p2, 200.0)]) == 1
    assert rdb.hget(names.positions_key("t"), "a") == p2
    assert rdb.zscore(names.object_expiry_key("t"), "a") == 200.0
    # the quota counts new ids only: an update passes, a new object over it writes nothing
    assert run(rdb, "g3", [("b", b"", p1, 1.0), ("a", p2, p1, 1.0)], quota=1) == 2
    assert rdb.hlen(names.positions_key("t")) == 1 and rdb.xlen("gs:w:x") == 2
    assert run(rdb, "g4", [("a", p2, p1, 300.0)], quota=1) == 1


def test_publish_script_over_many_chunks(rdb: redis.Redis) -> None:
    """Positions are read and written in chunks of the script's own size: a batch spanning
    several is checked and applied whole, and a change in its last chunk writes nothing."""
    n = 2_500
    first = [(f"o{i}", b"", b"p%d" % i, float(i)) for i in range(n)]
    assert run(rdb, "c1", first) == 1
    pos = rdb.hgetall(names.positions_key("t"))
    assert len(pos) == n and pos[b"o2499"] == b"p2499" and pos[b"o1000"] == b"p1000"
    assert rdb.zscore(names.object_expiry_key("t"), "o2001") == 2001.0
    # the last object's position read is stale: not one of the 2 500 is written
    stale = [(f"o{i}", b"p%d" % i, b"q%d" % i, 1e6) for i in range(n - 1)]
    stale.append((f"o{n - 1}", b"wrong", b"q", 1e6))
    assert run(rdb, "c2", stale) == 0
    assert rdb.hget(names.positions_key("t"), "o0") == b"p0" and rdb.xlen("gs:w:x") == 1
    # objects with nothing to store (older than the stored one) are checked, not written
    mixed = [(f"o{i}", b"p%d" % i, b"" if i % 2 else b"r%d" % i, 5.0) for i in range(n)]
    assert run(rdb, "c3", mixed) == 1
    pos = rdb.hgetall(names.positions_key("t"))
    assert pos[b"o2498"] == b"r2498" and pos[b"o2499"] == b"p2499"
    assert rdb.zscore(names.object_expiry_key("t"), "o1") == 1.0
    assert rdb.zscore(names.object_expiry_key("t"), "o2") == 5.0
    # the quota counts the new ids of every chunk
    new = [(f"n{i}", b"", b"x", 1.0) for i in range(1_500)]
    assert run(rdb, "c4", new, quota=n + 1_499) == 2
    assert rdb.hlen(names.positions_key("t")) == n
    assert run(rdb, "c5", new, quota=n + 1_500) == 1
    assert rdb.hlen(names.positions_key("t")) == n + 1_500


def test_a_publish_with_events_renews_the_tenants_events_mark(rdb: redis.Redis) -> None:
    assert run(rdb, "e1", [("a", b"", b"p", 1.0)]) == 1  # moving objects only: no mark
    assert not rdb.exists(names.events_key("t"))
    assert run(rdb, "e2", [], events_ttl=100) == 1
    assert 90 < rdb.ttl(names.events_key("t")) <= 100
    assert run(rdb, "e3", [("a", b"wrong", b"q", 1.0)], events_ttl=500) == 0  # not applied
    assert rdb.ttl(names.events_key("t")) <= 100


def test_publish_script_through_the_outbox(rdb: redis.Redis) -> None:
    """With outboxes (a Redis Cluster: the streams are in other slots) the script appends the
    workers' entries to the tenant's outbox as one entry, in the positions' step, and touches
    nothing outside the tenant's slot."""
    outbox = names.tenant_outbox("t")
    keys = [names.publish_guard_key("t", "o1"), names.positions_key("t"),
            names.object_expiry_key("t"), names.events_key("t"), outbox]
    assert len({slot_of(k) for k in keys}) == 1
    ops = [op("XADD", "gs:w:{w0}", "*", "m", b"e0"), op("XADD", "gs:w:{w1}", "*", "m", b"e1")]
    args: list[object] = [60, 1, 0, "t", 0, "o", "a", b"", b"pos", 100.0, encode_ops(ops)]
    assert int(rdb.eval(PUBLISH_SCRIPT, len(keys), *keys, *args)) == 1  # type: ignore[arg-type]
    assert int(rdb.eval(PUBLISH_SCRIPT, len(keys), *keys, *args)) == 1  # type: ignore[arg-type]
    (_, fields), = rdb.xrange(outbox)  # once
    assert decode_ops(fields[b"m"]) == ops
    assert rdb.hget(names.positions_key("t"), "a") == b"pos"
    assert not rdb.exists(names.OBJECT_EXPIRY_TENANTS, "gs:w:{w0}")
