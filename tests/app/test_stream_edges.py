"""WebSocket edges against the in-process api: the Origin check, `unlisten`, and the byte
bound of a connection's in-memory queue (a client that stops reading while big matches arrive
is served from the history streams instead, and still gets every match once, in order)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from app.core.metrics import WS_MESSAGES
from app.core.redis import EmbeddedRedis
from app.pipeline import names
from app.pipeline.hub import Connection
from tests.app.asgiws import AsgiWebSocket
from tests.app.httpapi import Api
from tests.conftest import InProcessServer, start_inprocess

Messages = list[dict[str, Any]]


def collect(ws: AsgiWebSocket, until: Callable[[Messages], bool], timeout: float = 30
            ) -> Messages:
    """Read frames until `until(messages)` holds."""
    messages: Messages = []
    while not until(messages):
        got = ws.receive(timeout=timeout)
        assert got or ws.close_code is None, (ws.close_code, ws.close_reason)
        messages += got
    return messages


def nothing_arrives(ws: AsgiWebSocket, wait_s: float = 1.0) -> bool:
    try:
        ws.receive(timeout=wait_s)
    except TimeoutError:
        return True
    return False


def ack(ws: AsgiWebSocket, op: str, subs: list[str]) -> list[str]:
    """Send a listen / unlisten; the subscriptions its `listening` answer names."""
    ws.send({"op": op, "subscriptions": subs})
    (reply,) = ws.receive()
    assert reply["type"] == "listening", reply
    return list(reply["subscriptions"])


# --- Origin ---------------------------------------------------------------------------------

ALLOWED = ["https://maps.example.com", "https://ops.example.com"]


@pytest.fixture(scope="module")
def origin_app(tmp_path_factory: pytest.TempPathFactory, embedded_redis: EmbeddedRedis
               ) -> Iterator[InProcessServer]:
    with start_inprocess(tmp_path_factory.mktemp("origins"), embedded_redis.url,
                         GEOSWARM_WS_ALLOWED_ORIGINS=" , ".join(ALLOWED),
                         GEOSWARM_TENANT_MAX_CONNECTIONS="1") as s:
        yield s


def test_origin_not_allowed_is_closed_1008_and_takes_no_slot(origin_app: InProcessServer
                                                              ) -> None:
    s = origin_app
    tenant = "origins"
    key = s.new_key(tenant)
    for origin in ("https://evil.example", "https://maps.example.com.evil.example",
                   "http://maps.example.com", "null"):
        ws = AsgiWebSocket(s, query=f"token={key}", headers={"Origin": origin}).connect()
        assert ws.wait_closed(5) == 1008
        assert ws.close_reason == f"origin {origin} is not allowed"
        ws.close()
    client = redis.Redis.from_url(s.redis_url)
    try:
        # refused before the tenant's connection quota (of 1) was charged
        assert client.zcard(names.ws_slots_key(tenant)) == 0
    finally:
        client.close()
    # an unknown key is refused for the key, whatever its Origin
    ws = AsgiWebSocket(s, query="token=gs_unknown", headers={"Origin": ALLOWED[0]}).connect()
    assert ws.wait_closed(5) == 1008 and "API key" in ws.close_reason
    ws.close()


@pytest.mark.parametrize("headers", [{"Origin": ALLOWED[0]}, {"Origin": ALLOWED[1]}, {}],
                         ids=["first", "second", "no-origin"])
def test_allowed_origin_or_none_is_served(origin_app: InProcessServer,
                                          headers: dict[str, str]) -> None:
    key = origin_app.new_key()
    ws = AsgiWebSocket(origin_app, query=f"token={key}", headers=headers).connect()
    try:
        assert ack(ws, "listen", []) == []
    finally:
        ws.close()


# --- unlisten -------------------------------------------------------------------------------

def test_unlisten_stops_delivery_until_listened_again(inprocess_worker: InProcessServer
                                                       ) -> None:
    s = inprocess_worker
    api = Api(s)
    a = api.subscribe({"type": "range", "bbox": [70, 70, 71, 71]})["id"]
    b = api.subscribe({"type": "range", "bbox": [72, 72, 73, 73]})["id"]

    def publish(ts: float) -> None:
        api.publish([{"lon": 70.5, "lat": 70.5, "ts": ts}, {"lon": 72.5, "lat": 72.5, "ts": ts}])

    def retained(sub: str, n: int) -> None:
        api.wait_matches(sub, lambda ms: len(ms) == n)

    ws = AsgiWebSocket(s, query=f"token={api.key}").connect()
    try:
        assert ack(ws, "listen", [a, b]) == sorted([a, b])
        assert ack(ws, "unlisten", [a]) == [b]
        # unlistening what is not listened to, or does not exist, changes nothing
        assert ack(ws, "unlisten", [a, "s_does_not_exist"]) == [b]
        publish(1.0)
        got = collect(ws, lambda ms: len(ms) >= 1)
        assert [(m["subscription"], m["object"]["ts"]) for m in got] == [(b, 1.0)]
        retained(a, 1)  # a matched meanwhile...
        assert nothing_arrives(ws)  # ...and was not delivered
        # listened to again without a cursor: from now on, nothing from the pause
        assert ack(ws, "listen", [a]) == sorted([a, b])
        publish(2.0)
        got = collect(ws, lambda ms: len(ms) >= 2)
        assert sorted((m["subscription"], m["object"]["ts"]) for m in got) == sorted(
            [(a, 2.0), (b, 2.0)])
        assert nothing_arrives(ws)
        # unlisten everything: the connection stays open, and quiet
        assert ack(ws, "unlisten", [a, b]) == []
        publish(3.0)
        retained(a, 3)
        retained(b, 3)
        assert nothing_arrives(ws)
        assert ws.close_code is None
    finally:
        ws.close()
        api.close()


# --- the byte bound of the in-memory queue --------------------------------------------------

QUEUE_BYTES = 64 * 1024
PAD = "p" * 3500  # props of about 3.5 KB: a match message is about 3.6 KB


@pytest.fixture(scope="module", params=["recent", "read"])
def byte_bound_app(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   embedded_redis: EmbeddedRedis) -> Iterator[InProcessServer]:
    """A small byte bound, a message bound far away, and patience with a slow client (it is
    neither closed for a send that does not complete nor for lag, and nothing is trimmed).
    What does not fit in the queue is kept in the api (`recent`) or read back (`read`)."""
    recent = {} if request.param == "recent" else {"GEOSWARM_WS_RECENT_BYTES": "0"}
    with start_inprocess(tmp_path_factory.mktemp("queue-bytes"), embedded_redis.url, **recent,
                         GEOSWARM_WS_QUEUE_MAX_BYTES=str(QUEUE_BYTES),
                         GEOSWARM_WS_QUEUE_MAX="50000", GEOSWARM_WS_SEND_TIMEOUT_S="300",
                         GEOSWARM_WS_MAX_LAG_S="600", GEOSWARM_HISTORY_MAX_AGE_S="600") as s:
        s.start_worker()
        yield s


def queued_bytes(s: InProcessServer, tenant: str) -> int:
    def read() -> int:
        conns: list[Connection] = [c for c in s.app.state.gs.hub.conns
                                   if c.principal.tenant == tenant]
        return sum(c.outbox.bytes for c in conns)

    return int(s.portal.call(read))


def test_big_matches_for_a_client_that_does_not_read_stay_within_the_byte_bound(
        byte_bound_app: InProcessServer) -> None:
    s = byte_bound_app
    api = Api(s)
    sid = api.subscribe({"type": "range", "bbox": [60, 60, 61, 61]})["id"]
    path = "recent" if s.app.state.gs.settings.ws_recent_bytes else "read"
    other = "read" if path == "recent" else "recent"
    before = {p: WS_MESSAGES.labels(p)._value.get() for p in (path, other)}
    history = redis.Redis.from_url(s.redis_url)
    # a client that holds one unread frame and then reads nothing: the server's sends block
    ws = AsgiWebSocket(s, query=f"token={api.key}", max_frames=1).connect()
    try:
        assert ack(ws, "listen", [sid]) == [sid]
        sent: list[float] = []
        peak = 0
        for i in range(50):  # 200 matches, about 720 KB: 11 times the bound
            batch: Messages = [{"lon": 60.5, "lat": 60.5, "ts": i + j / 10,
                                "props": {"pad": PAD}} for j in range(4)]
            api.publish(batch)
            sent += [o["ts"] for o in batch]
            # one history entry (about 15 KB) per publish: entries that fit in the queue
            wait_entries(history, sid, i + 1)
            peak = max(peak, queued_bytes(s, api.tenant))
        for _ in range(20):  # the last notifications reach the hub
            peak = max(peak, queued_bytes(s, api.tenant))
        assert QUEUE_BYTES // 2 < peak <= QUEUE_BYTES
        # the client reads again: everything, once, in order
        got = collect(ws, lambda ms: len(ms) >= len(sent), timeout=60)
        assert [m["type"] for m in got] == ["match"] * len(sent)
        assert [m["object"]["ts"] for m in got] == sent
        assert all(m["object"]["props"] == {"pad": PAD} for m in got)
        assert nothing_arrives(ws)
        # what did not fit came from the api's recent entries, or was read back from the
        # history stream, as configured
        assert WS_MESSAGES.labels(path)._value.get() > before[path]
        assert WS_MESSAGES.labels(other)._value.get() == before[other]
        assert ws.close_code is None
    finally:
        ws.close()
        api.close()
        history.close()


def wait_entries(client: redis.Redis, sid: str, n: int, timeout: float = 30) -> None:
    """Wait until the subscription's history holds `n` entries."""
    deadline = time.monotonic() + timeout
    while client.xlen(names.history_key(sid)) != n:
        assert time.monotonic() < deadline, f"the history of {sid} never held {n} entries"
        time.sleep(0.02)
