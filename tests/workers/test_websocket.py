"""WebSocket protocol edges: bad keys, oversized messages, revocation, malformed ops, slow
clients (1013), peers that stop answering pings, and poison stream entries (dead-letter).
(Origins, `unlisten` and the queue's byte bound: tests/app/test_stream_edges.py.)"""

from __future__ import annotations

import asyncio
import signal
import struct
import time
from pathlib import Path

import httpx
import orjson
import pytest
import redis
import websockets

from app.pipeline import names
from tests.conftest import LiveServer, auth, start_server
from tests.workers.harness import Listener, wait_for
from tests.workers.rawws import RawWebSocket

pytestmark = pytest.mark.slow


async def _close_code(url: str, **kw: object) -> int | None:
    async with websockets.connect(url, **kw) as ws:  # type: ignore[arg-type]
        try:
            await asyncio.wait_for(ws.recv(), 5)
        except websockets.ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd else None
    return None


def test_bad_key_closes_1008(server: LiveServer) -> None:
    assert asyncio.run(_close_code(server.ws_url + "/v1/stream?token=nope")) == 1008
    assert asyncio.run(_close_code(server.ws_url + "/v1/stream")) == 1008


def test_oversized_message_closes_1009(server: LiveServer, tenant_key: str) -> None:
    async def run() -> int | None:
        async with websockets.connect(f"{server.ws_url}/v1/stream?token={tenant_key}") as ws:
            await ws.send("x" * (70 * 1024))
            try:
                await asyncio.wait_for(ws.recv(), 5)
            except websockets.ConnectionClosed as exc:
                return exc.rcvd.code if exc.rcvd else None
        return None

    assert asyncio.run(run()) == 1009


def test_malformed_ops_get_errors_not_disconnects(server: LiveServer, tenant_key: str) -> None:
    other = server.new_key()
    foreign = httpx.post(server.base_url + "/v1/subscriptions", headers=auth(other),
                         json={"type": "keyword", "keywords": ["a"]}).json()["id"]

    async def run() -> list[dict[str, object]]:
        out = []
        async with websockets.connect(f"{server.ws_url}/v1/stream?token={tenant_key}") as ws:
            for msg in ["{", "[]", '{"op": "dance"}', '{"op": "listen", "subscriptions": 3}',
                        orjson.dumps({"op": "listen", "subscriptions": [foreign]}).decode(),
                        '{"op": "listen", "subscriptions": [], "since": {"x": 1}}']:
                await ws.send(msg)
                out.append(orjson.loads((await asyncio.wait_for(ws.recv(), 5)).split("\n")[0]))
        return out

    replies = asyncio.run(run())
    assert [r["type"] for r in replies[:4]] == ["error"] * 4
    # another tenant's subscription is unknown here
    assert replies[4]["type"] == "error" and replies[4]["code"] == "not_found"
    assert replies[5]["type"] == "error"


def test_revoked_key_closes_open_socket(server: LiveServer) -> None:
    r = httpx.post(server.base_url + "/v1/admin/keys", json={"tenant": "rev"},
                   headers=server.admin())
    key, key_id = r.json()["key"], r.json()["id"]

    async def run() -> int | None:
        listener = Listener(server.ws_url, key)
        await listener.connect()
        await listener.listen(all=True)
        assert httpx.delete(f"{server.base_url}/v1/admin/keys/{key_id}",
                            headers=server.admin()).status_code == 204
        await wait_for(lambda: listener.closed_code is not None, 10)
        await listener.close()
        return listener.closed_code

    assert asyncio.run(run()) == 1008
    assert httpx.get(server.base_url + "/v1/subscriptions", headers=auth(key)).status_code == 401


def test_slow_client_is_closed_1013_and_resumes(tmp_path: Path, embedded_redis: object) -> None:
    s = start_server(tmp_path, embedded_redis.url, workers=1,  # type: ignore[attr-defined]
                     GEOSWARM_WS_SEND_TIMEOUT_S="1", GEOSWARM_HISTORY_MAX_LEN="100000")
    try:
        key = s.new_key()
        sid = httpx.post(s.base_url + "/v1/subscriptions", headers=auth(key),
                         json={"type": "range", "bbox": [-1, -1, 1, 1]}).json()["id"]
        port = int(s.base_url.rsplit(":", 1)[1])
        ws = RawWebSocket("127.0.0.1", port, f"/v1/stream?token={key}")
        ws.send_text(orjson.dumps({"op": "listen", "subscriptions": [sid]}).decode())
        assert b"listening" in ws.recv_frame()[1]
        pad = "p" * 3000
        objs = [{"lon": 0.1, "lat": 0.1, "props": {"pad": pad}}] * 1000
        # the client reads nothing while about 30 MB of matches are due
        for _ in range(10):
            r = httpx.post(s.base_url + "/v1/objects", json={"objects": objs},
                           headers=auth(key), timeout=30)
            assert r.status_code == 202
        time.sleep(3)
        assert ws.read_until_close(timeout=30) == 1013
        ws.close()
        # the server is fine and the history is intact for a resume by cursor
        r = httpx.get(f"{s.base_url}/v1/subscriptions/{sid}/matches", params={"limit": 10},
                      headers=auth(key))
        assert r.status_code == 200 and len(r.json()["items"]) == 10
        assert httpx.get(s.base_url + "/readyz").status_code == 200
    finally:
        s.stop()


def test_poison_entry_goes_to_dead_letter(server: LiveServer, tenant_key: str) -> None:
    client = redis.Redis.from_url(server.redis_url)
    before = client.xlen(names.DEAD_LETTER)
    client.xadd(names.worker_stream("w0"), {b"m": b"\xc1 not msgpack"})
    sid = httpx.post(server.base_url + "/v1/subscriptions", headers=auth(tenant_key),
                     json={"type": "keyword", "keywords": ["after"]}).json()["id"]

    async def run() -> int:
        listener = Listener(server.ws_url, tenant_key)
        await listener.connect()
        await listener.listen([sid])
        httpx.post(server.base_url + "/v1/objects", headers=auth(tenant_key),
                   json={"objects": [{"lon": x, "lat": 0, "keywords": ["after"]}
                                     for x in (-90, 90)]})
        await wait_for(lambda: len(listener.matches()) == 2, 15)
        await listener.close()
        return len(listener.matches())

    assert asyncio.run(run()) == 2  # the shard was not blocked
    assert client.xlen(names.DEAD_LETTER) == before + 1


PING_S = 1.0
SLACK_S = 2.0  # scheduling on a busy machine; the bound itself is two ping periods


def _ws_connections(s: LiveServer) -> float:
    text = httpx.get(s.base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("geoswarm_ws_connections "))


def test_peer_that_stops_answering_pings_is_closed(tmp_path: Path, embedded_redis: object
                                                   ) -> None:
    """With pings every second: a peer that answered two pings and then stops is closed (1011)
    within two ping periods (the interval, then the wait for its pong); a client that answers
    (every WebSocket library does) stays connected; the dead peer's connection is gone from
    the hub, and its slot in the tenant's connection quota (of 1) is free again."""
    s = start_server(tmp_path, embedded_redis.url, workers=1,  # type: ignore[attr-defined]
                     GEOSWARM_WS_PING_S=str(PING_S), GEOSWARM_TENANT_MAX_CONNECTIONS="1")
    try:
        dead_key, live_key = s.new_key(), s.new_key()
        port = int(s.base_url.rsplit(":", 1)[1])

        def dead_peer() -> tuple[int, int | None, float]:
            """Answer two pings, then none: (pings seen, close code, seconds from the last
            pong to the close)."""
            ws = RawWebSocket("127.0.0.1", port, f"/v1/stream?token={dead_key}")
            try:
                ws.send_text('{"op": "listen", "all": true}')
                assert b"listening" in ws.recv_frame()[1]
                ws.sock.settimeout(10 * PING_S)
                pings, answered_at = 0, time.monotonic()
                while True:
                    opcode, payload = ws.recv_frame()
                    if opcode == 0x9:
                        pings += 1
                        if pings <= 2:
                            ws.send_frame(0xA, payload)
                            answered_at = time.monotonic()
                    elif opcode == 0x8:
                        code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                        return pings, code, time.monotonic() - answered_at
            finally:
                ws.close()

        async def run() -> None:
            live = Listener(s.ws_url, live_key)
            await live.connect()
            await live.listen(all=True)
            pings, code, after_last_pong = await asyncio.to_thread(dead_peer)
            assert pings >= 3 and code == 1011
            assert after_last_pong <= 2 * PING_S + SLACK_S
            await asyncio.sleep(2 * PING_S)
            assert live.closed_code is None  # it answered every ping, for 5 s and more
            assert await wait_for(lambda: _ws_connections(s) == 1, 10)
            again = Listener(s.ws_url, dead_key)  # the freed slot
            await again.connect()
            assert (await again.listen(all=True))["type"] == "listening"
            await again.close()
            await live.close()

        asyncio.run(run())
    finally:
        s.stop()


def test_frames_are_compressed_only_when_configured(server: LiveServer, tenant_key: str) -> None:
    """permessage-deflate is off by default (its CPU is the api's on every frame), even for
    a client that offers it; GEOSWARM_WS_COMPRESSION=true turns it on."""
    from app.core.processes import wait_until_ok
    from app.core.redis import free_port

    async def extensions(ws_url: str) -> str | None:
        async with websockets.connect(f"{ws_url}/v1/stream?token={tenant_key}") as ws:
            return ws.response.headers.get("Sec-WebSocket-Extensions")

    assert asyncio.run(extensions(server.ws_url)) is None
    port = free_port()
    proc = server.spawn("api-deflate", ["api", "--port", str(port), "--no-migrate"],
                        env={"GEOSWARM_WS_COMPRESSION": "true"})
    try:
        assert wait_until_ok(f"http://127.0.0.1:{port}/readyz", proc)
        got = asyncio.run(extensions(f"ws://127.0.0.1:{port}"))
        assert got is not None and "permessage-deflate" in got
    finally:
        server.kill("api-deflate", signal.SIGTERM)
