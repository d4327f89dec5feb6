"""Scale-out on Redis Cluster: a real 3-primary cluster (started from the embedded redis-server
binary), geoswarm pointed at one of its nodes, with the processes' cluster clients and
outboxes (`app.pipeline.outbox`). Exact against the brute-force oracle (every match once, the
HTTP replay too): the live path of range and keyword subscriptions, a worker SIGKILLed
mid-stream and a client resuming by cursor, partitions moving, splitting and merging (plan
changes staged and relayed in waves, `app.pipeline.control`) by commands and by the
coordinator's rounds, the failover of dead and stalled workers, continuous kNN (every list
pushed a true top-k, the last ones the oracle's), snapshot queries of every type across a move,
and dead-letter replays."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.redis import free_port, is_cluster, sync_client
from app.pipeline import names
from bench.redis_cluster import redis_cluster
from tests.conftest import LiveServer, start_server
from tests.workers import (
    test_balancer_e2e,
    test_balancing,
    test_failover,
    test_pipeline,
    test_snapshot,
)


@pytest.fixture(scope="module")
def on_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("redis-cluster")
    with redis_cluster(tmp / "redis") as url:
        s = start_server(tmp, url, workers=3, own_db=False)
        try:
            s.wait_workers(3)
            yield s
        finally:
            s.stop()


def test_a_cluster_node_is_told_from_a_standalone_redis(on_cluster: LiveServer,
                                                         embedded_redis: Any) -> None:
    """Told apart once per process by INFO cluster; a Redis that does not answer is taken for
    a standalone one (the caller meets it as it is)."""
    assert is_cluster(on_cluster.redis_url)
    assert not is_cluster(embedded_redis.url)
    assert not is_cluster(f"redis://127.0.0.1:{free_port()}/0")


def test_exact_delivery_on_a_redis_cluster(on_cluster: LiveServer) -> None:
    asyncio.run(test_pipeline._exact_workload(on_cluster, seed=23))
    client = sync_client(on_cluster.redis_url)
    try:
        # the keys are spread over the three nodes, and nothing is left to relay
        per_node = [client.dbsize(target_nodes=n) for n in client.get_primaries()]
        assert len(per_node) == 3 and all(n > 0 for n in per_node), per_node
        assert not any(client.xlen(names.outbox_stream(f"w{i}")) for i in range(3))
    finally:
        client.close()


def test_worker_sigkill_and_client_resume_on_a_redis_cluster(on_cluster: LiveServer) -> None:
    asyncio.run(test_pipeline._kill_and_resume(on_cluster))


def test_exact_delivery_while_partitions_move_on_a_redis_cluster(on_cluster: LiveServer) -> None:
    asyncio.run(test_balancing._moves_during_burst(on_cluster, seed=5))
    client = sync_client(on_cluster.redis_url)
    try:
        assert client.xlen(names.CONTROL_OUTBOX) == 0 and not client.exists(names.PLAN_PENDING)
    finally:
        client.close()


def test_continuous_knn_across_moves_on_a_redis_cluster(on_cluster: LiveServer) -> None:
    """kNN registrations, merges and resizes (their messages to workers relayed through the
    history groups' outboxes), with the partitions holding the query points moving and
    splitting: every subscription's last list equals the oracle's."""
    test_balancing.test_continuous_knn_across_moves(on_cluster)
    client = sync_client(on_cluster.redis_url)
    try:
        assert not any(client.xlen(o) for o in names.HISTORY_OUTBOXES)
        relayed = {f for key in client.scan_iter(match="gs:relay:*") for f in client.hkeys(key)}
        assert any(f.startswith(b"gs:out:{h") for f in relayed), relayed
    finally:
        client.close()


def test_every_knn_list_was_a_true_top_k_on_a_redis_cluster(on_cluster: LiveServer) -> None:
    test_balancing.test_every_knn_list_was_a_true_top_k(on_cluster)


def test_snapshot_queries_equal_the_oracle_across_a_move_on_a_redis_cluster(
        on_cluster: LiveServer) -> None:
    """Every query type of test_snapshot.py (parts sent straight to the workers' query
    streams, the plan history read after the sends), before and after a partition move."""
    rng = random.Random(8)
    key = on_cluster.new_key()
    data, clock = test_snapshot.Records(), [test_snapshot.t0()]
    with httpx.Client(base_url=on_cluster.base_url, timeout=60) as client:
        for _ in range(4):
            test_snapshot.publish(client, key, data, test_snapshot.random_objects(rng, 300, clock))
        test_snapshot.check_queries(client, key, data, rng, 30, clock[0])
        test_balancing.move_or_split(on_cluster, -1.0, 0.0, 1, False)
        for _ in range(2):
            test_snapshot.publish(client, key, data, test_snapshot.random_objects(rng, 300, clock))
        test_snapshot.check_queries(client, key, data, rng, 30, clock[0])


def test_dead_letters_replayed_on_a_redis_cluster(on_cluster: LiveServer) -> None:
    """A poison entry dead-lettered by its worker, replayed through the admin API in steps
    (its stream and the dead letters are in different slots): appended once, dead-lettered
    again under its new id, and the same replay sent again answers the same."""
    from tests.app import test_dead_letters as dl

    store = sync_client(on_cluster.redis_url)
    try:
        with httpx.Client(base_url=on_cluster.base_url, headers=on_cluster.admin(),
                          timeout=30) as client:
            dead = dl._dead_lettered(client, dl._poison(store))
            r = client.post(f"/v1/admin/dead-letters/{dead['id']}/replay")
            assert r.status_code == 200, r.text
            replayed = r.json()
            assert replayed["stream"] == names.worker_stream("w0")
            again = dl._dead_lettered(client, replayed["entry_id"])
            r = client.post(f"/v1/admin/dead-letters/{dead['id']}/replay")
            assert r.status_code == 200 and r.json() == replayed, r.text
            assert not store.xrange(names.worker_stream("w0"), "(" + replayed["entry_id"], "+")
            assert client.delete(f"/v1/admin/dead-letters/{again['id']}").status_code == 204
    finally:
        store.close()


def test_coordinator_rounds_move_partitions_on_a_redis_cluster(on_cluster: LiveServer) -> None:
    """The leader coordinator's rounds (its commands sent unfenced, checked against the lease
    by the workers) move and split partitions under a moving hotspot, exactly (last in this
    module: the tests above send their commands themselves)."""
    r = httpx.put(on_cluster.base_url + "/v1/admin/balancer", headers=on_cluster.admin(),
                  json={"period_s": 0.5, "beta": 1}, timeout=10)
    assert r.status_code == 200, r.text
    on_cluster.start_coordinator()
    assert test_balancer_e2e.wait_leader(on_cluster) is not None
    start = test_balancing.plan_of(on_cluster).version
    seen: dict[tuple[int, float], dict[str, Any]] = {}

    def during(i: int) -> None:  # the admin API lists the last rounds only: read them now
        time.sleep(0.1)
        if i % 4 == 3:
            rounds = test_balancer_e2e.balancer(on_cluster)["rounds"]
            seen.update(((r["round"], r["time"]), r) for r in rounds)

    asyncio.run(test_balancer_e2e._stream(on_cluster, 21, 40, during))
    actions = [seen[n]["action"] for n in sorted(seen)]
    assert any(a in ("move", "split") for a in actions), actions
    assert test_balancing.plan_of(on_cluster).version > start


def test_dead_and_stalled_workers_fail_over_on_a_redis_cluster(tmp_path: Path) -> None:
    """The failover scenario of test_failover.py (range, keyword and kNN subscriptions;
    without its snapshot count queries, not there yet on a cluster) on a cluster of its own:
    a worker
    SIGKILLed is failed over (its fence taken, an adopter, takeovers, the plan: staged and
    relayed in order), comes back and gets a partition; a worker SIGSTOPped past the dead-after
    time is failed over, commits nothing when it wakes, exits and rejoins; every match once."""
    with redis_cluster(tmp_path / "redis") as url:
        server = start_server(tmp_path, url, workers=3, own_db=False,
                              GEOSWARM_WORKER_DEAD_AFTER_S="2", GEOSWARM_BALANCE_PERIOD_S="3600")
        try:
            server.wait_workers(3)
            asyncio.run(test_failover._scenario(server))
        finally:
            server.stop()


def move_slot(url: str, slot: int) -> None:
    """Move `slot`, with its keys, to another primary, as a reshard does (IMPORTING /
    MIGRATING, MIGRATE, SETSLOT NODE on every primary)."""
    client = sync_client(url)
    try:
        src = client.nodes_manager.get_node_from_slot(slot)
        dst = next(n for n in client.get_primaries() if n.name != src.name)
        nodes = client.cluster_nodes()
        src_id, dst_id = nodes[src.name]["node_id"], nodes[dst.name]["node_id"]
        s, d = src.redis_connection, dst.redis_connection
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if keys:
            s.execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS", *keys)
        for n in client.get_primaries():
            n.redis_connection.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    finally:
        client.close()


def test_a_relay_to_a_slot_that_moved_is_sent_again(on_cluster: LiveServer) -> None:
    """A relay names each call's node from its client's slot map; when the slot has moved
    since (a reshard), the client's pipeline follows the MOVED reply all the same, and the
    call applies once."""
    from app.pipeline.outbox import Group, Relayer, op, slot_of

    url = on_cluster.redis_url
    client = sync_client(url)
    try:
        stream = "gs:test:{moving-slot}"
        slot = slot_of(stream)
        before = client.nodes_manager.get_node_from_slot(slot).name
        relayer = Relayer(client)
        group = Group(slot)
        group.add(op("XADD", stream, "*", "m", "x"), [stream.encode()])
        move_slot(url, slot)  # the client's slot map still names the old node
        assert client.nodes_manager.get_node_from_slot(slot).name == before
        (reply,) = relayer.relay("gs:out:{test}", "1-1", [group])
        assert reply is not None and b"-" in reply[0]
        assert client.xlen(stream) == 1
        assert client.nodes_manager.get_node_from_slot(slot).name != before
        assert relayer.relay("gs:out:{test}", "1-1", [group]) == [None]  # applied once
        assert client.xlen(stream) == 1
    finally:
        client.close()
