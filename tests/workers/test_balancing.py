"""Exact delivery while partitions move, split and merge (SWARM §5.1): real api and worker
processes, real Redis, real WebSockets, the brute-force oracle. Here the balancing commands
are sent to the workers directly (the protocol of app/pipeline/control.py); the coordinator
and admin API driving them are tested in test_balancer_e2e.py."""

from __future__ import annotations

import asyncio
import random
import secrets
import signal
import time
from typing import Any

import httpx
import msgspec
import orjson
import pytest
import redis

from app.core.redis import sync_client
from app.geo.index import Plan, initial_plan
from app.pipeline import names
from app.pipeline.cluster import partition_ids
from tests.conftest import LiveServer, start_server
from tests.workers.harness import Listener, wait_for
from tests.workers.oracle import Oracle, received_matches
from tests.workers.test_pipeline import (
    assert_exact,
    create_subs,
    publish,
    random_objects,
    random_subs,
)
from workers.executor import MIN_READ_COUNT, READ_COUNT, STEP_TARGET_S, paced_count

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_url: str):  # type: ignore[no-untyped-def]
    s = start_server(tmp_path_factory.mktemp("balancing"), redis_url, workers=3)
    s.wait_workers(3)
    yield s
    s.stop()


def plan_of(server: LiveServer) -> Plan:
    raw = sync_client(server.redis_url).get(names.PLAN_KEY)
    assert raw is not None
    return Plan.from_json(raw)


def owner(plan: Plan, lon: float, lat: float) -> tuple[str, str]:
    """(partition id, worker) owning a point."""
    cx, cy = plan.grid.cells_of([lon], [lat])
    for p in plan.partitions:
        if p.contains_cell(int(cx[0]), int(cy[0])):
            return p.id, p.worker
    raise AssertionError("no partition owns the point")


def command(server: LiveServer, worker: str, msg: dict[str, Any], timeout: float = 20.0,
            deadline: float | None = None) -> dict[str, Any] | None:
    """Send one balancing command as the coordinator would; the worker's reply (None on
    timeout). A worker that has not processed a handoff it received yet refuses: sent
    again, as the coordinator does in its next round."""
    client = sync_client(server.redis_url)
    give_up = time.time() + timeout
    while True:
        plan = plan_of(server)
        token = secrets.token_hex(8)
        first = int(client.incrby(names.PART_SEQ, 8)) - 7
        body = {"version": plan.version, "deadline": deadline or time.time() + timeout,
                "reply": token, "ids": partition_ids(first + 107, 8), **msg}
        client.xadd(names.command_stream(worker), {b"m": msgspec.msgpack.encode(body)})
        got = client.blpop([names.reply_key(token)], timeout=timeout)
        reply = None if got is None else orjson.loads(got[1])
        if (reply is None or reply["ok"] or "not processed yet" not in (reply["error"] or "")
                or time.time() > give_up):
            return reply
        time.sleep(0.05)


def move_or_split(server: LiveServer, lon: float, lat: float, i: int, split: bool) -> None:
    """Move the partition holding (lon, lat) to another worker (the i-th choice), or split
    it near lon 0 and move its low half there."""
    plan = plan_of(server)
    pid, w = owner(plan, lon, lat)
    other = sorted({"w0", "w1", "w2"} - {w})[i % 2]
    p = next(q for q in plan.partitions if q.id == pid)
    if split and p.width > 1:
        msg: dict[str, Any] = {"t": "split", "partition": pid, "axis": "x",
                               "at": min(max(p.x0, 499), p.x1 - 1), "moved": "low", "to": other}
    else:
        msg = {"t": "move", "partitions": [pid], "to": other}
    reply = command(server, w, msg)
    assert reply is not None and reply["ok"], reply


async def open_tenant(server: LiveServer, client: httpx.AsyncClient, rng: random.Random,
                      n_subs: int) -> tuple[str, Oracle, Listener]:
    """A new tenant with `n_subs` random subscriptions and a WebSocket listening to all."""
    key = server.new_key()
    oracle = Oracle()
    await create_subs(client, key, random_subs(rng, n_subs), oracle)
    listener = Listener(server.ws_url, key)
    await listener.connect()
    await listener.listen(all=True)
    return key, oracle, listener


async def _moves_during_burst(server: LiveServer, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        key, oracle, listener = await open_tenant(server, client, rng, 150)
        movers = [f"car-{i}" for i in range(30)]
        clock = [1_700_000_000.0]
        versions = [plan_of(server).version]
        actions: list[str] = []

        def step(i: int) -> None:
            plan = plan_of(server)
            pid, w = owner(plan, 0.3, 0.2)  # the hotspot of random_objects
            others = sorted({p.worker for p in plan.partitions} - {w})
            p = next(q for q in plan.partitions if q.id == pid)
            if i % 3 == 0:
                reply = command(server, w, {"t": "move", "partitions": [pid],
                                            "to": others[i % len(others)]})
            elif i % 3 == 1 and p.width > 1:
                at = min(max(p.x0, 500), p.x1 - 1)
                reply = command(server, w, {"t": "split", "partition": pid, "axis": "x",
                                            "at": at, "moved": "high", "to": others[0]})
            elif p.height > 1:
                at = min(max(p.y0, 500), p.y1 - 1)
                reply = command(server, w, {"t": "split", "partition": pid, "axis": "y",
                                            "at": at, "moved": "low", "to": others[-1]})
            else:
                reply = command(server, w, {"t": "merge"})
            assert reply is not None and reply["ok"], reply
            actions.append(reply["action"])
            versions.append(plan_of(server).version)

        for i in range(30):
            await publish(client, key, random_objects(rng, 100, movers, clock), oracle)
            if i % 4 == 1:
                # the command runs while the next batches are routed: some still with the old
                # plan (routers reload within a second), which the old owner forwards
                task = asyncio.create_task(asyncio.to_thread(step, i // 4))
                await publish(client, key, random_objects(rng, 100, movers, clock), oracle)
                await task
        for w in ("w0", "w1", "w2"):
            reply = command(server, w, {"t": "merge"})
            assert reply is not None and reply["ok"], reply
        await publish(client, key, random_objects(rng, 100, movers, clock), oracle)
        await wait_for(lambda: len(listener.matches()) >= oracle.total(), 60)
        await asyncio.sleep(0.5)
        assert_exact(received_matches(listener.messages), oracle)
        assert len(set(versions)) >= 7 and {"move", "split"} <= set(actions), (versions, actions)
        await listener.close()
    plan = plan_of(server)
    plan.validate()
    assert any(p.parent for p in plan.partitions) or plan.version > versions[0]
    history = sync_client(server.redis_url).lrange(names.PLAN_HISTORY, 0, -1)
    assert [orjson.loads(h)["version"] for h in history][-1] == plan.version


def test_exact_delivery_while_partitions_move_split_and_merge(cluster: LiveServer) -> None:
    asyncio.run(_moves_during_burst(cluster, seed=3))


def forwarded(server: LiveServer, worker: str) -> int:
    """Records the worker forwarded to a partition's new owner (from its heartbeat)."""
    raw = sync_client(server.redis_url).hget(names.WORKERS_KEY, worker)
    return int(orjson.loads(raw or b"{}").get("forwarded", 0))


async def _paused_owner(server: LiveServer) -> None:
    """A worker paused (SIGSTOP) around a move: a command that reaches it after its deadline
    is refused (it never executes a stale decision); a worker paused right after giving a
    partition away forwards, on resume, what stale routers sent it; nothing is lost or
    duplicated."""
    rng = random.Random(5)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        key, oracle, listener = await open_tenant(server, client, rng, 120)
        movers = [f"bus-{i}" for i in range(20)]
        clock = [1_700_000_000.0]
        plan = plan_of(server)
        pid, w = owner(plan, 0.3, 0.2)
        other = sorted({p.worker for p in plan.partitions} - {w})[0]
        server.kill(w, signal.SIGSTOP)
        try:
            for _ in range(4):
                await publish(client, key, random_objects(rng, 80, movers, clock), oracle)
            reply = await asyncio.to_thread(command, server, w, {"t": "move", "partitions": [pid],
                                                                 "to": other}, 1.5)
            assert reply is None  # paused: no answer before the deadline
        finally:
            server.kill(w, signal.SIGCONT)
        await wait_for(lambda: plan_of(server).version == plan.version, 5)
        # the late command was refused, not executed
        await asyncio.sleep(1.0)
        assert plan_of(server).version == plan.version
        before = forwarded(server, w)
        # now pause the owner while records for its partition queue up, move the partition
        # while it is paused: on resume it runs the move first and forwards those records
        server.kill(w, signal.SIGSTOP)
        try:
            for _ in range(4):
                await publish(client, key, random_objects(rng, 80, movers, clock), oracle)
            move = asyncio.create_task(asyncio.to_thread(
                command, server, w, {"t": "move", "partitions": [pid], "to": other}))
            await asyncio.sleep(0.5)
        finally:
            server.kill(w, signal.SIGCONT)
        reply = await move
        assert reply is not None and reply["ok"] and reply["action"] == "move", reply
        # and pause it again after it lost the partition, while publishing goes on
        server.kill(w, signal.SIGSTOP)
        try:
            for _ in range(4):
                await publish(client, key, random_objects(rng, 80, movers, clock), oracle)
            await asyncio.sleep(1.0)
        finally:
            server.kill(w, signal.SIGCONT)
        for _ in range(3):
            await publish(client, key, random_objects(rng, 80, movers, clock), oracle)
        await wait_for(lambda: len(listener.matches()) >= oracle.total(), 60)
        await asyncio.sleep(0.5)
        assert_exact(received_matches(listener.messages), oracle)
        await listener.close()
    assert owner(plan_of(server), 0.3, 0.2)[1] == other
    await asyncio.sleep(1.2)  # one heartbeat
    assert forwarded(server, w) > before  # the queued records went to the new owner


def test_paused_worker_around_a_move(cluster: LiveServer) -> None:
    asyncio.run(_paused_owner(cluster))


def test_a_command_from_a_coordinator_without_the_lease_is_refused(cluster: LiveServer
                                                                     ) -> None:
    """Commands carry their coordinator's id; a worker carries out none whose sender no longer
    holds the lease (a deposed leader's decision), whatever its plan version."""
    plan = plan_of(cluster)
    w = plan.partitions[0].worker
    sync_client(cluster.redis_url).set(names.LEASE_KEY, "coordinator-b")
    try:
        reply = command(cluster, w, {"t": "merge", "leader": "coordinator-a"})
        assert reply is not None and not reply["ok"], reply
        assert reply["error"] == ("sent by coordinator coordinator-a, which no longer holds "
                                  "the lease"), reply
        reply = command(cluster, w, {"t": "merge", "leader": "coordinator-b"})
        assert reply is not None and reply["ok"], reply
    finally:
        sync_client(cluster.redis_url).delete(names.LEASE_KEY)
    assert plan_of(cluster).version >= plan.version


def test_round_reports_statistics(cluster: LiveServer) -> None:
    """A round command folds the statistics; the report's per-partition counts add up."""
    client = sync_client(cluster.redis_url)
    n = int(client.incr(names.ROUND_SEQ)) + 1000
    plan = plan_of(cluster)
    for w in ("w0", "w1", "w2"):  # a worker may own no partition after the tests above
        client.xadd(names.command_stream(w), {b"m": msgspec.msgpack.encode({"t": "round", "n": n})})
    deadline = time.monotonic() + 20
    while client.hlen(names.report_key(n)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    reports = {k.decode(): orjson.loads(v) for k, v in client.hgetall(names.report_key(n)).items()}
    assert set(reports) == {"w0", "w1", "w2"}
    owned = {p.id for p in plan.partitions}
    for w, rep in reports.items():
        assert {p["id"] for p in rep["partitions"]} == {p.id for p in plan.partitions
                                                          if p.worker == w}
        assert rep["R"] == sum(p["R"] for p in rep["partitions"])
        assert rep["num"] == pytest.approx(sum(p["N"] * p["Q"] * p["R"]
                                               for p in rep["partitions"]))
        assert {p["id"] for p in rep["partitions"]} <= owned
    assert all(r["round"] == n for r in reports.values())


def round_report(server: LiveServer, worker: str, timeout: float = 20) -> dict[str, Any]:
    """A round command to one worker, as the coordinator sends it; its report."""
    client = sync_client(server.redis_url)
    n = int(client.incr(names.ROUND_SEQ)) + 1000
    client.xadd(names.command_stream(worker),
                {b"m": msgspec.msgpack.encode({"t": "round", "n": n})})
    deadline = time.monotonic() + timeout
    while (raw := client.hget(names.report_key(n), worker)) is None:
        assert time.monotonic() < deadline, f"no report from {worker}"
        time.sleep(0.05)
    report: dict[str, Any] = orjson.loads(raw)
    return report


def test_a_worker_reports_the_backlog_it_has_not_processed(cluster: LiveServer) -> None:
    """behind_s: how far the newest entry of the worker's stream is ahead of the last one it
    processed, when it reads the round's command (before the entries read with it). Paused
    while records for its partition arrive 1.5 s apart, it reports at least that; once it
    has caught up, about nothing."""
    _, w = owner(plan_of(cluster), 0.3, 0.2)
    key = cluster.new_key()
    headers = {"Authorization": f"Bearer {key}"}

    def post(tag: str) -> None:
        objs = [{"id": f"{tag}-{i}", "lon": 0.3, "lat": 0.2, "ts": time.time()}
                for i in range(20)]
        r = httpx.post(cluster.base_url + "/v1/objects", json={"objects": objs},
                       headers=headers, timeout=20)
        assert r.status_code == 202, r.text

    post("before")
    assert round_report(cluster, w)["behind_s"] < 1.0
    cluster.kill(w, signal.SIGSTOP)
    try:
        post("first")
        time.sleep(1.5)
        post("second")
        client = sync_client(cluster.redis_url)
        n = int(client.incr(names.ROUND_SEQ)) + 1000
        client.xadd(names.command_stream(w),
                    {b"m": msgspec.msgpack.encode({"t": "round", "n": n})})
    finally:
        cluster.kill(w, signal.SIGCONT)
    wait_for_sync(lambda: client.hget(names.report_key(n), w) is not None, 20)
    behind = orjson.loads(client.hget(names.report_key(n), w) or b"")["behind_s"]
    assert 1.4 <= behind < 10, behind
    wait_for_sync(lambda: round_report(cluster, w)["behind_s"] < 1.0, 20)


def test_a_step_reads_as_many_entries_as_take_a_quarter_of_a_second() -> None:
    """`paced_count`: after a step, the next reads as many entries as took STEP_TARGET_S at
    its pace, at least MIN_READ_COUNT (one entry that takes longer still goes whole) and at
    most READ_COUNT; it grows back by half at most per step."""
    assert (STEP_TARGET_S, MIN_READ_COUNT, READ_COUNT) == (0.25, 1, 256)
    assert paced_count(256, 256, 2.56) == 25  # 10 ms an entry
    assert paced_count(256, 3, 3.0) == 1  # a second an entry
    assert paced_count(25, 25, 0.025) == 37  # fast again: grows by half
    assert paced_count(200, 200, 0.01) == 256
    assert paced_count(40, 5, 0.0) == 40  # nothing measured: unchanged
    count, steps = 1, 0
    while count < READ_COUNT:
        count, steps = paced_count(count, count, 0.0005 * count), steps + 1
    assert steps <= 15


def wait_for_sync(done: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_continuous_knn_across_moves(cluster: LiveServer) -> None:
    """kNN state (moving objects' latest positions) travels with a moved partition: after
    moves and splits of the partitions holding the query points, every kNN subscription's
    last pushed list equals the oracle's."""
    from bench.knn_live import MOVE_SECONDS
    from bench.pipeline import hop_counts, observed
    from tests.workers.test_pipeline import _knn

    before = hop_counts(cluster.base_url, MOVE_SECONDS, "side")
    made = []

    def between(i: int) -> None:
        move_or_split(cluster, [0.0, 0.3, -1.0][i % 3], [0.0, 0.1, 0.5][i % 3], i, i % 2 == 1)
        made.append(i)

    asyncio.run(_knn(cluster, between))
    # each move and split handed partitions from one worker to another: the time it held
    # both workers' steps is on /metrics (from their heartbeats)

    def moves(side: str) -> int:
        return observed(before, hop_counts(cluster.base_url, MOVE_SECONDS, "side"), side)[0]

    give_up = time.monotonic() + 15
    while min(moves("give"), moves("take")) < len(made):
        assert time.monotonic() < give_up, (len(made), moves("give"), moves("take"))
        time.sleep(0.2)
    text = httpx.get(cluster.base_url + "/metrics", timeout=10).text
    assert 'geoswarm_worker_move_seconds_sum{side="take",worker="w' in text


@pytest.mark.parametrize("mode", ["replicated", "history"])
def test_exact_delivery_in_baseline_modes(mode: str, tmp_path: Any, embedded_redis: Any
                                          ) -> None:
    """The comparison modes deliver exactly what the oracle says too: replicated (every
    subscription on every worker, objects spread by id hash / round-robin, each worker
    deciding enter/exit alone) and history (a static plan cut from a sample)."""
    from tests.workers.test_pipeline import _exact_workload

    sample = tmp_path / "sample.ndjson"
    rng = random.Random(1)
    sample.write_text("".join(
        orjson.dumps({"lon": rng.gauss(0.3, 0.3), "lat": rng.gauss(0.2, 0.2)}).decode() + "\n"
        for _ in range(2000)) + orjson.dumps({"bbox": [0, 0, 0.5, 0.5]}).decode() + "\n")
    # The embedded server only (suite time): Redis 7 runs the swarm mode's moves in this module.
    server = start_server(tmp_path, embedded_redis.url, workers=3, GEOSWARM_PARTITIONING=mode,
                          GEOSWARM_HISTORY_SAMPLE=str(sample))
    try:
        server.wait_workers(3)
        if mode == "history":  # the sample's hotspot got more, smaller partitions around it
            plan = plan_of(server)
            assert plan.partitions != initial_plan(plan.grid, ["w0", "w1", "w2"]).partitions
        asyncio.run(_exact_workload(server, seed=17))
    finally:
        server.stop()


def drained(client: redis.Redis, workers: list[str]) -> bool:
    """Every entry of the workers' streams was read and acknowledged, and every worker is
    waiting for more (blocked in XREADGROUP): what it does after a commit (a kNN resize, an
    outbox relayed) is done too."""
    if not idle(client, len(workers)):
        return False
    for w in workers:
        stream = names.worker_stream(w)
        last = client.xinfo_stream(stream)["last-generated-id"]
        group = next(g for g in client.xinfo_groups(stream)
                     if g["name"] in (names.GROUP, names.GROUP.encode()))
        if group["pending"] or group["last-delivered-id"] != last:
            return False
    return True


def idle(client: Any, workers: int) -> bool:
    """At least `workers` connections of this server's database are blocked in XREADGROUP
    (the workers' reads; nothing else of a test server reads that way)."""
    if hasattr(client, "get_primaries"):  # a Redis Cluster: its nodes, database 0
        db, conns = "0", [c for n in client.get_primaries()
                          for c in client.client_list(target_nodes=n)]
    else:
        db = str(client.connection_pool.connection_kwargs.get("db", 0))
        conns = client.client_list()
    blocked = [c for c in conns if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")
               and str(c.get("db")) == db]
    return len(blocked) >= workers


async def wait_drained(client: redis.Redis, workers: list[str], timeout: float = 20.0) -> None:
    give_up = time.monotonic() + timeout
    while not drained(client, workers):
        assert time.monotonic() < give_up, "the workers did not catch up"
        await asyncio.sleep(0.003)


KNN_SPECS: list[dict[str, Any]] = [
    {"type": "knn", "point": [0.0, 0.0], "k": 5},
    {"type": "knn", "point": [0.3, 0.1], "k": 3, "keywords": ["taxi"]},
    {"type": "knn", "point": [-1.0, 0.5], "k": 4},
    {"type": "knn", "point": [1.5, -0.5], "k": 2},
    {"type": "knn", "point": [-0.2, -0.3], "k": 6, "keywords": ["taxi", "bus"], "match": "all"},
]


def test_every_knn_list_was_a_true_top_k(cluster: LiveServer) -> None:
    """One update at a time (the workers drained in between), objects crossing the
    partition borders, jumping far away and back (the registrations' radii grow and shrink),
    and partitions holding the query points moving and splitting every 15 updates: every list
    pushed is the oracle's top-k of the live set after some update, in the order of the
    updates, and the last one is that of the final set."""
    asyncio.run(_knn_history(cluster))


def test_a_list_held_alone_is_merged_with_its_distances_of_now(tmp_path: Any,
                                                               embedded_redis: Any) -> None:
    """A worker holding a kNN registration alone leaves out the reports of lists whose
    members and order did not change (the merged list cannot change), so the distances
    stored for it get old. When a split hands part of the circle to another worker, that
    worker's first report makes the sole holder report its list again before anything is
    merged: the object arriving on the new side between two listed ones enters the list at
    its place. Merged with the old distances, it would not. A server of its own: the plans of
    its live window must all give the point to one worker (a registration reaches every
    worker that owned its circle within the window); on the embedded Redis only (suite time:
    the module's other kNN tests run on Redis 7 too)."""
    server = start_server(tmp_path, embedded_redis.url, workers=2)
    try:
        server.wait_workers(2)
        asyncio.run(_sole_holder_refresh(server))
    finally:
        server.stop()


async def _sole_holder_refresh(server: LiveServer) -> None:
    from app.geo.geometry import haversine_m

    client = sync_client(server.redis_url)
    workers = ["w0", "w1"]
    # 96 m east of the boundary between grid columns 777 and 778 (lon 100.08), inside a
    # partition of the first plan
    px, py = 100.081, 30.0
    deg = 1 / (111_320 * 0.8660254)  # degrees of longitude per metre at lat 30

    def east(m: float) -> float:
        return px + m * deg

    tenant = "sole-" + secrets.token_hex(4)
    key = server.new_key(tenant)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        async def put(oid: str, lon: float) -> None:
            r = await http.post("/v1/objects", json={"objects": [
                {"id": oid, "lon": lon, "lat": py, "ts": time.time()}]}, headers=headers)
            assert r.status_code == 202, r.text
            await wait_drained(client, workers)

        r = await http.post("/v1/subscriptions", headers=headers,
                            json={"type": "knn", "point": [px, py], "k": 2})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        listener = Listener(server.ws_url, key)
        await listener.connect()
        await listener.listen([sid])
        hkey = names.knn_key(sid)
        await put("a", east(55))
        await put("b", east(222))

        def lists() -> list[list[str]]:
            """The lists pushed, less the first one when it is empty: a subscription gets a
            first list once created, which holds `a` or not as its put comes before or
            after it."""
            got = [[n["id"] for n in m["neighbors"]] for m in listener.messages
                   if m["type"] == "knn" and m["subscription"] == sid]
            return got[1:] if got[:1] == [[]] else got

        def holders() -> dict[str, Any]:
            fields = {k.decode(): v.decode() for k, v in client.hgetall(hkey).items()}
            return {k: orjson.loads(v) for k, v in fields.items() if not k.startswith("_")}

        # registered everywhere while the tenant had no objects, the radius then shrinks to
        # twice the k-th distance: one worker holds it, alone
        plan = plan_of(server)
        pid, a_worker = owner(plan, px, py)
        assert await wait_for(lambda: lists()[-1:] == [["a", "b"]] and list(holders())
                              == [a_worker] and client.hget(hkey, "_l:" + a_worker), 20), (
            lists(), client.hgetall(hkey))
        await wait_drained(client, workers)
        # b moves from 222 m to 400 m: the list keeps its members and order, not reported
        await put("b", east(400))
        (stored,) = holders().values()
        assert [n[1] for n in stored] == ["a", "b"] and round(stored[1][0]) == 222, stored
        # columns <= 777 (lon < 100.08, within the circle) go to another worker
        part = next(p for p in plan_of(server).partitions if p.id == pid)
        assert part.x0 <= 777 < part.x1, part
        other = sorted(set(workers) - {a_worker})[0]
        reply = command(server, a_worker, {"t": "split", "partition": pid, "axis": "x",
                                           "at": 777, "moved": "low", "to": other})
        assert reply is not None and reply["ok"], reply
        await wait_drained(client, workers)
        # c, 300 m west, on the new side: between a (55 m) and b (400 m now, 222 m stored)
        await put("c", px - 300 * deg)
        truth = sorted((haversine_m(px, py, x, py), oid)
                       for oid, x in (("a", east(55)), ("b", east(400)),
                                      ("c", px - 300 * deg)))
        assert [oid for _, oid in truth[:2]] == ["a", "c"]
        assert await wait_for(lambda: lists()[-1:] == [["a", "c"]], 20), lists()
        assert lists() == [["a"], ["a", "b"], ["a", "c"]]
        # the sole holder was asked to report again, whole, and holds alone no longer
        assert other in holders() and not client.hget(hkey, "_l:" + a_worker)
        assert round(holders()[a_worker][1][0]) == 400

        # The half holding the point moves to the other worker too: the circle reaches
        # nothing of the first one's any more, and the tenant has moving objects only, so
        # its registration leaves it (a new epoch on the current owner alone).
        plan = plan_of(server)
        high, _ = owner(plan, px, py)
        reply = command(server, a_worker, {"t": "move", "partitions": [high], "to": other})
        assert reply is not None and reply["ok"], reply
        await wait_drained(client, workers)
        assert await wait_for(lambda: list(holders()) == [other], 10), client.hgetall(hkey)
        await put("a", east(350))  # a passes c: [c, a]
        assert await wait_for(lambda: lists()[-1:] == [["c", "a"]], 20), lists()
        assert client.hget(hkey, "_l:" + other)  # alone again
        # An event of the tenant (kept where it is stored for the window): moving the whole
        # circle back leaves the registration on the worker that may hold such events.
        r = await http.post("/v1/objects", headers=headers, json={"objects": [
            {"lon": -100.0, "lat": -30.0, "ts": time.time()}]})
        assert r.status_code == 202, r.text
        assert client.exists(names.events_key(tenant))
        plan = plan_of(server)
        back = sorted({owner(plan, px, py)[0], owner(plan, px - 300 * deg, py)[0]})
        assert len(back) == 2, back  # both halves, all the circle
        reply = command(server, other, {"t": "move", "partitions": back, "to": a_worker})
        assert reply is not None and reply["ok"], reply
        await wait_drained(client, workers)
        await put("c", px - 500 * deg)  # c falls behind b: [a, b]
        assert await wait_for(lambda: lists()[-1:] == [["a", "b"]], 20), lists()
        assert sorted(holders()) == sorted(workers), client.hgetall(hkey)
        assert lists() == [["a"], ["a", "b"], ["a", "c"], ["c", "a"], ["a", "b"]]
        await listener.close()


async def _knn_history(server: LiveServer) -> None:
    from tests.workers.oracle import knn_oracle, record_keywords

    rng = random.Random(4)
    client = sync_client(server.redis_url)
    workers = ["w0", "w1", "w2"]
    key = server.new_key()
    live: dict[str, tuple[float, float, list[str]]] = {}
    states: list[dict[str, tuple[float, float, list[str]]]] = [dict(live)]

    def reshape(i: int) -> None:
        px, py = KNN_SPECS[i % len(KNN_SPECS)]["point"]
        move_or_split(server, px, py, i, i % 2 == 0)

    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        headers = {"Authorization": f"Bearer {key}"}
        r = await http.post("/v1/subscriptions/batch", json={"subscriptions": KNN_SPECS},
                            headers=headers)
        assert r.status_code == 201, r.text
        ids = r.json()["ids"]
        listener = Listener(server.ws_url, key)
        await listener.connect()
        await listener.listen(ids)
        await asyncio.to_thread(reshape, 0)
        clock = 1000.0
        for step in range(400):
            clock += 1
            vid = f"v{rng.randint(0, 9)}"
            roll = rng.random()
            if roll < 0.5 and vid in live:  # a short move (often across lon 0)
                x, y = live[vid][0] + rng.uniform(-0.4, 0.4), live[vid][1] + rng.uniform(-.3, .3)
            elif roll < 0.85:
                x, y = rng.uniform(-2, 2), rng.uniform(-1, 1)
            else:  # far away: lists lose it, radii grow
                x, y = rng.uniform(40, 60), rng.uniform(20, 40)
            obj: dict[str, Any] = {"lon": x, "lat": y, "ts": clock,
                                   "keywords": rng.sample(["taxi", "bus", "car"],
                                                          rng.randint(0, 2))}
            if rng.random() < 0.85:
                obj["id"] = vid
            r = await http.post("/v1/objects", json={"objects": [obj]}, headers=headers)
            assert r.status_code == 202, r.text
            live[r.json()["ids"][0]] = (x, y, record_keywords(obj))
            states.append(dict(live))
            await wait_drained(client, workers)
            if step % 15 == 14:
                await asyncio.to_thread(reshape, step // 15 + 1)
                await wait_drained(client, workers)

        # A list is pushed when its membership or order changes (not for a distance alone):
        # lists are compared by their ids in order.
        def lists(sid: str) -> list[list[str]]:
            return [[n["id"] for n in m["neighbors"]] for m in listener.messages
                    if m["type"] == "knn" and m["subscription"] == sid]

        oracle = knn_oracle

        final = {sid: oracle(spec, live) for sid, spec in zip(ids, KNN_SPECS, strict=True)}
        assert await wait_for(lambda: all(lists(s) and lists(s)[-1] == final[s] for s in ids),
                              30), {s: (lists(s)[-1:], final[s]) for s in ids
                                    if not lists(s) or lists(s)[-1] != final[s]}
        for sid, spec in zip(ids, KNN_SPECS, strict=True):
            truth = [oracle(spec, st) for st in states]
            at = 0
            for got in lists(sid):
                # the first state from `at` on whose top-k this list is
                j = next((j for j in range(at, len(truth)) if truth[j] == got), None)
                assert j is not None, (sid, got, "is the top-k of no state after", at,
                                       truth[at])
                at = j
        await listener.close()
