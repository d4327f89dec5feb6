"""`HeldCounts.count` (a count's whole cells from the workers' per-cell counts) against a
brute-force sum over every cell of every bucket: buckets written in cell order (as workers
hold and write them, `BucketCells`) or in any order (a worker of an earlier version), any box, any
horizon."""

from __future__ import annotations

import numpy as np
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from app.geo.grid import Grid
from app.pipeline import names, wire
from app.pipeline.cellcounts import CellCounts
from workers.records import BucketCells

NX, NY = 37, 23
GRID = Grid(nx=NX, ny=NY)

buckets_st = st.dictionaries(
    st.integers(0, 12),
    st.dictionaries(st.integers(0, NX * NY - 1), st.integers(1, 1000), max_size=120),
    max_size=8)


def encoded(bucket: int, cells: dict[int, int], ordered: bool) -> bytes:
    if ordered:  # as a worker holds and writes them
        held = BucketCells()
        for cid, n in cells.items():
            held.add(np.array([cid], dtype=np.int64), np.array([n], dtype=np.int64))
        ids, counts = held.encoded()
    else:
        ids = np.fromiter(cells, dtype="<i8", count=len(cells)).tobytes()
        counts = np.fromiter(cells.values(), dtype="<i8", count=len(cells)).tobytes()
    return wire.encode_cell_counts(wire.CellCounts(buckets=[(bucket, ids, counts)]))


@settings(max_examples=200, deadline=None)
@given(buckets=buckets_st, ordered=st.booleans(),
       boxes=st.lists(st.tuples(st.integers(0, NX - 1), st.integers(0, NY - 1),
                                st.integers(0, NX - 1), st.integers(0, NY - 1),
                                st.integers(0, 13)), min_size=1, max_size=6))
def test_count_equals_brute_force(buckets: dict[int, dict[int, int]], ordered: bool,
                                  boxes: list[tuple[int, int, int, int, int]]) -> None:
    reply: list[object] = [b"1-0"]
    for bucket, cells in buckets.items():
        reply += [names.cell_counts_field("t", bucket).encode(), b"1.%d" % bucket,
                  encoded(bucket, cells, ordered)]
    held = CellCounts(aioredis.Redis())._absorb("w0", "t", range(0, 14), None, reply, GRID)
    for x0, y0, xw, yw, horizon in boxes:
        x1, y1 = min(NX - 1, x0 + xw), min(NY - 1, y0 + yw)
        want = sum(n for bucket, cells in buckets.items() if bucket >= horizon
                   for cid, n in cells.items()
                   if x0 <= cid % NX <= x1 and y0 <= cid // NX <= y1)
        assert held.count((x0, y0, x1, y1), horizon) == want


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.lists(st.integers(0, 60), max_size=30), st.booleans()),
                      max_size=25))
def test_bucket_cells_equal_a_dict_of_counts(steps: list[tuple[list[int], bool]]) -> None:
    """`BucketCells` (chunks' counts folded into sorted arrays when read) against a dict:
    reads between any adds, what was encoded before an add left as it was."""
    held, want = BucketCells(), dict[int, int]()
    seen: list[tuple[bytes, bytes, list[tuple[int, int]]]] = []
    for cells, read in steps:
        ids, counts = np.unique(np.array(cells, dtype=np.int64), return_counts=True)
        held.add(ids, counts)
        for c in cells:
            want[c] = want.get(c, 0) + 1
        if read:
            got_ids, got_counts = held.encoded()
            assert (np.diff(np.frombuffer(got_ids, dtype="<i8")) > 0).all()
            assert held.items() == sorted(want.items())
            seen.append((got_ids, got_counts, sorted(want.items())))
            assert all(held.get(c) == n for c, n in want.items()) and held.get(-1) == 0
    assert held.items() == sorted(want.items()) and len(held) == len(want)
    for ids_then, counts_then, items_then in seen:
        assert list(zip(np.frombuffer(ids_then, dtype="<i8").tolist(),
                        np.frombuffer(counts_then, dtype="<i8").tolist(),
                        strict=True)) == items_then
