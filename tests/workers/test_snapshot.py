"""Snapshot queries end to end (API.md, Snapshot queries): a real api and two real workers, and
every query type against a brute-force oracle over everything published — range (bbox and
circle), knn, keyword, topk_terms and count, with keyword predicates, `limit`, `latest` and
time ranges — before and after a partition moves to the other worker (the records stored
before the move stay on the previous owner, which must still be asked), then with one worker
SIGKILLed (503 naming it) and restarted (its window read back from its log: exact again)."""

from __future__ import annotations

import asyncio
import math
import random
import secrets
import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest
import redis
import redis.asyncio as aioredis

from app.core.config import get_settings
from app.geo.geometry import haversine_m
from app.pipeline import names, wire
from app.pipeline.inbox import Inbox
from app.pipeline.queries import STORE_GRACE_S, QueryService, new_query_id
from app.pipeline.router import Router
from tests.conftest import LiveServer, auth, start_server
from tests.workers.test_balancing import command, owner, plan_of
from tests.workers.test_pipeline import WORDS

pytestmark = pytest.mark.slow

def t0() -> float:
    """A test's first record time: 50 minutes ago, inside the live window (one hour) for the
    test's length. Taken when the test starts, not when the module is imported: a test run
    late in a long suite would otherwise ask about records older than the window."""
    return time.time() - 3000


class Records:
    """Everything published, in order: the oracle's data."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, objs: list[dict[str, Any]], ids: list[str]) -> None:
        for obj, oid in zip(objs, ids, strict=True):
            self.rows.append({**obj, "id": oid, "moving": "id" in obj,
                              "keywords": sorted(set(obj.get("keywords", [])))})

    def answer(self, q: dict[str, Any]) -> Any:
        """The brute-force answer to a query: every record, filtered and sorted."""
        rows = [r for r in self.rows
                if q.get("from", -math.inf) <= r["ts"] <= q.get("to", math.inf)]
        if q.get("latest"):
            last: dict[str, dict[str, Any]] = {}
            for r in rows:  # publish order: of two with equal ts the later wins
                if r["moving"] and r["ts"] >= last.get(r["id"], {"ts": -1.0})["ts"]:
                    last[r["id"]] = r
            rows = [r for r in rows if not r["moving"] or last[r["id"]] is r]
        rows = [r for r in rows if _inside(q, r) and _keywords(q, r["keywords"])]
        if q["type"] == "count":
            return [{"count": len(rows)}]
        if q["type"] == "topk_terms":
            terms = Counter(t for r in rows for t in r["keywords"])
            return [{"term": t, "count": c}
                    for t, c in sorted(terms.items(), key=lambda t: (-t[1], t[0]))[:q["k"]]]
        if q["type"] == "knn":
            lon, lat = q["point"]
            d = {id(r): float(haversine_m(lon, lat, r["lon"], r["lat"])) for r in rows}
            rows.sort(key=lambda r: (d[id(r)], r["id"], -r["ts"]))
            return [(r["id"], r["ts"], round(d[id(r)], 3)) for r in rows[:q["k"]]]
        order = sorted(range(len(rows)), key=lambda i: (-rows[i]["ts"], rows[i]["id"], -i))
        return [(rows[i]["id"], rows[i]["ts"]) for i in order[:q.get("limit", 1000)]]


def _inside(q: dict[str, Any], r: dict[str, Any]) -> bool:
    if "bbox" in q:
        x0, y0, x1, y1 = q["bbox"]
        return bool(x0 <= r["lon"] <= x1 and y0 <= r["lat"] <= y1)
    if "circle" in q:
        c = q["circle"]
        return bool(haversine_m(c["lon"], c["lat"], r["lon"], r["lat"]) <= c["radius_m"])
    return True


def _keywords(q: dict[str, Any], kws: list[str]) -> bool:
    wanted = set(q.get("keywords") or [])
    if not wanted:
        return True
    return wanted <= set(kws) if q.get("match") == "all" else bool(wanted & set(kws))


def shaped(q: dict[str, Any], results: list[dict[str, Any]]) -> Any:
    """The part of an answer the oracle predicts."""
    if q["type"] in ("count", "topk_terms"):
        return results
    if q["type"] == "knn":
        return [(r["id"], r["ts"], r["distance_m"]) for r in results]
    return [(r["id"], r["ts"]) for r in results]


def random_objects(rng: random.Random, n: int, clock: list[float]) -> list[dict[str, Any]]:
    """Events and moving objects on both sides of the initial split (lon 0), some moving
    objects' records late (older than their latest)."""
    objs = []
    for _ in range(n):
        clock[0] += 1.0
        obj: dict[str, Any] = {"lon": round(rng.uniform(-2.0, 2.0), 5),
                               "lat": round(rng.uniform(-1.0, 1.0), 5), "ts": clock[0],
                               "keywords": rng.sample(WORDS, rng.randint(0, 3))}
        if rng.random() < 0.5:
            obj["id"] = f"car-{rng.randrange(40)}"
            if rng.random() < 0.1:
                obj["ts"] = clock[0] - rng.uniform(50, 500)  # late
        objs.append(obj)
    return objs


def random_query(rng: random.Random, clock: float) -> dict[str, Any]:
    kind = rng.choice(["range", "range", "knn", "keyword", "topk_terms", "count"])
    q: dict[str, Any] = {"type": kind}
    if kind in ("range", "topk_terms", "count"):
        if rng.random() < 0.5:
            x, y = rng.uniform(-2, 1.5), rng.uniform(-1, 0.5)
            q["bbox"] = [x, y, x + rng.uniform(0.1, 2.5), y + rng.uniform(0.1, 1.2)]
        else:
            q["circle"] = {"lon": rng.uniform(-2, 2), "lat": rng.uniform(-1, 1),
                           "radius_m": rng.uniform(10_000, 150_000)}
    if kind == "knn":
        q["point"] = [rng.uniform(-2, 2), rng.uniform(-1, 1)]
        q["k"] = rng.choice([1, 5, 30])
    if kind == "topk_terms":
        q["k"] = rng.choice([1, 3, 10])
    if kind == "keyword" or rng.random() < 0.3:
        q["keywords"] = rng.sample(WORDS, rng.randint(1, 2))
        q["match"] = rng.choice(["any", "all"])
    if kind in ("range", "keyword"):
        q["limit"] = rng.choice([3, 50, 1000])
    if rng.random() < 0.4:
        q["latest"] = True
    if rng.random() < 0.3:
        q["from"] = clock - rng.uniform(200, 1500)
        if rng.random() < 0.5:
            q["to"] = q["from"] + rng.uniform(100, 800)
    return q


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, embedded_redis: Any
            ) -> Iterator[LiveServer]:
    # (narrow buckets: each publish lands in a bucket of its own, as over an hour's window, so
    # that the workers' indexes of settled chunks take them between steps and queries read
    # them there)
    s = start_server(tmp_path_factory.mktemp("snapshot"), embedded_redis.url, workers=2,
                     GEOSWARM_WORKER_DEAD_AFTER_S="2", GEOSWARM_QUERY_TIMEOUT_S="20",
                     GEOSWARM_BUCKET_S="0.2")
    s.wait_workers(2)
    yield s
    s.stop()


def query(client: httpx.Client, key: str, q: dict[str, Any]) -> httpx.Response:
    return client.post("/v1/queries", json=q, headers=auth(key))


def check_queries(client: httpx.Client, key: str, data: Records, rng: random.Random,
                  n: int, clock: float) -> None:
    for _ in range(n):
        q = random_query(rng, clock)
        r = query(client, key, q)
        assert r.status_code == 200, (q, r.text)
        body = r.json()
        assert body["status"] == "done"
        assert shaped(q, body["results"]) == data.answer(q), q
        if q["type"] in ("range", "keyword"):
            assert body["sources"] == {"live": len(body["results"])}
            whole = data.answer({**q, "limit": 10**9})
            assert body["truncated"] == (len(whole) > q["limit"]), q


def publish(client: httpx.Client, key: str, data: Records, objs: list[dict[str, Any]]) -> None:
    r = client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
    assert r.status_code == 202, r.text
    data.add(objs, r.json()["ids"])


def cluster_settings(cluster: LiveServer) -> Any:
    """The settings the cluster's processes read (for a query service in this process)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in cluster.env.items():
            mp.setenv(name, value)
        get_settings.cache_clear()
        settings = get_settings()
    get_settings.cache_clear()
    return settings


def published(cluster: LiveServer, prefix: str, seed: int, n: int) -> tuple[str, Records]:
    """A new tenant with `n` random records published: its name, and the oracle's data."""
    tenant = prefix + secrets.token_hex(3)
    key = cluster.new_key(tenant)
    data, clock = Records(), [t0()]
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        publish(http, key, data, random_objects(random.Random(seed), n, clock))
    return tenant, data


def test_every_query_type_equals_the_oracle_across_a_move_and_a_worker_crash(
        cluster: LiveServer) -> None:
    rng = random.Random(7)
    key = cluster.new_key()
    data, clock = Records(), [t0()]
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        for _ in range(6):
            publish(client, key, data, random_objects(rng, 300, clock))
        check_queries(client, key, data, rng, 40, clock[0])

        # Move the partition of the west half to w1: what w0 stored stays there, and both
        # workers hold part of the west's records from now on.
        plan = plan_of(cluster)
        pid, w = owner(plan, -1.0, 0.0)
        other = next(p.worker for p in plan.partitions if p.worker != w)
        reply = command(cluster, w, {"t": "move", "partitions": [pid], "to": other})
        assert reply is not None and reply["ok"], reply
        for _ in range(3):
            publish(client, key, data, random_objects(rng, 300, clock))
        assert all(p.worker == other for p in plan_of(cluster).partitions)
        check_queries(client, key, data, rng, 40, clock[0])

        # One worker gone: the query fails naming it, never a partial answer.
        cluster.kill(w)
        r = query(client, key, {"type": "range", "bbox": [-2, -1, 2, 1]})
        assert r.status_code == 503, r.text
        assert w in r.json()["detail"]
        # Back, with its window read back from its log: exact again.
        cluster.start_worker(w)
        cluster.wait_workers(2)
        check_queries(client, key, data, rng, 20, clock[0])


def test_a_slow_answer_is_polled_by_id(cluster: LiveServer) -> None:
    key, stranger = cluster.new_key(), cluster.new_key()
    data, clock = Records(), [t0()]
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        publish(client, key, data, random_objects(random.Random(3), 200, clock))
        q = {"type": "range", "bbox": [-2, -1, 2, 1], "limit": 10_000}
        r = query(client, key, {**q, "wait_s": 0})
        assert r.status_code == 202, r.text
        assert r.json()["status"] == "running"
        qid = r.json()["id"]
        deadline = time.monotonic() + 20
        while True:
            got = client.get(f"/v1/queries/{qid}", headers=auth(key))
            assert got.status_code == 200, got.text
            if got.json()["status"] != "running" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert got.json()["status"] == "done"
        assert shaped(q, got.json()["results"]) == data.answer(q)
        assert client.get(f"/v1/queries/{qid}", headers=auth(stranger)).status_code == 404
    # an answer given later is kept for an hour (one given at once, for less: see below)
    keep_ms = redis.Redis.from_url(cluster.redis_url).pttl(names.query_key(qid))
    assert 3_500_000 < keep_ms <= 3_600_000, keep_ms


def test_an_answer_given_at_once_is_kept_for_its_id(cluster: LiveServer) -> None:
    """A query answered within `wait_s` is stored once its answer is sent: `GET
    /v1/queries/{id}` gives the same body, for GEOSWARM_QUERY_ANSWER_KEEP_S (a minute)."""
    key = cluster.new_key()
    data, clock = Records(), [t0()]
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        publish(client, key, data, random_objects(random.Random(4), 100, clock))
        for q in ({"type": "range", "bbox": [-2, -1, 2, 1], "limit": 10_000},
                  {"type": "count", "bbox": [-2, -1, 2, 1]}):
            r = query(client, key, q)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["status"] == "done" and shaped(q, body["results"]) == data.answer(q)
            got = client.get(f"/v1/queries/{body['id']}", headers=auth(key))
            assert got.status_code == 200, got.text
            assert got.json() == body
            keep_ms = redis.Redis.from_url(cluster.redis_url).pttl(names.query_key(body["id"]))
            assert 50_000 < keep_ms <= 60_000, keep_ms


def test_an_answer_given_at_once_is_found_through_another_api_process(cluster: LiveServer
                                                                     ) -> None:
    """An answer given within `wait_s` is stored after it is sent. A `GET` of its id that
    reaches another api process before the store lands (here held back 0.3 s) waits for it
    instead of answering 404; an id of that shape made moments ago and never stored is 404
    once the grace is over, and an id of another shape at once."""
    tenant, data = published(cluster, "race-", 11, 100)
    settings = cluster_settings(cluster)
    q = {"type": "range", "bbox": [-2, -1, 2, 1], "limit": 10_000}

    async def scenario() -> tuple[dict[str, Any], Any, Any, Any, float]:
        client = aioredis.from_url(cluster.redis_url)
        first = QueryService(settings, client, Router(settings, client))
        other = QueryService(settings, client, Router(settings, client))
        body, keep = await first.submit(
            tenant, wire.SnapshotQuery(type="range", bbox=(-2, -1, 2, 1), limit=10_000), 10)
        assert body["status"] == "done" and keep is not None

        async def late() -> None:
            await asyncio.sleep(0.3)
            await keep()

        storing = asyncio.create_task(late())
        got = await other.status(tenant, body["id"])
        await storing
        started = time.monotonic()
        never = await other.status(tenant, new_query_id(time.time()))
        waited = time.monotonic() - started
        shaped_otherwise = await other.status(tenant, "q" + "0" * 20)
        await client.aclose()
        return body, got, never, shaped_otherwise, waited

    body, got, never, shaped_otherwise, waited = asyncio.run(scenario())
    assert shaped(q, body["results"]) == data.answer(q)
    assert got == orjson.loads(orjson.dumps(body))
    assert never is None and waited >= STORE_GRACE_S * 0.9
    assert shaped_otherwise is None


def test_replies_come_to_the_inbox_and_through_redis_when_they_cannot(cluster: LiveServer
                                                                      ) -> None:
    """A query service with an inbox (`app.pipeline.inbox`) gets its replies straight from the
    workers once they have connected (the first through Redis: a worker connects as it reads
    the part); with the inbox closed, through Redis again; and a reply a worker cannot send
    to an inbox it was told to use goes to the list, where the api finds it. Every answer is
    exact."""
    from app.pipeline.inbox import REPLIES

    tenant, data = published(cluster, "inbox-", 12, 300)
    settings = cluster_settings(cluster)
    q = {"type": "range", "bbox": [-180, -90, 180, 90], "limit": 10_000}  # (every worker)
    query = wire.SnapshotQuery(type="range", bbox=(-180, -90, 180, 90), limit=10_000)

    def received() -> tuple[float, float]:
        return (REPLIES.labels("inbox")._value.get(), REPLIES.labels("redis")._value.get())

    async def scenario() -> list[tuple[Any, float, tuple[float, float]]]:
        client = aioredis.from_url(cluster.redis_url)
        service = QueryService(settings, client, Router(settings, client))
        await service.open_inbox()
        inbox = service.inbox
        assert inbox is not None and inbox.path.startswith(str(settings.data_dir.resolve()))
        out = []

        async def ask() -> None:
            before, started = received(), time.monotonic()
            body = await service.execute(tenant, query)
            after = received()
            out.append((body, time.monotonic() - started,
                        (after[0] - before[0], after[1] - before[1])))

        await ask()  # through Redis: the workers connect to the inbox as they read the part
        for _ in range(100):  # (their hellos are read by this loop, maybe after the reply)
            if inbox.reaches(["w0", "w1"]):
                break
            await asyncio.sleep(0.02)
        assert inbox.reaches(["w0", "w1"])
        for _ in range(3):
            await ask()  # to the inbox
        await inbox.stop()  # the workers' connections go: through Redis again
        assert not inbox.reaches(["w0", "w1"])
        await ask()
        # Told to reply to an inbox whose socket is gone (the api's view of it stale): the
        # workers' sends fail, and the replies wait in the list for the api's look there.
        inbox2 = Inbox(settings.data_dir.resolve() / "inbox")
        assert await inbox2.start()
        service.inbox = inbox2
        for _ in range(50):
            if inbox2.reaches(["w0", "w1"]):
                break
            await ask()  # (the workers connect to the new inbox as they read its parts)
        assert inbox2.reaches(["w0", "w1"])
        server = inbox2._server
        await inbox2.stop()  # its socket and the workers' connections gone...
        inbox2._server = server
        inbox2._workers.update({"w0": 1, "w1": 1})  # ...but not yet known to be
        await ask()
        inbox2._server = None
        await client.aclose()
        return out

    answers = asyncio.run(scenario())
    for body, _, _ in answers:
        assert shaped(q, body["results"]) == data.answer(q)
    vias = [via for _, _, via in answers]
    assert vias[0] == (0, 2) and vias[1:4] == [(2, 0)] * 3, vias
    assert vias[4] == (0, 2), vias
    assert vias[-1] == (0, 2) and answers[-1][1] >= 0.9, (vias, answers[-1][1])


def test_a_query_waits_for_the_backlog_accepted_before_it(cluster: LiveServer) -> None:
    """A query part goes straight to each worker with the tail of its stream: a worker that
    is far behind (stopped while hundreds of entries were accepted, more than one read of its
    stream takes) answers only once it has processed them all."""
    key = cluster.new_key()
    rng = random.Random(5)
    data, clock = Records(), [t0()]
    batches = [random_objects(rng, 4, clock) for _ in range(300)]
    queries = [{"type": "count", "bbox": [-2, -1, 2, 1], "keywords": WORDS, "match": "any"},
               {"type": "range", "bbox": [-2.5, -1.5, 0.5, 1.5], "limit": 10_000},
               {"type": "knn", "point": [-1.0, 0.0], "k": 30, "latest": True}]
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        cluster.kill("w0", signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda objs: publish(client, key, data, objs), batches))
            ids = []
            for q in queries:
                r = query(client, key, {**q, "wait_s": 0})
                assert r.status_code in (200, 202), r.text
                ids.append(r.json()["id"])
        finally:
            cluster.kill("w0", signal.SIGCONT)
        for q, qid in zip(queries, ids, strict=True):
            deadline = time.monotonic() + 20
            while True:
                got = client.get(f"/v1/queries/{qid}", headers=auth(key)).json()
                if got["status"] != "running" or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            assert got["status"] == "done", got
            assert shaped(q, got["results"]) == data.answer(q), q


@pytest.mark.parametrize("outbox", [False, True], ids=["checked-when-sent", "checked-after"])
def test_a_query_planned_with_an_older_plan_is_planned_again(cluster: LiveServer,
                                                             outbox: bool) -> None:
    """An api process chooses a query's workers from the plans it knows, without reading the
    plan history; a part is sent only while the newest plan is the one they came from. Here
    that process's plan is held stale across a move (another api process published since,
    to the partition's new owner): its query is planned again and finds those records. With
    outboxes (a Redis Cluster) the plan history is read once the parts are sent."""
    tenant = "stale-" + secrets.token_hex(3)
    key = cluster.new_key(tenant)
    rng = random.Random(9)
    data, clock = Records(), [t0()]
    settings = cluster_settings(cluster).model_copy(update={"redis_outbox": outbox})
    east = (0.5, -1.5, 2.5, 1.5)
    q = {"type": "range", "bbox": list(east), "limit": 10_000}

    async def scenario() -> list[dict[str, Any]]:
        client = aioredis.from_url(cluster.redis_url)
        router = Router(settings, client)
        service = QueryService(settings, client, router)
        assert (router.outbox is not None) == outbox
        query = wire.SnapshotQuery(type="range", bbox=east, limit=10_000)
        with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
            publish(http, key, data, random_objects(rng, 200, clock))
            first = await service.execute(tenant, query)
            assert shaped(q, first["results"]) == data.answer(q)
            router._plan_checked = time.monotonic() + 3600  # this process's plan: held
            plan = plan_of(cluster)
            pid, w = owner(plan, 1.0, 0.0)
            other = "w1" if w == "w0" else "w0"
            reply = await asyncio.to_thread(
                command, cluster, w, {"t": "move", "partitions": [pid], "to": other})
            assert reply is not None and reply["ok"], reply
            publish(http, key, data, random_objects(rng, 200, clock))  # to the new owner
        assert router.index is not None and router.index.version < plan_of(cluster).version
        out = await service.execute(tenant, query)
        # planned again: with the plan of the move, which this process had not read
        assert router.index.version == plan_of(cluster).version
        await client.aclose()
        return list(out["results"])

    assert shaped(q, asyncio.run(scenario())) == data.answer(q)


def test_a_worker_stopped_mid_query_fails_it_with_503(cluster: LiveServer) -> None:
    """SIGSTOP: the worker's heartbeat stops and the query is failed, naming it."""
    key = cluster.new_key()
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        cluster.kill("w1", signal.SIGSTOP)
        try:
            r = query(client, key, {"type": "count", "bbox": [-2, -1, 2, 1]})
        finally:
            cluster.kill("w1", signal.SIGCONT)
        assert r.status_code == 503, r.text
        assert "w1" in r.json()["detail"]
        r = query(client, key, {"type": "count", "bbox": [-2, -1, 2, 1]})
        assert r.status_code == 200, r.text


def _metadata_counts(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('geoswarm_count_queries_total{path="metadata"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_counts_of_whole_cells_come_from_the_workers_counts(cluster: LiveServer) -> None:
    """Counts over boxes holding whole grid cells are answered from the workers' per-cell
    counts (the cells the box cuts by the workers): exact against the oracle, right after
    publishing, after a worker restart (counts rebuilt from its window log) and after a
    partition moved (the previous owner's counts still count)."""
    rng = random.Random(23)
    key = cluster.new_key()
    data, clock = Records(), [t0()]

    def check(n: int) -> None:
        before = _metadata_counts(client)
        for _ in range(n):
            x, y = rng.uniform(-2.5, 0.5), rng.uniform(-1.2, 0.2)
            q = {"type": "count", "bbox": [x, y, x + rng.uniform(1.0, 3.5),
                                           y + rng.uniform(0.5, 1.5)]}
            r = query(client, key, q)
            assert r.status_code == 200, r.text
            assert r.json()["results"] == data.answer(q), q
        assert _metadata_counts(client) - before == n  # every one of them from the counts

    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        for _ in range(4):
            publish(client, key, data, random_objects(rng, 400, clock))
        check(15)
        # a box over every record: its whole cells from the counts, its edges by the workers
        r = query(client, key, {"type": "count", "bbox": [-180, -90, 180, 90]})
        assert r.json()["results"] == [{"count": len(data.rows)}]

        cluster.kill("w0")
        # its counts are back once it has read its window back (a count before that is
        # counted by the workers, exactly too)
        store = redis.Redis.from_url(cluster.redis_url)
        store.delete(names.cell_counts_key("w0"))  # the counts of the process just killed
        cluster.start_worker("w0")
        cluster.wait_workers(2)
        deadline = time.monotonic() + 30
        while store.hget(names.cell_counts_key("w0"), names.CELL_COUNTS_UPTO) is None:
            assert time.monotonic() < deadline, "w0 never reported its counts"
            time.sleep(0.05)
        store.close()
        publish(client, key, data, random_objects(rng, 200, clock))
        check(10)

        plan = plan_of(cluster)
        pid, w = owner(plan, 1.0, 0.0)
        other = "w1" if w == "w0" else "w0"
        reply = command(cluster, w, {"t": "move", "partitions": [pid], "to": other})
        assert reply is not None and reply["ok"], reply
        publish(client, key, data, random_objects(rng, 300, clock))
        check(10)
        # with keywords (or latest, or a time range) the workers count everything
        q = {"type": "count", "bbox": [-2, -1, 2, 1], "keywords": [WORDS[0]]}
        before = _metadata_counts(client)
        assert query(client, key, q).json()["results"] == data.answer(q)
        assert _metadata_counts(client) == before
