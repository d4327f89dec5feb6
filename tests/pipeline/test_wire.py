"""The typed wire: every message round-trips, keeps its short keys on the wire, and anything
that is not a valid message is refused at decoding (a poison entry never reaches a handler)."""

from __future__ import annotations

import msgspec
import pytest

from app.pipeline import wire


def batch(n: int = 3) -> wire.ObjectBatch:
    return wire.ObjectBatch(
        tenant="acme", sent_at=1.5, plan_version=4, ids=[f"o{i}" for i in range(n)],
        record_ids=[f"r{i}" for i in range(n)], moving=[i % 2 == 0 for i in range(n)],
        lon=[float(i) for i in range(n)], lat=[-float(i) for i in range(n)],
        ts=[10.0 + i for i in range(n)], keywords=[["a"], [], ["b", "c"]][:n],
        text=[None, "hi", None][:n], props=[None, {"p": 1}, None][:n],
        prev=[(0.5, 0.5), None, None][:n], late=[False] * n, exit_only=[False, True, False][:n],
        decide_exit=[True, True, False][:n])


def marked() -> wire.ObjectBatch:
    b = batch()
    b.no_match, b.no_match_token = [0, 2], 2**62
    return b


ENTRIES: list[wire.WorkerEntry] = [
    batch(),
    marked(),
    wire.SubsAdded(subs=[wire.SubscriptionCopy("s1", "acme", {"type": "keyword",
                                                              "keywords": ["a"]}, 9.0)],
                   plan_version=3),
    wire.SubsRemoved(ids=["s1", "s2"]),
    wire.Handoff(plan_version=5, sender="w0", partitions=["p3"], subs=[],
                 window=[(7, 1, [1, 2], [3, 4], [5, 6])],
                 moving={"acme": [("taxi", 1.0, 2.0, ["x"], 3.0)]}, stats={"p3": {"rows": {}}}),
]


@pytest.mark.parametrize("msg", ENTRIES, ids=lambda m: type(m).__name__)
def test_worker_entries_round_trip(msg: wire.WorkerEntry) -> None:
    assert wire.decode_entry(wire.encode_entry(msg)) == msg


def test_short_keys_on_the_wire() -> None:
    raw = msgspec.msgpack.decode(wire.encode_entry(batch()))
    assert raw["t"] == "obj"
    assert {"tn", "at", "v", "id", "rid", "mv", "kw", "txt", "pr", "xo", "dx"} <= set(raw)
    assert "tenant" not in raw and "exit_only" not in raw
    assert "nm" not in raw and "nmt" not in raw  # no marks: nothing on the wire
    assert {"nm": [0, 2], "nmt": 2**62}.items() <= msgspec.msgpack.decode(
        wire.encode_entry(marked())).items()
    cmd = msgspec.msgpack.decode(wire.encode_command(wire.ReduceCommand(
        round=3, to="w1", cost_ml=0.5, r_s=9.0, ids=["p9"], plan_version=2)))
    assert cmd == {"t": "reduce", "n": 3, "to": "w1", "c_ml": 0.5, "r_s": 9.0, "ids": ["p9"],
                   "version": 2, "deadline": None, "reply": None,
                   "leader": None}


COMMANDS: list[wire.Command] = [
    wire.RoundCommand(round=7),
    wire.ReduceCommand(round=1, to="w1", cost_ml=2.0, r_s=3.0, ids=["p5", "p6"],
                       plan_version=9, deadline=100.0, reply="tok"),
    wire.MoveCommand(partitions=["p1"], to="w2", ids=["p7"], plan_version=1),
    wire.SplitCommand(partition="p1", axis="y", at=12, moved="high", to="w0", ids=["a", "b"],
                      plan_version=1),
    wire.MergeCommand(ids=["p8"], plan_version=2),
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda m: type(m).__name__)
def test_commands_round_trip(cmd: wire.Command) -> None:
    assert wire.decode_command(wire.encode_command(cmd)) == cmd


def test_notifications_and_channels_round_trip() -> None:
    notes: list[wire.Notification] = [
        wire.HistoryAppended(tenant="acme", bucket=3, entries=[("s1", "0-0", "5-1", b"\x92")],
                             records={"r1": b'{"id":"o"}'}),
        wire.SubsChanged(tenant="acme", subs=["s1"]),
    ]
    for note in notes:
        assert wire.decode_notification(wire.encode_notification(note)) == note
    assert wire.decode_revoked(wire.encode_json(wire.KeyRevoked("k1"))) == wire.KeyRevoked("k1")
    gone = wire.SubsGone(expired=["s1"])
    assert wire.encode_json(gone) == b'{"expired":["s1"]}'
    assert wire.decode_gone(wire.encode_json(gone)) == gone
    refs = wire.MatchRefs(["r1", "r2"], bytes([0, 2]))
    assert msgspec.msgpack.decode(wire.encode_refs(refs)) == [["r1", "r2"], b"\x00\x02"]
    assert wire.decode_refs(wire.encode_refs(refs)) == refs


@pytest.mark.parametrize("data", [
    b"\xc1 not msgpack",
    msgspec.msgpack.encode({"t": "nope"}),
    msgspec.msgpack.encode({"t": "sub-"}),  # a required field is missing
    msgspec.msgpack.encode({"t": "sub-", "ids": "s1"}),  # a wrong type
    msgspec.msgpack.encode([1, 2, 3]),
])
def test_invalid_entries_are_refused(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        wire.decode_entry(data)
    with pytest.raises(msgspec.DecodeError):
        wire.decode_command(data)


def test_take_and_concat_keep_rows_together() -> None:
    b = batch()
    picked = b.take([2, 0])
    assert picked.ids == ["o2", "o0"] and picked.prev == [None, (0.5, 0.5)]
    assert picked.tenant == b.tenant and picked.plan_version == b.plan_version
    both = wire.ObjectBatch.concat([b, picked])
    assert len(both) == 5 and both.record_ids == ["r0", "r1", "r2", "r2", "r0"]
    assert wire.ObjectBatch.concat([b]) is b
    # marks name rows of their own entry: a new batch of rows has none
    m = marked()
    assert m.take([0, 1]).no_match == [] and wire.ObjectBatch.concat([m, m]).no_match == []


def test_keyword_summaries_round_trip() -> None:
    s = wire.KeywordSummary(token=5, plan_version=3, parts={"p1": ["a", "b"], "p2": None})
    assert wire.decode_summary(wire.encode_summary(s)) == s
    with pytest.raises(msgspec.DecodeError):
        wire.decode_summary(b"garbage")


def test_load_reports_round_trip_and_refuse_foreign_json() -> None:
    report = wire.LoadReport(worker="w0", round=3, at=1.0, num=12.0, r_m=30.0, plan_version=2,
                             partitions=[wire.PartitionLoad("p0", 100.0, 4.0, 30.0, 12.0)])
    raw = wire.encode_json(report)
    assert msgspec.json.decode(raw)["R"] == 30.0
    assert wire.decode_report(raw) == report
    for bad in (b"{", b"[]", b'{"worker": "w0"}', b'{"worker": "w0", "round": "x", "at": 1,'
                b' "num": 1, "R": 1}'):
        assert wire.decode_report(bad) is None


@pytest.mark.parametrize("msg", [
    wire.CommandReply(ok=True, worker="w1", action="split", version=8,
                      details={"split": {"partition": "p3", "axis": "x"}}),
    wire.CommandReply(ok=False, error="plan version 3 is stale (current 4)"),
    wire.AdminRequest(id="tok", kind="round"),
    wire.AdminRequest(id="tok", kind="split", partition="p7", axis="y", at=12),
    wire.AdminReply(status=202, round=41, action="move", details={"moved": ["p2"]}),
    wire.AdminReply(status=409, error="partition p2 already belongs to w1"),
])
def test_replies_and_admin_requests_round_trip(msg: wire.ListMessage) -> None:
    assert wire.decode_list_message(wire.encode_json(msg), type(msg)) == msg


def test_admin_requests_carry_only_what_they_say_and_garbage_reads_as_none() -> None:
    assert msgspec.json.decode(wire.encode_json(wire.AdminRequest(id="t", kind="move",
                                                                  partition="p1", to="w2"))) \
        == {"id": "t", "kind": "move", "partition": "p1", "to": "w2"}
    for kind in (wire.CommandReply, wire.AdminRequest, wire.AdminReply):
        assert wire.decode_list_message(b"not json", kind) is None
        assert wire.decode_list_message(b"[1, 2]", kind) is None
    assert wire.decode_list_message(b'{"id": "t", "kind": "split", "axis": "z"}',
                                    wire.AdminRequest) is None
    assert wire.decode_list_message(b'{"action": "move"}', wire.CommandReply) is None
