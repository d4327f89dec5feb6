"""SWARM end to end: the coordinator process drives real workers while objects stream in and a
WebSocket client receives the matches; the brute-force oracle must equal what arrives, with no
loss and no duplicate, while the balancer moves and splits partitions every other round under a
moving hotspot, while an operator moves and splits partitions through the admin API, and while
the leader coordinator is SIGKILLed and a standby takes over."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer, start_server
from tests.workers.harness import wait_for
from tests.workers.oracle import received_matches
from tests.workers.test_balancing import open_tenant, owner, plan_of
from tests.workers.test_pipeline import (
    WORDS,
    assert_exact,
    publish,
)

pytestmark = pytest.mark.slow


def hotspot_objects(rng: random.Random, n: int, centre: tuple[float, float],
                    movers: list[str], clock: list[float]) -> list[dict[str, Any]]:
    """Most objects in a small moving hotspot, the rest spread out; a third are moving
    objects (with enter/exit across partitions as the hotspot travels)."""
    objs = []
    for _ in range(n):
        if rng.random() < 0.8:
            lon, lat = rng.gauss(centre[0], 0.15), rng.gauss(centre[1], 0.08)
        else:
            lon, lat = rng.uniform(-2.5, 2.5), rng.uniform(-1.2, 1.2)
        clock[0] += 1.0
        obj: dict[str, Any] = {"lon": lon, "lat": lat, "ts": clock[0],
                               "keywords": rng.sample(WORDS, rng.randint(0, 2))}
        if rng.random() < 0.33:
            obj["id"] = rng.choice(movers)
        objs.append(obj)
    return objs


@pytest.fixture
def cluster(tmp_path: Any, embedded_redis: Any):  # type: ignore[no-untyped-def]
    # The embedded server only: the protocol is the same on Redis 7 (test_balancing.py and
    # test_pipeline.py run there too), and each of these takes tens of seconds.
    s = start_server(tmp_path, embedded_redis.url, workers=2, GEOSWARM_BALANCE_PERIOD_S="0.5",
                     GEOSWARM_BALANCE_BETA="1")
    s.wait_workers(2)
    yield s
    s.stop()


def balancer(server: LiveServer) -> dict[str, Any]:
    r = httpx.get(server.base_url + "/v1/admin/balancer", headers=server.admin(), timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def _stream(server: LiveServer, seed: int, batches: int, during: Any) -> None:
    """Publish `batches` batches along a hotspot moving west to east, calling
    `during(i)` (in a thread) after each batch; then check exact delivery."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        key, oracle, listener = await open_tenant(server, client, rng, 150)
        movers = [f"taxi-{i}" for i in range(25)]
        clock = [1_700_000_000.0]
        for i in range(batches):
            x = -1.5 + 3.0 * i / max(1, batches - 1)
            await publish(client, key, hotspot_objects(rng, 150, (x, 0.4 * x), movers, clock),
                          oracle)
            await asyncio.to_thread(during, i)
            await asyncio.sleep(0.05)
        await wait_for(lambda: len(listener.matches()) >= oracle.total(), 90)
        await asyncio.sleep(0.5)
        assert_exact(received_matches(listener.messages), oracle)
        await listener.close()


def test_balancer_rounds_move_and_split_under_a_moving_hotspot(cluster: LiveServer) -> None:
    cluster.start_coordinator()
    start = plan_of(cluster).version
    seen: dict[tuple[int, float], dict[str, Any]] = {}

    def during(i: int) -> None:
        # The admin API lists only the last rounds: read them while the hotspot moves, so
        # that a slow delivery check afterwards (idle rounds only) does not push them out.
        time.sleep(0.1)
        if i % 4 == 3:
            seen.update(((r["round"], r["time"]), r) for r in balancer(cluster)["rounds"])

    asyncio.run(_stream(cluster, 21, 60, during))
    seen.update(((r["round"], r["time"]), r) for r in balancer(cluster)["rounds"])
    rounds = [seen[n] for n in sorted(seen)]
    actions = [r["action"] for r in rounds]
    assert any(a in ("move", "split") for a in actions), rounds
    assert plan_of(cluster).version > start
    assert {r["decision"] for r in rounds} >= {"rebalance", "nothing"}


def test_admin_moves_and_splits_during_a_burst(cluster: LiveServer) -> None:
    cluster.start_coordinator()
    assert wait_leader(cluster) is not None
    r = httpx.put(cluster.base_url + "/v1/admin/balancer", json={"enabled": False},
                  headers=cluster.admin(), timeout=10)
    assert r.status_code == 200, r.text
    done: list[dict[str, Any]] = []

    def during(i: int) -> None:
        if i % 3 != 1:
            return
        plan = plan_of(cluster)
        x = -1.5 + 3.0 * i / 29
        pid, w = owner(plan, x, 0.4 * x)
        p = next(q for q in plan.partitions if q.id == pid)
        other = "w1" if w == "w0" else "w0"
        if i % 2 and p.width > 1:
            body: dict[str, Any] = {"split": pid, "axis": "x",
                                    "at": min(max(p.x0, 495 + i % 9), p.x1 - 1)}
        elif p.height > 1 and i % 2:
            body = {"split": pid, "axis": "y", "at": min(max(p.y0, 497), p.y1 - 1)}
        else:
            body = {"partition": pid, "to": other}
        r = httpx.post(cluster.base_url + "/v1/admin/rebalance", json=body,
                       headers=cluster.admin(), timeout=40)
        assert r.status_code == 202, (body, r.text)
        done.append(r.json())

    asyncio.run(_stream(cluster, 22, 30, during))
    assert {d["action"] for d in done} == {"move", "split"}, done
    # the partitions endpoint shows the result
    r = httpx.get(cluster.base_url + "/v1/admin/partitions", headers=cluster.admin(),
                  timeout=10)
    assert r.status_code == 200
    ids = {f["properties"]["id"] for f in r.json()["features"]}
    assert ids == {p.id for p in plan_of(cluster).partitions}


def test_coordinator_sigkill_standby_takes_over(cluster: LiveServer) -> None:
    cluster.start_coordinator("coord-a")
    assert wait_leader(cluster) is not None
    cluster.start_coordinator("coord-b")
    killed: list[str] = []

    def during(i: int) -> None:
        if i == 12:
            leader = wait_leader(cluster)
            assert leader is not None
            pid = int(leader.split(":")[1])
            name = next(n for n, p in cluster.procs.items() if p.pid == pid)
            cluster.kill(name, signal.SIGKILL)
            killed.append(name)

    asyncio.run(_stream(cluster, 23, 50, during))
    assert killed
    leader = wait_leader(cluster)
    assert leader is not None and int(leader.split(":")[1]) != cluster.procs[killed[0]].pid
    # rounds went on after the kill (period 0.5 s: takeover within two periods)
    rounds = balancer(cluster)["rounds"]
    assert rounds and time.time() - rounds[0]["time"] < 3.0
    nums = [r["round"] for r in rounds]
    assert len(set(nums)) == len(nums)  # never two leaders recording one round


def wait_leader(server: LiveServer, timeout: float = 30.0) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leader = balancer(server).get("leader")
        if leader:
            return str(leader)
        time.sleep(0.1)
    return None

