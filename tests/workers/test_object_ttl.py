"""Moving objects leave the latest-position store and the kNN lists when not updated within
their TTL (an object's `ttl_s`, else `object_ttl_s`), and a tenant's stored moving objects are
bounded by `tenant_max_objects` (real api and worker processes, a real WebSocket)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.redis import EmbeddedRedis
from tests.conftest import LiveServer, auth
from tests.workers.harness import Listener, run_on_cluster, wait_for

pytestmark = pytest.mark.slow


def neighbours(listener: Listener, sid: str) -> list[str] | None:
    """The ids of the newest kNN list pushed for `sid`."""
    lists = [m for m in listener.messages if m["type"] == "knn" and m["subscription"] == sid]
    return [n["id"] for n in lists[-1]["neighbors"]] if lists else None


async def _ttl(server: LiveServer) -> None:
    key = server.new_key()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        async def put(objs: list[dict[str, Any]]) -> httpx.Response:
            return await client.post("/v1/objects", json={"objects": objs}, headers=auth(key))

        r = await client.post("/v1/subscriptions", headers=auth(key),
                              json={"type": "knn", "point": [0.0, 0.0], "k": 3})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        listener = Listener(server.ws_url, key)
        await listener.connect()
        await listener.listen([sid])
        # "a" lives 2 s unless updated; "b" and "c" the default (a day).
        r = await put([{"id": "a", "lon": 0.01, "lat": 0.0, "ttl_s": 2},
                       {"id": "b", "lon": 0.02, "lat": 0.0},
                       {"id": "c", "lon": 0.03, "lat": 0.0}])
        assert r.status_code == 202, r.text
        assert await wait_for(lambda: neighbours(listener, sid) == ["a", "b", "c"], 15)
        assert (await client.get("/v1/objects/a", headers=auth(key))).status_code == 200
        # The quota of 3 moving objects: a new one is refused and changes nothing, while
        # updates of stored ones go on.
        r = await put([{"id": "b", "lon": 0.021, "lat": 0.0}, {"id": "d", "lon": 0.0, "lat": 0.0}])
        assert r.status_code == 429, r.text
        assert "tenant_max_objects" in r.json()["detail"] and "retry-after" in r.headers
        assert (await client.get("/v1/objects/d", headers=auth(key))).status_code == 404
        r = await put([{"id": "b", "lon": 0.022, "lat": 0.0}])
        assert r.status_code == 202, r.text
        # "a" outlives its TTL: gone from the store and from the neighbour list.
        assert await wait_for(lambda: neighbours(listener, sid) == ["b", "c"], 15)
        assert (await client.get("/v1/objects/a", headers=auth(key))).status_code == 404
        assert (await client.get("/v1/objects/b", headers=auth(key))).status_code == 200
        # Its place in the quota is free again.
        started = time.monotonic()
        r = await put([{"id": "d", "lon": 0.005, "lat": 0.0}])
        assert r.status_code == 202, r.text
        assert await wait_for(lambda: neighbours(listener, sid) == ["d", "b", "c"], 15)
        assert time.monotonic() - started < 15
        await listener.close()


def test_moving_objects_expire_and_are_bounded(tmp_path: Path, embedded_redis: EmbeddedRedis
                                               ) -> None:
    run_on_cluster(tmp_path, embedded_redis.url, 2, _ttl, GEOSWARM_TENANT_MAX_OBJECTS="3")
