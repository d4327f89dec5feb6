"""A plan change staged and relayed through the control outbox (`app.pipeline.control`: how a
partition move is applied where the receivers' streams are in other hash slots than the plan),
against real Redis: the handoffs are written before the plan that gives their partitions, a
relay cut short before the plan is finished once by another relayer, no second change is
staged (nor a failover applied) meanwhile, and a change computed from an older plan is refused
without writing anything. A staged failover (`workers.failover`) is refused when the dead worker
started after the decision, and takes the fence before the takeovers and the plan. On a Redis
Cluster the relay goes in waves, one node's run of groups at a time (`Relayer.waves`)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import redis

from app.pipeline import names
from app.pipeline.control import PLAN_ACTIVATE_SCRIPT, PLAN_STAGE_SCRIPT, plan_stage_args
from app.pipeline.outbox import (
    Group,
    Relayer,
    decode_ops,
    group_ops,
    op,
    script_op,
    slot_of,
)
from bench.cluster import own_database
from workers.failover import FAILOVER_SCRIPT

RECEIVERS = ["w1", "w2"]
APPEND = "return redis.call('XADD', KEYS[1], '*', 'm', ARGV[1])"
KNN_HASH = names.knn_key("s1")
# The plan's channel, of this run alone: channels are the server's, not a database's, and the
# Redis 7 variant shares its server with the other tests' clusters and their plan changes.
CHANNEL = f"{names.PLAN_CHANNEL}:{secrets.token_hex(4)}"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A database of its own on the embedded Redis 6.2 and on Redis 7, holding plan 5."""
    c = redis.Redis.from_url(own_database(redis_url))
    c.flushdb()
    c.set(names.PLAN_KEY, json.dumps({"version": 5, "partitions": []}))
    c.rpush(names.PLAN_HISTORY, b'{"version":5}')
    yield c
    c.flushdb()
    c.close()


def stage(client: redis.Redis, expected: int = 5, version: int = 6) -> Any:
    handoffs = [(names.worker_stream(w), f"handoff to {w}".encode()) for w in RECEIVERS]
    holds = [(KNN_HASH, "_h:6:w1", "3")]
    keys, args = plan_stage_args(expected, json.dumps({"version": version}), version, 1.5,
                                 CHANNEL, handoffs, holds)
    return client.register_script(PLAN_STAGE_SCRIPT)(keys=keys, args=args)


def plan_version(client: redis.Redis) -> int:
    raw = client.get(names.PLAN_KEY)
    assert raw is not None
    return int(orjson.loads(raw)["version"])


def handoffs(client: redis.Redis) -> list[list[bytes]]:
    return [[f[b"m"] for _, f in client.xrange(names.worker_stream(w))] for w in RECEIVERS]


def test_handoffs_are_written_before_the_plan_and_a_cut_relay_finishes_once(
        client: redis.Redis) -> None:
    pubsub = client.pubsub()
    pubsub.subscribe(CHANNEL)
    assert pubsub.get_message(timeout=1)["type"] == "subscribe"  # type: ignore[index]
    assert stage(client)
    relayer = Relayer(client, [PLAN_ACTIVATE_SCRIPT])
    client.script_load(relayer.text)
    real_send = relayer._send
    seen: list[int] = []

    def cut(outbox: str, eid: str, groups: list[Group]) -> list[Any]:
        # the plan's group is the last one: every other group is applied before it
        assert groups[-1].slot == slot_of(names.PLAN_KEY)
        assert all(g.slot != slot_of(names.PLAN_KEY) for g in groups[:-1])
        seen.append(len(groups))
        real_send(outbox, eid, groups[:-1])
        raise redis.ConnectionError("the stager died here")

    relayer._send = cut  # type: ignore[method-assign]
    with pytest.raises(redis.ConnectionError):
        relayer.relay_all(names.CONTROL_OUTBOX)
    relayer._send = real_send  # type: ignore[method-assign]
    assert seen == [4]  # two streams, the kNN hash, the plan (distinct slots)
    # the receivers hold their handoffs, the plan is not replaced yet, and nothing else can be
    # staged, nor a failover applied, until the change is active
    assert handoffs(client) == [[b"handoff to w1"], [b"handoff to w2"]]
    assert client.hget(KNN_HASH, "_h:6:w1") == b"3"
    assert plan_version(client) == 5 and client.get(names.PLAN_PENDING) == b"6"
    assert stage(client) == 0
    assert failover_refused(client)
    assert pubsub.get_message(timeout=0.2) is None
    # another relayer (a worker starting, the coordinator) finishes it, once
    assert Relayer(client, [PLAN_ACTIVATE_SCRIPT]).relay_all(names.CONTROL_OUTBOX) == 1
    assert plan_version(client) == 6 and client.get(names.PLAN_PENDING) is None
    assert orjson.loads(client.lindex(names.PLAN_HISTORY, -1) or b"{}")["version"] == 6
    assert client.llen(names.PLAN_HISTORY) == 2
    assert handoffs(client) == [[b"handoff to w1"], [b"handoff to w2"]]
    message = pubsub.get_message(timeout=2)
    assert message is not None and message["data"] == b"6"
    assert relayer.relay_all(names.CONTROL_OUTBOX) == 0
    assert client.xlen(names.CONTROL_OUTBOX) == 0 and client.llen(names.PLAN_HISTORY) == 2
    # the next change is computed from plan 6
    assert stage(client, 6, 7) and relayer.relay_all(names.CONTROL_OUTBOX) == 1
    assert plan_version(client) == 7
    pubsub.close()


def test_a_change_from_an_older_plan_writes_nothing(client: redis.Redis) -> None:
    assert stage(client, expected=4) == 0
    assert client.xlen(names.CONTROL_OUTBOX) == 0 and client.get(names.PLAN_PENDING) is None
    assert handoffs(client) == [[], []] and plan_version(client) == 5


def failover_refused(client: redis.Redis) -> bool:
    """FAILOVER_SCRIPT with everything else as the coordinator read it, the lease its own."""
    client.set(names.LEASE_KEY, "coord")
    keys = [names.LEASE_KEY, names.PLAN_KEY, names.PLAN_HISTORY, names.fence_key("w0"),
            names.adopter_key("w0"), names.adopted_key("w1"), names.PLAN_PENDING,
            names.worker_stream("w1")]
    args = ["coord", "5", "", json.dumps({"version": 6}), "6", CHANNEL,
            '{"version":6}', "1000", "w0", "w1", "takeover"]
    return client.register_script(FAILOVER_SCRIPT)(keys=keys, args=args) == 0


@dataclass
class _Node:
    name: str


class _Nodes:
    def __init__(self, of_slot: dict[int, str]) -> None:
        self.of_slot = of_slot

    def get_node_from_slot(self, slot: int) -> _Node:
        return _Node(self.of_slot[slot])


class _ClusterLike:
    """What `Relayer.waves` reads of a cluster client: the node serving a slot."""

    def __init__(self, of_slot: dict[int, str]) -> None:
        self.nodes_manager = _Nodes(of_slot)


def test_waves_are_runs_of_groups_on_one_node() -> None:
    nodes = {1: "a", 2: "a", 3: "b", 4: "a", 5: "c", 6: "c"}
    relayer = Relayer(_ClusterLike(nodes))
    groups = [Group(s) for s in (1, 2, 3, 4, 5, 6)]
    assert [[g.slot for g in w] for w in relayer.waves(groups)] == [[1, 2], [3], [4], [5, 6]]
    # one Redis: one pipeline, whose connection applies the groups in order
    assert relayer.waves(groups[:1]) == [groups[:1]]
    assert Relayer(redis.Redis()).waves(groups) == [groups]


def test_a_run_of_unordered_script_calls_is_one_wave_over_every_node() -> None:
    """History appends of different subscriptions may apply in any order among themselves,
    never before the groups ahead of them (the records they name) nor after those behind."""
    nodes = {1: "a", 2: "b", 3: "a", 4: "b", 5: "c", 6: "a", 7: "a"}
    relayer = Relayer(_ClusterLike(nodes), [APPEND], unordered=[APPEND])
    records, forward = Group(1), Group(6)
    records.add(op("HSET", "r", "f", "v"), [b"r"])
    forward.add(op("XADD", "s", "*", "m", "x"), [b"s"])
    appends = []
    for slot in (2, 3, 4, 5):
        g = Group(slot)
        g.add(script_op(op("EVAL", APPEND, 2, "k", "c", "m")), [b"k", b"c"])
        appends.append(g)
    mixed = Group(7)  # a script call and a plain command: ordered
    mixed.add(script_op(op("EVAL", APPEND, 2, "k", "c", "m")), [b"k", b"c"])
    mixed.add(op("HSET", "r2", "f", "v"), [b"r2"])
    waves = relayer.waves([records, *appends, forward, mixed])
    assert [[g.slot for g in w] for w in waves] == [[1], [2, 3, 4, 5], [6, 7]]


def stage_failover(client: redis.Redis, starts: bytes | None, fence: bytes | None) -> Any:
    from app.geo.index import Grid, initial_plan
    from workers.failover import FAILOVER_STAGE_SCRIPT, failover_plan, failover_stage_args

    plan = initial_plan(Grid(nx=10, ny=10), ["w0", "w1", "w2"])
    plan.version = 5
    new, given = failover_plan(plan, "w0", ["w1", "w2"], iter(["n1", "n2"]))
    keys, args = failover_stage_args(names.LEASE_KEY, "coord", plan, new, fence, starts, "w0",
                                     given, 1.5)
    return client.register_script(FAILOVER_STAGE_SCRIPT)(keys=keys, args=args), given


def test_a_staged_failover_takes_the_fence_then_hands_over_then_activates(
        client: redis.Redis) -> None:
    """Refused when the dead worker started after the decision (its starts moved) or the lease
    is another's; applied in order otherwise: fence, adopter, takeovers, plan."""
    from workers.failover import FENCE_TAKE_SCRIPT

    client.set(names.LEASE_KEY, "coord")
    client.hset(names.WORKER_STARTS, "w0", 3)
    client.set(names.fence_key("w0"), 4)
    assert stage_failover(client, b"2", b"4")[0] == 0  # decided before its last start
    client.set(names.LEASE_KEY, "another")
    assert stage_failover(client, b"3", b"4")[0] == 0
    client.set(names.LEASE_KEY, "coord")
    assert client.xlen(names.CONTROL_OUTBOX) == 0 and client.get(names.PLAN_PENDING) is None
    entry, given = stage_failover(client, b"3", b"4")
    assert entry and client.get(names.PLAN_PENDING) == b"6"
    adopter = next(iter(given))
    relayer = Relayer(client, [PLAN_ACTIVATE_SCRIPT, FENCE_TAKE_SCRIPT])
    ((_, fields),) = client.xrange(names.CONTROL_OUTBOX)
    groups = group_ops(decode_ops(fields[b"m"]))
    first = {slot_of(names.fence_key("w0"))}
    assert {groups[0].slot} == first and groups[-1].slot == slot_of(names.PLAN_KEY)
    assert relayer.relay_all(names.CONTROL_OUTBOX) == 1
    assert client.get(names.fence_key("w0")) == b"5"
    assert client.get(names.adopter_key("w0")) == adopter.encode()
    assert client.smembers(names.adopted_key(adopter)) == {b"w0"}
    for w in given:
        assert client.xlen(names.worker_stream(w)) == 1
    assert plan_version(client) == 6 and client.get(names.PLAN_PENDING) is None


def test_a_fence_taken_back_meanwhile_is_left_alone(client: redis.Redis) -> None:
    """FENCE_TAKE_SCRIPT, the failover's first command, changes nothing when the fence is no
    longer the one read (the worker took it back at its start)."""
    from workers.failover import FENCE_TAKE_SCRIPT

    take = client.register_script(FENCE_TAKE_SCRIPT)
    client.set(names.fence_key("w0"), 5)
    keys = [names.fence_key("w0"), names.adopter_key("w0")]
    assert take(keys=keys, args=["4", "w1"]) == 0
    assert client.get(names.fence_key("w0")) == b"5" and not client.exists(keys[1])
    assert take(keys=keys, args=["5", "w1"]) == 6
    assert client.get(keys[1]) == b"w1"
