"""Notifications are at most once: Redis drops a subscriber whose unread notifications outgrow
its output buffer (32 MB by default, a few notifications of a dense burst), and the client
library reconnects by itself. The hubs must then read back what they missed: a connection
listening to its subscriptions gets every match once, and one listening to all of its
tenant's subscriptions also those of subscriptions it had never heard of."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest
import redis

from app.core.config import Settings
from app.core.redis import start_embedded_redis
from tests.conftest import auth, start_server
from tests.workers.harness import Listener, wait_for
from tests.workers.oracle import Oracle, received_matches
from tests.workers.test_pipeline import assert_exact, create_subs, random_objects, random_subs

pytestmark = pytest.mark.slow


def test_every_notification_lost_every_match_still_once(tmp_path: Path) -> None:
    own = start_embedded_redis(Settings(data_dir=tmp_path / "redis"))
    # no safety poll within the test: only the hubs' recovery can deliver
    server = start_server(tmp_path / "cluster", own.url, workers=2, GEOSWARM_WS_POLL_S="600")

    async def scenario() -> None:
        rng = random.Random(17)
        key = server.new_key()
        oracle = Oracle()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            everything = Listener(server.ws_url, key)
            await everything.connect()
            await everything.listen(all=True)  # before any subscription exists
            ids = await create_subs(client, key, random_subs(rng, 40), oracle)
            named = Listener(server.ws_url, key)
            await named.connect()
            await named.listen(ids)
            # from now on Redis drops the hubs' subscriber at every notification (any that does
            # not fit in its 16 KB reply buffer)
            cut = redis.Redis.from_url(server.redis_url)
            cut.config_set("client-output-buffer-limit", "pubsub 1 1 0")
            movers = [f"m{i}" for i in range(12)]
            clock = [1_700_000_000.0]
            for _ in range(12):
                objs = random_objects(rng, 30, movers, clock)
                for obj in objs:  # notifications far larger than Redis' reply buffer
                    obj["props"] = {"pad": "p" * 2000}
                r = await client.post("/v1/objects", json={"objects": objs},
                                      headers=auth(key))
                assert r.status_code == 202, r.text
                oracle.publish(objs, r.json()["ids"])
                await asyncio.sleep(0.1)
            assert oracle.total() > 50
            for listener in (everything, named):
                await wait_for(lambda ln=listener: sum(received_matches(
                    ln.messages).values()) >= oracle.total(), 60)
            await asyncio.sleep(1.0)  # a duplicate would arrive now
            for listener in (everything, named):
                assert_exact(received_matches(listener.messages), oracle)
                await listener.close()
            cut.config_set("client-output-buffer-limit", "pubsub 256mb 64mb 60")
            cut.close()

    try:
        server.wait_workers(2)
        asyncio.run(scenario())
    finally:
        server.stop()
        own.stop()
