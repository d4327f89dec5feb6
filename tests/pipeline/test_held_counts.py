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
from app.pipeline.cellcounts import BucketCounts, CellCounts, Summed
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
    reply: list[object] = [b"1-0", b""]
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


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(
           # a few buckets written at a time (the older ones' sum then changes by difference)
           st.dictionaries(st.integers(0, 12), st.dictionaries(
               st.integers(0, NX * NY - 1), st.integers(1, 1000), max_size=120), max_size=3),
           st.lists(st.integers(0, 12), max_size=2)), min_size=1, max_size=12),
       boxes=st.lists(st.tuples(st.integers(0, NX - 1), st.integers(0, NY - 1),
                                st.integers(0, NX - 1), st.integers(0, NY - 1)),
                      min_size=1, max_size=4))
def test_counts_read_again_and_again_equal_brute_force(
        steps: list[tuple[dict[int, dict[int, int]], list[int]]],
        boxes: list[tuple[int, int, int, int]]) -> None:
    """Counts read one state after another, each read returning only the buckets whose
    version changed (new, rewritten or gone), as `READ_SCRIPT` does: the older buckets' sum
    is carried from one state to the next by difference (`Summed.changed`), and every count
    equals the brute-force sum of the state read, over the window's buckets."""
    counts = CellCounts(aioredis.Redis())
    state: dict[int, tuple[int, dict[int, int]]] = {}  # bucket -> (version, cells)
    base = None
    for version, (written, gone) in enumerate(steps, 1):
        reply: list[object] = [b"1-%d" % version, b"%d" % version]
        for bucket, cells in written.items():
            state[bucket] = (version, cells)
            reply += [names.cell_counts_field("t", bucket).encode(), b"%d" % version,
                      encoded(bucket, cells, True)]
        for bucket in gone:
            if bucket in state and bucket not in written:
                del state[bucket]
                reply += [names.cell_counts_field("t", bucket).encode(), b"", b""]
        base = counts._absorb("w0", "t", range(0, 13), base, reply, GRID)
        for x0, y0, xw, yw in boxes:
            x1, y1 = min(NX - 1, x0 + xw), min(NY - 1, y0 + yw)
            want = sum(n for _, cells in state.values() for cid, n in cells.items()
                       if x0 <= cid % NX <= x1 and y0 <= cid // NX <= y1)
            assert base.count((x0, y0, x1, y1), 0) == want


def bucket_counts(bucket: int, version: int, cells: dict[int, int]) -> BucketCounts:
    ids = np.array(sorted(cells), dtype=np.int64)
    return BucketCounts(version=b"%d" % version, bucket=bucket, cx=ids % NX, cy=ids // NX,
                        counts=np.array([cells[c] for c in sorted(cells)], dtype=np.int64))


few_cells = st.dictionaries(st.integers(0, 40), st.integers(1, 9), max_size=12)


@settings(max_examples=300, deadline=None)
@given(first=st.dictionaries(st.integers(0, 30), few_cells, min_size=1, max_size=20),
       changes=st.lists(st.tuples(st.integers(0, 30), st.none() | few_cells), max_size=30))
def test_a_sum_changed_by_difference_equals_one_made_anew(
        first: dict[int, dict[int, int]], changes: list[tuple[int, dict[int, int] | None]]
) -> None:
    """`Summed.changed` (counts gone or rewritten taken out, new ones added, on a few cells
    so that they overlap) holds the same cells and running sums as `Summed.of` the fields."""
    fields = {f"b{b}": bucket_counts(b, 0, cells) for b, cells in first.items()}
    summed = Summed.of(fields)
    for version, (bucket, cells) in enumerate(changes, 1):
        fields = dict(fields)
        if cells is None:
            fields.pop(f"b{bucket}", None)
        else:
            fields[f"b{bucket}"] = bucket_counts(bucket, version, cells)
        summed = summed.changed(fields)
        anew = Summed.of(fields)
        assert summed.fields == fields
        assert np.array_equal(summed.keys, anew.keys)
        assert np.array_equal(summed.below, anew.below)
