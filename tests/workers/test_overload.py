"""Overload: when a worker's stream holds more than `max_backlog` entries, publishing answers
503 with Retry-After instead of queueing without limit; a refused publish changes nothing, and
once the worker catches up publishing works again, every accepted object matched once."""

from __future__ import annotations

import asyncio
import random
import signal
from pathlib import Path

import httpx
import pytest

from app.core.redis import EmbeddedRedis
from tests.conftest import LiveServer, auth
from tests.workers.harness import run_on_cluster
from tests.workers.oracle import Oracle
from tests.workers.test_pipeline import create_subs, random_objects, random_subs
from tests.workers.test_redis_faults import publish_once_accepted, wait_exact

pytestmark = pytest.mark.slow


async def _overload(server: LiveServer) -> None:
    rng = random.Random(3)
    key = server.new_key()
    oracle = Oracle()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        ids = await create_subs(client, key, random_subs(rng, 40), oracle)
        movers = [f"m{i}" for i in range(10)]
        clock = [1_700_000_000.0]
        worker = server.procs["w0"]
        worker.send_signal(signal.SIGSTOP)  # the worker stops keeping up
        refused = None
        for _ in range(40):
            objs = random_objects(rng, 20, movers, clock)
            r = await client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
            if r.status_code == 503:
                refused = r
                break
            assert r.status_code == 202, r.text
            oracle.publish(objs, r.json()["ids"])
            await asyncio.sleep(0.3)  # past the api's cache of the streams' lengths
        assert refused is not None, "the backlog never refused a publish"
        assert "max_backlog" in refused.json()["detail"]
        assert int(refused.headers["retry-after"]) >= 1
        worker.send_signal(signal.SIGCONT)
        # accepted again once the worker has caught up
        await publish_once_accepted(client, key, oracle,
                                    lambda: random_objects(rng, 20, movers, clock))
        await wait_exact(client, key, ids, oracle, timeout=60)


def test_backlog_bound_refuses_then_recovers(tmp_path: Path, embedded_redis: EmbeddedRedis
                                             ) -> None:
    run_on_cluster(tmp_path, embedded_redis.url, 1, _overload, GEOSWARM_MAX_BACKLOG="5")
