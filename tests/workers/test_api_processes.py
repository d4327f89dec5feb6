"""Several api processes on one port (`geoswarm api --processes N`, what `geoswarm dev` runs
by default): each process publishes and serves WebSockets, and a client connected to either
gets every match of its subscriptions once, wherever the objects were published."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import auth, start_server
from tests.workers.harness import Listener, wait_for
from tests.workers.oracle import Oracle, received_matches
from tests.workers.test_pipeline import assert_exact, create_subs, random_objects, random_subs

pytestmark = pytest.mark.slow


def serving(api_pid: int, port: int) -> dict[int, set[int]]:
    """{api process pid: client ports of its established connections on `port`}."""
    out: dict[int, set[int]] = {}
    for proc in psutil.Process(api_pid).children(recursive=True):
        try:
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:
            continue
        out[proc.pid] = {c.raddr.port for c in conns
                         if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
                         and c.raddr}
    return out


def test_two_api_processes_each_deliver_what_either_accepted(tmp_path: Path,
                                                            embedded_redis: Any) -> None:
    server = start_server(tmp_path, embedded_redis.url, workers=2, api_processes=2)
    port = int(server.base_url.rsplit(":", 1)[1])

    async def scenario() -> None:
        rng = random.Random(5)
        key = server.new_key()
        oracle = Oracle()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            ids = await create_subs(client, key, random_subs(rng, 40), oracle)
        # WebSockets until both processes hold one (the kernel hands each accept to either)
        listeners: list[Listener] = []
        held: dict[int, Listener] = {}
        for _ in range(60):
            listener = Listener(server.ws_url, key)
            await listener.connect()
            await listener.listen(ids)
            local = listener.ws.transport.get_extra_info("sockname")[1]
            owner = next((pid for pid, ports in serving(server.procs["api"].pid, port).items()
                          if local in ports), None)
            if owner is not None and owner not in held:
                held[owner] = listener
                listeners.append(listener)
            else:
                await listener.close()
            if len(held) == 2:
                break
        assert len(held) == 2, "the two api processes never both took a connection"
        # publishes on new connections, so that both processes accept some
        movers = [f"m{i}" for i in range(15)]
        clock = [1_700_000_000.0]
        for _ in range(30):
            objs = random_objects(rng, 40, movers, clock)
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as one:
                r = await one.post("/v1/objects", json={"objects": objs}, headers=auth(key))
                assert r.status_code == 202, r.text
                oracle.publish(objs, r.json()["ids"])
        assert oracle.total() > 100
        for listener in listeners:
            assert await wait_for(lambda ln=listener: sum(received_matches(
                ln.messages).values()) >= oracle.total(), 60)
        await asyncio.sleep(1.0)  # a duplicate would arrive now
        for listener in listeners:
            assert_exact(received_matches(listener.messages), oracle)
            await listener.close()

    try:
        server.wait_workers(2)
        asyncio.run(scenario())
    finally:
        server.stop()
