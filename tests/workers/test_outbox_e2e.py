"""The workers committing through their outbox (`workers.outbox`, what a Redis Cluster needs),
end to end with real processes on a standalone Redis: the exactness scenarios of the pipeline,
balancing, failover and Redis-fault tests pass unchanged against the brute-force oracle (every
match once) while partitions move (plan changes staged and relayed, `app.pipeline.control`),
workers are SIGKILLed, Redis is SIGKILLed and restarted, and replies of applied transactions
and relays are cut."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.core.config import Settings
from app.core.redis import EmbeddedRedis
from app.pipeline import names
from app.pipeline.outbox import encode_ops, op, relay_mark_key, slot_of
from tests.conftest import LiveServer, start_server
from tests.workers import test_balancing, test_failover, test_pipeline, test_redis_faults
from tests.workers.harness import run_on_cluster
from tests.workers.test_redis_faults import CuttingProxy, own_redis  # noqa: F401 - fixture

OUTBOX = {"GEOSWARM_REDIS_OUTBOX": "1"}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory,
             embedded_redis: EmbeddedRedis) -> Iterator[LiveServer]:
    s = start_server(tmp_path_factory.mktemp("outbox"), embedded_redis.url, workers=3, **OUTBOX)
    s.wait_workers(3)
    yield s
    s.stop()


def test_exact_delivery(pipeline: LiveServer) -> None:
    asyncio.run(test_pipeline._exact_workload(pipeline, seed=17))
    client = redis.Redis.from_url(pipeline.redis_url)
    try:  # publishes and matches went through outboxes, and nothing is left to relay
        relayed = {f for key in client.scan_iter(match="gs:relay:*") for f in client.hkeys(key)}
        assert {names.outbox_stream(f"w{i}").encode() for i in range(3)} <= relayed
        assert any(f.startswith(b"gs:out:{t:") for f in relayed)
        assert not any(client.xlen(names.outbox_stream(f"w{i}")) for i in range(3))
        assert not any(client.xlen(k) for k in client.scan_iter(match="gs:out:{t:*"))
    finally:
        client.close()


def test_worker_sigkill_and_client_resume(pipeline: LiveServer) -> None:
    asyncio.run(test_pipeline._kill_and_resume(pipeline))


def test_continuous_knn_matches_oracle(pipeline: LiveServer) -> None:
    asyncio.run(test_pipeline._knn(pipeline))


def test_exact_delivery_while_partitions_move_split_and_merge(pipeline: LiveServer) -> None:
    asyncio.run(test_balancing._moves_during_burst(pipeline, seed=3))
    client = redis.Redis.from_url(pipeline.redis_url)
    try:  # every change was staged and relayed through the control outbox
        assert client.hexists(relay_mark(names.PLAN_KEY), names.CONTROL_OUTBOX)
        assert client.xlen(names.CONTROL_OUTBOX) == 0 and not client.exists(names.PLAN_PENDING)
    finally:
        client.close()


def relay_mark(key: str) -> str:
    return relay_mark_key(slot_of(key))


@pytest.mark.slow
def test_dead_worker_fails_over_with_every_match_once(tmp_path: Path,
                                                     embedded_redis: EmbeddedRedis) -> None:
    run_on_cluster(tmp_path, embedded_redis.url, 3, test_failover._scenario,
                   GEOSWARM_WORKER_DEAD_AFTER_S="2", GEOSWARM_BALANCE_PERIOD_S="3600",
                   **OUTBOX)


@pytest.mark.slow
def test_redis_sigkill_mid_burst_every_answer_is_exact(
        tmp_path: Path, own_redis: tuple[Settings, list[EmbeddedRedis]]) -> None:  # noqa: F811
    settings, servers = own_redis
    run_on_cluster(tmp_path / "cluster", servers[0].url, 2,
                   lambda server: test_redis_faults._killed_mid_burst(server, settings, servers),
                   **OUTBOX)


def test_replies_lost_after_commit_and_relay_apply_once(tmp_path: Path,
                                                        embedded_redis: EmbeddedRedis) -> None:
    """Every 5th transaction or script call (commits, relays, publishes) is applied and its
    reply cut, and sent again by nobody: the worker must finish from its outbox."""
    port = int(embedded_redis.url.rsplit(":", 1)[1].split("/", 1)[0])
    proxy = CuttingProxy(port, every=5, most=25, outage_s=0.0, only=None)
    try:
        run_on_cluster(tmp_path, f"redis://127.0.0.1:{proxy.port}/0", 2,
                       lambda server: test_redis_faults._lost_replies(server, proxy), **OUTBOX)
    finally:
        proxy.close()


def test_an_entry_left_in_a_tenant_outbox_is_relayed_by_the_expiry_round(
        pipeline: LiveServer) -> None:
    """As if an api process died between a publish's step and its relay: the entry waits in
    the tenant's outbox; the api process holding the expiry lock relays it, once."""
    client = redis.Redis.from_url(pipeline.redis_url)
    try:
        client.sadd(names.OUTBOX_TENANTS, "left-behind")
        client.xadd(names.tenant_outbox("left-behind"), {"m": encode_ops(
            [op("XADD", "probe:{p}", "*", "m", "1"), op("HINCRBY", "probe:count", "n", 1)])})
        deadline = time.monotonic() + 20
        while client.xlen(names.tenant_outbox("left-behind")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.5)  # more expiry rounds: nothing applies twice
        assert client.xlen("probe:{p}") == 1 and client.hget("probe:count", "n") == b"1"
        assert client.xlen(names.tenant_outbox("left-behind")) == 0
    finally:
        client.close()
