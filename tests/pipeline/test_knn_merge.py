"""The kNN merge script's word on sole holders (`app.pipeline.knnreg`), on a real Redis: a
worker that holds a registration alone is told so and may then leave out the reports that
cannot change the merged list, so its stored distances may be old; the first report of any
other worker makes it report again (a token and a `wire.KnnRefresh` on its stream) before
anything is merged, and a resize or a failover forgets it."""

from __future__ import annotations

from typing import Any

import orjson
import redis

from app.pipeline import knnreg, names, wire
from app.pipeline.histories import history_housekeeping_ms

SUB, TENANT = "k1", "t"


class Merge:
    def __init__(self, url: str) -> None:
        self.store = redis.Redis.from_url(url)
        self.script = self.store.register_script(knnreg.MERGE_SCRIPT)
        self.key = names.knn_key(SUB)

    def report(self, worker: str, epoch: int, local: list[tuple[float, str]],
               k: int = 2) -> tuple[int, int]:
        """(status, sole) of a worker's report of its list [(distance, id)]."""
        refresh = wire.encode_entry(wire.KnnRefresh(tenant=TENANT, ids=[SUB], epoch=epoch))
        out: list[Any] = self.script(
            keys=[self.key, names.history_key(SUB), names.history_last_key(SUB)],
            args=[worker, epoch, orjson.dumps([[d, i, 0.0, 0.0, 0] for d, i in local]), k,
                  1000, 3600, TENANT, 60_000, history_housekeeping_ms(60),
                  knnreg.STREAM_TEMPLATE, refresh])
        return int(out[0]), int(out[2])

    def pushed(self) -> list[list[str]]:
        """The id lists pushed to the subscription's history, oldest first."""
        return [[n["id"] for n in orjson.loads(f[b"k"])]
                for _id, f in self.store.xrange(names.history_key(SUB))]

    def field(self, name: str) -> str | None:
        raw = self.store.hget(self.key, name)
        return None if raw is None else raw.decode()

    def refreshes(self, worker: str) -> list[wire.WorkerEntry]:
        return [wire.decode_entry(f[b"m"])
                for _id, f in self.store.xrange(names.worker_stream(worker))]


def test_a_sole_holder_is_told_and_reports_again_when_another_joins(redis_db: str) -> None:
    m = Merge(redis_db)
    m.store.hset(m.key, mapping=knnreg.register_fields(1, 50.0, ["w0"]))
    assert m.report("w0", 1, [(10.0, "a"), (20.0, "b")]) == (1, 1)
    assert m.field("_l:w0") == "1" and m.pushed() == [["a", "b"]]
    # w0 then leaves out a report (b moved to 40 m, order unchanged): its field is old.
    # A forward registers w1 under the same epoch; its report finds w0 alone and asks it to
    # report again before anything is merged with w0's old distances.
    m.store.hset(m.key, knnreg.PENDING + "w1", "1")
    assert m.report("w1", 1, [(30.0, "c")]) == (0, 0)
    assert m.field("_l:w0") is None and m.field("_p:w0") == "1"
    (ask,) = m.refreshes("w0")
    assert ask == wire.KnnRefresh(tenant=TENANT, ids=[SUB], epoch=1)
    assert m.pushed() == [["a", "b"]]  # nothing merged meanwhile: [a, b] would be wrong
    # w0's whole list, with b's distance of now: the merged list is [a, c], and w0 is no
    # longer alone (it reports every change from now on)
    assert m.report("w0", 1, [(10.0, "a"), (40.0, "b")]) == (1, 0)
    assert m.pushed() == [["a", "b"], ["a", "c"]]
    assert m.field("_l:w0") is None and m.field("_l:w1") is None


def test_a_pending_token_means_not_alone(redis_db: str) -> None:
    m = Merge(redis_db)
    m.store.hset(m.key, mapping=knnreg.register_fields(1, 50.0, ["w0", "w1"]))
    assert m.report("w0", 1, [(10.0, "a"), (20.0, "b")]) == (0, 0)  # waits for w1
    assert m.field("_l:w0") is None and m.refreshes("w1") == []
    # a hold of a handoff in flight to w1 also means another holder is coming
    m.store.hdel(m.key, "_p:w1", "w1")
    assert m.report("w0", 1, [(10.0, "a"), (20.0, "b")]) == (1, 1)
    m.store.hset(m.key, knnreg.hold_field(7, "w1"), "1")
    assert m.report("w0", 1, [(10.0, "a"), (25.0, "b")]) == (0, 0)
    assert m.field("_l:w0") is None


def test_a_stale_epoch_is_refused_and_a_resize_forgets_sole_holders(redis_db: str) -> None:
    m = Merge(redis_db)
    m.store.hset(m.key, mapping=knnreg.register_fields(2, 50.0, ["w0"]))
    assert m.report("w0", 1, [(10.0, "a")]) == (-1, 0)
    assert m.report("w0", 2, [(10.0, "a"), (20.0, "b")]) == (1, 1)
    resize = m.store.register_script(knnreg.RESIZE_SCRIPT)
    reg = wire.encode_entry(wire.KnnRetract(ids=[SUB], epoch=3))
    assert resize(keys=[m.key], args=[2, "5000.0", reg, reg, knnreg.STREAM_TEMPLATE,
                                      "w0", "w1"]) == 1
    assert m.field("_l:w0") is None and m.field("_e") == "3"
    # a report of the old epoch after the resize changes nothing
    assert m.report("w0", 2, [(10.0, "a"), (20.0, "b")]) == (-1, 0)


def test_a_dead_holder_leaves_with_its_sole_mark(redis_db: str) -> None:
    m = Merge(redis_db)
    m.store.hset(m.key, mapping=knnreg.register_fields(1, 50.0, ["w0"]))
    assert m.report("w0", 1, [(10.0, "a"), (20.0, "b")]) == (1, 1)
    drop = m.store.register_script(knnreg.DROP_WORKER_SCRIPT)
    drop(keys=[m.key], args=["w0"])
    assert m.field("_l:w0") is None and m.field("w0") is None
    # the taker's report finds no one to ask again
    assert m.report("w1", 1, [(15.0, "a"), (20.0, "b")]) == (0, 1)
    assert m.refreshes("w0") == [] and m.field("_l:w1") == "1"


def test_a_worker_leaves_a_registration_of_the_epoch_it_holds(redis_db: str) -> None:
    m = Merge(redis_db)
    m.store.hset(m.key, mapping=knnreg.register_fields(3, 50.0, ["w0"]))
    assert m.report("w0", 3, [(10.0, "a"), (20.0, "b")]) == (1, 1)
    leave = m.store.register_script(knnreg.LEAVE_SCRIPT)
    assert leave(keys=[m.key], args=["w0", 2]) == 0  # an older registration: nothing
    assert m.field("w0") is not None and m.field("_l:w0") == "3"
    m.store.hset(m.key, knnreg.PENDING + "w0", "3")
    assert leave(keys=[m.key], args=["w0", 3]) == 1
    assert m.field("w0") is None and m.field("_l:w0") is None and m.field("_p:w0") is None
    assert m.field("_e") == "3" and m.pushed() == [["a", "b"]]  # the list pushed stays
