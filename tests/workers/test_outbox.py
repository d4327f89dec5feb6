"""A commit through the outbox (`workers.outbox`), against real Redis: the replies come back in
the order the commands were queued, as from one transaction; an entry whose relay was cut
short (after the commit, or after some of its slots) is finished by `relay_outbox` and every
command applies once; a relay run twice, or by two relayers, applies once; a failing command
fails alone, as in EXEC. The commit under the fence is the one the workers make."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from app.pipeline import names
from app.pipeline.outbox import (
    ENCODE_OPS_LUA,
    Relayer,
    decode_ops,
    encode_ops,
    group_ops,
    relay_mark_key,
    slot_of,
    slot_tags,
)
from bench.cluster import own_database
from workers.outbox import OutboxPipe, relay_outbox

# a script as a commit queues them: KEYS = a stream and a counter hash; appends, counts
APPEND = """
local id = redis.call('XADD', KEYS[1], '*', 'v', ARGV[1])
local n = redis.call('HINCRBY', KEYS[2], KEYS[1], 1)
return {id, n}
"""
OWN = "gs:w:w0"  # the stream committed on: its slot is the transaction's


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A database of its own on the embedded Redis 6.2 and on Redis 7."""
    c = redis.Redis.from_url(own_database(redis_url))
    c.flushdb()
    c.xgroup_create(OWN, names.GROUP, id="0", mkstream=True)
    yield c
    c.flushdb()
    c.close()


def far_keys() -> list[str]:
    """A record hash, a history stream and its counter (one slot: the script's two keys), a
    stream to forward to: three slots, none OWN's."""
    keys = ["far:record", "{h1}:history", "{h1}:count", "far:forward"]
    assert len({slot_of(k) for k in (OWN, *keys)}) == 4
    return keys


def commit(client: redis.Redis, relayer: Relayer, keys: list[str]) -> tuple[OutboxPipe, bytes]:
    """Read an entry of OWN and queue its 'effects' on `keys` with its XACK."""
    client.xadd(OWN, {"m": "x"})
    eid = client.xreadgroup(names.GROUP, "w0", {OWN: ">"}, count=1)[0][1][0][0]
    pipe = OutboxPipe(client, OWN, "w0", relayer)
    pipe.multi()
    pipe.hset(keys[0], "record", "r1")  # a record, first
    pipe.eval(APPEND, 2, keys[1], keys[2], "m1")
    pipe.xack(OWN, names.GROUP, eid)
    pipe.xadd(keys[3], {"m": "forwarded"})
    pipe.eval(APPEND, 2, keys[1], keys[2], "m2")
    return pipe, eid


def state(client: redis.Redis, keys: list[str]) -> dict[str, Any]:
    return {"record": client.hget(keys[0], "record"), "history": client.xlen(keys[1]),
            "count": client.hget(keys[2], keys[1]), "forwarded": client.xlen(keys[3]),
            "pending": client.xpending(OWN, names.GROUP)["pending"],
            "outbox": client.xlen(names.outbox_stream("w0"))}


APPLIED_ONCE = {"record": b"r1", "history": 2, "count": b"2", "forwarded": 1, "pending": 0,
                "outbox": 0}


def test_replies_in_queued_order_and_everything_applied_once(client: redis.Redis) -> None:
    keys = far_keys()
    relayer = Relayer(client, [APPEND])
    pipe, _ = commit(client, relayer, keys)
    out = pipe.execute()
    assert out[0] == 1 and out[2] == 1  # HSET, XACK
    assert out[1][1] == 1 and out[4][1] == 2  # the scripts ran in their order
    assert isinstance(out[3], bytes) and b"-" in out[3]  # the XADD's id
    assert state(client, keys) == APPLIED_ONCE
    assert client.hget(relay_mark_key(slot_of(keys[1])), names.outbox_stream("w0"))


# a script as the history script takes its many streams: counts its keys and arguments
COUNT_ALL = "return {#KEYS, #ARGV, ARGV[#ARGV]}"


def test_commands_and_scripts_of_many_arguments_are_relayed(client: redis.Redis) -> None:
    """Lua unpacks at most about 8 000 values: a batch's records in one HSET (20 000 fields)
    and a script call of 12 000 keys and arguments are relayed all the same, each with its
    one reply (the HSET's counted over its chunks)."""
    relayer = Relayer(client, [COUNT_ALL])
    client.xadd(OWN, {"m": "x"})
    eid = client.xreadgroup(names.GROUP, "w0", {OWN: ">"}, count=1)[0][1][0][0]
    pipe = OutboxPipe(client, OWN, "w0", relayer)
    pipe.multi()
    fields = {f"r{i}": f"v{i}" for i in range(20_000)}
    pipe.hset("far:record", mapping=fields)
    pipe.hdel("far:record", *(f"r{i}" for i in range(0, 20_000, 2)))
    pipe.eval(COUNT_ALL, 4_000, *(f"{{h1}}:k{i}" for i in range(4_000)),
              *(str(i) for i in range(8_000)))
    pipe.xack(OWN, names.GROUP, eid)
    out = pipe.execute()
    assert out[0] == 20_000 and out[1] == 10_000 and out[3] == 1
    assert out[2] == [4_000, 8_000, b"7999"]
    assert client.hlen("far:record") == 10_000
    assert client.hget("far:record", "r19999") == b"v19999"


@pytest.mark.parametrize("relayed_before", [0, 1, 2])
def test_a_relay_cut_short_is_finished_once(client: redis.Redis, relayed_before: int) -> None:
    """The commit stands; `relayed_before` of its slots were relayed when the relay stopped
    (a crash); `relay_outbox` finishes it, and running it again changes nothing."""
    keys = far_keys()
    relayer = Relayer(client, [APPEND])
    pipe, _ = commit(client, relayer, keys)
    real_send = relayer._send

    def cut(outbox: str, eid: str, groups: list[Any]) -> list[Any]:
        real_send(outbox, eid, groups[:relayed_before])
        raise redis.ConnectionError("the worker died here")

    relayer._send = cut  # type: ignore[method-assign]
    with pytest.raises(redis.ConnectionError):
        pipe.execute()
    relayer._send = real_send  # type: ignore[method-assign]
    after = state(client, keys)
    assert after["pending"] == 0 and after["outbox"] == 1  # committed, not relayed
    assert after["history"] == (2 if relayed_before >= 2 else 0)
    # a new process (another relayer of the same outbox) finishes it
    assert relay_outbox(client, "w0", Relayer(client, [APPEND])) == 1
    assert state(client, keys) == APPLIED_ONCE
    assert relay_outbox(client, "w0", relayer) == 0
    assert state(client, keys) == APPLIED_ONCE


def test_two_relayers_of_one_entry_apply_it_once(client: redis.Redis) -> None:
    keys = far_keys()
    relayer = Relayer(client, [APPEND])
    pipe, _ = commit(client, relayer, keys)
    real_send = relayer._send

    def stop(outbox: str, eid: str, groups: list[Any]) -> list[Any]:
        raise redis.ConnectionError("before any slot")

    relayer._send = stop  # type: ignore[method-assign]
    with pytest.raises(redis.ConnectionError):
        pipe.execute()
    relayer._send = real_send  # type: ignore[method-assign]
    outbox = names.outbox_stream("w0")
    (eid, fields), = client.xrange(outbox)
    groups = group_ops(decode_ops(fields[b"m"]))
    first = relayer.relay(outbox, eid, groups)
    second = Relayer(client, [APPEND]).relay(outbox, eid, groups)
    assert all(r is not None for r in first) and all(r is None for r in second)
    relay_outbox(client, "w0", relayer)  # the entry is still there: nothing applies again
    assert state(client, keys) == APPLIED_ONCE


def test_an_earlier_entry_is_not_applied_after_a_later_one(client: redis.Redis) -> None:
    """Marks are per slot and outbox: an entry older than the mark is skipped there."""
    keys = far_keys()
    relayer = Relayer(client, [APPEND])
    for _ in range(2):
        pipe, _ = commit(client, relayer, keys)
        pipe.execute()
    assert client.xlen(keys[1]) == 4
    mark = client.hget(relay_mark_key(slot_of(keys[1])), names.outbox_stream("w0"))
    ms, seq = mark.decode().split("-")
    older = f"{int(ms) - 1}-{seq}"
    g = [g for g in _groups_of(client, relayer, keys) if g.slot == slot_of(keys[1])]
    assert relayer.relay(names.outbox_stream("w0"), older, g) == [None]
    assert client.xlen(keys[1]) == 4


def _groups_of(client: redis.Redis, relayer: Relayer, keys: list[str]) -> list[Any]:
    pipe, _ = commit(client, relayer, keys)
    groups = sorted(pipe._far.values(), key=lambda g: g.at[0])
    pipe.reset()
    return groups


def test_a_failing_command_fails_alone(client: redis.Redis) -> None:
    keys = far_keys()
    client.set(keys[3], "not a stream")
    relayer = Relayer(client, [APPEND])
    pipe, _ = commit(client, relayer, keys)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        pipe.execute()
    assert client.hget(keys[0], "record") == b"r1" and client.xlen(keys[1]) == 2
    assert client.xpending(OWN, names.GROUP)["pending"] == 0
    assert client.xlen(names.outbox_stream("w0")) == 0


def test_an_unknown_script_is_refused_when_queued(client: redis.Redis) -> None:
    pipe = OutboxPipe(client, OWN, "w0", Relayer(client, [APPEND]))
    pipe.multi()
    with pytest.raises(ValueError, match="given to its relay"):
        pipe.eval("return 1", 1, "far:0")


def test_every_slot_has_a_mark_tag() -> None:
    tags = slot_tags()
    assert len(tags) == 16384
    assert all(slot_of("{" + t + "}") == s for s, t in enumerate(tags))


def test_commands_survive_their_encoding() -> None:
    ops = [[b"XADD", b"k", b"*", b"m", bytes(range(256))], [b"HSET", b"h", b"", b"1:2:"],
           [b"DEL"]]
    assert decode_ops(encode_ops(ops)) == ops
    assert decode_ops(b"") == []


def test_lua_writes_commands_as_python_reads_them(client: redis.Redis) -> None:
    """A script that appends to an outbox itself (`ENCODE_OPS_LUA`) writes what
    `decode_ops` reads."""
    ops = [[b"XADD", b"gs:w:{w1}", b"*", b"m", bytes(range(256))], [b"HDEL", b"h", b"f"]]
    raw = client.eval(ENCODE_OPS_LUA + "return encode_op({ARGV[1], ARGV[2], ARGV[3], ARGV[4], "
                      "ARGV[5]}) .. encode_op({ARGV[6], ARGV[7], ARGV[8]})", 0,
                      *ops[0], *ops[1])
    assert raw == encode_ops(ops) and decode_ops(raw) == ops
