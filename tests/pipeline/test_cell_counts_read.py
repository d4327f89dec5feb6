"""The api's read of the workers' per-cell counts (`CellCounts`): one script call per worker
returns the mark and only the buckets' counts whose version differs from what the reader
holds, including buckets gone since. Real Redis; the hash written as a worker writes it (with
each tenant's list of buckets), and as a worker that wrote no such lists did."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis

from app.geo.grid import Grid
from app.pipeline import names, wire
from app.pipeline.cellcounts import CellCounts

TENANT = "t:1"  # a tenant id with a separator-like character in it


def _counts(bucket: int, cells: dict[int, int]) -> bytes:
    return wire.encode_cell_counts(wire.CellCounts(buckets=[(
        bucket, np.fromiter(cells, dtype="<i8", count=len(cells)).tobytes(),
        np.fromiter(cells.values(), dtype="<i8", count=len(cells)).tobytes())]))


async def _write(client: aioredis.Redis, bucket: int, version: str,
                 cells: dict[int, int] | None, indexed: bool = False) -> None:
    """One bucket's counts written or deleted; `indexed`: with the tenant's list of buckets
    (in one transaction, as `Executor._report_counts` writes them)."""
    field = names.cell_counts_field(TENANT, bucket)
    key = names.cell_counts_key("w0")
    listed = set((await client.hget(key, names.cell_counts_index_field(TENANT)) or b"").split())
    pipe = client.pipeline(transaction=True)
    if cells is None:
        pipe.hdel(key, field, names.cell_counts_version_field(field))
        listed.discard(str(bucket).encode())
    else:
        pipe.hset(key, mapping={field: _counts(bucket, cells),
                                names.cell_counts_version_field(field): version})
        listed.add(str(bucket).encode())
    if indexed:
        index = names.cell_counts_index_field(TENANT)
        pipe.hset(key, mapping={index: b" ".join(sorted(listed, key=int)),
                                names.cell_counts_version_field(index): version or "gone",
                                names.CELL_COUNTS_INDEXED: 1})
    await pipe.execute()


async def _read_counting_hgets(client: aioredis.Redis, counts: CellCounts, buckets: range
                               ) -> tuple[int, int]:
    """Worker w0's counts of the tenant's `buckets` read: the records of the whole grid in
    them, and how many HGETs the read made (Redis counts them)."""
    grid = Grid()
    before = (await client.info("commandstats")).get("cmdstat_hget", {}).get("calls", 0)
    pipe = client.pipeline(transaction=False)
    reading = counts.read(pipe, ["w0"], TENANT, buckets)
    held = counts.absorb(reading, await pipe.execute(), grid)
    after = (await client.info("commandstats"))["cmdstat_hget"]["calls"]
    return held[0].count((0, 0, grid.nx - 1, grid.ny - 1), buckets.start), after - before


@pytest.mark.parametrize("indexed", [True, False], ids=["listed", "unlisted"])
def test_only_changed_buckets_are_read_again(redis_db: str, indexed: bool) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_db)
        grid = Grid()
        counts = CellCounts(client)
        buckets = range(-2, 4)  # negative buckets too (a clock near the epoch)
        whole = (0, 0, grid.nx - 1, grid.ny - 1)

        async def read() -> tuple[int, list[str]]:
            pipe = client.pipeline(transaction=False)
            reading = counts.read(pipe, ["w0"], TENANT, buckets)
            got = await pipe.execute()
            changed = [f.decode() if isinstance(f, bytes) else f for f in got[0][2::3]]
            held = counts.absorb(reading, got, grid)
            return held[0].count(whole, buckets.start), changed

        await client.hset(names.cell_counts_key("w0"), names.CELL_COUNTS_UPTO, "5-0")
        await _write(client, -1, "e1.1", {10: 2, 11: 3}, indexed)
        await _write(client, 2, "e1.2", {10: 4}, indexed)
        await _write(client, 9, "e1.3", {10: 100}, indexed)  # outside the buckets read
        assert await read() == (9, [names.cell_counts_field(TENANT, -1),
                                    names.cell_counts_field(TENANT, 2)])
        assert await read() == (9, [])  # nothing changed: nothing sent again
        await _write(client, 2, "e1.4", {10: 4, 12: 1}, indexed)
        await _write(client, 3, "e1.5", {13: 7}, indexed)
        assert await read() == (17, [names.cell_counts_field(TENANT, 2),
                                     names.cell_counts_field(TENANT, 3)])
        await _write(client, -1, "", None, indexed)  # gone (its records left the window)
        assert await read() == (12, [names.cell_counts_field(TENANT, -1)])
        assert await read() == (12, [])
        await client.aclose()

    asyncio.run(main())


def test_a_tenant_whose_counts_did_not_change_is_answered_at_once(redis_db: str) -> None:
    """The version of a tenant's list of buckets (rewritten with any of its counts) held by
    the reader: while it is the current one, the read is two HGETs (the mark and it), however
    many buckets are held; not when the buckets asked reach past those read (a bucket there
    may hold counts the reader never read), nor once anything of the tenant's changed."""
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_db)
        counts = CellCounts(client)
        await client.hset(names.cell_counts_key("w0"), names.CELL_COUNTS_UPTO, "5-0")
        for b in range(40):
            await _write(client, b, f"e1.{b}", {10: 1, 20: 2}, indexed=True)
        await _write(client, 60, "e1.60", {10: 5}, indexed=True)  # past the first reads

        async def read(buckets: range) -> tuple[int, int]:
            return await _read_counting_hgets(client, counts, buckets)

        assert (await read(range(0, 50)))[0] == 120
        assert await read(range(0, 50)) == (120, 2)
        assert await read(range(5, 45)) == (105, 2)  # (within what was read)
        total, hgets = await read(range(5, 70))  # past it: read again
        assert total == 110 and hgets > 2
        await _write(client, 7, "e1.99", {10: 4}, indexed=True)  # changed
        total, hgets = await read(range(5, 70))
        assert total == 111 and hgets > 2
        assert await read(range(5, 70)) == (111, 2)
        await client.aclose()

    asyncio.run(main())


def test_a_long_range_of_buckets_visits_only_those_listed(redis_db: str) -> None:
    """An hour of narrow buckets (or a long window) is a range of many buckets, few of them
    holding records: the read visits the buckets listed and those held, not the range (Redis
    counts the HGETs a script makes)."""
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_db)
        counts = CellCounts(client)
        buckets = range(0, 200_000)
        await client.hset(names.cell_counts_key("w0"), names.CELL_COUNTS_UPTO, "5-0")
        for b in (7, 150_000, 199_999):
            await _write(client, b, f"e1.{b}", {10: 1, 20: 2}, indexed=True)

        async def read() -> tuple[int, int]:
            return await _read_counting_hgets(client, counts, buckets)

        total, hgets = await read()
        assert total == 9 and hgets < 1_000
        await _write(client, 150_000, "", None, indexed=True)
        total, hgets = await read()
        assert total == 6 and hgets < 1_000
        await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("indexed", [True, False], ids=["listed", "unlisted"])
def test_totals_for_knn_radii_read_the_buckets_in_range(redis_db: str, indexed: bool) -> None:
    """What the routers read to size kNN registrations (`read_totals`): the counts of every
    bucket of the range that holds some, summed per cell; with the lists, without reading
    the range bucket by bucket."""
    from app.pipeline.cellcounts import TOTALS_SCRIPT, read_totals
    from app.pipeline.knnreg import cell_totals

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_db)
        script = client.register_script(TOTALS_SCRIPT)
        await _write(client, 5, "e1.1", {10: 2, 11: 3}, indexed)
        await _write(client, 90_000, "e1.2", {10: 4}, indexed)
        await _write(client, 200_001, "e1.3", {10: 100}, indexed)  # outside the range
        before = (await client.info("commandstats")).get("cmdstat_hget", {}).get("calls", 0)
        pipe = client.pipeline(transaction=False)
        read_totals(pipe, script, ["w0"], TENANT, range(0, 200_000))
        got = await pipe.execute()
        hgets = (await client.info("commandstats"))["cmdstat_hget"]["calls"] - before
        assert cell_totals((r for per in got for r in per), 0) == {10: 6, 11: 3}
        assert (hgets < 1_000) == indexed
        await client.aclose()

    asyncio.run(main())
