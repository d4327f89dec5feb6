"""Tornado's textual summaries end to end (real api, workers and Redis): the router marks the
rows that no subscription of the receiving worker can match by their keywords, the workers
skip matching exactly those while their subscriptions are unchanged, and a mark made from a
summary that is out of date (a subscription created since) is ignored: every match is still
delivered once."""

from __future__ import annotations

import asyncio
import random
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from app.core.redis import EmbeddedRedis
from app.pipeline import names
from tests.conftest import LiveServer, start_server
from tests.workers.harness import Listener, run_on_cluster, wait_for
from tests.workers.oracle import Oracle, received_matches
from tests.workers.test_balancing import move_or_split
from tests.workers.test_pipeline import WORDS, assert_exact, create_subs, publish

pytestmark = pytest.mark.slow

TRACKED = ["coffee", "tea", "taxi", "pizza"]  # the words of the first subscriptions
TENANT = "kwsum"
WORKERS = 2


def tracked_subs(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Range (box or circle) and keyword subscriptions, every one with tracked words."""
    subs: list[dict[str, Any]] = []
    for i in range(n):
        kws = {"keywords": rng.sample(TRACKED, rng.randint(1, 3)),
               "match": rng.choice(["any", "all"])}
        if i % 5 == 0:
            subs.append({"type": "keyword", **kws})
        elif i % 2:
            x0, y0 = rng.uniform(-2, 1.5), rng.uniform(-1, 0.8)
            subs.append({"type": "range", "bbox": [x0, y0, x0 + rng.uniform(0.1, 2.0),
                                                   y0 + rng.uniform(0.05, 1.0)],
                         "detect": rng.sample(["inside", "enter", "exit"], rng.randint(1, 3)),
                         **kws})
        else:
            subs.append({"type": "range", "circle": {
                "lon": rng.uniform(-1.5, 1.5), "lat": rng.uniform(-0.8, 0.8),
                "radius_m": rng.uniform(5_000, 150_000)}, **kws})
    return subs


def events(rng: random.Random, n: int, clock: list[float], words: list[str]
           ) -> list[dict[str, Any]]:
    """Objects without an id (each row is markable), with lower-case keywords."""
    out = []
    for _ in range(n):
        clock[0] += 1.0
        out.append({"lon": rng.uniform(-2.5, 2.5), "lat": rng.uniform(-1.2, 1.2),
                    "keywords": rng.sample(words, rng.randint(0, 3)), "ts": clock[0]})
    return out


def movers(rng: random.Random, n: int, clock: list[float]) -> list[dict[str, Any]]:
    """Moving objects: first positions are markable, later ones (enter/exit) never."""
    out = []
    for _ in range(n):
        clock[0] += 1.0
        out.append({"id": f"car-{rng.randrange(20)}", "lon": rng.uniform(-2.5, 2.5),
                    "lat": rng.uniform(-1.2, 1.2), "keywords": rng.sample(WORDS, 2),
                    "ts": clock[0]})
    return out


def marked_rows(server: LiveServer) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    m = re.search(r'^geoswarm_routed_rows_total\{mark="no_match"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def skipped_by_workers(server: LiveServer) -> float:
    """The rows the workers stored without matching (their heartbeats, through /metrics)."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(
        r'^geoswarm_worker_rows_skipped_total\{worker="w\d+"\} (\S+)$', text, re.M))


async def listening(server: LiveServer, http: httpx.AsyncClient,
                    specs: list[dict[str, Any]], workers: int
                    ) -> tuple[str, Oracle, Listener]:
    """A key of the tenant and its oracle; the subscriptions created, a WebSocket listening to
    them all, once each of the `workers` first workers wrote its keyword summary of the
    tenant."""
    key = server.new_key(TENANT)
    oracle = Oracle()
    await create_subs(http, key, specs, oracle)
    listener = Listener(server.ws_url, key)
    await listener.connect()
    await listener.listen(all=True)
    client = redis.Redis.from_url(server.redis_url)
    try:
        assert await wait_for(lambda: all(
            client.hget(names.keyword_summaries_key(f"w{i}"), TENANT) is not None
            for i in range(workers)), 30)
    finally:
        client.close()
    return key, oracle, listener


def untracked(obj: dict[str, Any], words: list[str]) -> bool:
    return not set(obj["keywords"]) & set(words)


@pytest.fixture
def server(tmp_path: Path, redis_url: str) -> Iterator[LiveServer]:
    # the routers keep the first summaries they read for the whole test: every mark made
    # after a subscription change is made from an out-of-date summary
    s = start_server(tmp_path, redis_url, workers=WORKERS,
                     GEOSWARM_KEYWORD_SUMMARIES_MAX_AGE_S="3600")
    s.wait_workers(WORKERS)
    yield s
    s.stop()


def test_marks_skip_matching_and_out_of_date_marks_are_ignored(server: LiveServer) -> None:
    asyncio.run(_marks(server))


async def _marks(server: LiveServer) -> None:
    rng = random.Random(7)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        # every worker holds keyword subscriptions of the tenant: each writes a summary
        key, oracle, listener = await listening(server, http, tracked_subs(rng, 60), WORKERS)

        # 1. summaries in force: every event without a tracked word is marked, and skipped
        clock = [1_700_000_000.0]
        first = [*events(rng, 400, clock, WORDS), *movers(rng, 100, clock)]
        before = marked_rows(server)
        for a in range(0, len(first), 100):
            await publish(http, key, first[a:a + 100], oracle)
        marked_first = marked_rows(server) - before
        seen: set[str] = set()
        markable = 0  # events, and the first position of each mover (no enter/exit to decide)
        for o in first:
            markable += untracked(o, TRACKED) and o.get("id") not in seen
            if "id" in o:
                seen.add(o["id"])
        assert marked_first == markable > 100
        assert await wait_for(lambda: skipped_by_workers(server) == marked_first, 30), (
            f"workers skipped {skipped_by_workers(server)} rows, {marked_first} were marked")

        # 2. a subscription to a new word; the routers still hold the old summaries, so the
        # objects with that word are marked, and must be matched all the same
        await create_subs(http, key, [
            {"type": "keyword", "keywords": ["rain"]},
            {"type": "range", "bbox": [-2.5, -1.2, 2.5, 1.2], "keywords": ["rain", "bus"],
             "match": "all"}], oracle)
        later = events(rng, 300, clock, ["rain", "bus", "coffee", "park"])
        before = marked_rows(server)
        for a in range(0, len(later), 100):
            await publish(http, key, later[a:a + 100], oracle)
        assert marked_rows(server) - before == sum(untracked(o, TRACKED) for o in later)
        assert sum("rain" in o["keywords"] for o in later) > 50

        assert oracle.total() > 200
        await wait_for(lambda: len(listener.matches()) >= oracle.total(), 60)
        await asyncio.sleep(1.0)  # duplicates or extras would arrive now
        assert_exact(received_matches(listener.messages), oracle)
        # the out-of-date marks were not followed
        await asyncio.sleep(1.5)  # a heartbeat
        assert skipped_by_workers(server) == marked_first
        await listener.close()


def test_without_summaries_nothing_is_marked(tmp_path: Path,
                                             embedded_redis: EmbeddedRedis) -> None:
    run_on_cluster(tmp_path, embedded_redis.url, 1, _unmarked,
                   GEOSWARM_KEYWORD_SUMMARIES="false")


async def _unmarked(server: LiveServer) -> None:
    rng = random.Random(3)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        key, oracle, listener = await listening(server, http, tracked_subs(rng, 20), 1)
        clock = [1_700_000_000.0]
        for _ in range(3):
            await publish(http, key, events(rng, 100, clock, WORDS), oracle)
        await wait_for(lambda: len(listener.matches()) >= oracle.total(), 60)
        await asyncio.sleep(1.0)
        assert_exact(received_matches(listener.messages), oracle)
        assert marked_rows(server) == 0
        await listener.close()


def test_exact_while_partitions_move_and_a_worker_is_killed(
        tmp_path: Path, embedded_redis: EmbeddedRedis) -> None:
    """Marks made under one plan reach a worker after a move (it forwards them unmarked) or
    a worker restarted with new tokens (it ignores them): every match is delivered once.
    (On the embedded Redis only: the test above runs on Redis 7 too.)"""
    run_on_cluster(tmp_path, embedded_redis.url, 3, _moves_and_kill)


async def _moves_and_kill(server: LiveServer) -> None:
    rng = random.Random(11)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        key, oracle, listener = await listening(server, http, tracked_subs(rng, 80), 3)
        clock = [1_700_000_000.0]
        marked = marked_rows(server)
        for i in range(20):
            batch = [*events(rng, 60, clock, WORDS), *movers(rng, 20, clock)]
            await publish(http, key, batch, oracle)
            if i in (4, 14):  # the partition of the centre moves (then splits) to another
                await asyncio.to_thread(move_or_split, server, 0.0, 0.0, i, i == 14)
            if i == 8:
                server.kill("w1", signal.SIGKILL)
            if i == 11:
                server.start_worker("w1")
            await asyncio.sleep(0.15)  # the routers read the summaries made after each change
        assert marked_rows(server) - marked > 300  # marks were made all along
        await wait_for(lambda: len(listener.matches()) >= oracle.total(), 90)
        await asyncio.sleep(1.0)
        assert_exact(received_matches(listener.messages), oracle)
        assert skipped_by_workers(server) > 0
        await listener.close()
