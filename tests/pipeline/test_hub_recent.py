"""The hub's recent entries: what a connection could not take when its notification came (it
was behind on that subscription, or its queue was full) is delivered from memory, in order and
once, by the connection's pump; what is not all there any more is left to a read of the
history stream. No Redis here: a read the hub should not make fails the test."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import orjson

from app.core.config import Settings
from app.core.security import Principal
from app.pipeline import wire
from app.pipeline.hub import Connection, Hub

TENANT = "t1"


class Transport:
    def __init__(self) -> None:
        self.frames: list[str] = []

    async def send(self, frame: str) -> None:
        self.frames.append(frame)

    async def close(self, code: int, reason: str) -> None:
        pass


def hub(**settings: Any) -> Hub:
    state = types.SimpleNamespace(settings=Settings(**settings), redis=None, router=None)
    return Hub(state)  # type: ignore[arg-type]


def connect(h: Hub, subs: list[str], at: str = "100-0") -> Connection:
    conn = Connection(transport=Transport(), principal=Principal("k1", TENANT, False))
    h.register(conn)
    ms, seq = (int(x) for x in at.split("-"))
    h.listen(conn, {sub: (ms, seq, 0) for sub in subs}, ms, read=False)
    return conn


def note(*entries: tuple[str, str, str, list[str]]) -> wire.HistoryAppended:
    """A notification of entries (subscription, previous id, id, record ids), each record
    `{"id": rid}`."""
    records = {rid: orjson.dumps({"id": rid}) for *_, rids in entries for rid in rids}
    return wire.HistoryAppended(tenant=TENANT, bucket=1, records=records, entries=[
        (sub, prev, eid, wire.encode_refs(wire.MatchRefs(rids, bytes(len(rids)))))
        for sub, prev, eid, rids in entries])


def pump_round(h: Hub, conn: Connection) -> list[str]:
    """What a round of the connection's pump does before reading: the subscriptions it
    would read."""
    subs = sorted(conn.dirty)
    conn.dirty.clear()
    return h.catch_up(conn, subs, 1000)


def delivered(conn: Connection) -> list[tuple[str, str, str]]:
    """(subscription, cursor, record id) of what the outbox holds, emptying it."""
    lines, _ = conn.outbox.take()
    out = []
    for line in lines:
        m = orjson.loads(line)
        out.append((m["subscription"], m["cursor"], m["object"]["id"]))
    return out


def test_an_entry_that_comes_before_its_predecessor_is_sent_after_it() -> None:
    h = hub()
    conn = connect(h, ["s1"])
    # two workers' notifications, the later entry's first
    h.handle_history_appended(note(("s1", "101-0", "102-0", ["b"])))
    assert delivered(conn) == [] and conn.expect == {"s1": (102, 0)} and "s1" in conn.dirty
    h.handle_history_appended(note(("s1", "100-0", "101-0", ["a1", "a2"])))
    assert delivered(conn) == [("s1", "101-0:0", "a1"), ("s1", "101-0:1", "a2")]
    assert pump_round(h, conn) == []  # nothing to read
    assert delivered(conn) == [("s1", "102-0:0", "b")]
    assert conn.positions["s1"] == (102, 0, 0) and not conn.expect
    # and the next entry is pushed again at once
    h.handle_history_appended(note(("s1", "102-0", "103-0", ["c"])))
    assert delivered(conn) == [("s1", "103-0:0", "c")]


def test_a_full_queue_sends_the_rest_from_memory_at_the_pumps_pace() -> None:
    h = hub(ws_queue_max=3)
    conn = connect(h, ["s1", "s2"])
    h.handle_history_appended(note(("s1", "100-0", "101-0", ["a", "b"]),
                                   ("s2", "100-0", "101-1", ["c", "d"])))
    # s1 fitted; s2 did not, nor anything after it of s1
    assert delivered(conn) == [("s1", "101-0:0", "a"), ("s1", "101-0:1", "b")]
    h.handle_history_appended(note(("s1", "101-0", "102-0", ["e"])))
    assert [x[2] for x in delivered(conn)] == ["e"]
    conn.outbox.extend([b'{"x":1}', b'{"x":2}'])  # a queue the client has not taken yet
    h.handle_history_appended(note(("s1", "102-0", "103-0", ["f", "g"]),
                                   ("s2", "101-1", "103-1", ["h"])))
    conn.outbox.take()  # sent
    # the pump: one round within the queue's bound (3 messages), then the next
    assert pump_round(h, conn) == []
    first = delivered(conn)
    assert first == [("s1", "103-0:0", "f"), ("s1", "103-0:1", "g")]
    assert conn.dirty == {"s2"}
    assert pump_round(h, conn) == []
    assert delivered(conn) == [("s2", "101-1:0", "c"), ("s2", "101-1:1", "d"),
                               ("s2", "103-1:0", "h")]
    assert conn.positions["s2"] == (103, 1, 0)


def test_what_memory_no_longer_holds_is_read_from_the_history() -> None:
    h = hub(ws_recent_bytes=600)  # about one entry of these
    conn = connect(h, ["s1", "s2"])
    h.handle_history_appended(note(("s1", "150-0", "160-0", ["a"])))  # behind on s1
    h.handle_history_appended(note(("s2", "150-0", "160-1", ["b"])))  # behind on s2
    h.handle_history_appended(note(("s2", "160-1", "170-0", ["c"] * 3)))
    # s1's entry was forgotten to make room: it must be read; s2's chain is incomplete
    # (its first entry's predecessor never came): read as well, from where it is
    assert sorted(pump_round(h, conn)) == ["s1", "s2"]
    assert delivered(conn) == [] and conn.positions["s1"] == (100, 0, 0)


def test_a_mark_for_a_read_is_never_served_from_memory_alone() -> None:
    h = hub()
    conn = connect(h, ["s1"])
    h.handle_history_appended(note(("s1", "101-0", "102-0", ["b"])))
    conn.mark(["s1"])  # e.g. a reconnect of the notification channel: what is new is unknown
    assert pump_round(h, conn) == ["s1"]
    assert not conn.must_read and not conn.expect


def test_a_connection_listening_to_all_gets_each_new_subscription_from_its_first_entry(
) -> None:
    h = hub()
    conn = Connection(transport=Transport(), principal=Principal("k1", TENANT, False))
    h.register(conn)
    h.listen_all(conn, (99, 2**64 - 1, 2**64 - 1))  # from server time 100 on
    h.handle_history_appended(note(("s9", "0-0", "100-5", ["a"])))
    assert delivered(conn) == [("s9", "100-5:0", "a")]
    # a new subscription whose first entry after the start has not come yet
    h.handle_history_appended(note(("s8", "100-6", "100-7", ["c"])))
    assert delivered(conn) == []
    h.handle_history_appended(note(("s8", "0-0", "100-6", ["b"])))
    assert delivered(conn) == [("s8", "100-6:0", "b")]
    assert pump_round(h, conn) == []
    assert delivered(conn) == [("s8", "100-7:0", "c")]


def test_each_connection_gets_an_entry_once_whether_it_listens_to_all_or_to_it() -> None:
    """A connection listening to every subscription is both a listener of the tenant and,
    once it has had an entry of a subscription, of that subscription; another connection
    listens to that subscription alone. Each gets every entry once."""
    h = hub()
    everything = Connection(transport=Transport(), principal=Principal("k1", TENANT, False))
    h.register(everything)
    h.listen_all(everything, (99, 2**64 - 1, 2**64 - 1))
    h.handle_history_appended(note(("s1", "0-0", "100-1", ["a"])))
    assert delivered(everything) == [("s1", "100-1:0", "a")]
    one = connect(h, ["s1"], at="100-1")
    h.handle_history_appended(note(("s1", "100-1", "100-2", ["b"]),
                                   ("s2", "0-0", "100-3", ["c"])))
    assert delivered(everything) == [("s1", "100-2:0", "b"), ("s2", "100-3:0", "c")]
    assert delivered(one) == [("s1", "100-2:0", "b")]
    # the connection listening to all has had s1's entries: it is a listener of s1 as well
    assert h.by_sub["s1"] == {everything, one}
    h.handle_history_appended(note(("s1", "100-2", "100-4", ["d", "e"])))
    assert delivered(everything) == [("s1", "100-4:0", "d"), ("s1", "100-4:1", "e")]
    assert delivered(one) == [("s1", "100-4:0", "d"), ("s1", "100-4:1", "e")]
    assert everything.wake.is_set() and one.wake.is_set()
    # a subscription the other connection listens to before the one listening to all had any
    # entry of it
    h.listen(one, {"s3": (0, 0, 0)}, 100, read=False)
    h.handle_history_appended(note(("s3", "0-0", "100-5", ["f"])))
    assert delivered(everything) == [("s3", "100-5:0", "f")]
    assert delivered(one) == [("s3", "100-5:0", "f")]


def test_the_pump_sends_what_it_caught_up_before_reading() -> None:
    h = hub()
    conn = connect(h, ["s1"])
    transport = conn.transport
    assert isinstance(transport, Transport)
    h.handle_history_appended(note(("s1", "101-0", "102-0", ["b"])))
    h.handle_history_appended(note(("s1", "100-0", "101-0", ["a"])))

    async def pump_once() -> None:
        task = asyncio.create_task(h.pump(conn))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(transport.frames) >= 2 or (transport.frames
                                               and transport.frames[0].count("\n") == 1):
                break
        conn.close_soon(1000, "done")
        await task

    asyncio.run(pump_once())
    lines = [orjson.loads(x) for f in transport.frames for x in f.split("\n")]
    assert [m["object"]["id"] for m in lines] == ["a", "b"]


def test_a_cursor_inside_an_entry_gets_the_rest_of_it_before_the_next() -> None:
    """A client resumed from the first of entry 101-0's two messages: the notification of the
    next entry, which names 101-0 as its predecessor, must not be pushed (the second message
    would be skipped for good); the subscription is read from its history first. Once a read
    has left the position at an entry's end, entries are pushed again."""
    h = hub()
    conn = Connection(transport=Transport(), principal=Principal("k1", TENANT, False))
    h.register(conn)
    h.listen(conn, {"s1": (101, 0, 0)}, 101, inside=["s1"])
    assert pump_round(h, conn) == ["s1"]  # the listen's own read
    h.listen(conn, {"s1": (101, 0, 0)}, 101)  # listened again, without a cursor: as it was
    assert pump_round(h, conn) == ["s1"]
    h.handle_history_appended(note(("s1", "101-0", "102-0", ["c"])))
    assert delivered(conn) == [] and conn.positions["s1"] == (101, 0, 0)
    assert pump_round(h, conn) == ["s1"]  # read from the history, not from memory
    assert delivered(conn) == []
    # what `deliver` does once its read rendered the rest of 101-0 and 102-0
    conn.positions["s1"] = (102, 0, 0)
    conn.inside.discard("s1")
    h.handle_history_appended(note(("s1", "102-0", "103-0", ["d"])))
    assert delivered(conn) == [("s1", "103-0:0", "d")]
