"""A worker that crash-loops on one entry: only that entry goes to the dead letters; the healthy
entries read in the same batch are matched, exactly once (real worker processes, restarted as
`geoswarm dev` restarts them)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis

from app.core.redis import EmbeddedRedis
from app.pipeline import names, wire
from tests.conftest import LiveServer, auth
from tests.workers.harness import run_on_cluster
from tests.workers.oracle import Oracle
from tests.workers.test_pipeline import create_subs, random_objects, random_subs
from tests.workers.test_redis_faults import wait_exact

pytestmark = pytest.mark.slow


def crashing_entry(tenant: str) -> bytes:
    """A well-formed entry whose columns disagree in length: decoding accepts it, matching it
    raises, and the worker process dies (no handler expects this)."""
    batch = wire.ObjectBatch(
        tenant=tenant, sent_at=time.time(), plan_version=1, ids=["a", "b"],
        record_ids=["ra", "rb"], moving=[False, False], lon=[0.1], lat=[0.1, 0.2],
        ts=[1.0, 2.0], keywords=[["coffee"], ["tea"]], text=[None, None], props=[None, None],
        prev=[None, None], late=[False, False], exit_only=[False, False],
        decide_exit=[False, False])
    return wire.encode_entry(batch)


async def _crash_loop(server: LiveServer) -> None:
    rng = random.Random(5)
    tenant = "poisoned"
    key = server.new_key(tenant)
    oracle = Oracle()
    rdb = redis.Redis.from_url(server.redis_url)
    worker = server.procs["w0"]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        ids = await create_subs(client, key, random_subs(rng, 40), oracle)
        await asyncio.sleep(0.5)  # the worker holds the subscriptions
        movers = [f"m{i}" for i in range(10)]
        clock = [1_700_000_000.0]
        worker.send_signal(signal.SIGSTOP)  # so that it reads everything below in one batch
        for i in range(6):
            if i == 3:
                rdb.xadd(names.worker_stream("w0"), {b"m": crashing_entry(tenant)})
            objs = random_objects(rng, 50, movers, clock)
            r = await client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
            assert r.status_code == 202, r.text
            oracle.publish(objs, r.json()["ids"])
        worker.send_signal(signal.SIGCONT)
        crashes = 0
        deadline = time.monotonic() + 90
        while not rdb.xlen(names.DEAD_LETTER):
            assert time.monotonic() < deadline, "the poison entry was never dead-lettered"
            if server.procs["w0"].poll() is not None:
                crashes += 1
                server.start_worker("w0")
            await asyncio.sleep(0.2)
        assert crashes >= 2  # it really crashed, more than once
        await wait_exact(client, key, ids, oracle, timeout=60)
    dead = rdb.xrange(names.DEAD_LETTER)
    assert len(dead) == 1, dead  # the poison only
    assert dead[0][1][b"why"] == b"delivered too often"
    poison = wire.decode_entry(dead[0][1][b"m"])
    assert isinstance(poison, wire.ObjectBatch) and poison.record_ids == ["ra", "rb"]
    assert rdb.xpending(names.worker_stream("w0"), names.GROUP)["pending"] == 0
    rdb.close()


def test_only_the_entry_that_crashes_the_worker_is_dead_lettered(
        tmp_path: Path, embedded_redis: EmbeddedRedis) -> None:
    run_on_cluster(tmp_path, embedded_redis.url, 1, _crash_loop, GEOSWARM_MAX_DELIVERIES="2")
