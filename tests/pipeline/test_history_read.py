"""Reading subscription histories for a client that is behind (app.pipeline.hub): one read is
bounded in the matches it fetches and renders, however large the entries, and reading on from
where a read stopped yields every message once, in order. Real Redis, history entries written
as the workers write them."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import redis

from app.core.pipelines import ClientPipelines, RawPipelines
from app.core.redis import async_client
from app.pipeline import names, wire
from app.pipeline.hub import Position, read_histories, start_position

TENANT = "t"
BUCKET = 7


def write_history(client: redis.Redis, sub: str, sizes: list[int]) -> list[str]:
    """Entries of `sub` with these numbers of matches (each record stored once in the bucket's
    records hash); returns the object ids in delivery order."""
    prev = "0-0"
    order: list[str] = []
    for n in sizes:
        rids = [f"{sub}-r{len(order) + i}" for i in range(n)]
        client.hset(names.records_key(TENANT, BUCKET),
                    mapping={r: orjson.dumps({"id": r}) for r in rids})
        refs = wire.encode_refs(wire.MatchRefs(rids, bytes(n)))
        prev = client.xadd(names.history_key(sub), {b"b": str(BUCKET), b"t": TENANT,
                                                    b"p": prev, b"m": refs}).decode()
        order += rids
    return order


@pytest.mark.parametrize("raw", [True, False], ids=["raw-pipelines", "client-pipelines"])
def test_a_read_is_bounded_and_reading_on_yields_everything_once(redis_db: str, raw: bool
                                                                 ) -> None:
    """Through the api's own pipelines (replies as Redis sends them) and through redis-py's
    (the way on a Redis Cluster, replies as redis-py parses them)."""
    store = redis.Redis.from_url(redis_db)
    expected = {"big": write_history(store, "big", [3000] * 5),
                "small": write_history(store, "small", [10, 10]),
                "mid": write_history(store, "mid", [1500, 1500, 1500])}
    store.close()
    max_lines = 4000

    async def run() -> tuple[dict[str, list[str]], list[int]]:
        client = async_client(redis_db)
        pipelines = RawPipelines.from_url(redis_db) if raw else ClientPipelines(client)
        assert pipelines is not None
        got: dict[str, list[str]] = {sub: [] for sub in expected}
        sizes: list[int] = []
        positions: dict[str, Position] = {sub: start_position(0) for sub in expected}
        try:
            while positions:
                batches = await read_histories(pipelines, positions, 256, TENANT,
                                               max_lines=max_lines)
                sizes.append(sum(len(b.lines) for b in batches.values()))
                for sub, batch in batches.items():
                    for line in batch.lines:
                        msg = orjson.loads(line)
                        assert msg["type"] == "match", msg
                        got[sub].append(msg["object"]["id"])
                    positions[sub] = batch.position
                    if not batch.full:
                        del positions[sub]
        finally:
            await pipelines.aclose()
            await client.aclose()
        return got, sizes

    got, sizes = asyncio.run(run())
    assert got == expected  # every match once, in order, for each subscription
    # a read stops adding entries at the bound: at most one entry (3 000 matches) beyond it
    assert max(sizes) <= max_lines + 3000, sizes
    assert len(sizes) >= 4, sizes  # 21 020 matches cannot come in fewer bounded reads
