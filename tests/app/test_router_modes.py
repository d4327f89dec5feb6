"""Routing in the partitioning modes (SWARM §6's baselines): replicated targets, the per-row
worker choice in replicated mode, the first plan of each mode and the partition id counter."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis

from app.core.config import Settings
from app.core.redis import EmbeddedRedis
from app.geo.grid import Grid
from app.geo.index import GlobalIndex, initial_plan
from app.pipeline import names
from app.pipeline.cluster import partition_ids
from app.pipeline.names import PART_SEQ
from app.pipeline.router import (
    ensure_plan,
    make_plan,
    part_seq_floor,
    read_history_sample,
    replicated_targets,
    replicated_worker_of,
    targets_for_spec,
)
from bench.cluster import own_database

WORKERS = ["w0", "w1", "w2", "w3"]


def _index() -> GlobalIndex:
    return GlobalIndex(initial_plan(Grid(nx=100, ny=100), WORKERS))


def test_targets_for_spec_replicated_is_every_worker() -> None:
    index = _index()
    small = {"type": "range", "bbox": [10.0, 10.0, 10.5, 10.5]}
    circle = {"type": "range", "circle": {"lon": -100.0, "lat": -40.0, "radius_m": 1000.0}}
    assert len(targets_for_spec(index, small)) == 1
    assert len(targets_for_spec(index, circle)) == 1
    for spec in (small, circle, {"type": "keyword", "keywords": ["a"]}):
        assert targets_for_spec(index, spec, replicated=True) == set(WORKERS)
    assert targets_for_spec(index, {"type": "keyword", "keywords": ["a"]}) == set(WORKERS)


def test_replicated_moving_objects_hash_stably_events_round_robin() -> None:
    ids = [f"car{i}" for i in range(200)]
    moving = [True] * 200
    a = replicated_targets("t1", ids, moving, 4, start=0)
    b = replicated_targets("t1", ids, moving, 4, start=17)  # the counter does not matter
    assert a == b == [replicated_worker_of("t1", i, 4) for i in ids]
    assert set(a) == {0, 1, 2, 3}  # spread over every worker
    assert max(Counter(a).values()) < 80
    # Stable across processes: crc32, not Python's salted hash. Tenants are separate keys.
    assert replicated_worker_of("t1", "car0", 4) == replicated_worker_of("t1", "car0", 4)
    assert replicated_worker_of("t1", "x", 1000) != replicated_worker_of("t2", "x", 1000)
    # Events: round-robin from the router's counter, moving rows do not advance it.
    ev_ids = ["o1", "o2", "car0", "o3", "o4", "o5"]
    mv = [False, False, True, False, False, False]
    got = replicated_targets("t1", ev_ids, mv, 4, start=3)
    assert [got[i] for i in (0, 1, 3, 4, 5)] == [3, 0, 1, 2, 3]
    assert got[2] == replicated_worker_of("t1", "car0", 4)


def _write_sample(path: Path) -> None:
    lines = [{"lon": -118.2 + i * 1e-4, "lat": 34.0} for i in range(500)]
    lines += [{"bbox": [-118.3, 33.9, -118.1, 34.1]} for _ in range(100)]
    lines += [{"circle": {"lon": -118.2, "lat": 34.0, "radius_m": 2000}} for _ in range(50)]
    lines += [{"type": "keyword", "keywords": ["x"]}]  # no region: skipped
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n\n")


def test_history_sample_file_and_make_plan(tmp_path: Path) -> None:
    sample = tmp_path / "sample.ndjson"
    _write_sample(sample)
    grid = Grid(nx=200, ny=200)
    cx, cy, rects = read_history_sample(sample, grid)
    assert cx.size == cy.size == 500 and rects.shape == (150, 4)
    base = {"grid": (200, 200), "data_dir": tmp_path}
    uniform = initial_plan(grid, WORKERS)
    hist = make_plan(Settings(partitioning="history", history_sample=sample, **base), WORKERS, 1)
    hist.validate()
    assert [p.worker for p in hist.partitions] == WORKERS
    assert hist.partitions != uniform.partitions  # cut around Los Angeles
    for mode in ("swarm", "uniform", "replicated"):
        assert make_plan(Settings(partitioning=mode, **base), WORKERS, 1).partitions == (
            uniform.partitions)
    # Unset or missing sample: the uniform plan (and a warning).
    for s in (None, tmp_path / "missing.ndjson"):
        got = make_plan(Settings(partitioning="history", history_sample=s, **base), WORKERS, 1)
        assert got.partitions == uniform.partitions


def test_part_seq_floor() -> None:
    plan = initial_plan(Grid(nx=10, ny=10), WORKERS)
    assert part_seq_floor(plan) == 4
    plan.partitions[1].id = "p41"
    assert part_seq_floor(plan) == 42


def test_ensure_plan_sets_the_partition_counter(embedded_redis: EmbeddedRedis,
                                               tmp_path: Path) -> None:
    url = own_database(embedded_redis.url)

    async def go() -> None:
        r = aioredis.Redis.from_url(url)
        try:
            await r.flushdb()
            settings = Settings(grid=(50, 50), data_dir=tmp_path)
            plan = await ensure_plan(r, settings, WORKERS)
            assert plan.version == 1
            assert int(await r.get(PART_SEQ)) == 4
            # The next ids the coordinator hands out (INCRBY) are new ones.
            last = await r.incrby(PART_SEQ, 2)
            assert partition_ids(last, 2) == ["p5", "p6"]
            # A counter already past the floor is left alone; the plan is kept.
            again = await ensure_plan(r, settings, WORKERS)
            assert again.version == 1 and int(await r.get(PART_SEQ)) == 6
            # Another worker set: a new plan version, the counter never goes back.
            other = await ensure_plan(r, settings, ["w0", "w1"])
            assert other.version == 2 and int(await r.get(PART_SEQ)) == 6
            assert (await r.get(names.PLAN_KEY)) is not None
        finally:
            await r.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("n", [1, 3])
def test_replicated_targets_single_and_few_workers(n: int) -> None:
    got = replicated_targets("t", ["a", "b", "c"], [False, True, False], n, start=0)
    assert all(0 <= w < n for w in got)
