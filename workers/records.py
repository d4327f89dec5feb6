"""The records one executor holds in its live window (SSTD §3.2): every record of the last
`window_s` that was routed to it (moving objects' records and events), bucketed by arrival
so that whole buckets expire at once, for snapshot queries (`workers.snapshot`).

A record stays with the worker that stored it when its partition moves on: that worker is
then the partition's previous owner, and queries over the older part of the window still ask
it (SWARM §5.2's parent partitions, SSTD's versioned mapping). The records are logged to
`names.window_stream(worker)` in the same transaction as the entry's matches, so a restarted
worker reads its window back instead of losing it.
"""

from __future__ import annotations

import functools
import itertools
import operator
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, cast

import numpy as np

from app.archive.layout import NO_CUT
from app.geo.arrays import distinct
from app.geo.geometry import bbox_contains
from app.geo.grid import Grid, run_positions
from app.pipeline.wire import ObjectBatch

F64 = np.ndarray[Any, np.dtype[np.float64]]
Bool = np.ndarray[Any, np.dtype[np.bool_]]
I64 = np.ndarray[Any, np.dtype[np.int64]]
I32 = np.ndarray[Any, np.dtype[np.int32]]
U64 = np.ndarray[Any, np.dtype[np.uint64]]
Positions = np.ndarray[Any, Any]  # (rows' positions in a `Stack`: int32 or int64)
NO_ROWS: I32 = np.empty(0, dtype=np.int32)

# The chunks' own coarse grid (0.1°, about 11 km): rows are kept sorted by its cell, so a query
# region reads the slices of the cells it covers instead of every row.
CELL_DEG = 0.1
NX, NY = int(round(360 / CELL_DEG)), int(round(180 / CELL_DEG))
# A region over more rows of cells than this, or a chunk of fewer rows, is read with one
# vectorised test of every row instead (cheaper there than many slices).
MAX_CELL_ROWS = 16
INDEXED_ROWS = 4096
# In the stack of chunks (`TenantRecords.read`), a binary search costs about as much as the
# test of this many rows: a tall region is read by its cell runs while they need fewer
# searches than the test of every row would cost.
ROWS_PER_SEARCH = 30
# The stack's chunks past its cell-major index are searched one by one: they are brought into
# it once this many are of buckets older than the newest (whose chunks still merge as added).
INDEX_AFTER = 4
# (between steps, `TenantRecords.index_chunks`; a query does it once this many times as many
# are left out)
QUERY_INDEXES_AFTER = 4
FEW_RUNS = 4  # up to this many runs of cells are sliced one by one (`Chunk.rows_of_bounds`)
# Chunks of one bucket are merged (`TenantRecords.compact`) while the result stays under this
# many rows: a query's cost is mostly per chunk, and a stream entry's chunk is small.
MERGED_ROWS = 100_000
# As chunks are added, the newest MERGE_FAN of a bucket are merged while the oldest of them is
# no larger than the others together and all hold at most MERGED_ON_ADD_ROWS rows (tiers: a
# bucket of n rows added in entries of s rows is in at most (MERGE_FAN - 1) chunks per tier of
# log_MERGE_FAN(n / s) between the maintenance's merges, and each row is copied once per tier).
MERGE_FAN = 4
MERGED_ON_ADD_ROWS = MERGED_ROWS


# A tenant's vocabulary of more terms than this is made anew once it is older than the window
# (the terms of records gone with it go too; the chunks left list their keywords again).
VOCAB_RENEW_TERMS = 100_000


class Vocabulary:
    """The keywords of one tenant's records as dense ids (for the chunks' `occurrences`): ids
    are given on first sight (a query counts terms with one `np.bincount` over them), and kept
    until the vocabulary is renewed (`RecordWindow.expire`)."""

    def __init__(self, since: float) -> None:
        self.since = since  # when it was made
        self.ids: dict[str, int] = {}
        self.terms: list[str] = []

    def id(self, term: str) -> int:
        got = self.ids.get(term)
        if got is None:
            got = self.ids[term] = len(self.terms)
            self.terms.append(term)
        return got


# a term id's second bit in a signature: ((id * TERM_MUL) >> TERM_SHIFT) & 63
TERM_MUL, TERM_SHIFT = 0x9E3779B1, 16


def term_bits(ids: Any) -> U64:
    """The two bits of each term id in a keywords' signature (`Chunk.signature`): a row
    holds 2-6 of its 64 bits (most rows list three keywords or fewer), so a term it does not
    hold has both of its bits there only now and then, even beside the commonest terms."""
    ids = np.asarray(ids, dtype=np.int64)
    one = np.uint64(1)
    bits: U64 = (np.left_shift(one, (ids & 63).astype(np.uint64))
            | np.left_shift(one, ((ids * TERM_MUL >> TERM_SHIFT) & 63).astype(np.uint64)))
    return bits


def term_mask(term_id: int) -> int:
    """`term_bits` of one id, in Python ints (a query has a term or two: numpy's calls on a
    list that short cost 20 us, twice or more a query)."""
    return 1 << (term_id & 63) | 1 << ((term_id * TERM_MUL >> TERM_SHIFT) & 63)


def _pairs(keys: I64) -> tuple[I32, I32]:
    """(term id, row) pairs packed as term << 32 | row, as two int32 arrays."""
    return (keys >> 32).astype(np.int32), (keys & 0xFFFFFFFF).astype(np.int32)


@dataclass(frozen=True)
class Terms:
    """A query's keyword predicate as signatures (`Chunk.signature`): the bits of each term
    (every term known to the vocabulary), and whether every term must be held. `masks` empty:
    no row can hold the terms (one is unknown, all of them are)."""

    masks: tuple[int, ...]
    match_all: bool

    @staticmethod
    def of(terms: Iterable[str], match_all: bool, vocab: Vocabulary) -> Terms:
        ids = [vocab.ids.get(t) for t in terms]
        known = [i for i in ids if i is not None]
        if not known or (match_all and len(known) < len(ids)):
            return Terms((), match_all)
        bits = [term_mask(i) for i in known]
        return Terms((functools.reduce(operator.or_, bits),) if match_all else tuple(bits),
                     match_all)

    def may_hold(self, sig: U64) -> Bool:
        """Which signatures may be those of rows holding the terms (every one that is, and a
        few more)."""
        out = np.zeros(sig.size, dtype=bool)
        for mask in self.masks:
            bits = np.uint64(mask)
            out |= (sig & bits) == bits
        return out


def cell_range(bbox: tuple[float, float, float, float]) -> tuple[int, int, int, int]:
    """The coarse cells (x0, y0, x1, y1) a bbox covers, inclusive."""
    x0, y0, x1, y1 = bbox
    return (min(NX - 1, max(0, int((x0 + 180) / CELL_DEG))),
            min(NY - 1, max(0, int((y0 + 90) / CELL_DEG))),
            min(NX - 1, max(0, int((x1 + 180) / CELL_DEG))),
            min(NY - 1, max(0, int((y1 + 90) / CELL_DEG))))


def run_bounds(ys: I64, xa: I64, xb: I64) -> I64:
    """The searchsorted bounds of coarse-cell runs (xa[i]..xb[i], ys[i]), inclusive: each
    run's first cell and the cell after its last, interleaved (in order when the runs are,
    which numpy's binary search walks faster; xb + 1 searched from the left ends where xb
    searched from the right does)."""
    bounds = np.empty(2 * ys.size, dtype=np.int64)
    bounds[0::2] = ys * NX + xa
    bounds[1::2] = ys * NX + xb + 1
    return bounds


@dataclass(frozen=True)
class Region:
    """A query's bbox with the bounds of the coarse-cell runs to read in it (`run_bounds`; all
    the cells it covers, or, for a count's border, those outside the whole cells), worked
    out once for every chunk a query reads; `bounds` None: a region over more than
    MAX_CELL_ROWS rows of cells, read with one vectorised test of every row instead (cheaper
    than many slices)."""

    bbox: tuple[float, float, float, float]
    bounds: I64 | None

    @staticmethod
    def of(bbox: tuple[float, float, float, float]) -> Region:
        x0, y0, x1, y1 = cell_range(bbox)
        if y1 - y0 >= MAX_CELL_ROWS:
            return Region(bbox, None)
        return Region(bbox, cell_runs(bbox))


def cell_runs(bbox: tuple[float, float, float, float]) -> I64:
    """The bounds (`run_bounds`) of the runs of coarse cells a bbox covers, a run a row."""
    x0, y0, x1, y1 = cell_range(bbox)
    ys = np.arange(y0, y1 + 1, dtype=np.int64)
    return run_bounds(ys, np.full(ys.size, x0), np.full(ys.size, x1))


@dataclass
class Chunk:
    """Records of one arrival bucket (those of one stream entry, or several merged), with
    numpy columns for the vectorised filters and the batch itself for everything else."""

    bucket: int
    at: F64  # when the api accepted each record
    first_at: float
    last_at: float
    batch: ObjectBatch
    lon: F64
    lat: F64
    ts: F64
    moving: Bool
    order: I64  # the rows sorted by coarse cell
    cells: I64  # the coarse cell of each row in that order
    _last_row: dict[tuple[str, float], int] | None = None
    # (the vocabulary, term ids, rows) of `occurrences`, and its pairs once (`term_rows`)
    _occurrences: tuple[Vocabulary, I32, I32] | None = None
    _term_rows: tuple[I32, I32] | None = None
    _signature: tuple[Vocabulary, U64] | None = None  # (`signature`)

    def rows_in(self, region: Region) -> I64:
        """Rows (indices) including every row inside the region's bbox within its runs of
        cells: those of the runs, or, without runs or in a small chunk, every row inside the
        bbox (the caller tests the rows read)."""
        if region.bounds is None or self.order.size < INDEXED_ROWS:
            return np.flatnonzero(bbox_contains(region.bbox, self.lon, self.lat))
        return self.rows_of_bounds(region.bounds)

    def rows_of_bounds(self, bounds: I64) -> I64:
        """The rows of the coarse-cell runs whose bounds `run_bounds` made (the runs must not
        overlap, or their rows come more than once): one searchsorted for every run's start
        and end; a few runs are sliced, many gathered without a loop."""
        found = np.searchsorted(self.cells, bounds)
        if found.size <= 2 * FEW_RUNS:
            ends = found.tolist()
            slices = [self.order[a:b] for a, b in zip(ends[0::2], ends[1::2], strict=True)
                      if b > a]
            if len(slices) == 1:
                return slices[0]
            return np.concatenate(slices) if slices else np.empty(0, dtype=np.int64)
        starts = found[0::2]
        lens = found[1::2] - starts
        np.maximum(lens, 0, out=lens)  # an empty run (xb < xa)
        return self.order[run_positions(starts, lens)]

    def occurrences(self, vocab: Vocabulary) -> tuple[I32, I32]:
        """Every keyword of every row as (its id in `vocab`, the row), in row order; built on
        first use (one pass over the rows' keywords), again for another vocabulary."""
        held = self._occurrences
        if held is None or held[0] is not vocab:
            # (one pass of C over the terms where it can: the loop per term in Python took
            # twice as long, and the first keyword query lists every chunk)
            keywords = self.batch.keywords
            flat = list(itertools.chain.from_iterable(keywords))
            known = vocab.ids
            ids = list(map(known.get, flat))
            if None in ids:
                for term in dict.fromkeys(flat):  # (new terms: ids in order of first sight)
                    vocab.id(term)
                ids = list(map(known.__getitem__, flat))
            per_row = np.fromiter(map(len, keywords), dtype=np.int64, count=len(keywords))
            held = self._occurrences = (
                vocab, np.array(ids, dtype=np.int32),
                np.repeat(np.arange(len(keywords), dtype=np.int32), per_row))
            self._term_rows = None
        return held[1], held[2]

    def term_rows(self, vocab: Vocabulary) -> tuple[I32, I32]:
        """Every (term id, row) of the chunk once (a row listing a term twice has it once),
        ascending by term id, then row: `occurrences` less the repeats."""
        ids, rows = self.occurrences(vocab)
        held = self._term_rows
        if held is None:
            held = self._term_rows = _pairs(distinct(ids.astype(np.int64) << 32
                                                     | rows.astype(np.int64)))
        return held

    def rows_of_term(self, vocab: Vocabulary, term: str) -> I32 | None:
        """The rows that hold `term`, ascending (None: none do): a search of `term_rows`
        (an inverted index of the chunk without a dict of its terms, which cost a few ms a
        chunk to make)."""
        ids, rows = self.term_rows(vocab)  # (first: the vocabulary then knows its terms)
        term_id = vocab.ids.get(term)
        if term_id is None:
            return None
        # (needles of the index's own dtype: other needles copy the whole index to theirs)
        a, b = np.searchsorted(ids, np.array((term_id, term_id + 1), dtype=ids.dtype)).tolist()
        return rows[a:b] if b > a else None

    def with_keywords(self, terms: frozenset[str], match_all: bool, vocab: Vocabulary) -> Bool:
        """Which rows have every one of `terms` (`match_all`) or any of them (`rows_with`, as
        a mask over the chunk)."""
        held: Bool = np.zeros(self.ts.size, dtype=bool)
        held[self.rows_with(terms, match_all, vocab)] = True
        return held

    def rows_with(self, terms: frozenset[str], match_all: bool, vocab: Vocabulary) -> I32:
        """The rows that hold every one of `terms` (`match_all`) or any of them, ascending:
        from the rows of each term (`rows_of_term`)."""
        found = [self.rows_of_term(vocab, term) for term in terms]
        held = [f for f in found if f is not None]
        if not held or (match_all and len(held) < len(found)):
            return NO_ROWS
        if len(held) == 1:
            return held[0]
        if not match_all:
            return distinct(np.concatenate(held))
        rows = held[0]
        for f in held[1:]:
            rows = np.intersect1d(rows, f, assume_unique=True)
        return rows

    def holds(self, rows: I64, terms: frozenset[str], match_all: bool, vocab: Vocabulary
              ) -> Bool:
        """`with_keywords` of these rows only: each row looked up in each term's rows."""
        out = np.full(rows.size, match_all)
        for term in terms:
            found = self.rows_of_term(vocab, term)
            if found is None:
                has = np.zeros(rows.size, dtype=bool)
            else:
                at = np.minimum(np.searchsorted(found, rows.astype(found.dtype)),
                                found.size - 1)
                has = found[at] == rows
            if match_all:
                out &= has
            else:
                out |= has
        return out

    def signature(self, vocab: Vocabulary) -> U64:
        """Each row's keywords in 64 bits: the `term_bits` of the id in `vocab` of each (a row
        can hold a query's keywords only if it has their bits: a vectorised test that leaves
        the exact one a few rows). Made on first use, again for another vocabulary."""
        held = self._signature
        if held is None or held[0] is not vocab:
            ids, rows = self.occurrences(vocab)
            sig = np.zeros(self.ts.size, dtype=np.uint64)
            np.bitwise_or.at(sig, rows, term_bits(ids))
            held = self._signature = (vocab, sig)
        return held[1]

    def last_row(self) -> dict[tuple[str, float], int]:
        """(moving object id, ts) -> its last row in the chunk (built on first use)."""
        if self._last_row is None:
            b = self.batch
            self._last_row = {(b.ids[i], b.ts[i]): i for i in np.flatnonzero(self.moving).tolist()}
        return self._last_row

    @staticmethod
    def of(batch: ObjectBatch, bucket: int) -> Chunk:
        return Chunk.build(bucket, batch, np.full(len(batch), batch.sent_at, dtype=np.float64))

    @staticmethod
    def build(bucket: int, batch: ObjectBatch, at: F64) -> Chunk:
        lon = np.asarray(batch.lon, dtype=np.float64)
        lat = np.asarray(batch.lat, dtype=np.float64)
        cx = np.clip(((lon + 180) / CELL_DEG).astype(np.int64), 0, NX - 1)
        cy = np.clip(((lat + 90) / CELL_DEG).astype(np.int64), 0, NY - 1)
        cell = cy * NX + cx
        order = np.argsort(cell, kind="stable")
        return Chunk(bucket=bucket, at=at, first_at=float(at.min()), last_at=float(at.max()),
                     batch=batch, lon=lon, lat=lat, ts=np.asarray(batch.ts, dtype=np.float64),
                     moving=np.asarray(batch.moving, dtype=bool), order=order,
                     cells=cell[order])

    @staticmethod
    def merge(chunks: list[Chunk]) -> Chunk:
        """One chunk of consecutive chunks of one bucket, rows in the same order. The columns
        are joined as they are, and the cell order from the chunks' own: a stable sort of
        their sorted cells one after another (runs, which it merges) keeps rows of a cell in
        row order."""
        at = np.concatenate([c.at for c in chunks])
        offsets = np.cumsum([0] + [c.order.size for c in chunks[:-1]])
        cells = np.concatenate([c.cells for c in chunks])
        by_cell = np.argsort(cells, kind="stable")
        order = np.concatenate([c.order + off for c, off in zip(chunks, offsets.tolist(),
                                                                 strict=True)])[by_cell]
        merged = Chunk(bucket=chunks[0].bucket, at=at, first_at=float(at.min()),
                       last_at=float(at.max()),
                       batch=ObjectBatch.concat([c.batch for c in chunks]),
                       lon=np.concatenate([c.lon for c in chunks]),
                       lat=np.concatenate([c.lat for c in chunks]),
                       ts=np.concatenate([c.ts for c in chunks]),
                       moving=np.concatenate([c.moving for c in chunks]), order=order,
                       cells=cells[by_cell])
        # the keywords as the chunks had them listed (a pass over every row's keywords in
        # Python, not made again), when all of them had, for one vocabulary
        held = [c._occurrences for c in chunks]
        vocab = held[0][0] if held[0] is not None else None
        if vocab is not None and all(h is not None and h[0] is vocab for h in held):
            merged._occurrences = (vocab, np.concatenate([h[1] for h in held if h]),
                                   np.concatenate([h[2] + off for h, off in zip(
                                       held, offsets.tolist(), strict=True) if h]))
            sigs = [c._signature for c in chunks]
            if all(g is not None and g[0] is vocab for g in sigs):
                merged._signature = (vocab, np.concatenate([g[1] for g in sigs if g]))
            pairs = [c._term_rows for c in chunks]
            if all(p is not None for p in pairs):
                # each chunk's distinct (term, row) pairs are sorted: a stable sort of them
                # one after another merges runs (making them again from the occurrences
                # sorted all of them: tens of ms for a merged chunk of the window)
                keys = np.concatenate([p[0].astype(np.int64) << 32 | (p[1] + off) for p, off
                                       in zip(pairs, offsets.tolist(), strict=True) if p])
                keys.sort(kind="stable")
                merged._term_rows = _pairs(keys)
        return merged


class BucketCells:
    """One arrival bucket's records per cell of the global grid (CheetahGIS's per-cell counts):
    the cell ids in ascending order and their counts, as the workers write them for the
    readers (`app.pipeline.cellcounts`). Chunks' counts are folded in when next read: a merge
    of their few cells into the sorted arrays, not a sort of every cell of the bucket at each
    write (a bucket of a million records, 3-4 ms)."""

    def __init__(self) -> None:
        self._ids: I64 = np.empty(0, dtype=np.int64)
        self._counts: I64 = np.empty(0, dtype=np.int64)
        self._pending: list[tuple[I64, I64]] = []
        self.total = 0  # records counted

    def add(self, cells: I64, counts: I64) -> None:
        """Count `counts[i]` more records in `cells[i]` (distinct cells, ascending: as
        `np.unique` gives them)."""
        self._pending.append((cells, counts))
        self.total += int(counts.sum())

    def encoded(self) -> tuple[bytes, bytes]:
        """The cell ids and counts as the wire carries them (little-endian int64)."""
        ids, counts = self._folded()
        return ids.astype("<i8", copy=False).tobytes(), counts.astype("<i8", copy=False).tobytes()

    def _folded(self) -> tuple[I64, I64]:
        if self._pending:
            self._fold()
        return self._ids, self._counts

    def get(self, cell: int, default: int = 0) -> int:
        ids, counts = self._folded()
        at = int(np.searchsorted(ids, cell))
        return int(counts[at]) if at < ids.size and ids[at] == cell else default

    def items(self) -> list[tuple[int, int]]:
        ids, counts = self._folded()
        return list(zip(ids.tolist(), counts.tolist(), strict=True))

    def __len__(self) -> int:
        return int(self._folded()[0].size)

    def _fold(self) -> None:
        pending, self._pending = self._pending, []
        if len(pending) == 1:
            new_ids, new_counts = pending[0]
        else:
            joined = np.concatenate([c for c, _ in pending])
            new_ids, inverse = np.unique(joined, return_inverse=True)
            new_counts = np.bincount(inverse, weights=np.concatenate([n for _, n in pending]),
                                     minlength=new_ids.size).astype(np.int64)
        ids = self._ids
        at = np.searchsorted(ids, new_ids)
        known = at < ids.size
        known[known] = ids[at[known]] == new_ids[known]
        fresh = ~known
        if fresh.any():
            ids = self._ids = np.insert(ids, at[fresh], new_ids[fresh])
            counts = self._counts = np.insert(self._counts, at[fresh], new_counts[fresh])
            counts[np.searchsorted(ids, new_ids[known])] += new_counts[known]
        else:
            self._counts[at] += new_counts


# A chunk's position above a coarse cell in `Stack.keys` (NX * NY < 2**23 cells).
CELL_BITS = 23
CELL_MASK = (1 << CELL_BITS) - 1


class Folded:
    """A sorted index of the rows of a stack's first `chunks` chunks: a key of each row (its
    coarse cell), or of each of its keywords (the term id), and the row's position in the
    stack beside it; so that a key's rows in all those chunks are a binary search per run
    away, not one per chunk. Chunks are brought in (`add`) as they settle, as a run of their
    own sorted by key, merged into the run before it while it is at least half its size (a
    log-structured merge: bringing in a few chunks costs a pass over the newest runs, not
    over the whole index, and a row is merged again a few times as the index doubles)."""

    def __init__(self) -> None:
        self.chunks = 0
        self.size = 0
        # runs, oldest first: (keys ascending, positions, the chunks it holds up to)
        self.runs: list[tuple[I32, I32, int]] = []

    def add(self, keys: I32, at: I64, chunks: int) -> None:
        """Bring in the keys of the chunks up to `chunks` (any order; `at`: their positions,
        after any held)."""
        order = np.argsort(keys, kind="stable")  # (a merge of sorted runs, for cells)
        runs = self.runs
        runs.append((keys[order], at[order].astype(np.int32), chunks))
        while len(runs) > 1 and 2 * runs[-1][0].size >= runs[-2][0].size:
            newer = runs.pop()
            runs.append(_merged(runs.pop(), newer))
        self.chunks, self.size = chunks, self.size + keys.size

    def cut(self, chunks: int, used: int) -> None:
        """Keep the first `chunks` chunks (whose rows lie before position `used`)."""
        if chunks >= self.chunks:
            return
        kept = []  # (rare: chunks of older buckets merged again)
        for keys, at, upto in self.runs:
            if upto > chunks:
                keep = at < used
                keys, at, upto = keys[keep], at[keep], chunks
            if keys.size:
                kept.append((keys, at, upto))
        self.runs = kept
        self.chunks, self.size = chunks, sum(keys.size for keys, _, _ in kept)

    def positions(self, bounds: I64) -> Positions:
        """The positions of the keys of runs [bounds[2i], bounds[2i + 1])."""
        bounds = bounds.astype(np.int32)
        found = [at[_runs(np.searchsorted(keys, bounds))] for keys, at, _ in self.runs]
        return _joined(found)


def _joined(found: list[Positions]) -> Positions:
    """Positions found in parts, as one array."""
    if len(found) == 1:
        return found[0]
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


def _merged(older: tuple[I32, I32, int], newer: tuple[I32, I32, int]) -> tuple[I32, I32, int]:
    """Two runs of a `Folded` as one, the newer's rows after the older's equal keys."""
    keys, at, _ = older
    total = keys.size + newer[0].size
    new = np.searchsorted(keys, newer[0], side="right")
    new += np.arange(newer[0].size)
    old = np.ones(total, dtype=bool)
    old[new] = False
    into_keys, into_at = np.empty(total, dtype=np.int32), np.empty(total, dtype=np.int32)
    into_keys[old], into_at[old] = keys, at
    into_keys[new], into_at[new] = newer[0], newer[1]
    return into_keys, into_at, newer[2]


class Stack:
    """The coarse-cell index of a tenant's chunks as one sorted array, so that a query finds
    its cell runs in every chunk with one binary search: `keys` holds (position of the chunk
    << CELL_BITS) | cell for each row of each chunk, chunk after chunk in each one's cell
    order, and `rows` the chunk's row of each key. A window of an hour holds sixty buckets of
    a chunk or more: a search per chunk cost more than all the rest of a small knn query.
    Beside each key are its row's columns (`COLUMNS`), so that the rows found are read with
    one gather each, not one per chunk; and, once a query with keywords asked for them, its
    keywords' `Chunk.signature` (`signatures`), to leave out rows without a query's keywords
    before anything is gathered. Small chunks are stacked too (a worker's share of a bucket
    can be a few thousand records: read row by row, such chunks cost more than the rest).

    It grows at its end as chunks are added (arrays with room to spare: a new chunk's rows
    are copied once), and is cut back to the chunks that are still the window's first ones
    when newer ones were merged. Chunks that leave the window are only marked (`drop_first`):
    their rows are left out of reads until they are the most, then the stack is made anew.
    The chunks of older buckets are in two indexes (`Folded`): their rows' cells, and their
    keywords, so that a region's cell runs, or a keyword's rows, are searched once for all of
    them rather than once per chunk."""

    COLUMNS = ("keys", "rows", "lon", "lat", "ts", "at", "where")

    def __init__(self) -> None:
        # (held: the positions stay theirs while it lives; None: dropped, `drop_first`)
        self.chunks: list[Chunk | None] = []
        # the first `dropped` chunks left the window: their rows, before `live_from`, are
        # left out of every read
        self.dropped = 0
        self.live_from = 0
        self.keys: I64 = np.empty(0, dtype=np.int64)  # the first `used` are in use
        self.rows: I64 = np.empty(0, dtype=np.int64)
        self.lon: F64 = np.empty(0, dtype=np.float64)
        self.lat: F64 = np.empty(0, dtype=np.float64)
        self.ts: F64 = np.empty(0, dtype=np.float64)
        self.at: F64 = np.empty(0, dtype=np.float64)
        # the position of each chunk's row r: where[start of the chunk + r]
        self.where: I64 = np.empty(0, dtype=np.int64)
        # the keywords of the first `listed` chunks' rows under `occ_vocab`, row after row in
        # stack order: the term ids of the row at position p are
        # occ[occ_start[p]:occ_start[p] + occ_len[p]] (`term_counts`); `occ_ends`: the
        # occurrences in use after each chunk
        self.occ: I32 = np.empty(0, dtype=np.int32)
        self.occ_start: I64 = np.empty(0, dtype=np.int64)
        self.occ_len: I64 = np.empty(0, dtype=np.int64)
        self.occ_ends: list[int] = []
        self.occ_vocab: Vocabulary | None = None
        self.used = 0
        self.ends: list[int] = []  # `used` after each chunk
        # the keywords' signatures of the first `signed` chunks' keys, and the vocabulary
        # they were taken with
        self.sig: U64 = np.empty(0, dtype=np.uint64)
        self.signed = 0
        self.sig_vocab: Vocabulary | None = None
        # the cell-major index of the chunks of older buckets (`index_cells`), and their
        # keywords' index under the vocabulary `terms_vocab` (`index_terms`)
        self.cells = Folded()
        self.terms = Folded()
        self.terms_vocab: Vocabulary | None = None

    def truncate(self, n: int) -> None:
        """Keep the first `n` chunks."""
        if n >= len(self.chunks):
            return
        self.used = self.ends[n - 1] if n else 0
        del self.chunks[n:], self.ends[n:]
        self.signed = min(self.signed, n)
        del self.occ_ends[n:]
        self.cells.cut(n, self.used)
        self.terms.cut(n, self.used)

    def drop_first(self) -> None:
        """The first chunk not dropped leaves the window: its rows are left out of reads from
        now on (they stay in the arrays and indexes until the stack is made anew: dropping a
        chunk costs nothing, making the stack and its indexes again a pass over them all)."""
        self.chunks[self.dropped] = None
        self.dropped += 1
        self.live_from = self.ends[self.dropped - 1]

    def stale(self) -> bool:
        """Whether the rows dropped are more than those left (time to make it anew)."""
        return 2 * self.live_from > self.used

    def live(self, at: Positions) -> Positions:
        """These positions less those of rows dropped."""
        return at[at >= self.live_from] if self.live_from else at

    def positions_of(self, i: int, rows: I32 | I64) -> I64:
        """The positions of these rows of the `i`-th chunk."""
        chunk = self.chunks[i]
        assert chunk is not None
        return self.where[self.ends[i] - chunk.order.size + rows]

    def index_cells(self, upto: int) -> None:
        """Bring the first `upto` chunks into the cell-major index."""
        if upto > self.cells.chunks:
            a, b = self.cells.size, self.ends[upto - 1]
            self.cells.add((self.keys[a:b] & CELL_MASK).astype(np.int32),
                           np.arange(a, b, dtype=np.int64), upto)

    def index_terms(self, upto: int, vocab: Vocabulary) -> None:
        """Bring the first `upto` chunks into the keywords' index (their `Chunk.term_rows`
        under `vocab`; all of them again under another)."""
        if self.terms_vocab is not vocab:
            self.terms, self.terms_vocab = Folded(), vocab
        if upto <= self.terms.chunks:
            return
        ids, at = [np.empty(0, dtype=np.int32)], [np.empty(0, dtype=np.int64)]
        for i in range(self.terms.chunks, upto):
            chunk = self.chunks[i]
            if chunk is not None:
                term_ids, rows = chunk.term_rows(vocab)
                ids.append(term_ids)
                at.append(self.positions_of(i, rows))
        self.terms.add(np.concatenate(ids), np.concatenate(at), upto)

    def extend(self, chunks: Iterable[Chunk]) -> None:
        """Stack these chunks after the ones held."""
        first = len(self.chunks)
        added = list(chunks)
        if not added:
            return
        self.chunks.extend(added)
        used = self.used + sum(c.order.size for c in added)
        if used > self.keys.size:
            room = max(used, 2 * self.keys.size)
            for name in self.COLUMNS:
                old = getattr(self, name)
                grown = np.empty(room, dtype=old.dtype)
                grown[:self.used] = old[:self.used]
                setattr(self, name, grown)
        a = self.used
        for i, chunk in enumerate(added, first):
            b = a + chunk.order.size
            order = chunk.order
            self.keys[a:b] = (i << CELL_BITS) | chunk.cells
            self.rows[a:b] = order
            self.lon[a:b] = chunk.lon[order]
            self.lat[a:b] = chunk.lat[order]
            self.ts[a:b] = chunk.ts[order]
            self.at[a:b] = chunk.at[order]
            self.where[a + order] = np.arange(a, b)
            self.ends.append(b)
            a = b
        self.used = used

    def signatures(self, vocab: Vocabulary) -> U64:
        """The keywords' signature of every key (`Chunk.signature`), taken for the chunks
        not yet signed (all of them again under another vocabulary)."""
        if self.sig_vocab is not vocab:
            self.sig_vocab, self.signed = vocab, 0
        if self.sig.size < self.keys.size:
            kept = self.ends[self.signed - 1] if self.signed else 0
            grown = np.empty(self.keys.size, dtype=np.uint64)
            grown[:kept] = self.sig[:kept]
            self.sig = grown
        for i in range(self.signed, len(self.chunks)):
            chunk = self.chunks[i]
            if chunk is not None:
                b = self.ends[i]
                self.sig[b - chunk.order.size:b] = chunk.signature(vocab)[chunk.order]
        self.signed = len(self.chunks)
        return self.sig

    def term_counts(self, at: Positions, vocab: Vocabulary) -> I64:
        """How many times each term id of `vocab` occurs among the keywords of the rows at
        these positions: a gather of theirs alone, from the chunks' `occurrences` laid out
        in stack order (listed for the chunks not yet listed, all of them again under
        another vocabulary)."""
        if self.occ_vocab is not vocab:
            self.occ_vocab, self.occ_ends = vocab, []
        if self.occ_start.size < self.keys.size:  # (made once a query asks: grown as the keys)
            kept = self.ends[len(self.occ_ends) - 1] if self.occ_ends else 0
            for name in ("occ_start", "occ_len"):
                column = np.empty(self.keys.size, dtype=np.int64)
                column[:kept] = getattr(self, name)[:kept]
                setattr(self, name, column)
        for i in range(len(self.occ_ends), len(self.chunks)):
            chunk = self.chunks[i]
            used = self.occ_ends[-1] if self.occ_ends else 0
            if chunk is None:  # (its rows are never read)
                self.occ_ends.append(used)
                continue
            b = self.ends[i]
            a = b - chunk.order.size
            ids, rows = chunk.occurrences(vocab)
            at_of = self.positions_of(i, rows)  # (each occurrence's position)
            order = np.argsort(at_of, kind="stable")
            lens = np.bincount(at_of - a, minlength=b - a)
            self.occ_len[a:b] = lens
            self.occ_start[a:b] = used + np.cumsum(lens) - lens
            if self.occ.size < used + ids.size:
                room = np.empty(max(used + ids.size, 2 * self.occ.size), dtype=np.int32)
                room[:used] = self.occ[:used]
                self.occ = room
            self.occ[used:used + ids.size] = ids[order]
            self.occ_ends.append(used + ids.size)
        ids = self.occ[run_positions(self.occ_start[at], self.occ_len[at])]
        return np.bincount(ids, minlength=len(vocab.terms))

    def positions(self, bounds: I64) -> Positions:
        """The positions in the stack of the rows of every chunk in the coarse-cell runs
        whose bounds `run_bounds` made: those of the indexed chunks from one search of the
        cell-major index (in cell order), then those of each chunk after them, chunk after
        chunk."""
        found: list[Positions] = []
        if self.cells.chunks:
            found.append(self.cells.positions(bounds))
        n, first = len(self.chunks), self.cells.chunks
        if n > first:
            chunks = np.arange(first, n, dtype=np.int64) << CELL_BITS
            found.append(_runs(np.searchsorted(self.keys[:self.used],
                                               (chunks[:, None] | bounds).ravel())))
        return _joined(found)

    def positions_with(self, terms: frozenset[str], match_all: bool, vocab: Vocabulary
                       ) -> Positions:
        """The positions of the rows of every chunk that hold every one of `terms`
        (`match_all`) or any of them (`Chunk.rows_with`): those of the chunks in the
        keywords' index from a search of it per term, then those of each chunk after them (a
        tall region with a rare keyword reads them: a lookup in each of a hundred chunks or
        more cost more than the rest)."""
        found: list[Positions] = []
        if self.terms.chunks and self.terms_vocab is vocab:
            ids = [vocab.ids.get(term) for term in terms]
            each = [self.terms.positions(np.array([i, i + 1])) for i in ids if i is not None]
            if match_all:
                if len(each) == len(ids):
                    held = each[0]
                    for more in each[1:]:
                        # (a term's positions are distinct: each chunk's pairs are)
                        held = np.intersect1d(held, more, assume_unique=True)
                    found.append(held)
            elif len(each) == 1:
                found.append(each[0])
            elif each:
                found.append(distinct(np.concatenate(each)))
            first = self.terms.chunks
        else:
            first = 0
        for i in range(first, len(self.chunks)):
            chunk = self.chunks[i]
            if chunk is not None:
                rows = chunk.rows_with(terms, match_all, vocab)
                if rows.size:
                    found.append(self.positions_of(i, rows))
        return _joined(found)

    def searches(self, runs: int) -> int:
        """How many binary searches `positions` makes for this many runs of cells."""
        return 2 * runs * (int(self.cells.chunks > 0) + len(self.chunks) - self.cells.chunks)


def _runs(ends: I64) -> I64:
    """The positions of runs from searchsorted's interleaved (start, end) of each."""
    starts = ends[0::2]
    lens = ends[1::2] - starts
    np.maximum(lens, 0, out=lens)  # an empty run (xb < xa)
    return run_positions(starts.astype(np.int64), lens.astype(np.int64))


class Flat(NamedTuple):
    """Rows of a tenant's chunks read for a query, in one array per column: row `row[j]` of
    chunk `chunks[which[j]]`, at (`lon[j]`, `lat[j]`), of time `ts[j]`, accepted at `at[j]`,
    and when read from the stack, at position `pos[j]` in it; in no particular order
    (`by_chunk` puts them in chunk order)."""

    chunks: list[Chunk]
    which: I64
    row: I64
    lon: F64
    lat: F64
    ts: F64
    at: F64
    pos: Positions | None = None

    def __len__(self) -> int:
        return int(self.row.size)

    def take(self, keep: Any) -> Flat:
        """These rows less those `keep` (a mask or positions) leaves out."""
        return Flat(self.chunks, self.which[keep], self.row[keep], self.lon[keep],
                    self.lat[keep], self.ts[keep], self.at[keep],
                    None if self.pos is None else self.pos[keep])

    def by_chunk(self) -> Flat:
        """These rows chunk after chunk in chunk order (in the order they are here within a
        chunk)."""
        which = self.which
        if which.size < 2 or bool((which[1:] >= which[:-1]).all()):
            return self
        return self.take(np.argsort(which, kind="stable"))

    def groups(self) -> Iterator[tuple[Chunk, I64]]:
        """Each chunk with rows here and its rows, in chunk order (that of `by_chunk`)."""
        flat = self.by_chunk()
        which = flat.which
        if not which.size:
            return
        cuts = (np.flatnonzero(which[1:] != which[:-1]) + 1).tolist()
        for a, b in zip([0, *cuts], [*cuts, which.size], strict=True):
            yield self.chunks[int(which[a])], flat.row[a:b]

    @staticmethod
    def of_rows(chunks: list[Chunk], found: list[tuple[int, I64 | I32]]) -> Flat:
        """The rows `found` of chunks by position (in position order), columns gathered."""
        found = [(i, rows) for i, rows in found if rows.size]
        if not found:
            e = np.empty(0, dtype=np.float64)
            return Flat(chunks, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64),
                        e, e, e, e)
        which = np.repeat(np.asarray([i for i, _ in found], dtype=np.int64),
                          [rows.size for _, rows in found])
        row = np.concatenate([rows for _, rows in found])
        lon, lat, ts, at = (np.concatenate([getattr(chunks[i], name)[rows] for i, rows in found])
                            for name in ("lon", "lat", "ts", "at"))
        return Flat(chunks, which, row, lon, lat, ts, at)


@dataclass
class TenantRecords:
    """One tenant's records on this worker, oldest chunk first, and per moving object the
    (ts, arrival, bucket) of each of its records here, in arrival order (for `latest`)."""

    chunks: deque[Chunk] = field(default_factory=deque)
    by_object: dict[str, deque[tuple[float, float, int]]] = field(default_factory=dict)
    size: int = 0
    floor: int = NO_CUT  # a view's: records of buckets up to it are left out (`after`)
    # bucket -> its records per global grid cell (CheetahGIS's per-cell counts)
    cell_counts: dict[int, BucketCells] = field(default_factory=dict)
    # (shared by the views of `after`)
    vocab: Vocabulary = field(default_factory=lambda: Vocabulary(time.time()))
    # the chunks' index for queries (`rows_in`), brought up to date by each query;
    # `_stacked`: how many of the first chunks are still those it holds
    _stack: Stack | None = field(default=None, repr=False, compare=False)
    _stacked: int = field(default=0, repr=False, compare=False)
    _oldest: int | None = field(default=None, repr=False, compare=False)  # (`oldest_bucket`)
    # whether a query asked about keywords here, and the first chunks whose keywords are
    # listed under `vocab` since (`index_keywords`)
    keywords_asked: bool = field(default=False, repr=False, compare=False)
    _keywords_listed: int = field(default=0, repr=False, compare=False)

    def read(self, region: Region, as_of: float,
             keywords: tuple[frozenset[str], bool] | None = None) -> Flat:
        """`Chunk.rows_in` of every chunk, as one `Flat` of the rows that arrived by `as_of`;
        with `keywords` (terms, match_all), only those whose keywords' signature may hold
        them (tested before anything is gathered). Those of the stacked chunks come from one
        search of the stack (`Stack`); for a region too tall for `Region.of`'s runs, from its
        runs all the same while they need fewer searches than ROWS_PER_SEARCH allows, else
        from one test of every row of the stack; and with keywords there, exactly the rows
        of the keywords in every chunk (`Stack.positions_with`: a tall region is a knn's last
        rounds, for a rare keyword: in a few chunks, a few rows; or a keyword anywhere).
        A view of `after` (made for one query) reads chunk by chunk: a stack of its own
        would cost it more than it saves."""
        self.keywords_asked = self.keywords_asked or keywords is not None
        if keywords is not None and region.bounds is None and self.floor != NO_CUT:
            chunks = list(self.chunks)
            flat = Flat.of_rows(chunks, [(i, c.rows_with(*keywords, self.vocab))
                                         for i, c in enumerate(chunks) if c.first_at <= as_of])
            flat = flat.take(bbox_contains(region.bbox, flat.lon, flat.lat))
        elif self.floor != NO_CUT:  # chunk by chunk
            chunks = list(self.chunks)
            terms = None
            if keywords is not None:
                for c in chunks:  # (the vocabulary knows the terms of the chunks signed)
                    c.signature(self.vocab)
                terms = Terms.of(*keywords, self.vocab)
            flat = Flat.of_rows(chunks, [(i, self._rows_of(c, region, terms))
                                         for i, c in enumerate(chunks) if c.first_at <= as_of])
        else:
            return self.read_at(self._positions(self._stacked_chunks(in_query=True), region,
                                                keywords), as_of)
        if flat.at.size and float(flat.at.max()) > as_of:
            flat = flat.take(flat.at <= as_of)
        return flat

    def _positions(self, stack: Stack, region: Region,
                   keywords: tuple[frozenset[str], bool] | None) -> Positions:
        """The positions in the stack of the rows `read` reads."""
        bounds = region.bounds
        if bounds is None and keywords is not None:
            # a tall region with keywords: the rows of the keywords in every chunk
            at = stack.live(stack.positions_with(*keywords, self.vocab))
            return at[bbox_contains(region.bbox, stack.lon[at], stack.lat[at])]
        if bounds is None:
            # a tall region: its cell runs searched, or, when there would be more searches
            # than that pays for, every row tested
            x0, y0, x1, y1 = cell_range(region.bbox)
            a, b = stack.live_from, stack.used
            if stack.searches(y1 - y0 + 1) * ROWS_PER_SEARCH >= b - a:
                return a + np.flatnonzero(bbox_contains(region.bbox, stack.lon[a:b],
                                                        stack.lat[a:b]))
            bounds = cell_runs(region.bbox)
        at = stack.live(stack.positions(bounds))
        if keywords is not None:
            sig = stack.signatures(self.vocab)  # (first: the vocabulary then knows the terms)
            at = at[Terms.of(*keywords, self.vocab).may_hold(sig[at])]
        return at

    def _stacked_chunks(self, in_query: bool) -> Stack:
        """The stack brought up to date with the chunks, and its indexes (`Folded`) with
        those before the newest bucket's once INDEX_AFTER of them are not in one (in a
        query, QUERY_INDEXES_AFTER times as many); the keywords' index only once a query
        asked about keywords, and between steps only with chunks whose keywords are listed
        (`index_keywords`: in a query, the chunks left are listed on the way)."""
        stack = self._stack
        if stack is None:
            stack = self._stack = Stack()
        dropped = stack.dropped  # (chunk i is the stack's chunk dropped + i)
        stack.truncate(dropped + self._stacked)
        if dropped + len(self.chunks) > len(stack.chunks):
            stack.extend(itertools.islice(self.chunks, len(stack.chunks) - dropped, None))
        self._stacked = len(self.chunks)
        settled = len(self.chunks)  # the chunks before those of the newest bucket
        while settled and self.chunks[settled - 1].bucket == self.chunks[-1].bucket:
            settled -= 1
        settled += dropped
        index_after = INDEX_AFTER * (QUERY_INDEXES_AFTER if in_query else 1)
        if settled - stack.cells.chunks >= index_after:
            stack.index_cells(settled)
        if self.keywords_asked:
            upto = settled if in_query else min(settled, dropped + self._keywords_listed)
            if upto - stack.terms.chunks >= index_after or stack.terms_vocab is not self.vocab:
                stack.index_terms(upto, self.vocab)
        return stack

    def keyword_positions(self, terms: frozenset[str], match_all: bool) -> Positions | None:
        """The positions in the stack of the rows left in the window that hold the keywords
        (every one of them with `match_all`, else any: `Stack.positions_with`, exact), for
        `read_at`; None for a view of `after` (it has no stack) or without terms."""
        if self.floor != NO_CUT or not terms:
            return None
        self.keywords_asked = True  # (the stack's keywords' index is kept from now on)
        stack = self._stacked_chunks(in_query=True)
        return stack.live(stack.positions_with(terms, match_all, self.vocab))

    def arrived_by(self, at: Positions, as_of: float) -> Positions:
        """These positions of the stack less those of rows that arrived after `as_of`."""
        assert self._stack is not None  # (brought up to date by what found the positions)
        arrived = self._stack.at[at]
        return at if not arrived.size or float(arrived.max()) <= as_of else at[arrived <= as_of]

    def points_at(self, at: Positions) -> tuple[F64, F64]:
        """The (lon, lat) of the rows at these positions of the stack."""
        assert self._stack is not None
        return self._stack.lon[at], self._stack.lat[at]

    def read_at(self, at: Positions, as_of: float) -> Flat:
        """The rows at these positions of the stack (`keyword_positions`, `_positions`) that
        arrived by `as_of`."""
        stack = self._stack  # (brought up to date by what found the positions)
        assert stack is not None
        chunks = cast(list[Chunk], stack.chunks)  # (no row of a dropped one is read)
        flat = Flat(chunks, stack.keys[at] >> CELL_BITS, stack.rows[at], stack.lon[at],
                    stack.lat[at], stack.ts[at], stack.at[at], at)
        if flat.at.size and float(flat.at.max()) > as_of:
            flat = flat.take(flat.at <= as_of)
        return flat

    def index_chunks(self) -> None:
        """Bring the chunks of older buckets into the stack's indexes (once INDEX_AFTER are
        not in one), between steps rather than in a query (a merge into an index costs a
        pass over it). Only once a query made the stack: a tenant nobody asks about costs no
        index."""
        if self._stack is not None and self.floor == NO_CUT:
            self._stacked_chunks(in_query=False)

    def _rows_of(self, chunk: Chunk, region: Region, terms: Terms | None) -> I64:
        rows = chunk.rows_in(region)
        return rows if terms is None else rows[terms.may_hold(chunk.signature(self.vocab)[rows])]

    def index_keywords(self, deadline: float) -> bool:
        """List the keywords of the chunks not yet listed under the vocabulary (their
        `signature`, and so their `occurrences`, and their `term_rows`, which merges then
        keep) until `deadline` (`time.monotonic`); True once every chunk is. Only once a
        query asked about keywords (`keywords_asked`): a tenant that never does costs no
        pass over its records' keywords."""
        if not self.keywords_asked:
            return True
        for i in range(self._keywords_listed, len(self.chunks)):
            if time.monotonic() > deadline:
                return False
            self.chunks[i].signature(self.vocab)
            self.chunks[i].term_rows(self.vocab)
            self._keywords_listed = i + 1
        return True

    def renew_vocabulary(self, now: float) -> None:
        """A new vocabulary: the terms of records gone go with the old one (the chunks list
        their keywords again, as queries or `index_keywords` need them)."""
        self.vocab = Vocabulary(now)
        self._keywords_listed = 0

    def oldest_bucket(self) -> int | None:
        """The oldest bucket of the chunks (None without chunks)."""
        if self._oldest is None and self.chunks:
            self._oldest = min(c.bucket for c in self.chunks)
        return self._oldest

    def _changed(self, first: int) -> None:
        """Chunks from position `first` on are not those the stack was made of any more (from
        the first: the stack goes, and the chunks it held with it)."""
        self._stacked = min(self._stacked, first)
        self._keywords_listed = min(self._keywords_listed, first)
        self._oldest = None
        if first == 0:
            self._stack = None

    def term_counts_at(self, at: Positions) -> dict[str, int]:
        """How many times each keyword occurs in the rows at these positions of the stack
        (`Stack.term_counts`: a pass over those rows' keywords, not over every chunk's)."""
        self.keywords_asked = True
        assert self._stack is not None
        return self._terms_of(self._stack.term_counts(at, self.vocab))

    def _terms_of(self, counts: I64) -> dict[str, int]:
        seen = np.flatnonzero(counts)
        terms = self.vocab.terms
        return {terms[i]: n for i, n in zip(seen.tolist(), counts[seen].tolist(), strict=True)}

    def term_counts(self, selected: list[tuple[Chunk, I64]]) -> dict[str, int]:
        """How many times each keyword occurs in the rows selected of each chunk: one count
        over the chunks' `occurrences` of those rows."""
        self.keywords_asked = True
        parts = []
        for chunk, rows in selected:
            if not rows.size:
                continue
            ids, at = chunk.occurrences(self.vocab)
            if rows.size == chunk.ts.size:  # every row (rows are distinct)
                parts.append(ids)
            else:
                mask = np.zeros(chunk.ts.size, dtype=bool)
                mask[rows] = True
                parts.append(ids[mask[at]])
        if not parts:
            return {}
        return self._terms_of(np.bincount(np.concatenate(parts),
                                          minlength=len(self.vocab.terms)))

    def count_cells(self, chunk: Chunk, grid: Grid) -> None:
        cx, cy = grid.cells_of(chunk.lon, chunk.lat)
        cells, counts = np.unique(grid.cell_id(cx.astype(np.int64), cy.astype(np.int64)),
                                  return_counts=True)
        self.cell_counts.setdefault(chunk.bucket, BucketCells()).add(cells, counts)

    def add(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)
        self._oldest = None
        self.size += len(chunk.batch)
        for i in np.flatnonzero(chunk.moving).tolist():
            oid = chunk.batch.ids[i]
            seen = self.by_object.get(oid)
            if seen is None:
                seen = self.by_object[oid] = deque()
            seen.append((chunk.batch.ts[i], float(chunk.at[i]), chunk.bucket))
        self._merge_newest()

    def _merge_newest(self) -> None:
        """Merge the newest MERGE_FAN chunks while they are of one bucket, the oldest of them
        is no larger than the others together, and all stay within MERGED_ON_ADD_ROWS (see
        there): a query reads a few chunks per bucket, not one per stream entry, while
        entries keep arriving."""
        chunks = self.chunks
        while len(chunks) >= MERGE_FAN:
            newest = [chunks[-i] for i in range(MERGE_FAN, 0, -1)]
            sizes = [c.order.size for c in newest]
            if (any(c.bucket != newest[0].bucket for c in newest)
                    or 2 * sizes[0] > sum(sizes) or sum(sizes) > MERGED_ON_ADD_ROWS):
                return
            for _ in range(MERGE_FAN):
                chunks.pop()
            self._changed(len(chunks))
            chunks.append(Chunk.merge(newest))

    def compact(self, settled_only: bool = False) -> None:
        """Merge runs of consecutive chunks of one bucket into chunks of up to MERGED_ROWS
        rows (row order, and so the arrival order `by_object` relies on, is kept).
        `settled_only`: not the newest bucket's, which still grows (`_merge_newest` keeps its
        chunks few): merged by the maintenance every 5 s, its rows were copied again each
        time, a pause of 9-21 ms in a worker's step under the kNN benchmark's load."""
        merged: deque[Chunk] = deque()
        run: list[Chunk] = []
        rows = 0
        newest = self.chunks[-1].bucket if self.chunks and settled_only else None

        first = len(self.chunks)  # the first position whose chunk changes

        def flush() -> None:
            nonlocal first
            if len(run) > 1 and run[0].bucket != newest:
                first = min(first, len(merged))
                merged.append(Chunk.merge(run))
            else:
                merged.extend(run)

        for chunk in self.chunks:
            n = len(chunk.batch)
            if run and (chunk.bucket != run[0].bucket or rows + n > MERGED_ROWS):
                flush()
                run, rows = [], 0
            run.append(chunk)
            rows += n
        flush()
        self.chunks = merged
        self._changed(first)

    def after(self, bucket: int) -> TenantRecords:
        """These records without the chunks of buckets up to `bucket` (a view for one query:
        the chunks are shared)."""
        oldest = self.oldest_bucket()
        if oldest is None or oldest > bucket:
            return self
        return replace(self, chunks=deque(c for c in self.chunks if c.bucket > bucket),
                       _stack=None, _stacked=0, _oldest=None, floor=bucket)

    def expire(self, horizon: int, through: int) -> None:
        """Forget the counts of buckets before `horizon`, and drop the oldest chunks while
        their bucket is at most `through` (archived)."""
        for bucket in [b for b in self.cell_counts if b < horizon]:
            del self.cell_counts[bucket]
        while self.chunks and self.chunks[0].bucket <= through:
            stack = self._stack
            if stack is not None and self._stacked:
                # (the stack keeps its rows, left out of reads, until they are the most)
                stack.drop_first()
                self._stacked -= 1
                if stack.stale():
                    self._stack, self._stacked = None, 0
            else:
                self._stack, self._stacked = None, 0
            self._keywords_listed = max(0, self._keywords_listed - 1)
            self._oldest = None
            chunk = self.chunks.popleft()
            self.size -= len(chunk.batch)
            for i in np.flatnonzero(chunk.moving).tolist():
                oid = chunk.batch.ids[i]
                seen = self.by_object[oid]
                seen.popleft()  # arrival order: this chunk's record is the oldest left
                if not seen:
                    del self.by_object[oid]

    def latest_ts(self, oid: str, t_from: float | None, t_to: float | None,
                  as_of: float) -> tuple[float, float] | None:
        """The greatest (ts, arrival) of the object's records here (in buckets after
        `floor`) with t_from <= ts <= t_to that arrived by `as_of`, or None."""
        after = self.floor
        best: tuple[float, float] | None = None
        for ts, at, bucket in self.by_object.get(oid, ()):
            if at > as_of or bucket <= after or (t_from is not None and ts < t_from) or (
                    t_to is not None and ts > t_to):
                continue
            if best is None or (ts, at) > best:
                best = (ts, at)
        return best


# Records added and not stored yet, at most (`RecordWindow.add`): enough to store tens of
# steps' records together, few enough that storing them (about 3 us a record) is not a pause of
# its own (20 000 held a worker's step 5-13 ms at every counts report under load).
PENDING_ROWS = 1024


class RecordWindow:
    """Every tenant's records on this worker; with `grid`, also their number per bucket and
    cell of that grid (the counts the api answers whole cells of a count query from)."""

    def __init__(self, window_s: float, bucket_s: float, grid: Grid | None = None) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.grid = grid
        self._tenants: dict[str, TenantRecords] = {}
        # (tenant, bucket) whose counts changed since `changed` was last emptied
        self._changed: set[tuple[str, int]] = set()
        # batches added and not stored yet (`add`), with their buckets
        self._pending: list[tuple[ObjectBatch, int]] = []
        self._pending_rows = 0

    @property
    def tenants(self) -> dict[str, TenantRecords]:
        """Every tenant's records, every batch added so far stored."""
        self.store_pending()
        return self._tenants

    @property
    def changed(self) -> set[tuple[str, int]]:
        """(tenant, bucket) whose counts changed since this was last emptied."""
        self.store_pending()
        return self._changed

    @changed.setter
    def changed(self, value: set[tuple[str, int]]) -> None:
        self._changed = value

    def has_changes(self) -> bool:
        """Whether `changed` is not empty, without storing what waits."""
        return bool(self._changed or self._pending)

    def __len__(self) -> int:
        return sum(t.size for t in self.tenants.values())

    def horizon(self, now: float) -> int:
        """The oldest bucket still in the window."""
        return int((now - self.window_s) // self.bucket_s)

    def bucket_of(self, batch: ObjectBatch, cut: int) -> int:
        """The bucket a batch's records are kept in: that of their arrival, or the first one
        after the archive cut if that one is archived already (a late entry, a backlog): a
        record joins no bucket whose file is written (`app.archive.layout`)."""
        return max(int(batch.sent_at // self.bucket_s), cut + 1)

    def add(self, batch: ObjectBatch, bucket: int) -> None:
        """Add a batch of records (exit-only copies removed by the caller) to `bucket`. It is
        stored when anything reads the records or their counts, or once PENDING_ROWS wait:
        a worker's step adds a few tens of records, and storing each step's alone (a chunk,
        its cells counted) cost about as many numpy calls as storing a thousand steps'."""
        if not len(batch):
            return
        self._pending.append((batch, bucket))
        self._pending_rows += len(batch)
        if self._pending_rows >= PENDING_ROWS:
            self.store_pending()

    def store_pending(self) -> None:
        """Store the batches `add` left waiting, in their order: each run of one tenant and
        bucket as one chunk (each record's arrival time is its own batch's)."""
        if not self._pending:
            return
        pending, self._pending, self._pending_rows = self._pending, [], 0
        run = [pending[0]]
        for item in pending[1:]:
            if item[0].tenant == run[0][0].tenant and item[1] == run[0][1]:
                run.append(item)
            else:
                self._store(run)
                run = [item]
        self._store(run)

    def _store(self, run: list[tuple[ObjectBatch, int]]) -> None:
        batches = [b for b, _ in run]
        batch, bucket = ObjectBatch.concat(batches), run[0][1]
        at = np.repeat(np.asarray([b.sent_at for b in batches], dtype=np.float64),
                       [len(b) for b in batches])
        chunk = Chunk.build(bucket, batch, at)
        records = self._tenants.get(batch.tenant)
        if records is None:
            records = self._tenants[batch.tenant] = TenantRecords()
        records.add(chunk)
        if self.grid is not None:
            records.count_cells(chunk, self.grid)
            self._changed.add((batch.tenant, chunk.bucket))

    def expire(self, now: float, through: int, settled_only: bool = False) -> None:
        """Forget the counts of buckets that left the window, drop the records of buckets up
        to `through` (archived: the oldest chunks while theirs is), and merge small chunks
        (`settled_only`: not those of a tenant's newest bucket, `TenantRecords.compact`)."""
        horizon = self.horizon(now)
        for tenant, records in self.tenants.items():
            self._changed.update((tenant, b) for b in records.cell_counts if b < horizon)
            records.expire(horizon, through)
            records.compact(settled_only)
            vocab = records.vocab
            if len(vocab.terms) > VOCAB_RENEW_TERMS and now - vocab.since > self.window_s:
                records.renew_vocabulary(now)
        for tenant in [t for t, r in self.tenants.items() if not r.size]:
            del self.tenants[tenant]

    def index_keywords(self, deadline: float) -> None:
        """`TenantRecords.index_keywords` of every tenant, until `deadline` (of the records
        stored: those waiting are indexed once stored)."""
        for records in self._tenants.values():
            if not records.index_keywords(deadline):
                return

    def index_chunks(self) -> None:
        """`TenantRecords.index_chunks` of every tenant (stored)."""
        for records in self._tenants.values():
            records.index_chunks()

    def buckets(self) -> set[int]:
        """The buckets of the records held."""
        return {c.bucket for t in self.tenants.values() for c in t.chunks}

    def bucket_batches(self, bucket: int) -> dict[str, list[tuple[ObjectBatch, F64]]]:
        """Per tenant, the batches of one bucket with their records' arrival times."""
        out: dict[str, list[tuple[ObjectBatch, F64]]] = {}
        for tenant, records in self.tenants.items():
            held = [(c.batch, c.at) for c in records.chunks if c.bucket == bucket]
            if held:
                out[tenant] = held
        return out


def records_of(batch: ObjectBatch) -> ObjectBatch | None:
    """The rows of an entry that are records to keep (not exit-only copies), or None."""
    if not any(batch.exit_only):
        return batch
    rows = [i for i, x in enumerate(batch.exit_only) if not x]
    return batch.take(rows) if rows else None
