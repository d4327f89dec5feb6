"""Errors of the dependencies that are not outages: a broken SQL constraint is the client's
conflict (409, naming what is duplicated), not a 503; a Redis full at maxmemory (noeviction)
answers 503 with Retry-After, never 500, and reads go on working. Against the real app on a
real database and a real (own) Redis filled to its limit."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from app.core.config import Settings
from app.core.redis import EmbeddedRedis, start_embedded_redis
from app.services import keys as key_service
from app.services import subscriptions as sub_service
from tests.app.httpapi import Api, check
from tests.conftest import InProcessServer, auth, start_inprocess


@pytest.fixture
def api(inprocess: InProcessServer) -> Iterator[Api]:
    a = Api(inprocess)
    yield a
    a.close()


# --- integrity -----------------------------------------------------------------------------

def test_duplicate_subscription_id_is_409(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault: the id generator hands out an id that exists (as a collision would)."""
    dup = "s_dup" + secrets.token_hex(6)
    monkeypatch.setattr(sub_service, "new_id", lambda prefix: dup)
    first = api.post("/v1/subscriptions", {"type": "keyword", "keywords": ["a"]})
    assert first.status_code == 201, first.text
    again = api.post("/v1/subscriptions", {"type": "keyword", "keywords": ["b"]})
    assert again.status_code == 409, again.text
    detail = again.json()["detail"]
    assert isinstance(detail, str) and "already exists" in detail and "id" in detail, detail
    batch = api.post("/v1/subscriptions/batch", {"subscriptions": [
        {"type": "keyword", "keywords": ["c"]}]})
    assert batch.status_code == 409, batch.text
    # nothing of the refused requests was stored
    assert api.subscription_ids() == [dup]
    assert api.get(f"/v1/subscriptions/{dup}").json()["keywords"] == ["a"]


def test_duplicate_key_id_is_409(inprocess: InProcessServer,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    dup = "k_dup" + secrets.token_hex(6)
    monkeypatch.setattr(key_service, "new_id", lambda prefix: dup)
    with inprocess.http(inprocess.admin()) as c:
        assert c.post("/v1/admin/keys", json={"tenant": "dupkeys"}).status_code == 201
        r = check(c.post("/v1/admin/keys", json={"tenant": "dupkeys"}))
    assert r.status_code == 409, r.text
    assert "id" in r.json()["detail"]


def test_first_requests_of_a_new_tenant_race_without_conflict(inprocess: InProcessServer
                                                              ) -> None:
    """Concurrent first requests of one tenant both create it: neither sees a conflict."""

    def create(tenant: str, start: threading.Barrier) -> int:
        with inprocess.http(inprocess.admin()) as c:
            start.wait()
            return check(c.post("/v1/admin/keys", json={"tenant": tenant})).status_code

    for _ in range(5):
        tenant = "race" + secrets.token_hex(4)
        start = threading.Barrier(8)
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(create, [tenant] * 8, [start] * 8))
        assert statuses == [201] * 8


# --- Redis out of memory ---------------------------------------------------------------------

@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A Redis of this test alone: its memory limit must not touch any other test's."""
    server = start_embedded_redis(Settings(data_dir=tmp_path / "redis"))
    yield server
    server.stop()


def fill_to_maxmemory(client: redis.Redis) -> None:
    """Set maxmemory a little above what is used now, with noeviction, and write until Redis
    refuses writes; then hold the limit at half of what is used: buffers freed meanwhile
    (client query buffers, the AOF buffer, keys of other clients expiring) must not let a
    small write through again, which a margin of a few hundred kilobytes once did."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(used + 2 * 1024 * 1024))
    blob = b"x" * 64 * 1024
    for i in range(10_000):
        try:
            client.set(f"filler:{i}", blob)
        except redis.exceptions.OutOfMemoryError:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", str(used // 2))
            return
    raise AssertionError("Redis never refused a write")


def test_redis_out_of_memory_is_503_with_retry_after(tmp_path: Path,
                                                     own_redis: EmbeddedRedis) -> None:
    with start_inprocess(tmp_path, own_redis.url) as s:
        api = Api(s)
        sub = api.subscribe({"type": "range", "bbox": [0, 0, 1, 1]})
        client = redis.Redis.from_url(s.redis_url)
        try:
            fill_to_maxmemory(client)
            writes = [
                api.post("/v1/objects", {"objects": [{"lon": 0.5, "lat": 0.5}]}),
                api.post("/v1/objects", {"objects": [{"id": "car-1", "lon": 0.5, "lat": 0.5}]}),
                api.post("/v1/subscriptions", {"type": "keyword", "keywords": ["a"]}),
                api.post("/v1/subscriptions/batch",
                         {"subscriptions": [{"type": "keyword", "keywords": ["a"]}]}),
                api.delete(f"/v1/subscriptions/{sub['id']}"),
            ]
            for r in writes:
                assert r.status_code == 503, (r.request.method, r.request.url, r.text)
                assert int(r.headers["retry-after"]) >= 1
                assert "out of memory" in r.json()["detail"]
            # Reads go on (the per-key rate limit cannot count, and lets them through), and
            # the refused writes changed nothing.
            r = api.get("/v1/subscriptions")
            assert r.status_code == 200, r.text
            assert [i["id"] for i in r.json()["items"]] == [sub["id"]]
            assert api.get("/v1/objects/car-1").status_code == 404
            # Memory freed: writes work again.
            client.config_set("maxmemory", "0")
            assert api.post("/v1/objects", {"objects": [{"lon": 0.5, "lat": 0.5}]}
                            ).status_code == 202
            assert api.delete(f"/v1/subscriptions/{sub['id']}").status_code == 204
            with s.http(auth(api.key)) as c:
                assert c.get("/v1/subscriptions").json()["items"] == []
        finally:
            client.config_set("maxmemory", "0")
            client.close()
            api.close()
