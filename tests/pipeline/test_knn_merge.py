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
    def __init__(self, url: str, sub: str = SUB) -> None:
        self.store = redis.Redis.from_url(url)
        self.script = self.store.register_script(knnreg.MERGE_SCRIPT)
        self.sub = sub
        self.key = names.knn_key(sub)

    def report(self, worker: str, epoch: int, local: list[tuple[float, str]],
               k: int = 2) -> tuple[int, int]:
        """(status, sole) of a worker's report of its list [(distance, id)]."""
        return self.report_whole(worker, epoch, [(d, i, 0.0, 0.0, (0, i)) for d, i in local],
                                 k)[::2]

    def report_whole(self, worker: str, epoch: int,
                     local: list[tuple[float, str, float, float, tuple[int, str]]], k: int,
                     sole: bool = False) -> tuple[int, str, int]:
        """(status, kth, sole) of a worker's report of its list of neighbours [(distance, id,
        lon, lat, (kind, id))], with its own rendering when `sole` (as a worker that held it
        alone at its last report sends it)."""
        (out,) = self.call(worker, [report_of(self.sub, epoch, local, k, sole)])
        return out

    def call(self, worker: str, reports: list[knnreg.Report], clear: tuple[str, ...] = ()
             ) -> list[tuple[int, str, int]]:
        """(status, kth, sole) of each of `reports` of a worker, made in one call."""
        keys, args = knnreg.merge_call(worker, TENANT, (1000, 3600, 60_000,
                                                        history_housekeeping_ms(60)),
                                       reports, False, clear)
        out: list[Any] = self.script(keys=keys, args=args)
        return [(int(o[0]), o[1].decode(), int(o[2])) for o in out]

    def lists(self) -> list[Any]:
        """The lists pushed to the subscription's history, oldest first."""
        return [orjson.loads(f[b"k"]) for _id, f in self.store.xrange(
            names.history_key(self.sub))]

    def pushed(self) -> list[list[str]]:
        """The id lists pushed to the subscription's history, oldest first."""
        return [[n["id"] for n in pushed] for pushed in self.lists()]

    def field(self, name: str) -> str | None:
        raw = self.store.hget(self.key, name)
        return None if raw is None else raw.decode()

    def refreshes(self, worker: str) -> list[wire.WorkerEntry]:
        return [wire.decode_entry(f[b"m"])
                for _id, f in self.store.xrange(names.worker_stream(worker))]


def report_of(sub: str, epoch: int, local: list[tuple[float, str, float, float, tuple[int, str]]],
              k: int, sole: bool = False) -> knnreg.Report:
    """A worker's report of its list of neighbours [(distance, id, lon, lat, (kind, id))],
    with its own rendering when `sole` (as a worker that held it alone at its last report
    sends it)."""
    return knnreg.Report(
        sub, epoch, orjson.dumps([[d, i, x, y, key[0]] for d, i, x, y, key in local]), k,
        wire.encode_entry(wire.KnnRefresh(tenant=TENANT, ids=[sub], epoch=epoch)),
        knnreg.sole_rendering(local, k) if sole else knnreg.NO_SOLE_RENDERING)


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


def test_a_sole_holders_own_rendering_is_the_merged_list_and_a_merge_renders_the_same(
        redis_db: str) -> None:
    """A worker that held a list alone sends it rendered (`sole_rendering`), and the script
    pushes that as it is when the worker still holds it alone. The script's own merge (of
    several holders, or without a rendering) pushes the same list: the same order (ties by
    id in code point order, then by point and kind, as the workers sort, whatever the
    Redis server's locale), and every number as the double it was (cjson's own encoding
    kept 14 digits). A rendering sent by a worker that is no longer alone is ignored."""
    lon = 13.404954123456789  # (17 significant digits)
    local = sorted([(10.0, "B", lon, 52.52, (0, "B")), (10.0, "a", 0.1, -33.9, (0, "a")),
                    (10.0, "é", 1e-7, 1.0, (0, "é")), (10.0, "a", 0.2, -33.9, (1, "a")),
                    (12.345, "z/1", -179.99999999999997, 89.5, (0, "z/1"))])
    k = 4
    want = [{"id": i, "lon": x, "lat": y, "distance_m": d} for d, i, x, y, _ in local[:k]]
    assert [n["id"] for n in want] == ["B", "a", "a", "é"]
    merged, whole = Merge(redis_db, "k-merged"), Merge(redis_db, "k-whole")
    for m in (merged, whole):
        m.store.hset(m.key, mapping=knnreg.register_fields(1, 40.0, ["w0"]))  # (4 x the k-th)

    def report(m: Merge, neighbours: list[Any], sole: bool = False) -> tuple[int, float, int]:
        status, kth, held_alone = m.report_whole("w0", 1, neighbours, k, sole)
        return status, float(kth), held_alone

    # the first report of each, merged by the script (the worker does not know yet that it
    # holds the list alone); then, held alone, the worker's rendering is pushed as it is
    assert report(merged, local) == (1, 10.0, 1)
    assert report(whole, local[1:]) == (1, 12.345, 1)
    assert report(whole, local, sole=True) == (1, 10.0, 1)
    assert merged.lists() == [want] and whole.lists()[-1] == want
    (_, last), = whole.store.xrevrange(names.history_key("k-whole"), count=1)
    assert last[b"k"] == knnreg.sole_rendering(local, k)[0]
    # another holder: a rendering no longer counts, the script merges both lists
    whole.store.hset(whole.key, "w1", orjson.dumps([[5.0, "c", 2.0, 3.0, 0]]))
    assert report(whole, local, sole=True) == (1, 10.0, 0)
    assert whole.lists()[-1] == [{"id": "c", "lon": 2.0, "lat": 3.0, "distance_m": 5.0},
                                 *want[:3]]


def test_many_reports_in_one_call_answer_as_one_by_one(redis_db: str) -> None:
    """A worker's step reports many lists in one call: each report is answered as it would
    be alone (pushed, waiting for a token, of a stale epoch, of no registration), in order,
    and the tokens the call clears are cleared on each hash."""
    subs = ["s-new", "s-wait", "s-stale", "s-gone", "s-sole"]
    m = {sid: Merge(redis_db, sid) for sid in subs}
    m["s-new"].store.hset(m["s-new"].key, mapping=knnreg.register_fields(1, 50.0, ["w0"]))
    m["s-wait"].store.hset(m["s-wait"].key,
                           mapping=knnreg.register_fields(1, 50.0, ["w0", "w1"]))
    m["s-stale"].store.hset(m["s-stale"].key,
                            mapping=knnreg.register_fields(2, 50.0, ["w0"]))
    m["s-sole"].store.hset(m["s-sole"].key, mapping=knnreg.register_fields(1, 50.0, ["w0"]))
    assert m["s-sole"].report("w0", 1, [(10.0, "a"), (20.0, "b")]) == (1, 1)
    token = knnreg.hold_field(9, "w0")
    for sid in subs:
        m[sid].store.hset(m[sid].key, token, "1")  # a hold the call clears
    near = [(10.0, "a", 1.0, 2.0, (0, "a")), (20.0, "b", 1.5, 2.5, (0, "b"))]
    answers = m["s-new"].call("w0", [
        report_of("s-new", 1, near, 2), report_of("s-wait", 1, near, 2),
        report_of("s-stale", 1, near, 2), report_of("s-gone", 1, near, 2),
        report_of("s-sole", 1, near[:1] + [(15.0, "c", 0.0, 0.0, (0, "c"))], 2, sole=True)],
        clear=(token,))
    assert [(status, sole) for status, _kth, sole in answers] == [
        (1, 1), (0, 0), (-1, 0), (0, 0), (1, 1)]
    assert float(answers[0][1]) == 20.0 and float(answers[4][1]) == 15.0
    assert m["s-new"].pushed() == [["a", "b"]] and m["s-wait"].pushed() == []
    assert m["s-stale"].pushed() == [] and m["s-gone"].pushed() == []
    assert m["s-sole"].pushed() == [["a", "b"], ["a", "c"]]
    for sid in ("s-new", "s-wait", "s-stale", "s-sole"):
        assert m[sid].field(token) is None, sid
    assert m["s-wait"].field("w0") is not None  # its list waits in the hash for w1's
