"""Failover of a dead worker (workers.failover), with real processes against the oracle.

A 3-worker cluster under load with a coordinator: one worker is SIGKILLed for good and its
partitions go to the live workers, its stream to an adopter; every match is delivered once,
snapshot queries answer exactly (the adopter answers for the dead worker's window). The worker
comes back (fence taken back, adoption ended) and a partition is moved to it. Then a worker
is SIGSTOPped past the dead-after time, failed over, and SIGCONTed: it must commit nothing
(its fence is gone), exit, and rejoin after a restart, still with every match once."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis

from app.core.redis import EmbeddedRedis, sync_client
from app.geo.index import Grid, Partition, Plan, initial_plan
from app.pipeline import names
from bench.knn_live import MOVE_SECONDS
from bench.pipeline import hop_counts, observed
from tests.conftest import LiveServer, auth
from tests.workers.harness import Listener, run_on_cluster, subscribe_listening, wait_for
from tests.workers.oracle import Oracle, knn_oracle, received_matches
from tests.workers.test_balancing import plan_of
from tests.workers.test_pipeline import (
    assert_exact,
    create_subs,
    publish,
    random_objects,
    random_subs,
)
from workers.failover import failover_plan

WORLD = [-180.0, -90.0, 180.0, 90.0]


# --- the plan (pure) ----------------------------------------------------------------------

def test_failover_plan_spreads_the_dead_workers_partitions() -> None:
    grid = Grid(nx=100, ny=100)
    plan = initial_plan(grid, ["w0", "w1", "w2"])
    # w1 owns three partitions (split its one in three), w0 one, w2 one
    ones = [p for p in plan.partitions if p.worker == "w1"]
    assert len(ones) == 1
    p = ones[0]
    mid = (p.x0 + p.x1) // 2
    parts = [q for q in plan.partitions if q.worker != "w1"] + [
        Partition("a", p.x0, p.y0, mid, p.y1, "w1"),
        Partition("b", mid + 1, p.y0, p.x1, (p.y0 + p.y1) // 2, "w1"),
        Partition("c", mid + 1, (p.y0 + p.y1) // 2 + 1, p.x1, p.y1, "w1")]
    plan = Plan(version=7, grid=grid, partitions=parts, members=["w0", "w1", "w2"])
    plan.validate()
    new, given = failover_plan(plan, "w1", ["w0", "w2"], iter(["n1", "n2", "n3"]))
    assert new.version == 8
    assert not [q for q in new.partitions if q.worker == "w1"]
    assert new.members == ["w0", "w1", "w2"]
    # fewest partitions first, ties by id: w0, w2, w0
    assert given == {"w0": ["n1", "n3"], "w2": ["n2"]}
    moved = {q.id: q for q in new.partitions if q.id in ("n1", "n2", "n3")}
    assert [(q.parent, q.prev_owner) for q in moved.values()] == [
        ("a", "w1"), ("b", "w1"), ("c", "w1")]
    assert [(q.x0, q.y0, q.x1, q.y1) for q in moved.values()] == [
        (q.x0, q.y0, q.x1, q.y1) for q in parts[-3:]]
    # everything else is unchanged, and the input plan is not touched
    assert [q for q in new.partitions if q.id not in moved] == parts[:-3]
    assert plan.version == 7 and [q.worker for q in plan.partitions[-3:]] == ["w1"] * 3


# --- a real cluster -----------------------------------------------------------------------

def owners(server: LiveServer) -> set[str]:
    return {p.worker for p in plan_of(server).partitions}


async def count_all(client: httpx.AsyncClient, key: str) -> int:
    r = await client.post("/v1/queries", json={"type": "count", "bbox": WORLD},
                          headers=auth(key))
    assert r.status_code == 200, r.text
    return int(r.json()["results"][0]["count"])


async def _scenario(server: LiveServer, knn: bool = True, counts: bool = True) -> None:
    """`knn`: with the kNN tenant; `counts`: with snapshot count queries (neither works on a
    Redis Cluster yet)."""
    rng = random.Random(11)
    store = sync_client(server.redis_url)
    server.start_coordinator()
    key = server.new_key()
    oracle = Oracle()
    published = 0
    movers = [f"car-{i}" for i in range(30)]
    clock = [time.time() - 900]  # inside the live window (one hour): snapshot queries see it

    # A second tenant with kNN subscriptions over moving objects only (the kNN state of the
    # events a dead worker held is not rebuilt, see docs/architecture.md)
    key_knn = server.new_key()
    knn_specs = [{"type": "knn", "point": [0.3, 0.2], "k": 4},
                 {"type": "knn", "point": [-1.5, 0.5], "k": 3},
                 {"type": "knn", "point": [2.0, -1.0], "k": 5, "keywords": ["taxi"]}]
    vehicles: dict[str, tuple[float, float, list[str]]] = {}

    async def burst(client: httpx.AsyncClient, batches: int) -> None:
        nonlocal published
        for _ in range(batches):
            objs = random_objects(rng, 80, movers, clock)
            await publish(client, key, objs, oracle)
            published += len(objs)
            moves = [{"id": f"v{i}", "lon": rng.uniform(-2.5, 2.5),
                      "lat": rng.uniform(-1.2, 1.2), "ts": clock[0],
                      "keywords": rng.sample(["taxi", "bus"], rng.randint(0, 2))}
                     for i in rng.sample(range(30), 10)]
            if knn:
                r = await client.post("/v1/objects", json={"objects": moves},
                                      headers=auth(key_knn))
                assert r.status_code == 202, r.text
                for m in moves:
                    vehicles[m["id"]] = (m["lon"], m["lat"], m["keywords"])
            await asyncio.sleep(0.05)

    def knn_last(sid: str) -> list[str] | None:
        assert knn_listener is not None
        msgs = [m for m in knn_listener.messages if m["type"] == "knn"
                and m["subscription"] == sid]
        return [n["id"] for n in msgs[-1]["neighbors"]] if msgs else None

    async def delivered(listener: Listener) -> None:
        await wait_for(lambda: len(listener.matches()) >= oracle.total(), 60)
        await asyncio.sleep(0.5)  # anything extra would arrive now
        assert_exact(received_matches(listener.messages), oracle)
        if not knn:
            return
        want = {sid: knn_oracle(spec, vehicles) for sid, spec in zip(knn_ids, knn_specs,
                                                                      strict=True)}
        assert await wait_for(lambda: all(knn_last(s) == want[s] for s in knn_ids), 30), (
            {s: (knn_last(s), want[s]) for s in knn_ids})

    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        await create_subs(client, key, random_subs(rng, 120), oracle)
        listener = Listener(server.ws_url, key)
        await listener.connect()
        await listener.listen(all=True)
        knn_ids: list[str] = []
        knn_listener: Listener | None = None
        if knn:
            knn_ids, knn_listener = await subscribe_listening(server, client, key_knn,
                                                              knn_specs)
        await burst(client, 6)

        # 1. w1 dies for good, in the middle of the load
        server.kill("w1", signal.SIGKILL)
        await burst(client, 6)  # routed to w1 until the failover plan is out
        assert await wait_for(lambda: "w1" not in owners(server), 30), plan_of(server)
        assert store.get(names.adopter_key("w1")) is not None
        await burst(client, 6)
        await delivered(listener)
        # w1's window answered by its adopter
        assert not counts or await count_all(client, key) == published
        rounds = httpx.get(server.base_url + "/v1/admin/balancer", headers=server.admin()
                           ).json()["rounds"]
        assert any(r.get("action") == "failover" for r in rounds), rounds
        # how long taking w1's partitions over held the survivors: on /metrics (heartbeats)
        assert await wait_for(lambda: observed(
            {}, hop_counts(server.base_url, MOVE_SECONDS, "side"), "takeover")[0] > 0, 15)

        # 2. w1 returns: its fence back, the adoption over; a partition moved to it works
        server.start_worker("w1")
        assert await wait_for(lambda: store.get(names.adopter_key("w1")) is None, 30)
        server.wait_workers(3)
        await burst(client, 4)
        part = next(p for p in plan_of(server).partitions if p.worker == "w0")
        r = await client.post("/v1/admin/rebalance", json={"partition": part.id, "to": "w1"},
                              headers=server.admin())
        assert r.status_code == 202, r.text
        assert "w1" in owners(server)
        await burst(client, 6)
        await delivered(listener)
        assert not counts or await count_all(client, key) == published

        # 3. w2 stops (a stalled machine) past the dead-after time: failed over while alive
        server.kill("w2", signal.SIGSTOP)
        await burst(client, 4)
        assert await wait_for(lambda: "w2" not in owners(server), 30), plan_of(server)
        server.kill("w2", signal.SIGCONT)
        # it finds its fence gone at its next transaction: commits nothing and exits
        assert server.procs["w2"].wait(30) == 3
        await burst(client, 4)
        server.start_worker("w2")
        assert await wait_for(lambda: store.get(names.adopter_key("w2")) is None, 30)
        await burst(client, 4)
        await delivered(listener)
        assert not counts or await count_all(client, key) == published
        await listener.close()
        if knn_listener is not None:
            await knn_listener.close()
    store.close()


@pytest.mark.slow
def test_dead_worker_fails_over_with_every_match_once(tmp_path: Path,
                                                     embedded_redis: EmbeddedRedis) -> None:
    run_on_cluster(tmp_path, embedded_redis.url, 3, _scenario, GEOSWARM_WORKER_DEAD_AFTER_S="2",
                   GEOSWARM_BALANCE_PERIOD_S="3600")



def test_an_idle_worker_whose_stream_was_taken_exits(tmp_path: Path,
                                                     embedded_redis: EmbeddedRedis) -> None:
    """A worker failed over while stalled may get nothing more to process, so no transaction
    tells it that its stream is another's: its maintenance round checks the fence and it
    exits (code 3), instead of running on, heartbeating, beside its stream's new reader."""
    from tests.conftest import start_server

    s = start_server(tmp_path, embedded_redis.url, workers=1)
    try:
        s.wait_workers(1)
        store = redis.Redis.from_url(s.redis_url)
        store.incr(names.fence_key("w0"))  # what a takeover does to the stream's fence
        assert s.procs["w0"].wait(30) == 3
        store.close()
    finally:
        s.stop()
