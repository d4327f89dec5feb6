"""End-to-end correctness of the live pipeline against the brute-force oracle: real api and
worker processes, real Redis (embedded 6.2 and Redis 7 when reachable), real WebSockets."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from app.pipeline import names
from tests.conftest import LiveServer, auth, start_server
from tests.workers.harness import Listener, replay_all, subscribe_listening, wait_for
from tests.workers.oracle import Oracle, received_matches

pytestmark = pytest.mark.slow

WORDS = ["coffee", "tea", "taxi", "pizza", "sale", "rain", "music", "game", "park", "bus"]
CELL_W, CELL_H = 0.36, 0.18  # the default 1000x1000 world grid


def random_subs(rng: random.Random, n: int) -> list[dict[str, Any]]:
    subs: list[dict[str, Any]] = []
    for _ in range(n):
        kind = rng.random()
        kws = rng.sample(WORDS, rng.randint(1, 3)) if rng.random() < 0.6 else None
        extra: dict[str, Any] = {}
        if kws:
            extra = {"keywords": kws, "match": rng.choice(["any", "all"])}
        if kind < 0.45:
            # boxes whose edges sit on cell and partition borders half of the time
            if rng.random() < 0.5:
                x0 = rng.randint(-6, 5) * CELL_W
                y0 = rng.randint(-6, 5) * CELL_H
            else:
                x0, y0 = rng.uniform(-2, 1.5), rng.uniform(-1, 0.8)
            w, h = rng.uniform(0.1, 2.0), rng.uniform(0.05, 1.0)
            sub = {"type": "range", "bbox": [x0, y0, x0 + w, y0 + h], **extra}
        elif kind < 0.75:
            sub = {"type": "range", "circle": {"lon": rng.uniform(-1.5, 1.5),
                                               "lat": rng.uniform(-0.8, 0.8),
                                               "radius_m": rng.uniform(1_000, 120_000)}, **extra}
        else:
            sub = {"type": "keyword", "keywords": rng.sample(WORDS, rng.randint(1, 2)),
                   "match": rng.choice(["any", "all"])}
        if sub["type"] == "range" and rng.random() < 0.4:
            sub["detect"] = rng.sample(["inside", "enter", "exit"], rng.randint(1, 3))
        subs.append(sub)
    return subs


def random_objects(rng: random.Random, n: int, movers: list[str], clock: list[float]
                   ) -> list[dict[str, Any]]:
    objs: list[dict[str, Any]] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.15:  # exactly on a cell / partition border (the initial plan splits at 0)
            lon = rng.choice([0.0, rng.randint(-6, 6) * CELL_W])
            lat = rng.choice([0.0, rng.randint(-6, 6) * CELL_H])
        elif r < 0.3:  # skewed: a hotspot
            lon, lat = rng.gauss(0.3, 0.1), rng.gauss(0.2, 0.05)
        else:
            lon, lat = rng.uniform(-2.5, 2.5), rng.uniform(-1.2, 1.2)
        obj: dict[str, Any] = {"lon": lon, "lat": lat}
        words = rng.sample(WORDS, rng.randint(0, 3))
        if rng.random() < 0.5:
            obj["keywords"] = [w.upper() if rng.random() < 0.2 else w for w in words]
        else:
            obj["text"] = " ".join(w.capitalize() for w in words) + " !"
        clock[0] += 1.0
        if movers and rng.random() < 0.5:
            obj["id"] = rng.choice(movers)
            # out-of-order timestamps: some records arrive late
            obj["ts"] = clock[0] - (rng.uniform(5, 50) if rng.random() < 0.15 else 0.0)
        else:
            obj["ts"] = clock[0]
        objs.append(obj)
    return objs


async def create_subs(client: httpx.AsyncClient, key: str, specs: list[dict[str, Any]],
                      oracle: Oracle) -> list[str]:
    r = await client.post("/v1/subscriptions/batch", json={"subscriptions": specs},
                          headers=auth(key))
    assert r.status_code == 201, r.text
    ids: list[str] = r.json()["ids"]
    for sid, spec in zip(ids, specs, strict=True):
        oracle.subs[sid] = spec
    return ids


async def publish(client: httpx.AsyncClient, key: str, objs: list[dict[str, Any]],
                  oracle: Oracle) -> None:
    r = await client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
    assert r.status_code == 202, r.text
    oracle.publish(objs, r.json()["ids"])


def assert_exact(got: Counter[Any], oracle: Oracle) -> None:
    missing = oracle.expected - got
    extra = got - oracle.expected
    assert not missing and not extra, (
        f"{sum(missing.values())} missing e.g. {list(missing)[:3]}; "
        f"{sum(extra.values())} extra e.g. {list(extra)[:3]}")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, redis_url: str):  # type: ignore[no-untyped-def]
    s = start_server(tmp_path_factory.mktemp("pipeline"), redis_url, workers=3)
    s.wait_workers(3)
    yield s
    s.stop()


async def _exact_workload(server: LiveServer, seed: int) -> None:
    rng = random.Random(seed)
    key = server.new_key()
    oracle = Oracle()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        ids = await create_subs(client, key, random_subs(rng, 150), oracle)
        everything = Listener(server.ws_url, key)
        some = Listener(server.ws_url, key)
        await everything.connect()
        await some.connect()
        await everything.listen(all=True)
        chosen = ids[::3]
        await some.listen(chosen)
        movers = [f"car-{i}" for i in range(25)]
        clock = [1_700_000_000.0]
        for _ in range(15):
            await publish(client, key, random_objects(rng, 120, movers, clock), oracle)
        assert oracle.total() > 300
        await wait_for(lambda: len(everything.matches()) >= oracle.total(), 60)
        await asyncio.sleep(0.5)  # anything extra would arrive now
        assert_exact(received_matches(everything.messages), oracle)
        want_some = Counter({m: c for m, c in oracle.expected.items() if m[0] in set(chosen)})
        await wait_for(lambda: len(some.matches()) >= sum(want_some.values()), 30)
        got_some = received_matches(some.messages)
        assert got_some == want_some, some.report(got_some, want_some)
        # the HTTP replay returns the same history, cursors increasing
        replayed: list[dict[str, Any]] = []
        for sid in ids:
            items = await replay_all(client, sid, auth(key))
            cursors = [m["cursor"] for m in items]
            assert len(set(cursors)) == len(cursors)
            replayed += items
        assert_exact(received_matches(replayed), oracle)
        await everything.close()
        await some.close()


def test_exact_delivery_random_workload(pipeline: LiveServer) -> None:
    asyncio.run(_exact_workload(pipeline, seed=7))


def test_metrics_break_the_path_down_by_hop(pipeline: LiveServer) -> None:
    """Every hop of the live path is measured on /metrics once objects were published and
    their matches pushed: the api's (validate, append, notify, send, total) and each
    worker's (queued, match, write, from its heartbeat)."""
    from bench.pipeline import HOP_ORDER, hop_counts

    server = pipeline
    key = server.new_key()
    before = hop_counts(server.base_url)

    async def scenario() -> int:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            _ids, listener = await subscribe_listening(
                server, client, key, [{"type": "range", "bbox": [-180, -90, 180, 90]}])
            # Twice: matches that reach a connection before it holds a position on the
            # subscription are read from the history, a path without the hub's stamps; once
            # the first arrived, the second batch is pushed (the send hop).
            for round_ in (1, 2):
                objs = [{"lon": random.uniform(-170, 170), "lat": random.uniform(-80, 80)}
                        for _ in range(40)]
                r = await client.post("/v1/objects", json={"objects": objs},
                                      headers=auth(key))
                assert r.status_code == 202, r.text
                await wait_for(lambda n=40 * round_: len(listener.matches()) >= n, 30)
            await listener.close()
            return len(listener.matches())

    delivered = asyncio.run(scenario())
    assert delivered == 80
    time.sleep(1.5)  # the workers' heartbeats carry their hops
    after = hop_counts(server.base_url)
    for hop in HOP_ORDER:
        counts, total_s = after[hop]
        old = before.get(hop, ([0] * len(counts), 0.0))
        n = sum(counts) - sum(old[0])
        assert n > 0 and total_s > old[1], (hop, n)
    # the objects published were measured once each by the api's hops
    for hop in ("validate", "append"):
        assert sum(after[hop][0]) - sum(before.get(hop, ([0], 0.0))[0]) == 80, hop
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert 'geoswarm_worker_hop_seconds_count{hop="match",worker="w' in text
    assert 'geoswarm_hop_seconds_bucket{hop="total",le="+Inf"}' in text


def test_moving_object_position_is_last_writer_wins(pipeline: LiveServer) -> None:
    key = pipeline.new_key()
    h = auth(key)
    base = pipeline.base_url
    objs = [{"id": "bus-1", "lon": 1.0, "lat": 1.0, "ts": 100.0},
            {"id": "bus-1", "lon": 2.0, "lat": 2.0, "ts": 50.0},  # late: ignored
            {"id": "bus-1", "lon": 3.0, "lat": 3.0, "ts": 100.0, "props": {"a": 1}}]
    assert httpx.post(base + "/v1/objects", json={"objects": objs}, headers=h).status_code == 202
    r = httpx.get(base + "/v1/objects/bus-1", headers=h)
    assert r.status_code == 200
    assert (r.json()["lon"], r.json()["lat"], r.json()["ts"]) == (3.0, 3.0, 100.0)
    assert r.json()["props"] == {"a": 1}
    other = pipeline.new_key()
    assert httpx.get(base + "/v1/objects/bus-1", headers=auth(other)).status_code == 404


# props of every JSON shape: nested, unicode and escapes, floats, 64-bit ints, empty, null
PROPS = [
    {"price": 2, "menu": {"espresso": 1.5, "sizes": ["s", "m", "l"], "vegan": True},
     "note": None},
    {"name": "Café «Zürich» \u2603", "quote": "say \"hi\"\n\ttab", "n": -2**63,
     "big": 2**64 - 1, "tiny": 5e-324, "exp": 1.5e300, "list": [[], {}, [1, [2]]]},
    {},
]


def test_props_reach_every_reader_as_published(pipeline: LiveServer) -> None:
    """Props travel as the JSON text the api encoded when it validated them: the match
    messages, a snapshot query's results and a moving object's latest record give them back
    equal to what was published (not as a string, not re-encoded into another value), and a
    record without props has none. So do props that only the models' path accepts (an
    integer beyond 64 bits, read as a float), which `records_from_objects` encodes."""
    asyncio.run(_props_everywhere(pipeline))


async def _props_everywhere(server: LiveServer) -> None:
    key = server.new_key()
    h = auth(key)
    box = [9.0, 9.0, 11.0, 11.0]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        [sid], listener = await subscribe_listening(server, client, key, [
            {"type": "range", "bbox": box}])
        objs: list[dict[str, Any]] = [
            {"id": f"cab-{i}", "lon": 10.0, "lat": 10.0 + i / 100, "props": p}
            for i, p in enumerate(PROPS)]
        objs += [{"lon": 10.1, "lat": 10.1, "props": PROPS[1]}, {"lon": 10.2, "lat": 10.2}]
        r = await client.post("/v1/objects", json={"objects": objs}, headers=h)
        assert r.status_code == 202, r.text
        want: dict[str, Any] = {oid: o.get("props")
                                for oid, o in zip(r.json()["ids"], objs, strict=True)}
        big = b'{"objects":[{"id":"bus","lon":10.3,"lat":10.3,"props":{"n":1%s}}]}' % (
            b"0" * 24)
        r = await client.post("/v1/objects", content=big,
                              headers={**h, "Content-Type": "application/json"})
        assert r.status_code == 202, r.text
        want["bus"] = {"n": 1e24}
        try:
            assert await wait_for(lambda: len(listener.matches()) == len(want))
            got = {m["object"]["id"]: m["object"].get("props") for m in listener.matches()}
            assert got == want and all(m["subscription"] == sid for m in listener.matches())
            # a record without props has no `props` in its match (as before)
            assert sum("props" not in m["object"] for m in listener.matches()) == 1
        finally:
            await listener.close()
        q = await client.post("/v1/queries", json={"type": "range", "bbox": box}, headers=h)
        assert q.status_code == 200, q.text
        assert {rec["id"]: rec.get("props") for rec in q.json()["results"]} == want
        for oid in ["cab-0", "cab-1", "cab-2", "bus"]:
            r = await client.get(f"/v1/objects/{oid}", headers=h)
            assert r.status_code == 200 and r.json()["props"] == want[oid], r.text


async def _kill_and_resume(server: LiveServer) -> None:
    rng = random.Random(11)
    key = server.new_key()
    oracle = Oracle()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        ids = await create_subs(client, key, random_subs(rng, 80), oracle)
        listener = Listener(server.ws_url, key)
        await listener.connect()
        await listener.listen(ids)
        movers = [f"m{i}" for i in range(10)]
        clock = [1_700_000_000.0]
        for i in range(24):
            await publish(client, key, random_objects(rng, 60, movers, clock), oracle)
            if i == 6:
                server.kill("w1", signal.SIGKILL)  # mid-stream
            if i == 9:
                server.start_worker("w1")
            if i == 12:
                # the client drops and resumes by cursor
                await listener.close()
                first = listener.messages
                cursors = dict(listener.cursors)
                listener = Listener(server.ws_url, key)
                await listener.connect()
                await listener.listen(ids, since=cursors)
                listener.messages = first + listener.messages
        await wait_for(lambda: len(listener.matches()) >= oracle.total(), 90)
        await asyncio.sleep(0.5)
        got = received_matches(listener.messages)
        if got != oracle.expected:  # say where duplicates came from: one side or the resume
            before = received_matches(first)
            after = received_matches(listener.messages[len(first):])
            print("duplicates before the resume:", +(before - oracle.expected),
                  "after it:", +(after - oracle.expected), "across it:",
                  sum((before & after).values()), "resume cursors:", cursors)
        assert_exact(got, oracle)
        await listener.close()


def test_worker_sigkill_and_client_resume(pipeline: LiveServer) -> None:
    asyncio.run(_kill_and_resume(pipeline))


async def _delete_midstream(server: LiveServer, paused: bool) -> None:
    key = server.new_key()
    workers = [name for name in server.procs if name.startswith("w")]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        r = await client.post("/v1/subscriptions", headers=auth(key),
                              json={"type": "range", "bbox": [-1, -1, 1, 1]})
        sid = r.json()["id"]
        keep = (await client.post("/v1/subscriptions", headers=auth(key),
                                  json={"type": "range", "bbox": [-1, -1, 1, 1]})).json()["id"]
        listener = Listener(server.ws_url, key)
        await listener.connect()
        await listener.listen([sid, keep])
        before = [{"lon": 0.5, "lat": 0.5, "keywords": [f"b{i}"]} for i in range(20)]
        if paused:  # the workers then read the objects and the removal in one step
            for w in workers:
                server.kill(w, signal.SIGSTOP)
        try:
            if paused:  # served to the read the worker was blocked in when it stopped
                await client.post("/v1/objects", headers=auth(key),
                                  json={"objects": [{"lon": 0.5, "lat": 0.5}]})
            await client.post("/v1/objects", json={"objects": before}, headers=auth(key))
            assert (await client.delete(f"/v1/subscriptions/{sid}",
                                        headers=auth(key))).status_code == 204
            after = [{"lon": 0.5, "lat": 0.5, "keywords": [f"a{i}"]} for i in range(20)]
            r = await client.post("/v1/objects", json={"objects": after}, headers=auth(key))
            after_ids = set(r.json()["ids"])
        finally:
            if paused:
                for w in workers:
                    server.kill(w, signal.SIGCONT)
        await wait_for(lambda: sum(m["subscription"] == keep for m in listener.matches())
                       >= 40 + paused)
        await asyncio.sleep(0.5)
        deleted = [m for m in listener.matches() if m["subscription"] == sid]
        assert not [m for m in deleted if m["object"]["id"] in after_ids]
        assert len({m["cursor"] for m in deleted}) == len(deleted) <= 20 + paused
        assert (await client.get(f"/v1/subscriptions/{sid}/matches",
                                 headers=auth(key))).status_code == 404
        # its history and the id of its last entry (which outlives a history) are gone
        rdb = redis.Redis.from_url(server.redis_url)
        assert rdb.exists(names.history_key(sid)) == 0
        hashes = rdb.keys("gs:hlast:*")
        assert [h for h in hashes if rdb.hexists(h, names.history_key(keep))]
        assert not [h for h in hashes if rdb.hexists(h, names.history_key(sid))]
        rdb.close()
        await listener.close()


@pytest.mark.parametrize("paused", [False, True], ids=["streaming", "one-step"])
def test_delete_midstream_stops_delivery(pipeline: LiveServer, paused: bool) -> None:
    """Deleting a subscription between two batches: nothing after it is delivered, and its
    history is gone, also when a worker reads the batch before, the removal and the batch
    after in one step (it matched the first batch before it knew of the removal)."""
    asyncio.run(_delete_midstream(pipeline, paused))


async def _ttl_expiry(server: LiveServer, db_path: Path) -> None:
    import sqlite3

    key = server.new_key()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        r = await client.post("/v1/subscriptions", headers=auth(key),
                              json={"type": "keyword", "keywords": ["x"], "ttl_s": 60})
        body = r.json()
        assert body["expires_at"] == pytest.approx(body["created_at"] + 60)
        sid = body["id"]
        listener = Listener(server.ws_url, key)
        await listener.connect()
        await listener.listen([sid])
        await client.post("/v1/objects", json={"objects": [{"lon": 0, "lat": 0,
                                                            "keywords": ["x"]}]},
                          headers=auth(key))
        await wait_for(lambda: len(listener.matches()) == 1)
        # Let the clock run: move expires_at to now instead of waiting a minute.
        with sqlite3.connect(db_path) as db:
            db.execute("UPDATE subscriptions SET expires_at = ? WHERE id = ?",
                       (time.time(), sid))
        assert await wait_for(lambda: any(m["type"] == "expired" for m in listener.messages), 15)
        assert (await client.get(f"/v1/subscriptions/{sid}", headers=auth(key))).status_code \
            == 404
        await listener.close()


def test_ttl_expiry_notifies_listeners(pipeline: LiveServer) -> None:
    asyncio.run(_ttl_expiry(pipeline, Path(pipeline.env["GEOSWARM_DATABASE_URL"][10:])))


async def _knn(server: LiveServer, between: Any = None) -> None:
    """Continuous kNN against the oracle; `between(i)` runs (in a thread) after batch i."""
    from tests.workers.oracle import knn_oracle, record_keywords

    rng = random.Random(5)
    key = server.new_key()
    specs = [{"type": "knn", "point": [0.0, 0.0], "k": 5},
             {"type": "knn", "point": [0.3, 0.1], "k": 3, "keywords": ["taxi"]},
             {"type": "knn", "point": [-1.0, 0.5], "k": 10, "keywords": ["taxi", "bus"],
              "match": "all"}]
    live: dict[str, tuple[float, float, list[str]]] = {}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        ids, listener = await subscribe_listening(server, client, key, specs)
        latest_ts: dict[str, float] = {}
        clock = 1000.0
        for _ in range(8):  # noqa: B007 - passed to `between`
            objs = []
            for _ in range(40):
                clock += 1
                obj: dict[str, Any] = {"lon": rng.uniform(-2, 2), "lat": rng.uniform(-1, 1),
                                       "keywords": rng.sample(["taxi", "bus", "car"],
                                                              rng.randint(0, 2)), "ts": clock}
                if rng.random() < 0.7:  # moving objects crossing the partition border at 0
                    obj["id"] = f"v{rng.randint(0, 30)}"
                    if rng.random() < 0.1:
                        obj["ts"] = clock - 100  # late: must not move the object
                objs.append(obj)
            r = await client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
            if between is not None:
                await asyncio.to_thread(between, _)
            for obj, oid in zip(objs, r.json()["ids"], strict=True):
                if "id" in obj and obj["ts"] < latest_ts.get(oid, -1):
                    continue
                latest_ts[oid] = obj["ts"]
                live[oid] = (obj["lon"], obj["lat"], record_keywords(obj))
        want = {sid: knn_oracle(spec, live) for sid, spec in zip(ids, specs, strict=True)}

        def last(sid: str) -> list[str] | None:
            msgs = [m for m in listener.messages if m["type"] == "knn"
                    and m["subscription"] == sid]
            return [n["id"] for n in msgs[-1]["neighbors"]] if msgs else None

        await wait_for(lambda: all(last(s) == want[s] for s in ids), 30)
        for sid in ids:
            assert last(sid) == want[sid]
            msgs = [m for m in listener.messages if m["type"] == "knn"
                    and m["subscription"] == sid]
            lists = [[n["id"] for n in m["neighbors"]] for m in msgs]
            assert all(a != b for a, b in zip(lists, lists[1:], strict=False))
            d = [n["distance_m"] for n in msgs[-1]["neighbors"]]
            assert d == sorted(d)
        await listener.close()


def test_continuous_knn_matches_oracle(pipeline: LiveServer) -> None:
    asyncio.run(_knn(pipeline))


def _knn_hash(client: redis.Redis, sid: str) -> tuple[float, set[str]]:
    """A kNN registration's radius (inf: unbounded) and the workers whose lists it merges."""
    held = {k.decode(): v.decode() for k, v in client.hgetall(names.knn_key(sid)).items()}
    r = float(held.get("_r", "-1"))
    return (r if r >= 0 else float("inf")), {k for k in held if not k.startswith("_")}


async def _knn_bounded(server: LiveServer) -> None:
    from app.geo.index import GlobalIndex, Plan
    from tests.workers.oracle import knn_oracle, record_keywords

    client = redis.Redis.from_url(server.redis_url)
    raw = client.get(names.PLAN_KEY)
    assert raw is not None
    index = GlobalIndex(Plan.from_json(raw))
    places = [(-100.0, 40.0), (100.0, 30.0), (10.0, 50.0), (-60.0, -20.0), (140.0, -30.0)]
    owners = {index.workers_for_circle(x, y, 1.0).pop(): (x, y) for x, y in places}
    assert len(owners) >= 2, owners
    (wa, pa), (wb, pb) = sorted(owners.items())[:2]
    rng = random.Random(3)
    key = server.new_key()
    specs = [{"type": "knn", "point": list(pa), "k": 3},
             {"type": "knn", "point": list(pb), "k": 4, "keywords": ["taxi"]}]
    live: dict[str, tuple[float, float, list[str]]] = {}

    async def put(objs: list[dict[str, Any]]) -> None:
        r = await client_http.post("/v1/objects", json={"objects": objs}, headers=auth(key))
        assert r.status_code == 202, r.text
        for obj, oid in zip(objs, r.json()["ids"], strict=True):
            live[oid] = (obj["lon"], obj["lat"], record_keywords(obj))

    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client_http:
        ids, listener = await subscribe_listening(server, client_http, key, specs)
        await put([{"id": f"v{i}", "lon": p[0] + rng.uniform(-0.3, 0.3),
                    "lat": p[1] + rng.uniform(-0.3, 0.3),
                    "keywords": ["taxi"] if i % 2 else ["bus"]}
                   for i in range(60) for p in [(pa, pb)[i % 2]]])

        def last(sid: str) -> list[str] | None:
            msgs = [m for m in listener.messages if m["type"] == "knn"
                    and m["subscription"] == sid]
            return [n["id"] for n in msgs[-1]["neighbors"]] if msgs else None

        def settled() -> bool:
            return all(last(s) == knn_oracle(spec, live) and _knn_hash(client, s)[0] < 1e6
                       for s, spec in zip(ids, specs, strict=True))

        assert await wait_for(settled, 30)
        # Shrunk to a radius around the neighbours: held by the owner of the point alone.
        for sid, owner, spec in zip(ids, (wa, wb), specs, strict=True):
            radius, held = _knn_hash(client, sid)
            assert held == {owner}, (sid, radius, held)
            assert held == index.workers_for_circle(*spec["point"], radius)
        # The neighbours of the first point leave for the second one's: its list holds fewer
        # than k within its radius, which grows until they are found.
        before = _knn_hash(client, ids[0])[0]
        await put([{"id": oid, "lon": pb[0] + rng.uniform(-1, 1), "lat": pb[1]}
                   for oid, (x, _, _) in list(live.items()) if abs(x - pa[0]) < 1])
        assert await wait_for(lambda: all(last(s) == knn_oracle(spec, live)
                                          for s, spec in zip(ids, specs, strict=True)), 30)
        radius, held = _knn_hash(client, ids[0])
        assert radius > before and wb in held
        await listener.close()

        # The cluster view counts the registrations and the resizes (from the heartbeats).
        def view() -> dict[str, Any]:
            r = httpx.get(server.base_url + "/v1/admin/cluster", headers=server.admin())
            return {w["id"]: w for w in r.json()["workers"]}

        def counted() -> bool:
            workers = view()
            return (workers[wb]["knn_registrations"] >= 2
                    and sum(w["knn_resizes"]["shrink"] for w in workers.values()) >= 2
                    and sum(w["knn_resizes"]["grow"] for w in workers.values()) >= 1)

        assert await wait_for(counted, 15), view()


def test_knn_registered_only_where_its_neighbours_can_be(pipeline: LiveServer) -> None:
    """A kNN subscription starts unbounded on a new tenant, shrinks to the owner of its point
    once its k nearest are known, and grows when they leave: its lists equal the oracle's
    throughout."""
    asyncio.run(_knn_bounded(pipeline))


def test_continuous_knn_broadcast_baseline(tmp_path: Path, embedded_redis: Any) -> None:
    """The baseline switch (every kNN subscription on every worker, unbounded) is exact too."""
    from tests.workers.harness import run_on_cluster

    def check(server: LiveServer) -> Any:
        async def run() -> None:
            await _knn(server)
            await _knn_bounded_broadcast(server)
        return run()

    run_on_cluster(tmp_path, embedded_redis.url, 2, check, GEOSWARM_KNN_BROADCAST="1")


async def _knn_bounded_broadcast(server: LiveServer) -> None:
    client = redis.Redis.from_url(server.redis_url)
    key = server.new_key()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        r = await http.post("/v1/subscriptions", json={"type": "knn", "point": [1, 1], "k": 2},
                            headers=auth(key))
        sid = r.json()["id"]
        await http.post("/v1/objects", json={"objects": [{"lon": 1.0, "lat": 1.01}] * 3},
                        headers=auth(key))
        assert await wait_for(lambda: _knn_hash(client, sid)[1] == {"w0", "w1"}, 15)
        await asyncio.sleep(0.5)
        assert _knn_hash(client, sid) == (float("inf"), {"w0", "w1"})
