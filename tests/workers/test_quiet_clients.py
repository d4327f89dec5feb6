"""Quiet subscriptions and resumes: a client is slow only when what is unread for it is old.

A healthy client whose subscriptions see nothing for a long time stays connected; a client
resumes by cursor after any pause, receiving everything after its cursor once; a client that
falls behind the retention is told so (`gap`, with the cursor to continue from) and goes on."""

from __future__ import annotations

import asyncio
import random
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from app.pipeline import names, wire
from tests.conftest import LiveServer, auth, start_server
from tests.workers.harness import Listener, replay_all, wait_for
from tests.workers.oracle import Oracle, received_matches
from tests.workers.rawws import RawWebSocket

pytestmark = pytest.mark.slow

# quick versions of the defaults: the lag bound and the safety poll, a few times smaller
QUICK = {"GEOSWARM_WS_MAX_LAG_S": "2", "GEOSWARM_WS_POLL_S": "0.5"}


@pytest.fixture(scope="module")
def quick_server(tmp_path_factory: pytest.TempPathFactory, embedded_redis: Any
                 ) -> Any:
    s = start_server(tmp_path_factory.mktemp("quiet"), embedded_redis.url, workers=1, **QUICK)
    yield s
    s.stop()


def _publish(s: LiveServer, key: str, objs: list[dict[str, Any]]) -> list[str]:
    r = httpx.post(s.base_url + "/v1/objects", json={"objects": objs}, headers=auth(key),
                   timeout=60)
    assert r.status_code == 202, r.text
    ids: list[str] = r.json()["ids"]
    return ids


def _sub(s: LiveServer, key: str, spec: dict[str, Any]) -> str:
    r = httpx.post(s.base_url + "/v1/subscriptions", json=spec, headers=auth(key))
    assert r.status_code == 201, r.text
    sid: str = r.json()["id"]
    return sid


def test_idle_connected_client_stays_across_polls(quick_server: LiveServer) -> None:
    """Repro 1: listen to all, receive one match, then nothing for many poll periods and
    several times the lag bound: still connected, and the next match arrives."""
    s = quick_server
    key = s.new_key()
    sid = _sub(s, key, {"type": "range", "bbox": [10, 10, 11, 11]})

    async def run() -> Listener:
        listener = Listener(s.ws_url, key)
        await listener.connect()
        await listener.listen(all=True)
        _publish(s, key, [{"lon": 10.5, "lat": 10.5, "ts": 1.0}])
        assert await wait_for(lambda: len(listener.matches()) == 1, 15)
        await asyncio.sleep(6)  # 12 safety polls, 3 times ws_max_lag_s
        assert listener.closed_code is None
        _publish(s, key, [{"lon": 10.6, "lat": 10.6, "ts": 2.0}])
        assert await wait_for(lambda: len(listener.matches()) == 2, 15)
        await asyncio.sleep(3)  # and still connected after it
        assert listener.closed_code is None
        await listener.close()
        return listener

    listener = asyncio.run(run())
    got = [(m["subscription"], m["object"]["ts"]) for m in listener.matches()]
    assert got == [(sid, 1.0), (sid, 2.0)]
    assert [m["type"] for m in listener.messages] == ["match", "match"]


def test_resume_by_cursor_after_a_quiet_pause(quick_server: LiveServer) -> None:
    """Repro 2: receive one match, disconnect for longer than the lag bound, resume with the
    cursor: acknowledged, not closed, nothing repeated, and the next match arrives. The same
    after the quiet subscription's history stream has expired altogether."""
    s = quick_server
    key = s.new_key()
    sid = _sub(s, key, {"type": "range", "bbox": [20, 20, 21, 21]})
    client = redis.Redis.from_url(s.redis_url)

    async def resume(cursor: str, ts: float) -> tuple[Listener, str]:
        listener = Listener(s.ws_url, key)
        await listener.connect()
        ack = await listener.listen([sid], since={sid: cursor})
        assert ack["subscriptions"] == [sid]
        await asyncio.sleep(3)  # longer than ws_max_lag_s, several polls
        assert listener.closed_code is None
        assert listener.messages == []  # no gap, nothing sent twice
        _publish(s, key, [{"lon": 20.5, "lat": 20.5, "ts": ts}])
        assert await wait_for(lambda: len(listener.matches()) == 1, 15)
        assert listener.matches()[0]["object"]["ts"] == ts
        await listener.close()
        return listener, listener.cursors[sid]

    async def run() -> None:
        listener = Listener(s.ws_url, key)
        await listener.connect()
        await listener.listen([sid])
        _publish(s, key, [{"lon": 20.5, "lat": 20.5, "ts": 1.0}])
        assert await wait_for(lambda: len(listener.matches()) == 1, 15)
        cursor = listener.cursors[sid]
        await listener.close()
        await asyncio.sleep(3)
        _, cursor = await resume(cursor, 2.0)
        # a subscription quiet for longer than its history's lifetime: the stream is gone
        assert client.delete(names.history_key(sid)) == 1
        await resume(cursor, 3.0)

    asyncio.run(run())


def test_unlisten_while_listening_to_all_sticks(quick_server: LiveServer) -> None:
    """`unlisten` of one subscription on a listen-all connection: its later matches are not
    delivered, and what it already delivered is never replayed; a `listen` naming it again
    brings it back from then on."""
    s = quick_server
    key = s.new_key()
    a = _sub(s, key, {"type": "range", "bbox": [50, 50, 51, 51]})
    b = _sub(s, key, {"type": "range", "bbox": [52, 52, 53, 53]})

    def both(ts: float) -> None:
        _publish(s, key, [{"lon": 50.5, "lat": 50.5, "ts": ts},
                          {"lon": 52.5, "lat": 52.5, "ts": ts}])

    async def run() -> list[tuple[str, float]]:
        listener = Listener(s.ws_url, key)
        await listener.connect()
        await listener.listen(all=True)
        both(1.0)
        assert await wait_for(lambda: len(listener.matches()) == 2, 15)
        await listener.ws.send(orjson.dumps({"op": "unlisten", "subscriptions": [a]}).decode())
        await asyncio.sleep(0.5)
        both(2.0)
        assert await wait_for(lambda: len(listener.matches()) == 3, 15)
        await asyncio.sleep(2)  # several polls: nothing of `a` comes back
        await listener.listen([a])
        both(3.0)
        assert await wait_for(lambda: len(listener.matches()) == 5, 15)
        await asyncio.sleep(1)
        await listener.close()
        return sorted((m["subscription"], m["object"]["ts"]) for m in listener.matches())

    assert asyncio.run(run()) == sorted([(a, 1.0), (b, 1.0), (b, 2.0), (a, 3.0), (b, 3.0)])


def test_resume_beyond_retention_gets_gap_and_goes_on(tmp_path: Path,
                                                       embedded_redis: Any) -> None:
    """A cursor whose successors were trimmed: `gap` with the cursor to continue from, then
    every retained match in order, once; the HTTP replay says the same."""
    s = start_server(tmp_path, embedded_redis.url, workers=1, GEOSWARM_HISTORY_MAX_LEN="5")
    try:
        key = s.new_key()
        sid = _sub(s, key, {"type": "range", "bbox": [30, 30, 31, 31]})

        async def first() -> str:
            listener = Listener(s.ws_url, key)
            await listener.connect()
            await listener.listen([sid])
            _publish(s, key, [{"lon": 30.5, "lat": 30.5, "ts": 0.0}])
            assert await wait_for(lambda: len(listener.matches()) == 1, 15)
            await listener.close()
            return listener.cursors[sid]

        cursor = asyncio.run(first())
        for i in range(1, 260):  # one history entry each; the oldest are trimmed (MAXLEN ~)
            _publish(s, key, [{"lon": 30.5, "lat": 30.5, "ts": float(i)}])
        client = redis.Redis.from_url(s.redis_url)
        assert wait_until(lambda: client.xlen(names.history_key(sid)) < 259
                          and _last_ts(client, sid) == 259.0, 30)
        retained = _replay(s, key, sid)
        assert [m["type"] for m in retained] == ["match"] * len(retained)
        retained_ts = [m["object"]["ts"] for m in retained]
        assert retained_ts == sorted(retained_ts) and retained_ts[-1] == 259.0
        assert retained_ts[0] > 1.0  # the entries right after the cursor are gone

        async def again() -> list[dict[str, Any]]:
            listener = Listener(s.ws_url, key)
            await listener.connect()
            await listener.listen([sid], since={sid: cursor})
            assert await wait_for(lambda: len(listener.matches()) == len(retained), 15)
            await asyncio.sleep(1)
            assert listener.closed_code is None
            await listener.close()
            return listener.messages

        messages = asyncio.run(again())
        assert messages[0]["type"] == "gap" and messages[0]["subscription"] == sid
        assert [m["object"]["ts"] for m in messages[1:]] == retained_ts
        assert all(m["type"] == "match" for m in messages[1:])
        # the gap's cursor continues from the oldest retained match, with no further gap
        again_from_gap = _replay(s, key, sid, since=messages[0]["cursor"])
        assert [m["object"]["ts"] for m in again_from_gap] == retained_ts
        # the HTTP replay from the stale cursor: the same gap, then the same matches
        r = httpx.get(f"{s.base_url}/v1/subscriptions/{sid}/matches",
                      params={"since": cursor, "limit": 1000}, headers=auth(key))
        body = r.json()
        assert body["items"][0] == messages[0]
        assert [m["object"]["ts"] for m in body["items"][1:]] == retained_ts
    finally:
        s.stop()


@pytest.mark.parametrize("recent_bytes", ["0", "2000000", None],
                         ids=["read-back", "recent-too-small", "recent"])
def test_connected_client_behind_the_retention_gets_gap(tmp_path: Path, embedded_redis: Any,
                                                        recent_bytes: str | None) -> None:
    """A connected client that stops reading while its history is trimmed past its position:
    when it reads again it gets `gap` and then every retained match, never a silent loss.
    Unless the api kept all it could not send (its recent entries, 64 MiB by default, hold
    the 18 MB): then it gets every match, in order, once, and no gap."""
    recent = {} if recent_bytes is None else {"GEOSWARM_WS_RECENT_BYTES": recent_bytes}
    s = start_server(tmp_path, embedded_redis.url, workers=1, GEOSWARM_HISTORY_MAX_LEN="5",
                     GEOSWARM_WS_QUEUE_MAX="10", GEOSWARM_WS_SEND_TIMEOUT_S="60",
                     GEOSWARM_WS_PING_S="600",  # a client that reads nothing answers no ping
                     **recent)
    try:
        key = s.new_key()
        sid = _sub(s, key, {"type": "range", "bbox": [40, 40, 41, 41]})
        port = int(s.base_url.rsplit(":", 1)[1])
        ws = RawWebSocket("127.0.0.1", port, f"/v1/stream?token={key}")
        ws.send_text(orjson.dumps({"op": "listen", "subscriptions": [sid]}).decode())
        assert b"listening" in ws.recv_frame()[1]
        pad = "p" * 4000
        sent_ts: list[float] = []
        for i in range(150):  # about 18 MB of matches while the client reads nothing
            batch = [{"lon": 40.5, "lat": 40.5, "ts": i + j / 100, "props": {"pad": pad}}
                     for j in range(30)]
            _publish(s, key, batch)
            sent_ts += [o["ts"] for o in batch]
        client = redis.Redis.from_url(s.redis_url)
        assert wait_until(lambda: _last_ts(client, sid) == sent_ts[-1], 60)
        messages = _drain(ws, until=lambda ms: any(m.get("object", {}).get("ts") == sent_ts[-1]
                                                    for m in ms))
        ws.close()
        got = [m["object"]["ts"] for m in messages if m["type"] == "match"]
        assert got == sorted(got) and len(set(got)) == len(got)  # in order, once
        assert set(got) <= set(sent_ts) and got[-1] == sent_ts[-1]
        gaps = [i for i, m in enumerate(messages) if m["type"] == "gap"]
        if recent_bytes is None:
            assert not gaps and got == sent_ts
            return
        assert gaps, "matches were trimmed before they were read, the client must be told"
        missing = sorted(set(sent_ts) - set(got))
        assert missing
        after_last_gap = [m["object"]["ts"] for m in messages[gaps[-1]:] if m["type"] == "match"]
        assert max(missing) < after_last_gap[0]  # only what lies before a gap is missing
    finally:
        s.stop()


def test_slow_client_with_10000_subscriptions_catches_up_by_cursor(
        tmp_path: Path, embedded_redis: Any) -> None:
    """10 000 busy subscriptions: a client that stops reading is closed with 1013, resumes every
    subscription from its last cursor, and ends with exactly the oracle's matches."""
    s = start_server(tmp_path, embedded_redis.url, workers=2, GEOSWARM_WS_SEND_TIMEOUT_S="1",
                     GEOSWARM_WS_PING_S="600")  # closed for slowness, not as a dead peer
    try:
        key = s.new_key()
        side = 100  # 100 x 100 tiles of 0.05 degrees
        specs = [{"type": "range", "bbox": [i * 0.05, j * 0.05, i * 0.05 + 0.04,
                                            j * 0.05 + 0.04]}
                 for i in range(side) for j in range(side)]
        r = httpx.post(s.base_url + "/v1/subscriptions/batch", json={"subscriptions": specs},
                       headers=auth(key), timeout=120)
        assert r.status_code == 201, r.text
        sub_ids: list[str] = r.json()["ids"]
        # Each object lies in the middle of one tile: the expected matches follow from the
        # layout, and the brute-force oracle confirms that on a sample of every batch.
        expected: Counter[tuple[str, str, float, str]] = Counter()
        brute = Oracle(subs=dict(zip(sub_ids, specs, strict=True)))
        rng = random.Random(14)

        def tile_objects(ts: float, pad: str | None) -> list[dict[str, Any]]:
            out = []
            for n in range(side * side):
                i, j = divmod(n, side)
                obj: dict[str, Any] = {"lon": i * 0.05 + 0.02, "lat": j * 0.05 + 0.02,
                                       "ts": ts + n / 1e6}
                if pad:
                    obj["props"] = {"pad": pad}
                out.append(obj)
            return out

        def publish(objs: list[dict[str, Any]]) -> None:
            ids = _publish(s, key, objs)
            for n, (obj, oid) in enumerate(zip(objs, ids, strict=True)):
                expected[(sub_ids[n], oid, obj["ts"], "inside")] += 1
            sample = rng.sample(range(len(objs)), 20)
            check = Oracle(subs=brute.subs)
            check.publish([objs[n] for n in sample], [ids[n] for n in sample])
            assert check.expected == Counter({(sub_ids[n], ids[n], objs[n]["ts"], "inside"): 1
                                              for n in sample})

        port = int(s.base_url.rsplit(":", 1)[1])
        ws = RawWebSocket("127.0.0.1", port, f"/v1/stream?token={key}")
        ws.send_text('{"op": "listen", "all": true}')
        assert b"listening" in ws.recv_frame()[1]
        publish(tile_objects(1.0, None))  # one match each: every subscription has a cursor
        received = _drain(ws, until=lambda ms: len(ms) >= side * side)
        assert len(received) == side * side
        # now the client stops reading while every subscription gets 5 more matches
        pad = "x" * 600
        for t in range(2, 7):
            publish(tile_objects(float(t), pad))
        # Still not reading until every match is written and the server has had more than
        # its send timeout to push them: on a loaded machine the workers may still be behind
        # when the publishing ends, and a client that read again by then would keep up.
        client = redis.Redis.from_url(s.redis_url)
        for n in (0, side * side // 2, side * side - 1):
            assert wait_until(lambda n=n: _last_ts(client, sub_ids[n]) == 6.0 + n / 1e6, 120)
        time.sleep(3)
        ws.sock.settimeout(60)
        received += _drain(ws, until=None)  # what was sent before the server gave up on it
        # The close frame queues behind megabytes the client has not read, so the server may
        # drop the TCP connection before the client gets to it; it counts the close either way.
        assert ws.close_code in (1013, None)
        assert _closed_for_slowness(s) >= 1
        ws.close()
        cursors: dict[str, str] = {}
        for m in received:
            cursors[m["subscription"]] = m["cursor"]
        assert len(cursors) == side * side

        async def resume() -> list[dict[str, Any]]:
            """Resume every subscription from its last cursor, again after each 1013, as a
            client that keeps cursors does, until everything due has arrived."""
            want = sum(expected.values()) - len(received)
            messages: list[dict[str, Any]] = []
            for _attempt in range(5):
                listener = Listener(s.ws_url, key)
                await listener.connect()
                items = list(cursors.items())
                for a in range(0, len(items), 500):  # each listen op stays under 64 KiB
                    await listener.listen(since=dict(items[a:a + 500]))
                before = sum(m["type"] == "match" for m in messages)

                def done(lst: Listener = listener, before: int = before) -> bool:
                    return len(lst.matches()) + before >= want or lst.closed_code is not None

                await wait_for(done, 120)
                await asyncio.sleep(1)  # anything extra would show up as a duplicate
                await listener.close()
                messages += listener.messages
                cursors.update(listener.cursors)
                if listener.closed_code in (None, 1000):
                    break
                assert listener.closed_code == 1013
            return messages

        resumed = asyncio.run(resume())
        assert all(m["type"] == "match" for m in resumed)  # no gap within retention
        got = received_matches(received) + received_matches(resumed)
        assert got == expected
        assert max(Counter(got).values()) == 1
    finally:
        s.stop()


def _closed_for_slowness(s: LiveServer) -> float:
    text = httpx.get(s.base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('geoswarm_ws_closed_total{code="1013"}'))


def wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def _last_ts(client: redis.Redis, sid: str) -> float | None:
    """The ts of the newest match written to the subscription's history."""
    last = client.xrevrange(names.history_key(sid), count=1)
    if not last:
        return None
    fields = last[0][1]
    rids = wire.decode_refs(fields[b"m"]).record_ids
    tenant = fields[b"t"].decode()
    rec = client.hget(names.records_key(tenant, int(fields[b"b"])), rids[-1])
    return float(orjson.loads(rec)["ts"]) if rec else None


def _replay(s: LiveServer, key: str, sid: str, since: str | None = None
            ) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=s.base_url) as client:
            if since is None:
                return await replay_all(client, sid, auth(key))
            r = await client.get(f"/v1/subscriptions/{sid}/matches",
                                 params={"since": since, "limit": 10_000}, headers=auth(key))
            items: list[dict[str, Any]] = r.json()["items"]
            return items

    return [orjson.loads(m) if isinstance(m, bytes | str) else m for m in asyncio.run(run())]


def _drain(ws: RawWebSocket, until: Any) -> list[dict[str, Any]]:
    """Read frames (text frames split on newlines) until `until(messages)` holds, or, with
    None, until the server closes; the close code is kept on `ws.close_code`."""
    ws.sock.settimeout(60)
    messages: list[dict[str, Any]] = []
    while until is None or not until(messages):
        try:
            opcode, payload = ws.recv_frame()
        except (ConnectionError, OSError):
            break
        if opcode == 0x8:
            ws.close_code = struct.unpack("!H", payload[:2])[0]
            break
        if opcode == 0x1:
            messages += [orjson.loads(line) for line in payload.split(b"\n")]
    return messages
