"""Dead letters through the admin API, with the real app (in-process) and a real worker process:
a poison entry written to the worker's stream is dead-lettered by the worker, then listed
(paginated), counted in /metrics, replayed (and, being still poison, dead-lettered again) and
deleted; tenants and strangers are refused."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import redis

from app.pipeline import names
from tests.conftest import InProcessServer, auth

POISON = b"\xc1 not a message"  # 0xc1 is never valid msgpack


@pytest.fixture
def api(inprocess_worker: InProcessServer) -> InProcessServer:
    return inprocess_worker


@pytest.fixture
def store(api: InProcessServer) -> redis.Redis:
    return redis.Redis.from_url(api.redis_url)


def _all(client: httpx.Client, limit: int = 1000) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": limit}
    while True:
        r = client.get("/v1/admin/dead-letters", params=params)
        assert r.status_code == 200, r.text
        page = r.json()
        items += page["items"]
        if page["next_after"] is None:
            return items
        params["after"] = page["next_after"]


def _dead_lettered(client: httpx.Client, entry_id: str, timeout: float = 30
                   ) -> dict[str, Any]:
    """The dead letter of `entry_id`, once the worker has moved it there."""
    deadline = time.monotonic() + timeout
    while True:
        found = [d for d in _all(client) if d["original_id"] == entry_id]
        if found:
            assert len(found) == 1, found
            return found[0]
        assert time.monotonic() < deadline, f"{entry_id} was not dead-lettered"
        time.sleep(0.1)


def _poison(store: redis.Redis, payload: bytes = POISON) -> str:
    return _text(store.xadd(names.worker_stream("w0"), {b"m": payload}))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _order(entry_id: str) -> tuple[int, ...]:
    return tuple(int(part) for part in entry_id.split("-"))


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics:\n{text}")


def test_dead_letters_listed_counted_replayed_and_deleted(api: InProcessServer,
                                                          store: redis.Redis) -> None:
    with api.http(api.admin()) as client:
        before = client.get("/metrics").text
        written = time.time()
        entry = _poison(store)
        dead = _dead_lettered(client, entry)
        assert dead["stream"] == names.worker_stream("w0")
        assert dead["why"].startswith("undecodable")
        assert dead["size"] == len(b"m") + len(POISON)
        assert written - 5 <= dead["time"] <= time.time() + 1

        # counted, cluster-wide, in every api process's /metrics
        after = client.get("/metrics").text
        total = "geoswarm_dead_letters_total"
        assert _metric(after, total) >= _metric(before, total) + 1
        assert _metric(after, "geoswarm_dead_letters_waiting") >= 1

        # replay: back on its stream as a new entry, the dead letter gone at once; still
        # poison, the worker dead-letters it again under the new entry id
        r = client.post(f"/v1/admin/dead-letters/{dead['id']}/replay")
        assert r.status_code == 200, r.text
        replayed = r.json()
        assert replayed["id"] == dead["id"] and replayed["stream"] == dead["stream"]
        assert _order(replayed["entry_id"]) > _order(entry)
        assert dead["id"] not in {d["id"] for d in _all(client)}
        again = _dead_lettered(client, replayed["entry_id"])
        assert _order(again["id"]) > _order(dead["id"]) and again["size"] == dead["size"]
        rows: Any = store.xrange(names.DEAD_LETTER, again["id"], again["id"])
        fields = rows[0][1]
        assert fields[b"m"] == POISON and _text(fields[b"id"]) == replayed["entry_id"]
        # the same replay sent again (its reply lost, say) answers the same, appending nothing
        r = client.post(f"/v1/admin/dead-letters/{dead['id']}/replay")
        assert r.status_code == 200, r.text
        assert r.json() == replayed
        assert not store.xrange(names.worker_stream("w0"), "(" + replayed["entry_id"], "+")
        assert client.delete(f"/v1/admin/dead-letters/{dead['id']}").status_code == 404

        # delete: gone for good
        r = client.delete(f"/v1/admin/dead-letters/{again['id']}")
        assert r.status_code == 204, r.text
        assert again["id"] not in {d["id"] for d in _all(client)}
        assert not store.xrange(names.DEAD_LETTER, again["id"], again["id"])
        assert client.delete(f"/v1/admin/dead-letters/{again['id']}").status_code == 404
        assert client.post(f"/v1/admin/dead-letters/{again['id']}/replay").status_code == 404


def test_dead_letters_are_paginated(api: InProcessServer, store: redis.Redis) -> None:
    with api.http(api.admin()) as client:
        entries = [_poison(store, POISON + bytes([i])) for i in range(3)]
        ids = [_dead_lettered(client, e)["id"] for e in entries]
        pages: list[list[str]] = []
        params: dict[str, Any] = {"limit": 2}
        while True:
            page = client.get("/v1/admin/dead-letters", params=params).json()
            assert len(page["items"]) <= 2 and page["total"] >= 3
            pages.append([d["id"] for d in page["items"]])
            if page["next_after"] is None:
                break
            assert page["next_after"] == page["items"][-1]["id"]
            params["after"] = page["next_after"]
        listed = [i for p in pages for i in p]
        assert listed == sorted(listed, key=_order)
        assert len(set(listed)) == len(listed) and set(ids) <= set(listed)
        # `after` is exclusive
        r = client.get("/v1/admin/dead-letters", params={"after": ids[0], "limit": 1})
        assert r.json()["items"][0]["id"] == ids[1]
        for i in ids:
            assert client.delete(f"/v1/admin/dead-letters/{i}").status_code == 204


def test_dead_letters_that_cannot_be_replayed(api: InProcessServer, store: redis.Redis) -> None:
    """A dead letter names its stream itself: only a worker's stream that exists is replayed to;
    the others stay where they are (409)."""
    with api.http(api.admin()) as client:
        for stream in (names.PLAN_KEY, names.worker_stream("gone")):
            did = _text(store.xadd(names.DEAD_LETTER, {b"stream": stream.encode(), b"id": b"1-1",
                                                       b"why": b"test", b"m": POISON}))
            r = client.post(f"/v1/admin/dead-letters/{did}/replay")
            assert r.status_code == 409, r.text
            assert store.xrange(names.DEAD_LETTER, did, did)
            assert not store.exists(names.worker_stream("gone"))
            assert client.delete(f"/v1/admin/dead-letters/{did}").status_code == 204


def test_dead_letter_errors(api: InProcessServer) -> None:
    tenant = auth(api.new_key())
    paths = [("GET", "/v1/admin/dead-letters"), ("POST", "/v1/admin/dead-letters/1-1/replay"),
             ("DELETE", "/v1/admin/dead-letters/1-1")]
    with api.http() as client:
        for method, path in paths:
            assert client.request(method, path).status_code == 401
            r = client.request(method, path, headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401
            assert client.request(method, path, headers=tenant).status_code == 403
        admin = api.admin()
        for did in ("1-1", "0-0", "nope", "99999999999999999999-0", "1-"):
            for method, path in (("POST", f"/v1/admin/dead-letters/{did}/replay"),
                                 ("DELETE", f"/v1/admin/dead-letters/{did}")):
                r = client.request(method, path, headers=admin)
                assert r.status_code == 404, (method, path, r.text)
        for params in ({"limit": 0}, {"limit": 1001}, {"after": "x"}, {"after": "1"},
                       {"after": "99999999999999999999-0"}):
            r = client.get("/v1/admin/dead-letters", params=params, headers=admin)
            assert r.status_code == 422, (params, r.text)
            assert r.json()["detail"][0]["loc"][0] == "query"


def test_a_replay_in_steps_cut_short_appends_once(redis_url: str) -> None:
    """With outboxes (a Redis Cluster) a replay goes in steps (`replay_in_steps`); one cut
    after the entry was appended (the api process died: the fault is caused by a client that
    fails there) is finished by the replay sent again, which appends nothing more and answers
    the same entry id."""
    import asyncio

    import redis.asyncio as aioredis

    from app.api.routes.admin import replay_in_steps
    from bench.cluster import own_database

    url = own_database(redis_url)
    stream = names.worker_stream("w9")

    class DiesBeforeTheOutcome:
        def __init__(self, client: Any) -> None:
            self.client = client

        def __getattr__(self, name: str) -> Any:
            return getattr(self.client, name)

        async def set(self, *args: Any, **kwargs: Any) -> Any:
            raise redis.ConnectionError("the api process died here")

    async def scenario() -> None:
        client = aioredis.from_url(url)
        await client.flushdb()
        await client.xadd(stream, {b"m": b"first"})
        did = _text(await client.xadd(names.DEAD_LETTER, {
            b"stream": stream.encode(), b"id": b"1-1", b"why": b"test", b"m": POISON}))
        fields = (await client.xrange(names.DEAD_LETTER, did, did))[0][1]
        with pytest.raises(redis.ConnectionError):
            await replay_in_steps(DiesBeforeTheOutcome(client), did, stream, fields)
        assert await client.xlen(stream) == 2 and await client.xlen(names.DEAD_LETTER) == 1
        status, outcome = await replay_in_steps(client, did, stream, fields)
        assert status == 200 and await client.xlen(stream) == 2
        (last_id, last), = await client.xrevrange(stream, count=1)
        assert outcome == f"{stream}\n{_text(last_id)}" and last == {b"m": POISON}
        assert await client.xlen(names.DEAD_LETTER) == 0
        assert _text(await client.get(names.dead_letter_replayed_key(did))) == outcome
        # a dead letter of a stream that is gone: 410, nothing written
        gone = names.worker_stream("gone")
        assert await replay_in_steps(client, "1-2", gone, {b"m": POISON}) == (410, "")
        assert await replay_in_steps(client, "1-3", stream, {b"why": b"x"}) == (409, "")
        assert not await client.exists(gone)
        await client.flushdb()
        await client.aclose()

    asyncio.run(scenario())
